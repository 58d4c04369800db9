"""`fntrain COMMAND ...`: the command line dispatched to its subcommand (`fntrain.cli.commands`), and the
console script's entry point. The usage it prints is `fntrain.cli.usage`'s."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from fntrain.cli.commands import (
    config,
    cp,
    eval,
    export,
    generate,
    plan,
    plot,
    recipes,
    run,
    tiny_llama,
    tokenize,
)
from fntrain.cli.errors import reporting
from fntrain.cli.usage import HELP, full_help

__all__ = ["COMMANDS", "dispatch", "main"]

_DISPATCH = {
    "run": run.command,
    "plan": plan.command,
    "config": config.command,
    "cp": cp.command,
    "plot": plot.command,
    "tokenize": tokenize.command,
    "export": export.command,
    "generate": generate.command,
    "eval": eval.command,
    "recipes": recipes.command,
    "tiny-llama": tiny_llama.command,
}
COMMANDS = tuple(_DISPATCH)


def dispatch(argv: Sequence[str]) -> Any:
    """Run the command line `argv` (without the program name) and return what the command produced:
    the run's `TrainResult` for run, the report dict for plan, the text for config, the written paths
    for plot, the shard index for tokenize. Usage and config-file errors print a message and raise
    `SystemExit(2)`."""
    args = list(argv)
    if not args or args[0] in HELP:
        print(full_help())
        if not args:
            raise SystemExit(2)
        return None
    if args[0] == "--version":
        from fntrain import __version__

        print(f"fntrain {__version__}")
        return __version__
    command, rest = args[0], args[1:]
    if command not in _DISPATCH:
        import difflib

        near = difflib.get_close_matches(command, COMMANDS, n=1)  # the nearest spelling
        hint = f"did you mean {near[0]}?" if near else f"one of: {', '.join(COMMANDS)}"
        print(f"fntrain: unknown command {command!r} ({hint}); fntrain --help for usage", file=sys.stderr)
        raise SystemExit(2)
    return reporting(f"fntrain {command}", lambda: _DISPATCH[command](rest))


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
