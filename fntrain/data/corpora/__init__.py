"""Small public-domain corpora shipped with fntrain, found through the package (so a recipe copied
anywhere, or fntrain installed as a wheel, finds them): `corpus_path("shakespeare")`. See SOURCE.md."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["corpus_path"]


def corpus_path(name: str = "shakespeare") -> Path:
    """The path of the bundled corpus `name` (`<name>.txt` in this package)."""
    path = Path(str(files(__name__) / f"{name}.txt"))
    if not path.is_file():
        raise FileNotFoundError(f"no bundled corpus named {name!r} ({path} does not exist)")
    return path
