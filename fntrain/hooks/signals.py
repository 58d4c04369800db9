"""Preemption notices [S19]: a signal asks the run to save at the next step boundary and stop.

    result = train(state, step_fn, hooks, data=data, plan=plan)  # hooks include the checkpoint hook
    if result.outcome == "preempted":   # after the runtime's clean teardown
        sys.exit(result.exit_code)      # 143 by default, like a process ended by SIGTERM

What happens, in order:
1. The first signal (any of the configured ones) only sets a flag and logs a warning; the handler
   then gives every configured signal its default disposition again, so
2. a second signal terminates the process at once, by the kernel (no Python code needs to run, which
   works even while the main thread is blocked in a collective): the shell and torchrun report
   128 + the signal number (143 for SIGTERM).
3. The checkpoint hook builds its own `Preemption` and polls the flag at step boundaries through the
   agreement (`fntrain.hooks.preemption`; with several ranks: one small all-reduce every
   `preempt_check_every` steps, so every rank stops at the same step), saves, and ends the run cleanly
   with `StopTraining(outcome="preempted", exit_code=checkpoint.preempt_exit_code)`: TRAIN_END runs and
   `train` returns a `TrainResult` saying so.
4. The launcher leaves its runtime normally (barrier, process group destroyed) and exits with the
   result's exit code (`fntrain run` does: default 143, like a process ended by SIGTERM, so a scheduler
   sees a terminated job, not a finished one) without a traceback.

Handlers exist only between `install()` and `uninstall()`, only in the main thread (Python's rule), and
are restored to what was there before. Standard library only.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from typing import Any

__all__ = [
    "DEFAULT_EXIT_CODE",
    "DEFAULT_SIGNALS",
    "INTERRUPT_EXIT_CODE",
    "Preemption",
    "preemption_reason",
    "signal_numbers",
]

log = logging.getLogger("fntrain.hooks.signals")

DEFAULT_EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a process ended by SIGTERM
INTERRUPT_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a process ended by Ctrl-C
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


class Preemption:
    """The preemption signal handlers of this process (a resource: `install()` / `uninstall()`).

    `requested` is True once a configured signal arrived (or `request()` was called); `received` names
    it. How the run ended is not kept here: it is the `TrainResult` that `train` returns.
    """

    def __init__(
        self, signals: Iterable[str] = DEFAULT_SIGNALS, *, exit_code: int = DEFAULT_EXIT_CODE, interrupt: bool = False,
        when: str = "at the next step boundary",
    ):
        """`interrupt`: Ctrl-C (SIGINT) is a notice too (`checkpoint.save_on_interrupt`): the first one
        asks for a save at the next step boundary, a second one ends the process at once. `when` says in
        the notice's warning where the save happens (several ranks stop only at agreed steps)."""
        self.signals = tuple(signals)
        self._numbers = signal_numbers(self.signals) + ((int(signal.SIGINT),) if interrupt else ())
        if type(exit_code) is not int or not 0 <= exit_code <= 255:
            raise ValueError(f"checkpoint.preempt_exit_code must be an int in [0, 255], got {exit_code!r}")
        self.exit_code = exit_code
        self.when = when
        self._flag = threading.Event()
        self._previous: dict[int, Any] = {}
        self.received: str | None = None

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
        log.warning("%s received: saving a checkpoint %s, then stopping (a second signal terminates at once)",
                    name, self.when)  # fmt: skip


def preemption_reason(signal_name: str | None, step: int, received_at: int | None = None) -> str:
    """The `StopTraining` reason of a preemption stop at `step`; `received_at`: the step during which
    this rank saw the notice, named when the ranks' agreement stopped them later than that."""
    reason = f"preempted by {signal_name or 'a notice on another rank'} at step {step}"
    if received_at is not None and received_at < step:
        reason += (f" (received during step {received_at}; the ranks stop together every "
                   "--checkpoint.preempt-check-every steps)")  # fmt: skip
    return reason
