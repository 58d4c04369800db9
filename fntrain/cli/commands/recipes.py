"""`fntrain recipes`: the recipes that can be named, one a line."""

from __future__ import annotations

from fntrain.cli.errors import UsageError
from fntrain.cli.recipes import available_recipes
from fntrain.cli.usage import HELP, recipe_lines

__all__ = ["command"]


def command(args: list[str]) -> dict[str, str]:
    """Print every recipe that can be named (name, module, built-in or not); return name -> module."""
    if args and args[0] not in HELP:
        raise UsageError(f"takes no arguments, got {' '.join(args)}")
    for line in recipe_lines():
        print(line.strip())
    return available_recipes()
