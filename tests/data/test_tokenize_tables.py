"""`fntrain tokenize` over Parquet, Arrow IPC and `datasets.save_to_disk` inputs, and over worker
processes: the same shards as the JSONL of the same texts, byte-identical for 1 and 3 workers, and bad
tables refused in one line before anything is written (issue 27, item 1)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from fntrain.cli import dispatch  # noqa: E402
from fntrain.config import ConfigError  # noqa: E402
from fntrain.data import tables  # noqa: E402
from fntrain.data.shards import open_shards  # noqa: E402
from fntrain.data.tokenize import TokenizeSettings, tokenize_files  # noqa: E402
from fntrain.data.tokenize_inputs import input_files, read_documents  # noqa: E402
from tests.helpers.files import relative_paths  # noqa: E402

TEXTS = [f"document {n}: " + "words and more words " * (n % 5) for n in range(60)]


def output_bytes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def write_parquet_texts(path: Path, texts: list, *, row_group_size: int = 7, **columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts, **columns}), path, row_group_size=row_group_size)
    return path


def write_arrow_stream(path: Path, texts: list, *, batch_rows: int = 9) -> Path:
    """Arrow IPC in the stream format, in small record batches: what `datasets` writes."""
    table = pa.table({"text": texts, "id": list(range(len(texts)))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return path


def write_texts_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_parquet_and_arrow_give_the_shards_of_the_same_jsonl(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "ARROW_PIECE_BYTES", 64)  # many pieces from a small file
    reference = tokenize_files([write_texts_jsonl(tmp_path / "c.jsonl", TEXTS)], tmp_path / "ref", settings=TokenizeSettings(shard_tokens=500))
    parquet = write_parquet_texts(tmp_path / "c.parquet", TEXTS)
    assert pq.ParquetFile(parquet).metadata.num_row_groups == 9
    arrow = write_arrow_stream(tmp_path / "c.arrow", TEXTS)
    assert len(tables.table_pieces(arrow, "x")) > 3
    for name, source in (("parquet", parquet), ("arrow", arrow)):
        index = tokenize_files([source], tmp_path / name, settings=TokenizeSettings(shard_tokens=500, batch_size=4))
        assert index.documents == reference.documents == len(TEXTS)
        assert output_bytes(tmp_path / name) == output_bytes(tmp_path / "ref"), name


def test_nulls_and_empty_texts_are_no_document(tmp_path):
    source = write_parquet_texts(tmp_path / "n.parquet", ["ab", None, "", "cd"], row_group_size=2)
    assert list(read_documents([source])) == ["ab", "", "cd"]
    index = tokenize_files([source], tmp_path / "out")
    shards = open_shards(tmp_path / "out")
    assert index.documents == 2 and shards.read(0, len(shards)).tolist() == [*b"ab", 256, *b"cd", 256]


def test_a_save_to_disk_folder_and_a_folder_of_parquet_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": TEXTS[:30]}).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    saved = input_files([tmp_path / "saved"])
    assert len(saved) > 1 and all(p.suffix == ".arrow" for p in saved)
    assert list(read_documents([tmp_path / "saved"], text_key="body")) == TEXTS[:30]
    write_parquet_texts(tmp_path / "dir" / "b.parquet", TEXTS[30:])
    write_parquet_texts(tmp_path / "dir" / "a.parquet", TEXTS[:30])
    assert list(read_documents([tmp_path / "dir"])) == TEXTS[:30] + TEXTS[30:]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"is a DatasetDict folder \(splits: train\): name one split's folder"):
        input_files([tmp_path / "dd"])


def tiny_hf_tokenizer():
    """A byte-level BPE trained here (nothing downloaded), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_one_and_three_workers_write_the_same_bytes(tmp_path, tokenizer, monkeypatch):
    # No tokenizer threads in this process before the fork (a forked worker of a process whose fast
    # tokenizer pool ran can hang; `fntrain tokenize` forks before any encoding).
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    tok = tiny_hf_tokenizer() if tokenizer == "hf" else "bytes"
    inputs = [write_parquet_texts(tmp_path / "in" / "a.parquet", TEXTS, row_group_size=5),
              write_texts_jsonl(tmp_path / "in" / "b.jsonl", TEXTS[::-1]),
              write_arrow_stream(tmp_path / "in" / "c.arrow", TEXTS[:20])]  # fmt: skip
    results = {}
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        index = tokenize_files(inputs, out, tok, settings=TokenizeSettings(shard_tokens=700, batch_size=8, workers=workers))
        results[workers] = output_bytes(out)
    assert results[1] == results[3] and len(results[1]) > 3  # several shards, documents.bin, index.json
    assert index.documents == 2 * len(TEXTS) + 20
    if tokenizer == "hf":
        expected = [t for text in TEXTS for t in [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
        assert open_shards(tmp_path / "w3").read(0, len(expected)).tolist() == expected


def test_a_worker_error_names_the_row_and_leaves_nothing(tmp_path):
    source = write_parquet_texts(tmp_path / "in" / "a.parquet", TEXTS, row_group_size=5)
    before = relative_paths(tmp_path)
    with pytest.raises(ValueError, match=r"input '.*a.parquet' row 40: token id 100 is outside \[0, 99\]"):
        tokenize_files([source], tmp_path / "out", lambda text: [100 if "40" in text else 1], eos_id=0,
                       vocab_size=100, settings=TokenizeSettings(workers=2))  # fmt: skip
    assert relative_paths(tmp_path) == before


@pytest.fixture
def bad_tables(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    write_parquet_texts(tmp_path / "in" / "good.parquet", TEXTS[:5])
    write_parquet_texts(tmp_path / "in" / "body.parquet", [1, 2], body=["a", "b"])
    (tmp_path / "in" / "junk.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    (tmp_path / "in" / "junk.arrow").write_bytes(b"not arrow either")
    (tmp_path / "shards").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["in/good.parquet", "--text-key", "content"],
         "input 'in/good.parquet' has no column 'content' (columns: text)"),
        (["in/good.parquet", "in/body.parquet"], "input 'in/body.parquet' column 'text' holds int64, not strings"),
        (["in/good.parquet", "in/junk.parquet"], "input 'in/junk.parquet' is not a readable Parquet file"),
        (["in/good.parquet", "in/junk.arrow"], "input 'in/junk.arrow' is not a readable Arrow IPC file"),
        (["in/good.parquet", "--workers", "0"], "workers must be >= 1"),
    ],
    ids=["missing-column", "not-strings", "unreadable-parquet", "unreadable-arrow", "no-workers"],
)  # fmt: skip
def test_a_bad_table_is_one_line_before_any_output(bad_tables, capsys, argv, needle):
    before = relative_paths(bad_tables)
    with pytest.raises(SystemExit) as exited:
        dispatch(["tokenize", *argv, "--output", "shards/out"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err, err
    assert relative_paths(bad_tables) == before


def test_the_cli_reads_a_column_with_workers(bad_tables, capsys):
    index = dispatch(["tokenize", "in/body.parquet", "--text-key", "body", "--output", "out", "--workers", "2"])
    assert index.documents == 2
    assert np.asarray(open_shards(bad_tables / "out").read(0, 4)).tolist() == [*b"a", 256, *b"b", 256]


@pytest.mark.parametrize("workers", [1, 2])
def test_units_are_pulled_lazily_so_memory_is_bounded(workers):
    """At most 2 x workers units are in flight: the first block comes back before the rest of the input
    is read (an eager pool.map would read every unit first)."""
    from fntrain.data.tokenize_pool import TextBlock, encoded_blocks
    from fntrain.data.tokenizers import byte_tokenizer

    pulled = []

    def units():
        for n in range(50):
            pulled.append(n)
            yield TextBlock((f"text {n}",), first=n)

    blocks = encoded_blocks(units(), byte_tokenizer(), dtype=np.dtype("<u2"), limit=256, batch_size=4,
                            workers=workers)  # fmt: skip
    first = next(blocks)
    assert bytes(first.tokens[:-1].tolist()) == b"text 0" and len(pulled) <= 2 * workers
    assert [bytes(b.tokens[:-1].tolist()) for b in blocks] == [f"text {n}".encode() for n in range(1, 50)]
    assert len(pulled) == 50
