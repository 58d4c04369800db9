"""An async checkpoint write and the DataLoader workers forked while it runs: the fork waits for the
write, so no worker inherits a C library lock the write thread held (the hang of
`tests/checkpoint/test_resume.py::test_sigkill_inside_a_step_resumes_bit_for_bit`, issue 49: a resumed
run's first save, an epoch end, then the next epoch's workers; one worker blocked for ever in
`torch.set_num_threads` at its start, pytorch#130610)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
from torch.distributed.checkpoint import FileSystemWriter

import fntrain.checkpoint.async_save as async_save
from fntrain.checkpoint.saver import SaveTarget
from fntrain.state import TrainState
from tests.checkpoint import toy
from tests.helpers.waiting import run_to_end


def test_a_fork_returns_once_the_write_in_flight_has_finished(tmp_path, monkeypatch):
    released = threading.Event()

    class HeldWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            assert released.wait(60), "the test never released the write"
            return super().write_data(plan, planner)

    monkeypatch.setattr(async_save, "writer", lambda path, thread_count: HeldWriter(path, thread_count=thread_count))
    pending = async_save.save_async(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    assert not pending.done()
    threading.Timer(0.2, released.set).start()
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    assert released.is_set() and pending.done()  # the fork waited for the write and its completion
    assert pending.result() == tmp_path / "step_1"


@pytest.mark.slow
def test_workers_forked_during_a_write_start(tmp_path):
    """25 epochs of 2 workers forked while writes hold glibc's exit-function lock most of the time
    (tests/checkpoint/fork_during_write_worker.py). Without the wait every run of it hung; with it, each
    epoch's workers start once the write has finished."""
    done = run_to_end(
        [sys.executable, "-m", "tests.checkpoint.fork_during_write_worker", str(tmp_path / "checkpoints"), "5", "5"],
        "25 epochs of DataLoader workers forked during async checkpoint writes", 180,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "ok\n", done.stdout + done.stderr[-3000:]
    assert done.stderr.count("a fork waited") >= 5  # each save's first epoch waited for its write
