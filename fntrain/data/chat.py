"""Chat templates and prompt masking: which characters of a rendered example are trained on, and the
token ids and labels that follow from them.

`chat_spans` renders a conversation with the tokenizer's chat template and finds its assistant turns;
`tokenize_spans` tokenizes a text and keeps a label only on tokens that start inside the trained spans
(IGNORE_INDEX elsewhere). The supervised (`fntrain.data.sft`) and vision-language (`fntrain.data.vlm`)
transforms share them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fntrain.config import ConfigError, first_line
from fntrain.data.tokens import IGNORE_INDEX

__all__ = ["chat_spans", "tokenize_spans"]


def _inside(position: int, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether character `position` falls inside one of the half-open `spans`."""
    return any(start <= position < stop for start, stop in spans)


def tokenize_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], *, add_special_tokens: bool,
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
    # A slow tokenizer has no offsets: tokenize the pieces between span borders one after another, without
    # special tokens, and put the ones the tokenizer adds to the whole text (a BOS before, an EOS after)
    # around them, labelled as the fast path labels them (their offsets are (0, 0)).
    ids, labels, position = [], [], 0
    borders = sorted({0, len(text), *(p for span in spans for p in span)})
    for begin, end in zip(borders, borders[1:], strict=False):
        piece = list(tokenizer(text[begin:end], add_special_tokens=False)["input_ids"])
        ids.extend(piece)
        labels.extend(piece if _inside(begin, spans) else [IGNORE_INDEX] * len(piece))
        position = end
    assert position == len(text)
    if not add_special_tokens:
        return ids, labels
    before, after = _added_special_tokens(tokenizer, text)
    special = (lambda tokens: tokens) if _inside(0, spans) else (lambda tokens: [IGNORE_INDEX] * len(tokens))
    return before + ids + after, special(before) + labels + special(after)


def _added_special_tokens(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after `text`'s own when it adds special tokens (e.g. [BOS], []
    or [], [EOS]); all before when they do not surround the text's ids."""
    whole = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    bare = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for start in range(len(whole) - len(bare) + 1):
        if whole[start : start + len(bare)] == bare:
            return whole[:start], whole[start + len(bare) :]
    return whole[: len(whole) - len(bare)], []


def chat_spans(
    tokenizer: Any, chat_template: str | None, messages: list[Any], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered with `tokenizer.apply_chat_template` (`chat_template`: the template it
    holds; None or empty is an error naming `where`) and the character spans of its assistant turns.

    A turn's span runs from the end of the conversation rendered up to it with the generation prompt to
    the end of the conversation rendered through it, so the template's own turn markers around the
    reply (the end-of-turn token included) are trained on, as the model must learn to emit them.
    """
    if not chat_template:
        raise ConfigError(
            f"{where}: chat examples need a chat template: the tokenizer has none; set assets.chat_template"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ConfigError(f"{where}: message {index} must be an object with 'role' and 'content'")

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages[:upto], tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as error:  # noqa: BLE001 - a user's template raising (jinja2's raise_exception) is a data error
            raise ConfigError(
                f"{where}: the chat template fails on this conversation ({first_line(error)})"
            ) from None

    text = render(len(messages), False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(index, True), render(index + 1, False)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ConfigError(
                f"{where}: the chat template does not render conversation prefixes as prefixes of the "
                "whole conversation, so prompt tokens cannot be told apart; use data.train_on_prompt"
            )
        spans.append((len(before), len(through)))
    return text, spans
