"""What a tiny run leaves in its run directory, as the kill-and-resume and multi-process tests read it."""

from __future__ import annotations

from pathlib import Path

import torch


def recorded_losses(run_dir: Path) -> list[tuple[int, str]]:
    """The (step, loss) pairs a driver's loss recorder wrote to `run_dir/losses.txt`, in order, each loss
    as written (exact)."""
    words = (run_dir / "losses.txt").read_text().split()
    return [(int(step), value) for step, value in zip(words[::2], words[1::2], strict=True)]


def exported_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final weights the run exported (`run_dir/model.safetensors`)."""
    from safetensors.torch import load_file

    return load_file(run_dir / "model.safetensors")
