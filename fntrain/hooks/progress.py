"""Progress bar: a tqdm bar on rank 0, advanced every step, its postfix refreshed on logging steps.

The bar counts optimizer steps of the whole run: total = `train_iters`, initial = the global step the run
starts from (a resumed run starts part-way). Its postfix (loss, an RL run's reward, grad_norm, lr,
tokens/s, step time) comes from the metrics log's last record (`latest`, e.g. `MetricsLog.latest`: the
progress hook goes after the metrics hook) and is refreshed only on the steps that record is made; on other steps the hook advances
the bar by one and reads nothing from the device. The bar opens at TRAIN_BEGIN and closes once, at
TRAIN_END or ABORT. tqdm is imported when the hook is built on rank 0, never by `import fntrain`; without
tqdm the hook warns once and shows no bar. While the bar is open, log records are routed through `tqdm.write` so they
do not break it.

Without a terminal (stderr redirected to a file or a pipe) there is no bar: the metrics hook's log lines,
every `log_every` steps, tell the progress instead of a bar redrawn between them. The progress bars of
other libraries (transformers, HF datasets and hub) follow `progress.enabled`, for those already imported.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from fntrain.config import require_bool, require_float, require_int
from fntrain.hooks.base import cadence
from fntrain.loop import Event, Hook
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["ProgressConfig", "progress_hook", "format_postfix", "set_library_progress_bars"]

log = logging.getLogger("fntrain.hooks.progress")


@dataclass(frozen=True)
class ProgressConfig:
    """The progress bar (rank 0)."""

    enabled: bool = True
    """Progress bar on a terminal; off also turns off the transformers / HF datasets / hub bars."""
    mininterval: float = 0.5
    """Least seconds between two redraws of the bar."""
    leave: bool = True
    """Keep the finished bar on screen."""
    redirect_logging: bool = True
    """Route log records through tqdm.write while the bar is open, so they print above it."""

    def validate(self, prefix: str = "progress") -> None:
        require_bool(f"{prefix}.enabled", self.enabled)
        require_float(f"{prefix}.mininterval", self.mininterval, min=0.0)
        require_bool(f"{prefix}.leave", self.leave)
        require_bool(f"{prefix}.redirect_logging", self.redirect_logging)


_POSTFIX = (
    ("loss", "loss", "{:.4f}"),
    ("reward", "reward", "{:.3f}"),  # an RL objective's mean reward (GRPO)
    ("grad_norm", "grad_norm", "{:.3f}"),
    ("lr", "lr", "{:.3e}"),
    ("tokens_per_s", "tok/s", "{:.4g}"),
    ("step_time_s", "step", "{:.3g}s"),
)


def format_postfix(metrics: Mapping[str, Any]) -> str:
    """The bar's postfix from a record: loss, reward, grad_norm, lr (.3e), tokens/s, step time; absent ones skipped."""
    parts = []
    for name, label, form in _POSTFIX:
        value = metrics.get(name)
        if value is not None:
            parts.append(f"{label}={form.format(float(value))}")
    return ", ".join(parts)


def _inactive(event: Event, state: TrainState, info: Any) -> None:
    """The progress hook off rank 0, when disabled, or without tqdm: nothing happens."""


def progress_hook(
    config: ProgressConfig,
    runtime: Runtime,
    *,
    total: int,
    latest: Callable[[], Mapping[str, Any]] | None = None,
    log_every: int = 0,
    file: TextIO | None = None,
) -> Hook:
    """The progress bar hook: rank 0 only, `total` = the plan's train_iters.

    The postfix is refreshed from `latest()`, the last metrics record (with its "step"), on the steps it
    was made; without `latest`, on every `log_every`-th step from the step's own metrics (rank 0's
    values, read on those steps only).
    `file` is where the bar is drawn (None: stderr, and then only when stderr is a terminal). Turns the
    third-party progress bars on or off with `config.enabled` (see `set_library_progress_bars`).
    """
    config.validate()
    require_int("total", total, min=1)
    require_int("log_every", log_every, min=0)
    set_library_progress_bars(config.enabled)
    if not config.enabled or runtime.rank != 0:
        return _inactive
    if file is None and not _stderr_is_terminal():
        return _inactive  # the periodic metrics log lines stand in for the bar
    imported = _import_tqdm(config.redirect_logging)
    if imported is None:
        return _inactive
    tqdm, redirect = imported
    memory = _ProgressMemory()
    due = cadence(log_every)

    def progress(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_END:
            if memory.bar is not None:
                _refresh(memory.bar, latest, due, state, info)  # before the update, which redraws
                memory.bar.update(1)
        elif event is Event.EPOCH_BEGIN:
            if memory.bar is not None:
                memory.bar.set_description(f"epoch {state.epoch}", refresh=False)
        elif event is Event.TRAIN_BEGIN:
            _close(memory)  # a previous run on this hook that neither ended nor aborted
            bar_options = dict(total=total, file=file, leave=config.leave, mininterval=config.mininterval)
            _open(memory, tqdm, redirect, state, bar_options)
        elif event is Event.TRAIN_END or event is Event.ABORT:
            _close(memory)

    return progress


def _import_tqdm(redirect_logging: bool) -> tuple[Any, Any] | None:
    """(tqdm, logging_redirect_tqdm or None), imported now: only a rank-0 bar on a terminal pays for
    tqdm. None (after one warning) when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        warnings.warn(
            "progress: tqdm is not installed; training runs without a progress bar", UserWarning, stacklevel=3
        )
        return None
    if not redirect_logging:
        return tqdm, None
    from tqdm.contrib.logging import logging_redirect_tqdm

    return tqdm, logging_redirect_tqdm


def _stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


def set_library_progress_bars(enabled: bool) -> list[str]:
    """Turn the progress bars of transformers, HF datasets and huggingface_hub on or off, for those
    already imported (none is imported here); returns the names of the libraries set."""
    switches = (
        ("transformers", "transformers.utils.logging", "enable_progress_bar", "disable_progress_bar"),
        ("datasets", "datasets.utils", "enable_progress_bars", "disable_progress_bars"),
        ("huggingface_hub", "huggingface_hub.utils", "enable_progress_bars", "disable_progress_bars"),
    )
    done = []
    for package, module_name, enable, disable in switches:
        if sys.modules.get(package) is None:
            continue
        module = sys.modules.get(module_name)
        if module is None:
            try:  # a submodule of a package already imported: cheap
                import importlib

                module = importlib.import_module(module_name)
            except ImportError:
                continue
        switch = getattr(module, enable if enabled else disable, None)
        if switch is not None:
            switch()
            done.append(package)
    return done


@dataclass(slots=True)
class _ProgressMemory:
    """What the progress hook remembers between events."""

    bar: Any = None  # the tqdm bar from TRAIN_BEGIN until TRAIN_END / ABORT
    redirecting: Any = None  # the entered logging_redirect_tqdm context, if any


def _open(memory: _ProgressMemory, tqdm: Any, redirect: Any, state: TrainState, options: dict) -> None:
    """Enter the logging redirection (when `redirect`) and open the bar at the run's current step."""
    if redirect is not None:
        memory.redirecting = redirect()
        memory.redirecting.__enter__()
    memory.bar = tqdm(initial=state.global_step, desc=f"epoch {state.epoch}", unit="step", dynamic_ncols=True,
                      **options)  # fmt: skip


def _close(memory: _ProgressMemory) -> None:
    """Close the bar and leave the logging redirection, once."""
    opened, memory.bar = memory.bar, None
    context, memory.redirecting = memory.redirecting, None
    try:
        if opened is not None:
            opened.close()
            _stop_monitor(type(opened))
    finally:
        if context is not None:
            context.__exit__(None, None, None)


def _stop_monitor(bar_cls: Any) -> None:
    """End tqdm's monitor thread once no bar is open: tqdm starts it with the first bar and leaves it
    running, and a run must end with no thread it started."""
    monitor = getattr(bar_cls, "monitor", None)
    if monitor is not None and not getattr(bar_cls, "_instances", None):
        with bar_cls.get_lock():
            bar_cls.monitor = None
        monitor.exit()


def _refresh(
    bar: Any, latest: Callable[[], Mapping[str, Any]] | None, due: Callable[[int], bool], state: TrainState,
    info: Any,
) -> None:  # fmt: skip
    """Set the postfix from the latest record when it is this step's, or from the step's own metrics on
    the steps `due` when there is no `latest`; otherwise leave it."""
    if latest is not None:
        record = latest()
        if record.get("step") != state.global_step:
            return
    elif due(state.global_step):
        record = info.metrics  # format_postfix reads only the names it shows, with float()
    else:
        return
    bar.set_postfix_str(format_postfix(record), refresh=False)
