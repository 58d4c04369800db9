"""Expert parallelism under torchrun (gloo, CPU): a MoE tiny GPT at ep 2 and 4 (alone and under FSDP2
over the rest of the data-parallel ranks) trains as one process does, token- and mean-weighted
(tests/models/moe_worker.py; the ep sizes of one world size share a launch); and through `fntrain run`, a
checkpoint saved at ep 2 resumes at ep 1 and at ep 4, and a SIGKILL resume at ep 2 is bitwise the
uninterrupted run (tests/checkpoint/resume_driver.py). One uninterrupted ep 2 run is the reference of the
SIGKILL resume and the checkpoint the other ep sizes restore; every launch forks from one preloaded Python."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import preloaded_launch
from tests.helpers.runs import exported_weights
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("module_launches_forked")]
# fp32; AdamW's first steps magnify 1e-8 gradient noise to ~3e-6. The bound holds while no token changes
# experts: longer or larger runs drift further through routing flips (a top-k choice between
# probabilities closer than rounding), not through a difference in the math (docs/distributed.md).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


# The launches fork from one Python that imported torch and fntrain (tests/helpers/preloaded_launch.py): the
# imports cost more than these runs' steps. Set for the module by the `module_launches_forked` fixture.
PYTHON: dict[str, object] = {}


def launch_module(
    ranks: int, module: str, *args: str, check: bool = True, what: str = ""
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS`, under torchrun when ranks > 1; its status must be 0 when `check`. `what`
    names the launch in the failure of a wait that runs out."""
    python = preloaded_launch.Python(str(PYTHON["executable"]), dict(PYTHON["env"]))
    command = preloaded_launch.command(python, ranks, module, *args)
    env = dict(python.env)
    what = what or f"`python -m {module}` on {ranks} rank(s){' (torchrun)' if ranks > 1 else ''}"
    result = run_to_end(command, what, 240, cwd=ROOT, env=env)
    failed = f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert result.returncode == 0 or not check, failed
    return result


# Every layout of a world size runs in one launch (tests/helpers/worker_sequence.py): the launch is the cost.
EP_SIZES = {2: (1, 2), 4: (2, 4)}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """(ranks, ep) -> the worker's results; one launch per world size computes all its ep sizes."""
    cache: dict[tuple, dict] = {}

    def get(ranks: int, strategy: str, ep: int) -> dict:
        if (ranks, strategy, ep) not in cache:
            root = tmp_path_factory.mktemp(f"w{ranks}")
            if ranks == 1:
                launch_module(1, "tests.models.moe_worker", strategy, str(ep), str(root / "results.pt"),
                              what=f"the one-process MoE worker ({strategy}, ep {ep})")
                cache[1, strategy, ep] = torch.load(root / "results.pt")
                return cache[1, strategy, ep]
            outs = {ep: root / f"ep{ep}.pt" for ep in EP_SIZES[ranks]}
            runs = [("--", "tests.models.moe_worker", strategy, str(ep), str(out)) for ep, out in outs.items()]
            launch_module(ranks, "tests.helpers.worker_sequence", *[word for run in runs for word in run][1:],
                          what=f"the {ranks}-rank MoE workers of ep sizes {EP_SIZES[ranks]} (torchrun)")
            cache.update({(ranks, strategy, ep): torch.load(out) for ep, out in outs.items()})
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


# ----------------------------------------------------------------------------- fntrain run: checkpoints

RUN = [
    "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
    "--model.experts", "4", "--model.expert-hidden", "32", "--model.shared-experts", "1",
    "--train.global-batch-size", "8", "--train.micro-batch-size", "2", "--train.train-iters", "8",
    "--optim.name", "sgd", "--optim.lr", "0.1", "--optim.momentum", "0.9",  # AdamW would magnify fp32 noise
    "--log-every", "1", "--checkpoint.save-every", "2", "--checkpoint.restore-from", "latest",
    "--checkpoint.export", "--progress.no-enabled", "--evaluate.eval-every", "0", "--evaluate.no-at-end",
]  # fmt: skip
EP2 = ["--parallel.strategy", "fsdp2", "--parallel.ep-size", "2"]


def run_driver(run_dir: Path, ranks: int, kill: str, *args: str, corpus: Path) -> subprocess.CompletedProcess:
    run_dir.mkdir(parents=True, exist_ok=True)
    driver = [str(run_dir), kill, *RUN, *args, "--data.path", str(corpus), "--run-dir", str(run_dir)]
    stop = "to its end" if kill == "none" else f"killed at {kill}"
    what = f"the MoE resume driver's run in {run_dir.name} on {ranks} rank(s), {stop},"
    return launch_module(ranks, "tests.checkpoint.resume_driver", *driver, check=kill == "none", what=what)


def losses_by_step(run_dir: Path) -> dict[int, str]:
    words = (run_dir / "losses.txt").read_text().split()
    return dict(zip(map(int, words[::2]), words[1::2], strict=True))


def _logged(run_dir: Path, name: str) -> dict[int, float]:
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record[name] for record in records if name in record}


# The loss-free router bias is on in the ep 2 runs: its buffer must be saved, restored and resharded too.
BIAS = ["--model.router-bias-rate", "0.01"]
EP2_RUN = [*EP2, *BIAS]


@pytest.fixture(scope="module")
def moe_ep2_run(tmp_path_factory, corpus) -> Path:
    """An uninterrupted run at ep 2 (2 ranks), its checkpoints every 2 steps kept: the reference of the
    SIGKILL resume and the checkpoint the other layouts restore."""
    run_dir = tmp_path_factory.mktemp("ep2")
    run_driver(run_dir, 2, "none", *EP2_RUN, corpus=corpus)
    return run_dir


def test_sigkill_resume_at_ep2_is_bitwise(tmp_path, corpus, moe_ep2_run):
    """Killed at step 5 (step 4 saved), resumed at the same layout: the losses and final weights of
    the uninterrupted run, bit for bit; the loss-free router bias is on, so its buffer must be restored."""
    reference = moe_ep2_run
    killed = run_driver(tmp_path / "run", 2, "step_begin:5", *EP2_RUN, corpus=corpus)
    assert killed.returncode != 0
    assert sorted(losses_by_step(tmp_path / "run")) == [1, 2, 3, 4]
    run_driver(tmp_path / "run", 2, "none", *EP2_RUN, corpus=corpus)
    assert losses_by_step(tmp_path / "run") == losses_by_step(reference)
    want, got = exported_weights(reference), exported_weights(tmp_path / "run")
    assert want["blocks.0.moe.experts.w_in"].shape == (4, 32, 32)  # the full tensor: global expert index
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize(("ranks", "layout"), [(1, []), (4, ["--parallel.strategy", "fsdp2", "--parallel.ep-size", "4"])])
def test_checkpoint_saved_at_ep2_resumes_at_another_ep_size(tmp_path, corpus, moe_ep2_run, ranks, layout):
    """Step 4's checkpoint of a run at ep 2 (2 ranks) resumed at ep 1 (one process) and at ep 4 (4
    ranks, one expert each), SGD's momentum and the router bias included: the global losses of steps
    5-8 and the final weights are the uninterrupted run's to fp32 tolerance."""
    import shutil

    reference = moe_ep2_run
    run_dir = tmp_path / "resharded"
    shutil.copytree(reference / "checkpoints" / "step_4", run_dir / "checkpoints" / "step_4")
    (run_dir / "checkpoints" / "latest").write_text("step_4\n")
    allow = ["--checkpoint.allow-changes", "parallel.ep_size", "parallel.strategy"]
    run_driver(run_dir, ranks, "none", *layout, *BIAS, *allow, corpus=corpus)
    want, got = _logged(reference, "loss"), _logged(run_dir, "loss")
    assert sorted(got) == [5, 6, 7, 8]
    torch.testing.assert_close([got[s] for s in got], [want[s] for s in got], rtol=1e-5, atol=0)
    want_weights, got_weights = exported_weights(reference), exported_weights(run_dir)
    for name in want_weights:
        torch.testing.assert_close(got_weights[name], want_weights[name], rtol=0, atol=1e-5, msg=name)
