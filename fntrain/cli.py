"""The `fntrain` command: run a recipe, print its run plan, plot a run.

    fntrain run RECIPE [--config FILE] [overrides]      train (torchrun works too: torchrun ... -m fntrain run ...)
    fntrain plan RECIPE [--world-size N] [--json] [--config FILE] [overrides]
                                                        the resolved run plan, without a model or a device
    fntrain config RECIPE [--format toml|json] [--config FILE] [overrides]
                                                        the resolved config, ready to be fed back as --config
    fntrain plot RUN_DIR [options]                      plots of a run's metrics
    fntrain tokenize INPUT... --output DIR [options]    text/JSONL -> memory-mapped token shards
    fntrain export CKPT --format hf|dcp OUT [options]   a DCP checkpoint -> a Hugging Face directory, or back
    fntrain recipes                                     the recipes that can be named

RECIPE is a name registered in the `fntrain.recipes` entry-point group (the built-ins: tiny_gpt,
hf_causal_lm), a recipe of a source checkout's `recipes/`, or a dotted module path. The options after it
are the recipe's own, parsed by tyro from its config dataclass (`fntrain run tiny_gpt --help` lists
them); `--config FILE` (TOML, YAML or JSON) seeds their defaults and flags override the file.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fntrain.config_file import CONFIG_HELP, config_to_dict, dump_toml, load_config, split_config_args
from fntrain.recipes_registry import Recipe, RecipeNotFound, available_recipes, load_recipe

__all__ = ["main", "dispatch", "resolve_config", "plan_report"]

COMMANDS = ("run", "plan", "config", "plot", "tokenize", "export", "recipes")
_HELP = ("-h", "--help")


class CommandError(Exception):
    """A bad command line or config file: printed (no traceback), exit status 2."""


class UsageError(CommandError):
    """A malformed command line: printed with the usage, exit status 2."""


def _usage() -> str:
    return __doc__.split("\n\n", 2)[1].strip("\n")


def _full_help() -> str:
    recipes = available_recipes()
    listed = "\n".join(f"  {name:<16} {module}" for name, module in recipes.items()) or "  (none found)"
    return f"usage:\n{_usage()}\n\n{__doc__.split(chr(10) * 2, 2)[2].strip()}\n\nrecipes:\n{listed}\n"


def _split_recipe(command: str, args: list[str]) -> tuple[str, list[str]]:
    if not args or args[0].startswith("-"):
        if args and args[0] in _HELP:
            raise UsageError(f"fntrain {command} RECIPE --help lists a recipe's options")
        raise UsageError(
            f"fntrain {command} needs a RECIPE (one of: {', '.join(available_recipes()) or 'none'})"
        )
    return args[0], args[1:]


def resolve_config(recipe: Recipe, args: Sequence[str], *, prog: str | None = None) -> Any:
    """The recipe's config from `--config FILE`s (seeding the defaults) and CLI overrides (tyro)."""
    import tyro

    paths, rest = _split_config(args)
    default = _load_defaults(recipe, paths)
    return tyro.cli(recipe.config_cls, default=default, args=rest, prog=prog, description=_describe(recipe))


def _split_config(args: Sequence[str]) -> tuple[list[str], list[str]]:
    try:
        return split_config_args(args)
    except ValueError as error:
        raise UsageError(str(error)) from error


def _load_defaults(recipe: Recipe, paths: Sequence[str]) -> Any:
    """The recipe's defaults seeded by the config files; a bad file is a `CommandError`."""
    try:
        return load_config(recipe.config_cls, *paths)
    except (OSError, TypeError, ValueError) as error:
        raise CommandError(str(error)) from error


def _describe(recipe: Recipe) -> str:
    first = recipe.description.split("\n\n", 1)[0] if recipe.description else f"The {recipe.name} recipe."
    return f"{first}\n\n{CONFIG_HELP}"


def plan_report(recipe: Recipe, config: Any, world_size: int = 1) -> dict[str, Any]:
    """The recipe's plan for `world_size` ranks (its `plan` function), with the recipe's name."""
    if recipe.plan is None:
        raise UsageError(f"recipe {recipe.name} has no plan(config, world_size) function")
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"--world-size must be a positive int, got {world_size!r}")
    return {"recipe": recipe.name, **recipe.plan(config, world_size=world_size)}


# ----------------------------------------------------------------------------- commands


def _run(args: list[str]) -> Any:
    name, rest = _split_recipe("run", args)
    recipe = load_recipe(name)
    config = resolve_config(recipe, rest, prog=f"fntrain run {name}")
    from fntrain.logs import setup_console_logging

    setup_console_logging()  # [rank r] prefixes; other ranks: warnings and errors only
    # A run stopped by a preemption signal raises fntrain.preemption.Preempted, a SystemExit: the
    # process exits with checkpoint.preempt_exit_code (143 by default).
    return recipe.run(config)


def _command_with_options(
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


def _plan(args: list[str]) -> dict[str, Any]:
    import tyro

    name, rest = _split_recipe("plan", args)
    recipe = load_recipe(name)
    paths, rest = _split_config(rest)
    command_cls = _command_with_options(
        recipe,
        _load_defaults(recipe, paths),
        [
            ("world_size", int, 1, "Ranks the run would use (torchrun's WORLD_SIZE)."),
            ("json", bool, False, "Print the plan as JSON instead of text."),
        ],
    )
    parsed = tyro.cli(command_cls, args=rest, prog=f"fntrain plan {name}", description=_describe(recipe))
    try:
        report = plan_report(recipe, parsed.recipe_config, parsed.world_size)
    except (TypeError, ValueError, FileNotFoundError) as error:  # config values the recipe rejects
        raise CommandError(str(error)) from error
    if parsed.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        from fntrain.plan_report import format_run_plan

        print(format_run_plan(report))
    return report


def _config(args: list[str]) -> str:
    import tyro

    name, rest = _split_recipe("config", args)
    recipe = load_recipe(name)
    paths, rest = _split_config(rest)
    command_cls = _command_with_options(
        recipe,
        _load_defaults(recipe, paths),
        [("format", Literal["toml", "json"], "toml", "Output format (both read back with --config).")],
    )
    parsed = tyro.cli(command_cls, args=rest, prog=f"fntrain config {name}", description=_describe(recipe))
    data = config_to_dict(parsed.recipe_config)
    text = dump_toml(data) if parsed.format == "toml" else json.dumps(data, indent=2, sort_keys=True) + "\n"
    sys.stdout.write(text)
    return text


def _plot(args: list[str]) -> Any:
    import tyro

    from fntrain.plot import plot_run

    if not args or args[0] in _HELP:
        if args:
            tyro.cli(plot_run, args=["--help"], prog="fntrain plot")
        raise UsageError("fntrain plot needs a RUN_DIR")
    run_dir, rest = args[0], args[1:]
    params = list(inspect.signature(plot_run).parameters)
    # RUN_DIR is positional on this command whatever plot_run calls its first parameter.
    flag = "--" + params[0].replace("_", "-")
    result = tyro.cli(plot_run, args=[flag, run_dir, *rest], prog="fntrain plot RUN_DIR")
    for path in result if isinstance(result, (list, tuple)) else ([result] if result else []):
        print(path)
    return result


def _tokenize(args: list[str]) -> Any:
    import tyro

    from fntrain.data.tokenize import tokenize_command

    try:
        index = tyro.cli(tokenize_command, args=args, prog="fntrain tokenize")
    except (ValueError, OSError) as error:  # bad inputs, an occupied output: no traceback
        raise CommandError(str(error)) from error
    print(
        f"{index.directory}: {index.total_tokens} tokens, {index.documents} documents, "
        f"{len(index.shards)} shard(s) of {index.dtype} (eos {index.eos_id}, tokenizer {index.tokenizer})"
    )
    return index


_EXPORT_CKPT_HELP = (
    "hf: an fntrain checkpoint (step_<N>/, or a checkpoint root: its latest); dcp: a Hugging Face directory"
)
_EXPORT_OUT_HELP = "hf: the Hugging Face directory to write; dcp: the checkpoint root to write"


def _export(args: list[str]) -> Any:
    import tyro

    from fntrain.checkpoint import hf_export

    positional = tyro.conf.Positional
    command_cls = dataclasses.make_dataclass(
        "Export",
        [
            ("checkpoint", Annotated[str, positional, tyro.conf.arg(metavar="CKPT", help=_EXPORT_CKPT_HELP)]),
            ("out", Annotated[str, positional, tyro.conf.arg(metavar="OUT", help=_EXPORT_OUT_HELP)]),
            (
                "options",
                Annotated[hf_export.ExportOptions, tyro.conf.arg(name="")],
                dataclasses.field(default=hf_export.ExportOptions()),
            ),
        ],
        frozen=True,
    )
    summary = "\n\n".join((hf_export.__doc__ or "").split("\n\n")[:2])
    parsed = tyro.cli(command_cls, args=args, prog="fntrain export", description=summary)
    try:
        path = hf_export.export_checkpoint(parsed.checkpoint, parsed.out, parsed.options)
    except (ValueError, OSError, KeyError) as error:  # a bad source, an occupied output: no traceback
        raise CommandError(str(error)) from error
    print(path)
    return path


def _recipes(args: list[str]) -> dict[str, str]:
    recipes = available_recipes()
    for name, module in recipes.items():
        print(f"{name:<16} {module}")
    return recipes


_DISPATCH = {
    "run": _run,
    "plan": _plan,
    "config": _config,
    "plot": _plot,
    "tokenize": _tokenize,
    "export": _export,
    "recipes": _recipes,
}


def dispatch(argv: Sequence[str]) -> Any:
    """Run the command line `argv` (without the program name) and return what the command produced:
    the final TrainState for run, the report dict for plan, the text for config, the written paths for
    plot, the shard index for tokenize. Usage and config-file errors print a message and raise
    `SystemExit(2)`."""
    args = list(argv)
    if not args or args[0] in _HELP:
        print(_full_help())
        if not args:
            raise SystemExit(2)
        return None
    command, rest = args[0], args[1:]
    if command not in _DISPATCH:
        print(
            f"fntrain: unknown command {command!r} (one of: {', '.join(COMMANDS)})\n\nusage:\n{_usage()}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        return _DISPATCH[command](rest)
    except UsageError as error:
        print(f"fntrain {command}: {error}\n\nusage:\n{_usage()}", file=sys.stderr)
        raise SystemExit(2) from None
    except (CommandError, RecipeNotFound) as error:
        print(f"fntrain {command}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fntrain` console script: 0 on success (errors raise or exit non-zero)."""
    dispatch(sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(main)
