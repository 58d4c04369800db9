"""A wait for another process is bounded, and one that runs out fails naming what it waited for, with
the stacks of the process and of its children (the tests' own promise: a hang is never silent)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers.waiting import is_alive, process_tree, run_to_end, spawn_to_end, wait_for_end

# A parent stuck in a wait for its child, the child stuck in a sleep of its own: the shape of a run
# waiting on a DataLoader worker or a torchrun agent on its workers.
STUCK = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time\\ndef child_stuck_here():\\n    time.sleep(600)\\nchild_stuck_here()"])
print("started", flush=True)
def parent_waits_here():
    child.wait()
parent_waits_here()
"""


def test_a_wait_that_runs_out_names_it_and_shows_every_process_stack():
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_to_end([sys.executable, "-c", STUCK], "the stuck pair", timeout=3)
    message = str(failure.value)
    assert message.startswith("the stuck pair did not end within 3 s")
    assert "started" in message  # the output before the hang
    assert "parent_waits_here" in message and "child_stuck_here" in message  # both processes' stacks
    assert time.monotonic() - started < 60


def test_nothing_it_started_outlives_a_wait_that_ran_out(tmp_path):
    with open(tmp_path / "out", "w+") as out:
        process = subprocess.Popen([sys.executable, "-c", STUCK], stdout=out, stderr=subprocess.STDOUT, text=True)
        while "started" not in (tmp_path / "out").read_text():
            time.sleep(0.01)
        tree = process_tree(process.pid)
        assert len(tree) == 2
        with pytest.raises(AssertionError, match="^the pair did not end within 1 s"):
            wait_for_end(process, "the pair", 1, lambda: "")
    assert process.returncode is not None
    assert not any(is_alive(pid) for pid in tree)


def test_a_process_that_ends_in_time_is_its_result():
    done = run_to_end([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                      "a quick command", timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")



@pytest.mark.slow
def test_a_command_of_the_fork_server_and_its_children_show_their_stacks(tmp_path, fork_env):
    """Through the fork server the command is the server's child, not the launcher's: the launcher passes
    the abort on to the command and to the command's children."""
    module = tmp_path / "stuck_pair.py"
    module.write_text(STUCK)
    with pytest.raises(AssertionError) as failure:
        run_to_end([fork_env["PYTHON_FORK"], "-m", "stuck_pair"], "the forked pair", timeout=8, cwd=tmp_path,
                   env=fork_env)  # fmt: skip
    message = str(failure.value)
    assert message.startswith("the forked pair did not end within 8 s")
    assert "parent_waits_here" in message and "child_stuck_here" in message


def _rank_one_stuck(rank: int) -> None:
    if rank == 1:
        time.sleep(600)


@pytest.mark.slow
def test_spawned_ranks_that_do_not_end_are_named():
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^two ranks did not end within 20 s: rank\(s\) \[1\] still running"):
        spawn_to_end(_rank_one_stuck, (), 2, "two ranks", 20)
    assert time.monotonic() - started < 60
