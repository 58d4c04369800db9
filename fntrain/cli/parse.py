"""Every `fntrain` command's tyro call: `parse(f, args, prog=...)`. A command line tyro rejects is one
`CommandError` line (which `errors.reporting` prints after the command's label, exit status 2):

    unknown flag --train.train-iter (did you mean --train.train-iters?)
    --train.train-iters expects an integer (or None), got 'twenty'
    --runtime.device must be one of cpu, cuda, npu, auto, got 'gpu'
    missing required option --output

naming the flag as typed and the value given. `--help` prints the command's short help when it has one
(`short_help=`; else tyro's full help), `--help-all` tyro's full help.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fntrain.cli.errors import CommandError
from fntrain.cli.flags import Flag, command_flags, type_words

__all__ = ["HELP_ALL", "parse", "error_line"]

HELP_ALL = "--help-all"  # tyro's full help, every flag with its description
_HELP = ("-h", "--help")


def parse(
    f: Any,
    args: Sequence[str],
    *,
    prog: str,
    description: str | None = None,
    default: Any = None,
    short_help: Callable[[], str] | None = None,
    config: tuple[Any, ...] = (),
) -> Any:
    """`tyro.cli(f, args=args, ...)` (with `default` seeding a dataclass's defaults and `config` tyro's
    global markers), a rejected command line raised as a one-line `CommandError`. `--help` prints
    `short_help()` and exits 0 when given, `--help-all` (and `--help` without a short help) tyro's full
    help."""
    import tyro

    args = list(args)
    if HELP_ALL in args:
        args = ["--help"]
    elif short_help is not None and any(arg in _HELP for arg in args):
        sys.stdout.write(short_help())
        raise SystemExit(0)
    options: dict[str, Any] = {"prog": prog, "description": description, "config": config or None}
    if default is not None:
        options["default"] = default
    fallback = f"this command line is not valid; {prog} --help for usage"
    with _one_line_errors(lambda event: error_line(event, args, prog, f), fallback):
        return tyro.cli(f, args=args, **options)


@contextlib.contextmanager
def _one_line_errors(line: Callable[[Any], str], fallback: str) -> Iterator[None]:
    """Within the block, a command line tyro rejects raises `CommandError(line(event))` (`fallback`
    when an event does not have the shape `line` reads) instead of tyro printing its box and exiting 2.

    Why a private hook: tyro (1.0) reports a failure only through `tyro._errors.on_parse_error`, which
    hands over the failing argument, value or choices before it prints; its public option
    (`console_outputs=False`) only silences the box and leaves a bare `SystemExit(2)`. The hook is
    documented but private, so it is used here only: a tyro without it prints its own box (exit 2)."""
    try:
        from tyro._errors import on_parse_error
    except ImportError:  # another tyro: its own (boxed) error, still exit status 2 and no traceback
        yield
        return

    def hook(event: Any) -> None:
        try:
            text = line(event)
        except Exception:  # an event of another shape (tyro's events are private): still one line
            text = fallback
        raise CommandError(text)

    with on_parse_error(hook):
        yield


# ----------------------------------------------------------------------------- the one line


def error_line(event: Any, args: Sequence[str], prog: str, f: Any) -> str:
    """The one line for tyro's parse-error `event` (tyro._errors' event classes, matched by name so
    that an event this code does not know still gets a line); `args` are the arguments as typed."""
    kind = type(event).__name__
    if kind == "UnrecognizedArgs":
        return _unrecognized(list(event.tokens), prog, f)
    if kind == "MissingArgs":
        return _missing([_names(item.arg) for item in event.missing_arguments])
    argument = getattr(event, "argument", None)
    names = _names(argument) if argument is not None else ()
    typed, value = _typed_value(args, names)
    if kind == "InvalidChoice":
        return f"{typed} must be one of {', '.join(map(str, event.choices))}, got {event.value!r}"
    if kind == "BadValue":
        if getattr(event, "reason", "") == "too_few_values":
            return f"{typed} needs a value ({_expects(names, f)})"
        return f"{typed} takes no value, got {getattr(event, 'offending_value', value)!r}"
    if kind == "InstantiationFailure":
        message = str(getattr(event, "message", "") or "invalid value")
        if not names:  # a check of the whole config (a ValueError of its own): its first line
            return message.strip().splitlines()[0]
        if value is None:
            found = re.search(r"from \[(.*?)\]", message)
            value = found.group(1).strip("'") if found else "?"
        return f"{typed} expects {_expects(names, f)}, got {value!r}"
    return f"this command line is not valid ({kind}); {prog} --help for usage"


def _names(argument: Any) -> tuple[str, ...]:
    """The flags of tyro's (internal) argument record, or for a positional argument its metavar; ()
    when this tyro keeps them elsewhere (the line then falls back to what the user typed)."""
    lowered = getattr(argument, "lowered", None)
    names = tuple(str(name) for name in (getattr(lowered, "name_or_flags", None) or ()))
    if names and not names[0].startswith("-"):  # positional: its name is a destination, show its metavar
        metavar = getattr(lowered, "metavar", None)
        return (str(metavar or names[0]).upper(),)
    return names


def _normal(flag: str) -> str:
    """A flag as tyro matches it: `--train.train_iters` and `--train.train-iters` are one flag."""
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def _typed_value(args: Sequence[str], names: tuple[str, ...]) -> tuple[str, str | None]:
    """The flag as the user typed it (its last occurrence) and the value given to it there."""
    wanted = {_normal(name) for name in names}
    typed, value = (names[0] if names else "the argument"), None
    for index, arg in enumerate(args):
        flag, equals, rest = arg.partition("=")
        if not (flag.startswith("-") and _normal(flag) in wanted):
            continue
        typed = flag
        if equals:
            value = rest
        else:
            given = []
            for following in args[index + 1 :]:
                if following.startswith("--"):
                    break
                given.append(following)
            value = " ".join(given) if given else None
    return typed, value


def _expects(names: tuple[str, ...], f: Any) -> str:
    flag = next((_normal(name) for name in names if name.startswith("--")), None)
    found: Flag | None = command_flags(f).get(flag) if flag else None
    return type_words(found.hint) if found else "another value"


def _unrecognized(tokens: list[str], prog: str, f: Any) -> str:
    flags = [token.partition("=")[0] for token in tokens if token.startswith("-") and len(token) > 1]
    if not flags:
        return (
            f"unexpected argument {tokens[0]!r}"
            if tokens
            else f"unexpected arguments; {prog} --help for usage"
        )
    known = command_flags(f)
    negated = [_negated(name) for name, flag in known.items() if flag.hint is bool]  # tyro's --x / --no-x
    close = closest_flag(flags[0], [*known, *negated, *_HELP[1:], HELP_ALL])
    hint = f"did you mean {close}?" if close else f"{prog} --help lists the flags"
    more = f"; also unknown: {', '.join(flags[1:])}" if len(flags) > 1 else ""
    return f"unknown flag {flags[0]} ({hint}){more}"


def _negated(flag: str) -> str:
    section, dot, last = flag[2:].rpartition(".")
    return f"--{section}{dot}no-{last}"


def closest_flag(typed: str, known: list[str]) -> str | None:
    """The known flag `typed` most likely meant: the same last part (`--lr` -> `--optim.lr`), else
    the nearest spelling (difflib), of the whole flag or of its last part."""
    wanted = _normal(typed)
    last = wanted.rsplit(".", 1)[-1].lstrip("-")
    same_last = [flag for flag in known if flag.rsplit(".", 1)[-1].lstrip("-") == last]
    if len(same_last) == 1:
        return same_last[0]
    close = difflib.get_close_matches(wanted, known, n=1, cutoff=0.75)
    if close:
        return close[0]
    by_last = {flag.rsplit(".", 1)[-1].lstrip("-"): flag for flag in known}
    close = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.8)
    return by_last[close[0]] if close else None


def _missing(names: list[tuple[str, ...]]) -> str:
    shown = [group[0] if group else "an argument" for group in names]
    if all(not name.startswith("-") for name in shown):
        return f"missing {' and '.join(shown)}"
    return f"missing required option{'s' if len(shown) > 1 else ''} {', '.join(shown)}"
