"""A recipe's command line, shared by `fntrain run`, `plan` and `config` (and `python -m recipes.X`):
the RECIPE argument, `--config FILE`s seeding the recipe's defaults, and tyro's flags over them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any

from fntrain.cli.config_file import CONFIG_HELP, load_config, split_config_args
from fntrain.cli.errors import CommandError, UsageError
from fntrain.cli.parse import parse
from fntrain.cli.recipes import Recipe, available_recipes
from fntrain.cli.usage import HELP, command_help

__all__ = [
    "split_recipe",
    "split_config",
    "load_defaults",
    "describe",
    "resolve_config",
    "parse_recipe_command",
    "command_with_options",
]


def split_recipe(command: str, args: list[str]) -> tuple[str, list[str]]:
    """(RECIPE, the rest of the arguments); a `UsageError` when no recipe is named; `--help` before a
    recipe prints the command's usage and the recipes (exit status 0)."""
    if not args or args[0].startswith("-"):
        if args and args[0] in HELP:
            print(command_help(command), end="")
            raise SystemExit(0)
        names = ", ".join(available_recipes())
        raise UsageError(
            f"missing RECIPE (one of: {names + ', ' if names else ''}or a path to a recipe .py file)"
        )
    return args[0], args[1:]


def resolve_config(recipe: Recipe, args: Sequence[str], *, prog: str | None = None) -> Any:
    """The recipe's config from `--config FILE`s (seeding the defaults) and CLI overrides (tyro); a
    rejected flag is one `CommandError` line, `--help` the short help, `--help-all` every flag."""
    paths, rest = split_config(args)
    default = load_defaults(recipe, paths)
    return parse_recipe_command(recipe, recipe.config_cls, rest, prog=prog or recipe.name, default=default)


def parse_recipe_command(
    recipe: Recipe, cls: type, args: Sequence[str], *, prog: str, default: Any = None
) -> Any:
    """`cls` (the recipe's config, or a command's dataclass around it) parsed from `args` by
    `fntrain.cli.parse.parse`, with the recipe's description and short help."""
    from fntrain.cli.short_help import short_help

    return parse(cls, args, prog=prog, description=describe(recipe), default=default,
                 short_help=lambda: short_help(cls, default, prog=prog, about=_first_paragraph(recipe)))  # fmt: skip


def split_config(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the `--config` files, the other arguments); a malformed `--config` is a `UsageError`."""
    try:
        return split_config_args(args)
    except ValueError as error:
        raise UsageError(str(error)) from error


def load_defaults(recipe: Recipe, paths: Sequence[str]) -> Any:
    """The recipe's defaults seeded by the config files; a bad file is a `CommandError`."""
    try:
        return load_config(recipe.config_cls, *paths)
    except (OSError, TypeError, ValueError) as error:
        raise CommandError(str(error)) from error


def describe(recipe: Recipe) -> str:
    """The recipe's `--help-all` text: the first paragraph of its docstring and how `--config` works."""
    return f"{_first_paragraph(recipe)}\n\n{CONFIG_HELP}"


def _first_paragraph(recipe: Recipe) -> str:
    return recipe.description.split("\n\n", 1)[0] if recipe.description else f"The {recipe.name} recipe."


def command_with_options(
    recipe: Recipe, default_config: Any, options: list[tuple[str, type, Any, str]]
) -> type:
    """A dataclass holding the recipe's config (its flags unprefixed) and the command's own options."""
    import tyro

    fields: list[tuple[str, Any, Any]] = [
        (
            "recipe_config",
            Annotated[recipe.config_cls, tyro.conf.arg(name="")],
            dataclasses.field(default=default_config),
        )
    ]
    for name, kind, default, doc in options:
        fields.append((name, Annotated[kind, tyro.conf.arg(help=doc)], dataclasses.field(default=default)))
    return dataclasses.make_dataclass("Command", fields, frozen=True)
