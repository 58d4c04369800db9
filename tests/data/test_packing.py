"""Packing with document masks: a packed sequence gives each document exactly the logits it gets when run
alone, and no loss token crosses a document boundary (issue 12, item 5)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fntrain.data.packing import (
    PADDING_DOCUMENT,
    PackedDocuments,
    PackedWindows,
    document_block_mask,
    document_causal_mask,
    document_ids_from_eos,
    flex_attention_available,
    pack_documents,
    pack_sequence,
    packed_collate,
    position_ids_from_documents,
)
from fntrain.data.pipeline import batches, build_data
from fntrain.data.settings import Batching
from fntrain.data.shards import TokenDocuments, TokenWindows, open_shards
from fntrain.data.tokenize import TokenizeSettings, tokenize_documents
from fntrain.data.tokens import IGNORE_INDEX, count_loss_tokens, loss_targets
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.step import causal_lm_loss, default_forward

EOS = 0
VOCAB = 50


def random_documents(count: int, *, seed: int, longest: int = 14) -> list[list[int]]:
    """Documents ending with EOS (ids 1..VOCAB-1 inside)."""
    rng = np.random.default_rng(seed)
    return [[*rng.integers(1, VOCAB, size=int(rng.integers(1, longest))).tolist(), EOS] for _ in range(count)]


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(ModelConfig(context=32, n_layer=2, n_head=2, d_model=32, vocab_size=VOCAB)).eval()


def alone(model: TinyGPT, tokens: list[int]) -> torch.Tensor:
    """Logits of one document run by itself: positions 0.., plain causal attention."""
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0]


def assert_no_loss_crosses_documents(batch: dict) -> None:
    targets, valid = loss_targets(batch)
    documents = batch["document_ids"]
    same = documents[..., 1:] == documents[..., :-1]
    real = documents[..., 1:] != PADDING_DOCUMENT
    assert valid.any()
    assert bool((same & real)[valid].all()), "a loss token crosses a document boundary or sits on padding"


# ----------------------------------------------------------------------------- the per-sequence fields


def test_fields_of_a_packed_sequence():
    tokens = torch.tensor([5, 6, EOS, 7, 8, 9, EOS, 3])
    packed = pack_sequence(tokens, eos_id=EOS)
    assert packed["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert packed["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    # The label of each document's first token is ignored: EOS never learns to predict the next document.
    assert packed["labels"].tolist() == [5, 6, EOS, IGNORE_INDEX, 8, 9, EOS, IGNORE_INDEX]
    assert torch.equal(packed["input_ids"], tokens) and int(count_loss_tokens(packed)) == 5
    batch = torch.stack([tokens, torch.tensor([1, 2, 3, EOS, EOS, 4, 5, 6])])
    assert document_ids_from_eos(batch, EOS).tolist()[1] == [0, 0, 0, 0, 1, 2, 2, 2]
    assert position_ids_from_documents(document_ids_from_eos(batch, EOS)).tolist()[1] == [
        0,
        1,
        2,
        3,
        0,
        0,
        1,
        2,
    ]
    mask = document_causal_mask(packed["document_ids"])
    assert mask.shape == (1, 8, 8) and mask.dtype == torch.bool
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for start, stop in ((0, 3), (3, 7), (7, 8)):
        expected[start:stop, start:stop] = torch.ones(stop - start, stop - start, dtype=torch.bool).tril()
    assert torch.equal(mask[0], expected)
    with pytest.raises(ValueError, match="needs eos_id or document_ids"):
        pack_sequence(tokens)


# ----------------------------------------------------------------------------- against each document alone


def test_packed_documents_give_each_document_its_own_logits_and_loss(model):
    docs = random_documents(9, seed=1)
    packed = PackedDocuments(docs, context=24)
    assert len(packed) < len(docs)  # several documents share a sequence
    batch = packed_collate()([packed[i] for i in range(len(packed))])
    assert batch["attention_mask"].shape == (len(packed), 1, 24, 24)
    with torch.no_grad():
        logits = default_forward(model, batch)  # what the training step calls: the mask reaches the model
    seen = 0
    for row in range(len(packed)):
        ids = batch["document_ids"][row]
        for document in ids.unique().tolist():
            if document == PADDING_DOCUMENT:
                continue
            where = ids == document
            tokens = batch["input_ids"][row][where].tolist()
            assert tokens in docs
            torch.testing.assert_close(logits[row][where], alone(model, tokens), atol=1e-5, rtol=0)
            seen += 1
    assert seen == len(docs)

    # The loss is the token-weighted mean of the documents' own losses, and no loss token crosses.
    assert_no_loss_crosses_documents(batch)
    assert int(count_loss_tokens(batch)) == sum(len(d) - 1 for d in docs)
    own = [(causal_lm_loss(alone(model, d)[None], {"labels": torch.tensor([d])}), len(d) - 1) for d in docs]
    expected = sum(loss * n for loss, n in own) / sum(n for _, n in own)
    torch.testing.assert_close(causal_lm_loss(logits, batch), expected, atol=1e-5, rtol=0)

    # Control: the same tokens without the mask and the reset positions see the other documents.
    with torch.no_grad():
        leaky = model(batch["input_ids"])
    assert (leaky - logits).abs().max() > 1e-3


def test_windows_over_a_token_stream_are_packed_by_eos(model, tmp_path):
    docs = random_documents(30, seed=2)
    texts = [" ".join(map(str, d[:-1])) for d in docs]
    tokenize_documents(texts, tmp_path, lambda t: [int(x) for x in t.split()], eos_id=EOS, vocab_size=VOCAB,
                       settings=TokenizeSettings(shard_tokens=40))  # fmt: skip
    windows = PackedWindows(TokenWindows(tmp_path, 32), eos_id=EOS)
    spec = build_data(windows, Batching(4, 1, seed=3), collate_fn=packed_collate())
    stream = open_shards(tmp_path).read(0, len(open_shards(tmp_path))).tolist()
    steps = 0
    for step in batches(spec, 0, 0):
        (batch,) = step
        assert_no_loss_crosses_documents(batch)
        with torch.no_grad():
            logits = default_forward(model, batch)
        for row in range(batch["input_ids"].size(0)):
            ids = batch["document_ids"][row]
            for document in ids.unique().tolist():
                where = ids == document
                # Each run between EOS tokens (the first and last may be cut by the window) behaves like
                # that run alone, positions from 0.
                torch.testing.assert_close(
                    logits[row][where],
                    alone(model, batch["input_ids"][row][where].tolist()),
                    atol=1e-5,
                    rtol=0,
                )
        steps += 1
    assert steps == len(windows) // 4 and len(stream) == sum(len(d) for d in docs)


@pytest.mark.slow  # building a BlockMask traces the mask function with vmap: seconds on first use
@pytest.mark.skipif(not flex_attention_available(), reason="needs torch.nn.attention.flex_attention")
def test_the_flex_attention_block_mask_equals_the_sdpa_mask():
    from torch.nn.attention.flex_attention import flex_attention

    docs = torch.tensor([[0] * 5 + [1] * 9 + [2] * 10 + [PADDING_DOCUMENT] * 8, [0] * 20 + [1] * 12])
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 8) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex attention on CPU warns that it is unfused
        flex = flex_attention(q, k, v, block_mask=document_block_mask(docs, block_size=16))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(docs))
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)
    assert not torch.isnan(sdpa).any()  # padding rows attend to padding: never an empty row


# ----------------------------------------------------------------------------- bin packing


def test_best_fit_decreasing_packs_every_token_once():
    assert pack_documents([6, 4, 5, 5, 3, 7], 10) == [[(0, 0, 6), (1, 0, 4)], [(2, 0, 5), (3, 0, 5)],
                                                      [(4, 0, 3), (5, 0, 7)]]  # fmt: skip
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, size=300)
    bins = pack_documents(lengths, 32)
    assert bins == pack_documents(lengths, 32)  # deterministic
    assert all(sum(stop - start for _, start, stop in b) <= 32 for b in bins)
    covered = {}
    for contents in bins:
        for document, start, stop in contents:
            covered.setdefault(document, []).append((start, stop))
    for document, length in enumerate(lengths.tolist()):
        pieces = sorted(covered.get(document, []))
        assert [i for start, stop in pieces for i in range(start, stop)] == list(range(length))
    assert sum(lengths) / (len(bins) * 32) > 0.95  # best fit leaves little padding
    truncated = pack_documents([50, 3], 32, long_documents="truncate")
    assert truncated == [[(0, 0, 32)], [(1, 0, 3)]]


def test_packed_documents_keep_their_labels_and_pad_without_loss():
    docs = [{"input_ids": [1, 2, 3, 4], "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, 4]}, {"input_ids": [5, 6]}]
    packed = PackedDocuments(docs, context=8, pad_id=9)
    (sample,) = [packed[0]]
    assert sample["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 9, 9]
    assert (
        sample["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX, 6] + [IGNORE_INDEX] * 2
    )
    assert sample["document_ids"].tolist() == [0, 0, 0, 0, 1, 1, PADDING_DOCUMENT, PADDING_DOCUMENT]
    assert sample["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 0, 1]
    assert len(packed) == 1 and packed.fill == 0.75
    split = PackedDocuments([[1, 2, 3, 4, 5], [6]], context=3)
    assert [split[i]["input_ids"].tolist() for i in range(len(split))] == [[1, 2, 3], [4, 5, 6]]
    assert split[1]["position_ids"].tolist() == [0, 1, 0]  # a split piece restarts its positions


def test_packing_shard_documents_plans_from_the_index_alone(tmp_path):
    docs = random_documents(40, seed=4)
    tokenize_documents([" ".join(map(str, d[:-1])) for d in docs], tmp_path, lambda t: [int(x) for x in t.split()],
                       eos_id=EOS, vocab_size=VOCAB, settings=TokenizeSettings(shard_tokens=64))  # fmt: skip
    shards = open_shards(tmp_path)
    packed = PackedDocuments(TokenDocuments(shards), context=32)
    assert shards.tokens_read == 0  # the plan came from documents.bin
    rows = [packed[i] for i in range(len(packed))]
    found = sorted(
        row["input_ids"][row["document_ids"] == d].tolist()
        for row in rows
        for d in row["document_ids"].unique().tolist()
        if d != PADDING_DOCUMENT
    )
    assert found == sorted(docs)
    assert_no_loss_crosses_documents(packed_collate("none")(rows))
