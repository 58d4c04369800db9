"""Worker for the 2-rank tests of meta-device init and HSDP, launched under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.runtime.scale_worker CASE OUT.pt

CASE meta: a tiny GPT built eagerly then sharded with FSDP2, and the same built on the meta device,
sharded and seeded-initialized; saves both full state dicts, the RNG states after each build and the
local parameter counts. CASE hsdp: the same global batches trained with DDP (eager build) and with
HSDP (fsdp2, replicate 2 x shard 1, meta-device build); saves losses and final weights of each, and
the HSDP run's checkpoint restored into a fresh DDP model.
One process group serves every setup_runtime in the launch (each reuses it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fntrain.checkpoint import SaveTarget, restore, save
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.runtime.groups import data_parallel_group
from fntrain.runtime.materialize import build_model, local_numel, seeded_init
from fntrain.runtime.parallel import ParallelConfig, parallelize
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, make_train_step
from fntrain.step.components import Components
from fntrain.step.optim import OptimizerConfig, build_optimizer
from tests.helpers.workers import gathered

MODEL = ModelConfig(context=16, n_layer=2, n_head=2, d_model=32, dropout=0.0)
SEED = 11
STEPS = 4
GLOBAL = 8
MICRO = 2


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)  # DDP wraps
    return {name: gathered(value) for name, value in inner.state_dict().items()}


def scale_rank_batches(dp_rank: int, dp_size: int) -> list[list[dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(5)
    per_rank = GLOBAL // dp_size
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(0, MODEL.vocab_size, (GLOBAL, MODEL.context), generator=generator)
        mine = ids[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        steps.append(
            [
                {"input_ids": mine[i : i + MICRO], "labels": mine[i : i + MICRO]}
                for i in range(0, per_rank, MICRO)
            ]
        )
    return steps


def train_steps(model: torch.nn.Module, runtime, keep: dict | None = None) -> list[float]:
    optimizer = build_optimizer(OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1), model).optimizer
    step = make_train_step(
        model, causal_lm_loss, (optimizer,), (), settings=StepSettings(max_grad_norm=1.0, device=runtime.device,
        dp_size=runtime.dp_size, dp_group=data_parallel_group(runtime)),
    )  # fmt: skip
    state, losses = TrainState(), []
    for batch in scale_rank_batches(runtime.dp_rank, runtime.dp_size):
        metrics = step(state, batch)
        state = state.after_step()
        losses.append(float(metrics["loss"]))
    if keep is not None:
        keep["optimizer"] = optimizer
    return losses


def meta_case() -> dict:
    fsdp = ParallelConfig(strategy="fsdp2")
    with setup_runtime(RuntimeConfig(), fsdp, seed=SEED) as runtime:
        torch.manual_seed(SEED)
        eager = parallelize(TinyGPT(MODEL), runtime, fsdp)
        eager_rng = torch.get_rng_state()
        meta = build_model(
            lambda: TinyGPT(MODEL), runtime, fsdp, fill=seeded_init(SEED, post_init=TinyGPT._init)
        )
        meta_rng = torch.get_rng_state()
        ids = torch.arange(2 * MODEL.context).remainder(MODEL.vocab_size).view(2, -1)
        return {
            "eager": _weights(eager),
            "meta": _weights(meta),
            "rng_equal": torch.equal(eager_rng, meta_rng),
            "tied": meta.head.weight is meta.tok.weight,
            "local_numel": local_numel(meta),
            "global_numel": sum(p.numel() for p in meta.parameters()),
            "logits_equal": torch.equal(gathered(eager(ids)), gathered(meta(ids))),
        }


def hsdp_case(out: str) -> dict:
    results = {}
    ddp = ParallelConfig(strategy="ddp")
    with setup_runtime(RuntimeConfig(), ddp, seed=SEED) as runtime:
        torch.manual_seed(SEED)
        model = parallelize(TinyGPT(MODEL), runtime, ddp)
        results["ddp"] = {"losses": train_steps(model, runtime), "weights": _weights(model)}
    hsdp = ParallelConfig(strategy="fsdp2", replicate=2, meta_init=True)
    with setup_runtime(RuntimeConfig(), hsdp, seed=SEED) as runtime:
        model = build_model(
            lambda: TinyGPT(MODEL), runtime, hsdp, fill=seeded_init(SEED, post_init=TinyGPT._init)
        )
        placements = {str(p.placements) for p in model.parameters()}
        kept: dict = {}
        results["hsdp"] = {
            "losses": train_steps(model, runtime, kept),
            "weights": _weights(model),
            "mesh": (runtime.mesh.mesh_dim_names, tuple(runtime.mesh.shape)),
            "placements": sorted(placements),
            "dp": (runtime.dp_rank, runtime.dp_size),
        }
        # An HSDP checkpoint (DTensors replicated x sharded) loads into another layout: DDP here.
        root = Path(out).parent / "hsdp_checkpoints"
        save(
            SaveTarget(root, Components(model, causal_lm_loss, (kept["optimizer"],))),
            TrainState(global_step=STEPS),
        )
    with setup_runtime(RuntimeConfig(), ddp, seed=SEED) as runtime:
        torch.manual_seed(SEED + 1)
        fresh = parallelize(TinyGPT(MODEL), runtime, ddp)
        restore("latest", Components(fresh, causal_lm_loss, ()), root=root, weights_only=True)
        results["restored_into_ddp"] = _weights(fresh)
    return results


def launch_scale_case(case: str, out: Path, timeout: float = 110) -> None:
    """Run CASE on 2 ranks under torchrun (from a test process); fail with the workers' output."""
    root = Path(__file__).resolve().parents[2]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(PYTHONPATH=str(root) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "tests.runtime.scale_worker", case, str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def main(case: str, out: str) -> None:
    dist.init_process_group("gloo")
    try:
        result = meta_case() if case == "meta" else hsdp_case(out)
        result["rank"], result["world_size"] = dist.get_rank(), dist.get_world_size()
        if dist.get_rank() == 0:
            torch.save(result, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(*sys.argv[1:3]))
