"""`no_host_reads()`: a block in which reading a tensor's value on the host from Python is an error.

On an accelerator `.item()`, `float()`, `int()`, `bool()` and `.tolist()` wait for the device: a host
sync per step. On CPU they are free and go unnoticed, so the tests make them raise. (A
TorchDispatchMode would also see data-dependent ops such as `nonzero`, but its first use imports
torch._dynamo and sympy: seconds of the default tier.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def _refuse(name: str):
    def read(self, *args, **kwargs):
        raise AssertionError(f"Tensor.{name} reads device values on the host (a sync on an accelerator)")

    return read


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    saved = {name: torch.Tensor.__dict__.get(name) for name in _READS}
    try:
        for name in _READS:
            setattr(torch.Tensor, name, _refuse(name))
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
