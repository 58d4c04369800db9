"""Checkpoint cost for a ~100M-parameter model (TinyGPT, d_model 768, 14 blocks) with AdamW state.

Rows:
- sync save: fntrain's `save` (DCP, per-rank JSON, completion marker, `latest`) vs `torch.save` of the
  same model + optimizer state dict to one file. Both are fsynced, so both pay the disk the same way.
- manifest: the part of a sync `save` spent on the manifest (reading the written files back and taking
  their CRC-32s, `fntrain.checkpoint.verify.build_manifest`, timed on each saved checkpoint just as
  `save` runs it) vs the whole sync save; the note gives the checksum throughput against the save's.
- async blocking: how long `save_async` holds the training loop (state dict, JSON, staging copy) vs a
  sync `save`. On CPU the staging copy is a memcpy of the whole state, so the ratio mostly shows memory
  bandwidth against disk bandwidth; the <= 0.1x goal is checked on an accelerator (pinned-memory staging)
  by `run(quick, device="cuda")` from bench/gpu_check.py.

Run: `python -m bench.checkpoint [--quick] [--device cuda]`. The variants alternate within one process
(`interleave`); each repeat writes to a fresh directory and the previous one is deleted first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from bench.harness import Row, append_results, format_table, interleave, paired_ratio_row, ratio_row
from fntrain.checkpoint import SaveTarget, make_stager, save, save_async
from fntrain.checkpoint.verify import build_manifest
from fntrain.state import TrainState
from fntrain.step.components import Components

FULL = {"n_layer": 14, "d_model": 768, "n_head": 12}  # ~99.6M parameters
QUICK = {"n_layer": 2, "d_model": 512, "n_head": 8}  # ~6.4M parameters


def build(shape: dict[str, int], device: str) -> Components:
    """The recipe's model with AdamW moments in place (one step taken), on `device`."""
    from fntrain.models.gpt import ModelConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=128, **shape)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, 256, (2, 128), device=device)
    model(ids).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return Components(model, None, (optimizer,))


def _synchronize(device: str) -> None:
    if device != "cpu":
        getattr(torch, torch.device(device).type).synchronize()


def _torch_save(parts: Components, path: Path) -> None:
    model_state, optimizer_state = get_state_dict(parts.model, parts.optimizers)
    with open(path, "wb") as handle:
        torch.save({"model": model_state, "optimizer": optimizer_state}, handle)
        handle.flush()
        os.fsync(handle.fileno())


def run(quick: bool, device: str = "cpu") -> list[Row]:
    parts = build(QUICK if quick else FULL, device)
    params = sum(p.numel() for p in parts.model.parameters())
    label = f"{params / 1e6:.0f}M params + AdamW, {device}"
    scratch = Path(tempfile.mkdtemp(prefix="fntrain-bench-ckpt-"))
    stager = make_stager(device)
    step = {"n": 0}
    blocking: list[float] = []
    async_total: list[float] = []
    manifest_s: list[float] = []
    saved_bytes: list[int] = []

    def fresh(name: str) -> Path:
        target = scratch / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        return target

    def dcp_sync() -> int:
        _synchronize(device)
        step["n"] += 1
        path = save(SaveTarget(fresh("dcp"), parts, device=device), TrainState(0, step["n"], step["n"]))
        t0 = time.perf_counter()  # what save spent on the manifest, repeated on the same page-cached files
        manifest = build_manifest(path)
        manifest_s.append(time.perf_counter() - t0)
        saved_bytes.append(sum(entry["size"] for entry in manifest["files"].values()))
        return 1

    def torch_sync() -> int:
        _synchronize(device)
        _torch_save(parts, fresh("torch") / "state.pt")
        return 1

    def dcp_async() -> int:
        _synchronize(device)
        step["n"] += 1
        root = fresh("async")
        t0 = time.perf_counter()
        pending = save_async(
            SaveTarget(root, parts, device=device), TrainState(0, step["n"], step["n"]), stager=stager
        )
        blocking.append(time.perf_counter() - t0)
        pending.result()
        async_total.append(time.perf_counter() - t0)
        return 1

    repeats = 1 if quick else 3
    try:
        timing = interleave(
            {"dcp": dcp_sync, "torch.save": torch_sync, "async": dcp_async},
            repeats=repeats,
            warmup=1,
        )
    finally:
        stager.close()
        shutil.rmtree(scratch, ignore_errors=True)
    sync = timing.median("dcp")
    blocked = sorted(blocking[-repeats:])[len(blocking[-repeats:]) // 2]
    written = sorted(async_total[-repeats:])[len(async_total[-repeats:]) // 2]
    on_accelerator = device != "cpu"
    summed = sorted(manifest_s[-repeats:])[len(manifest_s[-repeats:]) // 2]
    size_mb = saved_bytes[-1] / 1e6
    return [
        paired_ratio_row(
            f"checkpoint sync save ({label})",
            timing,
            "dcp",
            "torch.save",
            unit="s",
            scale=1.0,
            goal_ratio=None,
            note="fntrain save (DCP + JSON + marker + latest, fsynced) vs torch.save of the same state dict "
            "to one fsynced file; the baseline writes one stream, DCP writes per-rank files and metadata.",
        ),
        ratio_row(
            f"checkpoint manifest crc32 ({label})",
            summed,
            sync,
            unit="s",
            goal_ratio=None,
            note=f"reading back and CRC-32-summing the {size_mb:.0f} MB just written ({size_mb / summed:.0f} MB/s) "
            f"vs the whole sync save that includes it ({size_mb / sync:.0f} MB/s end to end); restore reads "
            "the files once more to verify them before loading.",
        ),
        ratio_row(
            f"checkpoint async blocking ({label})",
            blocked,
            sync,
            unit="s",
            goal_ratio=0.1 if on_accelerator else None,
            note=(
                f"time save_async holds the loop (state dict + staging copy) vs a sync save; the write "
                f"then finishes in the background (call to complete: {written:.3g} s). "
                + (
                    "Pinned-memory staging, buffers reused across saves."
                    if on_accelerator
                    else "On CPU staging is a full memcpy of the state; the 0.1x goal is checked on GPU "
                    "(bench/gpu_check.py)."
                )
            ),
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args(argv)
    rows = run(args.quick, args.device)
    print(format_table(rows))
    if args.record:
        append_results("Checkpoint cost" + (" (quick)" if args.quick else ""), rows)


if __name__ == "__main__":
    main()
