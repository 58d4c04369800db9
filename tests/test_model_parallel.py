"""Tensor and pipeline parallelism (issue 20) for the tiny GPT.

Fast tier: the pipeline split (layers per stage, names kept, tied weights found, stages that compose
into the full forward), the tensor-parallel plan's rules and the job's checks of a recipe's support.
Slow tier (torchrun, gloo on CPU): tp 2, pp 2 (1F1B and GPipe), dp 2 x tp 2 and tp 2 x pp 2 runs of the
real recipe match a 1-rank run on the same global batch (losses over 5 steps, the validation loss and
the exported SGD weights at rtol 1e-5, atol 1e-6); a tp 2 checkpoint restores at tp 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
from tests.test_distributed import ROOT, _env

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
    "tp2": (2, ["--parallel.tp-size", "2"]),
    "pp2_1f1b": (2, ["--parallel.pp-size", "2", "--parallel.pp-schedule", "1f1b"]),
    "pp2_gpipe": (2, ["--parallel.pp-size", "2", "--parallel.pp-schedule", "gpipe"]),
    "dp2_tp2": (4, ["--parallel.tp-size", "2", "--parallel.strategy", "fsdp2"]),
    "tp2_pp2": (4, ["--parallel.tp-size", "2", "--parallel.pp-size", "2", "--parallel.no-loss-parallel"]),
}


def _run(run_dir: Path, ranks: int, *args: str) -> str:
    command = [sys.executable, "-m", "recipes.tiny_gpt", *RUN, "--run-dir", str(run_dir), *args]
    if ranks > 1:
        command[1:3] = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            "-m",
            "recipes.tiny_gpt",
        ]
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout + result.stderr


def _metrics(run_dir: Path) -> tuple[list[float], float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    return losses, next(row["val_loss"] for row in rows if "val_loss" in row)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one_rank")
    _run(run_dir, 1)
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_model_parallel_runs_match_one_rank(layout, reference, tmp_path):
    ranks, args = LAYOUTS[layout]
    output = _run(tmp_path, ranks, *args)
    tp = "2" if "--parallel.tp-size" in args else "1"
    pp = "2" if "--parallel.pp-size" in args else "1"
    assert f"tp {tp}, pp {pp}" in output
    losses, val_loss = _metrics(tmp_path)
    want_losses, want_val = _metrics(reference)
    assert len(losses) == 5
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **TIGHT)
    torch.testing.assert_close(torch.tensor(val_loss), torch.tensor(want_val), **TIGHT)
    got, want = (
        load_file(tmp_path / "hf_model" / "model.safetensors"),
        load_file(reference / "hf_model" / "model.safetensors"),
    )
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TIGHT, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tp2_checkpoint_restores_at_tp1(reference, tmp_path):
    """Saved by 2 tensor-parallel ranks at step 5, restored by one process: the same weights, and the
    two go on to step 7 alike (to float tolerance: the reductions run in another order)."""
    two = tmp_path / "two"
    _run(two, 2, "--parallel.tp-size", "2", "--checkpoint.save-every", "5")
    checkpoint = two / "checkpoints" / "step_5"
    one = tmp_path / "one"
    longer = ["--train.train-iters", "7", "--checkpoint.allow-changes", "train.train_iters"]
    _run(one, 1, "--checkpoint.restore-from", str(checkpoint), *longer)
    _run(two, 2, "--parallel.tp-size", "2", "--checkpoint.restore-from", "latest", *longer)
    losses_one, _ = _metrics(one)
    losses_two, _ = _metrics(two)
    assert len(losses_one) == 2 and len(losses_two) == 7
    torch.testing.assert_close(torch.tensor(losses_one), torch.tensor(losses_two[5:]), **TIGHT)
    got, want = (
        load_file(one / "hf_model" / "model.safetensors"),
        load_file(two / "hf_model" / "model.safetensors"),
    )
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TIGHT, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipeline_checkpoints_change_layout_with_their_adam_state(tmp_path):
    """AdamW moments survive a change of pipeline layout both ways (pp 2 -> 1 and pp 1 -> 2), including
    the tied output head, which the last stage holds under its own name: the resumed steps equal those
    of an uninterrupted one-rank run."""
    # A constant learning rate: a run stopped at step 3 then resumed follows the 5-step run's schedule.
    adam = [
        "--optim.name",
        "adamw",
        "--optim.lr",
        "0.003",
        "--schedule.kind",
        "constant",
        "--checkpoint.save-every",
        "3",
    ]
    longer = ["--checkpoint.allow-changes", "train.train_iters", "--train.train-iters", "5"]
    straight = tmp_path / "straight"
    _run(straight, 1, *adam)
    want, _ = _metrics(straight)
    for saved_pp, resumed_pp in ((2, 1), (1, 2)):
        saved, resumed = tmp_path / f"saved_{saved_pp}", tmp_path / f"resumed_{resumed_pp}"
        _run(saved, saved_pp, *adam, "--parallel.pp-size", str(saved_pp), "--train.train-iters", "3")
        output = _run(resumed, resumed_pp, *adam, "--parallel.pp-size", str(resumed_pp), *longer,
                      "--checkpoint.restore-from", str(saved / "checkpoints" / "step_3"))  # fmt: skip
        assert "optimizer state not restored" not in output and "lacks optimizer state" not in output
        losses, _ = _metrics(resumed)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[3:]), **TIGHT)
