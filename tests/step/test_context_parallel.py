"""Context parallelism under torchrun on gloo equals one process (issue 28, items 4 and 5, cp parts).

- cp 2 (ddp) on 2 ranks and cp 2 x dp 2 (fsdp2 over the flattened dp_cp mesh) on 4 ranks match the
  1-rank run: step-1 gradients, four steps of losses and the final weights, token and mean weighting,
  packed documents with boundaries inside the cp slices (tests/step/cp_worker.py);
- the recipe end to end: a checkpoint saved at cp 2 resumes at cp 1, and a cp 2 run SIGKILLed inside a
  step and at a save resumes bit for bit (the kill-and-resume machinery of tests/checkpoint).
A launch (imports, process-group set-up) costs more than these steps: every launch forks from one
preloaded Python (tests/helpers/fork_server.py), the 2-rank worker cases and the ring probe share one
launch (tests/helpers/worker_sequence.py), and one uninterrupted cp 2 run of the recipe is both the SIGKILL
test's reference and the checkpoint the cp 1 test restores.
The pieces (all-to-alls, slices, refusals) are tested in tests/step/test_context_parallel_parts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoint import test_resume as resume
from tests.helpers import preloaded_launch
from tests.helpers.runs import exported_weights
from tests.runtime.test_distributed import TIGHT

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("module_launches_forked")]


PYTHON = resume.PYTHON  # resume.launch reads it: every launch forks from one Python that imported torch and fntrain


@pytest.fixture(scope="module")
def preloaded(module_launches_forked) -> preloaded_launch.Python:
    """The module's server (tests/helpers/fork_server.py) for the worker launches too."""
    return preloaded_launch.Python(str(resume.PYTHON["executable"]), dict(resume.PYTHON["env"]))


@pytest.fixture(scope="module")
def cp1_results(tmp_path_factory, preloaded) -> dict:
    out = tmp_path_factory.mktemp("cp1") / "none_cp1.pt"
    preloaded_launch.run(preloaded, 1, "tests.step.cp_worker", "none", "1", str(out))
    return torch.load(out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, preloaded) -> dict[str, Path]:
    """One 2-rank launch: cp 2 under DDP (the worker's cases), then the ring probe."""
    root = tmp_path_factory.mktemp("two_ranks")
    outs = {"cp2_ddp": root / "ddp_cp2.pt", "ring": root / "ring.pt"}
    preloaded_launch.run(preloaded, 2, "tests.helpers.worker_sequence", "tests.step.cp_worker", "ddp", "2", str(outs["cp2_ddp"]),
                         "--", "tests.step.cp_worker", "ring_probe", str(outs["ring"]))  # fmt: skip
    return outs


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("ranks", "strategy", "layout"),
    [(2, "ddp", {"world": 2, "dp": 1, "cp": 2}), (4, "fsdp2", {"world": 4, "dp": 2, "cp": 2})],
    ids=["cp2_ddp", "cp2_dp2_fsdp2"],
)
def test_cp2_equals_one_rank(cp1_results, two_ranks, preloaded, tmp_path, ranks, strategy, layout):
    if ranks == 2:
        results = torch.load(two_ranks["cp2_ddp"])
    else:
        preloaded_launch.run(preloaded, ranks, "tests.step.cp_worker", strategy, "2", str(tmp_path / "results.pt"))
        results = torch.load(tmp_path / "results.pt")
    assert results["layout"] == layout
    # cp is inside dp on the mesh: ranks (dp, cp) = (0, 0), (0, 1), (1, 0), (1, 1)
    assert results["coordinates"] == [(rank // 2, rank % 2) for rank in range(ranks)]
    for case in ("sgd", "sgd_mean", "adamw"):
        want, got = cp1_results[case], results[case]
        for name in want["grads"]:
            torch.testing.assert_close(got["grads"][name], want["grads"][name], **TIGHT, msg=f"{case} grad {name}")
        torch.testing.assert_close(got["grad_norms"], want["grad_norms"], **TIGHT, msg=f"{case} grad norms")
        torch.testing.assert_close(got["losses"], want["losses"], **TIGHT, msg=f"{case} losses")
        tolerance = {"rtol": 1e-4, "atol": 1e-5} if case == "adamw" else TIGHT  # 1/sqrt(v) amplifies noise
        for name in want["weights"]:
            torch.testing.assert_close(got["weights"][name], want["weights"][name], **tolerance, msg=f"{case} {name}")
    assert cp1_results["sgd_mean"]["losses"] != cp1_results["sgd"]["losses"]  # the two weightings differ here


# ----------------------------------------------------------------------------- the recipe end to end

# tests/checkpoint's kill-and-resume runs (12 steps of adamw, saves every 4 steps and at the epoch end
# after step 6), dropout off so that one process can match 2 ranks, each step logged (metrics.jsonl
# holds the mean over ranks: the global loss; losses.txt holds rank 0's part of it under cp).
PLAIN = [*resume.fsdp_args(dropout=0.0, strategy="none"), "--log-every", "1"]
CP2 = [*resume.fsdp_args(dropout=0.0), "--log-every", "1", "--parallel.cp-size", "2"]


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory, corpus) -> Path:
    """An uninterrupted cp 2 run on 2 ranks (FSDP2 over dp x cp), its checkpoints kept."""
    run_dir = tmp_path_factory.mktemp("cp2")
    resume.finish(resume.launch(run_dir, "none", CP2, corpus, ranks=2), killed=False)
    return run_dir


def cp_run_metrics(run_dir: Path) -> tuple[dict[int, float], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    return losses, next(row["val_loss"] for row in rows if "val_loss" in row)


def _assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    steps = sorted(got)
    torch.testing.assert_close(torch.tensor([got[s] for s in steps]), torch.tensor([want[s] for s in steps]), **TIGHT)


@pytest.mark.timeout(400)
def test_a_cp2_checkpoint_resumes_at_cp1(tmp_path, corpus, cp2_run):
    """Saved by cp 2 at step 4 (adamw: the optimizer state too), restored by one process: it goes on to
    step 12 as the cp 2 run did and ends at its weights; and the cp 2 run's losses and validation loss
    equal an uninterrupted 1-rank run's."""
    cp2_dir = cp2_run
    assert "cp 2" in (cp2_dir / "logs" / "rank_0.log").read_text()  # the run's layout line
    plain, one = tmp_path / "plain", tmp_path / "one"
    resume.finish(resume.launch(plain, "none", PLAIN, corpus), killed=False)
    (cp2_losses, cp2_val), (plain_losses, plain_val) = cp_run_metrics(cp2_dir), cp_run_metrics(plain)
    assert sorted(cp2_losses) == list(range(1, resume.STEPS + 1)) == sorted(plain_losses)
    _assert_close(cp2_losses, plain_losses)
    torch.testing.assert_close(torch.tensor(cp2_val), torch.tensor(plain_val), **TIGHT)
    restore = ["--checkpoint.restore-from", str(cp2_dir / "checkpoints" / "step_4")]
    resume.finish(resume.launch(one, "none", [*PLAIN, *restore], corpus), killed=False)
    one_losses, _ = cp_run_metrics(one)
    assert sorted(one_losses) == list(range(5, resume.STEPS + 1))
    _assert_close(one_losses, cp2_losses)
    got, want = exported_weights(one), exported_weights(cp2_dir)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.timeout(600)
def test_cp2_sigkill_resumes_bit_for_bit(tmp_path, corpus, cp2_run):
    """cp 2 on 2 ranks, killed inside step 5 and again while saving step 8, resumed from latest: the
    losses (==) and final weights (torch.equal) of an uninterrupted cp 2 run."""
    run_dir = tmp_path / "run"
    resume.kill_and_resume(run_dir, ["optimizer:5", "marker:8"], [*CP2, *resume.WORKERS], corpus, ranks=2)
    resume.assert_same_losses_and_weights(cp2_run, run_dir)


@pytest.mark.timeout(200)
def test_ring_slices_like_torchs_load_balancer_and_reaches_its_dispatcher(two_ranks):
    """--parallel.cp-style ring on CPU (phase 1 refuses it; here the pieces are called directly): each
    rank gets torch's head-tail chunks with global positions and targets, and the forward reaches torch's
    ring dispatcher, which has no CPU attention kernel (what the refusal says). The numbers need a GPU:
    bench/gpu_check.py's context_parallel section."""
    first, second = torch.load(two_ranks["ring"])
    assert first["slices"]["input_ids"] == [[0, 1, 6, 7], [8, 9, 14, 15]]  # chunks 0 and 3 of 4
    assert second["slices"]["input_ids"] == [[2, 3, 4, 5], [10, 11, 12, 13]]  # chunks 1 and 2
    assert first["slices"]["position_ids"] == [[0, 1, 6, 7], [0, 1, 6, 7]]
    assert first["slices"]["shift_labels"] == [[1, 2, 7, -100], [9, 10, 15, -100]]
    for rank in (first, second):
        assert "does not have a sharding strategy" in rank["error"]
