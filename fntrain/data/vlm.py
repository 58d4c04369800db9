"""Vision-language fine-tuning data: image + chat JSONL or tables (or a generated shapes set) -> the model's own
processor -> input_ids, labels (assistant turns only) and per-sample pixel_values -> padded batches.

    data = VLMDataConfig(path="vqa.jsonl", val_fraction=0.05)
    data.validate()                                        # before any model work: fields and files
    train_set, val_set = build_vlm_datasets(data, processor, seed=0)
    collate = make_vlm_collate(processor.tokenizer.pad_token_id, max_length=data.max_length)

Rows (one JSON object per line): {"image": PATH, "messages": [{"role", "content"}, ...]} or
{"image": PATH, "prompt": ..., "completion": ...} (a one-turn chat). PATH is relative to the JSONL
file's directory (or absolute), read with Pillow; a list of paths gives several images. When no
message holds an {"type": "image"} item, the images go first in the first user turn. The conversation
is rendered with the processor's chat template and encoded by the processor (which expands each image
placeholder into the model's image tokens and resizes the images: nothing here resizes by hand). Only
the assistant turns are trained on: every other label, the image tokens included, is IGNORE_INDEX.

A Parquet/Arrow file or a `datasets.save_to_disk` folder serves as well, one row per example, its
columns the keys (`fntrain.data.files.read_rows`; errors name rows 0-based). Its image column may hold
paths (relative to the file's directory, or to the save_to_disk folder), encoded image bytes, or what
`datasets.Image` stores ({"bytes", "path"} structs), or lists of them.

With no `path`, a generated set is used (`fntrain.data.shapes.ShapesQA`): coloured shapes on noise
backgrounds, each asking "What colour is the shape?" or "What shape is it?" (4 answers each); images are
drawn from (seed, index), so the set needs no file and validation images are never trained on.

Multimodal packing is out of scope: one example per sample, right-padded per micro-batch; the
micro-batch's pixel_values are the samples' image tensors concatenated along dim 0.
Pillow is imported inside functions only.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from fntrain.config import ConfigError, require_choice, require_float, require_int, require_str
from fntrain.data.chat import chat_spans
from fntrain.data.files import position_label, read_rows, require_source
from fntrain.data.formats import Format, check_table_formats, no_format_error
from fntrain.data.sft_collate import make_sft_collate
from fntrain.data.shapes import ShapesQA
from fntrain.data.tokens import IGNORE_INDEX

__all__ = [
    "VLMDataConfig",
    "vlm_messages",
    "check_vlm_rows",
    "transform_vlm_example",
    "vlm_prompt",
    "VLMExamples",
    "VLMPrompts",
    "build_vlm_datasets",
    "make_vlm_collate",
]

log = logging.getLogger("fntrain.data.vlm")


@dataclass(frozen=True)
class VLMDataConfig:
    """The image + text training data (a JSONL file or a table, or the generated shapes set)."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("path", "val_path")

    path: str = ""
    """JSONL file, one row per line: {"image", "messages"} or {"image", "prompt", "completion"}; image paths are relative to the file. Or a .parquet/.arrow file, a folder of them or a datasets.save_to_disk folder with those columns (images as paths, bytes or datasets.Image). Empty: the generated shapes question-answer set."""
    val_path: str | None = None
    """Validation rows, in any format data.path takes (None: the val_fraction tail of data.path, or generated held-out images)."""
    val_fraction: float = 0.0
    """Tail fraction of data.path's rows held out for validation when val_path is None."""
    image_key: str = "image"
    """Key (column) of a row's image path (or list of paths; in a table also image bytes)."""
    messages_key: str = "messages"
    """Key (column) of a chat row's message list."""
    prompt_key: str = "prompt"
    """Key (column) of a prompt/completion row's prompt."""
    completion_key: str = "completion"
    """Key (column) of a prompt/completion row's completion."""
    max_length: int = 512
    """Most tokens per example, image tokens included; a longer example is an error (cutting it could cut its image tokens)."""
    pad_to: Literal["longest", "max_length"] = "longest"
    """Padding: every micro-batch to its longest example, or to max_length (static shapes)."""
    train_samples: int = 4096
    """Generated set: training examples (used when path is empty)."""
    val_samples: int = 128
    """Generated set: held-out examples for validation loss and answer accuracy."""
    image_size: int = 48
    """Generated set: image side in pixels (the processor resizes to the model's input size)."""

    def validate(self, prefix: str = "data") -> None:
        """Value rules naming `prefix.field`; given data files (or table folders) must exist (a
        `ConfigError`); their rows and images are checked by `build_vlm_datasets`."""
        require_str(f"{prefix}.path", self.path)
        require_str(f"{prefix}.val_path", self.val_path, optional=True)
        require_float(f"{prefix}.val_fraction", self.val_fraction, min=0.0, max=0.5)
        for name in ("image_key", "messages_key", "prompt_key", "completion_key"):
            require_str(f"{prefix}.{name}", getattr(self, name), non_empty=True)
        require_int(f"{prefix}.max_length", self.max_length, min=2)
        require_choice(f"{prefix}.pad_to", self.pad_to, ("longest", "max_length"))
        require_int(f"{prefix}.train_samples", self.train_samples, min=1)
        require_int(f"{prefix}.val_samples", self.val_samples, min=0)
        require_int(f"{prefix}.image_size", self.image_size, min=8)
        if self.path:
            require_source(f"{prefix}.path", self.path)
        if self.val_path:
            require_source(f"{prefix}.val_path", self.val_path)


# ----------------------------------------------------------------------------- transform


def _image_sources(value: Any, root: Path | None, where: str) -> list[Any]:
    """The images of a row's image value (a path, a PIL image, encoded bytes, a `datasets.Image`
    {"bytes", "path"} struct, or a list of them): PIL images and bytes as they are, paths resolved
    against `root` and checked to be files (a `ConfigError` naming `where` and the path as written in
    the row)."""
    sources = []
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, Mapping) and ("bytes" in item or "path" in item):  # datasets.Image
            item = item.get("bytes") or item.get("path")
        if hasattr(item, "convert") or isinstance(item, bytes):  # a PIL image (generated rows), bytes
            sources.append(item)
            continue
        if not isinstance(item, str):
            raise ConfigError(f"{where}: an image must be a path, got {type(item).__name__}")
        path = Path(item).expanduser()
        path = path if path.is_absolute() or root is None else root / path
        if not path.is_file():
            raise ConfigError(f"{where}: image {item!r} not found (looked at {path})")
        sources.append(path)
    return sources


def _load_images(value: Any, root: Path | None, where: str) -> list[Any]:
    """PIL RGB images of a row's image value: a path, a PIL image, or a list of them."""
    from PIL import Image

    images = []
    for source in _image_sources(value, root, where):
        if isinstance(source, (Path, bytes)):
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as opened:
                images.append(opened.convert("RGB"))
        else:
            images.append(source.convert("RGB"))
    return images


def _formats(data: VLMDataConfig) -> list[Format]:
    """A chat row's and a prompt/completion row's key settings and keys (`fntrain.data.formats`)."""
    return [[("data.messages_key", data.messages_key)],
            [("data.prompt_key", data.prompt_key), ("data.completion_key", data.completion_key)]]  # fmt: skip


def vlm_messages(record: Mapping[str, Any], data: VLMDataConfig, images: int, where: str) -> list[dict]:
    """The row's conversation, with `images` image items first in the first user turn unless a message
    already holds them; a prompt/completion row is a one-turn chat."""
    if data.messages_key in record:
        messages = record[data.messages_key]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{where}: {data.messages_key!r} must be a non-empty list of messages")
    elif data.prompt_key in record and data.completion_key in record:
        messages = [{"role": "user", "content": record[data.prompt_key]},
                    {"role": "assistant", "content": record[data.completion_key]}]  # fmt: skip
    else:
        raise no_format_error(where, record, _formats(data))
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ConfigError(f"{where}: message {index} must be an object with 'role' and 'content'")
    has_image = any(
        isinstance(m["content"], list) and any(c.get("type") == "image" for c in m["content"]) for m in messages
    )
    if has_image or not images:
        return [dict(m) for m in messages]
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise ConfigError(f"{where}: an image row needs a user turn to put the image in")
    out = [dict(m) for m in messages]
    content = out[first_user]["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    out[first_user]["content"] = [{"type": "image"}] * images + text
    return out


def check_vlm_rows(rows: Sequence[Mapping[str, Any]], data: VLMDataConfig, *, root: Path | None,
                   wheres: Sequence[str]) -> None:  # fmt: skip
    """Every row's conversation and image files, checked without decoding an image or running the
    processor (that happens in the loader): a `ConfigError` starting with the row's `wheres` entry for
    a row without a conversation or an assistant turn, or whose image file is missing or not an image
    (its header is read), so a bad row fails before training instead of at the step that reads it."""
    from PIL import Image, UnidentifiedImageError

    for record, where in zip(rows, wheres, strict=True):
        images = _image_sources(record[data.image_key], root, where) if data.image_key in record else []
        for index, image in enumerate(images):
            if not isinstance(image, (Path, bytes)):
                continue
            try:
                Image.open(io.BytesIO(image) if isinstance(image, bytes) else image).close()  # the header only
            except (UnidentifiedImageError, OSError) as error:
                name = f"{index} (bytes)" if isinstance(image, bytes) else repr(str(image))
                raise ConfigError(f"{where}: image {name} is not an image Pillow reads ({error})") from None
        messages = vlm_messages(record, data, len(images), where)
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{where}: no assistant turn to train on")


def _encode(processor: Any, text: str, images: list[Any], where: str, offsets: bool) -> Mapping[str, Any]:
    kwargs = {"return_offsets_mapping": True} if offsets else {}
    encoded = processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
    if "input_ids" not in encoded:
        raise ValueError(f"{where}: the processor returned no input_ids")
    return encoded


def transform_vlm_example(
    record: Mapping[str, Any], processor: Any, data: VLMDataConfig, *, root: Path | None = None,
    where: str = "example",
) -> dict[str, Any]:  # fmt: skip
    """One row -> {"input_ids", "labels", "pixel_values"} (the multimodal data transform). Labels keep
    the tokens of the assistant turns (with their end-of-turn marker) and ignore the rest, image tokens
    included. An example longer than `data.max_length` is an error naming the field."""
    images = _load_images(record[data.image_key], root, where) if data.image_key in record else []
    messages = vlm_messages(record, data, len(images), where)
    text, spans = chat_spans(processor, getattr(processor, "chat_template", None), messages, where)
    encoded = _encode(processor, text, images, where, offsets=True)
    ids = encoded["input_ids"][0]
    image_token = getattr(processor, "image_token", "<image>")
    image_id = processor.tokenizer.convert_tokens_to_ids(image_token)
    placeholders = text.count(image_token)
    # The processor expands each placeholder into N image tokens; shift the spans past the expansion.
    per_image = int((ids == image_id).sum()) // placeholders if placeholders else 1
    grow = (per_image - 1) * len(image_token)
    shifted = [(a + grow * text[:a].count(image_token), b + grow * text[:b].count(image_token)) for a, b in spans]
    starts = [int(begin) for begin, _ in encoded["offset_mapping"][0].tolist()]
    labels = torch.tensor([
        int(token) if any(a <= s < b for a, b in shifted) and token != image_id else IGNORE_INDEX
        for token, s in zip(ids.tolist(), starts, strict=True)
    ], dtype=torch.long)  # fmt: skip
    if len(ids) > data.max_length:
        raise ValueError(f"{where}: {len(ids)} tokens (image tokens included) exceed data.max_length "
                         f"({data.max_length})")  # fmt: skip
    if bool((labels == IGNORE_INDEX).all()):
        raise ValueError(f"{where}: no assistant token to train on")
    sample = {"input_ids": ids, "labels": labels}
    if "pixel_values" in encoded:
        sample["pixel_values"] = encoded["pixel_values"]
    return sample


def vlm_prompt(
    record: Mapping[str, Any], processor: Any, data: VLMDataConfig, *, root: Path | None = None,
    where: str = "example",
) -> dict[str, Any]:  # fmt: skip
    """The row up to its last assistant turn, with the generation prompt, encoded for generation:
    {"input_ids", "pixel_values", "answer"} (answer: the last assistant turn's text)."""
    images = _load_images(record[data.image_key], root, where) if data.image_key in record else []
    messages = vlm_messages(record, data, len(images), where)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise ValueError(f"{where}: no assistant turn to compare an answer with")
    answer = messages[last]["content"]
    if isinstance(answer, list):
        answer = " ".join(c.get("text", "") for c in answer if c.get("type") == "text")
    text = processor.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
    encoded = _encode(processor, text, images, where, offsets=False)
    prompt = {"input_ids": encoded["input_ids"][0], "answer": str(answer)}
    if "pixel_values" in encoded:
        prompt["pixel_values"] = encoded["pixel_values"]
    return prompt


# ----------------------------------------------------------------------------- datasets


class VLMExamples(torch.utils.data.Dataset):
    """Rows (a sequence: loaded JSONL or `ShapesQA`) transformed on access, so images are decoded and
    processed by the loader (and its workers), not held in memory. Errors name `source` and the row's
    line in its file (`lines`) or its number."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], processor: Any, data: VLMDataConfig, *,
                 root: Path | None = None, source: str = "data.path", lines: Sequence[int | str] | None = None):  # fmt: skip
        self.rows, self.processor, self.data, self.root, self.source = rows, processor, data, root, source
        self.lines = lines

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, index: int) -> str:
        """How errors name row `index`: its line in the file (or its table row), else its number."""
        line = self.lines[index] if self.lines is not None else None
        return f"{self.source} {position_label(line)}" if line is not None else f"{self.source} row {index + 1}"

    def __getitem__(self, index: int) -> dict[str, Any]:
        where = self.where(index)
        return transform_vlm_example(self.rows[index], self.processor, self.data, root=self.root, where=where)

    def prompts(self) -> VLMPrompts:
        """The same rows as generation prompts with their answers (for answer accuracy)."""
        return VLMPrompts(self)


class VLMPrompts(torch.utils.data.Dataset):
    """A `VLMExamples`' rows as `vlm_prompt`s."""

    def __init__(self, examples: VLMExamples):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        e = self.examples
        return vlm_prompt(e.rows[index], e.processor, e.data, root=e.root, where=e.where(index))


def build_vlm_datasets(
    data: VLMDataConfig, processor: Any, *, seed: int = 0
) -> tuple[VLMExamples, VLMExamples | None]:
    """(train, validation or None): the JSONL or table rows of data.path (validation: data.val_path, else the
    data.val_fraction tail), or the generated set (validation: data.val_samples held-out images). Every
    JSONL row is read and checked here (its conversation, that its image files exist), so a bad row is a
    `ConfigError` naming the field, the file and the line before training."""
    if not data.path:
        size = data.image_size
        train = ShapesQA(data.train_samples, seed=seed, image_size=size)
        val = ShapesQA(data.val_samples, seed=seed, start=data.train_samples, image_size=size)
        return (VLMExamples(train, processor, data, source="generated"),
                VLMExamples(val, processor, data, source="generated validation") if len(val) else None)  # fmt: skip
    rows, lines, root = _checked_rows(data.path, "data.path", data)
    source = f"data.path {data.path!r}"
    val = None
    if data.val_path:
        val_rows, val_lines, val_root = _checked_rows(data.val_path, "data.val_path", data)
        val = VLMExamples(val_rows, processor, data, root=val_root, source=f"data.val_path {data.val_path!r}",
                          lines=val_lines)  # fmt: skip
    elif data.val_fraction > 0:
        split = len(rows) - max(1, math.floor(len(rows) * data.val_fraction))
        if split < 1:
            raise ConfigError(f"data.val_fraction {data.val_fraction} leaves no training row")
        val = VLMExamples(rows[split:], processor, data, root=root, source=source, lines=lines[split:])
        rows, lines = rows[:split], lines[:split]
    return VLMExamples(rows, processor, data, root=root, source=source, lines=lines), val


def _checked_rows(path: str, field_name: str, data: VLMDataConfig) -> tuple[list[dict], list[int | str], Path]:
    """(rows, their positions, the directory image paths are relative to) of a JSONL file or a table
    source, every row checked (`check_vlm_rows`)."""
    columns = (data.image_key, data.messages_key, data.prompt_key, data.completion_key)
    numbered = read_rows(path, field_name, columns)
    check_table_formats(field_name, path, _formats(data))  # a table's rows hold only `columns`
    rows, lines = [row for _, row in numbered], [number for number, _ in numbered]
    source = require_source(field_name, path)
    root = source if source.is_dir() else source.parent
    wheres = [f"{field_name} {path!r} {position_label(n)}" for n in lines]
    check_vlm_rows(rows, data, root=root, wheres=wheres)
    return rows, lines, root


# ----------------------------------------------------------------------------- collate


def make_vlm_collate(
    pad_id: int, *, max_length: int, pad_to: str = "longest"
) -> Callable[[list[Any]], dict[str, torch.Tensor]]:
    """Right-pad the text of a list of samples (`fntrain.data.sft_collate.make_sft_collate`: labels
    IGNORE_INDEX and a 2-D attention_mask where padded) and concatenate their image tensors along
    dim 0 into `pixel_values` (no key when no sample has an image)."""
    text_collate = make_sft_collate(pad_id, max_length=max_length, pad_to=pad_to)

    def collate(samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        batch = text_collate(samples)
        images = [s["pixel_values"] for s in samples if "pixel_values" in s]
        if images:
            batch["pixel_values"] = torch.cat(images, dim=0)
        return batch

    return collate
