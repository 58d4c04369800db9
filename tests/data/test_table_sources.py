"""The SFT and VLM data read Parquet, Arrow and `datasets.save_to_disk` sources as they read JSONL: the
key flags map columns, null cells are missing keys, and a bad row is one line naming the file and its
row, before any model work (issue 27, item 1)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from fntrain.cli import dispatch  # noqa: E402
from fntrain.config import ConfigError  # noqa: E402
from fntrain.data.files import count_rows, read_rows, require_source  # noqa: E402
from fntrain.data.sft import SFTDataConfig, build_sft_datasets  # noqa: E402
from fntrain.data.vlm import VLMDataConfig, _load_images, build_vlm_datasets  # noqa: E402
from tests.data.test_sft import CharTokenizer, assets_of  # noqa: E402
from tests.helpers.files import file_hashes  # noqa: E402
from tests.helpers.hf import CHATS  # noqa: E402

ROWS = [{"question": f"Q{n}?", "answer": f" A{n}."} for n in range(6)]


def write_parquet_rows(path: Path, rows: list[dict], **options) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, **options)
    return path


def samples(dataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


def test_sft_columns_are_keys_and_give_the_examples_of_the_same_jsonl(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    parquet = write_parquet_rows(tmp_path / "d.parquet", ROWS, row_group_size=4)
    assets = assets_of(CharTokenizer())
    mapped = dict(prompt_key="question", completion_key="answer", max_length=32)
    from_jsonl, _ = build_sft_datasets(SFTDataConfig(path=str(jsonl), **mapped), assets)
    from_parquet, val = build_sft_datasets(SFTDataConfig(path=str(parquet), val_fraction=0.2, **mapped), assets)
    assert samples(from_parquet) + samples(val) == samples(from_jsonl) and len(val) == 1
    assert count_rows(str(parquet), "data.path") == 6
    assert read_rows(str(parquet), "data.path", ["question"])[5] == ("row 5", {"question": "Q5?"})


def test_chat_rows_from_a_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"messages": chat} for chat in CHATS]).save_to_disk(str(tmp_path / "chats"))
    data = SFTDataConfig(path=str(tmp_path / "chats"), max_length=128)
    data.validate()
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    assets = assets_of(CharTokenizer())
    assert samples(build_sft_datasets(data, assets)[0]) == samples(
        build_sft_datasets(SFTDataConfig(path=str(jsonl), max_length=128), assets)[0]
    )


def test_a_null_cell_is_a_missing_key_and_rows_are_named(tmp_path):
    rows = [{"text": "ab", "prompt": None}, {"text": None, "prompt": "p"}]
    parquet = write_parquet_rows(tmp_path / "n.parquet", rows)
    with pytest.raises(ConfigError, match=r"data.path '.*n.parquet' row 1: cannot tell the format of an example "
                                          r"with keys \['prompt'\]"):  # fmt: skip
        build_sft_datasets(SFTDataConfig(path=str(parquet)), assets_of(CharTokenizer()))
    with pytest.raises(ConfigError, match=r"has none of the columns 'body', .* \(columns: text, prompt\)"):
        build_sft_datasets(SFTDataConfig(path=str(parquet), format="text", text_key="body", prompt_key="q",
                                         completion_key="c", messages_key="m"), assets_of(CharTokenizer()))  # fmt: skip
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data.path '.*empty' is a directory, not a file"):
        require_source("data.path", str(tmp_path / "empty"))


def png_bytes(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_vlm_images_as_bytes_structs_and_relative_paths(tmp_path):
    pytest.importorskip("PIL")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png_bytes((0, 0, 255)))
    rows = [
        {"image": {"bytes": png_bytes((255, 0, 0)), "path": None}, "prompt": "colour?", "completion": "red"},
        {"image": {"bytes": None, "path": "img/a.png"}, "prompt": "colour?", "completion": "blue"},
    ]
    parquet = write_parquet_rows(tmp_path / "v.parquet", rows)
    train, _ = build_vlm_datasets(VLMDataConfig(path=str(parquet)), processor=None)
    assert len(train) == 2 and train.where(1).endswith("v.parquet' row 1")
    images = [_load_images(row["image"], train.root, "x")[0] for row in train.rows]
    assert [image.getpixel((0, 0)) for image in images] == [(255, 0, 0), (0, 0, 255)]
    bad = write_parquet_rows(tmp_path / "bad.parquet", [rows[0], {**rows[0], "image": {"bytes": b"junk", "path": None}}])
    with pytest.raises(ConfigError, match=r"data.path '.*bad.parquet' row 1: image 0 \(bytes\) is not an image"):
        build_vlm_datasets(VLMDataConfig(path=str(bad)), processor=None)


@pytest.fixture(scope="module")
def tokenizer_llama_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from tests.helpers.hf import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "model", ["to be or not to be"] * 8, vocab_size=300,
                           max_positions=64)  # fmt: skip


def _hf_argv(tmp_path: Path, hf_model: Path, data: Path) -> list[str]:
    # The recipe by module path: this checkout's, whatever the installed entry point names.
    return ["run", "recipes.hf_causal_lm", "--run-dir", str(tmp_path / "run"), "--model.path", str(hf_model),
            "--data.path", str(data), "--data.prompt-key", "question", "--data.completion-key", "answer",
            "--data.max-length", "32", "--train.train-iters", "2", "--train.global-batch-size", "2",
            "--train.micro-batch-size", "2", "--progress.no-enabled"]  # fmt: skip


def test_hf_causal_lm_refuses_a_bad_parquet_row_before_any_file(tmp_path, capsys, tokenizer_llama_dir):
    data = write_parquet_rows(tmp_path / "in" / "d.parquet", [*ROWS[:3], {"question": "Q?", "answer": None}, *ROWS[3:]])
    before = file_hashes(tmp_path)
    with pytest.raises(SystemExit) as exited:
        dispatch([*_hf_argv(tmp_path, tokenizer_llama_dir, data), "--data.format", "prompt_completion"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1, err
    assert "data.path " in err and "d.parquet' row 3: missing key 'answer'" in err, err
    assert file_hashes(tmp_path) == before and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_hf_causal_lm_trains_on_a_parquet_file(tmp_path, tokenizer_llama_dir):
    data = write_parquet_rows(tmp_path / "in" / "d.parquet", ROWS)
    dispatch(_hf_argv(tmp_path, tokenizer_llama_dir, data))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(row.get("step", 0) for row in metrics) == 2
