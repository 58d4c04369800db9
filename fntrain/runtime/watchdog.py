"""Hang watchdog: notice a step that takes far longer than the recent ones, dump every thread's stack on
every rank, abort with a clear message.

The monitor of one rank: `Watchdog` (a resource: `start()`, `stop()`), driven by the watchdog hook
(`fntrain.hooks.watchdog`), which only records monotonic timestamps (no syncs, no allocations worth
naming): a heartbeat at TRAIN_BEGIN, EPOCH_BEGIN, STEP_BEGIN, STEP_END and EPOCH_END, and at STEP_END
the step period (the time since the previous STEP_END). The monitor thread (started at TRAIN_BEGIN,
stopped and joined at TRAIN_END / ABORT) wakes every `poll_s` and compares the time since the last
heartbeat with

    limit = max(floor_s, factor x median(the last `window` step periods))

During the first `grace_steps` steps of this run (compilation, warm-up, the first collectives) the limit
is max(floor_s, grace_s), and those steps do not enter the median. The last in the hook list, the
watchdog's silence covers the step itself and every other hook's work (metric syncs, evaluation,
checkpoint saves), so `floor_s` must exceed the longest legitimate pause of a run.

When the limit is passed, on this rank:
1. every thread's Python stack is appended to `<run_dir>/stacks/rank_<r>.txt` (faulthandler, which
   reads the threads without their cooperation, so a main thread blocked inside a collective or a
   C call is dumped as it is), under a header naming the step, the silence and the limit;
2. `<run_dir>/stacks/HANG` is written; every other rank's watchdog polls for it and, seeing it, dumps
   its own stacks and aborts as well (ranks not hung themselves, e.g. waiting in a collective, still
   leave their stacks; needs a run directory all ranks can see, else each rank relies on its own
   limit, which a hung collective passes on every rank);
3. a CRITICAL log line says what happened and where the stacks are;
4. the process ends with `os._exit(exit_code)` (124 by default): the only way out that works whatever
   the main thread is stuck in (a blocked collective never returns to Python, so neither an exception
   in the main thread nor `sys.exit` could end it). No atexit handlers or finalizers run; log handlers
   and stdio are flushed first. Under `torchrun --max-restarts N` the job is then restarted (and with
   `--checkpoint.restore-from auto` resumes from its last checkpoint).

Collective timeouts are separate: `runtime.timeout_s` is given to `init_process_group`, so a rank
waiting for its peers longer than that fails on its own (NCCL's watchdog, gloo's timeout).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fntrain.config import require_bool, require_float, require_int

__all__ = [
    "EXIT_CODE",
    "HANG_MARKER",
    "THREAD_NAME",
    "WatchdogConfig",
    "Watchdog",
    "hard_exit",
    "flush_outputs",
]

log = logging.getLogger("fntrain.watchdog")

EXIT_CODE = 124  # "timed out", as GNU timeout reports it
HANG_MARKER = "HANG"
THREAD_NAME = "fntrain-watchdog"


@dataclass(frozen=True)
class WatchdogConfig:
    """When a silent step counts as a hang (see fntrain.runtime.watchdog)."""

    enabled: bool = True
    """Watch for hangs (a monitor thread per rank; the steps only record timestamps)."""
    factor: float = 10.0
    """A silence longer than factor x the median recent step period (and floor_s) is a hang."""
    floor_s: float = 600.0
    """Never fire before this many seconds of silence: above the longest checkpoint save or evaluation."""
    grace_steps: int = 3
    """The first steps of a run (compilation, warm-up) are allowed grace_s and stay out of the median."""
    grace_s: float = 1800.0
    """Limit during the first grace_steps steps (and until a step period is known)."""
    window: int = 100
    """Recent step periods the median is taken over."""
    poll_s: float = 1.0
    """How often the monitor thread looks."""
    exit_code: int = EXIT_CODE
    """Exit status of a process the watchdog aborts."""

    def validate(self, prefix: str = "watchdog") -> None:
        require_bool(f"{prefix}.enabled", self.enabled)
        require_float(f"{prefix}.factor", self.factor, min=1.0)
        require_float(f"{prefix}.floor_s", self.floor_s, min=0.0, min_exclusive=True)
        require_int(f"{prefix}.grace_steps", self.grace_steps, min=0)
        require_float(f"{prefix}.grace_s", self.grace_s, min=0.0)
        require_int(f"{prefix}.window", self.window, min=1)
        require_float(f"{prefix}.poll_s", self.poll_s, min=0.0, min_exclusive=True)
        require_int(f"{prefix}.exit_code", self.exit_code, min=1, max=255)


def flush_outputs() -> None:
    """Flush the root logger's handlers and stdio (best effort)."""
    for handler in list(logging.getLogger().handlers) + list(log.handlers):
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - on the way out
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def hard_exit(code: int) -> None:
    """`os._exit(code)`: ends the process whatever its threads are blocked in (outputs were flushed)."""
    os._exit(code)


class Watchdog:
    """The monitor thread of one rank (a resource: `start()`, `stop()`).

    `beat(what, step)` and `step_done()` are what the training thread calls (attribute stores and a
    deque append); `check()` is one look of the monitor, public so tests can drive it with a fake
    `clock` and no thread. `abort(exit_code)` ends the process (default `hard_exit`); a test may pass
    one that returns, after which the watchdog stays quiet.
    """

    def __init__(
        self,
        config: WatchdogConfig,
        *,
        rank: int,
        stacks_dir: str | os.PathLike,
        clock: Callable[[], float] = time.monotonic,
        abort: Callable[[int], Any] = hard_exit,
        world_size: int = 1,
    ) -> None:
        self.config, self.rank, self.clock, self._abort = config, rank, clock, abort
        self.world_size = world_size
        self.stacks_dir = Path(stacks_dir)
        self.stack_file = self.stacks_dir / f"rank_{rank}.txt"
        self._periods: deque[float] = deque(maxlen=config.window)
        self._beat = (clock(), "start", 0)  # (time, what, step): replaced whole, read whole
        self._steps_done = 0
        self._last_step_end: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_wall = time.time()
        self.fired = False

    # -- the training thread
    def beat(self, what: str, step: int) -> None:
        self._beat = (self.clock(), what, step)

    def step_done(self, step: int) -> None:
        now = self.clock()
        self._beat = (now, "after step", step)
        self._steps_done += 1
        if self._steps_done > self.config.grace_steps and self._last_step_end is not None:
            self._periods.append(now - self._last_step_end)
        self._last_step_end = now

    # -- the monitor
    def limit(self) -> tuple[float, str]:
        """(seconds of silence allowed now, how that number came about)."""
        config = self.config
        periods = list(self._periods)
        if self._steps_done < config.grace_steps or not periods:
            limit = max(config.floor_s, config.grace_s)
            return limit, f"start-up grace: max(floor {config.floor_s:g} s, grace {config.grace_s:g} s)"
        median = statistics.median(periods)
        limit = max(config.floor_s, config.factor * median)
        return limit, (
            f"max(floor {config.floor_s:g} s, {config.factor:g} x median step {median:.3g} s "
            f"over the last {len(periods)} steps)"
        )

    def check(self) -> bool:
        """Look once; fire (dump, log, abort) when the limit is passed or a peer reported a hang.
        Returns True when it fired."""
        if self.fired:
            return False
        at, what, step = self._beat
        silence = self.clock() - at
        limit, why = self.limit()
        if silence > limit:
            self._fire(
                f"no progress for {silence:.1f} s {self._where(what, step)} (limit {limit:.1f} s = {why})"
            )
            return True
        peer = self._peer_report()
        if peer is not None:
            self._fire(
                f"rank {peer.get('rank')} reported a hang ({peer.get('reason', '?')}); this rank: "
                f"{silence:.1f} s {self._where(what, step)}"
            )
            return True
        return False

    @staticmethod
    def _where(what: str, step: int) -> str:
        if what == "step":
            return f"inside step {step}"
        if what == "after step":
            return f"after step {step} (hooks, data loading)"
        return f"since {what} (step {step})"

    def _peer_report(self) -> dict[str, Any] | None:
        marker = self.stacks_dir / HANG_MARKER
        try:
            if marker.stat().st_mtime < self._started_wall:
                return None  # left by an earlier launch of the job
            report = json.loads(marker.read_text() or "{}")
        except (OSError, ValueError):
            return None
        return report if isinstance(report, dict) and report.get("rank") != self.rank else None

    def _fire(self, reason: str) -> None:
        self.fired = True
        first_to_report = False
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            self.stacks_dir.mkdir(parents=True, exist_ok=True)
            with open(self.stack_file, "a") as handle:
                handle.write(
                    f"=== fntrain watchdog, rank {self.rank}, pid {os.getpid()}, {stamp}: {reason}\n"
                )
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
                handle.write("\n")
            marker = self.stacks_dir / HANG_MARKER
            if self._peer_report() is None:  # none yet from this launch (an older one is replaced)
                tmp = marker.with_name(f".{HANG_MARKER}.{self.rank}.tmp")
                tmp.write_text(json.dumps({"rank": self.rank, "reason": reason, "time": time.time()}))
                os.replace(tmp, marker)
                first_to_report = True
        except OSError as error:
            log.error("watchdog could not write the stack dump to %s: %r", self.stack_file, error)

        def report() -> None:
            log.critical(
                "watchdog: rank %d: %s; every thread's stack is in %s; aborting with exit status %d",
                self.rank, reason, self.stack_file, self.config.exit_code,
            )  # fmt: skip
            flush_outputs()

        # Logging takes handler locks that a hung main thread may hold (stuck writing to a full pipe):
        # report from a helper thread and abort anyway after a few seconds.
        reporter = threading.Thread(target=report, name=f"{THREAD_NAME}-report", daemon=True)
        reporter.start()
        reporter.join(5.0)
        if first_to_report and self.world_size > 1:
            # This rank's exit breaks its peers' collectives, and a peer whose collective fails aborts
            # (its watchdog stops) before it dumps: give them a few polls to see the marker and dump.
            time.sleep(min(10.0, 3 * self.config.poll_s + 0.5))
        self._abort(self.config.exit_code)

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            try:
                if self.check():
                    return
            except Exception:  # noqa: BLE001 - a watchdog bug must not kill training
                log.exception("watchdog check failed; the watchdog stops")
                return

    def start(self) -> None:
        if self._thread is None:
            self._started_wall = time.time()
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop and join the thread; True when it ended (or never started)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()
