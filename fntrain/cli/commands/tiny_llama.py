"""`fntrain tiny-llama DIR [options]`: make a small local Hugging Face model to try the HF recipes with
(`hf_causal_lm`, LoRA, `generate`, `tokenize --tokenizer`), nothing downloaded: a randomly initialised
tiny Llama and a byte-level BPE tokenizer trained on the bundled Shakespeare corpus, with a chat template,
in `save_pretrained` layout (`fntrain.models.tiny_llama`). Seeded: the same options write the same files.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fntrain.cli.errors import CommandError
from fntrain.cli.parse import parse
from fntrain.config import first_line

__all__ = ["command"]

MISSING_HINT = "needs transformers and tokenizers (the hf extra): pip install 'fntrain[hf]'"


def command(args: list[str]) -> Any:
    """`fntrain tiny-llama`: the written directory; bad options, an occupied DIR or a missing `hf` extra
    are a `CommandError` (one line, exit status 2) before anything is written."""
    import tyro

    from fntrain.models.tiny_llama import TinyLlamaConfig, write_tiny_llama

    command_cls = dataclasses.make_dataclass(
        "TinyLlama",
        [
            ("dir", Annotated[str, tyro.conf.Positional, tyro.conf.arg(
                metavar="DIR", help="the directory to write (new, or empty)")]),
            ("shape", Annotated[TinyLlamaConfig, tyro.conf.arg(name="")],
             dataclasses.field(default=TinyLlamaConfig())),
        ],
        frozen=True,
    )  # fmt: skip
    summary = (__doc__ or "").split("\n\n")[0].split(": ", 1)[-1]
    parsed = parse(command_cls, args, prog="fntrain tiny-llama", description=summary)
    try:
        parsed.shape.validate("--")
    except (ValueError, TypeError) as error:
        raise CommandError(first_line(error).replace("_", "-")) from None
    _require_hf_extra()
    try:
        path = write_tiny_llama(parsed.dir, parsed.shape)
    except OSError as error:  # an occupied DIR, a file where it should be, a read-only parent
        raise CommandError(first_line(error)) from None
    print(f"{path}: a tiny Llama ({parsed.shape.layers} layers, width {parsed.shape.hidden_size}) and its "
          f"tokenizer; try it: fntrain generate {parsed.dir} --prompt 'ROMEO:'")  # fmt: skip
    return path


def _require_hf_extra() -> None:
    """transformers and tokenizers importable, else the one line that says which extra installs them."""
    import importlib.util

    if any(importlib.util.find_spec(name) is None for name in ("transformers", "tokenizers")):
        raise CommandError(MISSING_HINT)
