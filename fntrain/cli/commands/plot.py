"""`fntrain plot RUN_DIR [options]`: plots of a run's metrics (`fntrain.cli.plot`)."""

from __future__ import annotations

from typing import Annotated, Any

from fntrain.cli.errors import CommandError, UsageError
from fntrain.cli.parse import parse

__all__ = ["command"]


def command(args: list[str]) -> Any:
    """`fntrain plot`: the written paths, one a line; a run with nothing to plot is a `CommandError`."""
    import importlib

    import tyro

    plot_module = importlib.import_module("fntrain.cli.plot")  # looked up when called (tests stub it)

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
    if not args:
        raise UsageError("missing RUN_DIR")
    result = parse(plot, args, prog="fntrain plot")
    for path in result if isinstance(result, (list, tuple)) else [result]:
        print(path)
    return result
