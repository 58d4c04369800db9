"""`fntrain tokenize` against `datasets.map` on the same Parquet corpus and tokenizer, and its peak memory
on corpora growing 4x each.

Throughput: a generated corpus (random words, 50-400 per document) in a Parquet file, a byte-level BPE
trained here (4096 ids, a transformers fast tokenizer; nothing is downloaded), and in alternating rounds
`tokenize_files(..., settings=TokenizeSettings(workers=N))` (shards, documents.bin, index.json) and
`Dataset.map(tokenize, batched, num_proc=N)` over the same file loaded with `Dataset.from_parquet` beforehand (its Arrow cache written;
map writes its result to a fresh cache file). Both run with TOKENIZERS_PARALLELISM=false, so each
process is one core: tokens/s per core = tokens / wall time / N, and the rows give fntrain's rate over
datasets'. The median of the rounds is compared; these machines are noisy, so say "about".

Memory: Parquet corpora of S, 4S and 16S bytes of text (~40 MB row groups, uncompressed), each tokenized
with the bytes tokenizer by a fresh `python -c` child (workers 1, then 2 at the largest size) whose
ru_maxrss (and its workers') is the figure; corpus and shards are deleted after each size.

    python -m bench.tokenize_throughput [--quick] [--record]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import Row, bench_main, ratio_row

ROOT = Path(__file__).resolve().parents[1]
WORDS = 3000


def _vocabulary(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return np.array(["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(WORDS)])


def _documents(count: int, seed: int) -> list[str]:
    """`count` documents of 50-400 words drawn from a Zipf-like distribution (a pure function of seed)."""
    rng = np.random.default_rng(seed)
    words = _vocabulary()
    weights = 1.0 / np.arange(1, WORDS + 1)
    weights /= weights.sum()
    lengths = rng.integers(50, 400, count)
    picks = rng.choice(WORDS, int(lengths.sum()), p=weights)
    ends = np.cumsum(lengths)
    return [" ".join(words[picks[end - n : end]]) for n, end in zip(lengths, ends, strict=True)]


def _write_corpus(path: Path, documents: list[str], rows_per_group: int = 4096) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": documents}), path, row_group_size=rows_per_group)


def _tokenizer(documents: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(documents[:2000], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>")


def _fntrain_seconds(corpus: Path, out: Path, tokenizer, workers: int) -> tuple[float, int]:
    from fntrain.data.tokenize import TokenizeSettings, tokenize_files

    start = time.perf_counter()
    index = tokenize_files([corpus], out, tokenizer, settings=TokenizeSettings(workers=workers, batch_size=1000, overwrite=True))
    return time.perf_counter() - start, index.total_tokens - index.documents


def _datasets_seconds(dataset, tokenizer, cache: Path, workers: int) -> tuple[float, int]:
    def encode(batch):
        return tokenizer(batch["text"], add_special_tokens=False)

    start = time.perf_counter()
    mapped = dataset.map(encode, batched=True, batch_size=1000, num_proc=workers if workers > 1 else None,
                         remove_columns=["text"], cache_file_name=str(cache), load_from_cache_file=False)  # fmt: skip
    seconds = time.perf_counter() - start
    return seconds, sum(len(ids) for ids in mapped["input_ids"])


def throughput_rows(quick: bool) -> list[Row]:
    """Tokens/s per core of fntrain tokenize over datasets.map, for 1 and 2 processes."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import datasets

    import fntrain.data.tokenize  # noqa: F401 - imported before timing (it imports torch), as datasets is

    datasets.disable_progress_bars()
    documents = _documents(600 if quick else 3000, seed=1)
    tokenizer = _tokenizer(documents)
    rows, rounds = [], 1 if quick else 5
    with tempfile.TemporaryDirectory(prefix="fntrain-bench-tok-") as tmp:
        corpus = Path(tmp) / "corpus.parquet"
        _write_corpus(corpus, documents, rows_per_group=256)
        dataset = datasets.Dataset.from_parquet(str(corpus), cache_dir=str(Path(tmp) / "hf-cache"))
        megabytes = sum(len(d) for d in documents) / 1e6
        _fntrain_seconds(corpus, Path(tmp) / "shards", tokenizer, 1)  # warm-up: first-call costs of both
        _datasets_seconds(dataset, tokenizer, Path(tmp) / "warm.arrow", 1)
        for workers in (1, 2):
            ours, theirs = [], []
            for round_ in range(rounds):
                seconds, tokens = _fntrain_seconds(corpus, Path(tmp) / "shards", tokenizer, workers)
                ours.append(tokens / seconds / workers)
                seconds, their_tokens = _datasets_seconds(dataset, tokenizer, Path(tmp) / f"map{round_}.arrow", workers)
                assert their_tokens == tokens, (their_tokens, tokens)  # the same ids, counted both ways
                theirs.append(tokens / seconds / workers)
            rows.append(ratio_row(
                f"tokenize tokens/s per core, {workers} process{'es' if workers > 1 else ''}: fntrain / datasets.map",
                statistics.median(ours), statistics.median(theirs), unit="tok/s/core", goal_ratio=1.0,
                lower_is_better=False,
                note=f"{megabytes:.1f} MB of text, {tokens} tokens, BPE 4096 ids, batches of 1000, median of "
                     f"{rounds} round(s); fntrain writes shards + documents.bin, datasets.map an Arrow cache file",
            ))  # fmt: skip
    return rows


# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child would report its parent's peak.
# The workers' figure (ru_maxrss of the forked children) counts the pages they share with the main process.
_CHILD = """
import json, re, resource, sys
from fntrain.data.tokenize import TokenizeSettings, tokenize_files
imported = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
index = tokenize_files([sys.argv[1]], sys.argv[2], "bytes",
                       settings=TokenizeSettings(workers=int(sys.argv[3]), shard_tokens=int(sys.argv[4])))
peak = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
print(json.dumps({"self": peak, "imported": imported, "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                  "tokens": index.total_tokens}))
"""


def _generate_corpus(path: Path, text_bytes: int, seed: int) -> int:
    """A Parquet file of about `text_bytes` of text in ~64 MiB row groups (a block of generated documents
    written again with a changed first word each time); returns the text bytes written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    block = _documents(20_000, seed)  # about 40 MB of text
    block_bytes = sum(len(d) for d in block)
    written = 0
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="none") as writer:
        copy = 0
        while written < text_bytes:
            texts = [f"c{copy} {d}" for d in block]
            writer.write_table(pa.table({"text": texts}), row_group_size=len(texts))
            written += block_bytes + sum(len(f"c{copy} ") for _ in block)
            copy += 1
    return written


def _peak_rss(corpus: Path, out: Path, workers: int, shard_tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", _CHILD, str(corpus), str(out), str(workers), str(shard_tokens)],
                            capture_output=True, text=True, env=env, check=True)  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def memory_rows(quick: bool) -> list[Row]:
    """Peak RSS of tokenizing corpora of S, 4S, 16S bytes: the largest over the smallest."""
    base = (1 << 20) if quick else (300 << 20)
    shard_tokens = 1 << 20 if quick else 100_000_000
    figures = []
    with tempfile.TemporaryDirectory(prefix="fntrain-bench-rss-", dir="/tmp") as tmp:
        for step, size in enumerate((base, 4 * base, 16 * base)):
            corpus = Path(tmp) / "corpus.parquet"
            text = _generate_corpus(corpus, size, seed=step) if not quick else _small_corpus(corpus, size)
            started = time.perf_counter()
            peak = _peak_rss(corpus, Path(tmp) / "shards", 1, shard_tokens)
            seconds = time.perf_counter() - started
            peak2 = _peak_rss(corpus, Path(tmp) / "shards2", 2, shard_tokens) if step == 2 else None
            figures.append((text, corpus.stat().st_size, peak, seconds, peak2))
            print(f"  {text / 2**30:.2f} GiB text: peak RSS {peak['self'] / 1024:.0f} MiB in {seconds:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            corpus.unlink()
            shutil.rmtree(Path(tmp) / "shards", ignore_errors=True)
            shutil.rmtree(Path(tmp) / "shards2", ignore_errors=True)
    (small, _, small_peak, _, _), (big, big_file, big_peak, big_seconds, big2) = figures[0], figures[-1]
    sizes = "; ".join(f"{t / 2**30:.2f} GiB -> {p['self'] / 1024:.0f} MiB" for t, _, p, _, _ in figures)
    sizes += f" (of which {small_peak['imported'] / 1024:.0f} MiB after importing fntrain.data, torch included)"
    return [
        ratio_row(
            f"tokenize peak RSS, {big / 2**30:.2f} GiB corpus / {small / 2**30:.2f} GiB (1 process)",
            big_peak["self"] / 1024, small_peak["self"] / 1024, unit="MiB", goal_ratio=1.25,
            note=f"bytes tokenizer, Parquet row groups of ~40 MB, shard_tokens {shard_tokens}; text -> peak RSS: "
                 f"{sizes}; the largest took {big_seconds:.0f} s ({big / big_seconds / 2**20:.0f} MiB/s), file "
                 f"{big_file / 2**30:.2f} GiB; with 2 workers: main {big2['self'] / 1024:.0f} MiB, each worker "
                 f"at most {big2['workers'] / 1024:.0f} MiB",
        ),  # fmt: skip
    ]


def _small_corpus(path: Path, text_bytes: int) -> int:
    documents, total, seed = [], 0, 0
    while total < text_bytes:
        more = _documents(500, seed)
        documents += more
        total += sum(len(d) for d in more)
        seed += 1
    _write_corpus(path, documents, rows_per_group=500)
    return total


def run(quick: bool) -> list[Row]:
    return throughput_rows(quick) + memory_rows(quick)


if __name__ == "__main__":
    bench_main(run, "Tokenize: throughput against datasets.map, memory against corpus size", __doc__)
