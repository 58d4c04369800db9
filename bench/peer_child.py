"""One whole run of bench/peers.py in a process of its own: `python -m bench.peer_child JOB.json`.

The job (`PeerJob`, written by bench/peers.py) names the side, the workload and the files. fntrain's side
runs its command line (`fntrain run ...`, `job.argv`) through the console script's `main`; TRL's side
builds `SFTTrainer` or `DPOTrainer` from the same model directory and JSONL file (`trl_trainer`, also
what bench/peers.py times step by step), trains and saves the model, as a user's script does. Each
optimizer step's end is marked (wall clock and this process's CPU time): fntrain's from its per-step
metrics line, TRL's from a `TrainerCallback`. The marks and the run's end go to `job.out` as JSON.

This module imports nothing at its top but the standard library, so that neither side's start-up
pays for the other's imports.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["PeerJob", "trl_trainer", "main"]

@dataclass(frozen=True)
class PeerJob:
    """One side's run of one workload: `model` a model directory (weights and tokenizer), `data` a JSONL
    file, `work` a directory of its own, `out` where the marks go; the batch, the sequence cap, the
    learning rate and the number of optimizer steps, the same on both sides; `argv` fntrain's command
    line (its side only)."""

    side: str
    workload: str
    variant: str
    model: str
    data: str
    work: str
    out: str
    micro: int
    accum: int
    max_length: int
    lr: float
    steps: int
    argv: tuple[str, ...] = ()

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self)))
        return path

    @staticmethod
    def read(path: str | Path) -> PeerJob:
        record = json.loads(Path(path).read_text())
        return PeerJob(**{**record, "argv": tuple(record["argv"])})


def trl_trainer(job: PeerJob) -> Any:
    """TRL's trainer for `job`, set to do fntrain's work: fp32, no gradient checkpointing (both TRL
    defaults are on), AdamW with TRL's default kernel, a constant learning rate, clipping at 1, the
    data in file order; DPO with an explicit frozen copy of the model as its reference. SFT's `packed`
    is TRL's `packing=True` (best-fit decreasing, which turns on its padding-free collate)."""
    import trl
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.model)
    model = AutoModelForCausalLM.from_pretrained(job.model)
    dataset = load_dataset("json", data_files=job.data, split="train")
    common = dict(
        output_dir=job.work, per_device_train_batch_size=job.micro, gradient_accumulation_steps=job.accum,
        max_steps=job.steps, learning_rate=job.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_length=job.max_length, logging_steps=1, save_strategy="no",
        report_to=[], bf16=False, use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        train_sampling_strategy="sequential", gradient_checkpointing=False,
    )  # fmt: skip
    if job.workload == "sft":
        args = trl.SFTConfig(**common, packing=job.variant == "packed")
        return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(job.model)
    args = trl.DPOConfig(**common, beta=0.1)
    return trl.DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip


def _mark() -> list[float]:
    return [time.time(), time.process_time()]


def _run_trl(job: PeerJob, marks: list[list[float]]) -> None:
    from transformers import TrainerCallback

    class MarkSteps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(_mark())

    trainer = trl_trainer(job)
    trainer.add_callback(MarkSteps())
    trainer.train()
    trainer.save_model(str(Path(job.work) / "model"))


_STEP_LINE = re.compile(r"step=(\d+) ")


def _run_fntrain(job: PeerJob, marks: list[list[float]]) -> None:
    """`fntrain run ...` as its console script runs it; a step's end is its metrics line (log every 1)."""

    def on_metrics_line(record: logging.LogRecord) -> bool:
        if _STEP_LINE.match(record.getMessage()) and "val_loss" not in record.getMessage():
            marks.append(_mark())
        return True

    logging.getLogger("fntrain.metrics").addFilter(on_metrics_line)
    from fntrain.cli import main as fntrain_main

    fntrain_main(list(job.argv))


RUNNERS: dict[str, Callable[[PeerJob, list[list[float]]], None]] = {"trl": _run_trl, "fntrain": _run_fntrain}


def peak_resident_mib() -> float:
    """This process's peak resident memory (VmHWM): unlike a child's ru_maxrss on Linux, it does not
    start from the size of the process that forked it."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str]) -> None:
    job = PeerJob.read(argv[0])
    marks: list[list[float]] = []
    RUNNERS[job.side](job, marks)
    Path(job.out).write_text(json.dumps({"steps": marks, "end": _mark(), "peak_mib": peak_resident_mib()}))


if __name__ == "__main__":
    main(sys.argv[1:])
