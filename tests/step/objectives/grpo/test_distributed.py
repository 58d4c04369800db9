"""GRPO on 2 ranks (torchrun, gloo, CPU) trains as one process does, under `--parallel.strategy ddp` and
`fsdp2`, at the same global batch: every completion the same tokens, every logged metric (but wall-clock
ones) and the final weights the same to float tolerance. Slow tier (torchrun).

Three cases, each on the three layouts (one process, ddp, fsdp2):
- `plain`: each optimizer step generates its own batch (R = 1), loss_type grpo, no KL;
- `multi`: a generation batch of twice the micro-batches of a step, reused twice (num_iterations 2),
  so R = 4 optimizer steps per generation and the old log-probs are kept; beta 0.04 with a frozen
  reference copy (sharded like the policy under fsdp2); loss_type dapo (the generation batch's tokens);
- `lora`: a LoRA adapter with the adapter-off reference (beta 0.04), R = 2, loss_type dr_grpo.

The loss's metrics ("entropy", "kl", "clip_ratio/*") are TRL's values per micro-step, over the rows
every rank trains on in it (`fntrain.step.objectives.grpo.loss`), averaged over the step's micro-steps:
one process has one micro-batch per micro-step, 2 ranks two. Their token means then weigh two
micro-batches of different token counts together where one process averages each micro-batch's mean,
and their per-row extremes ("clip_ratio/low_min", "/high_max") range over two micro-batches' rows:
they depend on the layout, as TRL's do. So they are compared between ddp and fsdp2 (the same rows in
each micro-step), every other metric between one process and 2 ranks.

The completions are compared whole: the reward function (a module written to the test's directory, on
the workers' PYTHONPATH) appends every (step, prompt, completion ids) it scores to a file per rank, so
every row of every generation batch is compared, not just samples.jsonl's first few of rank 0. A row's
sample index is not passed to reward functions, so the rows are compared per (step, prompt) as sorted
lists of completions. Several token ids end a completion (the model's generation_config), so
completions have different lengths and micro-batches are padded.

Tolerances: metrics rel 1e-5, abs 1e-6 (tests/runtime/test_distributed.py's); final weights rtol 1e-5, atol 1e-6
(they differ by ~4e-8 at most). SGD, as in tests/step/objectives/test_dpo_distributed.py: Adam turns float-level
gradient differences into lr-sized steps.

Every launch goes through tests/step/objectives/dpo_dist_worker.py (one launch per layout serves every case), forked
from one process that imported torch and transformers once (tests/helpers/fork_server.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers.fork_server import started
from tests.helpers.waiting import run_to_end
from tests.step.objectives.grpo.helpers import (
    GRPO_PRELOAD,
    RECORD,
    final_weights,
    grpo_env,
    is_timing,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[4]
TOLERANCE = {"rel": 1e-5, "abs": 1e-6}  # tests/runtime/test_distributed.py's rtol 1e-5, atol 1e-6
WEIGHTS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
COMMON = [
    "--train.global-batch-size", "8", "--train.micro-batch-size", "2",
    "--optim.name", "sgd", "--optim.lr", "0.5", "--schedule.kind", "constant", "--schedule.warmup-iters", "0",
    "--grpo.num-generations", "4", "--grpo.max-completion-length", "12",
    "--log-every", "1", "--progress.no-enabled", "--checkpoint.save-every", "0",
]  # fmt: skip
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.dropout", "0", "--lora.target-modules", "q_proj", "v_proj"]  # fmt: skip


def case_flags(name: str, ranks: int) -> list[str]:
    """The flags of case `name` on `ranks` ranks: grpo.steps_per_generation counts micro-batches per rank,
    so the same generation batch is half as many on 2 ranks."""
    micro_batches = 8 // (2 * ranks)  # global batch 8, micro-batch 2
    reward = ["--grpo.reward-funcs", f"grpo_test_rewards:{name}"]
    if name == "plain":
        return [*reward, "--train.train-iters", "3", "--grpo.loss-type", "grpo"]
    if name == "multi":
        return [*reward, "--train.train-iters", "8", "--grpo.steps-per-generation", str(2 * micro_batches),
                "--grpo.num-iterations", "2", "--grpo.beta", "0.04"]  # fmt: skip
    return [*reward, *LORA, "--train.train-iters", "4", "--grpo.steps-per-generation", str(2 * micro_batches),
            "--grpo.beta", "0.04", "--grpo.reference", "adapter-off", "--grpo.loss-type", "dr_grpo",
            "--optim.lr", "2.0"]  # fmt: skip


CASES = ("plain", "multi", "lora")
LAYOUTS = ("one", "ddp", "fsdp2")
# case -> (optimizer steps, optimizer steps per generation batch, completions per generation batch)
SHAPES = {"plain": (3, 1, 8), "multi": (8, 4, 16), "lora": (4, 2, 16)}


def per_micro_step(name: str) -> bool:
    """One of the loss's metrics, TRL's values over a micro-step's rows (see the module docstring)."""
    return name in ("entropy", "kl") or name.startswith("clip_ratio/")


def launch_grpo(root: Path, layout: str, inputs: tuple[Path, Path, Path], launch_env: dict[str, str]) -> Path:
    model, prompts, _ = inputs
    ranks = 1 if layout == "one" else 2
    strategy = "none" if layout == "one" else layout
    data = ["--model.path", str(model), "--data.path", str(prompts)]
    cases = [f"{name}=grpo:{json.dumps([*COMMON, *data, *case_flags(name, ranks)])}" for name in CASES]  # fmt: skip
    runner = ["torchrun", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else [launch_env["PYTHON_FORK"]]  # fmt: skip
    (root / "record").mkdir(parents=True)
    result = run_to_end([*runner, "-m", "tests.step.objectives.dpo_dist_worker", strategy, str(root), *cases],
                        f"the GRPO cases' worker on layout {layout} ({ranks} rank(s))", 500, cwd=ROOT,
                        env={**launch_env, RECORD: str(root / "record")})  # fmt: skip
    assert result.returncode == 0, f"{layout} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return root


@pytest.fixture(scope="module")
def grpo_layout_runs(grpo_run_inputs, tmp_path_factory) -> dict[str, Path]:
    """layout -> the root of its run directories (ROOT/<case>) and records (ROOT/record). The reward
    module's directory is on the fork server's PYTHONPATH: every command it forks (torchrun's agent
    and workers, the one process) imports from its sys.path."""
    with started(grpo_env(grpo_run_inputs[2]), GRPO_PRELOAD) as launched:
        return {
            layout: launch_grpo(tmp_path_factory.mktemp(layout), layout, grpo_run_inputs, launched) for layout in LAYOUTS
        }


def completions(root: Path, case: str) -> dict[tuple[int, int], list[list[int]]]:
    """(step, prompt id) -> the sorted completions every rank scored for it."""
    rows: dict[tuple[int, int], list[list[int]]] = {}
    for path in sorted((root / "record").glob(f"{case}.rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault((row["step"], row["prompt"]), []).append(row["completion"])
    return {key: sorted(value) for key, value in sorted(rows.items())}


def logged_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not is_timing(k)} for row in rows if "loss" in row]


def assert_same_completions(
    got: Path, want: Path, case: str, steps: int, per_generation: int, rows: int
) -> None:
    expected, actual = completions(want, case), completions(got, case)
    assert sorted({step for step, _ in expected}) == list(range(0, steps, per_generation))
    assert sum(len(value) for value in expected.values()) == rows * len(range(0, steps, per_generation))
    assert all(len(value) == 4 for value in expected.values())  # every prompt's group, whole
    assert actual == expected


def assert_same_metrics(got: Path, want: Path, steps: int, skip=lambda name: False) -> list[dict]:
    """Every row of metrics.jsonl, every metric in it but wall-clock ones and those `skip` names, the
    same to TOLERANCE; the same names in both."""
    expected, actual = logged_metrics(want), logged_metrics(got)
    assert [row["step"] for row in expected] == [row["step"] for row in actual] == list(range(1, steps + 1))
    for want_row, got_row in zip(expected, actual, strict=True):
        assert sorted(got_row) == sorted(want_row), want_row["step"]
        for name, value in want_row.items():
            if skip(name):
                continue
            where = (want_row["step"], name, got_row[name], value)
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got_row[name]), where
            else:
                assert got_row[name] == pytest.approx(value, **TOLERANCE), where
    return expected


def assert_same_final_weights(got: Path, want: Path) -> None:
    expected, actual = final_weights(want), final_weights(got)
    assert expected and expected.keys() == actual.keys()
    for key in expected:
        assert torch.allclose(actual[key], expected[key], **WEIGHTS_TOLERANCE), key


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_train_as_one_process(grpo_layout_runs, layout, case):
    """The same completions, metrics (but the loss's per-micro-step ones) and final weights."""
    steps, per_generation, rows = SHAPES[case]
    got, want = grpo_layout_runs[layout], grpo_layout_runs["one"]
    assert json.loads((got / case / "run_metadata.json").read_text())["world_size"] == 2
    assert_same_completions(got, want, case, steps, per_generation, rows)
    expected = assert_same_metrics(got / case, want / case, steps, skip=per_micro_step)
    assert_same_final_weights(got / case, want / case)
    # The numbers compared move: rewards vary in each group, completions end early and at the limit,
    # the policy leaves the reference and (multi) the sampling policy far enough to clip
    generated = [row for row in expected if "reward_std" in row]
    assert len(generated) == steps // per_generation
    assert all(row["reward_std"] > 0 and row["completions/clipped_ratio"] < 1 for row in generated)
    assert any(row["completions/clipped_ratio"] > 0 for row in generated)
    if case != "plain":
        assert expected[-1]["kl"] > 0
    if case == "multi":
        assert any(row["clip_ratio/region_mean"] > 0 for row in expected)


@pytest.mark.parametrize("case", CASES)
def test_ddp_and_fsdp2_agree_on_every_metric(grpo_layout_runs, case):
    """The two strategies put the same rows in each micro-step: every metric agrees, the per-micro-step
    ones included."""
    expected = assert_same_metrics(grpo_layout_runs["fsdp2"] / case, grpo_layout_runs["ddp"] / case, SHAPES[case][0])
    assert all("entropy" in row and "clip_ratio/low_min" in row for row in expected)
