"""Tiny datasets for the data tests (module-level so DataLoader workers can import them)."""

from __future__ import annotations

import torch


class Indexed(torch.utils.data.Dataset):
    """Sample i is {"index": i, "x": [i, i]}; records which indices were read (in this process)."""

    def __init__(self, length: int):
        self.length = length
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.reads.append(index)
        return {"index": torch.tensor(index), "x": torch.tensor([index, index], dtype=torch.float32)}


class Stream(torch.utils.data.IterableDataset):
    """An unsized stream of `length` samples; the order depends on the epoch given to set_epoch."""

    def __init__(self, length: int):
        self.length = length
        self.epoch = 0
        self.read = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in range(self.length):
            self.read += 1
            yield {"index": torch.tensor(i + 1000 * self.epoch)}


class StatefulStream(Stream):
    """A stream that can save and restore its position (the HF IterableDataset / torchdata protocol):
    `state_dict()` is the position after the last sample yielded; `load_state_dict` makes the next
    iteration start there."""

    def __init__(self, length: int):
        super().__init__(length)
        self.position = 0
        self.resume_at = 0
        self.loads: list[dict] = []

    def __iter__(self):
        start, self.resume_at = self.resume_at, 0
        self.position = start
        for i in range(start, self.length):
            self.position = i + 1
            self.read += 1
            yield {"index": torch.tensor(i + 1000 * self.epoch)}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.loads.append(dict(state))
        self.resume_at = state["position"]
