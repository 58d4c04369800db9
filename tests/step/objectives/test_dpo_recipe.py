"""The `dpo` and `kd` recipes end to end on a tiny Llama (a few steps in this process): what they log, count,
export and refuse. TRL parity: tests/step/objectives/test_dpo_trl.py; ranks, kills and learning: tests/step/objectives/test_dpo_*.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from fntrain.cli import dispatch
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.models.hf_config import HFModelConfig
from fntrain.run.config import CheckpointConfig, TrainConfig
from fntrain.run.job import run_job
from fntrain.step.objectives import DPOConfig, KDConfig
from fntrain.step.optim import OptimizerConfig
from tests.helpers.commands import expect_one_line
from tests.helpers.files import file_hashes_and_siblings
from tests.step.objectives.dpo_helpers import preference_rows, tiny_llama

pytest.importorskip("transformers")

TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")  # fmt: skip


@pytest.fixture(scope="module")
def dpo_inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama, a bigger teacher with its tokenizer, one with another vocabulary, and the data."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("dpo")
    model = tiny_llama(root / "llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    teacher = LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    LlamaForCausalLM(teacher).save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    other = tiny_llama(root / "other", vocab_size=290)
    prefs, sft = root / "prefs.jsonl", root / "sft.jsonl"
    rows = preference_rows(24, seed=0)
    prefs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sft.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"]}) + "\n" for r in rows))
    return {"model": model, "teacher": root / "teacher", "other": other, "prefs": prefs, "sft": sft}


def _dpo_config(inputs: dict[str, Path], run_dir: Path, **dpo: object):
    from recipes import dpo as recipe

    return recipe.Config(
        run_dir=str(run_dir), log_every=1, model=HFModelConfig(path=str(inputs["model"])),
        data=dataclasses.replace(recipe.Config().data, path=str(inputs["prefs"]), val_fraction=0.25),
        train=TrainConfig(train_iters=2, global_batch_size=4, micro_batch_size=2, loss_weighting="mean"),
        optim=OptimizerConfig(lr=5e-3, weight_decay=0.0), dpo=DPOConfig(**dpo),
        evaluate=EvaluateConfig(at_end=True), checkpoint=CheckpointConfig(save_every=0, export=False),
    )  # fmt: skip


def metrics_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_dpo_run_logs_trl_metrics_counts_pairs_and_exports_the_policy(tmp_path, dpo_inputs):
    from recipes import dpo as recipe

    run_job(_dpo_config(dpo_inputs, tmp_path / "run"), recipe.spec)
    records = metrics_records(tmp_path / "run")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(set(TRL_NAMES) <= set(r) for r in train)
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as its reference
    assert train[-1]["consumed_samples"] == 2 * 4  # pairs, not the 2 rows each is laid out in
    val = records[-1]
    assert {"val_loss", "val_rewards/accuracies", "val_rewards/margins"} <= set(val) and "val_ppl" not in val
    assert (val["val_rewards/accuracies"] * 6) == pytest.approx(round(val["val_rewards/accuracies"] * 6))  # 6 pairs
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "run" / "hf_model").iterdir()}


def test_the_precomputed_reference_gives_the_copys_numbers_and_simpo_needs_none(tmp_path, dpo_inputs):
    from recipes import dpo as recipe

    for name, reference in (("copy", "copy"), ("pre", "precomputed")):
        run_job(_dpo_config(dpo_inputs, tmp_path / name, reference=reference), recipe.spec)
    copy, pre = metrics_records(tmp_path / "copy"), metrics_records(tmp_path / "pre")
    for row, other in zip(copy, pre, strict=True):
        assert row.keys() == other.keys()
        for name in ("loss", "grad_norm", "val_loss", *TRL_NAMES, *(f"val_{n}" for n in TRL_NAMES)):
            if name in row:
                assert other[name] == pytest.approx(row[name], rel=1e-5, abs=1e-7), name
    run_job(_dpo_config(dpo_inputs, tmp_path / "simpo", loss_type="simpo"), recipe.spec)
    assert metrics_records(tmp_path / "simpo")[0]["loss"] != pytest.approx(math.log(2), abs=1e-3)


def test_a_changed_beta_is_refused_on_a_rerun_unless_allowed(tmp_path, capsys, dpo_inputs):
    base = ["run", "dpo", "--run-dir", str(tmp_path / "run"), "--model.path", str(dpo_inputs["model"]), "--data.path",
            str(dpo_inputs["prefs"]), "--train.train-iters", "1", "--train.global-batch-size", "2",
            "--progress.no-enabled", "--evaluate.no-at-end"]  # fmt: skip
    dispatch(base)
    capsys.readouterr()
    before = file_hashes_and_siblings(tmp_path / "run")
    expect_one_line(capsys, [*base, "--dpo.beta", "0.2", "--train.train-iters", "2"], "dpo.beta")
    assert file_hashes_and_siblings(tmp_path / "run") == before
    dispatch([*base, "--dpo.beta", "0.2", "--train.train-iters", "2", "--checkpoint.allow-changes", "dpo.beta",
              "train.train_iters"])  # fmt: skip
    assert [r["step"] for r in metrics_records(tmp_path / "run") if "loss" in r][-1] == 2


def test_a_kd_run_logs_both_parts_of_its_loss(tmp_path, dpo_inputs):
    from recipes import kd as recipe

    config = recipe.Config(
        run_dir=str(tmp_path / "run"), log_every=1, model=HFModelConfig(path=str(dpo_inputs["model"])),
        data=dataclasses.replace(recipe.Config().data, path=str(dpo_inputs["sft"])),
        train=TrainConfig(train_iters=2, global_batch_size=4, micro_batch_size=2),
        kd=KDConfig(teacher_path=str(dpo_inputs["teacher"]), ratio=0.25), evaluate=EvaluateConfig(),
        checkpoint=CheckpointConfig(save_every=0, export=False),
    )  # fmt: skip
    run_job(config, recipe.spec)
    first = metrics_records(tmp_path / "run")[0]
    assert first["loss"] == pytest.approx(0.75 * first["kd/ce"] + 0.25 * first["kd/kl"], rel=1e-5)
    assert (tmp_path / "run" / "hf_model" / "model.safetensors").exists()


def test_plan_counts_the_frozen_model(capsys, dpo_inputs):
    dispatch(["plan", "kd", "--model.path", str(dpo_inputs["model"]), "--kd.teacher-path", str(dpo_inputs["teacher"]),
              "--data.path", str(dpo_inputs["sft"]), "--world-size", "2", "--parallel.strategy", "fsdp2"])  # fmt: skip
    out = capsys.readouterr().out
    assert "frozen model" in out and "(reference or teacher)" in out



def test_the_flops_count_the_forward_that_runs_beside_the_policys(dpo_inputs):
    """TFLOP/s and MFU count the reference's or teacher's forward: the model each objective runs forward
    only on every micro-batch (counted on meta by fntrain.run.build), none when nothing runs beside the policy."""
    import torch

    from recipes import dpo, kd

    def forward_only(recipe, config):
        with torch.device("meta"):
            model = recipe.spec.objective.forward_only(config)
        return None if model is None else model.config.num_hidden_layers

    config = _dpo_config(dpo_inputs, Path("unused"))
    assert forward_only(dpo, config) == 2  # the frozen copy of the starting model
    assert forward_only(dpo, dataclasses.replace(config, dpo=DPOConfig(reference="precomputed"))) is None
    assert forward_only(dpo, dataclasses.replace(config, dpo=DPOConfig(loss_type="simpo"))) is None
    with_lora = dataclasses.replace(config, dpo=DPOConfig(reference="adapter-off"),
                                    lora=dataclasses.replace(config.lora, rank=4))  # fmt: skip
    assert forward_only(dpo, with_lora) == 2  # the policy itself, adapters off
    kd_config = kd.Config(model=HFModelConfig(path=str(dpo_inputs["model"])), kd=KDConfig(teacher_path=str(dpo_inputs["teacher"])))
    assert forward_only(kd, kd_config) == 3  # the teacher

BAD = [
    ("dpo", ["--dpo.beta", "0"], "--dpo.beta must be > 0, got 0.0"),
    ("dpo", ["--dpo.reference", "adapter-off"], "--dpo.reference 'adapter-off' needs LoRA"),
    ("dpo", ["--dpo.reference-path", "{tmp}/nowhere"], "nowhere"),
    ("dpo", ["--dpo.reference-path", "{other}"], "--dpo.reference-path"),
    ("dpo", ["--data.path", "{same}"], "line 2"),
    ("dpo", ["--data.path", "{no_rejected}"], "--data.rejected-key"),
    ("dpo", ["--train.loss-weighting", "token"], "--train.loss-weighting must be 'mean'"),
    ("dpo", ["--parallel.pp-size", "2"], "--parallel.pp-size 2"),
    ("kd", ["--kd.teacher-path", "{other}"], "--kd.teacher-path"),
    ("kd", ["--kd.ratio", "1.5"], "--kd.ratio"),
]  # fmt: skip


@pytest.mark.parametrize(("recipe", "args", "needle"), BAD)
def test_a_bad_preference_or_distillation_input_is_one_line_and_creates_nothing(tmp_path, capsys, dpo_inputs, recipe,
                                                                                args, needle):  # fmt: skip
    rows = preference_rows(3, seed=0)
    same = tmp_path / "in" / "same.jsonl"
    same.parent.mkdir()
    same.write_text("".join(json.dumps(r) + "\n" for r in [rows[0], {**rows[1], "rejected": rows[1]["chosen"]}]))
    (tmp_path / "in" / "no_rejected.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    files = {"tmp": str(tmp_path), "other": str(dpo_inputs["other"]), "same": str(same),
             "no_rejected": str(tmp_path / "in" / "no_rejected.jsonl")}  # fmt: skip
    data = dpo_inputs["prefs"] if recipe == "dpo" else dpo_inputs["sft"]
    extra = ["--kd.teacher-path", str(dpo_inputs["teacher"])] if recipe == "kd" else []
    before = file_hashes_and_siblings(tmp_path)
    argv = ["run", recipe, "--run-dir", str(tmp_path / "run"), "--model.path", str(dpo_inputs["model"]), "--data.path",
            str(data), *extra, *[a.format(**files) for a in args]]  # fmt: skip
    expect_one_line(capsys, argv, needle)
    assert file_hashes_and_siblings(tmp_path) == before
