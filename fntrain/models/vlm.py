"""Hugging Face image-text-to-text models (LLaVA-style): local loading, a tiny built-in model, saving,
and answer accuracy by greedy generation.

    model_config.validate("model")                          # before any model work
    directory = resolve_model_dir(model_config, texts)      # model.path, or the tiny model's cache dir
    processor = load_processor(directory)                   # tokenizer + image processor + chat template
    model = load_vlm(directory, runtime, parallel)          # loaded and parallelized
    ...train...
    save_vlm(model, processor, output_dir, runtime)         # save_pretrained layout

The tiny model (`build_tiny_llava`) is a LLaVA built from config: a small CLIP vision tower, a linear
projector and a small Llama, with a word-level tokenizer trained on the given texts and a CLIP image
processor built from config, all written with save_pretrained. It is a pure function of its
`TinyLlavaConfig` and the texts, so every rank (and every run) builds the same one. Nothing is ever
downloaded; transformers is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from fntrain.config import ConfigError, first_line, require_choice, require_int, require_str
from fntrain.models.hf import (
    ModelAssets,
    dtype_kwargs,
    quiet_progress_bars,
    save_hf_model,
    set_offline,
    unwrap,
)
from fntrain.models.hf_config import ATTN_IMPLEMENTATIONS, DTYPES, require_model_dir, require_model_kind
from fntrain.runtime import Runtime
from fntrain.runtime.parallel import ParallelConfig

__all__ = [
    "VLMModelConfig",
    "TinyLlavaConfig",
    "CHAT_TEMPLATE",
    "build_tiny_llava",
    "resolve_model_dir",
    "load_processor",
    "load_vlm",
    "vlm_from_config",
    "save_vlm",
    "vlm_forward",
    "greedy_generate",
    "answer_accuracy",
]

log = logging.getLogger("fntrain.models.vlm")

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>", IMAGE_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values")


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class VLMModelConfig:
    """The image-text-to-text model: a local directory, or the tiny built-in LLaVA."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("path", "cache_dir")

    path: str = ""
    """Local model directory (config.json + *.safetensors + the processor files, as save_pretrained writes them). Empty: the tiny built-in LLaVA, built on first use under cache_dir."""
    cache_dir: str = "~/.cache/fntrain/tiny_llava"
    """Where the tiny built-in LLaVA is written on first use (used when path is empty)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Dtype of the loaded weights (auto: the checkpoint's)."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel transformers uses."""

    def validate(self, prefix: str = "model") -> None:
        """Value rules naming `prefix.field`; a given path must hold config.json and safetensors."""
        require_str(f"{prefix}.path", self.path)
        require_str(f"{prefix}.cache_dir", self.cache_dir, non_empty=True)
        require_choice(f"{prefix}.dtype", self.dtype, (*DTYPES, "auto"))
        require_choice(f"{prefix}.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        if self.path:
            require_model_dir(f"{prefix}.path", self.path)
            require_model_kind(f"{prefix}.path", self.path, "vlm")


@dataclass(frozen=True)
class TinyLlavaConfig:
    """The shape of the tiny built-in LLaVA."""

    image_size: int = 32
    patch_size: int = 4
    vision_width: int = 64
    vision_layers: int = 2
    text_width: int = 64
    text_layers: int = 2
    heads: int = 4
    max_positions: int = 256
    seed: int = 0

    def validate(self, prefix: str = "tiny") -> None:
        for name, value in asdict(self).items():
            require_int(f"{prefix}.{name}", value, min=0 if name == "seed" else 1)
        if self.image_size % self.patch_size:
            raise ValueError(f"{prefix}.image_size must be a multiple of {prefix}.patch_size")


# ----------------------------------------------------------------------------- the tiny model


def _train_tokenizer(texts: Sequence[str]) -> Any:
    """A word-level tokenizer trained on the words of `texts` (sorted, so the ids do not depend on
    their order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel(unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1)
    word_level.train_from_iterator(sorted(set(texts)), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", extra_special_tokens={"image_token": IMAGE_TOKEN},
    )  # fmt: skip


def build_tiny_llava(directory: str | os.PathLike, texts: Sequence[str], tiny: TinyLlavaConfig) -> Path:
    """Write a tiny LLaVA (model, tokenizer trained on `texts`, image processor, chat template) to
    `directory` with save_pretrained; a pure function of its arguments. Returns the directory."""
    set_offline()
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tiny.validate()
    directory = Path(directory)
    tokenizer = _train_tokenizer(texts)
    side = tiny.image_size
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=tiny.patch_size,
        vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE, num_additional_image_tokens=1,
    )  # fmt: skip
    image_tokens = (side // tiny.patch_size) ** 2
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=tiny.vision_width, intermediate_size=2 * tiny.vision_width,
            num_hidden_layers=tiny.vision_layers, num_attention_heads=tiny.heads, image_size=side,
            patch_size=tiny.patch_size, projection_dim=tiny.vision_width,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=tiny.text_width, intermediate_size=2 * tiny.text_width,
            num_hidden_layers=tiny.text_layers, num_attention_heads=tiny.heads,
            num_key_value_heads=tiny.heads, max_position_embeddings=tiny.max_positions,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-1,
        vision_feature_select_strategy="default", image_seq_length=image_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with quiet_progress_bars():  # no "Writing model shards" in a log
        model.save_pretrained(str(directory))
    processor.save_pretrained(str(directory))
    return directory


def _fingerprint(texts: Sequence[str], tiny: TinyLlavaConfig) -> str:
    text = json.dumps({"texts": sorted(set(texts)), "tiny": asdict(tiny), "template": CHAT_TEMPLATE})
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def resolve_model_dir(
    config: VLMModelConfig, texts: Sequence[str] = (), tiny: TinyLlavaConfig | None = None
) -> Path:
    """`config.path`, or the tiny built-in LLaVA under `config.cache_dir` (one subdirectory per
    vocabulary and shape), built on first use. Safe when several ranks or runs race: each builds in a
    private directory and renames it into place; the builds are identical."""
    if config.path:
        return require_model_dir("model.path", config.path)
    tiny = tiny or TinyLlavaConfig()
    target = Path(config.cache_dir).expanduser() / _fingerprint(texts, tiny)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build_tiny_llava(scratch, texts, tiny)
        try:
            os.rename(scratch, target)
            log.info("built the tiny LLaVA in %s", target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


# ----------------------------------------------------------------------------- loading and saving


def load_processor(directory: str | os.PathLike) -> Any:
    """The model's own processor (tokenizer, image processor, chat template) from a local directory."""
    set_offline()
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:  # transformers' ways of saying "cannot load"
        processor, reason = None, f" ({first_line(error)})"
    else:
        reason = ""
    if getattr(processor, "image_processor", None) is None:  # AutoProcessor falls back to a bare tokenizer
        raise ConfigError(
            f"model.path {str(directory)!r} holds no processor with an image processor{reason}: save the "
            "model's processor there with processor.save_pretrained"
        )
    return processor


def vlm_from_config(directory: str | os.PathLike, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The bare model from its config.json (no weights): for counting FLOPs on the meta device."""
    set_offline()
    from transformers import AutoConfig, AutoModelForImageTextToText

    hf_config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    return AutoModelForImageTextToText.from_config(hf_config, attn_implementation=attn_implementation)


def load_vlm(
    directory: str | os.PathLike, runtime: Runtime, parallel: ParallelConfig, *, dtype: str = "float32",
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:  # fmt: skip
    """The model of a local directory (`AutoModelForImageTextToText`), on `runtime.device` and
    parallelized (vision and language blocks sharded one by one under fsdp2)."""
    set_offline()
    from transformers import AutoModelForImageTextToText

    from fntrain.runtime.parallel import parallelize

    with quiet_progress_bars():
        model = AutoModelForImageTextToText.from_pretrained(
            str(directory), local_files_only=True, use_safetensors=True,
            attn_implementation=attn_implementation, **dtype_kwargs("auto" if dtype == "auto" else DTYPES[dtype]),
        )  # fmt: skip
    # from_pretrained returns the model in eval mode; it trains in train mode, as transformers' Trainer runs it.
    return parallelize(model.to(runtime.device), runtime, parallel).train()


def save_vlm(model: torch.nn.Module, processor: Any, output_dir: str | Path, runtime: Runtime) -> Path:
    """The model and its processor in save_pretrained layout (every rank must call it)."""
    tokenizer = processor.tokenizer
    assets = ModelAssets(processor, tokenizer.pad_token_id or 0, tokenizer.eos_token_id, None)
    return save_hf_model(model, assets, output_dir, runtime)


# ----------------------------------------------------------------------------- forward and accuracy


@contextlib.contextmanager
def _no_data_checks_on_meta() -> Iterator[None]:
    """Skip torch's data-dependent checks of meta tensors (they have no data to check): transformers
    checks that the image tokens match the image features with one, which a meta forward (counting
    FLOPs) cannot evaluate. Checks of real tensors still run."""
    original = torch._check_tensor_all_with

    def check(error_type: Any, cond: torch.Tensor, message: Any = None) -> None:
        if cond.device.type != "meta":
            original(error_type, cond, message)

    torch._check_tensor_all_with = check
    try:
        yield
    finally:
        torch._check_tensor_all_with = original


def vlm_forward(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> Any:
    """Call the model with the micro-batch's text and image inputs (pixel_values included). On the
    meta device (counting FLOPs) the data checks meta tensors cannot take are skipped, and so is the
    padding mask, which transformers inspects by value and which changes no FLOP count."""
    inputs = {key: micro_batch[key] for key in _MODEL_INPUTS if key in micro_batch}
    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.device.type == "meta":
        inputs.pop("attention_mask", None)
        with _no_data_checks_on_meta():
            return model(**inputs)
    return model(**inputs)


def _left_pad(prompts: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(p["input_ids"]) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        n = len(prompt["input_ids"])
        ids[row, length - n :] = torch.as_tensor(prompt["input_ids"])
        mask[row, length - n :] = 1
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.cat([p["pixel_values"] for p in prompts])}


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, prompts: Sequence[Mapping[str, Any]], *, pad_id: int, max_new_tokens: int,
    device: torch.device | str = "cpu",
) -> list[list[int]]:  # fmt: skip
    """Greedy continuations of `prompts` (each {"input_ids", "pixel_values"}), exactly `max_new_tokens`
    forwards without a cache, whatever is generated: ranks stay in step under FSDP2."""
    batch = {k: v.to(device) for k, v in _left_pad(prompts, pad_id).items()}
    generated = []
    for _ in range(max_new_tokens):
        position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = vlm_forward(model, {**batch, "position_ids": position_ids}).logits
        next_ids = logits[:, -1].argmax(-1)
        generated.append(next_ids)
        batch["input_ids"] = torch.cat([batch["input_ids"], next_ids[:, None]], dim=1)
        batch["attention_mask"] = torch.cat([batch["attention_mask"], torch.ones_like(next_ids)[:, None]], 1)
    return torch.stack(generated, dim=1).tolist() if generated else [[] for _ in prompts]


def _first_word(text: str) -> str:
    words = text.strip().lower().replace(".", " ").split()
    return words[0] if words else ""


def answer_accuracy(
    model: torch.nn.Module, processor: Any, prompts: Any, *, batch_size: int = 16, max_new_tokens: int = 2,
    runtime: Runtime | None = None, group: Any = None,
) -> float:  # fmt: skip
    """Share of `prompts` (a sequence of {"input_ids", "pixel_values", "answer"}) whose greedy answer's
    first word is the reference's, on `runtime.device`, sharded over its `dp_size` data-parallel ranks
    whose counts are summed over `group` (every rank runs the same number of batches and returns the same
    number). No runtime: one process on the CPU."""
    import math

    import torch.distributed as dist

    runtime = runtime or Runtime()
    device, rank, world_size = runtime.device, runtime.dp_rank, runtime.dp_size
    length = len(prompts)
    mine = list(range(rank, length, world_size))
    batches = math.ceil(math.ceil(length / world_size) / batch_size)
    tokenizer = processor.tokenizer
    inner = unwrap(model)
    was_training = inner.training
    inner.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for index in range(batches):
            chunk = mine[index * batch_size : (index + 1) * batch_size]
            samples = [prompts[i] for i in (chunk or [0])]
            outputs = greedy_generate(
                inner, samples, pad_id=tokenizer.pad_token_id or 0, max_new_tokens=max_new_tokens, device=device
            )
            if not chunk:
                continue  # a filler batch: keeps the ranks' collectives in step
            for sample, output in zip(samples, outputs, strict=True):
                said = _first_word(tokenizer.decode(output, skip_special_tokens=True))
                counts[0] += float(said == _first_word(sample["answer"]))
                counts[1] += 1
    finally:
        inner.train(was_training)
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    return float(counts[0] / counts[1].clamp(min=1))
