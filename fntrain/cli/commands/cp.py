"""`fntrain cp RECIPE DEST.py [--force]`: copy a built-in recipe to own and change it."""

from __future__ import annotations

from fntrain.cli.errors import CommandError, UsageError
from fntrain.cli.recipes import load_recipe
from fntrain.cli.usage import HELP

__all__ = ["command"]


def command(args: list[str]) -> str:
    """Copy a recipe's source file to DEST.py, to own and change; it runs from there unchanged."""
    import shutil
    from pathlib import Path

    if any(arg in HELP for arg in args):
        print("usage: fntrain cp RECIPE DEST.py [--force]\n\nCopy a recipe's file to DEST.py, to own and change; "
              "--force replaces an existing DEST.py.")  # fmt: skip
        return ""
    unknown = [arg for arg in args if arg.startswith("-") and arg != "--force"]
    if unknown:
        raise UsageError(f"unknown flag {unknown[0]} (fntrain cp takes only --force)")
    force = "--force" in args
    positional = [arg for arg in args if arg != "--force"]
    if len(positional) != 2 or any(arg.startswith("-") for arg in positional):
        raise UsageError(f"needs a RECIPE and a DEST.py, got {' '.join(args) or 'nothing'}")
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
