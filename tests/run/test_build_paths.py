"""`fntrain.run.build` and `fntrain.step.layouts` helpers one process can run: the pipeline ties of
tiny_gpt's split (found on a meta copy of the whole model), the FLOPs sample micro-batch from a sized or
a streaming dataset, no FLOPs count without a model factory, and the plain layout's evaluation loss run
under loss_parallel when the logits are split over the vocabulary."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from torch.utils.data import IterableDataset

from fntrain.run import build
from fntrain.run.checks import full_model_on_meta
from fntrain.runtime import Runtime
from fntrain.runtime.parallel import ParallelConfig
from fntrain.step import StepSettings, layouts
from fntrain.step.components import Components
from recipes import tiny_gpt


def _tie_inputs(config):
    """What the pipeline layout reads to find the ties: the parallel config, the split, the meta model."""
    return SimpleNamespace(parallel=config.parallel, pipeline=tiny_gpt.spec.pipeline,
                           model_on_meta=lambda: full_model_on_meta(config, tiny_gpt.spec))  # fmt: skip


def test_pipeline_ties_of_tiny_gpt_join_its_first_and_last_stage():
    config = tiny_gpt.Config()
    assert layouts._pipeline_ties(_tie_inputs(config)) == []
    two_stages = dataclasses.replace(config, parallel=ParallelConfig(pp_size=2))
    assert layouts._pipeline_ties(_tie_inputs(two_stages)) == [{0: "tok.weight", 1: "head.weight"}]


class TensorStream(IterableDataset):
    def __iter__(self):
        return iter([torch.full((2,), float(i)) for i in range(10)])


def built_with(dataset, collate=None):
    config = SimpleNamespace(train=SimpleNamespace(micro_batch_size=3))
    return SimpleNamespace(data=SimpleNamespace(dataset=dataset), config=config, collate_fn=collate)


def test_the_flops_sample_is_one_micro_batch_of_either_kind_of_dataset():
    streamed = build._sample_micro_batch(built_with(TensorStream()))
    assert torch.equal(streamed, torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]))
    sized = build._sample_micro_batch(built_with([torch.ones(2), torch.zeros(2)], collate=torch.stack))
    assert torch.equal(sized, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # fewer samples than a micro-batch
    assert build._flops_per_token(built_with([]), SimpleNamespace(model_factory=None)) is None


def test_eval_loss_runs_under_loss_parallel_when_logits_are_split():
    entered = []

    class Context:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    loss_fn = lambda output, batch: output.sum() + batch["shift"]  # noqa: E731
    model = torch.nn.Linear(2, 2)
    components = Components(model, loss_fn, (torch.optim.SGD(model.parameters(), lr=0.1),))
    inputs = layouts.StepInputs(components, StepSettings(loss_context=Context), "spec forward", None,
                                Runtime(tp_size=2), ParallelConfig(), micro_batches=1)  # fmt: skip
    laid_out = layouts.choose_layout(inputs.parallel).build(inputs)
    forward, eval_loss = laid_out.forward, laid_out.loss
    assert forward == "spec forward"
    assert eval_loss(torch.ones(3), {"shift": 1.0}) == 4.0 and entered == [True]


def _gpt_flops(forward_only):
    """tiny_gpt's FLOPs per token as the run counts them, with an objective whose forward-only model is
    `forward_only(config)` (None: no objective)."""
    model = dataclasses.replace(tiny_gpt.Config().model, context=16, n_layer=1, n_head=2, d_model=32)
    config = dataclasses.replace(tiny_gpt.Config(), model=model)
    ids = torch.arange(4 * 16).reshape(4, 16) % config.model.vocab_size
    built = SimpleNamespace(data=SimpleNamespace(dataset=[{"input_ids": row, "labels": row} for row in ids]),
                            config=dataclasses.replace(config, train=dataclasses.replace(config.train, micro_batch_size=2)),
                            collate_fn=None)  # fmt: skip
    objective = None if forward_only is None else SimpleNamespace(forward_only=forward_only)
    spec = SimpleNamespace(model_factory=tiny_gpt.spec.model_factory, loss=tiny_gpt.spec.loss, forward=None,
                           objective=objective)  # fmt: skip
    return build._flops_per_token(built, spec)()


def test_an_objectives_forward_only_model_adds_its_forward_flops_and_none_adds_nothing():
    policy = _gpt_flops(None)
    assert _gpt_flops(lambda config: None) == policy  # e.g. a precomputed reference: no forward beside the policy's
    with_copy = _gpt_flops(tiny_gpt.spec.model_factory)  # a frozen copy of the policy, forward only
    # A forward is a third of forward + backward for the matmuls that dominate (backward: two matmuls each).
    assert policy * 1.3 < with_copy < policy * 1.36
    built_where = []

    def on_meta(config):
        model = tiny_gpt.spec.model_factory(config)
        built_where.append(next(model.parameters()).device.type)
        return model

    _gpt_flops(on_meta)
    assert built_where == ["meta"]  # a teacher's weights are never allocated to count its FLOPs
