"""Run by tests/runtime/test_npu.py in a throw-away process whose stand-in torch_npu (on PYTHONPATH)
renames PrivateUse1 to "npu" as the real one does: drives setup_runtime on cpu and npu and prints
what it saw as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    report: dict = {}
    import fntrain.runtime  # noqa: F401  (the whole runtime package, as a recipe imports it)
    import fntrain.step  # noqa: F401
    from fntrain.runtime import process_group
    from fntrain.runtime.parallel import ParallelConfig, parallelize
    from fntrain.runtime.setup import RuntimeConfig, setup_runtime

    report["imported_by_fntrain_imports"] = "torch_npu" in sys.modules
    with setup_runtime(RuntimeConfig(device="cpu")) as runtime:
        parallelize(torch.nn.Linear(2, 2), runtime, ParallelConfig())
    report["imported_by_cpu_runtime"] = "torch_npu" in sys.modules

    with setup_runtime(RuntimeConfig(device="npu", tf32=True), seed=5) as runtime:
        report["imported_by_npu_runtime"] = "torch_npu" in sys.modules
        report["device"] = str(runtime.device)
        report["backend_single_process"] = runtime.backend
        report["hf32_inside"] = [torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32]
    report["hf32_after"] = [torch.npu.matmul.allow_hf32, torch.npu.conv.allow_hf32]
    report["calls"] = [list(call) for call in torch.npu.calls]

    class Stop(Exception):
        pass

    seen: dict = {}

    def fake_init(backend, timeout_s, device, launch):
        seen.update(backend=backend, timeout_s=timeout_s, device=str(device))
        seen["HCCL_DETERMINISTIC"] = os.environ.get("HCCL_DETERMINISTIC")
        raise Stop

    process_group.init_process_group = fake_init
    # The real setter imports torch._inductor (seconds); test_setup.py covers it for real.
    deterministic = {"on": False}
    torch.use_deterministic_algorithms = lambda mode, warn_only=False: deterministic.update(on=mode)
    torch.are_deterministic_algorithms_enabled = lambda: deterministic["on"]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    try:
        with setup_runtime(RuntimeConfig(device="npu", timeout_s=90.0, deterministic=True)):
            pass
    except Stop:
        report["torchrun"] = seen
    report["HCCL_DETERMINISTIC_after"] = os.environ.get("HCCL_DETERMINISTIC")
    report["deterministic_after"] = torch.are_deterministic_algorithms_enabled()
    print("PROBE " + json.dumps(report))


if __name__ == "__main__":
    main()
