"""DPO in fntrain gives TRL's numbers: per-step loss, rewards, log-probs and grad norm equal to TRL 1.16's
`DPOTrainer` on the same tiny Llama, data and order (slow: trains with both; needs the `trl` test extra).

TRL is set up to compute what the fntrain run computes: fp32 (bf16=False), data in file order
(train_sampling_strategy "sequential" against --loader.no-shuffle), a constant learning rate, AdamW
with the same betas, no weight decay, an explicit frozen reference (TRL's default reloads one from the
hub name) or, with a LoRA adapter, the adapter switched off.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.models.hf_config import HFModelConfig
from fntrain.models.lora import LoraConfig
from fntrain.run.config import CheckpointConfig, TrainConfig
from fntrain.run.job import run_job
from fntrain.step.objectives import DPOConfig
from fntrain.step.optim import OptimizerConfig, ScheduleConfig
from tests.step.objectives.dpo_helpers import preference_rows, tiny_llama

pytestmark = pytest.mark.slow

STEPS, MICRO, ACCUM, LR = 3, 2, 2, 5e-3
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected")  # fmt: skip


def _trl_history(model_dir: Path, data: Path, out: Path, *, loss_type: str, lora: bool) -> list[dict]:
    """TRL's per-step log over the same steps (logging_steps 1)."""
    trl = pytest.importorskip("trl")
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reference, peft_config = AutoModelForCausalLM.from_pretrained(model_dir), None
    if lora:
        from peft import LoraConfig as PeftLora

        reference = None
        peft_config = PeftLora(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                               task_type="CAUSAL_LM")  # fmt: skip
    args = trl.DPOConfig(
        output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to=[], bf16=False, use_cpu=True, train_sampling_strategy="sequential", beta=0.1,
        loss_type=[loss_type], seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    dataset = load_dataset("json", data_files=str(data), split="train")
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=dataset,
                             processing_class=tokenizer, peft_config=peft_config)  # fmt: skip
    trainer.train()
    return [row for row in trainer.state.log_history if "loss" in row]


def _fntrain_history(model_dir: Path, data: Path, run_dir: Path, *, loss_type: str, lora: bool) -> list[dict]:
    from recipes import dpo

    config = dpo.Config(
        run_dir=str(run_dir), seed=0, log_every=1,
        model=HFModelConfig(path=str(model_dir)),
        data=dataclasses.replace(dpo.Config().data, path=str(data)),
        train=TrainConfig(train_iters=STEPS, global_batch_size=MICRO * ACCUM, micro_batch_size=MICRO,
                          loss_weighting="mean", max_grad_norm=1.0),  # fmt: skip
        optim=OptimizerConfig(lr=LR, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8),
        schedule=ScheduleConfig(kind="constant", warmup_iters=0),
        dpo=DPOConfig(beta=0.1, loss_type=loss_type, reference="adapter-off" if lora else "copy"),
        lora=LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj")) if lora else LoraConfig(),
        evaluate=EvaluateConfig(with_validation=False),
        checkpoint=CheckpointConfig(save_every=0, save_every_minutes=0.0, export=False),
    )  # fmt: skip
    config = dataclasses.replace(config, loader=dataclasses.replace(config.loader, shuffle=False))
    run_job(config, dpo.spec)
    return [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in row]


@pytest.mark.parametrize(("loss_type", "lora"), [("sigmoid", False), ("ipo", False), ("sigmoid", True)])
def test_dpo_matches_trl(tmp_path: Path, loss_type: str, lora: bool) -> None:
    model_dir = tiny_llama(tmp_path / "llama")
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in preference_rows(STEPS * MICRO * ACCUM, seed=1)))
    theirs = _trl_history(model_dir, data, tmp_path / "trl", loss_type=loss_type, lora=lora)
    ours = _fntrain_history(model_dir, data, tmp_path / "run", loss_type=loss_type, lora=lora)
    assert len(theirs) == len(ours) == STEPS
    for step, (trl_row, row) in enumerate(zip(theirs, ours, strict=True), start=1):
        for name in COMPARED:
            assert row[name] == pytest.approx(trl_row[name], rel=1e-4, abs=1e-6), (step, name, row, trl_row)
