"""The vision-language recipe (recipes/vlm.py): its settings and their one-line errors, its plan, and a
few steps through run_job on the tiny LLaVA (fast); in the slow tier the built-in default learning
the shapes set, the exported model answering with transformers, a 2-rank FSDP2 run matching one rank,
and a SIGKILL-and-resume run matching an uninterrupted one bit for bit. The data transform and the
model glue are pinned in tests/data/test_vlm.py and tests/models/test_vlm.py."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from fntrain.cli import dispatch
from fntrain.data.shapes import ShapesQA
from fntrain.data.vlm import VLMDataConfig
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.models.vlm import VLMModelConfig
from fntrain.run.config import TrainConfig
from fntrain.run.job import plan_job, run_job
from fntrain.step.optim import OptimizerConfig
from recipes import vlm
from tests.helpers.fork_server import VLM_PRELOAD, started
from tests.helpers.waiting import run_to_end
from tests.helpers.workers import worker_env

ROOT = Path(__file__).resolve().parents[2]


def test_bad_settings_are_one_line_naming_the_flag(tmp_path, capsys):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("{}\n")
    for args, words in (
        (["--data.max-length", "1"], "--data.max-length"),
        (["--answer-tokens", "-1"], "--answer-tokens"),
        (["--model.path", str(tmp_path / "nope")], "--model.path"),
        (["--data.path", str(jsonl)], "--data.path needs --model.path"),
        (["--data.val-samples", "0"], "--data.val-samples > 0"),
        (["--parallel.meta-init"], "--parallel.meta-init"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            dispatch(["run", "vlm", "--run-dir", str(tmp_path / "run"), *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()  # nothing built before the settings were checked


def test_plan_needs_no_model(tmp_path):
    config = vlm.Config(run_dir=str(tmp_path), model=VLMModelConfig(cache_dir=str(tmp_path / "cache")))
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, strategy="ddp"))
    plan = plan_job(config, vlm.spec, world_size=2)

    text = json.dumps(plan)
    assert "generated shapes" in text and "4096" in text
    assert not (tmp_path / "cache").exists()


def vlm_run_config(model_dir: Path, run_dir: Path, **changes) -> vlm.Config:
    return dataclasses.replace(
        vlm.Config(
            run_dir=str(run_dir),
            log_every=1,
            model=VLMModelConfig(path=str(model_dir)),
            data=VLMDataConfig(train_samples=16, val_samples=8),
            train=TrainConfig(train_iters=3, global_batch_size=4, micro_batch_size=2),
            optim=OptimizerConfig(lr=1e-2, weight_decay=0.0),
            evaluate=EvaluateConfig(at_end=True),
            progress=ProgressConfig(enabled=False),
        ),
        **changes,
    )


def test_three_steps_train_on_images_evaluate_accuracy_and_export(tiny_llava_dir, tmp_path):
    from safetensors.torch import load_file

    config = vlm_run_config(tiny_llava_dir, tmp_path / "run")
    result = run_job(config, vlm.spec)
    assert result.outcome == "completed" and result.state.global_step == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and all(r["loss"] > 0 for r in steps)
    assert any(r.get("tflops", 0) > 0 for r in steps)  # FLOPs counted on a meta copy, images included
    evaluation = [r for r in records if "val_accuracy" in r][-1]
    assert 0.0 <= evaluation["val_accuracy"] <= 1.0 and evaluation["val_loss"] > 0
    before, after = (
        load_file(tiny_llava_dir / "model.safetensors"),
        load_file(tmp_path / "run/hf_model/model.safetensors"),
    )
    vision = [name for name in after if "vision_tower" in name]
    assert vision and any(not torch.equal(before[n], after[n]) for n in vision)  # the images were seen
    assert (tmp_path / "run" / "hf_model" / "processor_config.json").exists()


# ----------------------------------------------------------------------------- slow


@pytest.fixture(scope="module")
def vlm_launch_env():
    """The environment of this module's driver launches: each its own process (torchrun's agent and
    workers too), forked from one that imported torch and transformers once (tests/helpers/fork_server.py)."""
    with started(worker_env(), VLM_PRELOAD) as env:
        yield env


def _driver(
    out: Path, kill: str, args: list[str], env: dict[str, str], *, ranks: int = 1
) -> subprocess.CompletedProcess:
    command = ["torchrun", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else [env["PYTHON_FORK"]]
    command += ["-m", "tests.recipes.vlm_driver", str(out), kill, *args, "--run-dir", str(out)]
    stop = "to its end" if kill == "none" else f"killed at {kill}"
    what = f"the VLM driver's run in {out.name} on {ranks} rank(s), {stop},"
    return run_to_end(command, what, 600, cwd=ROOT, env=env)


def loss_words(out: Path) -> list[str]:
    return (out / "losses.txt").read_text().split()


@pytest.mark.slow
def test_the_default_learns_the_shapes_and_the_export_answers_with_transformers(tmp_path):
    """`fntrain run vlm` as the README shows it (300 steps), with a temporary cache: held-out answer
    accuracy >= 0.85 (chance 0.25); the exported model, reloaded with transformers, answers >= 0.8 of
    32 other held-out questions.

    Measured with `--seed S` on 2 shared x86 CPU cores (val_accuracy on 128 rows; right of the 32 rows
    below): 0: 0.961 (32), 1: 0.969 (32), 2: 1.000 (31), 3: 0.984 (30), 4: 0.984 (32), 5: 0.969 (29),
    42 (the default, run here): 0.992 (32). With one torch thread, as the slow tier runs it beside another
    test file (`-n 2`): 0: 0.945, 1: 0.984, 2: 1.000, 3: 0.977, 4: 0.961, 42: 0.992. The bars sit about
    0.1 below the worst seed: another machine's float rounding, or another thread count, moves the
    trajectory (seed 42 once gave 0.836 on one VM, 0.797 on another, with older data)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run_dir = tmp_path / "run"
    dispatch(["run", "vlm", "--run-dir", str(run_dir), "--model.cache-dir", str(tmp_path / "cache"),
              "--progress.no-enabled", "--train.train-iters", "300"])  # fmt: skip
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["val_accuracy"] for r in records if "val_accuracy" in r][-1]
    assert accuracy >= 0.85, accuracy

    model = AutoModelForImageTextToText.from_pretrained(run_dir / "hf_model", local_files_only=True)
    processor = AutoProcessor.from_pretrained(run_dir / "hf_model", local_files_only=True)
    held_out = ShapesQA(32, seed=42, start=10_000)  # never trained on
    right = 0
    for row in held_out:
        text = processor.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[row["image"]], return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        said = processor.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).split()
        right += said[:1] == [row["messages"][1]["content"]]
    assert right / len(held_out) >= 0.8, right


SMALL = ["--data.train-samples", "32", "--data.val-samples", "8", "--train.global-batch-size", "8",
         "--train.micro-batch-size", "2", "--log-every", "1", "--progress.no-enabled",
         "--evaluate.eval-every", "0", "--evaluate.no-at-end"]  # fmt: skip


@pytest.mark.slow
def test_two_rank_fsdp2_matches_one_rank(tiny_llava_dir, vlm_launch_env, tmp_path):
    from safetensors.torch import load_file

    args = [*SMALL, "--model.path", str(tiny_llava_dir), "--train.train-iters", "4", "--optim.name", "sgd",
            "--optim.lr", "0.05", "--train.max-grad-norm", "0", "--data.pad-to", "max_length",
            "--data.max-length", "40"]  # fmt: skip
    one = _driver(tmp_path / "one", "none", args, vlm_launch_env)
    assert one.returncode == 0, one.stderr[-4000:]
    two = _driver(tmp_path / "two", "none", [*args, "--parallel.strategy", "fsdp2"], vlm_launch_env, ranks=2)
    assert two.returncode == 0, two.stderr[-4000:]

    def logged(out: Path) -> torch.Tensor:  # the loss reduced over the ranks, as metrics.jsonl logs it
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return torch.tensor([r["loss"] for r in records if "loss" in r], dtype=torch.float64)

    reference = logged(tmp_path / "one")
    assert len(reference) == 4
    torch.testing.assert_close(logged(tmp_path / "two"), reference, rtol=1e-5, atol=1e-6)
    initial = load_file(tiny_llava_dir / "model.safetensors")
    a = load_file(tmp_path / "one" / "hf_model" / "model.safetensors")
    b = load_file(tmp_path / "two" / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[n], initial[n]) for n in a if "vision_tower" in n)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_sigkill_and_resume_matches_an_uninterrupted_run_bitwise(tiny_llava_dir, vlm_launch_env, tmp_path):
    from safetensors.torch import load_file

    args = [*SMALL, "--model.path", str(tiny_llava_dir), "--train.train-iters", "8", "--checkpoint.save-every", "2",
            "--checkpoint.restore-from", "latest", "--loader.num-workers", "2"]  # fmt: skip
    reference = _driver(tmp_path / "ref", "none", args, vlm_launch_env)
    assert reference.returncode == 0, reference.stderr[-4000:]
    killed = _driver(tmp_path / "resumed", "step_begin:6", args, vlm_launch_env)
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), killed.stderr[-4000:]
    assert len(loss_words(tmp_path / "resumed")) == 2 * 5
    resumed = _driver(tmp_path / "resumed", "none", args, vlm_launch_env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    ref = loss_words(tmp_path / "ref")
    got = loss_words(tmp_path / "resumed")
    assert got[:8] == ref[:8] and got[10:] == ref[8:]  # steps 1-4, then 5-8 again from step 4's checkpoint
    a = load_file(tmp_path / "ref" / "hf_model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "hf_model" / "model.safetensors")
    assert all(torch.equal(a[n], b[n]) for n in a)
