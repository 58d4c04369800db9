"""Time-based checkpoints: every N minutes of an injected clock, reset by any save, decided by rank 0
alone; optionally temporary, each deleted once a newer checkpoint is complete (never the newest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fntrain import StepInfo, TrainState
from fntrain.checkpoint import (
    SaveOptions,
    SaveTarget,
    is_temporary,
    read_meta,
    remove_superseded_temporary,
    save,
    step_dir,
)
from fntrain.checkpoint.layout import LATEST
from fntrain.hooks.checkpoint import checkpoint_hook
from fntrain.loop import Event
from fntrain.run.config import CheckpointConfig
from fntrain.runtime.runtime import Runtime
from tests.checkpoint import toy
from tests.helpers.checkpoints import saved_steps
from tests.helpers.ports import free_port
from tests.helpers.workers import run_ranks

ROOT = Path(__file__).resolve().parents[2]
INFO = StepInfo({"loss": 0.0})


class StepClock:
    """Seconds; each step advances it by `per_step`."""

    def __init__(self, per_step: float) -> None:
        self.now, self.per_step = 0.0, per_step

    def __call__(self) -> float:
        return self.now


def timed_saves(tmp_path: Path, steps: int, per_step: float = 25.0, **fields) -> list[int]:
    """Drive the hook for `steps` steps of `per_step` seconds; return the complete checkpoints' steps
    (every one kept unless `keep_last` says otherwise: these tests pin when saves happen)."""
    fields.setdefault("keep_last", 0)
    clock = StepClock(per_step)
    hooks: list = []
    hooks.append(
        checkpoint_hook(CheckpointConfig(**fields), SaveTarget(tmp_path, toy.components(), hooks=lambda: hooks), Runtime(), clock=clock)
    )  # fmt: skip
    hook, state = hooks[0], TrainState()
    hook(Event.TRAIN_BEGIN, state, None)
    for _ in range(steps):
        hook(Event.STEP_BEGIN, state, None)
        clock.now += per_step
        state = state.after_step()
        hook(Event.STEP_END, state, INFO)
    hook(Event.TRAIN_END, state, None)
    return saved_steps(tmp_path)


def test_config_fields_are_validated():
    with pytest.raises(ValueError, match="checkpoint.save_every_minutes must be >= 0"):
        CheckpointConfig(save_every_minutes=-1.0).validate()
    with pytest.raises(TypeError, match="checkpoint.time_based_temporary must be a bool"):
        CheckpointConfig(time_based_temporary=1).validate()
    assert CheckpointConfig(save_every_minutes=5.0).enabled  # a time cadence alone turns saving on


def test_saves_every_n_minutes_of_the_clock(tmp_path):
    # 25 s steps, 1 minute: due after steps 3 (75 s), 6 (150 s, 75 s after the last save), 9; then the end.
    assert timed_saves(tmp_path, 10, save_every_minutes=1.0) == [3, 6, 9, 10]
    assert not any(is_temporary(step_dir(tmp_path, step)) for step in (3, 6, 9, 10))


def test_any_save_restarts_the_timer(tmp_path):
    # save_every 4 saves steps 4 and 8; the timer then counts from them: 3 (75 s), 4, 7 (75 s after 4), 8.
    assert timed_saves(tmp_path, 8, save_every=4, save_every_minutes=1.0, save_at_end=False) == [3, 4, 7, 8]


def test_temporary_time_based_checkpoints_are_removed_once_superseded(tmp_path):
    assert timed_saves(tmp_path / "a", 8, save_every=4, save_every_minutes=1.0, time_based_temporary=True) == [4, 8]
    # The newest complete checkpoint is never removed, temporary or not: stopped after step 7 (time-based).
    root = tmp_path / "b"
    assert timed_saves(
        root, 7, save_every=4, save_every_minutes=1.0, time_based_temporary=True, save_at_end=False
    ) == [4, 7]
    assert is_temporary(step_dir(root, 7)) and not is_temporary(step_dir(root, 4))
    assert read_meta(step_dir(root, 7))["temporary"] is True
    assert (root / LATEST).read_text().strip() == "step_7"


def test_async_temporary_saves_are_removed_by_the_completion_of_the_next(tmp_path):
    steps = timed_saves(
        tmp_path, 10, save_every=5, save_every_minutes=1.0, time_based_temporary=True, async_save=True
    )
    assert steps == [5, 10]


def test_removal_spares_the_newest_and_later_steps(tmp_path):
    parts = toy.components()
    for step, temporary in ((2, True), (4, False), (6, True), (9, True)):
        save(SaveTarget(tmp_path, parts), TrainState(0, step, step), SaveOptions(temporary=temporary))
    # Each save removed the temporary ones below it: 2 went when 4 completed, 6 when 9 completed.
    assert saved_steps(tmp_path) == [4, 9]
    save(
        SaveTarget(tmp_path, parts), TrainState(0, 3, 3), SaveOptions(temporary=False)
    )  # a run resumed from an older step
    assert saved_steps(tmp_path) == [3, 4, 9]  # step 9 (temporary, but above step 3) stays
    assert remove_superseded_temporary(tmp_path, step_dir(tmp_path, 9)) == []  # never itself
    assert remove_superseded_temporary(tmp_path, tmp_path / "step_99") == []  # not a complete checkpoint


def test_two_ranks_follow_rank_0s_clock_and_any_ranks_preemption(tmp_path, fork_env):
    """Rank 1's clock always says a save is due, rank 0's after 60 s (step 6): both save step 6 only.
    Rank 1 alone is asked to stop at step 7: both save and stop at step 8, the next agreement step."""
    root = tmp_path / "ckpt"
    port = free_port()

    def env_of_rank(rank: int) -> dict[str, str]:
        return {**fork_env, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    def command_of_rank(rank: int) -> list[str]:
        return [fork_env["PYTHON_FORK"], "-m", "tests.checkpoint.agree_worker", str(root), str(tmp_path / f"{rank}.json")]

    run_ranks(2, command_of_rank, env_of_rank, "the time-based save workers", 120, tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        expected = {"stopped": 8, "saved": [6, 8], "outcome": "preempted", "exit_code": 143}
        assert result == expected, (rank, result)
