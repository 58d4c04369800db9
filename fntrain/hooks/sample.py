"""Samples during training: text the model writes from a few prompts, every `sample.every` steps and
after the last step (llm.c and nanoGPT print one every few hundred steps).

At its steps the hook puts the model in eval mode, samples each prompt through the recipe's sampler
(`RecipeSpec.sampler`: prompt, `SampleSettings`, generator -> text) under no_grad, then restores the
model's mode. Each prompt draws from a `torch.Generator` of its own seeded by sample.seed, with
`fntrain generate`'s defaults (`fntrain.sampling.TEXT_DEFAULTS`), as `fntrain generate --seed` draws its
first sample: the step's checkpoint writes the same text there. The global RNGs are forked around the
call anyway (a recipe's sampler may use them), so a run's losses are bit for bit the same with and
without samples. Each sample goes to the log (one line), to
`<run_dir>/samples.jsonl` ({"step", "prompt", "text"}) and to the metric sinks that take text
(TensorBoard, W&B, MLflow: `MetricsLog.text`). Rank 0 samples; a model whose parameters are sharded
(FSDP2, tensor parallel) is sampled on every rank, the same draws everywhere, so the collectives of its
forwards match, and rank 0 writes. Steps it does not sample on cost the cadence's one integer check.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fntrain.config import require_bool, require_int, require_str
from fntrain.hooks.base import cadence, on, on_ranks, on_steps
from fntrain.hooks.metrics_log import MetricsLog
from fntrain.loop import Event, Hook
from fntrain.runtime.runtime import Runtime
from fntrain.sampling import TEXT_DEFAULTS, SampleSettings
from fntrain.state import TrainState

__all__ = ["SampleConfig", "Sampler", "sample_hook", "whole_logits_on_each_rank", "SAMPLES_FILE"]

log = logging.getLogger("fntrain.hooks.sample")

SAMPLES_FILE = "samples.jsonl"

Sampler = Callable[[str, SampleSettings, torch.Generator], str]
"""(prompt, settings, generator) -> the text the model writes after the prompt (the recipe's)."""


@dataclass(frozen=True)
class SampleConfig:
    """Text the model writes during training, from `prompts`."""

    every: int = 0
    """Sample every N optimizer steps (0: not by steps)."""
    prompts: tuple[str, ...] = ()
    """Prompts to continue, one sample each (none: no samples)."""
    max_new_tokens: int = 64
    """Tokens per sample at most."""
    temperature: float = TEXT_DEFAULTS.temperature
    """Softmax temperature (0: greedy); `fntrain generate`'s default too."""
    top_k: int | None = TEXT_DEFAULTS.top_k
    """Draw among the k most likely tokens (None or 0: no cut)."""
    top_p: float = TEXT_DEFAULTS.top_p
    """Nucleus sampling: draw among the most likely tokens holding this much probability, in (0, 1]."""
    seed: int = 1234
    """Seed of each prompt's own generator, as `fntrain generate --seed`'s: the global RNGs are never drawn from."""
    at_end: bool = True
    """Also sample after the run's last step (when there are prompts)."""

    def validate(self, prefix: str = "sample") -> None:
        require_int(f"{prefix}.every", self.every, min=0)
        if not isinstance(self.prompts, (tuple, list)):
            raise TypeError(f"{prefix}.prompts must be a list of strings, got {self.prompts!r}")
        for index, prompt in enumerate(self.prompts):
            require_str(f"{prefix}.prompts[{index}]", prompt, non_empty=True)
        require_int(f"{prefix}.seed", self.seed, min=0, max=2**32 - 1)
        require_bool(f"{prefix}.at_end", self.at_end)
        self.settings().validate(prefix)  # max_new_tokens, temperature, top_k, top_p
        if self.every and not self.prompts:
            raise ValueError(f"{prefix}.every {self.every} needs {prefix}.prompts (the text to continue)")

    @property
    def enabled(self) -> bool:
        """Prompts and a cadence (every N steps or at the end)."""
        return bool(self.prompts) and bool(self.every or self.at_end)

    def settings(self) -> SampleSettings:
        return SampleSettings(self.max_new_tokens, self.temperature, self.top_k, self.top_p)


def check_sampling(config: SampleConfig, has_sampler: bool, prefix: str = "sample") -> None:
    """Samples asked for (`sample.every`, or `sample.prompts` on a recipe that gives none) need a
    recipe with a sampler: a `ValueError` naming the flag otherwise (the run's first phase calls this)."""
    if config.enabled and not has_sampler:
        field = f"{prefix}.every {config.every}" if config.every else f"{prefix}.prompts {list(config.prompts)!r}"
        raise ValueError(f"{field}: this recipe cannot sample text (its spec has no sampler)")


def whole_logits_on_each_rank(parallel: Any) -> bool:
    """Whether every rank can run the whole model to its full logits, as sampling needs: not under
    pipeline parallelism or with a loss-parallel head (`parallel` is the `--parallel.*` config). When
    not, a warning says there are no samples during training (sample the checkpoint with `fntrain
    generate`) and a recipe's sampler gives None."""
    if parallel.pp_size > 1 or (parallel.tp_size > 1 and parallel.loss_parallel):
        log.warning("sample: no samples during training with pipeline parallelism or a loss-parallel head")
        return False
    return True


def generator_for(seed: int) -> torch.Generator:
    """A sample's generator, fresh for each prompt at each step: the one `fntrain generate --seed` draws
    its first sample from."""
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class _SampleTarget:
    """Where a sample goes and what it draws from (built once; the hook keeps no other state)."""

    model: torch.nn.Module
    sampler: Sampler
    runtime: Runtime
    path: Path  # <run_dir>/samples.jsonl, appended per sampling step
    writer: MetricsLog | None


def _sample_all(config: SampleConfig, target: _SampleTarget, step: int) -> list[dict[str, Any]]:
    """Every prompt's sample at `step`, in eval mode, with the model's mode and the global RNGs restored."""
    model, device = target.model, target.runtime.device
    devices = [device] if device.type not in ("cpu", "meta") else []
    was_training = model.training
    settings = config.settings()
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        model.eval()
        try:
            return [{"step": step, "prompt": prompt,
                     "text": target.sampler(prompt, settings, generator_for(config.seed))}
                    for prompt in config.prompts]  # fmt: skip
        finally:
            model.train(was_training)


def _publish(records: list[dict[str, Any]], target: _SampleTarget) -> None:
    """Log line, samples.jsonl and the text sinks (rank 0)."""
    target.path.parent.mkdir(parents=True, exist_ok=True)
    with open(target.path, "a", encoding="utf-8") as file:
        for index, record in enumerate(records):
            written = json.dumps(record["prompt"] + record["text"], ensure_ascii=False)  # one line: \n escaped
            log.info("sample step=%d %s", record["step"], written)
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
            if target.writer is not None:
                target.writer.text(record["step"], f"sample/{index}", record["prompt"] + record["text"])


def sample_hook(
    config: SampleConfig,
    sampler: Sampler,
    model: torch.nn.Module,
    runtime: Runtime,
    run_dir: str | Path,
    *,
    writer: MetricsLog | None = None,
    last_step: int | None = None,
) -> Hook:
    """The sampling hook: at STEP_END every `config.every` steps (and at `last_step` with `at_end`), each
    prompt sampled by `sampler` from `model` (see the module docstring for the ranks)."""
    config.validate()
    if config.at_end and last_step is None:
        raise ValueError("sample.at_end needs the run's last step (last_step=plan.train_iters)")
    target = _SampleTarget(model, sampler, runtime, Path(run_dir).expanduser() / SAMPLES_FILE, writer)

    def sample(state: TrainState, info: Any) -> None:
        records = _sample_all(config, target, state.global_step)
        if runtime.rank == 0:
            _publish(records, target)

    hook = on_steps(cadence(config.every, last_step if config.at_end else None), on(Event.STEP_END, sample))
    sharded = any(isinstance(parameter, DTensor) for parameter in model.parameters())
    return hook if sharded else on_ranks({0}, runtime.rank, hook)
