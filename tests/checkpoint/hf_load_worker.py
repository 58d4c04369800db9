"""Worker for tests/checkpoint/test_hf_load.py: a 2-rank FSDP2 load of a Hugging Face directory through
the hf_causal_lm recipe's meta-device path, under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.checkpoint.hf_load_worker MODEL_DIR OUT.pt

Saves the logits of a fixed batch, what each rank read from the safetensors files (name, offsets,
lengths of every read request) and the local/global parameter counts.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageReader

from fntrain.models.hf import load_causal_lm
from fntrain.models.hf_config import HFModelConfig
from fntrain.runtime.materialize import local_numel
from fntrain.runtime.parallel import ParallelConfig
from fntrain.runtime.setup import RuntimeConfig, setup_runtime

INPUT_IDS = torch.tensor([[1, 5, 9, 30, 77, 2, 100, 4], [3, 3, 8, 250, 17, 61, 12, 90]])


def main(model_dir: str, out: str) -> None:
    reads: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    original = HuggingFaceStorageReader._process_read_request

    def recording(self, f, req, planner):
        reads.append((req.storage_index.fqn, tuple(req.storage_offsets), tuple(req.lengths)))
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = recording
    dist.init_process_group("gloo")
    try:
        parallel = ParallelConfig(strategy="fsdp2", meta_init=True)
        with setup_runtime(RuntimeConfig(), parallel) as runtime:
            model = load_causal_lm(HFModelConfig(path=model_dir), runtime, parallel)
            model.eval()
            counts = local_numel(model), sum(p.numel() for p in model.parameters())  # before the root gathers
            with torch.no_grad():
                logits = model(input_ids=INPUT_IDS).logits
            all_reads = [None] * dist.get_world_size()
            dist.all_gather_object(all_reads, reads)
            result = {
                "logits": logits,
                "reads": all_reads,
                "local_numel": counts[0],
                "global_numel": counts[1],
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "dtype": str(next(model.parameters()).dtype),
                "world_size": dist.get_world_size(),
            }
            if dist.get_rank() == 0:
                torch.save(result, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(*sys.argv[1:3]))
