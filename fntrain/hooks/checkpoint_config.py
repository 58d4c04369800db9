"""The checkpoint hook's settings [S36]: `SaveConfig` (when and how to save, its value rules in
`validate`) and `saves_at_end` (whether a run's final step is checkpointed). Touches nothing: the run's
first phase, the standard hook list and the hook (`fntrain.hooks.checkpoint`, which re-exports these
names) all read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fntrain.config import require_bool, require_choice, require_float, require_int, require_str
from fntrain.hooks.signals import DEFAULT_EXIT_CODE, signal_numbers

__all__ = ["SaveConfig", "saves_at_end"]


@dataclass(frozen=True)
class SaveConfig:
    """When and how to save checkpoints."""

    dir: str | None = None
    """Checkpoint root (None: <run_dir>/checkpoints)."""
    save_every: int = 0
    """Save every K optimizer steps (0: off)."""
    save_epochs: int = 0
    """Save every K epochs, at the epoch's end (0: off)."""
    save_at_end: bool = True
    """Also save after the last step if unsaved, when a cadence is set or checkpoint.restore_from is not none (its default auto included: a rerun of the command then resumes the run or finds it complete)."""
    keep_last: int = 3
    """Keep the newest K complete checkpoints, delete older ones, each deletion logged (0: keep all)."""
    keep_best: bool = True
    """With keep_last, also keep the checkpoint with the lowest val_loss (evaluated at its step), if any."""
    async_save: bool = False
    """Write checkpoints in the background (dcp.async_save); training waits only for the staging copy.
    DataLoader workers starting (each epoch) wait for a write in flight: forked during it, one can hang."""
    save_on_interrupt: bool = False
    """On Ctrl-C, save at the next step boundary and stop (exit status 130); a second Ctrl-C exits at once."""
    preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signals that request a save at the next step boundary and a clean exit (empty: none)."""
    preempt_check_every: int = 10
    """Multi-rank runs: agree on a preemption request and a time-based save every K steps (a tiny CPU all-reduce)."""
    preempt_exit_code: int = DEFAULT_EXIT_CODE
    """Exit status of a run stopped by a preemption signal after its checkpoint (143 = 128 + SIGTERM)."""
    save_every_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (0: off); rank 0's clock decides."""
    time_based_temporary: bool = False
    """Mark time-based checkpoints temporary: each is deleted once a newer checkpoint is complete."""
    abort_wait_s: float = 60.0
    """On a failure, wait at most this long for an async save in flight before abandoning it."""
    thread_count: int = 1
    """Writer threads per rank."""
    on_save_failure: Literal["stop", "continue"] = "stop"
    """A save that fails (disk full, quota, I/O error): stop (exit status 1, resumable from the newest good checkpoint) or continue (warn, try again at the next cadence)."""
    make_room: bool = False
    """When a save will not fit, first delete the oldest verified checkpoints that keep_last (>= 2) would delete after it."""

    @property
    def enabled(self) -> bool:
        """Checkpointing is on when a cadence is set; preemption and interrupt saves need it too."""
        return self.save_every > 0 or self.save_epochs > 0 or self.save_every_minutes > 0

    def validate(self, prefix: str = "checkpoint") -> None:
        require_str(f"{prefix}.dir", self.dir, optional=True, non_empty=True)
        for name in ("save_every", "save_epochs", "keep_last"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=0)
        require_int(f"{prefix}.preempt_check_every", self.preempt_check_every, min=1)
        require_int(f"{prefix}.thread_count", self.thread_count, min=1)
        for name in ("save_at_end", "keep_best", "async_save", "save_on_interrupt", "time_based_temporary",
                     "make_room"):  # fmt: skip
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_float(f"{prefix}.abort_wait_s", self.abort_wait_s, min=0.0)
        require_float(f"{prefix}.save_every_minutes", self.save_every_minutes, min=0.0)
        require_int(f"{prefix}.preempt_exit_code", self.preempt_exit_code, min=0, max=255)
        require_choice(f"{prefix}.on_save_failure", self.on_save_failure, ("stop", "continue"))
        signal_numbers(self.preempt_signals, f"{prefix}.preempt_signals")


def saves_at_end(config: SaveConfig, restoring: bool) -> bool:
    """Whether the run's final step is checkpointed: save_at_end, when a cadence is set or the run
    restores from a checkpoint (`restoring`: checkpoint.restore_from is not none; a run extended that
    way ends with a checkpoint of its new end)."""
    return config.save_at_end and (config.enabled or restoring)
