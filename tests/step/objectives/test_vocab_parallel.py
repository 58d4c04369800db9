"""The preference and distillation losses over vocabulary-parallel logits (tensor parallelism with
parallel.loss_parallel: a DTensor split over the vocabulary, the loss under torch's loss_parallel()):
the same numbers and gradients as over plain logits. Slow tier: a real 1-rank gloo group and mesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives import (
    DPOConfig,
    KDConfig,
    KDOutput,
    PreferenceOutput,
    make_dpo_loss,
    make_kd_loss,
)
from tests.runtime.conftest import one_rank_env  # noqa: F401 (the fixture: a 1-rank torchrun environment)

pytestmark = pytest.mark.slow

ROWS, SEQ, VOCAB = 4, 6, 10


@pytest.fixture
def mesh(one_rank_env):  # noqa: F811 (the imported fixture, requested by name)
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def split_over_vocab(tensor: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(tensor.detach(), mesh, [Shard(-1)]).requires_grad_(True)


def labels() -> torch.Tensor:
    out = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    out[:, :2] = IGNORE_INDEX
    return out


def test_dpo_loss_over_vocabulary_parallel_logits(mesh):
    from torch.distributed.tensor.parallel import loss_parallel

    full = torch.randn(ROWS, SEQ, VOCAB, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    reference = torch.randn(ROWS)
    batch = {"labels": labels()}
    loss_fn = make_dpo_loss(DPOConfig())
    plain, plain_metrics = loss_fn(PreferenceOutput(full, reference), batch)
    plain.backward()
    split = split_over_vocab(full, mesh)
    with loss_parallel():
        loss, metrics = loss_fn(PreferenceOutput(split, reference), batch)
        loss.backward()
    assert torch.allclose(loss, plain)
    assert all(torch.allclose(metrics[name], plain_metrics[name]) for name in plain_metrics)
    assert torch.allclose(split.grad.full_tensor(), full.grad, atol=1e-6)


def test_kd_loss_over_vocabulary_parallel_logits(mesh):
    from torch.distributed.tensor.parallel import loss_parallel

    generator = torch.Generator().manual_seed(3)
    student = torch.randn(ROWS, SEQ, VOCAB, generator=generator).requires_grad_(True)
    teacher = torch.randn(ROWS, SEQ, VOCAB, generator=generator)
    batch = {"labels": labels()}
    loss_fn = make_kd_loss(KDConfig(ratio=0.4, temperature=2.0, teacher_path="/t"))
    plain, plain_metrics = loss_fn(KDOutput(student, teacher), batch)
    plain.backward()
    split = split_over_vocab(student, mesh)
    with loss_parallel():
        loss, metrics = loss_fn(KDOutput(split, split_over_vocab(teacher, mesh).detach()), batch)
        loss.backward()
    assert torch.allclose(loss.full_tensor() if hasattr(loss, "full_tensor") else loss, plain)
    assert torch.allclose(split.grad.full_tensor(), student.grad, atol=1e-6)
