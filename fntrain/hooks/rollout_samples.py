"""The rollout's sample completions, published: what an RL step generated, with its rewards.

An objective that generates (GRPO) keeps a few completions of each generation batch with their rewards
and advantage; this hook takes them after each step (`take()` hands each generation's out once) and,
on rank 0, writes each as one line of `<run_dir>/samples.jsonl` ({"step", "prompt", "completion",
"rewards", "reward", "advantage", ...}) and a text for the sinks that take text (TensorBoard, W&B,
MLflow: `MetricsLog.text`), and logs the first of them in one line. Steps without a new generation cost
one call that returns an empty tuple; nothing here touches the device.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fntrain.hooks.base import on, on_ranks
from fntrain.hooks.metrics_log import MetricsLog
from fntrain.hooks.sample import SAMPLES_FILE
from fntrain.loop import Event, Hook
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["rollout_samples_hook"]

log = logging.getLogger("fntrain.hooks.rollout_samples")


def _text(record: Mapping[str, Any]) -> str:
    """A sample as one line of text: the prompt (a chat's last message), the completion, the reward."""
    prompt = record["prompt"]
    if isinstance(prompt, list):
        prompt = prompt[-1].get("content", "") if prompt else ""
    reward = "none" if record["reward"] is None else f"{record['reward']:.4g}"
    return f"{prompt}{record['completion']}  [reward {reward}]"


def rollout_samples_hook(take: Callable[[], tuple[Mapping[str, Any], ...]], runtime: Runtime,
                         run_dir: str | Path, writer: MetricsLog | None = None) -> Hook:  # fmt: skip
    """At STEP_END on rank 0, the samples `take()` hands out (see the module docstring)."""
    path = Path(run_dir).expanduser() / SAMPLES_FILE

    def publish(state: TrainState, info: Any) -> None:
        records = take()
        if not records:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as file:
            for index, record in enumerate(records):
                file.write(json.dumps({"step": state.global_step, **record}, ensure_ascii=False) + "\n")
                if writer is not None:
                    writer.text(state.global_step, f"completion/{index}", _text(record))
        more = f" (+{len(records) - 1} more in {path.name})" if len(records) > 1 else ""
        log.info("completion step=%d %s%s", state.global_step, json.dumps(_text(records[0]), ensure_ascii=False), more)

    return on_ranks({0}, runtime.rank, on(Event.STEP_END, publish))
