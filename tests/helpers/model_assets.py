"""A stand-in for what fntrain.data reads from a model's assets (fntrain.models.hf.ModelAssets' fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Assets:
    """What fntrain.data.sft and fntrain.data.preference read from the model's assets."""

    tokenizer: Any
    pad_id: int
    eos_id: int | None
    chat_template: str | None
