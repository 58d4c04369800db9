"""The one place a command's bad input becomes what the user sees: one line after the command's label
and exit status 2 (a usage error adds where the usage is: `--help`), Ctrl-C outside a run its one line
and the shell's status. A bad setting names the flag, not the dataclass field; a command line tyro
rejects is turned into its `CommandError` line by `fntrain.cli.parse`."""

from __future__ import annotations

from typing import Any

from fntrain.cli.final_line import say
from fntrain.cli.recipes import RecipeNotFound
from fntrain.config import as_flags
from fntrain.hooks.signals import INTERRUPT_EXIT_CODE

__all__ = ["CommandError", "UsageError", "setting_error", "reporting"]


class CommandError(Exception):
    """A bad command line or config file: printed (no traceback), exit status 2."""


class UsageError(CommandError):
    """A malformed command line: printed with where the usage is (`--help`), exit status 2."""


def setting_error(error: BaseException, config_cls: type) -> CommandError:
    """A bad setting as the one line the user sees: the fields it names written as their flags."""
    from fntrain.run.config import config_fields

    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CommandError(as_flags(message, config_fields(config_cls)))


def reporting(label: str, action: Any) -> Any:
    """`action()`, with usage and setting errors printed as one line after `label` (a usage error's
    ending `; LABEL --help for usage`) and `SystemExit(2)`."""
    try:
        return action()
    except KeyboardInterrupt:  # Ctrl-C outside a run that saves on it: no traceback, the shell's status
        say(f"{label}: interrupted", INTERRUPT_EXIT_CODE)  # one line per job under the launcher
        raise SystemExit(INTERRUPT_EXIT_CODE) from None
    except UsageError as error:  # one line too; the usage is --help's
        say(f"{label}: {error}; {label} --help for usage", 2)
        raise SystemExit(2) from None
    except (CommandError, RecipeNotFound) as error:
        say(f"{label}: {error}", 2)
        raise SystemExit(2) from None
