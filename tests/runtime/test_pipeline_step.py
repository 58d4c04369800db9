"""`make_pipeline_step` as a plain function call: a one-stage pipeline (a real torch schedule over a
1-rank gloo group) takes exactly the steps `make_train_step` takes (token-weighted loss over uneven
masks, clipping, the order of optimizer and schedulers), in both schedules; bad micro-batches are
refused with the step named. Several stages, tied weights and layouts are in tests/runtime/test_model_parallel.py
(torchrun, slow tier)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, make_train_step
from fntrain.step.pipeline import PipelineLayout, make_pipeline_step

SHAPE = ModelConfig(context=8, n_layer=2, n_head=2, d_model=16)


def pipeline_batches(steps: int = 3, micro: int = 3) -> list[list[dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(steps):
        step = []
        for index in range(micro):
            ids = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.context), generator=generator)
            labels = ids.clone()
            labels[:, : 2 * index + 1] = -100  # uneven valid tokens: token weighting matters
            step.append({"input_ids": ids, "labels": labels})
        batches.append(step)
    return batches


def _model_and_optimizer() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(SHAPE)
    return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("weighting", ["token", "mean"])
def test_one_stage_pipeline_steps_like_the_plain_step(one_rank_env, schedule, weighting):
    with setup_runtime(RuntimeConfig()) as runtime:
        layout = PipelineLayout(0, 1, dist.group.WORLD, schedule)
        model, optimizer = _model_and_optimizer()
        reference, reference_optimizer = _model_and_optimizer()
        pipeline = make_pipeline_step(model, causal_lm_loss, [optimizer], [], layout, settings=StepSettings(
            max_grad_norm=0.5, loss_weighting=weighting, device=runtime.device), micro_batches=3)  # fmt: skip
        plain = make_train_step(reference, causal_lm_loss, reference_optimizer, settings=StepSettings(max_grad_norm=0.5,
                                loss_weighting=weighting))  # fmt: skip
        for step, batch in enumerate(pipeline_batches()):
            state = TrainState(global_step=step)
            got, want = pipeline(state, batch), plain(state, batch)
            torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(got["grad_norm"], want["grad_norm"], rtol=1e-6, atol=1e-7)
            assert got["lr"] == want["lr"]
        for name, param in reference.named_parameters():
            torch.testing.assert_close(model.get_parameter(name), param, rtol=1e-6, atol=1e-7, msg=name)


def test_micro_batches_must_match_the_pipeline_and_each_other(one_rank_env):
    with setup_runtime(RuntimeConfig()) as runtime:
        model, optimizer = _model_and_optimizer()
        step = make_pipeline_step(model, causal_lm_loss, [optimizer], [], PipelineLayout(0, 1, dist.group.WORLD),
                                  settings=StepSettings(device=runtime.device), micro_batches=3)  # fmt: skip
        batch = pipeline_batches(steps=1)[0]
        with pytest.raises(ValueError, match="step 1: 2 micro-batches, the pipeline runs 3"):
            step(TrainState(), batch[:2])
        short = [*batch[:2], {key: value[:, :4] for key, value in batch[2].items()}]
        with pytest.raises(ValueError, match="pipeline parallelism needs micro-batches of one shape"):
            step(TrainState(), short)
        masked = [{**mb, "attention_mask": torch.ones(2, 1, SHAPE.context, SHAPE.context, dtype=torch.bool)}
                  for mb in batch]  # fmt: skip
        with pytest.raises(ValueError, match="without per-document attention masks"):
            step(TrainState(), masked)
