"""2-rank gloo runs under torchrun match a 1-rank run with the same global batch (§5) [S21] [S23].

Each strategy runs `tests/runtime/dist_worker.py` once under `python -m torch.distributed.run
--nproc_per_node=2` (several cases per launch, ddp and fsdp2 in one launch through
tests/helpers/worker_sequence.py, every process forked from one preloaded Python through
tests/helpers/preloaded_launch.py: the start-up is paid once); the 1-rank reference runs the same worker without
torchrun. fp32, dropout 0, a global batch that divides evenly, labels masked unevenly across
micro-batches and ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import preloaded_launch

ROOT = Path(__file__).resolve().parents[2]
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


CASES = "sgd,adamw,sgd_mean,bf16,fp16,skip_nan"


@pytest.fixture(scope="module")
def strategy_runs(tmp_path_factory, python):
    """strategy -> the worker's results: the 1-rank reference in one process, ddp and fsdp2 in one
    2-rank launch (tests/helpers/worker_sequence.py: the launch costs more than these steps)."""
    root = tmp_path_factory.mktemp("runs")
    cache: dict[str, dict] = {}

    def get(strategy: str) -> dict:
        if strategy not in cache:
            if strategy == "none":
                preloaded_launch.run(python, 1, "tests.runtime.dist_worker", "none", str(root / "none.pt"), CASES)
            else:
                preloaded_launch.run(python, 2, "tests.helpers.worker_sequence", "tests.runtime.dist_worker", "ddp",
                                     str(root / "ddp.pt"), CASES, "--", "tests.runtime.dist_worker", "fsdp2",
                                     str(root / "fsdp2.pt"), CASES)  # fmt: skip
            for name in ("none",) if strategy == "none" else ("ddp", "fsdp2"):
                cache[name] = torch.load(root / f"{name}.pt")
                assert cache[name]["world_size"] == (1 if name == "none" else 2)
        return cache[strategy]

    return get


def _initial_weights() -> dict[str, torch.Tensor]:
    from fntrain.models.gpt import TinyGPT
    from tests.runtime.dist_worker import MODEL

    torch.manual_seed(0)
    return {name: p.detach().clone() for name, p in TinyGPT(MODEL).named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_match_one_rank(strategy, strategy_runs):
    reference, results = strategy_runs("none"), strategy_runs(strategy)
    for case in ("sgd", "adamw", "sgd_mean"):
        ref, got = reference[case], results[case]
        # Step-1 gradients (after clipping at 1.0) and their pre-clip norms.
        assert ref["grads"].keys() == got["grads"].keys()
        for name in ref["grads"]:
            torch.testing.assert_close(
                got["grads"][name], ref["grads"][name], **TIGHT, msg=f"{case} grad {name}"
            )
        torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], **TIGHT)
        # Five steps of losses: the mean over ranks of each rank's "loss" is the global loss.
        assert len(got["losses"]) == 5
        torch.testing.assert_close(got["losses"], ref["losses"], **TIGHT, msg=f"{case} losses")

    initial = _initial_weights()
    for name, weight in reference["sgd"]["weights"].items():
        assert not torch.equal(weight, initial[name]), f"sgd did not move {name}"
        torch.testing.assert_close(results["sgd"]["weights"][name], weight, **TIGHT, msg=f"sgd weight {name}")
    for name, weight in reference["adamw"]["weights"].items():
        # AdamW divides by sqrt(v), amplifying float noise in near-zero gradients: rtol 1e-4 with
        # float32's default atol.
        torch.testing.assert_close(
            results["adamw"]["weights"][name], weight, rtol=1e-4, atol=1e-5, msg=f"adamw weight {name}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_mixed_precision_runs_close_to_the_reference(strategy, strategy_runs):
    reference, results = strategy_runs("none"), strategy_runs(strategy)
    for case in ("bf16", "fp16"):
        losses = results[case]["losses"]
        assert all(torch.isfinite(torch.tensor(losses)))
        # fsdp2 casts the parameters (MixedPrecisionPolicy) where the reference autocasts: close, not equal.
        torch.testing.assert_close(losses, reference[case]["losses"], rtol=1e-3, atol=1e-3)
        for name, weight in results[case]["weights"].items():
            assert weight.dtype == torch.float32, f"{case}: the optimizer's weight {name} must stay fp32"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(strategy, strategy_runs):
    """nonfinite="skip": rank 1 alone sees a NaN loss at step 2; both ranks skip that step (they decide
    from the synced gradients), stay identical, and end where the 1-rank run that skipped it ends."""
    reference, results = strategy_runs("none")["skip_nan"], strategy_runs(strategy)["skip_nan"]
    assert reference["skipped_by_rank"] == [[0.0, 1.0, 0.0]]
    assert results["skipped_by_rank"] == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    assert results["weights_by_rank"][0] == results["weights_by_rank"][1]
    for name, weight in reference["weights"].items():
        assert torch.isfinite(results["weights"][name]).all()
        torch.testing.assert_close(results["weights"][name], weight, **TIGHT, msg=f"weight {name}")


@pytest.mark.slow
def test_token_counts_really_differ_across_ranks():
    """The data the equivalence tests use is uneven by construction (else token weighting is untested)."""
    from fntrain.data.tokens import count_loss_tokens
    from tests.runtime.dist_worker import global_batches, rank_micro_batches

    samples = global_batches()[0]
    per_rank = [[int(count_loss_tokens(mb)) for mb in rank_micro_batches(samples, r, 2)] for r in range(2)]
    assert per_rank[0][0] == 0  # a zero-token micro-batch
    assert sum(per_rank[0]) * 2 < sum(per_rank[1])


# The recipe under torchrun with ddp: tests/step/test_hf_conventions.py's window test, whose 2-rank DDP run
# asserts the same runtime line and saved config (one launch fewer).
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2"])
def test_recipe_runs_under_torchrun(strategy, python, tmp_path):
    run_dir = tmp_path / "run"
    output = preloaded_launch.run(
        python, 2, "recipes.tiny_gpt",
        "--parallel.strategy", strategy,
        "--runtime.device", "cpu",
        "--run-dir", str(run_dir),
        "--train.train-iters", "3",
        "--train.global-batch-size", "8",
        "--train.micro-batch-size", "2",
        "--model.n-layer", "2", "--model.d-model", "32", "--model.context", "32",
        "--log-every", "1", "--data.val-fraction", "0.001",  # a short end-of-run evaluation
    )  # fmt: skip
    assert "runtime: world 2, device cpu, backend gloo, dp 2" in output
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["parallel"]["strategy"] == strategy
    assert saved["runtime"]["device"] == "cpu"
