"""`fntrain generate`'s options and its loop: samples of a loaded model, streamed to stdout as they come.

    options = GenerateOptions(prompt=("ROMEO:",), max_new_tokens=200, seed=1)
    options.validate()                                           # before anything is read
    samples = generate(model, assets, options)                   # prints, and returns the Sample records

`--num-samples N` draws N samples per prompt with seeds seed, seed+1, ...; each sample is printed after
a header line (`--- sample 2/3 (seed 1235) ---`, with the prompt's number when there are several), then
the prompt and the continuation as it is produced. Every model, the tiny GPT and transformers ones alike,
is sampled by fntrain's sampler (`fntrain.sampling.decode`, over the model's KV cache), the one the GRPO
rollout uses: each sample draws from its own generator seeded by --seed + its number, so the same seed
gives the same text, independent of transformers' and torch's global random state (transformers' own
`generate` is not called; at temperature 0 the tokens are its greedy ones). Unless told otherwise it
draws as the samples during training do (`fntrain.sampling.TEXT_DEFAULTS`: temperature 0.8, no top-k or
top-p cut), so a checkpoint's first sample for a prompt and seed is the text the run logged for that
prompt and `--sample.seed` at the checkpoint's step (up to the shorter one's length). A sample stops at
the EOS id: a transformers model's generation_config ones (it may name several), else the tokenizer's (a
byte-level model's: its config's). Text streams as it completes; byte-level models (UTF-8 bytes as ids) print each character once its bytes are complete,
undecodable bytes as U+FFFD.

A prompt longer than the model's context loses its first tokens (one warning line on stderr): a
transformers model keeps room for max_new_tokens within its positions, the tiny GPT slides its window.
"""

from __future__ import annotations

import codecs
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch

from fntrain.config import require_float, require_int, require_str
from fntrain.models.load import TextAssets
from fntrain.sampling import TEXT_DEFAULTS, SampleSettings, decode, model_context, sample_tokens

__all__ = ["GenerateOptions", "Sample", "generate", "read_prompts", "text_sampler", "ByteStreamer", "TokenStreamer",
           "DEFAULT_PROMPT"]

log = logging.getLogger("fntrain.generate")

DEFAULT_PROMPT = "\n"  # nanoGPT's sample.py starts from a newline too


@dataclass(frozen=True)
class GenerateOptions:
    """What to sample and how."""

    prompt: tuple[str, ...] = ()
    """Text to continue; repeat the flag for several prompts (none and no --prompt-file: a newline)."""
    prompt_file: str | None = None
    """A UTF-8 text file whose whole text is one more prompt (after the --prompt ones)."""
    max_new_tokens: int = 256
    """Tokens to generate per sample at most (fewer when the model writes its EOS)."""
    temperature: float = TEXT_DEFAULTS.temperature
    """Softmax temperature (0: greedy, the most likely token every step); the samples during training's default too."""
    top_k: int | None = TEXT_DEFAULTS.top_k
    """Draw only among the k most likely tokens (None or 0: no cut)."""
    top_p: float = TEXT_DEFAULTS.top_p
    """Nucleus sampling: draw among the most likely tokens holding this much probability, in (0, 1]."""
    num_samples: int = 1
    """Samples per prompt, with seeds seed, seed+1, ..."""
    seed: int = 1234
    """Seed of the first sample: the same seed gives the same text (on the same device), the samples during training's with that --sample.seed too."""
    image: str | None = None
    """An image for a vision-language model (the vlm recipe's, or an HF one), read with Pillow."""
    device: str = "auto"
    """cpu, cuda, cuda:N, npu (auto: cuda when a GPU is visible, else cpu)."""
    recipe: str | None = None
    """The recipe that rebuilds the model of a checkpoint or model.safetensors (None: the one the run recorded)."""

    def validate(self) -> None:
        """Value rules, naming the flags; the files named must exist."""
        require_int("--max-new-tokens", self.max_new_tokens, min=1)
        require_float("--temperature", self.temperature, min=0.0)
        if self.top_k is not None:
            require_int("--top-k", self.top_k, min=0)
        require_float("--top-p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        require_int("--num-samples", self.num_samples, min=1)
        require_int("--seed", self.seed, min=0)
        for flag, path in (("--prompt-file", self.prompt_file), ("--image", self.image)):
            require_str(flag, path, optional=True, non_empty=True)
            if path is not None and not Path(path).expanduser().is_file():
                raise FileNotFoundError(f"{flag} {path!r} does not exist" if not Path(path).expanduser().exists()
                                        else f"{flag} {path!r} is not a file")  # fmt: skip
        require_str("--recipe", self.recipe, optional=True, non_empty=True)

    def settings(self, eos_id: int | tuple[int, ...] | None) -> SampleSettings:
        return SampleSettings(self.max_new_tokens, self.temperature, self.top_k, self.top_p, eos_id)


@dataclass(frozen=True)
class Sample:
    """One sample: which prompt (0-based), its seed, the prompt and the new tokens and their text."""

    prompt_index: int
    seed: int
    prompt: str
    token_ids: tuple[int, ...]
    text: str


def read_prompts(options: GenerateOptions) -> list[str]:
    """The --prompt texts, then the --prompt-file's whole text; a newline when there is none. A prompt
    file that is not UTF-8 text is a `ValueError` naming it."""
    prompts = list(options.prompt)
    if options.prompt_file is not None:
        try:
            prompts.append(Path(options.prompt_file).expanduser().read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"--prompt-file {options.prompt_file!r} is not UTF-8 text") from None
    return prompts or [DEFAULT_PROMPT]


class ByteStreamer:
    """Prints byte ids (0..255) as UTF-8 text as each character completes; ids beyond a byte (an EOS)
    print nothing. `put` takes ids (a list or a tensor); with `skip_first` its first `put` (a prompt) is
    skipped."""

    def __init__(self, out: TextIO, skip_first: bool = False):
        self.out, self.skip = out, skip_first
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def put(self, value: Any) -> None:
        if self.skip:
            self.skip = False
            return
        ids = value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else list(value)
        self.out.write(self.decoder.decode(bytes(i for i in ids if 0 <= i < 256)))
        self.out.flush()

    def end(self) -> None:
        self.out.write(self.decoder.decode(b"", final=True) + "\n")
        self.out.flush()


def _decode(assets: TextAssets, ids: list[int]) -> str:
    if assets.tokenizer is None:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
    return assets.tokenizer.decode(ids, skip_special_tokens=True)


def _encode(assets: TextAssets, prompt: str, image: Any) -> dict[str, torch.Tensor]:
    """The model inputs of one prompt ({"input_ids": [1, n], ...}; a VLM's pixel_values too)."""
    if assets.processor is not None:
        from fntrain.data.vlm import VLMDataConfig, vlm_prompt

        record = {"prompt": prompt, "completion": " ", **({"image": image} if image is not None else {})}
        encoded = vlm_prompt(record, assets.processor, VLMDataConfig(), where="--prompt")
        inputs = {"input_ids": encoded["input_ids"][None]}
        if "pixel_values" in encoded:
            inputs["pixel_values"] = encoded["pixel_values"]
        return inputs
    if assets.tokenizer is None:
        ids = list(prompt.encode("utf-8"))
    else:
        ids = assets.tokenizer(prompt, return_tensors="pt")["input_ids"][0].tolist()
    if not ids:
        raise ValueError("--prompt '' has no tokens: give some text (or leave --prompt out)")
    return {"input_ids": torch.tensor([ids], dtype=torch.long)}


def _fit(inputs: dict[str, torch.Tensor], keep: int | None, number: int) -> dict[str, torch.Tensor]:
    """The prompt cut to its last `keep` tokens (a warning says so); unchanged when it fits."""
    length = inputs["input_ids"].shape[1]
    if keep is None or length <= keep or "pixel_values" in inputs:  # cutting could cut image tokens
        return inputs
    log.warning("prompt %d is %d tokens, more than the %d the model's context leaves it: its first %d are "
                "dropped", number, length, keep, length - keep)  # fmt: skip
    return {**inputs, "input_ids": inputs["input_ids"][:, -keep:]}


class TokenStreamer:
    """Prints token ids as text as it completes, with the tokenizer: the ids of the current line are
    decoded and what is new is written, held back while it ends in an incomplete character (U+FFFD), as
    transformers' TextStreamer does; a written newline starts a new line (decoding stays linear)."""

    def __init__(self, tokenizer: Any, out: TextIO):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0

    def put(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._write(text)

    def end(self) -> None:
        self._write(self.tokenizer.decode(self.ids, skip_special_tokens=True) + "\n")

    def _write(self, text: str) -> None:
        self.out.write(text[self.printed :])
        self.out.flush()
        self.ids, self.printed = ([], 0) if text.endswith("\n") else (self.ids, len(text))


def _eos(model: Any, assets: TextAssets) -> int | tuple[int, ...] | None:
    """The ids that end a sample: a transformers model's generation_config.eos_token_id (one or several)
    when it names one, else the tokenizer's (assets.eos_id)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        return configured
    if isinstance(configured, (list, tuple)) and configured:
        return tuple(int(token) for token in configured)
    return assets.eos_id


def _sample(model: Any, inputs: dict, assets: TextAssets, options: GenerateOptions, seed: int,
            out: TextIO) -> list[int]:  # fmt: skip
    """One sample: `decode` of the prompt's one row, drawing from a generator seeded by `seed`, its
    tokens streamed to `out` as they come (a VLM's pixel_values go into the first forward)."""
    device = next(model.parameters()).device
    streamer: Any = ByteStreamer(out) if assets.tokenizer is None else TokenStreamer(assets.tokenizer, out)
    extra = {key: value.to(device) for key, value in inputs.items() if key != "input_ids"}

    def stream(step: list[int | None]) -> None:
        if step[0] is not None:
            streamer.put([step[0]])

    decoded = decode(model, [inputs["input_ids"][0].tolist()], options.settings(_eos(model, assets)),
                     [torch.Generator().manual_seed(seed)], device=device, on_tokens=stream,
                     prefill_inputs=extra or None)  # fmt: skip
    streamer.end()
    return decoded.tokens[0]


def _room(model: Any, options: GenerateOptions, hf: bool) -> int | None:
    """How many prompt tokens fit: the context (less max_new_tokens for a transformers model, whose
    positions end there); None: no limit known."""
    context = model_context(model)
    if context is None or not hf:
        return context
    if options.max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {options.max_new_tokens}: the model's context is {context} tokens; "
                         f"ask for fewer than {context}")  # fmt: skip
    return context - options.max_new_tokens


def generate(
    model: Any, assets: TextAssets, options: GenerateOptions, out: TextIO | None = None
) -> list[Sample]:
    """Every prompt's `options.num_samples` samples from `model` (eval mode, on its device), printed to
    `out` (stdout) as they come; returns them in order."""
    out = out if out is not None else sys.stdout
    hf = hasattr(model, "generate") and hasattr(model, "generation_config")
    prompts = read_prompts(options)
    room = _room(model, options, hf)
    image = None
    if options.image is not None:
        from PIL import Image

        with Image.open(Path(options.image).expanduser()) as opened:
            image = opened.convert("RGB")
    encoded = [_fit(_encode(assets, prompt, image), room, n + 1) for n, prompt in enumerate(prompts)]
    samples = []
    for index, (prompt, inputs) in enumerate(zip(prompts, encoded, strict=True)):
        for number in range(options.num_samples):
            seed = options.seed + number
            if len(prompts) > 1 or options.num_samples > 1:
                where = f"prompt {index + 1}/{len(prompts)}, " if len(prompts) > 1 else ""
                out.write(f"--- {where}sample {number + 1}/{options.num_samples} (seed {seed}) ---\n")
            out.write(prompt)
            out.flush()
            ids = _sample(model, inputs, assets, options, seed, out)
            samples.append(Sample(index, seed, prompt, tuple(ids), _decode(assets, ids)))
    return samples


def text_sampler(model: Any, tokenizer: Any, eos_id: int | None) -> Any:
    """The samples hook's sampler for a transformers text model being trained (`--sample.*` of the
    recipes built on one): `sampler(prompt, settings, generator) -> text`, the prompt encoded, the
    sample ended and the text decoded as `fntrain generate` does (the model's generation_config end ids,
    else `eos_id`), so the text a run logs at step N is what `fntrain generate` prints from step N's
    checkpoint with the same seed and settings. Every rank calls it under fsdp2 (each forward gathers
    the shards), with the same generator: the same tokens on every rank."""
    assets = TextAssets(tokenizer=tokenizer, eos_id=eos_id)
    end = _eos(model, assets)

    def sample(prompt: str, settings: SampleSettings, generator: torch.Generator) -> str:
        ids = _encode(assets, prompt, None)["input_ids"][0].to(next(model.parameters()).device)
        return _decode(assets, list(sample_tokens(model, ids, replace(settings, eos_id=end), generator)))

    return sample
