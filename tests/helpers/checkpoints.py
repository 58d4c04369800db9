"""What a checkpoint directory holds, as the checkpoint and hook tests read it."""

from __future__ import annotations

from pathlib import Path

from fntrain.checkpoint import list_checkpoints


def saved_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under `root`, oldest first."""
    return [int(path.name.split("_")[1]) for path in list_checkpoints(root)]


def bytes_under(path: Path) -> int:
    """The bytes the files under `path` hold."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fake_disk_capacity(monkeypatch, root: Path, total: int) -> None:
    """The checkpoint filesystem holds `total` bytes: free space is that minus what `root` holds."""
    from fntrain.checkpoint import space

    def free(path):
        return max(0, total - bytes_under(Path(root)))

    monkeypatch.setattr(space, "free_bytes", free)
