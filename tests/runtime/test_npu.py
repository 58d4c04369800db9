"""The NPU path end to end with a stand-in torch_npu (never the real one) [§5]: device npu imports it,
sets the device, selects hccl with the configured timeout, seeds the NPU, sets and restores HF32;
device cpu never imports it. Runs in a subprocess because the stand-in, like torch_npu, renames
PrivateUse1 to "npu" for the rest of the process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers.waiting import run_to_end
from tests.runtime.conftest import write_fake_torch_npu

ROOT = Path(__file__).resolve().parents[2]


def test_npu_runtime_with_a_stand_in_torch_npu(tmp_path):
    site = write_fake_torch_npu(tmp_path / "site")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HCCL_DETERMINISTIC")
    }
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), FAKE_TORCH_NPU_RENAME="1")
    result = run_to_end(
        [sys.executable, "-m", "tests.runtime.npu_probe"], "the NPU probe with a stand-in torch_npu", 60,
        cwd=ROOT, env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("PROBE "))
    report = json.loads(line.removeprefix("PROBE "))

    assert report["imported_by_fntrain_imports"] is False
    assert report["imported_by_cpu_runtime"] is False
    assert report["imported_by_npu_runtime"] is True
    assert report["device"] == "npu:0"
    assert report["backend_single_process"] is None  # plain python: no process group
    assert report["hf32_inside"] == [True, True] and report["hf32_after"] == [False, True]
    assert report["calls"] == [["manual_seed_all", 5], ["set_device", "npu:0"], ["synchronize", "npu:0"]]
    assert report["torchrun"] == {
        "backend": "hccl",
        "timeout_s": 90.0,
        "device": "npu:1",
        "HCCL_DETERMINISTIC": "true",
    }
    assert report["HCCL_DETERMINISTIC_after"] is None and report["deterministic_after"] is False
