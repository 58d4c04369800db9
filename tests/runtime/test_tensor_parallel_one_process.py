"""`fntrain.runtime.tensor_parallel` in one process: a plan applied over a 1-rank gloo group's DeviceMesh
gives every parameter the DTensor placement its style names (colwise/rowwise/embedding/output, the rest
replicated), keeps tied weights tied, and leaves the forward, the loss (vocabulary-parallel or gathered)
and every gradient equal to the untouched model's; tied weights split differently are refused. Several
tp ranks are in tests/runtime/test_model_parallel.py (torchrun, slow tier)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fntrain.runtime.tensor_parallel import is_dtensor, parallel_style, tensor_parallel_plan
from tests.runtime.conftest import one_rank_mesh

PLAN = {"tok": "embedding", "up": "colwise", "down": "rowwise", "head": "output", "blocks.*.attn": "colwise"}


class TiedLM(nn.Module):
    """Embedding -> MLP residual -> LayerNorm -> output head sharing the embedding's weight."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.tok(ids)
        hidden = hidden + self.down(torch.relu(self.up(hidden)))
        return self.head(self.norm(hidden))


@pytest.fixture
def tp_mesh(tmp_path):
    """A 1-rank gloo group and its one-dimensional "tp" DeviceMesh."""
    with one_rank_mesh(tmp_path, "tp") as mesh:
        yield mesh


def _models() -> tuple[TiedLM, TiedLM]:
    torch.manual_seed(0)
    model = TiedLM()
    return model, copy.deepcopy(model)


def _placement_names(model: nn.Module) -> dict[str, str]:
    return {name: str(param.placements[0]) for name, param in model.named_parameters()}


def test_styles_place_each_parameter_and_keep_ties(tp_mesh):
    from torch.distributed.tensor.parallel import loss_parallel

    model, reference = _models()
    tensor_parallel_plan(PLAN)(model, tp_mesh, True)  # "blocks.*.attn" names nothing here: skipped
    assert all(is_dtensor(p) for p in model.parameters()) and not is_dtensor(torch.ones(1))
    assert _placement_names(model) == {
        "tok.weight": "S(0)",  # vocabulary rows (the head is tied to it)
        "up.weight": "S(0)", "up.bias": "S(0)",  # output features
        "down.weight": "S(1)", "down.bias": "R",  # input features; the bias is added once
        "norm.weight": "R", "norm.bias": "R",  # left to replicate_remaining
    }  # fmt: skip
    assert model.head.weight is model.tok.weight
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    assert is_dtensor(logits) and str(logits.placements[0]) == "S(2)"  # vocabulary-parallel logits
    with loss_parallel():
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
    want = nn.functional.cross_entropy(reference(ids).flatten(0, 1), ids.flatten())
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad.full_tensor(), param.grad, msg=name)


def test_gathered_output_returns_plain_full_logits(tp_mesh):
    model, reference = _models()
    tensor_parallel_plan(PLAN)(model, tp_mesh, False)
    ids = torch.arange(10).reshape(2, 5)
    logits = model(ids)
    assert not is_dtensor(logits) and logits.shape == (2, 5, 11)
    torch.testing.assert_close(logits, reference(ids))


def test_norm_only_module_takes_and_returns_plain_tensors(tp_mesh):
    from fntrain.runtime.tensor_parallel import replicate_remaining

    torch.manual_seed(0)
    norm = nn.LayerNorm(4)
    reference = copy.deepcopy(norm)
    replicate_remaining(norm, tp_mesh)
    assert str(norm.weight.placements[0]) == "R" and norm.weight.requires_grad
    x = torch.randn(3, 4)
    out = norm(x)
    assert not is_dtensor(out)
    torch.testing.assert_close(out, reference(x))


def test_tied_weights_split_differently_are_refused(tp_mesh):
    model, _ = _models()
    with pytest.raises(ValueError, match=r"tied weights tok.weight and head.weight are split differently"):
        tensor_parallel_plan({"tok": "embedding", "head": "rowwise"})(model, tp_mesh, False)


def test_styles_map_to_torch_parallel_styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert type(parallel_style("colwise", False)) is ColwiseParallel
    assert type(parallel_style("rowwise", True)) is RowwiseParallel
    embedding = parallel_style("embedding", False)
    assert type(embedding) is RowwiseParallel and embedding.input_layouts == (Replicate(),)
    sharded, gathered = parallel_style("output", True), parallel_style("output", False)
    assert sharded.output_layouts == (Shard(-1),) and not sharded.use_local_output
    assert gathered.output_layouts == (Replicate(),) and gathered.use_local_output
    with pytest.raises(ValueError, match=r"tensor-parallel style must be one of .*got 'diagonal'"):
        parallel_style("diagonal", False)
