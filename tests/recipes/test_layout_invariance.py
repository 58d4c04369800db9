"""What a user reads does not depend on the layout [S21] [S23]: every recipe (tiny_gpt, hf_causal_lm, dpo,
kd, grpo), at the same global batch, logs the same value of every metric in metrics.jsonl (train and
`val_`), writes the same samples and saves the same checkpoint on each layout it allows:

- `one`: one process, micro-batches of a quarter of the global batch (4 accumulation steps);
- `whole`: one process, the whole global batch in one micro-batch (no accumulation);
- `ddp`, `fsdp2`: 2 ranks under torchrun, a quarter of the global batch per micro-batch (2 accumulation
  steps on each rank).

The metric names are read from the files, not listed here: a new metric is compared the day it appears.
Only wall-clock metrics (`WALL_CLOCK`) are left out, and the metrics that are means over one micro-batch
(or micro-step) by their definition (`PER_MICRO_BATCH`, each with its reason): those are compared on
the layouts whose micro-batches hold the same rows as `one`'s, and must appear in the runs (so an
exception cannot outlive its metric).

Checkpoints (the last step's, saved by `--checkpoint.save-every`) are compared whole: every tensor of the
DCP state (the model, the optimizer's state; fsdp2's shards read back as one), the train state, data
position, optimizer hyper-parameters, val_loss and every hook's state; left out are what names the layout
itself (world size, the micro-batch size and strategy in the saved config, each rank's RNG streams) and
the clock. Exported weights are compared too.

Every layout is one launch of tests/step/objectives/dpo_dist_worker.py running the five recipes one after
another, forked from one process that imported torch, transformers and the recipes once
(tests/helpers/fork_server.py). SGD, as in the other layout tests: Adam turns float-level gradient
differences into lr-sized steps. Tolerances: tests/runtime/test_distributed.py's. Slow tier (torchrun).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.fork_server import started
from tests.helpers.waiting import run_to_end
from tests.step.objectives.dpo_helpers import CORPUS, bigger_teacher, preference_rows, tiny_llama
from tests.step.objectives.grpo.helpers import GRPO_PRELOAD, grpo_env, grpo_inputs, is_timing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
# tests/runtime/test_distributed.py's rel 1e-5; abs 5e-6 rather than its 1e-6: DPO's rewards/* are beta times a
# difference of summed log-probs near -30, whose float32 rounding (~4e-6) survives the difference
TOLERANCE = {"rel": 1e-5, "abs": 5e-6}
TENSOR_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
STEPS = 3
LAYOUTS = {"one": (1, "none", 4), "whole": (1, "none", 1), "ddp": (2, "ddp", 2), "fsdp2": (2, "fsdp2", 2)}
"""layout -> (ranks, strategy, micro-batches per optimizer step on each rank)."""
RECIPES = ("tiny_gpt", "hf_causal_lm", "dpo", "kd", "grpo")
GLOBAL_BATCH = {"tiny_gpt": 4, "hf_causal_lm": 4, "dpo": 4, "kd": 4, "grpo": 8}
WALL_CLOCK = is_timing  # time/*, *_per_s, step_time_s, tflops, mfu: different in every run
PER_MICRO_BATCH = {
    "dpo": (("logits/chosen", "logits/rejected", "val_logits/chosen", "val_logits/rejected"), ("ddp", "fsdp2"),
            "TRL 1.16's: a token mean over each micro-batch's completions, then a mean over micro-batches, "
            "so it changes with which pairs share a micro-batch (`whole`'s one micro-batch of 4 pairs; "
            "evaluation's micro-batches are training's)"),
    "grpo": (("entropy", "kl", "clip_ratio/"), (),
             "TRL's values over the rows of one micro-step: one process's micro-step is one micro-batch, "
             "2 ranks' two (tests/step/objectives/grpo/test_distributed.py); ddp and fsdp2 agree"),
}
"""recipe -> (metric names, or prefixes ending in "/"; the layouts on which they match `one`; why)."""
LAYOUT_NAMED = {
    "world_size": "the number of ranks is the layout",
    "num_threads": "torch's CPU threads per process follow the ranks per machine",
    "run_dir": "each run's own directory",
    "saved_at": "the clock",
    "rng": "each rank's own python, numpy and torch streams",
    "rank": "the rank that wrote the file",
}
"""Checkpoint metadata that names the layout, the run or the clock, with why it may differ."""
CONFIG_LAYOUT = (("parallel", "strategy"), ("train", "micro_batch_size"), ("run_dir",))
SAMPLE = ["--sample.prompts", "What colour is the sky?", "--sample.max-new-tokens", "8", "--sample.every", "2"]
COMMON = [
    "--train.train-iters", str(STEPS), "--optim.name", "sgd", "--optim.lr", "0.2", "--optim.momentum", "0.9",
    "--schedule.kind", "constant",
    "--schedule.warmup-iters", "0", "--log-every", "1", "--progress.no-enabled",
    "--checkpoint.save-every", str(STEPS), "--checkpoint.export", *SAMPLE,
]  # fmt: skip


def recipe_flags(root: Path, inputs: dict[str, Path]) -> dict[str, list[str]]:
    """recipe -> its flags but the layout's: tiny models, evaluation on a validation split (not for
    grpo, which has none) at step 2 and at the end."""
    evaluate = ["--evaluate.eval-every", "2", "--evaluate.at-end"]
    hf = ["--model.path", str(inputs["llama"])]
    return {
        "tiny_gpt": [*evaluate, "--data.path", str(inputs["text"]), "--data.val-fraction", "0.05",
                     "--model.context", "32", "--model.n-layer", "2", "--model.n-head", "2", "--model.d-model", "32"],
        "hf_causal_lm": [*evaluate, *hf, "--data.path", str(inputs["sft"]), "--data.val-fraction", "0.2",
                         "--data.max-length", "48"],
        "dpo": [*evaluate, *hf, "--data.path", str(inputs["prefs"]), "--data.val-fraction", "0.2",
                "--dpo.beta", "0.5"],
        "kd": [*evaluate, *hf, "--data.path", str(inputs["texts"]), "--data.val-fraction", "0.2",
               "--data.max-length", "32", "--kd.teacher-path", str(inputs["teacher"]), "--kd.ratio", "0.5"],
        "grpo": ["--model.path", str(inputs["grpo_llama"]), "--data.path", str(inputs["prompts"]),
                 "--grpo.reward-funcs", "grpo_test_rewards:plain", "--grpo.num-generations", "4",
                 "--grpo.max-completion-length", "12"],
    }  # fmt: skip


def make_inputs(root: Path) -> dict[str, Path]:
    """Tiny models and data on disk: 15 rows, the 12 a recipe's 3 steps of 4 read and a validation tail
    of 3 (`--data.val-fraction 0.2`), an odd count: 2 ranks split it unevenly."""
    llama = tiny_llama(root / "llama", max_positions=64)
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()][:15]
    text = root / "corpus.txt"
    text.write_text(CORPUS.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    prefs = preference_rows(15, seed=3)
    files = {
        "sft": [{"prompt": row["prompt"], "completion": row["chosen"]} for row in prefs],
        "prefs": prefs,
        "texts": [{"text": line} for line in lines],
    }
    for name, rows in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    model, prompts, modules = grpo_inputs(root / "grpo")
    inputs = {name: root / f"{name}.jsonl" for name in files}
    return {**inputs, "llama": llama, "teacher": bigger_teacher(llama, root / "teacher"), "text": text,
            "grpo_llama": model, "prompts": prompts, "modules": modules}  # fmt: skip


def layout_flags(recipe: str, layout: str) -> list[str]:
    ranks, _, accumulation = LAYOUTS[layout]
    batch = GLOBAL_BATCH[recipe]
    return ["--train.global-batch-size", str(batch), "--train.micro-batch-size", str(batch // (ranks * accumulation))]


def launch_every_recipe(root: Path, layout: str, flags: dict[str, list[str]], launch_env: dict[str, str]) -> Path:
    """Run every recipe on `layout` in one launch; its run directories are ROOT/<recipe>."""
    ranks, strategy, _ = LAYOUTS[layout]
    cases = [f"{name}={name}:{json.dumps([*COMMON, *flags[name], *layout_flags(name, layout)])}" for name in RECIPES]
    runner = ["torchrun", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else [launch_env["PYTHON_FORK"]]
    command = [*runner, "-m", "tests.step.objectives.dpo_dist_worker", strategy, str(root), *cases]
    result = run_to_end(command, f"every recipe on layout {layout} ({ranks} rank(s))", 800, cwd=ROOT, env=launch_env)
    assert result.returncode == 0, f"{layout} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return root


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> dict[str, Path]:
    """layout -> the root of its run directories, one per recipe."""
    inputs = make_inputs(tmp_path_factory.mktemp("inputs"))
    flags = recipe_flags(tmp_path_factory.getbasetemp(), inputs)
    preload = (*GRPO_PRELOAD, "recipes.tiny_gpt")
    with started(grpo_env(inputs["modules"]), preload) as launch_env:
        return {layout: launch_every_recipe(tmp_path_factory.mktemp(layout), layout, flags, launch_env) for layout in LAYOUTS}


# ----------------------------------------------------------------------------- what the runs wrote


def metric_rows(run_dir: Path) -> list[dict]:
    """Every row of metrics.jsonl (steps and evaluations), wall-clock metrics left out."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{name: value for name, value in row.items() if not WALL_CLOCK(name)} for row in rows]


def per_micro_batch(recipe: str) -> Callable[[str], bool]:
    """Whether a metric of `recipe` is one of its PER_MICRO_BATCH ones."""
    names = PER_MICRO_BATCH.get(recipe, ((), (), ""))[0]
    return lambda name: any(name == item or (item.endswith("/") and name.startswith(item)) for item in names)


def assert_same_value(got, want, where) -> None:
    if isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), where
    elif isinstance(want, (int, float)) and not isinstance(want, bool):
        assert got == pytest.approx(want, **TOLERANCE), where
    else:
        assert got == want, where


def assert_same_metric_rows(got: Path, want: Path, skip: Callable[[str], bool] = lambda name: False) -> list[dict]:
    """The same rows, each with the same metric names and (but those `skip` names) values."""
    expected, actual = metric_rows(want), metric_rows(got)
    assert len(actual) == len(expected), (len(actual), len(expected))
    for want_row, got_row in zip(expected, actual, strict=True):
        assert sorted(got_row) == sorted(want_row), (want_row["step"], sorted(got_row), sorted(want_row))
        for name, value in want_row.items():
            if not skip(name):
                assert_same_value(got_row[name], value, (want_row["step"], name, got_row[name], value))
    return expected


def checkpoint_tensors(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, sharded or not, read back whole in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch, weights_only=False)


def checkpoint_record(checkpoint: Path) -> dict:
    """meta.json and rank 0's record without what names the layout, the run or the clock (LAYOUT_NAMED)."""
    record = {**json.loads((checkpoint / "meta.json").read_text()), **json.loads((checkpoint / "rank_0.json").read_text())}
    config = record.pop("config")
    for path in CONFIG_LAYOUT:
        section = config
        for key in path[:-1]:
            section = section[key]
        section.pop(path[-1])
    return {"config": config, **{key: value for key, value in record.items() if key not in LAYOUT_NAMED}}


def assert_same_tree(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (where, sorted(got), sorted(want))
        for key in want:
            assert_same_tree(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_tree(a, b, f"{where}[{index}]")
    elif isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, where
        assert torch.allclose(got.float(), want.float(), **TENSOR_TOLERANCE), (where, (got - want).abs().max())
    else:
        assert_same_value(got, want, where)


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor the run exported (model.safetensors and hf_model/*.safetensors), keyed file:name."""
    from safetensors.torch import load_file

    files = [run_dir / "model.safetensors", *sorted((run_dir / "hf_model").glob("*.safetensors"))]
    return {f"{path.name}:{key}": value for path in files if path.exists() for key, value in load_file(path).items()}


# ----------------------------------------------------------------------------- the tests

PAIRS = [(recipe, layout) for recipe in RECIPES for layout in ("whole", "ddp", "fsdp2")]


@pytest.mark.parametrize(("recipe", "layout"), PAIRS)
def test_every_metric_is_the_same_on_every_layout(recipe_runs, recipe, layout):
    """Every metric of every row, train and val_, against one process with 4 accumulation steps."""
    got, want = recipe_runs[layout] / recipe, recipe_runs["one"] / recipe
    exempt = per_micro_batch(recipe)
    matching = layout in PER_MICRO_BATCH.get(recipe, ((), (), ""))[1]
    expected = assert_same_metric_rows(got, want, skip=lambda name: exempt(name) and not matching)
    names = {name for row in expected for name in row}
    assert [row["step"] for row in expected if "loss" in row] == list(range(1, STEPS + 1))  # every step logged
    assert recipe == "grpo" or any(name.startswith("val_") for name in names), names
    if recipe in PER_MICRO_BATCH:
        assert any(exempt(name) for name in names), names  # the exception still names real metrics


def test_grpo_per_micro_step_metrics_agree_where_micro_steps_match(recipe_runs):
    """ddp and fsdp2 train the same rows in each micro-step: every metric agrees, those too."""
    expected = assert_same_metric_rows(recipe_runs["fsdp2"] / "grpo", recipe_runs["ddp"] / "grpo")
    assert any(per_micro_batch("grpo")(name) for row in expected for name in row)


@pytest.mark.parametrize(("recipe", "layout"), PAIRS)
def test_the_same_samples_on_every_layout(recipe_runs, recipe, layout):
    """samples.jsonl: every sample (its step, prompt, text and, for grpo, the completions and rewards)."""
    got, want = recipe_runs[layout] / recipe, recipe_runs["one"] / recipe
    expected = (want / "samples.jsonl").read_text().splitlines()
    assert expected
    actual = (got / "samples.jsonl").read_text().splitlines()
    assert len(actual) == len(expected)
    for index, (a, b) in enumerate(zip(actual, expected, strict=True)):
        assert_same_tree(json.loads(a), json.loads(b), f"samples.jsonl line {index + 1}")


@pytest.mark.parametrize(("recipe", "layout"), PAIRS)
def test_the_same_checkpoint_on_every_layout(recipe_runs, recipe, layout, tmp_path):
    """The last step's checkpoint: every tensor and every recorded value but LAYOUT_NAMED's; and the
    exported weights."""
    got, want = recipe_runs[layout] / recipe, recipe_runs["one"] / recipe
    checkpoint = Path("checkpoints") / f"step_{STEPS}"
    expected = checkpoint_tensors(want / checkpoint, tmp_path / "want.pt")
    assert any(key.startswith("model") for key in expected) and any(key.startswith("optimizer") for key in expected)
    assert_same_tree(checkpoint_tensors(got / checkpoint, tmp_path / "got.pt"), expected, "dcp")
    assert_same_tree(checkpoint_record(got / checkpoint), checkpoint_record(want / checkpoint), "record")
    weights = exported(want)
    assert weights
    assert_same_tree(exported(got), weights, "export")
