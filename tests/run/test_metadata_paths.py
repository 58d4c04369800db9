"""`fntrain.run.metadata` where the environment differs: device names (cuda missing, npu through the
device module, meta, /proc/cpuinfo unreadable), torch_npu's version only once imported, extra fields,
and writes that fail or are not rank 0's to make (logged, never raised); a recorded config file that
was never written is cleared."""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import torch

from fntrain.run import metadata
from fntrain.runtime import Runtime


def test_device_names_never_fail(monkeypatch):
    assert metadata._device_name(torch.device("meta")) == "meta"
    if not torch.cuda.is_available():
        assert metadata._device_name(torch.device("cuda", 0)).startswith("unknown (")
    import fntrain.runtime.device as devices

    npu = types.SimpleNamespace(get_device_name=lambda index: f"Ascend 910B #{index}")
    monkeypatch.setattr(devices, "device_module", lambda kind: npu)  # torch.device("npu") needs torch_npu
    assert metadata._device_name(types.SimpleNamespace(type="npu", index=1)) == "Ascend 910B #1"
    assert metadata._device_name(types.SimpleNamespace(type="npu", index=None)) == "Ascend 910B #0"


def test_cpu_name_falls_back_to_the_platform(monkeypatch):
    real = Path.read_text

    def no_cpuinfo(self, *args, **kwargs):
        if str(self) == "/proc/cpuinfo":
            raise OSError("no /proc")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", no_cpuinfo)
    monkeypatch.setattr(metadata.platform, "processor", lambda: "")
    monkeypatch.setattr(metadata.platform, "machine", lambda: "riscv64")
    assert metadata._cpu_name() == "riscv64"


def test_torch_npu_version_only_when_imported_and_extra_fields(monkeypatch, tmp_path):
    monkeypatch.delitem(metadata.sys.modules, "torch_npu", raising=False)
    assert "torch_npu" not in metadata._versions()
    monkeypatch.setitem(metadata.sys.modules, "torch_npu", types.SimpleNamespace(__version__="2.5.1"))
    assert metadata._versions()["torch_npu"] == "2.5.1"
    assert metadata.git_state(tmp_path / "missing") is None
    collected = metadata.collect_run_metadata(Runtime(), argv=["x"], extra={"note": "hi", "seed": 9})
    assert collected["note"] == "hi" and collected["seed"] == 9 and collected["command"]["argv"] == ["x"]


def test_failed_or_foreign_writes_are_logged_not_raised(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger=metadata.log.name):
        assert metadata.write_run_metadata(blocker / "run", Runtime()) is None  # a file where a dir must be
    assert "could not write" in caplog.text

    run = tmp_path / "run"
    metadata.record_start(run, Runtime(), {"global_step": 2})  # no metadata yet: nothing to update
    assert not run.exists()
    path = metadata.write_run_metadata(run, Runtime(), argv=[])
    before = path.read_text()
    metadata.record_outcome(run, Runtime(rank=1, world_size=2), "completed")  # not rank 0: untouched
    assert path.read_text() == before

    def broken(*_args):
        raise OSError("read-only filesystem")

    monkeypatch.setattr(metadata, "_write", broken)
    with caplog.at_level(logging.WARNING, logger=metadata.log.name):
        metadata.record_outcome(run, Runtime(), "completed")
    assert "could not update" in caplog.text and path.read_text() == before


def test_a_config_file_never_written_is_cleared(tmp_path):
    path = metadata.write_run_metadata(tmp_path, Runtime(), argv=[], config_file="config.json")
    metadata.record_outcome(tmp_path, Runtime(), "failed before training", error="bad flag")
    recorded = json.loads(path.read_text())
    assert recorded["outcome"] == "failed before training" and recorded["error"] == "bad flag"
    assert recorded["config_file"] is None
