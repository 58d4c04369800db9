"""`fntrain tokenize INPUT... --output DIR [options]`: text/JSONL/Parquet/Arrow -> token shards
(`fntrain.data.tokenize`)."""

from __future__ import annotations

from typing import Any

from fntrain.cli.errors import CommandError
from fntrain.cli.parse import parse

__all__ = ["command"]


def command(args: list[str]) -> Any:
    """`fntrain tokenize`: the shard index written, summarised in one line."""
    from fntrain.data.tokenize_cli import tokenize_command

    try:
        index = parse(tokenize_command, args, prog="fntrain tokenize")
    except (ValueError, OSError) as error:  # bad inputs, an occupied output: no traceback
        raise CommandError(str(error)) from error
    print(
        f"{index.directory}: {index.total_tokens} tokens, {index.documents} documents, "
        f"{len(index.shards)} shard(s) of {index.dtype} (eos {index.eos_id}, tokenizer {index.tokenizer})"
    )
    return index
