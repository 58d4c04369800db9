"""Expert parallelism under torchrun (gloo, CPU): a MoE tiny GPT at ep 2 and 4 (alone and under FSDP2
over the rest of the data-parallel ranks) trains as one process does, token- and mean-weighted
(tests/moe_worker.py); and through `fntrain run`, a checkpoint saved at ep 2 resumes at ep 1 and at ep
4, and a SIGKILL resume at ep 2 is bitwise the uninterrupted run (tests/checkpoint/resume_driver.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32; AdamW's first steps magnify 1e-8 gradient noise to ~3e-6


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _launch(ranks: int, module: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone"]
    command = [*(torchrun if ranks > 1 else [sys.executable]), "-m", module, *args]
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    cache: dict[tuple, dict] = {}

    def get(ranks: int, strategy: str, ep: int) -> dict:
        if (ranks, strategy, ep) not in cache:
            out = tmp_path_factory.mktemp(f"w{ranks}ep{ep}") / "results.pt"
            _launch(ranks, "tests.moe_worker", strategy, str(ep), str(out))
            cache[ranks, strategy, ep] = torch.load(out)
        return cache[ranks, strategy, ep]

    return get


@pytest.mark.parametrize(("ranks", "ep"), [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_expert_parallel_trains_like_one_process(layouts, ranks, ep):
    """ep 2 on 2 ranks: every rank holds half the experts; 4 ranks ep 2: experts over ep x FSDP2 over
    dp_mod_ep 2; ep 4: one expert per rank. Losses, aux loss, first-step gradients, final weights and
    the loss-free router biases ("bias" case) all match one process."""
    reference, run = layouts(1, "none", 1), layouts(ranks, "fsdp2", ep)
    assert run["layout"] == (ranks, ranks, ep)
    for case in ("token", "mean", "bias"):
        want, got = reference[case], run[case]
        torch.testing.assert_close(got["losses"], want["losses"], **TOLERANCE)
        torch.testing.assert_close(got["aux"], want["aux"], **TOLERANCE)
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            torch.testing.assert_close(got["grads"][name], want["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
            torch.testing.assert_close(got["weights"][name], want["weights"][name], **TOLERANCE, msg=name)
        for name in want["biases"]:
            assert torch.equal(got["biases"][name], want["biases"][name]), name
    # The bias case balances: its biases moved, and so its losses differ from the plain token case.
    assert any(bias.abs().sum() > 0 for bias in reference["bias"]["biases"].values())
    assert reference["bias"]["losses"] != reference["token"]["losses"]
