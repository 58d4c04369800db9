"""A run ends with no thread and no child process it started: after a full recipe run through
`fntrain.run.job.run_job` (normal end, abort, StopTraining, progress bar, prefetch, async checkpoints)
`threading.enumerate()` is the set it was before the run."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
from typing import Any

import pytest

from fntrain import Event, StopTraining
from fntrain.data.settings import LoaderConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.run.config import CheckpointConfig
from fntrain.run.job import RunAborted, run_job

tiny_gpt = pytest.importorskip("recipes.tiny_gpt")


def tiny_job_config(tmp_path, **changes: Any):
    config = tiny_gpt.Config(
        run_dir=str(tmp_path / "run"),
        log_every=1,
        model=tiny_gpt.ModelConfig(context=16, n_layer=1, n_head=2, d_model=16),
        train=tiny_gpt.TrainConfig(train_iters=3, global_batch_size=4, micro_batch_size=4),
        progress=ProgressConfig(enabled=False),
    )
    return dataclasses.replace(config, **changes)


def raise_at_step_2(error: BaseException):
    def hook(event: Event, state: Any, info: Any) -> None:
        if event is Event.STEP_END and state.global_step == 2:
            raise error

    return hook


def run_and_compare(config, spec=tiny_gpt.spec, *, raises: type[BaseException] | None = None) -> Any:
    threads, children = set(threading.enumerate()), set(multiprocessing.active_children())
    if raises is None:
        result = run_job(config, spec)
    else:
        with pytest.raises(RunAborted) as aborted:  # a failed run: its one line, raised from the error
            run_job(config, spec)
        assert isinstance(aborted.value.__cause__, raises)
        result = None
    left = set(threading.enumerate()) - threads
    assert not left, f"threads left behind: {sorted(t.name for t in left)}"
    assert set(threading.enumerate()) == threads
    assert set(multiprocessing.active_children()) == children
    return result


def test_a_normal_end_leaves_no_thread(tmp_path):
    result = run_and_compare(tiny_job_config(tmp_path, checkpoint=CheckpointConfig(save_every=2)))
    assert result.state.global_step == 3


def test_an_abort_leaves_no_thread(tmp_path):
    spec = dataclasses.replace(
        tiny_gpt.spec, hooks=lambda built: [raise_at_step_2(RuntimeError("hook failed"))]
    )
    run_and_compare(tiny_job_config(tmp_path, checkpoint=CheckpointConfig(save_every=1)), spec, raises=RuntimeError)


def test_a_stop_training_leaves_no_thread(tmp_path):
    spec = dataclasses.replace(tiny_gpt.spec, hooks=lambda built: [raise_at_step_2(StopTraining("enough"))])
    result = run_and_compare(tiny_job_config(tmp_path), spec)
    assert (result.outcome, result.state.global_step) == ("stopped", 2)


def test_the_progress_bar_leaves_no_thread(tmp_path):
    result = run_and_compare(tiny_job_config(tmp_path, progress=ProgressConfig(enabled=True)))
    assert result.state.global_step == 3


def test_the_progress_bar_leaves_no_thread_on_abort(tmp_path):
    spec = dataclasses.replace(
        tiny_gpt.spec, hooks=lambda built: [raise_at_step_2(RuntimeError("hook failed"))]
    )
    run_and_compare(tiny_job_config(tmp_path, progress=ProgressConfig(enabled=True)), spec, raises=RuntimeError)


def test_prefetch_leaves_no_thread(tmp_path):
    result = run_and_compare(tiny_job_config(tmp_path, loader=LoaderConfig(prefetch=True, prefetch_depth=2)))
    assert result.state.global_step == 3


@pytest.mark.parametrize("fails", [False, True], ids=["normal end", "abort"])
def test_async_save_leaves_no_thread(tmp_path, fails):
    config = tiny_job_config(tmp_path, checkpoint=CheckpointConfig(save_every=1, async_save=True))
    if fails:
        spec = dataclasses.replace(
            tiny_gpt.spec, hooks=lambda built: [raise_at_step_2(RuntimeError("hook failed"))]
        )
        run_and_compare(config, spec, raises=RuntimeError)
    else:
        run_and_compare(config)
