"""Context parallelism under torchrun on gloo equals one process (issue 28, items 4 and 5, cp parts).

- cp 2 (ddp) on 2 ranks and cp 2 x dp 2 (fsdp2 over the flattened dp_cp mesh) on 4 ranks match the
  1-rank run: step-1 gradients, four steps of losses and the final weights, token and mean weighting,
  packed documents with boundaries inside the cp slices (tests/cp_worker.py);
- the recipe end to end: a checkpoint saved at cp 2 resumes at cp 1, and a cp 2 run SIGKILLed inside a
  step and at a save resumes bit for bit (the kill-and-resume machinery of tests/checkpoint).
The pieces (all-to-alls, slices, refusals) are tested in tests/test_context_parallel_parts.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint import test_resume as resume
from tests.test_distributed import TIGHT, _env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _worker(tmp: Path, ranks: int, strategy: str, cp: int) -> dict:
    out = tmp / f"{strategy}_cp{cp}_{ranks}.pt"
    command = [sys.executable, "-m", "tests.cp_worker", strategy, str(cp), str(out)]
    if ranks > 1:
        command[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m",
                        "tests.cp_worker"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return torch.load(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _worker(tmp_path_factory.mktemp("cp1"), 1, "none", 1)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("ranks", "strategy", "layout"),
    [(2, "ddp", {"world": 2, "dp": 1, "cp": 2}), (4, "fsdp2", {"world": 4, "dp": 2, "cp": 2})],
    ids=["cp2_ddp", "cp2_dp2_fsdp2"],
)
def test_cp2_equals_one_rank(reference, tmp_path, ranks, strategy, layout):
    results = _worker(tmp_path, ranks, strategy, 2)
    assert results["layout"] == layout
    # cp is inside dp on the mesh: ranks (dp, cp) = (0, 0), (0, 1), (1, 0), (1, 1)
    assert results["coordinates"] == [(rank // 2, rank % 2) for rank in range(ranks)]
    for case in ("sgd", "sgd_mean", "adamw"):
        want, got = reference[case], results[case]
        for name in want["grads"]:
            torch.testing.assert_close(got["grads"][name], want["grads"][name], **TIGHT, msg=f"{case} grad {name}")
        torch.testing.assert_close(got["grad_norms"], want["grad_norms"], **TIGHT, msg=f"{case} grad norms")
        torch.testing.assert_close(got["losses"], want["losses"], **TIGHT, msg=f"{case} losses")
        tolerance = {"rtol": 1e-4, "atol": 1e-5} if case == "adamw" else TIGHT  # 1/sqrt(v) amplifies noise
        for name in want["weights"]:
            torch.testing.assert_close(got["weights"][name], want["weights"][name], **tolerance, msg=f"{case} {name}")
    assert reference["sgd_mean"]["losses"] != reference["sgd"]["losses"]  # the two weightings differ here


# ----------------------------------------------------------------------------- the recipe end to end

RUN = [
    "--runtime.device", "cpu", "--train.global-batch-size", "8", "--train.micro-batch-size", "2",
    "--model.n-layer", "2", "--model.d-model", "32", "--model.n-head", "4", "--model.context", "32",
    "--log-every", "1", "--optim.name", "adamw", "--optim.lr", "0.01", "--schedule.warmup-iters", "0",
    "--seed", "3", "--evaluate.eval-every", "0", "--evaluate.max-batches", "2", "--evaluate.micro-batch-size", "8",
    "--progress.no-enabled",
]  # fmt: skip
CP2 = ["--parallel.cp-size", "2", "--parallel.strategy", "fsdp2"]


def _run(run_dir: Path, ranks: int, *args: str) -> str:
    command = [sys.executable, "-m", "recipes.tiny_gpt", *RUN, "--run-dir", str(run_dir), *args]
    if ranks > 1:
        command[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m",
                        "recipes.tiny_gpt"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout + result.stderr


def _metrics(run_dir: Path) -> tuple[list[float], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row], next(row["val_loss"] for row in rows if "val_loss" in row)


@pytest.mark.timeout(400)
def test_a_cp2_checkpoint_resumes_at_cp1(tmp_path):
    """Saved by cp 2 at step 4 (adamw: the optimizer state too), restored by one process: the two go on
    to step 6 alike, and the cp 2 run's losses and validation loss equal a 1-rank run's."""
    two, one, plain = tmp_path / "two", tmp_path / "one", tmp_path / "plain"
    output = _run(two, 2, *CP2, "--train.train-iters", "4", "--checkpoint.save-every", "4")
    assert "cp 2" in output
    _run(plain, 1, "--train.train-iters", "4")
    for got, want in zip(_metrics(two), _metrics(plain), strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TIGHT)
    longer = ["--train.train-iters", "6", "--checkpoint.allow-changes", "train.train_iters"]
    _run(one, 1, "--checkpoint.restore-from", str(two / "checkpoints" / "step_4"), *longer)
    _run(two, 2, *CP2, "--checkpoint.restore-from", "latest", *longer)
    losses_one, _ = _metrics(one)
    losses_two, _ = _metrics(two)
    assert len(losses_one) == 2 and len(losses_two) == 6
    torch.testing.assert_close(torch.tensor(losses_one), torch.tensor(losses_two[4:]), **TIGHT)
    got, want = load_file(one / "hf_model" / "model.safetensors"), load_file(two / "hf_model" / "model.safetensors")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.timeout(600)
def test_cp2_sigkill_resumes_bit_for_bit(tmp_path, corpus):
    """cp 2 on 2 ranks, killed inside step 5 and again while saving step 8, resumed from latest: the
    losses (==) and final weights (torch.equal) of an uninterrupted cp 2 run."""
    args = [*resume.fsdp_args(dropout=0.0), "--parallel.cp-size", "2"]
    resume.finish(resume.launch(tmp_path / "reference", "none", args, corpus, ranks=2), killed=False)
    run_dir = tmp_path / "run"
    resume.kill_and_resume(run_dir, ["optimizer:5", "marker:8"], [*args, *resume.WORKERS], corpus, ranks=2)
    resume.assert_same_run(tmp_path / "reference", run_dir)


corpus = resume.corpus  # the small-corpus fixture of the kill-and-resume tests


@pytest.mark.timeout(200)
def test_ring_slices_like_torchs_load_balancer_and_reaches_its_dispatcher(tmp_path):
    """--parallel.cp-style ring on CPU (phase 1 refuses it; here the pieces are called directly): each
    rank gets torch's head-tail chunks with global positions and targets, and the forward reaches torch's
    ring dispatcher, which has no CPU attention kernel (what the refusal says). The numbers need a GPU:
    bench/gpu_check.py's context_parallel section."""
    out = tmp_path / "ring.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "tests.cp_worker", "ring_probe", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-6000:]
    first, second = torch.load(out)
    assert first["slices"]["input_ids"] == [[0, 1, 6, 7], [8, 9, 14, 15]]  # chunks 0 and 3 of 4
    assert second["slices"]["input_ids"] == [[2, 3, 4, 5], [10, 11, 12, 13]]  # chunks 1 and 2
    assert first["slices"]["position_ids"] == [[0, 1, 6, 7], [0, 1, 6, 7]]
    assert first["slices"]["shift_labels"] == [[1, 2, 7, -100], [9, 10, 15, -100]]
    for rank in (first, second):
        assert "does not have a sharding strategy" in rank["error"]
