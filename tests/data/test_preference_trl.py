"""fntrain.data.preference tokenizes and batches preference rows exactly as TRL's DPOTrainer does: the same
tiny tokenizer through TRL's own `_prepare_dataset` and `DataCollatorForPreference` gives the same prompt,
chosen and rejected ids, and the same input_ids, attention_mask and labels (TRL's `completion_mask` ->
`input_ids.masked_fill(completion_mask == 0, -100)`, the labels its `_compute_loss` builds). Plain and
conversational rows, EOS already present, a prompt merging with its completion, a template that renders
the prompt differently alone, truncation, and the rows TRL drops (a prompt filling max_length)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fntrain.config import ConfigError
from fntrain.data.preference import (
    PreferenceDataConfig,
    make_preference_collate,
    preference_example,
    tokenize_pair,
)
from tests.data.test_preference import TEMPLATE, USER, tiny_tokenizer
from tests.helpers.model_assets import Assets

pytestmark = pytest.mark.slow

PLAIN = [
    {"prompt": "the sky is", "chosen": " blue", "rejected": " green"},
    {"prompt": "hello", "chosen": " there, friend", "rejected": " there</s>"},
    {"prompt": "the sk", "chosen": "y is blue", "rejected": "y is green, the sea is blue"},
    {"prompt": "", "chosen": "the sea", "rejected": "the sky"},
]
CHAT = [
    {"prompt": USER, "chosen": [{"role": "assistant", "content": "blue"}],
     "rejected": [{"role": "assistant", "content": "green, the sea is blue"}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, *USER], "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "Hello there, friend."}]},
]  # fmt: skip
# Renders the assistant turn without the newline the generation prompt has: the prompt alone is not a
# prefix of prompt + completion, and the completion starts where they diverge.
SKEWED = TEMPLATE.replace("{{ m['content'] }}</s>", "{% if m['role'] == 'assistant' %}{% else %}\n{% endif %}"
                          "{{ m['content'] }}</s>").replace("<|{{ m['role'] }}|>\n", "<|{{ m['role'] }}|>")  # fmt: skip


def trl_batch(rows, tokenizer, max_length):
    """TRL's tokenized rows and collated batch for `rows` (its own functions, no model)."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    datasets.disable_progress_bars()
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    trainer = SimpleNamespace(_tokenizer=tokenizer)  # all `_prepare_dataset` reads of the trainer
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    tokenized = DPOTrainer._prepare_dataset(
        trainer, datasets.Dataset.from_list(rows), tokenizer, args, "train"
    )
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_length)
    return list(tokenized), collator([dict(row) for row in tokenized])


def our_batches(rows, assets, max_length):
    data = PreferenceDataConfig(path="unused", max_length=max_length)
    pairs = [tokenize_pair(row, assets, data) for row in rows]
    examples = [preference_example(pair, index, max_length) for index, pair in enumerate(pairs)]
    return pairs, make_preference_collate(assets.pad_id)(examples)


@pytest.mark.parametrize("template", [TEMPLATE, SKEWED], ids=["template", "skewed_template"])
@pytest.mark.parametrize("truncate", [False, True], ids=["whole", "truncated"])
def test_rows_and_batches_match_trl(template, truncate):
    tokenizer = tiny_tokenizer(chat_template=template)
    assets = Assets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, template)
    for rows in (PLAIN, CHAT):
        max_length = 1024
        if truncate:  # room for the longest prompt and two completion tokens: most sequences are cut
            max_length = max(len(pair.prompt_ids) for pair in our_batches(rows, assets, 1024)[0]) + 2
        trl_rows, trl = trl_batch(rows, tokenizer, max_length)
        pairs, batch = our_batches(rows, assets, max_length)
        assert len(trl_rows) == len(pairs)
        for theirs, pair in zip(trl_rows, pairs, strict=True):
            assert (theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"]) == (
                list(pair.prompt_ids), list(pair.chosen_ids), list(pair.rejected_ids))  # fmt: skip
        labels = trl["input_ids"].masked_fill(trl["completion_mask"] == 0, -100)
        assert batch["input_ids"].tolist() == trl["input_ids"].tolist()
        assert batch["attention_mask"].tolist() == trl["attention_mask"].tolist()
        assert batch["labels"].tolist() == labels.tolist()
        assert truncate == any(len(pair.prompt_ids) + len(pair.rejected_ids) > max_length for pair in pairs)
    if template == SKEWED:
        assert any(pair.prompt_cut for pair in our_batches(CHAT, assets, 1024)[0])


def test_a_prompt_trl_drops_is_a_config_error():
    tokenizer = tiny_tokenizer()
    assets = Assets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, TEMPLATE)
    long = {"prompt": "the sky is blue, the sea is green", "chosen": " yes", "rejected": " no"}
    trl_rows, _ = trl_batch([PLAIN[0], long], tokenizer, 6)
    assert len(trl_rows) == 1  # TRL filters it out silently
    with pytest.raises(ConfigError, match="leaving no room for a completion"):
        tokenize_pair(long, assets, PreferenceDataConfig(path="unused", max_length=6))
