"""Pins of `fntrain.data.packing` behaviours the packing tests left open (mutation testing): masks and
position ids stay on the ids' device, the block mask covers every row of a batch, best fit decreasing with
ties in document order, labels and ignore_index kept through both datasets, plain windows, and the exact
one-line refusals naming the field and value."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import fntrain.data.packing as packing
from fntrain.data.packing import (
    PADDING_DOCUMENT,
    PackedDocuments,
    PackedWindows,
    document_block_mask,
    document_causal_mask,
    flex_attention_available,
    pack_documents,
    pack_sequence,
    packed_collate,
    position_ids_from_documents,
)
from fntrain.data.tokens import IGNORE_INDEX


def brute_mask(ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq]: True exactly where key k <= query q and both hold the same document."""
    batch, seq = ids.shape
    out = torch.zeros(batch, 1, seq, seq, dtype=torch.bool)
    for b in range(batch):
        for q in range(seq):
            for k in range(q + 1):
                out[b, 0, q, k] = bool(ids[b, q] == ids[b, k])
    return out


def raises_exactly(error: type[Exception], message: str):
    return pytest.raises(error, match="^" + re.escape(message) + "$")


# ----------------------------------------------------------------------------- devices


def test_masks_and_positions_are_built_on_the_ids_device():
    ids = torch.zeros(2, 8, dtype=torch.int64, device="meta")  # any non-CPU device: no data needed
    assert document_causal_mask(ids).device.type == "meta"
    assert position_ids_from_documents(ids).device.type == "meta"


# ----------------------------------------------------------------------------- flex attention


needs_flex = pytest.mark.skipif(not flex_attention_available(), reason="needs torch's flex attention")


def test_flex_availability_follows_the_import(monkeypatch):
    try:
        import torch.nn.attention.flex_attention  # noqa: F401

        importable = True
    except ImportError:  # pragma: no cover - older torch
        importable = False
    assert flex_attention_available() is importable
    monkeypatch.setattr(packing, "_create_block_mask", None)
    assert flex_attention_available() is False
    with raises_exactly(RuntimeError, "document_block_mask needs torch.nn.attention.flex_attention (torch >= 2.5)"):
        document_block_mask(torch.zeros(1, 4, dtype=torch.int64))


@needs_flex
def test_block_mask_skips_exactly_the_fully_masked_tiles_of_every_row_of_the_batch():
    # Row 1 has a different document layout from row 0: a mask built for row 0 only would be wrong there.
    ids = torch.tensor([[0] * 8, [0, 0, 1, 1, 1, 1, 2, 2]])
    block = document_block_mask(ids, block_size=2)
    assert block.BLOCK_SIZE == (2, 2)
    dense = brute_mask(ids)
    tiles = dense.reshape(2, 1, 4, 2, 4, 2).any(dim=(3, 5))  # [batch, 1, q tile, k tile]
    assert torch.equal(block.to_dense().bool(), tiles)
    assert document_block_mask(ids).BLOCK_SIZE == (128, 128)  # the default is flex attention's tile
    on_meta = document_block_mask(ids.to("meta"), block_size=2)  # built on the ids' device, not the default
    assert on_meta.kv_num_blocks.device.type == "meta"


# ----------------------------------------------------------------------------- packed sequences


def test_document_starts_take_the_ignore_index_given():
    ids = torch.tensor([5, 6, 7, 8, 9])
    packed = pack_sequence(ids, document_ids=torch.tensor([0, 0, 1, 1, 1]), ignore_index=-1)
    assert packed["labels"].tolist() == [5, 6, -1, 8, 9]
    with raises_exactly(ValueError, "pack_sequence needs eos_id or document_ids"):
        pack_sequence(ids)


def test_collate_refuses_an_unknown_attention_mode():
    with raises_exactly(ValueError, "attention must be one of ['none', 'sdpa'], got 'flash'"):
        packed_collate("flash")


def test_plain_windows_are_packed_by_eos():
    windows = [torch.tensor([4, 5, 0, 6, 7, 0]), [8, 0, 9, 9, 9, 9]]
    packed = PackedWindows(windows, eos_id=0)
    first = packed[0]
    assert first["input_ids"].tolist() == [4, 5, 0, 6, 7, 0]
    assert first["labels"].tolist() == [4, 5, 0, IGNORE_INDEX, 7, 0]
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]
    assert packed[1]["position_ids"].tolist() == [0, 1, 0, 1, 2, 3]
    batch = packed_collate()([packed[0], packed[1]])
    assert torch.equal(batch["attention_mask"], brute_mask(batch["document_ids"]))


def test_windows_keep_their_labels_and_ignore_index():
    ids = torch.tensor([4, 5, 0, 6, 7, 8])
    labels = torch.tensor([-7, 5, 0, 6, -7, 8])  # e.g. prompt tokens already ignored
    packed = PackedWindows([{"input_ids": ids, "labels": labels}], eos_id=0, ignore_index=-7)[0]
    assert packed["labels"].tolist() == [-7, 5, 0, -7, -7, 8]


def test_window_eos_id_must_be_a_token_id():
    with raises_exactly(ValueError, "eos_id must be >= 0, got -1"):
        PackedWindows([], eos_id=-1)


# ----------------------------------------------------------------------------- bin packing


def test_longest_pieces_are_placed_first():
    # 30 tokens fit exactly 3 bins of 10 only when the 8s are placed before the 2s ([8, 2] [8, 2] [5, 5]).
    bins = pack_documents([2, 5, 5, 8, 8, 2], 10)
    assert len(bins) == 3
    assert all(sum(stop - start for _, start, stop in b) == 10 for b in bins)


def test_equal_pieces_are_placed_in_document_order():
    # Pieces of 3: document 0's tail (start 10) comes before document 1 (start 0), so it takes the
    # tightest room (after the 7) and document 1 the next one (after the 6).
    bins = pack_documents([13, 3, 7, 6], 10)
    assert bins == [[(0, 0, 10)], [(0, 10, 13), (2, 0, 7)], [(1, 0, 3), (3, 0, 6)]]


def test_context_of_one_and_whole_float_lengths_pack():
    assert pack_documents([1, 2], 1) == [[(0, 0, 1)], [(1, 0, 1)], [(1, 1, 2)]]
    assert pack_documents(np.array([3.0, 5.0]), 4) == pack_documents([3, 5], 4)


def test_bad_packing_settings_are_refused_naming_field_and_value():
    with raises_exactly(ValueError, "context must be >= 1, got 0"):
        pack_documents([1, 2], 0)
    with raises_exactly(ValueError, "long_documents must be one of ['split', 'truncate'], got 'drop'"):
        pack_documents([1, 2], 4, long_documents="drop")
    with raises_exactly(ValueError, "pad_id must be >= 0, got -1"):
        PackedDocuments([[1]], 4, pad_id=-1)


def test_packed_documents_pad_with_token_0_and_keep_ignore_index_and_truncation():
    packed = PackedDocuments([[5, 6, 7, 8, 9, 10], [3, 4]], 4, long_documents="truncate", ignore_index=-5)
    assert packed.tokens == 6 and len(packed) == 2
    first, second = packed[0], packed[1]
    assert first["input_ids"].tolist() == [5, 6, 7, 8]  # truncated: 9, 10 dropped
    assert second["input_ids"].tolist() == [3, 4, 0, 0]
    assert second["labels"].tolist() == [3, 4, -5, -5]
    assert second["document_ids"].tolist() == [0, 0, PADDING_DOCUMENT, PADDING_DOCUMENT]
    both = PackedDocuments([[5, 6, 7], [8, 9]], 5, ignore_index=-5)[0]
    assert both["labels"].tolist() == [5, 6, 7, -5, 9]  # document 1's start masked with ignore_index


def test_token_count_of_split_and_empty_documents():
    split = PackedDocuments([list(range(1, 11))], 4)  # pieces [0, 4) [4, 8) [8, 10)
    assert split.tokens == 10
    rows = [split[i]["input_ids"].tolist() for i in range(len(split))]
    assert rows == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    empty = PackedDocuments([[], []], 4)
    assert len(empty) == 0 and empty.tokens == 0 and empty.fill == 0.0
