"""Context-parallel step cost: the Ulysses cp 2 step against cp 1, and what its all-to-alls cost, in 2
processes (torchrun, gloo, CPU, one torch thread each).

`python -m bench.cp_overhead [--quick] [--json FILE]` launches itself under
`python -m torch.distributed.run --standalone --nproc_per_node=2`; each rank builds the tiny GPT (d_model
128, 4 blocks, 4 heads, context 256; recipes/tiny_gpt.py) three times and, in the same processes,
alternates per round between three variants of K AdamW steps on the same fixed micro-batch (4 sequences
of 256 tokens, packed into two documents each: the 4-D document mask of fntrain.data.packing):

- `cp1`: the plain step (`make_train_step`, no collective): one process computing every token, what
  `--parallel.cp-size 1` runs (both ranks run it side by side, each on its own core);
- `cp2`: `--parallel.cp-size 2` as fntrain.run.build wires it: each rank computes 128 of the 256 tokens,
  two all-to-alls around every attention (4 per block forward, 4 in backward), DDP over the cp group;
- `cp2_local`: the same step with the all-to-all replaced by a local copy of the same shape (wrong
  numbers, the same compute and layout work): `cp2` minus this is the all-to-alls' cost.

Each round ends with a barrier (inside its timing, paid alike by all); rank 0 keeps, per round, the slower
rank's time. The figures are ratios of variants measured in the same rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import fntrain  # noqa: F401  (before torch: sets OMP_WAIT_POLICY=PASSIVE like the recipe's workers)
from bench.harness import Row, Timing, bench_main, paired_ratio_row, quiet
from bench.pipeline_overhead import rounds_on_every_rank, worker_env

RANKS = 2
CONTEXT = 256
MICRO_BATCH_SIZE = 4
VARIANTS = ("cp1", "cp2", "cp2_local")
FULL = {"steps": 2, "min_rounds": 12, "max_rounds": 60, "budget_s": 60.0}
QUICK = {"steps": 1, "min_rounds": 2, "max_rounds": 2, "budget_s": 0.0}
CHUNK = 3


def run(quick: bool = False) -> list[Row]:
    """Launch the 2-rank measurement under torchrun and turn rank 0's rounds into the table's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timing.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
                   "-m", "bench.cp_overhead", "--worker", str(out), *(["--quick"] if quick else [])]  # fmt: skip
        subprocess.run(command, cwd=Path(__file__).resolve().parent.parent, env=worker_env(os.environ),
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        record = json.loads(out.read_text())
    return rows(Timing(record["samples"], record["samples"]), record["steps"])


def rows(timing: Timing, steps: int) -> list[Row]:
    size = f"tiny GPT 4x128, {MICRO_BATCH_SIZE}x{CONTEXT} tokens, packed documents, gloo on CPU"
    return [
        paired_ratio_row(
            f"cp 2 step vs cp 1 ({size})", timing, "cp2", "cp1", goal_ratio=None, unit="ms",
            note="each cp rank computes half the tokens; the all-to-alls and DDP's all-reduce over the cp "
            f"group are what it pays for that; {steps} steps per variant per round, slower rank's wall time.",
        ),
        paired_ratio_row(
            f"cp 2 step vs the same step with the all-to-alls replaced by local copies ({size})", timing,
            "cp2", "cp2_local", goal_ratio=None, unit="ms",
            note="the 16 all-to-alls per step (2 per attention, forward and backward, 4 blocks) on gloo.",
        ),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- the workers (under torchrun)


def _pin_to_own_core(local_rank: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) >= RANKS:
            os.sched_setaffinity(0, {allowed[local_rank % len(allowed)]})


def _batch() -> list[dict]:
    import torch

    from fntrain.data.packing import document_causal_mask, pack_sequence

    generator = torch.Generator().manual_seed(1)
    samples = [pack_sequence(torch.randint(0, 256, (CONTEXT,), generator=generator),
                             document_ids=(torch.arange(CONTEXT) >= 100 + 20 * i).long())
               for i in range(MICRO_BATCH_SIZE)]  # fmt: skip
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    batch["attention_mask"] = document_causal_mask(batch["document_ids"])
    return [batch]


def _step(runtime, cp: bool) -> Callable[[], None]:
    import torch

    from fntrain.models.gpt import ModelConfig, TinyGPT
    from fntrain.runtime.groups import context_parallel_mesh, data_parallel_group
    from fntrain.runtime.parallel import ParallelConfig, parallelize
    from fntrain.state import TrainState
    from fntrain.step import StepSettings, causal_lm_loss, default_forward, make_train_step
    from fntrain.step.context_parallel import context_parallel_parts

    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=CONTEXT, n_layer=4, n_head=4, d_model=128))
    forward, loss, extra = default_forward, causal_lm_loss, {}
    if cp:
        model = parallelize(model, runtime, ParallelConfig(strategy="ddp", cp_size=RANKS))
        parts = context_parallel_parts(default_forward, causal_lm_loss, mesh=context_parallel_mesh(runtime))
        forward, loss = parts.forward, parts.train_loss
        extra = {"loss_context": parts.context, "dp_size": RANKS, "dp_group": data_parallel_group(runtime)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_train_step(model, loss, optimizer, settings=StepSettings(max_grad_norm=1.0, **extra), forward=forward)
    batch, state = _batch(), TrainState()
    return lambda: step_fn(state, batch)


def _worker(out: str, quick: bool) -> None:
    _pin_to_own_core(int(os.environ["LOCAL_RANK"]))
    import torch
    import torch.distributed as dist

    import fntrain.step.context_parallel as cp_module
    from fntrain.runtime.parallel import ParallelConfig
    from fntrain.runtime.setup import RuntimeConfig, setup_runtime

    torch.set_num_threads(1)
    quiet()
    settings = QUICK if quick else FULL
    steps = settings["steps"]
    with setup_runtime(RuntimeConfig(device="cpu", cpu_threads=1), ParallelConfig(strategy="ddp", cp_size=RANKS)) as runtime:
        steppers = {"cp1": _step(runtime, cp=False), "cp2": _step(runtime, cp=True)}
        real_exchange = cp_module._all_to_all

        def local_copy(send, group):
            return send.clone()  # the received buffer an all-to-all would allocate, without the exchange

        def variant(name: str) -> Callable[[], int]:
            step = steppers["cp2" if name == "cp2_local" else name]

            def round_() -> int:
                cp_module._all_to_all = local_copy if name == "cp2_local" else real_exchange
                try:
                    for _ in range(steps):
                        step()
                finally:
                    cp_module._all_to_all = real_exchange
                dist.barrier()
                return steps

            return round_

        variants = {name: variant(name) for name in VARIANTS}
        for name in VARIANTS:  # warm-up
            variants[name]()
        combined = rounds_on_every_rank(variants, settings, ("cp2", "cp2_local"), chunk=CHUNK)
        if runtime.is_main:
            Path(out).write_text(json.dumps({"samples": combined, "steps": steps}))


def main() -> None:
    bench_main(run, "Context-parallel step (2 ranks, gloo on CPU)", __doc__, worker=_worker)


if __name__ == "__main__":
    main()
