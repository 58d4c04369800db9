"""Fixtures for runtime tests: a 1-rank torchrun-like environment and an installable stand-in torch_npu."""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.ports import free_port

FAKE_TORCH_NPU = textwrap.dedent(
    '''
    """Stand-in torch_npu: registers `torch.npu` and the "npu" device name, as the real one does."""
    import os
    import types

    import torch

    # The real torch_npu renames PrivateUse1 to "npu" so that torch.device("npu") parses. That is
    # irreversible for the process and makes torch treat it as the accelerator (a later gloo barrier
    # then fails), so only a throw-away subprocess asks for it.
    if os.environ.get("FAKE_TORCH_NPU_RENAME") == "1":
        torch.utils.rename_privateuse1_backend("npu")

    calls = []


    class _Flags:
        allow_hf32 = False


    npu = types.SimpleNamespace(
        IS_FAKE=True,
        calls=calls,
        is_available=lambda: True,
        device_count=lambda: 2,
        set_device=lambda device: calls.append(("set_device", str(device))),
        synchronize=lambda device=None: calls.append(("synchronize", str(device))),
        manual_seed_all=lambda seed: calls.append(("manual_seed_all", seed)),
        _is_in_bad_fork=lambda: False,
        matmul=_Flags(),
        conv=type("_ConvFlags", (), {"allow_hf32": True})(),
    )
    torch.npu = npu
    '''
)


def write_fake_torch_npu(site: Path) -> Path:
    """An importable stand-in torch_npu package under `site`; returns `site`."""
    package = site / "torch_npu"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(FAKE_TORCH_NPU)
    return site


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """Makes `import torch_npu` find a stand-in (not imported yet); removes it and `torch.npu` after."""
    monkeypatch.syspath_prepend(str(write_fake_torch_npu(tmp_path / "fake_site")))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    yield
    sys.modules.pop("torch_npu", None)
    if getattr(getattr(torch, "npu", None), "IS_FAKE", False):
        delattr(torch, "npu")


@pytest.fixture
def one_rank_env(monkeypatch):
    """The environment torchrun gives a 1-process job (a real gloo group gets created from it)."""
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env
    if dist.is_initialized():  # a failed test must not leak its group into the next one
        dist.destroy_process_group()


@pytest.fixture
def no_launch_env(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def one_rank_mesh(tmp_path: Path, dim: str) -> Iterator[object]:
    """A 1-rank gloo group (file rendezvous under `tmp_path`) and its one-dimensional DeviceMesh named
    `dim`; the group is destroyed on exit."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=(dim,))
    finally:
        dist.destroy_process_group()
