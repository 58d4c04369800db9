"""The generated vision-language set: coloured shapes on noise backgrounds, with a question and its answer.

Each row asks "What colour is the shape?" or "What shape is it?" (4 answers each) about one drawn image;
row i is a pure function of (seed, start + i), so the set needs no file and disjoint index ranges (train,
validation) never share an image. `fntrain.data.vlm` uses it when no data path is given; the tiny VLM's
tokenizer is trained on `shapes_texts()`. Pillow is imported inside functions only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["COLOURS", "SHAPES", "QUESTIONS", "draw_shape", "ShapesQA", "shapes_texts", "write_shapes_jsonl"]

COLOURS = {"red": (215, 40, 40), "green": (40, 175, 60), "blue": (40, 80, 225), "yellow": (230, 205, 40)}
SHAPES = ("circle", "square", "triangle", "cross")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?"}


def draw_shape(shape: str, colour: str, size: int, rng: np.random.Generator) -> Any:
    """A `size` x `size` RGB image: mid-grey with faint noise and one `colour` `shape` near the centre,
    of random size, offset and shade."""
    from PIL import Image, ImageDraw

    # A flat background and large shapes: with busier images (grey level 90-170, noise std 18, half
    # side 0.28-0.38) the tiny model learnt the colours but not the shapes in the default 300 steps.
    pixels = np.clip(128 + rng.normal(0, 4, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    half = rng.uniform(0.36, 0.46) * size
    cx, cy = (size / 2 + rng.uniform(-0.04, 0.04) * size for _ in range(2))
    fill = tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in COLOURS[colour])
    draw = ImageDraw.Draw(image)
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    elif shape == "cross":
        arm = half * 0.38
        draw.rectangle((cx - half, cy - arm, cx + half, cy + arm), fill=fill)
        draw.rectangle((cx - arm, cy - half, cx + arm, cy + half), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    return image


class ShapesQA(torch.utils.data.Dataset):
    """`count` generated rows {"image": PIL image, "messages": [user: image + question, assistant:
    answer]}; row i is a pure function of (seed, start + i), so disjoint `start` ranges never share an
    image."""

    def __init__(self, count: int, *, seed: int = 0, start: int = 0, image_size: int = 48):
        self.count, self.seed, self.start, self.image_size = count, seed, start, image_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        rng = np.random.default_rng([self.seed, self.start + index])
        shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
        kind = ("colour", "shape")[rng.integers(2)]
        image = draw_shape(shape, colour, self.image_size, rng)
        user = [{"type": "image"}, {"type": "text", "text": QUESTIONS[kind]}]
        answer = colour if kind == "colour" else shape
        return {"image": image, "messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": answer}]}  # fmt: skip


def shapes_texts() -> list[str]:
    """Every text of the generated set: what the tiny model's tokenizer is trained on."""
    return [*QUESTIONS.values(), *COLOURS, *SHAPES]


def write_shapes_jsonl(directory: str | Path, count: int, *, seed: int = 0, start: int = 0,
                       image_size: int = 48, name: str = "shapes") -> Path:  # fmt: skip
    """The generated rows as PNG files and `<name>.jsonl` ({"image": relative path, "messages"}) in
    `directory`; returns the JSONL path."""
    import json

    directory = Path(directory)
    (directory / name).mkdir(parents=True, exist_ok=True)
    rows = ShapesQA(count, seed=seed, start=start, image_size=image_size)
    lines = []
    for index in range(count):
        row = rows[index]
        relative = f"{name}/{start + index:06d}.png"
        row["image"].save(directory / relative)
        lines.append(json.dumps({"image": relative, "messages": row["messages"]}))
    path = directory / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
