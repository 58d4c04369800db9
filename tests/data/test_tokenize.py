"""`fntrain tokenize`: text/JSONL -> token shards with EOS between documents, deterministic, configurable
shard size; tokenizer adapters (bytes, callables, Hugging Face); the CLI (issue 12, item 4)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from fntrain.cli import dispatch
from fntrain.data.shard_index import INDEX_NAME, read_index
from fntrain.data.shards import TokenDocuments, open_shards
from fntrain.data.tokenize import TokenizeSettings, tokenize_documents, tokenize_files
from fntrain.data.tokenize_inputs import input_files, read_documents
from fntrain.data.tokenizers import as_tokenizer, byte_tokenizer, hf_tokenizer
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["To be, or not to be", "", "that is the question:", "Whether 'tis nobler — in the mind"]


def stream_of(directory: Path) -> list[int]:
    shards = open_shards(directory)
    return shards.read(0, len(shards)).tolist()


def write_numbered_texts(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: text, "id": n}) + "\n" for n, text in enumerate(texts)))
    return path


def test_bytes_tokenizer_writes_documents_with_eos_between_them(tmp_path):
    corpus = write_numbered_texts(tmp_path / "corpus.jsonl", TEXTS)
    index = tokenize_files([corpus], tmp_path / "out", settings=TokenizeSettings(shard_tokens=16))
    kept = [t for t in TEXTS if t]  # an empty document is skipped (no lone EOS)
    expected = [token for text in kept for token in [*text.encode("utf-8"), 256]]
    assert stream_of(tmp_path / "out") == expected
    assert index.eos_id == 256 and index.vocab_size == 257 and index.tokenizer == "bytes"
    assert index.dtype == "<u2" and index.documents == len(kept) and index.total_tokens == len(expected)
    assert [s.tokens for s in index.shards] == [16] * (len(expected) // 16) + [len(expected) % 16]
    # The document index gives each document back, EOS included.
    docs = TokenDocuments(tmp_path / "out")
    assert [bytes(docs[i][:-1].tolist()).decode() for i in range(len(docs))] == kept
    assert all(int(docs[i][-1]) == 256 for i in range(len(docs)))


def test_output_is_deterministic_byte_for_byte(tmp_path):
    corpus = write_numbered_texts(tmp_path / "corpus.jsonl", TEXTS * 20)
    files = []
    for name in ("a", "b"):
        tokenize_files([corpus], tmp_path / name, settings=TokenizeSettings(shard_tokens=100, format="npy"))
        files.append({p.name: p.read_bytes() for p in sorted((tmp_path / name).iterdir())})
    assert files[0] == files[1] and len(files[0]) == 2 + len(read_index(tmp_path / "a").shards)
    index_text = (tmp_path / "a" / INDEX_NAME).read_text()
    assert str(tmp_path) not in index_text  # no absolute path or timestamp in the index


def test_txt_splits_gzip_and_directories_in_sorted_order(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "b.txt").write_text("line one\nline two\n\nthird para\n")
    with gzip.open(tmp_path / "in" / "sub" / "a.jsonl.gz", "wt") as gz:
        gz.write(json.dumps({"body": "zipped"}) + "\n\n")
    (tmp_path / "in" / "notes.md").write_text("ignored: not a .txt or .jsonl file")
    assert [p.relative_to(tmp_path).as_posix() for p in input_files([tmp_path / "in"])] == [
        "in/b.txt", "in/sub/a.jsonl.gz",
    ]  # fmt: skip
    docs = {split: list(read_documents([tmp_path / "in"], text_key="body", split=split))
            for split in ("file", "line", "paragraph")}  # fmt: skip
    assert docs["file"] == ["line one\nline two\n\nthird para\n", "zipped"]
    assert docs["line"] == ["line one", "line two", "third para", "zipped"]
    assert docs["paragraph"] == ["line one\nline two", "third para\n", "zipped"]


def test_callable_tokenizer_and_id_checks(tmp_path):
    words = {"a": 1, "b": 2, "c": 70_000}

    def encode(text: str) -> list[int]:
        return [words[w] for w in text.split()]

    index = tokenize_documents(["a b", "b a a"], tmp_path / "small", encode, eos_id=0, vocab_size=3)
    assert index.dtype == "<u2" and stream_of(tmp_path / "small") == [1, 2, 0, 2, 1, 1, 0]
    big = tokenize_documents(["c a"], tmp_path / "big", encode, eos_id=0, vocab_size=80_000)
    assert big.dtype == "<u4" and stream_of(tmp_path / "big") == [70_000, 1, 0]
    with pytest.raises(ValueError, match="token id 70000 is outside"):
        tokenize_documents(["c"], tmp_path / "bad", encode, eos_id=0, vocab_size=3)
    with pytest.raises(ValueError, match="needs eos_id"):
        as_tokenizer(encode)
    with pytest.raises(ValueError, match="eos_id 5 is outside the vocabulary of 3"):
        as_tokenizer(encode, eos_id=5, vocab_size=3)
    assert byte_tokenizer(eos_id=0).vocab_size == 256


class FakeHFTokenizer:
    """Stands in for a Hugging Face tokenizer: whitespace words, EOS id 1, a batch call."""

    name_or_path = "fake-hf"
    eos_token_id = 1

    def __init__(self):
        self.vocab = {"<unk>": 0, "</s>": 1}
        self.batch_calls = 0

    def __len__(self) -> int:
        return 50

    def _ids(self, text: str) -> list[int]:
        return [self.vocab.setdefault(word, len(self.vocab)) for word in text.split()]

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False  # EOS is the shard writer's job
        if isinstance(text, list):
            self.batch_calls += 1
            return {"input_ids": [self._ids(t) for t in text]}
        return {"input_ids": self._ids(text)}


def test_hugging_face_tokenizers_are_called_in_batches(tmp_path):
    fake = FakeHFTokenizer()
    tokenizer = hf_tokenizer(fake)
    assert tokenizer.eos_id == 1 and tokenizer.vocab_size == 50 and tokenizer.name == "fake-hf"
    texts = [f"w{n % 7} x{n % 3}" for n in range(25)]
    tokenize_documents(texts, tmp_path / "out", fake, settings=TokenizeSettings(batch_size=10))
    assert fake.batch_calls == 3
    reference = FakeHFTokenizer()  # assigns ids in order of first appearance, like the batched run did
    expected = [t for text in texts for t in [*reference._ids(text), 1]]
    assert stream_of(tmp_path / "out") == expected


def test_an_existing_output_is_kept_unless_overwrite(tmp_path):
    corpus = write_numbered_texts(tmp_path / "corpus.jsonl", ["abc", "de"])
    tokenize_files(corpus, tmp_path / "out", settings=TokenizeSettings(shard_tokens=2))
    (tmp_path / "out" / "README").write_text("mine")
    with pytest.raises(FileExistsError, match="already holds token shards"):
        tokenize_files(corpus, tmp_path / "out")
    index = tokenize_files(corpus, tmp_path / "out", settings=TokenizeSettings(overwrite=True))  # default shard size: one shard now
    assert len(index.shards) == 1 and (tmp_path / "out" / "README").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "README", "documents.bin", "index.json", "shard_00000.bin",
    ]  # fmt: skip


def test_bad_inputs_fail_before_writing(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        tokenize_files([tmp_path / "missing.jsonl"], tmp_path / "out")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="must be a .txt or .jsonl"):
        tokenize_files([tmp_path / "data.csv"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(
        ValueError, match=r"input '.*bad.jsonl' line 2: expected an object with a string 'text' field"
    ):
        tokenize_files([tmp_path / "bad.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="shard_tokens must be >= 1"):
        tokenize_documents(["x"], tmp_path / "out2", settings=TokenizeSettings(shard_tokens=0))


def tree_contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in root.rglob("*")}


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{nope\n', r"input '.*bad.jsonl' line 3: not JSON"),
        ("late.jsonl", '{"text": "a"}\n' * 50 + '{"body": "x"}\n', r"late.jsonl' line 51: expected an object"),
        ("binary.txt", bytes(range(256)) * 4, r"input '.*binary.txt' is not UTF-8 text"),
        ("binary.jsonl", bytes(range(256)) * 4, r"input '.*binary.jsonl' is not UTF-8 text"),
        ("fake.txt.gz", "not gzip", r"input '.*fake.txt.gz' cannot be read"),
    ],
)  # fmt: skip
def test_a_failed_tokenization_leaves_the_disk_as_it_found_it(tmp_path, name, content, message):
    """The inputs are read through before anything is written: a bad line anywhere fails at once, the
    output (new, or an existing tokenization being overwritten) left exactly as it was, and the
    corrected rerun needs no --overwrite."""
    bad = tmp_path / "in" / name
    bad.parent.mkdir()
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    good = write_numbered_texts(tmp_path / "in" / "good.jsonl", ["abc", "de"])
    before = tree_contents(tmp_path)
    with pytest.raises(ValueError, match=message):
        tokenize_files([good, bad], tmp_path / "out" / "deep", settings=TokenizeSettings(shard_tokens=2))
    assert tree_contents(tmp_path) == before  # no output, no parent made, no staging left
    tokenize_files([good], tmp_path / "old", settings=TokenizeSettings(shard_tokens=2))
    (tmp_path / "old" / "README").write_text("mine")
    before = tree_contents(tmp_path)
    with pytest.raises(ValueError, match=message):
        tokenize_files([good, bad], tmp_path / "old", settings=TokenizeSettings(overwrite=True))
    assert tree_contents(tmp_path) == before  # the old shards whole, the other file untouched


def test_a_failure_while_writing_removes_the_staged_shards(tmp_path):
    """A tokenizer that fails half way (after shards were written): nothing is left."""
    calls = []

    def encode(text):
        calls.append(text)
        if len(calls) == 3:
            raise ValueError("tokenizer broke")
        return [1, 2, 3]

    before = tree_contents(tmp_path)
    with pytest.raises(ValueError, match="tokenizer broke"):
        tokenize_documents(["a", "b", "c"], tmp_path / "out", encode, eos_id=0, settings=TokenizeSettings(shard_tokens=2))
    assert tree_contents(tmp_path) == before
    index = tokenize_documents(["a", "b"], tmp_path / "out", lambda text: [1, 2, 3], eos_id=0, settings=TokenizeSettings(shard_tokens=2))
    assert index.total_tokens == 8 and (tmp_path / "out" / "index.json").is_file()  # no --overwrite needed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda out: out.write_text("x"), r"output '.*out' exists and is not a directory"),
        (lambda out: (out.parent / "file").write_text("x"), r"output '.*file/out' cannot be created: '.*file' is a file"),
    ],
)  # fmt: skip
def test_an_output_that_cannot_be_a_directory_fails_before_reading(tmp_path, make, message):
    corpus = write_numbered_texts(tmp_path / "corpus.jsonl", ["abc"])
    out = tmp_path / "out"
    make(out)
    target = out if out.exists() else tmp_path / "file" / "out"
    before = tree_contents(tmp_path)
    with pytest.raises(FileExistsError, match=message):
        tokenize_files(corpus, target)
    assert tree_contents(tmp_path) == before


# ----------------------------------------------------------------------------- the command


def test_fntrain_tokenize_command(tmp_path, capsys):
    corpus = write_numbered_texts(tmp_path / "corpus.jsonl", TEXTS)
    index = dispatch(["tokenize", str(corpus), "--output", str(tmp_path / "out"), "--shard-tokens", "32",
                      "--format", "npy"])  # fmt: skip
    assert index == read_index(tmp_path / "out") and len(index.shards) > 1
    assert index.shards[0].path.endswith(".npy")
    out = capsys.readouterr().out
    assert f"{index.total_tokens} tokens, 3 documents" in out
    assert stream_of(tmp_path / "out") == stream_of_function(tmp_path, corpus)
    # An occupied output or a missing input: a message and exit status 2, no traceback.
    for argv, words in (
        (["tokenize", str(corpus), "--output", str(tmp_path / "out")], "already holds token shards"),
        (["tokenize", str(tmp_path / "nope.txt"), "--output", str(tmp_path / "o")], "does not exist"),
        (["tokenize", "--output", str(tmp_path / "o")], "at least one input"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            dispatch(argv)
        assert exit_info.value.code == 2 and words in capsys.readouterr().err


def stream_of_function(tmp_path: Path, corpus: Path) -> list[int]:
    tokenize_files([corpus], tmp_path / "via_function")
    return stream_of(tmp_path / "via_function")


def test_python_dash_m_fntrain_tokenize(tmp_path, fork_env):
    (tmp_path / "play.txt").write_text("Enter GHOST.\n\nExit GHOST.\n")
    result = run_to_end(
        [fork_env["PYTHON_FORK"], "-m", "fntrain", "tokenize", str(tmp_path / "play.txt"), "--output",
         str(tmp_path / "out"), "--split", "paragraph", "--eos-id", "0"],
        "`python -m fntrain tokenize` of a play", 120, cwd=ROOT, env=fork_env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "2 documents" in result.stdout
    assert stream_of(tmp_path / "out") == [*b"Enter GHOST.", 0, *b"Exit GHOST.\n", 0]
    assert np.dtype(read_index(tmp_path / "out").dtype) == np.uint16


@pytest.mark.slow
def test_a_saved_hugging_face_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "!": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        tmp_path / "tok"
    )
    corpus = write_numbered_texts(tmp_path / "c.jsonl", ["hello world !", "world hello"])
    index = dispatch(["tokenize", str(corpus), "--output", str(tmp_path / "out"), "--tokenizer",
                      str(tmp_path / "tok")])  # fmt: skip
    reference = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    expected = [
        t
        for text in ("hello world !", "world hello")
        for t in [*reference(text, add_special_tokens=False)["input_ids"], 1]
    ]
    assert stream_of(tmp_path / "out") == expected == [2, 3, 4, 1, 3, 2, 1]
    assert index.eos_id == 1 and index.vocab_size == 5
