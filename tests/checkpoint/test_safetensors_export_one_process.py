"""`fntrain.checkpoint.export` in one process: the pipeline branch of `full_model_state` (its stage
states gathered over a 1-rank gloo pipeline group and merged), `export_safetensors` writing tied and
non-contiguous tensors as plain copies with or without metadata, and the umask read falling back to
022 where /proc cannot be read."""

from __future__ import annotations

import json
import stat

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from fntrain.checkpoint import export, staged_out


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("table", torch.arange(12.0).reshape(3, 4).t())  # non-contiguous


def test_a_pipeline_stage_state_is_gathered_and_written(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        pipeline = dist.new_group([0])
        state = export.full_model_state(model, pipeline)
        path = export.export_safetensors(model, tmp_path / "w" / "model.safetensors", pipeline_group=pipeline)
    finally:
        dist.destroy_process_group()
    assert set(state) == {"tok.weight", "head.weight", "table"}
    assert all(t.device.type == "cpu" for t in state.values())
    assert torch.equal(state["head.weight"], model.tok.weight.detach())
    written = load_file(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(written[name], tensor), name
    with safe_open(str(path), framework="pt") as handle:
        assert "fntrain" not in handle.metadata()  # no metadata given: the format key only
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~export._umask()


def test_metadata_goes_into_the_header(tmp_path):
    path = export.export_safetensors(Tied(), tmp_path / "m.safetensors", metadata={"step": 3})
    with safe_open(str(path), framework="pt") as handle:
        assert json.loads(handle.metadata()["fntrain"]) == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # the temporary file is gone


def test_umask_falls_back_to_022_without_proc(monkeypatch):
    def no_proc(*_args, **_kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(staged_out, "open", no_proc, raising=False)
    assert staged_out._umask() == 0o022
