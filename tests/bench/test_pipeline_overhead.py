"""The pipeline-step benchmark (bench/pipeline_overhead.py): when rounds stop, the pipeline's time per round
(the slower rank's), the torchrun command and the rows; the 2-rank run itself in the slow tier."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from bench.harness import Timing
from bench.pipeline_overhead import (
    GOAL_RATIO,
    STAGES,
    keep_going,
    launch_command,
    rows,
    run,
    slower_rank,
    worker_env,
)


def test_rounds_continue_below_the_minimum_and_stop_at_the_maximum_or_budget():
    noisy = [1.0, 1.2, 0.8, 1.3, 0.7, 1.1]
    assert keep_going(noisy[:2], min_rounds=4, max_rounds=10, elapsed_s=999.0, budget_s=1.0)
    assert not keep_going(noisy, min_rounds=4, max_rounds=6, elapsed_s=0.0, budget_s=100.0)
    assert not keep_going(noisy, min_rounds=4, max_rounds=10, elapsed_s=100.0, budget_s=100.0)


def test_rounds_continue_only_while_the_interval_is_wide():
    settings = {"min_rounds": 4, "max_rounds": 100, "elapsed_s": 0.0, "budget_s": 100.0}
    assert keep_going([1.0, 1.2, 0.8, 1.3, 0.7, 1.1], **settings)
    assert not keep_going([1.0, 1.001, 0.999, 1.0, 1.0, 1.002], **settings)


def test_a_round_takes_the_slower_ranks_time():
    first = {"plain": [1.0, 4.0], "fntrain": [2.0, 1.0]}
    second = {"plain": [3.0, 2.0], "fntrain": [1.0, 5.0]}
    assert slower_rank([first, second]) == {"plain": [3.0, 4.0], "fntrain": [2.0, 5.0]}


def test_slower_rank_refuses_ranks_with_different_round_counts():
    with pytest.raises(ValueError):
        slower_rank([{"plain": [1.0, 2.0]}, {"plain": [1.0]}])


def test_the_launch_runs_this_module_under_torchrun_on_one_thread_per_rank(tmp_path: Path):
    out = tmp_path / "timing.json"
    command = launch_command(True, out)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert f"--nproc_per_node={STAGES}" in command and "--standalone" in command
    assert command[-4:] == ["bench.pipeline_overhead", "--worker", str(out), "--quick"]
    assert "--quick" not in launch_command(False, out)
    env = worker_env({"PATH": "/bin", "OMP_NUM_THREADS": "8"})
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"


def test_rows_compare_fntrain_with_both_hand_loops():
    samples = {
        "plain": [0.200, 0.210, 0.205, 0.220],
        "plain_tied": [0.210, 0.221, 0.215, 0.230],
        "fntrain": [0.211, 0.220, 0.216, 0.232],
    }
    table = rows(Timing(samples, samples), steps=2)
    assert [row.goal for row in table] == [f"<= {GOAL_RATIO:g}x", f"<= {GOAL_RATIO:g}x", "-"]
    assert table[1].verdict == "met" and table[2].verdict == "-"
    like_for_like = table[1].interval
    assert like_for_like.n == 4 and 0.99 < like_for_like.median < 1.01
    assert all(row.unit == "x" for row in table)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_quick_run_measures_three_variants_on_two_ranks():
    table = run(quick=True)
    assert len(table) == 3
    assert all(math.isfinite(row.interval.median) and row.interval.median > 0 for row in table)
    assert all(row.rounds == 2 for row in table)
