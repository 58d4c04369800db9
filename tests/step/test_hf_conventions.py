"""Metrics and schedule conventions users compare with (issue 27, item 5): the logged lr is the rate the
step used; with log_every > 1 the logged loss is the token-weighted mean since the last log; HF-style
warmup (`schedule.warmup_style hf`) and HF's weight-decay grouping (`optim.decay_grouping hf`).

Fast tier: plain torch models. Slow tier: per-step lr and loss held against a hand-written torch loop
using transformers' scheduler and Trainer's decay grouping on a tiny Llama.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from fntrain.hooks.metrics import MetricsConfig, metrics_hook
from fntrain.hooks.metrics_log import metrics_log
from fntrain.loop import train
from fntrain.runtime.runtime import Runtime
from fntrain.state import RunPlan, TrainState
from fntrain.step import StepSettings, causal_lm_loss, make_train_step
from fntrain.step.optim import (
    OptimizerConfig,
    ScheduleConfig,
    _no_decay_names,
    build_lr_schedule,
    build_optimizer,
    lr_factor,
)
from tests.helpers import preloaded_launch


class NormedLM(nn.Module):
    """Every kind of parameter the two groupings disagree on: embedding, biases, LayerNorm, RMS norms."""

    def __init__(self, vocab: int = 13, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.ln_f = nn.LayerNorm(width)
        self.final_norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, **_) -> torch.Tensor:
        return self.head(self.final_norm(self.ln_f(torch.tanh(self.proj(self.embed(input_ids))))))


def uneven_batches(steps: int, vocab: int = 13, seq: int = 7, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """One micro-batch of 2 rows per step, each step keeping a very different number of loss tokens."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (2, seq), generator=generator)
        labels = ids.clone()
        keep = 1 + (step * 5) % (2 * (seq - 1))  # 1, 6, 11, 4, 9, ... of the 12 targets
        flat = labels[:, 1:].reshape(-1)
        flat[keep:] = -100
        labels[:, 1:] = flat.reshape(2, seq - 1)
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def run_fntrain(model, batches, *, log_every, optim, schedule, tmp_path, max_grad_norm=0.0):
    """fntrain's own loop over `batches` (one per step); the metrics records it wrote."""
    plan = RunPlan(len(batches), len(batches), 1)
    optimizer = build_optimizer(optim, model).optimizer
    scheduler = build_lr_schedule(schedule, plan, optimizer).scheduler
    step_fn = make_train_step(model, causal_lm_loss, optimizer, scheduler, settings=StepSettings(max_grad_norm=max_grad_norm))
    runtime = Runtime()
    writer = metrics_log(MetricsConfig(), runtime, tmp_path)
    hook = metrics_hook(runtime, log_every=log_every, writer=writer, last_step=plan.train_iters)
    train(TrainState(), step_fn, [hook], data=lambda epoch, cursor: iter(batches[cursor:]), plan=plan)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- fast tier


def test_hf_warmup_starts_at_zero_and_fntrain_warmup_at_one_over_w():
    common = dict(kind="linear", warmup_iters=4, horizon=10, min_lr_ratio=0.0)
    assert [lr_factor(s, **common, warmup_style="hf") for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [lr_factor(s, **common) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    after = [lr_factor(s, **common, warmup_style=style) for style in ("hf", "fntrain") for s in range(4, 10)]
    assert after[:6] == after[6:]  # the styles differ in the warmup only


def test_logged_lr_is_the_rate_the_step_used(tmp_path):
    torch.manual_seed(0)
    records = run_fntrain(
        NormedLM(), uneven_batches(6), log_every=1, tmp_path=tmp_path,
        optim=OptimizerConfig(lr=0.1), schedule=ScheduleConfig(kind="linear", warmup_iters=3, warmup_style="hf",
                                                               min_lr_ratio=0.0),
    )  # fmt: skip
    # hf warmup over 3 steps, then linear to 0 at step 6: step k uses lr * factor(k - 1)
    assert [r["lr"] for r in records] == pytest.approx([0.0, 0.1 / 3, 0.2 / 3, 0.1, 0.1 * 2 / 3, 0.1 / 3])


def test_log_every_4_logs_the_token_weighted_mean_of_the_real_steps_on_uneven_counts(tmp_path):
    batches = uneven_batches(8)
    counts = [loss_tokens(b) for b in batches]
    assert len(set(counts)) >= 4  # uneven
    settings = dict(
        optim=OptimizerConfig(lr=0.05), schedule=ScheduleConfig(kind="constant"), max_grad_norm=1.0
    )
    torch.manual_seed(0)
    model = NormedLM()
    per_step = run_fntrain(copy.deepcopy(model), batches, log_every=1, tmp_path=tmp_path / "one", **settings)
    windowed = run_fntrain(copy.deepcopy(model), batches, log_every=4, tmp_path=tmp_path / "four", **settings)
    assert [r["step"] for r in windowed] == [4, 8]
    for record, steps in zip(windowed, (range(0, 4), range(4, 8)), strict=True):
        losses = [per_step[k]["loss"] for k in steps]
        weights = [counts[k] for k in steps]
        want = sum(loss * n for loss, n in zip(losses, weights, strict=True)) / sum(weights)
        assert record["loss"] == pytest.approx(want, rel=1e-6)
        assert record["loss"] != pytest.approx(sum(losses) / 4, rel=1e-3)  # not the plain mean
        assert record["grad_norm"] == pytest.approx(
            sum(per_step[k]["grad_norm"] for k in steps) / 4, rel=1e-6
        )
        assert record["loss_last"] == pytest.approx(per_step[steps[-1]]["loss"], rel=1e-6)
        assert record["lr"] == per_step[steps[-1]]["lr"]


def test_hf_decay_grouping_skips_biases_and_norms_and_decays_embeddings():
    model = NormedLM()
    assert _no_decay_names(model, "hf") == {"proj.bias", "ln_f.weight", "ln_f.bias", "final_norm.weight"}
    assert _no_decay_names(model) == {
        "embed.weight",
        "proj.bias",
        "ln_f.weight",
        "ln_f.bias",
        "final_norm.weight",
    }
    built = build_optimizer(OptimizerConfig(decay_grouping="hf"), model)
    decayed = {id(p) for p in built.optimizer.param_groups[0]["params"]}
    assert id(model.embed.weight) in decayed and id(model.ln_f.weight) not in decayed
    assert (
        built.optimizer.param_groups[0]["weight_decay"] == 0.1
        and built.optimizer.param_groups[1]["weight_decay"] == 0
    )


@pytest.mark.parametrize(
    "config, message",
    [
        (OptimizerConfig(decay_grouping="torch"), "optim.decay_grouping must be one of"),
        (
            OptimizerConfig(decay_all=True, decay_grouping="hf"),
            "decay_grouping must stay 'fntrain', got 'hf'",
        ),
        (ScheduleConfig(warmup_style="late"), "schedule.warmup_style must be one of"),
    ],
)
def test_bad_conventions_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()


# ----------------------------------------------------------------------------- slow: against transformers


def llama_with_biases():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, attention_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def hf_decay_names(model) -> set[str]:
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))  # it uses no Trainer state


@pytest.mark.slow
def test_hf_grouping_equals_trainers_on_a_llama():
    model = llama_with_biases()
    names = {name for name, _ in model.named_parameters()}
    assert _no_decay_names(model, "hf") == names - hf_decay_names(model)
    assert any("bias" in n for n in names - hf_decay_names(model))  # the model has biases and norms
    assert "model.embed_tokens.weight" in hf_decay_names(model)


@pytest.mark.slow
def test_per_step_lr_and_loss_equal_a_torch_loop_with_transformers_schedule_and_grouping(tmp_path):
    from transformers import get_cosine_schedule_with_warmup

    steps, warmup, lr, decay = 8, 3, 1e-2, 0.1
    batches = uneven_batches(steps)
    model = llama_with_biases()
    reference = copy.deepcopy(model)
    records = run_fntrain(
        model, batches, log_every=1, tmp_path=tmp_path, max_grad_norm=1.0,
        optim=OptimizerConfig(lr=lr, weight_decay=decay, betas=(0.9, 0.999), decay_grouping="hf"),
        schedule=ScheduleConfig(kind="cosine", warmup_iters=warmup, warmup_style="hf", min_lr_ratio=0.0),
    )  # fmt: skip

    # The hand-written loop: Trainer's groups, transformers' schedule, HF's own loss from labels.
    decayed = hf_decay_names(reference)
    named = list(reference.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decayed], "weight_decay": decay},
        {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, steps)
    want_lr, want_loss = [], []
    for batch in batches:
        want_lr.append(scheduler.get_last_lr()[0])  # the rate this step uses
        loss = reference(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        want_loss.append(loss.item())
    assert want_lr[0] == 0.0
    assert [r["lr"] for r in records] == pytest.approx(want_lr, rel=1e-12, abs=0)
    assert [r["loss"] for r in records] == pytest.approx(want_loss, rel=1e-6)


# ----------------------------------------------------------------------------- slow: the window over ranks

WINDOW_RUN = [
    "--runtime.device", "cpu", "--train.train-iters", "8", "--log-every", "4", "--train.global-batch-size", "8",
    "--train.micro-batch-size", "2", "--model.n-layer", "2", "--model.d-model", "32", "--model.n-head", "4",
    "--model.context", "32", "--evaluate.eval-every", "0", "--evaluate.no-at-end", "--seed", "3",
]  # fmt: skip


def _window_run(python, run_dir, ranks: int, *args: str) -> tuple[list[dict], str]:
    """The run's logged windows and its output."""
    flags = [*WINDOW_RUN, "--run-dir", str(run_dir), *args]
    output = preloaded_launch.run(python, ranks, "recipes.tiny_gpt", *flags)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [{key: row[key] for key in ("step", "loss", "loss_last", "grad_norm", "lr")} for row in rows]
    return windows, output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_window_means_over_data_parallel_and_pipeline_ranks_equal_one_rank(python, tmp_path):
    """loss_tokens is the count over all data-parallel ranks, so the per-rank window means average to the
    global token-weighted mean: 2-rank DDP and a 2-stage pipeline log what one rank logs. The DDP run is
    also tests/runtime/test_distributed.py's "the recipe runs under torchrun" for ddp: its runtime line and its
    saved config (one launch for both claims)."""
    one, _ = _window_run(python, tmp_path / "one", 1)
    assert [row["step"] for row in one] == [4, 8] and one[0]["loss"] != one[0]["loss_last"]
    for name, args in (("ddp", ["--parallel.strategy", "ddp"]), ("pp", ["--parallel.pp-size", "2"])):
        rows, output = _window_run(python, tmp_path / name, 2, *args)
        for got, want in zip(rows, one, strict=True):
            assert got == pytest.approx(want, rel=1e-5), name
        if name == "ddp":
            assert "runtime: world 2, device cpu, backend gloo, dp 2" in output
            saved = json.loads((tmp_path / name / "config.json").read_text())
            assert saved["parallel"]["strategy"] == "ddp"
            assert saved["runtime"]["device"] == "cpu"
