"""`fntrain.data.packing` paths the packing tests leave out: the flex-attention block mask equals the
dense block-diagonal causal mask, and the refusals (mismatched document ids, a negative length, a
lengths list of the wrong size, an index outside the packed sequences; negative indices count from
the end)."""

from __future__ import annotations

import pytest
import torch

from fntrain.data.packing import (
    PackedDocuments,
    document_block_mask,
    document_causal_mask,
    flex_attention_available,
    pack_documents,
    pack_sequence,
)


@pytest.mark.skipif(not flex_attention_available(), reason="needs torch's flex attention")
def test_the_block_mask_equals_the_dense_document_mask():
    from torch.nn.attention.flex_attention import create_mask

    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, -1, -1]])
    block = document_block_mask(ids, block_size=4)
    dense = create_mask(block.mask_mod, 2, 1, 8, 8, device="cpu")
    assert torch.equal(dense, document_causal_mask(ids))
    with pytest.raises(ValueError, match=r"document_ids must be \[batch, seq\], got shape \(8,\)"):
        document_block_mask(ids[0])


def test_bad_packing_inputs_are_refused():
    with pytest.raises(ValueError, match=r"document_ids shape \(3,\) differs from input_ids \(4,\)"):
        pack_sequence(torch.arange(4), document_ids=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="document 1 has a negative length -2"):
        pack_documents([3, -2], context=4)
    documents = [[1, 2, 3], [4, 5], [6]]
    with pytest.raises(ValueError, match="lengths has 2 entries for 3 documents"):
        PackedDocuments(documents, context=4, lengths=[3, 2])


def test_negative_indices_count_from_the_end_and_others_are_refused():
    packed = PackedDocuments([[1, 2, 3], [4, 5], [6]], context=4)
    assert len(packed) == 2
    assert torch.equal(packed[-1]["input_ids"], packed[len(packed) - 1]["input_ids"])
    with pytest.raises(IndexError, match=r"packed sequence 2 is outside \[0, 2\)"):
        packed[2]
    with pytest.raises(IndexError, match=r"packed sequence -1 is outside"):
        packed[-3]
