"""A text file as non-overlapping windows of bytes, its tail held out: data with no tokenizer (the tiny
GPT's). Sizes come from the file's length alone, so a plan reads nothing.

    byte_windows(path, context, val_fraction)        (train, validation) `ByteWindows`
    byte_window_counts(path, context, val_fraction)  their lengths, from the file size
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fntrain.config import ConfigError

__all__ = ["ByteWindows", "byte_windows", "byte_window_counts"]


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping `context`-byte windows of a byte tensor; labels equal the inputs (the loss shifts)."""

    def __init__(self, data: torch.Tensor, context: int):
        self.data, self.context = data, context

    def __len__(self) -> int:
        return len(self.data) // self.context

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chunk = self.data[index * self.context : (index + 1) * self.context].long()
        return {"input_ids": chunk, "labels": chunk}


def _split_point(size: int, val_fraction: float) -> int:
    return int(size * (1.0 - val_fraction))


def _size(path: str | os.PathLike, field: str) -> int:
    """The file's size; a `ConfigError` naming `field` when it is a directory or empty."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{field} {str(path)!r} is a directory, not a text file")
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{field} {str(path)!r} is empty")
    return size


def byte_window_counts(path: str | os.PathLike, context: int, val_fraction: float, *,
                       field: str = "data.path") -> tuple[int, int]:  # fmt: skip
    """(train, validation) window counts of `byte_windows`, from the file size alone; a file too small
    for one training window is a `ConfigError` naming `field` (the context is `model.context`)."""
    size = _size(path, field)
    split = _split_point(size, val_fraction)
    if split < context:
        raise ConfigError(
            f"{field} {str(path)!r} holds {size} bytes, {split} of them for training: fewer than one "
            f"window of model.context ({context}) bytes"
        )
    return split // context, (size - split) // context


def byte_windows(path: str | os.PathLike, context: int, val_fraction: float, *,
                 field: str = "data.path") -> tuple[ByteWindows, ByteWindows]:  # fmt: skip
    """(train, validation): the file as bytes, its last `val_fraction` held out (checked as
    `byte_window_counts` checks it)."""
    byte_window_counts(path, context, val_fraction, field=field)
    raw = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
    split = _split_point(len(raw), val_fraction)
    return ByteWindows(raw[:split], context), ByteWindows(raw[split:], context)
