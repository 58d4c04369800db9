"""Exact resume [S36]: runs of recipes/tiny_gpt SIGKILLed at several points (between steps, inside a
step, inside a save) and resumed from "latest" give the same per-step losses (==) and final weights
(torch.equal) as a run never interrupted; a kill inside a save never leaves `latest` at an incomplete
checkpoint. The resumed runs read data with 2 workers and prefetch on, the reference reads in-process:
data order depends on neither. Dropout is on, so the RNG state matters.

A preemption notice (SIGTERM) is one more point of the chains: the run saves, stops with status 143
and its resume matches too.

The default tier has one quick case; every kill point in turn (sync and async saves), 2-rank FSDP2 and
DDP, a 2-stage pipeline and resharding (saved by 2 ranks, restored by 1) are in the slow tier
(`-m slow`). Runs go through tests/checkpoint/resume_driver.py, launched through a preloaded Python
(tests/helpers/fork_server.py: each launch a fork of one process that imported torch and fntrain once, so
that ~40 launches do not each pay the imports); torchrun's workers come through it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fntrain.checkpoint import find_latest, is_complete, read_meta
from fntrain.checkpoint.layout import LATEST
from tests.helpers.runs import exported_weights, recorded_losses
from tests.helpers.waiting import wait_for_end

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
MODEL = [
    "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
    "--model.dropout", "0.1",
]  # fmt: skip
COMMON = [
    *MODEL,
    "--train.global-batch-size", "8", "--train.micro-batch-size", "4", "--train.train-iters", str(STEPS),
    "--log-every", "0",
    "--checkpoint.save-every", "4", "--checkpoint.save-epochs", "1", "--checkpoint.keep-last", "2",
    "--checkpoint.restore-from", "latest",
]  # fmt: skip
WORKERS = ["--loader.num-workers", "2", "--loader.prefetch"]


def env() -> dict[str, str]:
    out = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    out["OMP_NUM_THREADS"] = "1"  # the same thread count in every run (and no oversubscription)
    return out


# The preloaded Python's launcher and environment (set for the module by the `module_launches_forked` fixture, tests/conftest.py): every launch
# goes through it.
PYTHON: dict[str, object] = {}
pytestmark = pytest.mark.usefixtures("module_launches_forked")


def launch(run_dir: Path, kill: str, args: list[str], corpus: Path, *, ranks: int = 1) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    driver = ["-m", "tests.checkpoint.resume_driver", str(run_dir), kill, *args, "--data.path", str(corpus)]
    driver += ["--run-dir", str(run_dir)]
    python = str(PYTHON.get("executable", sys.executable))
    if ranks == 1:
        command = [python, *driver]
    else:
        command = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        command += driver
        shutil.rmtree(run_dir / "pids", ignore_errors=True)  # the driver's kill reads the ranks' pids there
    output = tempfile.TemporaryFile(mode="w+")  # read by finish(); see there why not a pipe
    process = subprocess.Popen(
        command, cwd=ROOT, env=PYTHON.get("env", env()), stdout=output, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    process.output = output  # type: ignore[attr-defined]
    stop = "to its end" if kill == "none" else f"to its kill point {kill}"
    process.what = f"the resume driver's run in {run_dir} on {ranks} rank(s), {stop},"  # type: ignore[attr-defined]
    return process


def ended(process: subprocess.Popen, timeout: float = 240) -> str:
    """Wait for the driver (or torchrun) to end, then end what it left in its session; its output. A
    wait that runs out fails naming the launch, with every process's stacks (`wait_for_end`).
    A DataLoader worker forked just before its parent's SIGKILL can take init (pid 1) for its parent
    and, its parent-death check never firing, live on; it would hold a pipe open for ever (seen under
    coverage, whose start-up in the forked worker widens that window), so the output is a file."""

    def output_so_far() -> str:
        process.output.seek(0)
        return process.output.read()

    try:
        wait_for_end(process, process.what, timeout, output_so_far)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # start_new_session: the driver's pid is its group's
        process.output.seek(0)
        output = process.output.read()
        process.output.close()
    return output


def finish(process: subprocess.Popen, *, killed: bool, timeout: float = 240) -> None:
    """Wait for `process` (ended()) and check its status: SIGKILLed when `killed`, else 0."""
    output = ended(process, timeout)
    if killed:
        assert process.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), (
            process.returncode,
            output[-3000:],
        )
    else:
        assert process.returncode == 0, output[-6000:]


def assert_latest_is_complete(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    pointer = root / LATEST
    if pointer.exists():
        assert is_complete(root / pointer.read_text().strip()), "latest names an incomplete checkpoint"
    found = find_latest(root)
    assert found is None or is_complete(found)


def assert_same_losses_and_weights(reference: Path, run_dir: Path) -> None:
    expected = dict(recorded_losses(reference))
    assert sorted(expected) == list(range(1, STEPS + 1))
    recorded = recorded_losses(run_dir)
    assert {step for step, _ in recorded} == set(expected)
    mismatches = [(step, value, expected[step]) for step, value in recorded if value != expected[step]]
    assert not mismatches, f"losses differ from the uninterrupted run: {mismatches}"
    want, got = exported_weights(reference), exported_weights(run_dir)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), "final weights differ"


# Every how many steps the ranks agree on a preemption notice in the runs that get one (one process
# checks every step): a notice at step 9 stops one process at 9, two ranks at 10.
PREEMPT = ["--checkpoint.preempt-check-every", "2"]


def preempted(run_dir: Path, at: int, args: list[str], corpus: Path, ranks: int) -> None:
    """SIGTERM to the last rank at step `at` (odd): every rank agrees to save the step they stop at and
    stop cleanly, exiting with the documented status 143 (torchrun then reports the workers' 143). The
    ranks leave the run's last barrier together, but the first to exit makes torchrun's agent send the
    others SIGTERM at once: a rank still destroying its process group then dies by that signal (-15)
    instead of exiting 143 (seen on a loaded 2-core machine). That changes nothing but torchrun's report:
    its own status is 1 either way, and the checkpoint and records were written before the barrier (the
    resume that follows checks them)."""
    earlier = len(recorded_losses(run_dir)) if (run_dir / "losses.txt").exists() else 0
    process = launch(run_dir, f"preempt:{at}", args, corpus, ranks=ranks)
    output = ended(process)
    if ranks == 1:
        assert process.returncode == 143, output[-3000:]
    else:
        statuses = re.findall(r"exitcode {2}: (-?\d+)", output)  # torchrun's per-rank lines
        assert process.returncode != 0 and len(statuses) == 2 and "143" in statuses, output[-3000:]
        assert set(statuses) <= {"143", "-15"} and ("-15" not in statuses or "closing signal SIGTERM" in output), output[-3000:]
    stop = at if ranks == 1 else at + 1
    assert max(step for step, _ in recorded_losses(run_dir)[earlier:]) == stop  # the last step this launch ran
    assert read_meta(find_latest(run_dir / "checkpoints"))["train_state"]["global_step"] == stop


def kill_and_resume(run_dir: Path, kills: list[str], args: list[str], corpus: Path, ranks: int = 1) -> None:
    """Each of `kills` in turn (a SIGKILL point of the driver, or `preempt:K`), then a run to the end."""
    for kill in kills:
        if kill.startswith("preempt:"):
            preempted(run_dir, int(kill.partition(":")[2]), args, corpus, ranks)
        else:
            finish(launch(run_dir, kill, args, corpus, ranks=ranks), killed=True)
        assert_latest_is_complete(run_dir)
    finish(launch(run_dir, "none", args, corpus, ranks=ranks), killed=False)
    assert_latest_is_complete(run_dir)
    assert read_meta(find_latest(run_dir / "checkpoints"))["train_state"]["global_step"] == STEPS


def test_sigkill_inside_a_step_resumes_bit_for_bit(tmp_path, corpus):
    """The quick case: async saves, 2 workers + prefetch, killed right after step 7's optimizer step
    (weights updated, schedule and state not): the resumed run redoes step 7 from the step-6
    checkpoint (an epoch end) and matches the uninterrupted in-process-data run."""
    reference = launch(tmp_path / "reference", "none", COMMON, corpus)
    args = [*COMMON, *WORKERS, "--checkpoint.async-save"]
    killed = launch(tmp_path / "run", "optimizer:7", args, corpus)
    finish(reference, killed=False)
    finish(killed, killed=True)
    assert_latest_is_complete(tmp_path / "run")
    # Step 6 (an epoch end) is the latest unless its background write was still running at the kill.
    restored = read_meta(find_latest(tmp_path / "run" / "checkpoints"))["train_state"]
    assert restored in (
        {"epoch": 0, "global_step": 6, "cursor": 6},
        {"epoch": 0, "global_step": 4, "cursor": 4},
    )
    finish(launch(tmp_path / "run", "none", args, corpus), killed=False)
    assert_same_losses_and_weights(tmp_path / "reference", tmp_path / "run")
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    aside = [name for name in saved if re.fullmatch(r"step_\d+\.incomplete(\.\d+)?", name)]
    # keep_last 2; a partial left by the kill (step 6's background write) was moved aside, not deleted
    assert [name for name in saved if name not in aside] == ["latest", "step_12", "step_8"]
    assert aside in ([], ["step_6.incomplete"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    """The run directory of an uninterrupted run with these recipe flags on this many ranks, run once
    for the module (tests that check their resumes against the same run share it)."""
    runs: dict[tuple[tuple[str, ...], int], Path] = {}

    def run(args: list[str], ranks: int = 1) -> Path:
        key = (tuple(args), ranks)
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("uninterrupted")
            finish(launch(runs[key], "none", args, corpus, ranks=ranks), killed=False)
        return runs[key]

    return run


# Every kill point, in the order a run reaches them. One run directory takes them all in turn: each
# launch resumes from what the kill before it left (a kill inside a save: a partial step directory set
# aside, `latest` behind a complete one) and is killed further on; the last launch finishes the run.
# Every step a launch records, redone ones included, must equal the uninterrupted run's.
KILL_CHAIN = (
    "optimizer:3",  # inside a step, before the first save: the resume starts from scratch
    "step_begin:5",  # between steps
    "dcp_finish:6",  # inside the epoch-end save, its data files written
    "dcp_finish:8",  # inside a save at save_every, its data files written
    "marker:8",  # its .metadata written, the COMPLETE marker not yet
    "latest:8",  # COMPLETE written, `latest` not yet moved
    "preempt:9",  # not a kill: a preemption notice, saved at step 9, status 143
    "optimizer:10",  # inside a step, after a resume from the newest complete checkpoint
    "export",  # after the last step's save, before the weights are exported
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_kill_point_and_a_preemption_in_turn_resume_bit_for_bit(tmp_path, corpus, uninterrupted, mode):
    """The reference runs without the preemption check: checking for notices changes no step."""
    args = [*COMMON, *WORKERS, *PREEMPT] + (["--checkpoint.async-save"] if mode == "async" else [])
    kill_and_resume(tmp_path, list(KILL_CHAIN), args, corpus)
    assert_same_losses_and_weights(uninterrupted(COMMON), tmp_path)
    assert len(recorded_losses(tmp_path)) > STEPS  # the kills cost steps that the resumes redid


def fsdp_args(
    steps: int = STEPS, restore: str = "latest", strategy: str = "fsdp2", dropout: float = 0.1
) -> list[str]:
    return [
        *MODEL[:-1], str(dropout),
        "--train.global-batch-size", "8", "--train.micro-batch-size", "2", "--train.train-iters", str(steps),
        "--log-every", "0",
        "--checkpoint.save-every", "4", "--checkpoint.save-epochs", "1", "--checkpoint.restore-from", restore,
        "--checkpoint.keep-last", "0",  # every checkpoint kept: later tests restore the early ones
        "--parallel.strategy", strategy,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "kills"),
    [("fsdp2", ["optimizer:5", "marker:8", "preempt:9"]), ("ddp", ["optimizer:5", "marker:8"])],
)
def test_two_ranks_killed_or_preempted_resume_bit_for_bit(tmp_path, corpus, uninterrupted, strategy, kills):
    """Killed inside a step and inside a save (and, FSDP2, preempted: SIGTERM to one rank at step 9, the
    ranks agree at step 10 to save and stop with status 143), the 2-rank run resumes to the uninterrupted
    run's losses and weights; the reference runs without the preemption check."""
    run_dir = tmp_path / "run"
    args = [*fsdp_args(strategy=strategy), *WORKERS, "--checkpoint.async-save", *PREEMPT]
    kill_and_resume(run_dir, kills, args, corpus, ranks=2)
    assert_same_losses_and_weights(uninterrupted(fsdp_args(strategy=strategy), ranks=2), run_dir)
    step = find_latest(run_dir / "checkpoints")
    assert read_meta(step)["world_size"] == 2
    for rank in (0, 1):  # each rank saved its own RNG and hook states
        saved = json.loads((step / f"rank_{rank}.json").read_text())
        assert saved["rank"] == rank and set(saved["rng"]) == {"python", "numpy", "torch_cpu"}
        assert saved["hooks"]["checkpoint"] == {"last_saved_step": STEPS}


@pytest.mark.slow
def test_resharding_two_ranks_to_one(tmp_path, corpus):
    """Saved by 2 FSDP2 ranks at step 8, restored by 1 process: the weights the checkpoint holds; training
    on from there matches the 2-rank run to float tolerance (the reduction order differs; dropout off,
    since the ranks' dropout streams cannot match one process's)."""
    two = tmp_path / "two"
    finish(launch(two, "none", fsdp_args(STEPS, dropout=0.0), corpus, ranks=2), killed=False)
    checkpoint = two / "checkpoints" / "step_8"
    assert read_meta(checkpoint)["world_size"] == 2
    dcp_to_torch_save(checkpoint, tmp_path / "step_8.pt")  # what the 2 ranks saved, in one file
    held = torch.load(tmp_path / "step_8.pt", weights_only=False)
    saved = {key.removeprefix("model."): value for key, value in held.items() if key.startswith("model.")}

    one = tmp_path / "one"
    shorter = ["--checkpoint.allow-changes", "train.train_iters"]  # it ends at the restored step
    finish(launch(one, "none", [*fsdp_args(8, str(checkpoint), "none", 0.0), *shorter], corpus), killed=False)
    got = exported_weights(one)
    assert saved.keys() == got.keys() and all(torch.equal(saved[k], got[k]) for k in saved)
    assert (one / "losses.txt").read_text() == ""  # restored at its last step: nothing re-run, not re-saved
    assert not (one / "checkpoints").exists()

    on = tmp_path / "on"
    finish(launch(on, "none", fsdp_args(STEPS, str(checkpoint), "none", 0.0), corpus), killed=False)
    want, got = exported_weights(two), exported_weights(on)  # the 2-rank run went on from step 8 too
    assert want.keys() == got.keys()
    assert all(torch.allclose(want[k], got[k], rtol=1e-4, atol=1e-5) for k in want)
    assert min(step for step, _ in recorded_losses(on)) == 9


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pipeline_kill_and_resume(tmp_path, corpus, uninterrupted):
    """A 2-stage pipeline (1F1B, dropout on, async saves, 2 loader workers) killed inside a step and
    inside a save resumes to the same losses and weights as an uninterrupted 2-stage run, bit for bit:
    each stage restores its own part of the model and optimizer and its own RNG state."""
    pipeline = ["--parallel.pp-size", "2", "--model.n-layer", "2"]
    run_dir = tmp_path / "run"
    args = [*fsdp_args(strategy="none"), *pipeline, *WORKERS, "--checkpoint.async-save"]
    kill_and_resume(run_dir, ["optimizer:5", "marker:8"], args, corpus, ranks=2)
    assert_same_losses_and_weights(uninterrupted([*fsdp_args(strategy="none"), *pipeline], ranks=2), run_dir)
    meta = read_meta(find_latest(run_dir / "checkpoints"))
    assert meta["world_size"] == 2 and meta["config"]["parallel"]["pp_size"] == 2
