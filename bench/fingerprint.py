"""What a data fingerprint costs: `fntrain.data.fingerprint` over 100 token shards.

Rows:
- 100 shards of 10 GiB (1 TiB in all; sparse files, so the machine's disk is not filled): the time
  `data_fingerprint` takes for the directory. Every shard is past the full-hash budget
  (`FULL_HASH_BYTES`, 1 GiB), so it is sampled: two 64 KiB reads at its ends, `SAMPLES` 4 KiB reads
  spread through it, and its modification time. The cost does not grow with the shard size; the row
  proves it on 1 TiB.
- 100 shards of 4 MiB holding random tokens (400 MiB), sampled the same way (the budget set to 0): the
  same cost on real data.
- the same 100 shards hashed in full (within the budget, as a run fingerprints them): BLAKE2b's speed.
- the baseline: a full CRC-32 (the checkpoint manifest's checksum, `verify.checksum`) of 10 of the
  4 MiB shards, scaled to bytes per second, and what hashing the 1 TiB corpus in full would take at
  that speed: the ratio is what sampling saves past the budget.

Timed warm (the files were just written: page cache), median of `--repeats`; a cold network
filesystem adds the reads' latency per shard. Run: `python -m bench.fingerprint [--repeats N] [--quick]`
(`--quick`: one repeat, checks that it runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from fntrain.checkpoint.verify import checksum
from fntrain.data import fingerprint
from fntrain.data.fingerprint import data_fingerprint
from fntrain.data.shard_index import INDEX_NAME, ShardIndex, ShardInfo, write_index

SHARDS = 100


@dataclasses.dataclass(frozen=True)
class _Data:
    shards: str


@dataclasses.dataclass(frozen=True)
class _Config:
    data: _Data


def make_shards(directory: Path, shard_bytes: int, *, sparse: bool) -> Path:
    """`SHARDS` uint16 shards of `shard_bytes` each and their index (sparse: only the ends are written)."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    infos = []
    for number in range(SHARDS):
        name = f"shard_{number:05d}.bin"
        with open(directory / name, "wb") as file:
            if sparse:
                file.write(rng.integers(0, 50_000, 1 << 16, dtype=np.uint16).tobytes())
                file.truncate(shard_bytes)
            else:
                file.write(rng.integers(0, 50_000, shard_bytes // 2, dtype=np.uint16).tobytes())
        infos.append(ShardInfo(name, shard_bytes // 2))
    write_index(ShardIndex(directory, "<u2", tuple(infos), eos_id=0, vocab_size=50_000))
    assert (directory / INDEX_NAME).is_file()
    return directory


def timed(function, repeats: int) -> float:
    """Median seconds of `function()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--quick", action="store_true", help="one repeat: checks that it runs, not the figures"
    )
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="fntrain-fingerprint-") as tmp:
        big = make_shards(Path(tmp) / "big", 10 << 30, sparse=True)
        small = make_shards(Path(tmp) / "small", 4 << 20, sparse=False)
        big_s = timed(lambda: data_fingerprint(_Config(_Data(str(big))), None), repeats)
        full_hash_s = timed(lambda: data_fingerprint(_Config(_Data(str(small))), None), repeats)
        budget, fingerprint.FULL_HASH_BYTES = fingerprint.FULL_HASH_BYTES, 0
        try:
            small_s = timed(lambda: data_fingerprint(_Config(_Data(str(small))), None), repeats)
        finally:
            fingerprint.FULL_HASH_BYTES = budget
        files = sorted(small.glob("shard_*.bin"))[:10]
        crc_s = timed(lambda: [checksum(f) for f in files], repeats)
        crc_bps = sum(f.stat().st_size for f in files) / crc_s
        hashed_bps = sum(f.stat().st_size for f in small.glob("shard_*.bin")) / full_hash_s
        logical = sum(os.path.getsize(f) for f in big.glob("shard_*.bin"))
        full_s = logical / crc_bps
    rows = [
        ("100 x 10 GiB shards (1 TiB, sparse), sampled", f"{1000 * big_s / SHARDS:.3f} ms/shard",
         f"{big_s * 1000:.1f} ms"),
        ("100 x 4 MiB shards (random tokens), sampled", f"{1000 * small_s / SHARDS:.3f} ms/shard",
         f"{small_s * 1000:.1f} ms"),
        ("100 x 4 MiB shards, hashed in full", f"{hashed_bps / 1e9:.2f} GB/s", f"{full_hash_s * 1000:.1f} ms"),
        ("full CRC-32 (baseline)", f"{crc_bps / 1e9:.2f} GB/s", f"1 TiB: {full_s / 60:.0f} min"),
        ("fingerprint / full CRC, 1 TiB", f"{big_s / full_s:.1e}x", ""),
    ]  # fmt: skip
    width = max(len(row[0]) for row in rows)
    print(f"{'case':<{width}}  {'per shard / speed':>18}  {'total':>14}")
    for name, per, total in rows:
        print(f"{name:<{width}}  {per:>18}  {total:>14}")


if __name__ == "__main__":
    main()
