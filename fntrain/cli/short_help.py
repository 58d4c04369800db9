"""A recipe command's short `--help`: the flags a user sets first, one line each, grouped by section;
`--help-all` prints tyro's full help (every flag with its whole description) and docs/config.md
explains each.

The common flags are the recipe's own (its model, data and other sections, a command's own options)
and, of the settings every recipe shares (`JobConfig`), those in `COMMON_SHARED`. The lines are written
here, not by tyro: tyro's help spends two to four lines and a box on every flag, which puts even the
common flags of a recipe past a screen.
"""

from __future__ import annotations

import shutil
from typing import Any

from fntrain.cli.flags import Flag, command_flags, metavar

__all__ = ["COMMON_SHARED", "short_help", "common_flags"]

# Of JobConfig's flags, the ones a first run sets (a name ending in "." takes its whole section).
COMMON_SHARED = (
    "--run-dir", "--overwrite", "--seed", "--log-every", "--train.", "--optim.lr", "--schedule.",
    "--checkpoint.save-every", "--checkpoint.restore-from", "--parallel.strategy", "--runtime.device",
)  # fmt: skip


def common_flags(cls: type, default: Any = None) -> tuple[list[Flag], int]:
    """(the common flags of the command `cls`: the top-level ones, then each section's, in declaration
    order; how many flags it has in all)."""
    from fntrain.run.config import JobConfig

    shared = set(command_flags(JobConfig))
    every = command_flags(cls, default)
    common = [flag for name, flag in every.items() if name not in shared or _listed(name)]
    return sorted(common, key=lambda flag: flag.section != ""), len(every)  # the top-level flags first


def _listed(name: str) -> bool:
    return any(name == entry or (entry.endswith(".") and name.startswith(entry)) for entry in COMMON_SHARED)


def short_help(cls: type, default: Any = None, *, prog: str, about: str = "") -> str:
    """The text `PROG --help` prints: usage, `about`, and the common flags of `cls` (defaults from
    `default`, an instance of `cls`, else its own) in sections, one line per flag."""
    common, total = common_flags(cls, default)
    width = max(80, min(shutil.get_terminal_size((120, 24)).columns, 160))
    column = min(max((len(metavar(flag)) for flag in common), default=0), 34) + 4
    lines = [f"usage: {prog} [--config FILE] [OPTIONS]", ""]
    if about:
        lines += [" ".join(about.split()), ""]
    lines.append(
        f"The common options ({prog} --help-all lists all {total}; --config FILE seeds them from a file):"
    )
    section = None
    for flag in common:
        if flag.section != section:
            section = flag.section
            heading = f"{section}: {_sentence(flag.section_doc)}".rstrip(": ") if section else "options:"
            lines += ["", _cut(heading, width)]
        lines.append(_line(flag, column, width))
    return "\n".join(lines) + "\n"


def _line(flag: Flag, column: int, width: int) -> str:
    """`  --flag TYPE   first sentence of its doc (default: X)`, cut to `width` columns."""
    left = f"  {metavar(flag)}"
    left = left.ljust(column) if len(left) < column else left + "  "
    default = f" (default: {_shown(flag.default)})"
    text = _sentence(flag.doc)
    return f"{left}{_cut(text, width - len(left) - len(default))}{default}".rstrip()


def _cut(text: str, room: int) -> str:
    """`text`, cut to `room` characters with an ellipsis (--help-all has the whole text)."""
    return text if len(text) <= room else text[: max(room - 1, 0)].rstrip() + "…"


def _sentence(doc: str) -> str:
    """The first sentence of a docstring (its whole first line when it has no full stop)."""
    text = " ".join(doc.split())
    end = text.find(". ")
    return text[: end + 1] if end >= 0 else text


def _shown(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) if value else "(empty)"
    return '""' if value == "" else str(value)
