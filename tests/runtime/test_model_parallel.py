"""Tensor and pipeline parallelism (issue 20) for the tiny GPT.

Fast tier: the pipeline split (layers per stage, names kept, tied weights found, stages that compose
into the full forward), the tensor-parallel plan's rules and the job's checks of a recipe's support.
Slow tier (torchrun, gloo on CPU): tp 2, pp 2 (1F1B and GPipe), dp 2 x tp 2 and tp 2 x pp 2 runs of the
real recipe match a 1-rank run on the same global batch (losses over 5 steps, the validation loss and
the exported SGD weights at rtol 1e-5, atol 1e-6); the tp 2 run's step-3 checkpoint restores at tp 1;
AdamW state survives pp 1 -> 2 -> 1. A launch costs more than these steps: each layout is launched once
per module, the checkpoint tests restore what those runs saved, and every launch (torchrun's workers
too) forks from one process that imported torch and fntrain (tests/helpers/preloaded_launch.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fntrain.config import ConfigError
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.run.job import plan_job
from fntrain.runtime.pipeline import PipelineSplit, split_stage, stage_layers, stage_ties
from fntrain.runtime.tensor_parallel import tensor_parallel_plan
from recipes.tiny_gpt import PIPELINE, Config
from tests.helpers import preloaded_launch

TIGHT = {"rtol": 1e-5, "atol": 1e-6}
SHAPE = ModelConfig(context=16, n_layer=4, n_head=4, d_model=32)


def test_stage_layers_are_contiguous_and_earlier_stages_take_the_extra_ones():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert stage_layers(3, 1) == [range(0, 3)]
    with pytest.raises(
        ValueError, match=r"--parallel.pp-size 5 needs at least one transformer block per stage"
    ):
        stage_layers(4, 5)


def _stages(count: int) -> list[TinyGPT]:
    stages = []
    for stage in range(count):
        torch.manual_seed(0)
        stages.append(split_stage(TinyGPT(SHAPE), PIPELINE, stage=stage, stages=count))
    return stages


def test_a_stage_keeps_its_blocks_under_their_full_model_names():
    torch.manual_seed(0)
    full = TinyGPT(SHAPE)
    first, last = _stages(2)
    names = [set(dict(stage.named_parameters())) for stage in (first, last)]
    assert {"tok.weight", "pos.weight", "blocks.0.attn.q.weight", "blocks.1.mlp.2.bias"} <= names[0]
    assert {"blocks.2.ln1.weight", "blocks.3.attn.proj.weight", "ln_f.weight", "head.weight"} <= names[1]
    assert not names[0] & names[1]
    # Every weight of the full model is on exactly one stage (the tied head under its own name).
    full_names = set(dict(full.named_parameters(remove_duplicate=False)))
    assert names[0] | names[1] == full_names
    assert first.head is None and last.tok is None and list(last.blocks) == ["2", "3"]


def test_stages_compose_into_the_full_forward():
    torch.manual_seed(0)
    full = TinyGPT(SHAPE)
    ids = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.context))
    hidden = ids
    for stage in _stages(3):
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, full(ids), rtol=0, atol=0)


def test_tied_weights_across_stages_are_found():
    torch.manual_seed(0)
    assert stage_ties(TinyGPT(SHAPE), PIPELINE, 2) == [{0: "tok.weight", 1: "head.weight"}]
    assert stage_ties(TinyGPT(SHAPE), PIPELINE, 1) == []


def test_a_split_that_leaves_weights_on_every_stage_is_refused():
    split = PipelineSplit(layers="blocks", first=("tok",), last=("ln_f", "head"))  # pos forgotten
    with pytest.raises(ValueError, match=r"pos.weight would be on every stage.*`first` or `last`"):
        split_stage(TinyGPT(SHAPE), split, stage=0, stages=2)


def test_a_tensor_parallel_plan_names_known_styles_only():
    with pytest.raises(ValueError, match=r"style for 'blocks.\*.attn.q' must be one of .*got 'diagonal'"):
        tensor_parallel_plan({"blocks.*.attn.q": "diagonal"})


def test_a_recipe_without_a_plan_or_split_refuses_tp_and_pp_before_any_work():
    from recipes.vlm import Config as VlmConfig
    from recipes.vlm import spec as vlm_spec

    config = VlmConfig(parallel=VlmConfig().parallel.__class__(tp_size=2))
    with pytest.raises(ConfigError, match=r"--parallel.tp-size 2: this recipe has no tensor-parallel plan"):
        plan_job(config, vlm_spec, world_size=2)
    config = VlmConfig(parallel=VlmConfig().parallel.__class__(pp_size=2))
    with pytest.raises(ConfigError, match=r"--parallel.pp-size 2: this recipe has no pipeline split"):
        plan_job(config, vlm_spec, world_size=2)


def test_1f1b_needs_a_micro_batch_per_stage():
    from dataclasses import replace

    from recipes.tiny_gpt import spec

    config = Config()
    config = replace(
        config,
        train=replace(config.train, global_batch_size=8, micro_batch_size=8),
        parallel=replace(config.parallel, pp_size=2),
    )
    with pytest.raises(
        ConfigError, match=r"1f1b needs at least --parallel.pp-size \(2\) micro-batches per step, got 1"
    ):
        plan_job(config, spec, world_size=2)
    plan_job(replace(config, parallel=replace(config.parallel, pp_schedule="gpipe")), spec, world_size=2)


# ----------------------------------------------------------------------------- torchrun runs

RUN = [
    "--runtime.device", "cpu", "--train.train-iters", "5", "--train.global-batch-size", "8",
    "--train.micro-batch-size", "2", "--model.n-layer", "4", "--model.d-model", "32", "--model.n-head", "4",
    "--model.context", "32", "--log-every", "1", "--optim.name", "sgd", "--optim.lr", "0.3",
    "--schedule.warmup-iters", "0", "--seed", "3", "--evaluate.eval-every", "0", "--evaluate.max-batches", "0",
    "--evaluate.micro-batch-size", "8", "--data.val-fraction", "0.001",  # 69 validation samples, all evaluated
]  # fmt: skip
LAYOUTS = {
    # The tp 2 run also saves step 3: test_a_tp2_checkpoint_restores_at_tp1 restores it (saving changes no step).
    "tp2": (2, ["--parallel.tp-size", "2", "--checkpoint.save-every", "3"]),
    "pp2_1f1b": (2, ["--parallel.pp-size", "2", "--parallel.pp-schedule", "1f1b"]),
    "pp2_gpipe": (2, ["--parallel.pp-size", "2", "--parallel.pp-schedule", "gpipe"]),
    "dp2_tp2": (4, ["--parallel.tp-size", "2", "--parallel.strategy", "fsdp2"]),
    "tp2_pp2": (4, ["--parallel.tp-size", "2", "--parallel.pp-size", "2", "--parallel.no-loss-parallel"]),
}


def run_tiny_gpt(python: preloaded_launch.Python, run_dir: Path, ranks: int, *args: str) -> str:
    return preloaded_launch.run(python, ranks, "recipes.tiny_gpt", *RUN, "--run-dir", str(run_dir), *args)


def tp_run_metrics(run_dir: Path) -> tuple[list[float], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    return losses, next(row["val_loss"] for row in rows if "val_loss" in row)


def _assert_same_weights(got_dir: Path, want_dir: Path) -> None:
    got, want = (
        load_file(got_dir / "hf_model" / "model.safetensors"),
        load_file(want_dir / "hf_model" / "model.safetensors"),
    )
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TIGHT, msg=name)


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory, python) -> Path:
    run_dir = tmp_path_factory.mktemp("one_rank")
    run_tiny_gpt(python, run_dir, 1)
    return run_dir


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, python):
    """layout -> (run directory, output) of its torchrun run, each layout launched once per module."""
    cache: dict[str, tuple[Path, str]] = {}

    def get(layout: str) -> tuple[Path, str]:
        if layout not in cache:
            ranks, args = LAYOUTS[layout]
            run_dir = tmp_path_factory.mktemp(layout)
            cache[layout] = (run_dir, run_tiny_gpt(python, run_dir, ranks, *args))
        return cache[layout]

    return get


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_model_parallel_runs_match_one_rank(layout, one_rank_run, layout_runs):
    run_dir, output = layout_runs(layout)
    args = LAYOUTS[layout][1]
    tp = "2" if "--parallel.tp-size" in args else "1"
    pp = "2" if "--parallel.pp-size" in args else "1"
    assert f"tp {tp}, pp {pp}" in output
    losses, val_loss = tp_run_metrics(run_dir)
    want_losses, want_val = tp_run_metrics(one_rank_run)
    assert len(losses) == 5
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **TIGHT)
    torch.testing.assert_close(torch.tensor(val_loss), torch.tensor(want_val), **TIGHT)
    _assert_same_weights(run_dir, one_rank_run)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tp2_checkpoint_restores_at_tp1(layout_runs, python, tmp_path):
    """Saved by 2 tensor-parallel ranks at step 3 (the tp 2 run of the test above), restored by one
    process: steps 4-5 log the tp 2 run's losses and end at its weights (to float tolerance: the
    reductions run in another order)."""
    two, _ = layout_runs("tp2")
    one = tmp_path / "one"
    run_tiny_gpt(python, one, 1, "--checkpoint.restore-from", str(two / "checkpoints" / "step_3"))
    losses_one, _ = tp_run_metrics(one)
    losses_two, _ = tp_run_metrics(two)
    assert len(losses_one) == 2 and len(losses_two) == 5
    torch.testing.assert_close(torch.tensor(losses_one), torch.tensor(losses_two[3:]), **TIGHT)
    _assert_same_weights(one, two)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipeline_checkpoints_change_layout_with_their_adam_state(python, tmp_path):
    """AdamW moments survive a change of pipeline layout both ways, including the tied output head,
    which the last stage holds under its own name: an uninterrupted one-rank run's step-2 checkpoint
    resumed at pp 2 (pp 1 -> 2), and that pp 2 run's step-4 checkpoint resumed at pp 1 (pp 2 -> 1),
    log the one-rank run's losses. Two resumed steps each: the last one's loss is the first to see an
    update made with the restored moments."""
    # A constant learning rate: a resumed run follows the uninterrupted run's schedule.
    adam = ["--optim.name", "adamw", "--optim.lr", "0.003", "--schedule.kind", "constant",
            "--checkpoint.save-every", "2", "--train.train-iters", "6"]  # fmt: skip
    straight, on_two, on_one = tmp_path / "straight", tmp_path / "pp2", tmp_path / "pp1"
    run_tiny_gpt(python, straight, 1, *adam)
    want, _ = tp_run_metrics(straight)
    for run_dir, pp, saved, start in ((on_two, 2, straight / "checkpoints" / "step_2", 2),
                                      (on_one, 1, on_two / "checkpoints" / "step_4", 4)):  # fmt: skip
        restore = ["--parallel.pp-size", str(pp), "--checkpoint.restore-from", str(saved)]
        output = run_tiny_gpt(python, run_dir, pp, *adam, *restore)
        assert "optimizer state not restored" not in output and "lacks optimizer state" not in output
        losses, _ = tp_run_metrics(run_dir)
        assert len(losses) == 6 - start
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[start:]), **TIGHT)
