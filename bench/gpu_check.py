"""GPU checks: one script, one section per capability, for a short slot on a machine with one GPU.

    python bench/gpu_check.py                 # every section, one table, gpu_check.json (<= 5 minutes)
    python bench/gpu_check.py --only matmul_peak,train_throughput --json out.json

Each section is a function `section(report)` that adds rows with `report.add(section, measure, value,
goal, ok)`; a section that cannot run here (no CUDA) says so and is skipped, and sections not started
before `--budget-s` is spent are skipped with that reason. Progress goes to stderr; stdout gets the one
table. CI runs the sections on CPU (tests/bench/test_gpu_check.py), where they skip.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a file: the repository root holds `bench`, `fntrain` and `recipes`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


@dataclass
class Report:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def add(self, section: str, measure: str, value: str, goal: str = "-", ok: bool | None = None) -> None:
        self.rows.append((section, measure, value, goal, "-" if ok is None else ("yes" if ok else "NO")))
        print(f"[{section}] {measure}: {value} (goal {goal})", file=sys.stderr, flush=True)

    def records(self) -> list[dict]:
        keys = ("section", "measure", "value", "goal", "met")
        return [dict(zip(keys, row, strict=True)) for row in self.rows]

    def table(self) -> str:
        lines = ["| section | measure | value | goal | met |", "|---|---|---|---|---|"]
        lines += [f"| {' | '.join(row)} |" for row in self.rows]
        return "\n".join(lines)


def _need_cuda(report: Report, section: str) -> bool:
    if not torch.cuda.is_available():
        report.add(section, "skipped", "no CUDA device")
        return False
    return True


def environment(report: Report) -> None:
    report.add("environment", "torch", torch.__version__)
    if torch.cuda.is_available():
        report.add("environment", "device", torch.cuda.get_device_name(0))


def _matmul_peak_flops(dtype: torch.dtype = torch.bfloat16, size: int = 8192, iters: int = 20) -> float:
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * iters / (time.perf_counter() - start)


_PEAK: dict[str, float] = {}


def matmul_peak(report: Report) -> None:
    if not _need_cuda(report, "matmul_peak"):
        return
    _PEAK["bf16"] = _matmul_peak_flops()
    report.add("matmul_peak", "bf16 8192^3 matmul", f"{_PEAK['bf16'] / 1e12:.0f} TFLOP/s")


def _gpt2_small_run(steps: int, log_every: int, compile_model: bool, count_syncs: bool) -> dict:
    """Train a GPT-2-124M-sized TinyGPT in bf16 autocast through fntrain.train; tokens/s and syncs."""
    from fntrain import Event, RunPlan, TrainState, train
    from fntrain.models.gpt import ModelConfig, TinyGPT
    from fntrain.step import StepSettings, causal_lm_loss, make_train_step

    torch.manual_seed(0)
    cfg = ModelConfig(context=1024, n_layer=12, n_head=12, d_model=768, vocab_size=50304)
    model = TinyGPT(cfg).cuda()
    params = sum(p.numel() for p in model.parameters())
    if compile_model:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    step_fn = make_train_step(
        model, causal_lm_loss, optimizer, settings=StepSettings(max_grad_norm=1.0, device=torch.device("cuda"),
        autocast_dtype=torch.bfloat16),
    )  # fmt: skip
    micro, batch = 2, 8
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.context), device="cuda")
    batches = [[{"input_ids": ids[i : i + micro], "labels": ids[i : i + micro]} for i in range(0, batch, micro)]]
    plan = RunPlan(train_iters=steps, steps_per_epoch=steps, epochs=1)
    timings: dict[str, float] = {}
    syncs = {"count": 0}

    def data(epoch: int, cursor: int):
        return (batches[0] for _ in range(steps - cursor))

    def timer(event, state, info):
        if event is Event.STEP_END and state.global_step == 3:
            torch.cuda.synchronize()
            timings["start"] = time.perf_counter()
        if event is Event.STEP_END and log_every and state.global_step % log_every == 0:
            float(info.metrics["loss"])  # a logging step: the one place a value leaves the device

    train(TrainState(), step_fn, [timer], data=data, plan=plan)  # warm-up and compile
    torch.cuda.synchronize()
    if count_syncs:
        # Count host syncs on non-logging steps: sync debug mode "warn" emits a warning per sync.
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(TrainState(), step_fn, [], data=data, plan=RunPlan(train_iters=5, steps_per_epoch=5, epochs=1))
            torch.cuda.set_sync_debug_mode("default")
        syncs["count"] = sum("synchroniz" in str(w.message) for w in caught)
        return {"syncs": syncs["count"] / 5}
    train(TrainState(), step_fn, [timer], data=data, plan=plan)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - timings["start"]
    tokens = (steps - 3) * batch * cfg.context
    flops_per_token = 6 * params + 12 * cfg.n_layer * cfg.d_model * cfg.context
    return {"tokens_per_s": tokens / elapsed, "flops": flops_per_token * tokens / elapsed, "params": params}


def train_throughput(report: Report) -> None:
    if not _need_cuda(report, "train_throughput"):
        return
    result = _gpt2_small_run(steps=30, log_every=10, compile_model=True, count_syncs=False)
    report.add("train_throughput", "GPT-2-124M bf16 compile tokens/s", f"{result['tokens_per_s']:.0f}")
    if "bf16" in _PEAK:
        mfu = result["flops"] / _PEAK["bf16"]
        report.add("train_throughput", "MFU vs measured matmul peak", f"{mfu:.1%}", ">= 30%", mfu >= 0.30)


def host_syncs(report: Report) -> None:
    if not _need_cuda(report, "host_syncs"):
        return
    result = _gpt2_small_run(steps=5, log_every=0, compile_model=False, count_syncs=True)
    report.add("host_syncs", "syncs per non-logging step", f"{result['syncs']:.1f}", "0", result["syncs"] == 0)


def memory_snapshot(report: Report) -> None:
    """The memory hook on the real CUDA allocator [S35]: a window snapshot of a training run, then a forced
    out-of-memory error whose snapshot the allocator's OOM observer writes before the stack unwinds."""
    if not _need_cuda(report, "memory_snapshot"):
        return
    import logging
    import pickle
    import tempfile

    from fntrain import RunPlan, TrainState, train
    from fntrain.hooks.memory import MemoryConfig, memory_hook
    from fntrain.models.gpt import ModelConfig, TinyGPT
    from fntrain.runtime import Runtime
    from fntrain.step import StepSettings, causal_lm_loss, make_train_step

    name = "memory_snapshot"
    device = torch.device("cuda", torch.cuda.current_device())
    runtime = Runtime(device=device)
    torch.manual_seed(0)
    cfg = ModelConfig(context=256, n_layer=2, n_head=4, d_model=256)
    model = TinyGPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_fn = make_train_step(model, causal_lm_loss, optimizer, settings=StepSettings(device=device))
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.context), device=device)
    batch = [{"input_ids": ids, "labels": ids}]
    plan = RunPlan(train_iters=4, steps_per_epoch=4, epochs=1)

    def data(epoch: int, cursor: int):
        return (batch for _ in range(4 - cursor))

    def actions_in(path: str) -> tuple[dict, set]:
        with open(path, "rb") as handle:
            snapshot = pickle.load(handle)
        return snapshot, {e.get("action") for trace in snapshot.get("device_traces", []) for e in trace}

    with tempfile.TemporaryDirectory() as tmp:
        # A window over control points [1, 3) of a real run, with mem_info's peak log.
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("fntrain.hooks.memory")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            config = MemoryConfig(enable=True, start_step=1, end_step=3, save_path=f"{tmp}/w", mem_info=True)
            train(TrainState(), step_fn, [memory_hook(config, runtime)], data=data, plan=plan)
        finally:
            logger.removeHandler(handler)
        files = sorted(os.listdir(f"{tmp}/w"))
        one = len(files) == 1 and files[0].startswith("snapshot_") and files[0].endswith("_0.pickle")
        report.add(name, "window files", ", ".join(files), "one snapshot_<time>_0.pickle", one)
        snapshot, actions = actions_in(f"{tmp}/w/{files[0]}")
        ok = {"segments", "device_traces"} <= set(snapshot) and "alloc" in actions
        value = f"keys={sorted(snapshot)} actions={sorted(a for a in actions if a)}"
        report.add(name, "pickle loads; segments, device_traces, alloc events", value, "yes", ok)
        peaks = [line for line in records if "peak_reserved_mib=" in line]
        reserved = float(peaks[-1].split("peak_reserved_mib=")[1].split()[0]) if peaks else 0.0
        value = f"{len(peaks)} lines, last peak_reserved {reserved:.1f} MiB"
        report.add(name, "mem_info", value, "6 lines, > 0 MiB", len(peaks) == 6 and reserved > 0)

        # A forced OOM inside the window: the observer (without one: ABORT) writes snapshot_oom_0.pickle.
        total = torch.cuda.get_device_properties(device).total_memory

        def oom_step(state, batch):
            if state.global_step == 1:
                torch.empty(2 * total, dtype=torch.uint8, device=device)
            return step_fn(state, batch)

        config = MemoryConfig(enable=True, start_step=1, end_step=10, save_path=f"{tmp}/oom")
        raised = None
        try:
            train(TrainState(), oom_step, [memory_hook(config, runtime)], data=data, plan=plan)
        except torch.OutOfMemoryError as error:
            raised = error
        torch.cuda.empty_cache()
        path = f"{tmp}/oom/snapshot_oom_0.pickle"
        written = os.path.exists(path)
        oom_event = written and "oom" in actions_in(path)[1]
        via = "observer" if hasattr(torch._C, "_cuda_attach_out_of_memory_observer") else "ABORT"
        value = f"raised={type(raised).__name__} written={written} oom_event={oom_event}"
        ok = raised is not None and oom_event
        report.add(name, f"forced OOM snapshot (via {via})", value, "OutOfMemoryError, oom event", ok)
        left = sum(len(trace) for trace in torch.cuda.memory._snapshot()["device_traces"])
        report.add(name, "history events left after the runs", str(left), "0", left == 0)


def checkpoint_async(report: Report) -> None:
    """Sync DCP save vs torch.save and async-save blocking vs sync on the GPU (pinned-memory staging)."""
    if not _need_cuda(report, "checkpoint_async"):
        return
    from bench.checkpoint import run as run_checkpoint

    for row in run_checkpoint(quick=False, device="cuda"):
        report.add("checkpoint_async", row.measure, f"{row.fntrain} vs {row.baseline} ({row.difference})",
                   row.goal, row.met)  # fmt: skip


def _cp_loss_and_grads(style: str | None, mesh) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward of a small TinyGPT (bf16 autocast, causal, 4 x 256 tokens) on CUDA:
    plainly (`style` None) or through fntrain.step.context_parallel's `style` over `mesh`."""
    from fntrain.models.gpt import ModelConfig, TinyGPT
    from fntrain.step import causal_lm_loss, default_forward
    from fntrain.step.context_parallel import context_parallel_parts

    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=256, n_layer=2, n_head=4, d_model=128)).cuda()
    ids = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
    batch = {"input_ids": ids, "labels": ids.clone()}
    forward, loss_fn, context = default_forward, causal_lm_loss, None
    if style is not None:
        parts = context_parallel_parts(default_forward, causal_lm_loss, mesh=mesh, style=style)
        forward, loss_fn, context = parts.forward, parts.train_loss, parts.context
    import contextlib

    with (context or contextlib.nullcontext)(), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(forward(model, batch), batch)
        loss.backward()
    return float(loss), {name: p.grad.float().clone() for name, p in model.named_parameters()}


def context_parallel(report: Report) -> None:
    """--parallel.cp-style ring (torch's ring attention through its private SDPA dispatcher, which
    fntrain.step.context_parallel drives) and ulysses on CUDA, over a 1-rank NCCL group (one GPU: a cp mesh
    of size 1, which runs the whole code path; the exchange between ranks needs 2 GPUs and torchrun):
    the loss and gradients equal a plain step's to bf16 tolerance."""
    if not _need_cuda(report, "context_parallel"):
        return
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
        want_loss, want_grads = _cp_loss_and_grads(None, mesh)
        for style in ("ring", "ulysses"):
            loss, grads = _cp_loss_and_grads(style, mesh)
            worst = max(float((grads[n] - g).abs().max() / (g.abs().max() + 1e-6)) for n, g in want_grads.items())
            report.add("context_parallel", f"{style}: loss vs plain", f"{loss:.4f} vs {want_loss:.4f}", "equal to 2e-2",
                       abs(loss - want_loss) <= 2e-2 * abs(want_loss))  # fmt: skip
            report.add("context_parallel", f"{style}: worst relative gradient difference", f"{worst:.2e}", "<= 5e-2",
                       worst <= 5e-2)  # fmt: skip
    finally:
        dist.destroy_process_group()


SECTIONS: list[Callable[[Report], None]] = [
    environment, matmul_peak, train_throughput, host_syncs, checkpoint_async, memory_snapshot, context_parallel,
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated section names")
    parser.add_argument(
        "--json", default=os.environ.get("GPU_CHECK_JSON", "gpu_check.json"), help="where to write the rows as JSON"
    )
    parser.add_argument("--budget-s", type=float, default=270.0, help="start no section after this many seconds")
    args = parser.parse_args(argv)
    wanted = {name for name in args.only.split(",") if name}
    report = Report()
    started = time.perf_counter()
    for section in SECTIONS:
        if wanted and section.__name__ not in wanted:
            continue
        if time.perf_counter() - started > args.budget_s:
            report.add(section.__name__, "skipped", f"time budget of {args.budget_s:g} s spent")
            continue
        try:
            section(report)
        except Exception as error:  # a failing section must not hide the others
            traceback.print_exc()
            report.add(section.__name__, "FAILED", repr(error)[:120], ok=False)
    print(report.table())
    if args.json:
        from bench.harness import machine_info

        payload = {"machine": machine_info(), "seconds": time.perf_counter() - started, "rows": report.records()}
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
