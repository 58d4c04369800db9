"""Pins of fntrain/data/chat.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import pytest

from fntrain.config import ConfigError
from fntrain.data.chat import chat_spans, tokenize_spans
from fntrain.data.tokens import IGNORE_INDEX
from tests.data.test_sft import CharTokenizer

BOS, EOS = CharTokenizer.bos_token_id, CharTokenizer.eos_token_id


def char(text: str) -> list[int]:
    return [ord(c) + 10 for c in text]


def test_train_all_without_special_tokens_adds_none():
    ids, labels = tokenize_spans(CharTokenizer(), "To be.", [], add_special_tokens=False, train_all=True)
    assert ids == labels == char("To be.")


@pytest.mark.parametrize("spans", [[(0, 1)], [(0, 3)], [(2, 4)], [(0, 2), (4, 6)]])
def test_a_slow_tokenizer_labels_as_a_fast_one_with_a_span_from_the_first_character(spans):
    """The BOS a tokenizer adds is trained on exactly when a span starts at the text's first character
    (its offsets are (0, 0)), slow or fast."""
    text = "To be."
    fast = tokenize_spans(CharTokenizer(is_fast=True), text, spans, add_special_tokens=True, train_all=False)
    slow = tokenize_spans(CharTokenizer(is_fast=False), text, spans, add_special_tokens=True, train_all=False)
    assert slow == fast
    assert fast[0][0] == BOS and (fast[1][0] == BOS) == (spans[0][0] == 0)


def test_an_empty_text_through_a_slow_tokenizer_is_its_special_tokens_alone():
    assert tokenize_spans(CharTokenizer(is_fast=False), "", [], add_special_tokens=True, train_all=False) == (
        [BOS],
        [IGNORE_INDEX],
    )


class MergingFastTokenizer(CharTokenizer):
    """A fast tokenizer that merges "ab" into one token (id 5), wherever a prompt border falls."""

    def _encode(self, text):
        ids, offsets = super()._encode(text)
        out_ids, out_offsets, i = [], [], 0
        while i < len(ids):
            if ids[i : i + 2] == char("ab"):
                out_ids.append(5)
                out_offsets.append((offsets[i][0], offsets[i + 1][1]))
                i += 2
            else:
                out_ids.append(ids[i])
                out_offsets.append(offsets[i])
                i += 1
        return out_ids, out_offsets


def test_a_fast_tokenizer_keeps_its_own_tokens_across_a_prompt_border():
    """A fast tokenizer is read through its offsets: the ids are the whole text's, a token merging across
    the border is kept whole and labelled by where it starts."""
    tokenizer = MergingFastTokenizer()
    ids, labels = tokenize_spans(tokenizer, "xab", [(2, 3)], add_special_tokens=False, train_all=False)
    assert ids == [*char("x"), 5] and labels == [IGNORE_INDEX, IGNORE_INDEX]
    ids, labels = tokenize_spans(tokenizer, "xab", [(1, 3)], add_special_tokens=False, train_all=False)
    assert ids == [*char("x"), 5] and labels == [IGNORE_INDEX, 5]


class NoOffsetsTokenizer(CharTokenizer):
    """A tokenizer that says nothing of being fast (no `is_fast`) and has no offsets."""

    def __getattribute__(self, name):
        if name == "is_fast":
            raise AttributeError(name)
        return super().__getattribute__(name)

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        assert not return_offsets_mapping, "no offsets"
        return super().__call__(text, add_special_tokens)


def test_a_tokenizer_that_does_not_say_it_is_fast_is_read_without_offsets():
    ids, labels = tokenize_spans(
        NoOffsetsTokenizer(), "Q?A", [(2, 3)], add_special_tokens=True, train_all=False
    )
    assert ids == [BOS, *char("Q?A")] and labels == [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, *char("A")]


class PrefixingSlowTokenizer(CharTokenizer):
    """A slow tokenizer whose special tokens change the text's own first id (a prefix-space marker
    merged into it), so they do not surround the bare ids."""

    def __init__(self):
        super().__init__(is_fast=False)

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids = char(text)
        return {"input_ids": [BOS, 7, *ids[1:]] if add_special_tokens and ids else ids}


def test_special_tokens_that_do_not_surround_the_text_go_before_it():
    ids, labels = tokenize_spans(
        PrefixingSlowTokenizer(), "Q?A", [(2, 3)], add_special_tokens=True, train_all=False
    )
    assert ids == [BOS, *char("Q?A")] and labels == [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, *char("A")]


@pytest.mark.parametrize("message", [{"role": "user"}, {"content": "hi"}, "hi"])
def test_a_message_without_a_role_or_content_is_refused_naming_it(message):
    messages = [{"role": "user", "content": "Who?"}, message]
    with pytest.raises(ConfigError) as error:
        chat_spans(CharTokenizer(), CharTokenizer().chat_template, messages, "data.path 'chat.jsonl' line 3")
    assert (
        str(error.value)
        == "data.path 'chat.jsonl' line 3: message 1 must be an object with 'role' and 'content'"
    )


class TokenizingByDefault(CharTokenizer):
    """apply_chat_template as transformers' tokenizers define it: token ids unless told tokenize=False."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        text = super().apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self(text)["input_ids"] if tokenize else text


def test_the_conversation_is_rendered_as_text_whatever_the_tokenizers_default():
    text, spans = chat_spans(TokenizingByDefault(), CharTokenizer().chat_template, CHAT, "row 1")
    assert text == "<s><|user|>\nWho?</s>\n<|assistant|>\nMe.</s>\n"
    assert [text[start:stop] for start, stop in spans] == ["Me.</s>\n"]


CHAT = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Me."}]


def test_a_template_that_fails_is_one_line_naming_the_row_and_the_templates_error():
    """As a template's raise_exception("...") fails: a ValueError, here of two lines."""

    class Failing(CharTokenizer):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            raise ValueError("roles must alternate\nsecond line")

    with pytest.raises(ConfigError) as error:
        chat_spans(Failing(), "a template", CHAT, "data.path 'chat.jsonl' line 2")
    assert str(error.value) == (
        "data.path 'chat.jsonl' line 2: the chat template fails on this conversation (roles must alternate)"
    )


def test_an_empty_assistant_turn_is_an_empty_span_not_a_refusal():
    """A template that writes each message's content alone (no turn markers, no generation prompt): an
    empty reply adds nothing, so its span is empty."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": ""}]
    assert chat_spans(CharTokenizer(chat_template=template), template, messages, "row 1") == (
        "Who?",
        [(4, 4)],
    )


def test_a_template_that_renders_prefixes_otherwise_is_refused_pointing_at_train_on_prompt():
    template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError) as error:
        chat_spans(CharTokenizer(chat_template=template), template, CHAT, "row 1")
    assert str(error.value) == (
        "row 1: the chat template does not render conversation prefixes as prefixes of the whole "
        "conversation, so prompt tokens cannot be told apart; use data.train_on_prompt"
    )
