"""The preemption agreement's control group: the default group's timeout is read for new groups
(None without a group), a non-gloo backend gets its own gloo group with that timeout, and where no
gloo group can be made the agreement falls back to the device."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import torch
import torch.distributed as dist

from fntrain.hooks import preemption


def test_the_default_groups_timeout_is_read(tmp_path):
    assert preemption.group_timeout() is None  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))  # fmt: skip
    try:
        assert preemption.group_timeout() == datetime.timedelta(seconds=77)
        memory = preemption._AgreementMemory()
        setup = SimpleNamespace(runtime=SimpleNamespace(backend="nccl", device=torch.device("cpu")))
        preemption._make_control_group(setup, memory)  # a device backend: a gloo group beside it
        assert memory.control_group is not None and memory.control_device is None
        assert dist.get_backend(memory.control_group) == "gloo"
    finally:
        dist.destroy_process_group()


def test_without_gloo_the_agreement_uses_the_device(monkeypatch, caplog):
    def no_gloo(**_kwargs):
        raise RuntimeError("gloo is not built in")

    monkeypatch.setattr(dist, "new_group", no_gloo)
    memory = preemption._AgreementMemory()
    device = torch.device("meta")
    preemption._make_control_group(
        SimpleNamespace(runtime=SimpleNamespace(backend="hccl", device=device)), memory
    )
    assert memory.control_group is None and memory.control_device == device
    assert "no gloo group for checkpoint decisions" in caplog.text
    gloo = preemption._AgreementMemory()
    preemption._make_control_group(
        SimpleNamespace(runtime=SimpleNamespace(backend="cpu:gloo,cuda:nccl")), gloo
    )
    assert gloo.control_group is None and gloo.control_device is None  # the default group does it
