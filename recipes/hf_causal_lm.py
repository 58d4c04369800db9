"""Fine-tune a local Hugging Face causal LM on text, prompt/completion or chat JSONL.

    fntrain run hf_causal_lm --model.path ./my-llama --data.path chat.jsonl --train.train-iters 100
    torchrun --nproc_per_node 2 -m fntrain run hf_causal_lm ... --parallel.strategy fsdp2
    fntrain plan hf_causal_lm --model.path ./my-llama --data.path chat.jsonl --world-size 8

Needs the `hf` extra (transformers, tokenizers). Never downloads anything: `model.path` must be a local
directory holding config.json and safetensors weights (what `save_pretrained` writes), and the Hub's
offline switches (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE) are set before transformers is imported. The
fine-tuned model, its config and the tokenizer are saved to `output_dir` in the same layout, so
`AutoModelForCausalLM.from_pretrained(output_dir)` loads the result.

Data (one JSON object per line): {"text": ...} trains on every token; {"prompt": ..., "completion": ...}
and {"messages": [{"role": ..., "content": ...}, ...]} (rendered with the tokenizer's chat template, or
`assets.chat_template`) train on the completion / the assistant turns only: every other token's label
is the ignore index (-100). Examples are padded one per sample to `data.max_length`, or packed into
`data.max_length`-token windows with `data.packing` (documents then see the earlier documents of their
window: plain concatenation, no per-document attention masks).

The recipe composes fntrain's builders in the fixed order [S1]: runtime -> model (loaded, parallelized)
-> loss -> model assets (tokenizer) -> data transform -> dataset -> collate -> plan -> optimizer ->
schedule -> hooks -> train -> save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from fntrain import RunPlan, TrainState, make_run_plan, train
from fntrain.components import Components
from fntrain.config import require_bool, require_choice, require_float, require_int, require_str
from fntrain.data.pipeline import DataSpec, build_data, data_fn
from fntrain.data.tokens import IGNORE_INDEX, count_batch
from fntrain.hooks.checkpoint import CheckpointConfig, checkpoint_root, make_preemption
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.gc import GCConfig
from fntrain.hooks.memory import MemoryConfig
from fntrain.hooks.metrics import MetricsConfig
from fntrain.hooks.profiler import ProfilerConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.hooks.standard import (
    EarlyHooks,
    early_hooks,
    memory_config,
    profiler_config,
    restore_run,
    standard_hooks,
    under_run_dir,
)
from fntrain.hooks.throughput import ThroughputConfig, dense_transformer_flops_per_token
from fntrain.hooks.watchdog import WatchdogConfig
from fntrain.logs import rank_logs
from fntrain.optim import OptimizerConfig, ScheduleConfig, build_lr_schedule, build_optimizer
from fntrain.preemption import Preemption
from fntrain.run_metadata import record_start, write_run_metadata
from fntrain.runtime import Runtime
from fntrain.runtime.parallel import (
    ParallelConfig,
    autocast_dtype,
    build_grad_scaler,
    data_parallel_group,
    hsdp_shape,
    parallel_train_step,
    parallelize,
)
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.step import causal_lm_loss

log = logging.getLogger("recipes.hf_causal_lm")

OFFLINE_SWITCHES = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = ("auto", "text", "prompt_completion", "chat")


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class HFModelConfig:
    """The model to fine-tune: a local directory, never a Hub id."""

    path: str = ""
    """Local model directory (config.json + *.safetensors, as save_pretrained writes it). Required."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Dtype of the loaded weights (auto: the checkpoint's). For bf16 compute over fp32 weights use
    parallel.mixed_precision instead."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel transformers uses."""


@dataclass(frozen=True)
class AssetsConfig:
    """Model assets: the tokenizer and its chat template."""

    tokenizer_path: str | None = None
    """Local tokenizer directory (None: model.path)."""
    chat_template: str | None = None
    """Jinja chat template for chat data: a file path or the template text (None: the tokenizer's own).
    It is saved with the tokenizer in output_dir."""


@dataclass(frozen=True)
class HFDataConfig:
    """The JSONL training data and how it becomes token windows."""

    path: str = ""
    """JSONL file, one example per line: {"text"}, {"prompt", "completion"} or {"messages"}. Required."""
    format: Literal["auto", "text", "prompt_completion", "chat"] = "auto"
    """Example format (auto: decided per line by the keys present)."""
    text_key: str = "text"
    """Key of the text of a text example."""
    prompt_key: str = "prompt"
    """Key of the prompt of a prompt/completion example."""
    completion_key: str = "completion"
    """Key of the completion of a prompt/completion example."""
    messages_key: str = "messages"
    """Key of the message list of a chat example."""
    max_length: int = 1024
    """Tokens per sample: longer examples are truncated (padding) or split across windows (packing)."""
    packing: bool = False
    """Concatenate examples into max_length windows instead of padding one example per sample."""
    pad_to: Literal["max_length", "longest"] = "max_length"
    """Padding: every micro-batch to max_length (static shapes), or to its longest example."""
    train_on_prompt: bool = False
    """Also train on prompt tokens (system/user turns, prompts); by default their labels are ignored."""
    add_eos: bool = True
    """Append the EOS token to text examples and completions (chat templates end turns themselves)."""
    shuffle: bool = True
    """Shuffle the sample order each epoch (seeded by seed and epoch)."""
    val_path: str | None = None
    """JSONL validation examples for evaluation (None: the val_fraction tail of data.path)."""
    val_fraction: float = 0.0
    """Tail fraction of data.path's examples held out for evaluation when val_path is None."""


@dataclass(frozen=True)
class HFTrainConfig:
    """Run length and batch shape."""

    train_iters: int | None = 100
    """Optimizer steps to run (exclusive with train_samples)."""
    train_samples: int | None = None
    """Samples to train on; train_iters = train_samples // global_batch_size."""
    global_batch_size: int = 8
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 2
    """Samples per forward/backward."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this (0 disables clipping)."""
    loss_weighting: Literal["token", "mean"] = "token"
    """token: token-weighted global mean; mean: plain mean over micro-batches and ranks."""


@dataclass(frozen=True)
class HFCausalLMConfig:
    """Fine-tune a local Hugging Face causal LM and save it in save_pretrained layout."""

    run_dir: str = "runs/hf_causal_lm"
    """Directory for the resolved config, metrics and artifacts."""
    output_dir: str | None = None
    """Where the fine-tuned model, config and tokenizer are saved (None: <run_dir>/hf_model)."""
    seed: int = 42
    """Seed for python, numpy, torch and the data order."""
    log_every: int = 10
    """Log metrics every N steps (0 = never)."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: HFModelConfig = field(default_factory=HFModelConfig)
    assets: AssetsConfig = field(default_factory=AssetsConfig)
    data: HFDataConfig = field(default_factory=HFDataConfig)
    train: HFTrainConfig = field(default_factory=HFTrainConfig)
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=2e-5, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_iters=0, min_lr_ratio=0.1))
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Allocator-history snapshots and peak-memory logs; a relative save_path is under run_dir."""
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """Validation loss on data.val_path (or the data.val_fraction tail) every N steps / epochs."""
    gc: GCConfig = field(default_factory=GCConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """A window of steps traced with torch.profiler / torch_npu.profiler; output_path None is run_dir."""
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(export=False))
    """Resumable DCP checkpoints (under <run_dir>/checkpoints); the fine-tuned model itself always goes
    to output_dir in save_pretrained layout."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Hang watchdog: a silence far longer than recent steps dumps every rank's stacks to <run_dir>/stacks
    and aborts (exit status watchdog.exit_code)."""

    def validate(self) -> None:
        """Value rules, each error naming the dotted field; runs before any model or device work."""
        require_str("run_dir", self.run_dir, non_empty=True)
        require_str("output_dir", self.output_dir, optional=True)
        require_int("seed", self.seed, min=0)
        require_int("log_every", self.log_every, min=0)
        self.runtime.validate("runtime")
        if self.runtime.seed not in (RuntimeConfig().seed, self.seed):
            raise ValueError(
                f"runtime.seed ({self.runtime.seed}) is set from seed ({self.seed}) by this recipe: use --seed"
            )
        self.parallel.validate("parallel")
        require_str("model.path", self.model.path)
        if not self.model.path:
            raise ValueError("model.path is required: a local model directory (config.json + safetensors)")
        require_choice("model.dtype", self.model.dtype, ("float32", "bfloat16", "float16", "auto"))
        require_str("assets.tokenizer_path", self.assets.tokenizer_path, optional=True)
        require_str("assets.chat_template", self.assets.chat_template, optional=True)
        require_str("data.path", self.data.path)
        if not self.data.path:
            raise ValueError("data.path is required: a JSONL file of training examples")
        require_choice("data.format", self.data.format, FORMATS)
        for name in ("text_key", "prompt_key", "completion_key", "messages_key"):
            require_str(f"data.{name}", getattr(self.data, name), non_empty=True)
        require_int("data.max_length", self.data.max_length, min=2)
        for name in ("packing", "train_on_prompt", "add_eos", "shuffle"):
            require_bool(f"data.{name}", getattr(self.data, name))
        require_choice("data.pad_to", self.data.pad_to, ("max_length", "longest"))
        require_str("data.val_path", self.data.val_path, optional=True)
        require_float("data.val_fraction", self.data.val_fraction, min=0.0, max=0.5)
        require_int("train.global_batch_size", self.train.global_batch_size, min=1)
        require_int("train.micro_batch_size", self.train.micro_batch_size, min=1)
        require_float("train.max_grad_norm", self.train.max_grad_norm, min=0.0)
        require_choice("train.loss_weighting", self.train.loss_weighting, ("token", "mean"))
        self.optim.validate("optim")
        self.schedule.validate("schedule")
        for name in (
            "memory",
            "throughput",
            "metrics",
            "progress",
            "evaluate",
            "gc",
            "profiler",
            "checkpoint",
            "watchdog",
        ):
            getattr(self, name).validate(name)
        if self.evaluate.enabled and not (self.data.val_path or self.data.val_fraction > 0):
            raise ValueError("evaluate needs validation data: set data.val_path or data.val_fraction > 0")


Config = HFCausalLMConfig  # the name the `fntrain` command looks for


# ----------------------------------------------------------------------------- model assets


def set_offline() -> None:
    """Turn on the Hub's offline switches: nothing in this process may try a download."""
    os.environ.update(OFFLINE_SWITCHES)


def require_local_dir(field_name: str, path: str, *, needs: Sequence[str] = ()) -> Path:
    """`path` as an existing local directory holding `needs`, else a `FileNotFoundError` naming the
    field (a Hub id is never looked up)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{field_name} {path!r} is not a local directory; fntrain never downloads models: "
            "save one with save_pretrained (or huggingface-cli download) and pass its path"
        )
    missing = [name for name in needs if not (directory / name).exists()]
    if missing:
        raise FileNotFoundError(f"{field_name} {path!r} lacks {', '.join(missing)}")
    return directory


@dataclass(frozen=True)
class ModelAssets:
    """The tokenizer and the ids the data transform needs."""

    tokenizer: Any
    pad_id: int
    eos_id: int | None
    chat_template: str | None


def _read_chat_template(value: str) -> str:
    path = Path(value).expanduser()
    if "{{" in value or "{%" in value:
        return value
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise FileNotFoundError(f"assets.chat_template {value!r} is neither a file nor a Jinja template")


def build_model_assets(config: HFCausalLMConfig) -> ModelAssets:
    """The tokenizer from the local tokenizer directory (default: the model's), with the chat template
    of `assets.chat_template` when given."""
    set_offline()
    source = config.assets.tokenizer_path or config.model.path
    field_name = "assets.tokenizer_path" if config.assets.tokenizer_path else "model.path"
    directory = require_local_dir(field_name, source)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if config.assets.chat_template is not None:
        tokenizer.chat_template = _read_chat_template(config.assets.chat_template)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return ModelAssets(
        tokenizer=tokenizer,
        pad_id=int(pad_id) if pad_id is not None else 0,  # padded positions are masked and ignored
        eos_id=int(eos_id) if eos_id is not None else None,
        chat_template=getattr(tokenizer, "chat_template", None),
    )


# ----------------------------------------------------------------------------- data transform


@dataclass(frozen=True)
class Example:
    """One tokenized example: token ids and their labels (IGNORE_INDEX on tokens not trained on)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


def read_jsonl(path: str, field_name: str = "data.path") -> list[dict[str, Any]]:
    """The objects of a JSONL file (blank lines skipped); a bad line is an error naming its number."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{field_name} {path!r} does not exist")
    records = []
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{field_name} {path!r} line {number}: not valid JSON ({error})") from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{field_name} {path!r} line {number}: expected a JSON object, got {record!r}"
                )
            records.append(record)
    return records


def example_format(record: Mapping[str, Any], data: HFDataConfig) -> str:
    """The format of one record: `data.format`, or decided by its keys when "auto"."""
    if data.format != "auto":
        return data.format
    if data.messages_key in record:
        return "chat"
    if data.prompt_key in record and data.completion_key in record:
        return "prompt_completion"
    if data.text_key in record:
        return "text"
    raise ValueError(
        f"cannot tell the format of an example with keys {sorted(record)}: expected {data.text_key!r}, "
        f"{data.prompt_key!r} + {data.completion_key!r}, or {data.messages_key!r}"
    )


def _field(record: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in record:
        raise ValueError(f"{where}: missing key {key!r}")
    value = record[key]
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _inside(position: int, spans: Sequence[tuple[int, int]]) -> bool:
    return any(start <= position < stop for start, stop in spans)


def _tokenize_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], *, add_special_tokens: bool,
                    train_all: bool) -> tuple[list[int], list[int]]:  # fmt: skip
    """Token ids of `text` and labels that keep a token only when it starts inside one of the
    character `spans` (all tokens when `train_all`)."""
    if train_all:
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return list(ids), list(ids)
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        labels = [
            token if _inside(begin, spans) else IGNORE_INDEX
            for token, (begin, _) in zip(ids, encoded["offset_mapping"], strict=True)
        ]
        return ids, labels
    # A slow tokenizer has no offsets: tokenize the pieces between span borders one after another.
    ids, labels, position = [], [], 0
    borders = sorted({0, len(text), *(p for span in spans for p in span)})
    for index, (begin, end) in enumerate(zip(borders, borders[1:], strict=False)):
        piece = tokenizer(text[begin:end], add_special_tokens=add_special_tokens and index == 0)["input_ids"]
        trained = _inside(begin, spans)
        ids.extend(piece)
        labels.extend(piece if trained else [IGNORE_INDEX] * len(piece))
        position = end
    assert position == len(text)
    return ids, labels


def _chat_spans(assets: ModelAssets, messages: list[Any], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    A turn's span runs from the end of the conversation rendered up to it with the generation prompt to
    the end of the conversation rendered through it, so the template's own turn markers around the
    reply (the end-of-turn token included) are trained on, as the model must learn to emit them.
    """
    tokenizer = assets.tokenizer
    if not assets.chat_template:
        raise ValueError(
            f"{where}: chat examples need a chat template: the tokenizer has none; set assets.chat_template"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {index} must be an object with 'role' and 'content'")

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=generation_prompt
        )

    text = render(len(messages), False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(index, True), render(index + 1, False)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ValueError(
                f"{where}: the chat template does not render conversation prefixes as prefixes of the "
                "whole conversation, so prompt tokens cannot be told apart; use data.train_on_prompt"
            )
        spans.append((len(before), len(through)))
    return text, spans


def transform_example(
    record: Mapping[str, Any], assets: ModelAssets, data: HFDataConfig, where: str = "example"
) -> Example:
    """One JSONL record -> token ids and labels (the data transform)."""
    tokenizer = assets.tokenizer
    kind = example_format(record, data)
    eos = [assets.eos_id] if data.add_eos and assets.eos_id is not None else []
    if kind == "text":
        text = _field(record, data.text_key, str, where)
        ids, _ = _tokenize_spans(tokenizer, text, [], add_special_tokens=True, train_all=True)
        ids = ids + eos if not (eos and ids and ids[-1] == eos[0]) else ids
        return Example(tuple(ids), tuple(ids))
    if kind == "prompt_completion":
        prompt = _field(record, data.prompt_key, str, where)
        completion = _field(record, data.completion_key, str, where)
        text = prompt + completion
        ids, labels = _tokenize_spans(
            tokenizer,
            text,
            [(len(prompt), len(text))],
            add_special_tokens=True,
            train_all=data.train_on_prompt,
        )
        return Example(tuple(ids + eos), tuple(labels + eos))
    messages = _field(record, data.messages_key, list, where)
    text, spans = _chat_spans(assets, messages, where)
    ids, labels = _tokenize_spans(
        tokenizer, text, spans, add_special_tokens=False, train_all=data.train_on_prompt
    )
    return Example(tuple(ids), tuple(labels))


def build_examples(
    records: Sequence[Mapping[str, Any]], assets: ModelAssets, data: HFDataConfig, source: str = "data.path"
) -> list[Example]:
    """Every record transformed; examples with no trained token (within max_length when padding; the
    first label is never a target) are dropped with a warning."""
    limit = None if data.packing else data.max_length
    examples, empty = [], 0
    for number, record in enumerate(records, start=1):
        example = transform_example(record, assets, data, where=f"{source} example {number}")
        if all(label == IGNORE_INDEX for label in example.labels[1:limit]):
            empty += 1
            continue
        examples.append(example)
    if empty:
        log.warning("%s: dropped %d of %d examples with no token to train on", source, empty, len(records))
    if not examples:
        raise ValueError(f"{source} yields no example with a token to train on")
    return examples


class PaddedExamples(torch.utils.data.Dataset):
    """One example per sample, truncated to `max_length` (padding happens in the collate fn)."""

    def __init__(self, examples: Sequence[Example], max_length: int):
        self.examples, self.max_length = list(examples), max_length
        self.truncated = sum(len(e.input_ids) > max_length for e in self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        example = self.examples[index]
        return {
            "input_ids": list(example.input_ids[: self.max_length]),
            "labels": list(example.labels[: self.max_length]),
        }


class PackedExamples(torch.utils.data.Dataset):
    """All examples concatenated and cut into `max_length`-token windows (the tail is dropped)."""

    def __init__(self, examples: Sequence[Example], max_length: int):
        ids = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.long)
        labels = torch.tensor([t for e in examples for t in e.labels], dtype=torch.long)
        self.max_length = max_length
        self.windows = len(ids) // max_length
        self.dropped_tokens = len(ids) - self.windows * max_length
        self.ids = ids[: self.windows * max_length].view(self.windows, max_length)
        self.labels = labels[: self.windows * max_length].view(self.windows, max_length)

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def build_dataset(examples: Sequence[Example], data: HFDataConfig) -> torch.utils.data.Dataset:
    """Padded (one example per sample) or packed windows, per `data.packing`."""
    if data.packing:
        dataset = PackedExamples(examples, data.max_length)
        if len(dataset) == 0:
            raise ValueError(
                f"data.packing: the examples hold fewer than data.max_length ({data.max_length}) tokens"
            )
        return dataset
    dataset = PaddedExamples(examples, data.max_length)
    if dataset.truncated:
        log.warning("%d examples are longer than data.max_length (%d) and are truncated", dataset.truncated,
                    data.max_length)  # fmt: skip
    return dataset


def make_collate(pad_id: int, *, max_length: int, pad_to: str = "max_length") -> Callable[[list[Any]], dict]:
    """Stack samples into a micro-batch: right-padded with `pad_id` (labels IGNORE_INDEX, attention_mask
    0) to `max_length` or to the longest sample. Packed samples (all of one length, no padding needed)
    get no attention_mask, which keeps attention on its causal fast path."""

    def collate(samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(s["input_ids"], dtype=torch.long) for s in samples]
        labels = [torch.as_tensor(s["labels"], dtype=torch.long) for s in samples]
        length = max_length if pad_to == "max_length" else min(max(len(t) for t in ids), max_length)
        if all(len(t) == length for t in ids):  # nothing to pad (packed windows): no mask needed
            return {"input_ids": torch.stack(ids), "labels": torch.stack(labels)}
        batch_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
        batch_labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), length), dtype=torch.long)
        for row, (sample_ids, sample_labels) in enumerate(zip(ids, labels, strict=True)):
            n = min(len(sample_ids), length)
            batch_ids[row, :n] = sample_ids[:n]
            batch_labels[row, :n] = sample_labels[:n]
            mask[row, :n] = 1
        return {"input_ids": batch_ids, "labels": batch_labels, "attention_mask": mask}

    return collate


def build_datasets(config: HFCausalLMConfig, assets: ModelAssets) -> tuple[Any, Any]:
    """(train, validation or None): JSONL -> examples -> padded or packed datasets. Validation comes
    from data.val_path, else the data.val_fraction tail of the training examples."""
    data = config.data
    records = read_jsonl(data.path)
    if not records:
        raise ValueError(f"data.path {data.path!r} holds no example")
    examples = build_examples(records, assets, data)
    val_examples: list[Example] = []
    if data.val_path:
        val_records = read_jsonl(data.val_path, "data.val_path")
        if not val_records:
            raise ValueError(f"data.val_path {data.val_path!r} holds no example")
        val_examples = build_examples(val_records, assets, data, "data.val_path")
    elif data.val_fraction > 0:
        split = len(examples) - max(1, int(len(examples) * data.val_fraction))
        if split < 1:
            raise ValueError(f"data.val_fraction {data.val_fraction} leaves no training example")
        examples, val_examples = examples[:split], examples[split:]
    return build_dataset(examples, data), (build_dataset(val_examples, data) if val_examples else None)


# ----------------------------------------------------------------------------- model


def load_model(config: HFModelConfig, device: torch.device) -> torch.nn.Module:
    """The causal LM from the local directory `config.path` (config + safetensors), on `device`."""
    set_offline()
    directory = require_local_dir("model.path", config.path, needs=("config.json",))
    if not any(directory.glob("*.safetensors")) and not (directory / "model.safetensors.index.json").exists():
        raise FileNotFoundError(f"model.path {config.path!r} holds no *.safetensors weights")
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = "auto" if config.dtype == "auto" else _DTYPES[config.dtype]
    # transformers 4.56 renamed torch_dtype to dtype (5.x knows only the new name).
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        str(directory),
        local_files_only=True,
        use_safetensors=True,
        attn_implementation=config.attn_implementation,
        **{dtype_kwarg: dtype},
    )
    return model.to(device)


def load_model_sharded(config: HFModelConfig, runtime: Runtime, parallel: ParallelConfig) -> torch.nn.Module:
    """parallel.meta_init: the causal LM built on the meta device from `config.path`'s config.json,
    parallelized, then filled from its safetensors through DCP's Hugging Face reader, each rank reading
    only its shards (fntrain.checkpoint.hf_load). Returns what `parallelize` returns."""
    set_offline()
    directory = require_local_dir("model.path", config.path, needs=("config.json",))
    if not any(directory.glob("*.safetensors")):
        raise FileNotFoundError(f"model.path {config.path!r} holds no *.safetensors weights")
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from fntrain.checkpoint.hf_load import hf_weights
    from fntrain.runtime.materialize import build_model

    hf_config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    saved_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype = _DTYPES.get(config.dtype) or saved_dtype  # auto: the checkpoint's, as from_pretrained does
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    kwargs: dict[str, Any] = {"attn_implementation": config.attn_implementation}
    if dtype is not None:
        kwargs["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = (
            getattr(torch, dtype) if isinstance(dtype, str) else dtype
        )
    factory = lambda: AutoModelForCausalLM.from_config(hf_config, **kwargs)  # noqa: E731
    return build_model(factory, runtime, parallel, fill=hf_weights(directory))


def _check_vocab(model: torch.nn.Module, assets: ModelAssets) -> None:
    embeddings = model.get_input_embeddings().weight.shape[0]
    if len(assets.tokenizer) > embeddings:
        raise ValueError(
            f"the tokenizer has {len(assets.tokenizer)} tokens but the model's embedding table only "
            f"{embeddings} rows: model.path and assets.tokenizer_path do not belong together"
        )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (FSDP2 shards in place: no wrapper)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def save_hf_model(
    model: torch.nn.Module, assets: ModelAssets, output_dir: str | Path, runtime: Runtime
) -> Path:
    """Save the model (safetensors + config + generation config) and the tokenizer in save_pretrained
    layout. Under FSDP2 every rank takes part in gathering the full state dict; rank 0 writes."""
    output = Path(output_dir).expanduser()
    inner = unwrap(model)
    state_dict = None
    if runtime.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state_dict = get_model_state_dict(
            inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    if runtime.is_main:
        output.mkdir(parents=True, exist_ok=True)
        inner.save_pretrained(str(output), state_dict=state_dict)
        assets.tokenizer.save_pretrained(str(output))
        log.info("saved the fine-tuned model and tokenizer to %s", output)
    return output


# ----------------------------------------------------------------------------- composition


@dataclass(frozen=True)
class Built:
    """Everything the recipe built, for hooks and tests."""

    config: HFCausalLMConfig
    runtime: Runtime
    plan: RunPlan
    components: Components
    assets: ModelAssets
    data: DataSpec
    val_dataset: Any
    run_dir: Path
    flops_per_token: float | None = None


def _flops_per_token(model: torch.nn.Module, context: int) -> float | None:
    """Analytic training FLOPs per token of a dense decoder (6N + 12 L d T), from the HF config."""
    hf_config = getattr(model, "config", None)
    layers, width = getattr(hf_config, "num_hidden_layers", None), getattr(hf_config, "hidden_size", None)
    if not (isinstance(layers, int) and isinstance(width, int)):
        return None
    params = sum(p.numel() for p in model.parameters())
    return dense_transformer_flops_per_token(params, layers, width, context)


def output_dir(config: HFCausalLMConfig) -> Path:
    """Where the fine-tuned model goes: `output_dir`, else <run_dir>/hf_model."""
    return Path(under_run_dir(config.run_dir, config.output_dir, "hf_model"))


def build_hooks(built: Built, *, early: EarlyHooks | None = None, preemption: Preemption | None = None) -> list[Any]:
    """The standard hook list [S27] (memory, throughput, metrics, progress, evaluate, gc, profiler,
    checkpoint, then the hang watchdog). `early` holds the memory and profiler hooks `run` built before
    the model; `preemption` the checkpoint hook's signal handlers (`make_preemption`)."""
    from fntrain.config_file import config_to_dict

    config, runtime = built.config, built.runtime
    return standard_hooks(
        config,
        runtime,
        built.plan,
        built.components,
        run_dir=built.run_dir,
        early=early,
        val_dataset=built.val_dataset,
        eval_micro_batch_size=config.train.micro_batch_size,
        collate_fn=built.data.collate_fn,
        autocast_dtype=autocast_dtype(config.parallel),
        dp_group=data_parallel_group(runtime),
        flops_per_token=built.flops_per_token,
        run_config=config_to_dict(config),
        preemption=preemption,
    )


def _make_plan(config: HFCausalLMConfig, dataset_len: int, dp_size: int) -> RunPlan:
    return make_run_plan(
        global_batch_size=config.train.global_batch_size,
        micro_batch_size=config.train.micro_batch_size,
        dp_size=dp_size,
        train_iters=config.train.train_iters,
        train_samples=config.train.train_samples,
        dataset_len=dataset_len,
        lr_schedule_iters=config.schedule.lr_schedule_iters,
    )


def build(config: HFCausalLMConfig, runtime: Runtime) -> Built:
    """Model (loaded, parallelized), loss, assets, transform, dataset, collate, plan, optimizer and
    schedule, in that order [S1]."""
    torch.manual_seed(config.seed)
    if config.parallel.meta_init:  # built on meta, parallelized, each rank loading only its shards
        model = load_model_sharded(config.model, runtime, config.parallel)
    else:
        model = load_model(config.model, runtime.device)
    assets = build_model_assets(config)
    _check_vocab(unwrap(model), assets)
    flops = _flops_per_token(unwrap(model), config.data.max_length)
    if not config.parallel.meta_init:
        model = parallelize(model, runtime, config.parallel)
    train_set, val_set = build_datasets(config, assets)
    plan = _make_plan(config, len(train_set), runtime.dp_size)
    data = build_data(
        train_set,
        micro_batch_size=config.train.micro_batch_size,
        micro_batches=plan.micro_batches,
        collate_fn=make_collate(assets.pad_id, max_length=config.data.max_length, pad_to=config.data.pad_to),
        shuffle=config.data.shuffle,
        seed=config.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
    )
    optimizer = build_optimizer(config.optim, model).optimizer
    schedule = build_lr_schedule(config.schedule, plan, optimizer).scheduler
    components = Components(
        model=model,
        loss_fn=causal_lm_loss,
        optimizers=(optimizer,),
        schedulers=(schedule,),
        grad_scaler=build_grad_scaler(config.parallel, runtime),
    )
    return Built(
        config, runtime, plan, components, assets, data, val_set, Path(config.run_dir).expanduser(), flops
    )


def run(config: HFCausalLMConfig, state: TrainState | None = None) -> TrainState:
    """Validate, build, restore (checkpoint.restore_from, unless `state` is given), train, save the
    fine-tuned model to `output_dir`; return the final state. Logs go to <run_dir>/logs/rank_<r>.log
    too, and <run_dir>/run_metadata.json records the launch. A run stopped by a preemption signal
    raises `fntrain.preemption.Preempted` (a SystemExit with checkpoint.preempt_exit_code) after its
    clean teardown, without saving the model to `output_dir`."""
    from fntrain.config_file import write_config

    config.validate()
    set_offline()
    runtime_config = dataclasses.replace(config.runtime, seed=config.seed)
    preemption = make_preemption(config.checkpoint)
    with setup_runtime(runtime_config, config.parallel) as runtime, contextlib.ExitStack() as logs:
        early = early_hooks(config, runtime)  # before the model: bad settings fail first [S9]
        # Files only once the settings checked before any model work have passed [S9].
        logs.enter_context(rank_logs(config.run_dir, runtime.rank))
        write_run_metadata(config.run_dir, runtime)
        built = build(config, runtime)
        if runtime.is_main:
            write_config(dataclasses.replace(config, runtime=runtime_config), built.run_dir)
        components = built.components
        step_fn = parallel_train_step(
            components,
            runtime,
            config.parallel,
            max_grad_norm=config.train.max_grad_norm,
            loss_weighting=config.train.loss_weighting,
        )
        hooks = build_hooks(built, early=early, preemption=preemption)
        if state is None:
            state = restore_run(config, components, runtime, built.run_dir, hooks)
        record_start(built.run_dir, runtime, state)
        final = train(
            state,
            step_fn,
            hooks,
            data=data_fn(built.data),
            plan=built.plan,
            count_batch=count_batch,
        )
        if preemption.stopped_at is None:
            save_hf_model(components.model, built.assets, output_dir(config), runtime)
        if config.checkpoint.export and preemption.stopped_at is None:
            from fntrain.checkpoint import export_safetensors

            export_safetensors(
                components.model, built.run_dir / "model.safetensors", metadata=final.as_dict()
            )
    preemption.raise_if_stopped(final)
    return final


def plan(config: HFCausalLMConfig, world_size: int = 1) -> dict[str, Any]:
    """The resolved run plan for `world_size` ranks (what `fntrain plan hf_causal_lm` prints). Reads the
    tokenizer and the data (the sample count depends on tokenization when packing), never the model's
    weights, and touches no device."""
    from fntrain.plan_report import describe_run_plan

    config.validate()
    model_parallel = config.parallel.tp_size * config.parallel.pp_size * config.parallel.cp_size
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by tp x pp x cp = {model_parallel}")
    hsdp_shape(world_size // model_parallel, config.parallel.replicate)  # HSDP replicas divide dp
    require_local_dir("model.path", config.model.path, needs=("config.json",))
    dataset, val_dataset = build_datasets(config, build_model_assets(config))
    run_plan = _make_plan(config, len(dataset), world_size // model_parallel)
    return describe_run_plan(
        run_plan,
        world_size=world_size,
        pp_size=config.parallel.pp_size,
        device_type=config.runtime.device,
        dataset_len=len(dataset),
        profiler=profiler_config(config),
        memory=memory_config(config),
        checkpoint=dataclasses.replace(
            config.checkpoint, dir=str(checkpoint_root(config.checkpoint, config.run_dir))
        ),
        extra={
            "val_samples": len(val_dataset) if val_dataset is not None else 0,
            "strategy": config.parallel.strategy,
            "packing": config.data.packing,
            "max_length": config.data.max_length,
            "run_dir": config.run_dir,
            "output_dir": str(output_dir(config)),
        },
    )


def main(argv: list[str] | None = None) -> TrainState:
    """`python -m recipes.hf_causal_lm [--config FILE] [overrides]`."""
    from fntrain.config_file import parse_config_cli
    from fntrain.logs import setup_console_logging

    setup_console_logging()  # [rank r] prefixes; other ranks: warnings and errors only
    return run(parse_config_cli(HFCausalLMConfig, argv, description=__doc__))


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(main)
