"""The `fntrain` command: run a recipe, print its run plan, plot a run.

    fntrain run RECIPE [--config FILE] [overrides]      train (torchrun works too: torchrun ... -m fntrain run ...)
    fntrain cp RECIPE DEST.py [--force]                 copy a built-in recipe to own and change it
    fntrain plan RECIPE [--world-size N] [--json] [--config FILE] [overrides]
                                                        the resolved run plan, without a model or a device
    fntrain config RECIPE [--format toml|json] [--config FILE] [overrides]
                                                        the resolved config, ready to be fed back as --config
    fntrain plot RUN_DIR [options]                      plots of a run's metrics
    fntrain tokenize INPUT... --output DIR [options]    text/JSONL/Parquet/Arrow -> token shards
    fntrain export CKPT --format hf|dcp OUT [options]   a DCP checkpoint -> a Hugging Face directory, or back
    fntrain recipes                                     the recipes that can be named

RECIPE is a name registered in the `fntrain.recipes` entry-point group (the built-ins and any other
project's, listed below and by `fntrain recipes`), a recipe of a source checkout's `recipes/`, a dotted
module path, or a .py file (such as one `fntrain cp` wrote; `python DEST.py` runs it too). Every bad setting is one line naming the flag,
exit status 2, before any file, model or device work. The options after it
are the recipe's own, parsed by tyro from its config dataclass (`fntrain run tiny_gpt --help` lists
them); `--config FILE` (TOML, YAML or JSON) seeds their defaults and flags override the file.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fntrain.config import ConfigError, as_flags
from fntrain.hooks.signals import INTERRUPT_EXIT_CODE
from fntrain.run.config_file import (
    CONFIG_HELP,
    class_defaults,
    config_to_dict,
    dump_toml,
    load_config,
    split_config_args,
)
from fntrain.run.recipes import Recipe, RecipeNotFound, available_recipes, is_built_in, load_recipe

__all__ = ["main", "dispatch", "resolve_config", "plan_report", "run_recipe", "recipe_main"]

COMMANDS = ("run", "plan", "config", "cp", "plot", "tokenize", "export", "recipes")
_HELP = ("-h", "--help")


class CommandError(Exception):
    """A bad command line or config file: printed (no traceback), exit status 2."""


class UsageError(CommandError):
    """A malformed command line: printed with the usage, exit status 2."""


def _usage() -> str:
    return __doc__.split("\n\n", 2)[1].strip("\n")


def _full_help() -> str:
    listed = "\n".join(_recipe_lines()) or "  (none found)"
    return f"usage:\n{_usage()}\n\n{__doc__.split(chr(10) * 2, 2)[2].strip()}\n\nrecipes:\n{listed}\n"


def _recipe_lines() -> list[str]:
    """One line per recipe that can be named, from the registry: name, module, and whether it is built in."""
    return [f"  {name:<16} {module}{'  (built-in)' if is_built_in(name, module) else ''}"
            for name, module in available_recipes().items()]  # fmt: skip


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


def _setting_error(error: BaseException, config_cls: type) -> CommandError:
    """A bad setting as the one line the user sees: the fields it names written as their flags."""
    from fntrain.run.config import config_fields

    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CommandError(as_flags(message, config_fields(config_cls)))


def plan_report(recipe: Recipe, config: Any, world_size: int = 1) -> dict[str, Any]:
    """The recipe's plan for `world_size` ranks (`fntrain.run.job.plan_job`), with the recipe's name."""
    from fntrain.run.config import config_fields
    from fntrain.run.job import plan_job

    try:
        report = {"recipe": recipe.name, **plan_job(config, recipe.spec, world_size)}
    except (TypeError, ValueError, OSError) as error:  # settings the job rejects, a bad data file
        raise _setting_error(error, recipe.config_cls) from None
    fields = config_fields(recipe.config_cls)
    report["notes"] = [as_flags(note, fields) for note in report.get("notes", ())]  # fields as flags
    return report


def run_recipe(spec: Any, config: Any) -> Any:
    """Run `config` with `fntrain.run.job.run_job` and return its `TrainResult`. A bad setting is a
    `CommandError` naming the flag; a run that failed, or was interrupted or preempted, ends the process
    with its one line on stderr and its exit status (1, 130, or the preemption's) after its teardown."""
    from fntrain.run.job import RunAborted, run_job
    from fntrain.run.logs import setup_console_logging

    setup_console_logging()  # [rank r] prefixes; other ranks: warnings and errors only
    try:
        result = run_job(config, spec)
    except ConfigError as error:
        raise _setting_error(error, type(config)) from None
    except RunAborted as aborted:
        _show_traceback(aborted.__cause__)
        print(aborted.line, file=sys.stderr)
        raise SystemExit(aborted.exit_code) from None
    if result.exit_code:  # preempted or interrupted: saved, torn down; say so in one line
        print(f"{result.reason}; checkpoint saved, resume with --checkpoint.restore-from latest", file=sys.stderr)
        raise SystemExit(result.exit_code)
    return result


def _show_traceback(error: BaseException | None) -> None:
    """The full traceback on stderr, when FNTRAIN_TRACEBACK=1 asks for it (it is always in the log)."""
    import os

    if error is not None and os.environ.get("FNTRAIN_TRACEBACK", "") not in ("", "0"):
        import traceback

        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)


def recipe_main(spec: Any, argv: Sequence[str] | None = None) -> None:
    """`python -m recipes.NAME [--config FILE] [overrides]` and `python my_recipe.py ...`: the same as
    `fntrain run`, ending the process with the run's exit status."""
    import os

    from fntrain.runtime.process import run_main

    args = list(sys.argv[1:] if argv is None else argv)
    module = sys.modules[spec.config.__module__]
    prog = os.path.basename(getattr(module, "__file__", None) or "recipe")
    recipe = Recipe(name=prog, module=module, spec=spec, description=(module.__doc__ or "").strip())

    def main() -> Any:
        return _reporting(prog, lambda: run_recipe(spec, resolve_config(recipe, args, prog=prog)))

    run_main(main)


# ----------------------------------------------------------------------------- commands


def _run(args: list[str]) -> Any:
    name, rest = _split_recipe("run", args)
    recipe = load_recipe(name)
    config = resolve_config(recipe, rest, prog=f"fntrain run {name}")
    return run_recipe(recipe.spec, config)


def _cp(args: list[str]) -> str:
    """Copy a recipe's source file to DEST.py, to own and change; it runs from there unchanged."""
    import shutil
    from pathlib import Path

    force = "--force" in args
    positional = [arg for arg in args if arg != "--force"]
    if len(positional) != 2 or any(arg.startswith("-") for arg in positional):
        raise UsageError("fntrain cp needs a RECIPE and a DEST.py")
    name, dest = positional
    if not dest.endswith(".py"):
        raise UsageError(f"DEST must be a .py file, got {dest!r}")
    source = Path(load_recipe(name).module.__file__ or "")
    target = Path(dest).expanduser()
    if target.exists() and not force:
        raise CommandError(f"{dest} exists; pass --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    print(f"{target}: a copy of {name}; run it with `fntrain run {target}` or `python {target}`")
    return str(target)


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
    report = plan_report(recipe, parsed.recipe_config, parsed.world_size)
    if parsed.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        from fntrain.plan.report import format_run_plan

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
    if parsed.format == "toml":
        text = dump_toml(data, class_defaults(parsed.recipe_config))
    else:
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    sys.stdout.write(text)
    return text


def _plot(args: list[str]) -> Any:
    import importlib

    import tyro

    plot_module = importlib.import_module("fntrain.run.plot")  # looked up when called (tests stub it)

    def plot(run_dir: str, out_dir: str | None = None) -> Any:
        try:
            written = plot_module.plot_run(run_dir, out_dir)
        except (OSError, ValueError, ImportError) as error:  # a missing run, a malformed metrics file
            raise CommandError(str(error)) from error
        if not written:  # a run that logged nothing to plot: said, not a silent success
            raise CommandError(f"nothing to plot: {run_dir!r} has no loss or throughput records in metrics.jsonl")
        return written

    # plot_command's user-facing help, RUN_DIR the first argument (not a flag), readable metavars
    plot.__doc__ = getattr(plot_module, "plot_command", plot).__doc__
    plot.__annotations__ = {
        "run_dir": Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")],
        "out_dir": Annotated[str | None, tyro.conf.arg(metavar="DIR")],
        "return": Any,
    }
    if not args or args[0] in _HELP:
        if args:
            tyro.cli(plot, args=["--help"], prog="fntrain plot")
        raise UsageError("fntrain plot needs a RUN_DIR")
    result = tyro.cli(plot, args=args, prog="fntrain plot")
    for path in result if isinstance(result, (list, tuple)) else [result]:
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
        convert = _hf_conversion(parsed.checkpoint, parsed.out, parsed.options)
        path = hf_export.export_checkpoint(parsed.checkpoint, parsed.out, parsed.options, convert)
    except (ValueError, OSError, KeyError) as error:  # a bad source, an occupied output: no traceback
        raise CommandError(str(error)) from error
    print(path)
    return path


def _hf_conversion(checkpoint: str, out: str, options: Any) -> Any:
    """The conversion of `--format hf` for `checkpoint`: the `hf_conversion` of `options.recipe`, else of
    the recipe its meta.json records, bound to the run config it saved; None for a recipe without one,
    an old checkpoint that records none, `--recipe none`, or another format."""
    from fntrain.checkpoint import hf_export
    from fntrain.checkpoint.restorer import read_meta
    from fntrain.run.config_file import config_from_dict

    if options.format != "hf" or options.recipe == "none":
        return None
    meta = read_meta(hf_export.export_source(checkpoint, out, options.overwrite))
    name = options.recipe or meta.get("recipe")
    if not name:
        return None
    try:
        recipe = load_recipe(name)
    except RecipeNotFound as error:
        flag = "--recipe" if options.recipe else "the checkpoint's recipe"
        hint = "--recipe none exports the model's own names"
        raise CommandError(f"{flag} {name!r}: {error} ({hint})") from None
    if recipe.spec.hf_conversion is None:
        return None
    config = config_from_dict(recipe.config_cls, meta.get("config") or {})
    return lambda state: recipe.spec.hf_conversion(config, state)


def _recipes(args: list[str]) -> dict[str, str]:
    for line in _recipe_lines():
        print(line.strip())
    return available_recipes()


_DISPATCH = {
    "run": _run,
    "plan": _plan,
    "config": _config,
    "cp": _cp,
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
    if args[0] == "--version":
        from fntrain import __version__

        print(f"fntrain {__version__}")
        return __version__
    command, rest = args[0], args[1:]
    if command not in _DISPATCH:
        print(
            f"fntrain: unknown command {command!r} (one of: {', '.join(COMMANDS)})\n\nusage:\n{_usage()}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return _reporting(f"fntrain {command}", lambda: _DISPATCH[command](rest))


def _reporting(label: str, action: Any) -> Any:
    """`action()`, with usage and setting errors printed as one line after `label` (the usage after a
    usage error) and `SystemExit(2)`."""
    try:
        return action()
    except KeyboardInterrupt:  # Ctrl-C outside a run that saves on it: no traceback, the shell's status
        print(f"{label}: interrupted", file=sys.stderr)
        raise SystemExit(INTERRUPT_EXIT_CODE) from None
    except UsageError as error:
        print(f"{label}: {error}\n\nusage:\n{_usage()}", file=sys.stderr)
        raise SystemExit(2) from None
    except (CommandError, RecipeNotFound) as error:
        print(f"{label}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fntrain` console script: 0 on success (errors raise or exit non-zero).

    A reader that stops early (`fntrain plan --json | head -1`) ends the command quietly, as Python's
    documentation of SIGPIPE recommends: stdout goes to devnull (so the interpreter's last flush does not
    fail again) and the status is 1, with no traceback."""
    try:
        dispatch(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout without a file descriptor (captured): nothing to redirect
            pass
        finally:
            os.close(devnull)
        raise SystemExit(1) from None
    return 0


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(main)
