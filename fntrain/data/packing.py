"""Packing documents into context-length sequences that keep document boundaries [S22].

A packed sequence holds several documents back to back. Three things keep each document on its own, as
if it had been run alone:

- `position_ids` restart at 0 at every document start;
- attention stays inside the document: `document_causal_mask` (a boolean [batch, 1, seq, seq] mask for
  `scaled_dot_product_attention`, True where a query may attend a key) or `document_block_mask` (a
  flex-attention `BlockMask`, built on the device from `document_ids`);
- no loss crosses a boundary: the label at each document start (but position 0, never a target) is
  IGNORE_INDEX, so the last token of one document is never trained to predict the first of the next.

Two ways to get packed sequences:
- `PackedWindows` wraps a dataset of fixed windows over a token stream (`shards.TokenWindows`): the
  documents are the EOS-separated runs of each window (a document may continue from the previous window;
  its tokens in this window then start at position 0).
- `PackedDocuments` bin-packs whole documents (best fit decreasing, deterministic) into sequences of
  `context` tokens, padding what is left (pad labels IGNORE_INDEX, pad document id PADDING_DOCUMENT);
  documents longer than `context` are split into `context`-token pieces (or truncated).

Samples are dicts of equal-length int64 tensors: input_ids, labels, position_ids, document_ids.
`packed_collate()` stacks them and adds the SDPA mask as `attention_mask`, the key the training step
passes to the model (fntrain.models.gpt's TinyGPT reads a 4-D `attention_mask` as this mask).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from fntrain.config import require_choice, require_int
from fntrain.data.tokens import IGNORE_INDEX

try:  # flex attention ships with torch >= 2.5; only `document_block_mask` needs it
    from torch.nn.attention.flex_attention import create_block_mask as _create_block_mask
except ImportError:  # pragma: no cover - older torch
    _create_block_mask = None

__all__ = [
    "PADDING_DOCUMENT",
    "document_ids_from_eos",
    "document_starts",
    "position_ids_from_documents",
    "mask_document_starts",
    "pack_sequence",
    "document_causal_mask",
    "document_block_mask",
    "flex_attention_available",
    "PackedWindows",
    "pack_documents",
    "PackedDocuments",
    "packed_collate",
]

PADDING_DOCUMENT = -1
"""The document id of padding tokens (they attend only to padding and carry no loss)."""
ATTENTION_MODES = ("sdpa", "none")
LONG_DOCUMENT_MODES = ("split", "truncate")


# ----------------------------------------------------------------------------- per-sequence fields


def document_ids_from_eos(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document ids ([..., seq] int64): 0 for the first run of tokens, +1 after every EOS (an EOS belongs to
    the document it ends)."""
    is_eos = (input_ids == eos_id).to(torch.int64)
    return is_eos.cumsum(-1) - is_eos


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """True where a document begins (position 0 included): [..., seq] bool."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return starts


def position_ids_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at every document start: [..., seq] int64."""
    index = torch.arange(document_ids.size(-1), device=document_ids.device).expand_as(document_ids)
    last_start = torch.where(document_starts(document_ids), index, 0).cummax(-1).values
    return index - last_start


def mask_document_starts(
    labels: torch.Tensor, document_ids: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """`labels` (a copy) with IGNORE_INDEX at every document start after position 0, and on padding: with
    the loss's shift (targets = labels[..., 1:]) no target then crosses from one document into the next."""
    cross = document_starts(document_ids)
    cross[..., 0] = False
    return labels.masked_fill(cross | (document_ids == PADDING_DOCUMENT), ignore_index)


def pack_sequence(
    input_ids: torch.Tensor,
    *,
    eos_id: int | None = None,
    document_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, torch.Tensor]:
    """The packed fields of one sequence whose documents are given by `document_ids` or found by `eos_id`:
    {input_ids, labels (starts masked), position_ids, document_ids}."""
    if document_ids is None:
        if eos_id is None:
            raise ValueError("pack_sequence needs eos_id or document_ids")
        document_ids = document_ids_from_eos(input_ids, eos_id)
    elif document_ids.shape != input_ids.shape:
        raise ValueError(
            f"document_ids shape {tuple(document_ids.shape)} differs from input_ids {tuple(input_ids.shape)}"
        )
    labels = input_ids if labels is None else labels
    return {
        "input_ids": input_ids,
        "labels": mask_document_starts(labels, document_ids, ignore_index),
        "position_ids": position_ids_from_documents(document_ids),
        "document_ids": document_ids,
    }


# ----------------------------------------------------------------------------- attention masks


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed sequences, on `document_ids`' device: [batch, 1, seq, seq]
    bool (a [seq] input gives [1, seq, seq]), True where query q may attend key k: same document and
    k <= q. Padding attends to padding only, so no row is empty (an empty row makes SDPA return NaN)."""
    seq = document_ids.size(-1)
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    mask = same & causal
    return mask.unsqueeze(-3)


def flex_attention_available() -> bool:
    return _create_block_mask is not None


def document_block_mask(document_ids: torch.Tensor, *, block_size: int = 128) -> Any:
    """A flex-attention `BlockMask` equal to `document_causal_mask(document_ids)` ([batch, seq] ids), built
    on their device; pass it as `flex_attention(q, k, v, block_mask=...)`. Fully masked blocks are
    skipped by the kernel, so the cost grows with the documents' lengths, not with the sequence's."""
    if _create_block_mask is None:
        raise RuntimeError("document_block_mask needs torch.nn.attention.flex_attention (torch >= 2.5)")
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}")
    batch, seq = document_ids.shape

    def same_document_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (document_ids[b, q] == document_ids[b, k]) & (k <= q)

    return _create_block_mask(
        same_document_causal, batch, None, seq, seq, device=document_ids.device, BLOCK_SIZE=block_size
    )


def packed_collate(attention: str = "sdpa") -> Callable[[list[Any]], Any]:
    """A collate_fn for packed samples: `default_collate`, plus (attention="sdpa") the block-diagonal
    causal mask as `attention_mask` [batch, 1, seq, seq]. attention="none" leaves the mask to the model
    (built on the device from `document_ids`, e.g. `document_block_mask`), which saves moving
    batch x seq^2 bytes per micro-batch."""
    require_choice("attention", attention, ATTENTION_MODES)

    def collate(samples: list[Any]) -> Any:
        batch = default_collate(samples)
        if attention == "sdpa":
            batch["attention_mask"] = document_causal_mask(batch["document_ids"])
        return batch

    return collate


# ----------------------------------------------------------------------------- windows of a token stream


class PackedWindows(torch.utils.data.Dataset):
    """A dataset of windows over a token stream (samples with `input_ids`, optionally `labels`) whose
    documents are separated by `eos_id`, with the packed fields of `pack_sequence` added."""

    def __init__(self, windows: Any, eos_id: int, *, ignore_index: int = IGNORE_INDEX):
        require_int("eos_id", eos_id, min=0)
        self.windows = windows
        self.eos_id = eos_id
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.windows[index]
        input_ids = sample["input_ids"] if isinstance(sample, Mapping) else torch.as_tensor(sample)
        labels = sample.get("labels") if isinstance(sample, Mapping) else None
        return pack_sequence(input_ids, eos_id=self.eos_id, labels=labels, ignore_index=self.ignore_index)


# ----------------------------------------------------------------------------- bin-packing whole documents


def pack_documents(
    lengths: Sequence[int] | np.ndarray, context: int, *, long_documents: str = "split"
) -> list[list[tuple[int, int, int]]]:
    """Best-fit-decreasing packing of documents into bins of `context` tokens (deterministic).

    Returns the bins, each a list of pieces (document, start, stop) sorted by document, ordered by their
    first piece.
    A document longer than `context` is cut into `context`-token pieces ("split") or cut to its first
    `context` tokens ("truncate"); empty documents are dropped.
    """
    require_int("context", context, min=1)
    require_choice("long_documents", long_documents, LONG_DOCUMENT_MODES)
    pieces: list[tuple[int, int, int]] = []
    for document, length in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        if length < 0:
            raise ValueError(f"document {document} has a negative length {length}")
        stop = length if long_documents == "split" else min(length, context)
        pieces.extend((document, start, min(start + context, stop)) for start in range(0, stop, context))
    # Longest first; ties keep document order, so the packing is a pure function of the lengths.
    pieces.sort(key=lambda piece: (piece[1] - piece[2], piece[0], piece[1]))
    bins: list[list[tuple[int, int, int]]] = []
    rooms: list[int] = []  # sorted distinct free capacities that some bin has
    by_room: dict[int, list[int]] = {}  # free capacity -> bins with it (used last-in first-out)
    for piece in pieces:
        size = piece[2] - piece[1]
        at = bisect.bisect_left(rooms, size)
        if at == len(rooms):
            bins.append([piece])
            bin_index, room = len(bins) - 1, context - size
        else:
            old_room = rooms[at]
            bin_index = by_room[old_room].pop()
            if not by_room[old_room]:
                del by_room[old_room]
                del rooms[at]
            bins[bin_index].append(piece)
            room = old_room - size
        if room not in by_room:
            by_room[room] = []
            bisect.insort(rooms, room)
        by_room[room].append(bin_index)
    # In order of their first piece, so sequences follow the corpus roughly (and the order is canonical).
    return sorted(sorted(contents) for contents in bins)


class PackedDocuments(torch.utils.data.Dataset):
    """Whole documents bin-packed into sequences of exactly `context` tokens (see `pack_documents`).

    documents: a map-style dataset whose items are token-id sequences or mappings with `input_ids` (and
    optionally `labels`, kept, e.g. prompt tokens already IGNORE_INDEX). lengths: each document's length;
    default `documents.lengths()` when it has one (`shards.TokenDocuments` reads it from the document
    index), else every document is read once here. Each split piece is its own document (positions from
    0). The packing is decided here, once: sample i is the same in every epoch and on every rank.
    """

    def __init__(
        self,
        documents: Any,
        context: int,
        *,
        pad_id: int = 0,
        lengths: Sequence[int] | np.ndarray | None = None,
        long_documents: str = "split",
        ignore_index: int = IGNORE_INDEX,
    ):
        require_int("pad_id", pad_id, min=0)
        self.documents = documents
        self.context = context
        self.pad_id = pad_id
        self.ignore_index = ignore_index
        if lengths is None:
            lengths = documents.lengths() if callable(getattr(documents, "lengths", None)) else None
        if lengths is None:
            lengths = [len(self._fields(documents[i])[0]) for i in range(len(documents))]
        if len(lengths) != len(documents):
            raise ValueError(f"lengths has {len(lengths)} entries for {len(documents)} documents")
        bins = pack_documents(lengths, context, long_documents=long_documents)
        # Flat arrays: a few int64 per piece instead of Python tuples for millions of documents.
        self._bin_starts = np.cumsum([0] + [len(b) for b in bins], dtype=np.int64)
        self._pieces = np.asarray([piece for contents in bins for piece in contents], dtype=np.int64).reshape(
            -1, 3
        )
        self.tokens = int((self._pieces[:, 2] - self._pieces[:, 1]).sum()) if len(self._pieces) else 0

    def __len__(self) -> int:
        return len(self._bin_starts) - 1

    @property
    def fill(self) -> float:
        """Fraction of the packed tokens that are not padding."""
        return self.tokens / max(1, len(self) * self.context)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"packed sequence {index} is outside [0, {len(self)})")
        context = self.context
        input_ids = torch.full((context,), self.pad_id, dtype=torch.int64)
        labels = torch.full((context,), self.ignore_index, dtype=torch.int64)
        document_ids = torch.full((context,), PADDING_DOCUMENT, dtype=torch.int64)
        at = 0
        pieces = self._pieces[self._bin_starts[index] : self._bin_starts[index + 1]]
        for number, (document, start, stop) in enumerate(pieces.tolist()):
            ids, doc_labels = self._fields(self.documents[document])
            size = stop - start
            input_ids[at : at + size] = ids[start:stop]
            labels[at : at + size] = doc_labels[start:stop]
            document_ids[at : at + size] = number
            at += size
        return pack_sequence(
            input_ids, document_ids=document_ids, labels=labels, ignore_index=self.ignore_index
        )

    @staticmethod
    def _fields(item: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(item, Mapping):
            ids = torch.as_tensor(item["input_ids"], dtype=torch.int64)
            labels = item.get("labels")
            return ids, ids if labels is None else torch.as_tensor(labels, dtype=torch.int64)
        ids = torch.as_tensor(item, dtype=torch.int64)
        return ids, ids
