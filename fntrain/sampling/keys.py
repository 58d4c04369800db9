"""One random stream per sampled row, named by integers: `row_generator(seed, *key)`.

    generator = row_generator(seed, generation_index, prompt_index, sample_index)

The GRPO rollout seeds each completion by (run seed, generation index, the prompt's dataset index,
sample index), so a row draws the same tokens whichever rank, micro-batch or batch mates it gets, and a
resumed run regenerates exactly. The key is hashed (BLAKE2b of the integers, fixed width, signed) into a
63-bit seed: nearby keys give unrelated streams (unlike `manual_seed(seed + index)`, where (1, 2) and (2, 1)
would meet), and the mapping never changes with the Python, torch or platform version.
"""

from __future__ import annotations

import hashlib

import torch

from fntrain.config import require_int

__all__ = ["row_generator", "row_seed"]

_WIDTH = 16  # bytes per integer: any int in [-2**127, 2**127) hashes without collision


def row_seed(seed: int, *key: int) -> int:
    """The 63-bit seed of the stream named by (seed, *key): a BLAKE2b hash of the integers."""
    digest = hashlib.blake2b(digest_size=8, person=b"fntrain.rowseed")
    for index, value in enumerate((seed, *key)):
        require_int("seed" if index == 0 else f"key[{index - 1}]", value)
        digest.update(value.to_bytes(_WIDTH, "little", signed=True))
    return int.from_bytes(digest.digest(), "little") >> 1


def row_generator(seed: int, *key: int) -> torch.Generator:
    """A CPU generator seeded by (seed, *key) (`row_seed`): the same key, the same stream, on any device
    the model runs on (the sampler draws on the CPU and moves the draws)."""
    return torch.Generator().manual_seed(row_seed(seed, *key))
