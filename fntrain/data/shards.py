"""Memory-mapped token shards: a corpus tokenized once, read in place, resumed exactly [S11].

The directory's format (`index.json`, the shard files, `documents.bin`) is `fntrain.data.shard_index`;
`fntrain tokenize` writes it.

`TokenShards` maps the files read-only and never copies a shard into memory: a read copies out just the
tokens asked for. Touched pages of a file mapping count in the process's RSS until they are unmapped, so
after every `release_bytes` read it tells the kernel it no longer needs them (`MADV_DONTNEED`: the pages
stay in the page cache, the mapping re-faults them on the next read); memory stays flat however much of
the corpus an epoch walks through.

`TokenWindows` is the map-style dataset the pipeline reads: sample i is the `context` tokens starting at
`i * stride`. Its order, sharding over ranks and O(1) resume come from the sampler and the cursor alone,
so resuming at any step (across shard boundaries included) reads exactly the windows an uninterrupted
run would, and none of the skipped ones.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fntrain.config import ConfigError
from fntrain.data.shard_index import INDEX_NAME, ShardIndex, npy_layout, read_index

__all__ = [
    "TokenShards",
    "open_shards",
    "TokenWindows",
    "split_windows",
    "TokenDocuments",
    "require_shards",
    "check_shard_vocab",
]

DEFAULT_RELEASE_BYTES = 64 << 20
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # absent on some platforms: pages are then never released


class _Mapped:
    """One shard file mapped read-only: its tokens as a zero-copy numpy view of the mapping. Only a shard
    holding tokens is mapped (`TokenShards.read` skips the others: mmap refuses an empty file)."""

    __slots__ = ("file", "mapping", "tokens", "data_offset")

    def __init__(self, path: Path, dtype: np.dtype, tokens: int):
        self.data_offset = npy_layout(path)[0] if path.suffix == ".npy" else 0
        self.file = open(path, "rb")  # noqa: SIM115 - owned by this object, closed in close()
        self.mapping = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ)
        self.tokens = np.frombuffer(self.mapping, dtype=dtype, count=tokens, offset=self.data_offset)

    def release(self) -> None:
        """Unmap the pages read so far from this process (they stay in the page cache)."""
        if self.mapping is not None and _DONTNEED is not None and hasattr(self.mapping, "madvise"):
            self.mapping.madvise(_DONTNEED)

    def close(self) -> None:
        self.tokens = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a caller still holds a view: the mapping goes when it is collected
                pass
            self.mapping = None
        self.file.close()


class TokenShards:
    """Read access to a shard directory's concatenated token stream, without loading it.

    Owns the file mappings, which it opens lazily in the process that reads (so a dataset holding it can
    be sent to DataLoader workers: pickling drops the mappings and each worker maps the files itself) and
    ends with `close()`. `read(start, stop)` returns a fresh array (the dtype of the shards) holding
    tokens [start, stop) of the stream, however many shards they span.

    release_bytes: after this many bytes read, the pages read so far are unmapped from the process
    (`MADV_DONTNEED`), which keeps its RSS flat; None never releases them.
    """

    def __init__(self, index: ShardIndex, *, release_bytes: int | None = DEFAULT_RELEASE_BYTES):
        if release_bytes is not None and (type(release_bytes) is not int or release_bytes < 1):
            raise ValueError(f"release_bytes must be a positive int or None, got {release_bytes!r}")
        self.index = index
        self.dtype = np.dtype(index.dtype)
        self.release_bytes = release_bytes
        self._starts = index.starts
        self._maps: dict[int, _Mapped] = {}
        self._documents: np.ndarray | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._unreleased = 0
        self.tokens_read = 0
        """Tokens copied out by `read` in this process (a statistic; resume tests read it)."""

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def eos_id(self) -> int | None:
        return self.index.eos_id

    @property
    def vocab_size(self) -> int | None:
        return self.index.vocab_size

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream, copied out of the mappings."""
        total = len(self)
        if not 0 <= start <= stop <= total:
            raise IndexError(f"token range [{start}, {stop}) is outside the shards' [0, {total})")
        out = np.empty(stop - start, dtype=self.dtype)
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        position = start
        while position < stop:
            shard_start, shard_stop = int(self._starts[shard]), int(self._starts[shard + 1])
            end = min(stop, shard_stop)
            if end > position:
                tokens = self._mapped(shard).tokens
                out[position - start : end - start] = tokens[position - shard_start : end - shard_start]
                position = end
            shard += 1
        self._account(stop - start)
        return out

    def document_offsets(self) -> np.ndarray:
        """Start offset of every document in the stream (int64, one per document), mapped read-only.

        Needs the document index `fntrain tokenize` writes (`documents.bin`)."""
        if self._documents is None:
            if self.index.document_index is None:
                raise ValueError(f"the shards at {str(self.index.directory)!r} have no document index")
            path = self.index.directory / self.index.document_index
            count = self.index.documents or 0
            # One int64 per document: mapped, never read whole (a corpus may hold billions of documents).
            self._documents = (
                np.memmap(path, dtype="<i8", mode="r", shape=(count,)) if count else np.empty(0, "<i8")
            )
        return self._documents

    def document_range(self, document: int) -> tuple[int, int]:
        """(start, stop) of document `document` in the stream."""
        starts = self.document_offsets()
        if not 0 <= document < len(starts):
            raise IndexError(f"document {document} is outside [0, {len(starts)})")
        stop = int(starts[document + 1]) if document + 1 < len(starts) else len(self)
        return int(starts[document]), stop

    def release(self) -> None:
        """Unmap every page read so far from this process (see the class docstring)."""
        with self._lock:
            for mapped in self._maps.values():
                mapped.release()
            self._unreleased = 0

    def close(self) -> None:
        """Unmap and close every shard file; a later read maps them again."""
        with self._lock:
            for mapped in self._maps.values():
                mapped.close()
            self._maps.clear()
            self._documents = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_maps={}, _documents=None, _lock=None, _unreleased=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.index.directory)!r}, shards={len(self.index.shards)}, "
            f"tokens={len(self)}, dtype={self.dtype})"
        )

    # ------------------------------------------------------------------------- internals

    def _mapped(self, shard: int) -> _Mapped:
        mapped = self._maps.get(shard)
        if mapped is None or self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    # A forked worker inherits the parent's mappings; it maps the files again so that
                    # releasing its pages never depends on the parent's objects.
                    self._maps, self._pid, self._unreleased = {}, os.getpid(), 0
                mapped = self._maps.get(shard)
                if mapped is None:
                    info = self.index.shards[shard]
                    mapped = _Mapped(self.index.directory / info.path, self.dtype, info.tokens)
                    self._maps[shard] = mapped
        return mapped

    def _account(self, tokens: int) -> None:
        self.tokens_read += tokens
        if self.release_bytes is None:
            return
        self._unreleased += tokens * self.dtype.itemsize
        if self._unreleased >= self.release_bytes:
            self.release()


def open_shards(
    directory: str | os.PathLike[str], *, release_bytes: int | None = DEFAULT_RELEASE_BYTES
) -> TokenShards:
    """`TokenShards` over the directory `fntrain tokenize` wrote (checked, nothing mapped yet)."""
    return TokenShards(read_index(directory), release_bytes=release_bytes)


def _as_shards(shards: TokenShards | str | os.PathLike[str]) -> TokenShards:
    return shards if isinstance(shards, TokenShards) else open_shards(shards)


class TokenWindows(torch.utils.data.Dataset):
    """Fixed-length sequences over token shards: sample i is tokens [i * stride, i * stride + context).

    Each sample is {"input_ids": int64 tensor [context], "labels": the same tensor} (the loss shifts the
    labels). stride defaults to `context` (disjoint windows; the first token of each window is then no
    target); `context - 1` makes every token after the first a target exactly once. A window may span
    shards. Windows that would run past the end are not samples.
    """

    def __init__(
        self, shards: TokenShards | str | os.PathLike[str], context: int, *, stride: int | None = None
    ):
        from fntrain.config import require_int

        require_int("context", context, min=1)
        stride = context if stride is None else stride
        require_int("stride", stride, min=1)
        self.shards = _as_shards(shards)
        self.context = context
        self.stride = stride
        total = len(self.shards)
        if total < context:
            raise ValueError(
                f"the shards at {str(self.shards.index.directory)!r} hold {total} tokens, fewer than one "
                f"context of {context}"
            )
        self._length = (total - context) // stride + 1

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"window {index} is outside [0, {self._length})")
        start = index * self.stride
        tokens = torch.from_numpy(self.shards.read(start, start + self.context).astype(np.int64))
        return {"input_ids": tokens, "labels": tokens}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in indices]


def split_windows(windows: TokenWindows, val_fraction: float) -> tuple[Any, Any]:
    """(train, validation) map-style datasets: the first windows, and the tail `val_fraction` of them
    (the held-out tail of the corpus, as a recipe holds out the tail of a text file)."""
    split = int(len(windows) * (1.0 - val_fraction))
    return (
        torch.utils.data.Subset(windows, range(split)),
        torch.utils.data.Subset(windows, range(split, len(windows))),
    )


class TokenDocuments(torch.utils.data.Dataset):
    """The documents of token shards, one per sample: int64 token tensors (each ends with its EOS).

    `lengths()` reads only the document index, so `packing.PackedDocuments` can plan a packing without
    reading a token."""

    def __init__(self, shards: TokenShards | str | os.PathLike[str]):
        self.shards = _as_shards(shards)
        self.shards.document_offsets()  # fails now when the shards have no document index

    def __len__(self) -> int:
        return len(self.shards.document_offsets())

    def __getitem__(self, index: int) -> torch.Tensor:
        start, stop = self.shards.document_range(index)
        return torch.from_numpy(self.shards.read(start, stop).astype(np.int64))

    def lengths(self) -> np.ndarray:
        """Tokens in each document (int64)."""
        starts = np.asarray(self.shards.document_offsets(), dtype=np.int64)
        return np.diff(np.append(starts, len(self.shards)))


# ----------------------------------------------------------------------------- phase-1 checks


def require_shards(field: str, directory: str) -> ShardIndex:
    """The index of the token shards at `directory`, or one line naming `field` and the value: the
    directory is missing, is a file, or holds no complete `fntrain tokenize` output (or a bad index)."""
    path = Path(directory).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{field} {directory!r} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"{field} {directory!r} is a file, not a token-shard directory")
    if not (path / INDEX_NAME).is_file():
        raise FileNotFoundError(
            f"{field} {directory!r} holds no {INDEX_NAME}: not `fntrain tokenize` output, or unfinished"
        )
    try:
        return read_index(path)
    except (ConfigError, ValueError, OSError) as error:
        raise ConfigError(f"{field} {directory!r}: {error}") from None


def check_shard_vocab(field: str, directory: str, vocab_size: int | None) -> None:
    """A `ConfigError` naming `field` when the shards may hold token ids >= `vocab_size` (the model's):
    the index's vocabulary (what `fntrain tokenize` guarantees every id is below) is larger, or, for an
    index without one, the largest id read from the shards is."""
    if vocab_size is None:
        return
    index = require_shards(field, directory)
    bound = index.vocab_size
    if bound is None:  # an index that names no vocabulary: read the ids (in chunks, memory flat)
        shards, bound, chunk = TokenShards(index), 0, 1 << 22
        for start in range(0, len(shards), chunk):
            bound = max(bound, int(shards.read(start, min(start + chunk, len(shards))).max()) + 1)
        shards.close()
    if bound > vocab_size:
        raise ConfigError(
            f"{field} {directory!r} holds token ids up to {bound - 1} (tokenizer {index.tokenizer!r}) "
            f"but the model's vocabulary has {vocab_size}: tokenize with the model's tokenizer "
            "(fntrain tokenize ... --tokenizer MODEL_DIR)"
        )
