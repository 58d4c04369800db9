"""GRPO resumes exactly: a `fntrain run grpo` SIGKILLed inside a generation batch and at its edge, and
launched again each time, ends as a run never interrupted, bit for bit: every step's metrics (==, as
float.hex; the redone ones too), metrics.jsonl row for row and samples.jsonl line for line (but wall-clock
figures), and the final weights (torch.equal).

The killed run: a generation batch of 16 completions (4 prompts x 4) serves R = 4 optimizer steps (twice
the micro-batches of a step, reused twice: grpo.num_iterations 2), so old and reference log-probs (beta
0.04) are part of what a checkpoint inside a batch keeps; a checkpoint every 3 steps, a log every 2, 16
steps (4 batches). One run directory is killed in turn right after the optimizer step of steps 6, 8, 11
and 14, so each relaunch resumes from step 3, 6, 9 (inside batches 0, 1, 2, after their step 3, 2 and 1
of 4) and 12 (batch 2's last step: its edge, the next batch generated anew from its key). Steps 4-5
and 13 also ran before a kill: the generations of steps 5 and 13 are made again, their samples logged
again (the first launch's lines move to samples.superseded.jsonl).

Also, from a checkpoint inside a generation batch: a relaunch with another grpo.beta, grpo.loss_type or
grpo.num_generations is refused in one line (exit 2, the run directory as it was) unless named in
--checkpoint.allow-changes; allowed, a batch the run can no longer train on (no reference log-probs for
a beta now > 0, another group size) is generated again; and a batch saved by 2 ranks is refused in one
line by one process. The quick in-process checks are in the default tier, the launches in the slow one.

Launches go through tests/step/objectives/grpo/resume_driver.py (tests/step/objectives/dpo_resume_driver.py's recorder and kill) with
tests/step/objectives/test_dpo_resume.py's launcher and tests/checkpoint/test_resume.py's process helpers, each a fork
of one process that imported torch and transformers once (tests/helpers/fork_server.py).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from fntrain.checkpoint import find_latest, read_meta
from tests.checkpoint.test_resume import assert_latest_is_complete, finish
from tests.helpers.fork_server import started
from tests.helpers.waiting import run_to_end
from tests.step.objectives.grpo.helpers import GRPO_PRELOAD, final_weights, grpo_env, is_timing
from tests.step.objectives.test_dpo_resume import launch_dpo_driver, sizes_and_mtimes

ROOT = Path(__file__).resolve().parents[4]
STEPS = 16
PER_GENERATION = 4  # R: optimizer steps per generation batch
DRIVER = "tests.step.objectives.grpo.resume_driver"
LAUNCH = "attempt"  # which launch logged the row
# (kill: SIGKILL right after this step's optimizer step, the step the relaunch resumes from)
KILLS = (("optimizer:6", 3), ("optimizer:8", 6), ("optimizer:11", 9), ("optimizer:14", 12))


@pytest.fixture
def run_rewards_importable(grpo_run_inputs, monkeypatch) -> None:
    """The reward module importable by runs in this process."""
    monkeypatch.syspath_prepend(str(grpo_run_inputs[2]))


@pytest.fixture(scope="module")
def grpo_launch_env(grpo_run_inputs):
    """The preloaded launcher (the slow tests' launches), the reward module on its PYTHONPATH."""
    with started(grpo_env(grpo_run_inputs[2]), GRPO_PRELOAD) as launched:
        yield launched


def flags(inputs: tuple[Path, Path, Path]) -> list[str]:
    model, prompts, _ = inputs
    return [
        "--model.path", str(model), "--data.path", str(prompts), "--grpo.reward-funcs", "grpo_test_rewards:multi",
        "--train.train-iters", str(STEPS), "--train.global-batch-size", "8", "--train.micro-batch-size", "2",
        "--grpo.num-generations", "4", "--grpo.max-completion-length", "12", "--grpo.steps-per-generation", "8",
        "--grpo.num-iterations", "2", "--grpo.beta", "0.04", "--grpo.completions-to-log", "3",
        "--optim.lr", "1e-2", "--log-every", "2", "--progress.no-enabled", "--checkpoint.save-every", "3",
    ]  # fmt: skip


def saved_generation(run_dir: Path) -> dict | None:
    """The generation batch the latest checkpoint keeps (rank 0's part; None at a batch's edge)."""
    saved = json.loads((find_latest(run_dir / "checkpoints") / "rank_0.json").read_text())
    return saved["hooks"]["grpo"]["generation"]


def rows(path: Path, drop: tuple[str, ...] = ()) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in record.items() if not is_timing(k) and k not in drop} for record in records]


def assert_same_grpo_run(reference: Path, run_dir: Path) -> None:
    """Every step the killed launches and the last one recorded equals the uninterrupted run's step,
    metric by metric; metrics.jsonl, samples.jsonl and the final weights are the uninterrupted run's."""
    expected = {row["step"]: row for row in rows(reference / "steps.jsonl")}
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert {"loss", "grad_norm", "kl", "entropy", "reward", "completions/mean_length"} <= set(expected[1])
    recorded = rows(run_dir / "steps.jsonl")
    redone = [4, 5, 7, 10, 13]  # each launch redoes the steps after its checkpoint the kill cut off
    assert sorted(row["step"] for row in recorded) == sorted([*range(1, STEPS + 1), *redone])
    mismatches = [
        (row["step"], name) for row in recorded for name in row if row[name] != expected[row["step"]][name]
    ]
    assert not mismatches, f"steps differ from the uninterrupted run: {mismatches}"
    assert rows(run_dir / "metrics.jsonl", (LAUNCH,)) == rows(reference / "metrics.jsonl", (LAUNCH,))
    samples = rows(reference / "samples.jsonl")
    assert [row["step"] for row in samples] == [1] * 3 + [5] * 3 + [9] * 3 + [13] * 3
    assert rows(run_dir / "samples.jsonl") == samples
    want, got = final_weights(reference), final_weights(run_dir)
    assert want and want.keys() == got.keys()
    assert all(torch.equal(want[key], got[key]) for key in want), "final weights differ"


def assert_refused(run_dir: Path, args: list[str], change: list[str], said: str, capsys) -> None:
    """A relaunch of `run_dir` with `change` exits 2 with one line saying `said` (the flag, its old and
    new value) and the way out, touching nothing."""
    from fntrain.cli import dispatch

    before = sizes_and_mtimes(run_dir)
    with pytest.raises(SystemExit) as exited:
        dispatch(["run", "grpo", *args, "--run-dir", str(run_dir), *change])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert said in err and "--checkpoint.allow-changes" in err, err
    assert sizes_and_mtimes(run_dir) == before


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_inside_and_at_the_edge_of_generation_batches_resumes_bit_for_bit(
    tmp_path, grpo_run_inputs, grpo_launch_env
):
    """KILLS in turn on one run directory (the module docstring), the uninterrupted run beside them;
    each checkpoint resumed from holds the generation batch it is inside, with its log-probs, or none."""
    args = flags(grpo_run_inputs)
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    running = launch_dpo_driver(reference, "none", args, grpo_launch_env, DRIVER)
    for kill, restored in KILLS:
        finish(launch_dpo_driver(run_dir, kill, args, grpo_launch_env, DRIVER), killed=True)
        assert_latest_is_complete(run_dir)
        assert read_meta(find_latest(run_dir / "checkpoints"))["train_state"]["global_step"] == restored
        generation = saved_generation(run_dir)
        if restored % PER_GENERATION:  # inside batch restored // R: its rows, advantages and log-probs kept
            assert generation["index"] == restored // PER_GENERATION and generation["steps"] == PER_GENERATION
            assert all({"old_logps", "ref_logps"} <= set(row) for row in generation["rows"].values())
        else:
            assert generation is None
    finish(running, killed=False)
    finish(launch_dpo_driver(run_dir, "none", args, grpo_launch_env, DRIVER), killed=False)
    assert_same_grpo_run(reference, run_dir)
    assert {row["step"] for row in rows(run_dir / "samples.superseded.jsonl")} == {5, 13}


# A short run whose only checkpoint (its last step, 1) is inside generation batch 0 of R = 2
# (num_iterations 2), beta 0: what the quick checks resume.
SHORT = ["--train.train-iters", "1", "--train.global-batch-size", "4", "--train.micro-batch-size", "2",
         "--grpo.num-generations", "4", "--grpo.max-completion-length", "4", "--grpo.num-iterations", "2",
         "--progress.no-enabled"]  # fmt: skip


@pytest.fixture(scope="module")
def inside(grpo_run_inputs, tmp_path_factory) -> tuple[Path, list[str]]:
    """(a run directory, its flags but --run-dir) whose latest checkpoint is inside a generation batch."""
    from fntrain.cli import dispatch

    model, prompts, modules = grpo_run_inputs
    run_dir = tmp_path_factory.mktemp("inside") / "run"
    args = ["--model.path", str(model), "--data.path", str(prompts), "--grpo.reward-funcs", "grpo_test_rewards:plain",
            *SHORT]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(modules))
        dispatch(["run", "grpo", *args, "--run-dir", str(run_dir)])
    assert saved_generation(run_dir)["index"] == 0
    return run_dir, args


@pytest.mark.parametrize(
    ("change", "said"),
    [(["--grpo.beta", "0.1"], "--grpo.beta 0.0 -> 0.1"),
     (["--grpo.loss-type", "bnpo"], "--grpo.loss-type 'dapo' -> 'bnpo'"),
     (["--grpo.num-generations", "2"], "--grpo.num-generations 4 -> 2")],
)  # fmt: skip
def test_a_changed_grpo_setting_is_refused_in_one_line(inside, run_rewards_importable, capsys, change, said):
    run_dir, args = inside
    assert_refused(run_dir, args, change, said, capsys)


@pytest.mark.parametrize(
    ("change", "reason"),
    [(["--grpo.beta", "0.04"], "holds no reference log-probs"), (["--grpo.num-generations", "2"], "has another shape")],
)  # fmt: skip
def test_an_allowed_change_the_saved_batch_cannot_serve_generates_it_again(inside, run_rewards_importable, tmp_path,
                                                                           caplog, change, reason):  # fmt: skip
    """beta 0 -> 0.04: the saved batch has no reference log-probs for the KL; num_generations 4 -> 2: its
    rows would sit under other prompts. Each is generated again with a warning, and the run goes on."""
    from fntrain.cli import dispatch

    run_dir, args = inside
    shutil.copytree(run_dir, tmp_path / "run")
    field = change[0].removeprefix("--").replace("-", "_")
    with caplog.at_level(logging.WARNING, logger="fntrain.step.objectives.grpo"):
        result = dispatch(["run", "grpo", *args, "--run-dir", str(tmp_path / "run"), *change, "--train.train-iters",
                           "2", "--checkpoint.allow-changes", field, "train.train_iters"])  # fmt: skip
    assert result.state.global_step == 2
    warned = [
        record.getMessage() for record in caplog.records if record.name == "fntrain.step.objectives.grpo"
    ]
    assert any("generation batch 0 " + reason in line and "generated again" in line for line in warned), (
        warned
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_batch_saved_by_two_ranks_is_refused_by_one_process(tmp_path, grpo_run_inputs, grpo_launch_env, run_rewards_importable,
                                                              capsys):  # fmt: skip
    """Saved inside generation batch 0 by 2 DDP ranks (each kept its own rows), relaunched on one process."""
    from fntrain.cli import dispatch

    model, prompts, _ = grpo_run_inputs
    run_dir = tmp_path / "run"
    args = ["--model.path", str(model), "--data.path", str(prompts), "--grpo.reward-funcs", "grpo_test_rewards:plain",
            *SHORT, "--run-dir", str(run_dir)]  # fmt: skip
    two = run_to_end(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "fntrain", "run", "grpo", *args,
                      "--parallel.strategy", "ddp"], "the 2-rank DDP `fntrain run grpo` (torchrun)", 240, cwd=ROOT,
                     env=grpo_launch_env)  # fmt: skip
    assert two.returncode == 0, two.stderr[-4000:]
    assert saved_generation(run_dir)["dp_size"] == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        dispatch(["run", "grpo", *args])
    err = capsys.readouterr().err.strip()
    assert exited.value.code != 0, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("run failed before its first step: ValueError: the checkpoint was saved "
                                           "inside generation batch 0 on 2 data-parallel ranks"), err  # fmt: skip
    assert "resume it on 2 ranks, or from a checkpoint at a generation batch's edge" in err, err
