"""The start-of-run lines: parameter counts, world and device, the resolved plan."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fntrain.run.report import count_parameters, describe_start, human_count
from fntrain.runtime.parallel import ParallelConfig
from fntrain.runtime.runtime import Runtime
from fntrain.state import make_run_plan


def test_describe_start_counts_parameters_and_states_world_and_plan():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    plan = make_run_plan(
        dataset_len=1000, global_batch_size=32, micro_batch_size=8, dp_size=2, train_iters=70
    )
    built = SimpleNamespace(
        config=SimpleNamespace(parallel=ParallelConfig(strategy="ddp")),
        runtime=Runtime(world_size=2, dp_size=2),
        plan=plan,
        components=SimpleNamespace(model=model),
    )
    assert describe_start(built) == [
        "model: 23 parameters (23), 11 trainable",
        "world: 2 processes, device cpu, parallel ddp",
        f"plan: 70 steps over {plan.epochs} epochs of up to {plan.steps_per_epoch} steps; "
        "global batch 32 = micro 8 x accum 2 x dp 2",
    ]
    built.config.parallel = ParallelConfig(strategy="fsdp2", tp_size=2, pp_size=2, pp_schedule="gpipe")
    built.runtime = Runtime(world_size=8, dp_size=2, tp_size=2, pp_size=2, pp_rank=1)
    lines = describe_start(built)
    assert lines[0] == "model: 23 parameters (23) in pipeline stage 1 of 2, 11 trainable"
    assert lines[1] == "world: 8 processes, device cpu, parallel fsdp2, tp 2, pp 2 (gpipe)"


def test_tied_parameters_count_once_and_human_counts():
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    assert count_parameters(torch.nn.ModuleList([embedding, head])) == (40, 40)
    assert [human_count(n) for n in (999, 1234, 1234567, 7_000_000_000)] == ["999", "1.23K", "1.23M", "7B"]
