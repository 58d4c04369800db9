"""The one place a command's bad input becomes what the user sees: one line after the command's label
and exit status 2 (a usage error adds the usage), Ctrl-C outside a run its one line and the shell's
status. A bad setting names the flag, not the dataclass field."""

from __future__ import annotations

import sys
from typing import Any

from fntrain.cli.recipes import RecipeNotFound
from fntrain.cli.usage import usage
from fntrain.config import as_flags
from fntrain.hooks.signals import INTERRUPT_EXIT_CODE

__all__ = ["CommandError", "UsageError", "setting_error", "reporting"]


class CommandError(Exception):
    """A bad command line or config file: printed (no traceback), exit status 2."""


class UsageError(CommandError):
    """A malformed command line: printed with the usage, exit status 2."""


def setting_error(error: BaseException, config_cls: type) -> CommandError:
    """A bad setting as the one line the user sees: the fields it names written as their flags."""
    from fntrain.run.config import config_fields

    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CommandError(as_flags(message, config_fields(config_cls)))


def reporting(label: str, action: Any) -> Any:
    """`action()`, with usage and setting errors printed as one line after `label` (the usage after a
    usage error) and `SystemExit(2)`."""
    try:
        return action()
    except KeyboardInterrupt:  # Ctrl-C outside a run that saves on it: no traceback, the shell's status
        print(f"{label}: interrupted", file=sys.stderr)
        raise SystemExit(INTERRUPT_EXIT_CODE) from None
    except UsageError as error:
        print(f"{label}: {error}\n\nusage:\n{usage()}", file=sys.stderr)
        raise SystemExit(2) from None
    except (CommandError, RecipeNotFound) as error:
        print(f"{label}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
