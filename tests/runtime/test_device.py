"""Devices (§5): cpu/cuda/npu resolution, torch_npu imported only for npu, precision flags."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fntrain.runtime import device as devices


def test_cpu_resolves_without_touching_accelerators(fake_torch_npu):
    assert devices.resolve_device_type("cpu") == "cpu"
    assert devices.local_device("cpu", 3) == torch.device("cpu")
    devices.set_device(torch.device("cpu"))
    devices.synchronize(torch.device("cpu"))
    assert devices.set_precision_flags("cpu", True) == {}
    assert "torch_npu" not in sys.modules  # installed (importable) but never imported for cpu


def test_default_backends():
    assert [devices.default_backend(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]


def test_npu_imports_torch_npu_and_uses_its_device_api(fake_torch_npu):
    assert "torch_npu" not in sys.modules
    assert devices.resolve_device_type("npu") == "npu"
    assert "torch_npu" in sys.modules
    assert devices.device_count("npu") == 2
    # torch.device("npu", 1) needs PrivateUse1 renamed (tests/runtime/test_npu.py does that in a
    # subprocess); the device API only reads .type and passes the device on.
    device = types.SimpleNamespace(type="npu", index=1)
    devices.set_device(device)
    devices.synchronize(device)
    assert [name for name, _ in torch.npu.calls] == ["set_device", "synchronize"]


def test_npu_local_rank_beyond_the_node_is_a_clear_error(fake_torch_npu):
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK 2 has no npu device: this node sees 2"):
        devices.local_device("npu", 2)


def test_npu_without_torch_npu_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(RuntimeError, match="device 'npu' needs torch_npu"):
        devices.resolve_device_type("npu")


def test_npu_precision_flags_set_and_restore(fake_torch_npu):
    devices.resolve_device_type("npu")
    previous = devices.set_precision_flags("npu", True)
    assert torch.npu.matmul.allow_hf32 is True and torch.npu.conv.allow_hf32 is True
    devices.restore_precision_flags("npu", previous)
    assert torch.npu.matmul.allow_hf32 is False and torch.npu.conv.allow_hf32 is True


def test_cuda_precision_flags_set_and_restore():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    previous = devices.set_precision_flags("cuda", not before[0])
    assert torch.backends.cuda.matmul.allow_tf32 is (not before[0])
    devices.restore_precision_flags("cuda", previous)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_auto_without_accelerators_is_cpu_and_imports_nothing(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(devices, "npu_installed", lambda: False)
    assert devices.resolve_device_type("auto") == "cpu"
    assert "torch_npu" not in sys.modules


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto prefers cuda when present")
def test_auto_picks_an_installed_npu(fake_torch_npu):
    assert devices.npu_installed()
    assert "torch_npu" not in sys.modules  # found without importing
    assert devices.resolve_device_type("auto") == "npu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_requested_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="runtime.device is 'cuda' but torch.cuda.is_available"):
        devices.resolve_device_type("cuda")


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="runtime.device must be one of"):
        devices.resolve_device_type("tpu")
