"""Preemption notices [S19]: a signal asks the run to save at the next step boundary and stop.

    preemption = Preemption(("SIGTERM", "SIGUSR1"), exit_code=143)
    hooks = [..., checkpoint_hook(config, components, runtime, directory=root, preemption=preemption)]
    final = train(state, step_fn, hooks, data=data, plan=plan)   # installs / removes the handlers
    preemption.raise_if_stopped(final)        # raises Preempted (a SystemExit) after a preemption stop

What happens, in order:
1. The first signal (any of the configured ones) only sets a flag and logs a warning; the handler
   then gives every configured signal its default disposition again, so
2. a second signal terminates the process at once, by the kernel (no Python code needs to run, which
   works even while the main thread is blocked in a collective): the shell and torchrun report
   128 + the signal number (143 for SIGTERM).
3. The checkpoint hook polls the flag at step boundaries (with several ranks: one small all-reduce every
   `preempt_check_every` steps, so every rank stops at the same step), saves, records the step in
   `stopped_at` and ends the run cleanly (`StopTraining`: TRAIN_END runs).
4. The recipe leaves its runtime normally (barrier, process group destroyed) and raises `Preempted`, a
   `SystemExit` carrying `exit_code`: the process exits with that status (default 143, like a process
   ended by SIGTERM, so a scheduler sees a terminated job, not a finished one) without a traceback.

Handlers exist only between `install()` and `uninstall()`, only in the main thread (Python's rule), and
are restored to what was there before. Standard library only.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["DEFAULT_EXIT_CODE", "DEFAULT_SIGNALS", "Preempted", "Preemption", "signal_numbers"]

log = logging.getLogger("fntrain.preemption")

DEFAULT_EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a process ended by SIGTERM
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
_FORBIDDEN = ("SIGKILL", "SIGSTOP", "SIGINT")


def signal_numbers(names: Iterable[str], field: str = "checkpoint.preempt_signals") -> tuple[int, ...]:
    """The signal numbers of `names` (like "SIGTERM"); a bad or forbidden name is a `ValueError`
    naming `field`. SIGINT stays Ctrl-C (KeyboardInterrupt); SIGKILL and SIGSTOP cannot be caught."""
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise TypeError(f"{field} must be a tuple of signal names, got {names!r}")
    numbers = []
    for name in names:
        if not isinstance(name, str) or not name.startswith("SIG") or not hasattr(signal, name):
            raise ValueError(f"{field} must name signals like SIGTERM, got {name!r}")
        if name in _FORBIDDEN:
            raise ValueError(f"{field} cannot include {name} (SIGINT is save_on_interrupt)")
        numbers.append(int(getattr(signal, name)))
    return tuple(numbers)


class Preempted(SystemExit):
    """A run stopped cleanly on a preemption notice, its checkpoint saved. A `SystemExit` whose code is
    the documented exit status, so an entry point that lets it propagate exits with it (no traceback);
    `state` is the final `TrainState`, `signal_name` the signal (or "request")."""

    def __init__(self, state: Any, *, signal_name: str | None, exit_code: int = DEFAULT_EXIT_CODE):
        super().__init__(exit_code)
        self.state, self.signal_name, self.exit_code = state, signal_name, exit_code

    def __str__(self) -> str:
        step = getattr(self.state, "global_step", "?")
        return (
            f"preempted by {self.signal_name or 'a request'}: stopped after step {step} with a checkpoint; "
            f"exit status {self.exit_code}"
        )


class Preemption:
    """The preemption signal handlers of this process (a resource: `install()` / `uninstall()`).

    `requested` is True once a configured signal arrived (or `request()` was called); `received` names
    it; `stopped_at` is the step at which the checkpoint hook stopped the run (None: not stopped).
    """

    def __init__(self, signals: Iterable[str] = DEFAULT_SIGNALS, *, exit_code: int = DEFAULT_EXIT_CODE):
        self.signals = tuple(signals)
        self._numbers = signal_numbers(self.signals)
        if type(exit_code) is not int or not 0 <= exit_code <= 255:
            raise ValueError(f"checkpoint.preempt_exit_code must be an int in [0, 255], got {exit_code!r}")
        self.exit_code = exit_code
        self._flag = threading.Event()
        self._previous: dict[int, Any] = {}
        self.received: str | None = None
        self.stopped_at: int | None = None

    @property
    def requested(self) -> bool:
        return self._flag.is_set()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def request(self, reason: str = "request") -> None:
        """Ask for a save-and-stop without a signal (e.g. from a scheduler's API poller thread)."""
        if self.received is None:
            self.received = reason
        self._flag.set()

    def install(self) -> bool:
        """Install the handlers (main thread only: elsewhere Python forbids it and this is a no-op).
        Returns whether handlers are now installed; calling it again is harmless."""
        if self._previous or not self._numbers:
            return bool(self._previous)
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals not installed: not in the main thread")
            return False
        for number in self._numbers:
            self._previous[number] = signal.signal(number, self._on_signal)
        return True

    def uninstall(self) -> None:
        """Restore the handlers that were there before `install()`; idempotent."""
        for number, handler in self._previous.items():
            try:
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):  # not the main thread, or an interpreter shutting down
                pass
        self._previous.clear()

    stop = uninstall

    def raise_if_stopped(self, state: Any) -> None:
        """Raise `Preempted` (exit status `exit_code`) when the run was stopped by a preemption notice."""
        if self.stopped_at is not None:
            raise Preempted(state, signal_name=self.received, exit_code=self.exit_code)

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
        self._flag.set()
        # The next notice must end the process even if the main thread never returns to Python (a hung
        # collective): the kernel's default action needs no Python code.
        for number in self._previous:
            try:
                signal.signal(number, signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        log.warning(
            "%s received: saving a checkpoint at the next step boundary, then stopping "
            "(a second signal terminates at once)",
            name,
        )
