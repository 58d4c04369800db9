"""A recipe's command line, shared by `fntrain run`, `plan` and `config` (and `python -m recipes.X`):
the RECIPE argument, `--config FILE`s seeding the recipe's defaults, and tyro's flags over them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any

from fntrain.cli.config_file import CONFIG_HELP, load_config, split_config_args
from fntrain.cli.errors import CommandError, UsageError
from fntrain.cli.recipes import Recipe, available_recipes
from fntrain.cli.usage import HELP

__all__ = ["split_recipe", "split_config", "load_defaults", "describe", "resolve_config", "command_with_options"]


def split_recipe(command: str, args: list[str]) -> tuple[str, list[str]]:
    """(RECIPE, the rest of the arguments); a `UsageError` when no recipe is named."""
    if not args or args[0].startswith("-"):
        if args and args[0] in HELP:
            raise UsageError(f"fntrain {command} RECIPE --help lists a recipe's options")
        raise UsageError(
            f"fntrain {command} needs a RECIPE (one of: {', '.join(available_recipes()) or 'none'})"
        )
    return args[0], args[1:]


def resolve_config(recipe: Recipe, args: Sequence[str], *, prog: str | None = None) -> Any:
    """The recipe's config from `--config FILE`s (seeding the defaults) and CLI overrides (tyro)."""
    import tyro

    paths, rest = split_config(args)
    default = load_defaults(recipe, paths)
    return tyro.cli(recipe.config_cls, default=default, args=rest, prog=prog, description=describe(recipe))


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
    """The recipe's `--help` text: the first paragraph of its docstring and how `--config` works."""
    first = recipe.description.split("\n\n", 1)[0] if recipe.description else f"The {recipe.name} recipe."
    return f"{first}\n\n{CONFIG_HELP}"


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
