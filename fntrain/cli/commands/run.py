"""`fntrain run RECIPE [--config FILE] [overrides]`, the same run from a recipe's own file
(`python -m recipes.NAME ...`, `python my_recipe.py ...`), and the launcher: `fntrain run
--nproc-per-node N [torchrun's options] RECIPE ...` (`fntrain.cli.launcher`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from fntrain.cli.errors import reporting, setting_error
from fntrain.cli.final_line import say
from fntrain.cli.recipe_args import resolve_config, split_recipe
from fntrain.cli.recipes import Recipe, load_recipe
from fntrain.config import ConfigError

__all__ = ["command", "run_recipe", "recipe_main"]


def command(args: list[str]) -> Any:
    """`fntrain run`: the recipe named first, configured by the rest of the arguments, run; with
    torchrun's options before the recipe, run on the ranks they describe (`launch_recipe`)."""
    from fntrain.cli import launcher

    if launcher.is_launch(args):
        return launch_recipe(args)
    name, rest = split_recipe("run", args)
    recipe = load_recipe(name)
    config = resolve_config(recipe, rest, prog=f"fntrain run {name}")
    return run_recipe(recipe.spec, config)


def launch_recipe(args: list[str]) -> None:
    """`fntrain run --nproc-per-node N ... RECIPE ...`: the recipe's options parsed here (a bad one is
    one line, exit status 2, before any rank starts), then the job launched; a job that failed or was
    stopped ends the process with its first failing rank's line and status."""
    from fntrain.cli import launcher

    options, name, rest = launcher.split_launch(args)
    resolve_config(load_recipe(name), rest, prog=f"fntrain run {name}")
    ended = launcher.launch(options, [name, *rest])
    if ended.exit_code:
        if ended.line:
            print(ended.line, file=sys.stderr)
        raise SystemExit(ended.exit_code)


def run_recipe(spec: Any, config: Any) -> Any:
    """Run `config` with `fntrain.run.job.run_job` and return its `TrainResult`. A bad setting is a
    `CommandError` naming the flag; a run that failed, or was interrupted or preempted, ends the process
    with its one line on stderr and its exit status (1, 130, or the preemption's) after its teardown."""
    from fntrain.run.job import RunAborted, run_job
    from fntrain.run.logs import setup_console_logging

    setup_console_logging()  # [rank r] prefixes; other ranks: errors only (warnings once, from rank 0)
    try:
        result = run_job(config, spec)
    except ConfigError as error:
        raise setting_error(error, type(config)) from None
    except RunAborted as aborted:
        _show_traceback(aborted.__cause__)
        say(aborted.line, aborted.exit_code)
        raise SystemExit(aborted.exit_code) from None
    if result.exit_code:  # preempted or interrupted: saved, torn down; say so in one line
        say(f"{result.reason}; checkpoint saved, resume with --checkpoint.restore-from latest", result.exit_code)
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
        return reporting(prog, lambda: run_recipe(spec, resolve_config(recipe, args, prog=prog)))

    run_main(main)
