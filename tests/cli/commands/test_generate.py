"""`fntrain generate` on a tiny GPT run, as a user types it: from the run directory, a checkpoint
step_<N>/, the model.safetensors export and the run's hf_model (a GPT-2); the same seed gives the same
text; bad input is one line, exit status 2, nothing written (the HF models: tests/cli/commands/test_generate_hf.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fntrain.cli import dispatch
from fntrain.models.generate import ByteStreamer, GenerateOptions
from tests.helpers.files import tree_hashes


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny GPT trained for 2 steps (1 layer, width 32) with a checkpoint at step 2 and its exports."""
    run = tmp_path_factory.mktemp("generate") / "tiny"
    dispatch([
        "run", "tiny_gpt", "--run-dir", str(run), "--train.train-iters", "2", "--model.n-layer", "1",
        "--model.d-model", "32", "--model.n-head", "2", "--model.context", "64", "--checkpoint.save-every", "2",
        "--train.global-batch-size", "4", "--train.micro-batch-size", "4", "--evaluate.no-at-end",
        "--progress.no-enabled",
    ])  # fmt: skip
    assert (run / "checkpoints" / "step_2" / "COMPLETE").is_file() and (run / "model.safetensors").is_file()
    return run


def generate(capsys, *argv: str) -> tuple[list, str]:
    samples = dispatch(["generate", *argv])
    return samples, capsys.readouterr().out


def test_every_source_of_a_run_gives_the_same_greedy_text(run_dir, capsys):
    greedy = ("--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "12")
    found = {}
    for source in (
        run_dir,
        run_dir / "checkpoints" / "step_2",
        run_dir / "checkpoints",
        run_dir / "model.safetensors",
    ):
        samples, out = generate(capsys, str(source), *greedy)
        (sample,) = samples
        assert len(sample.token_ids) == 12 and out.startswith("ROMEO:")
        assert out == "ROMEO:" + sample.text + "\n" or "\ufffd" in out  # streamed bytes: the same text
        found[source.name] = sample.token_ids
    assert len(set(found.values())) == 1, found  # the checkpoint and the export: one model


def test_the_same_seed_gives_the_same_text_and_samples_are_headed(run_dir, capsys):
    args = (str(run_dir), "--prompt", "To be", "--max-new-tokens", "20", "--num-samples", "2", "--seed", "7")
    first, out = generate(capsys, *args)
    again, _ = generate(capsys, *args)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert [s.seed for s in first] == [7, 8] and first[0].token_ids != first[1].token_ids
    assert "--- sample 1/2 (seed 7) ---\nTo be" in out and "--- sample 2/2 (seed 8) ---\nTo be" in out
    several, out = generate(capsys, str(run_dir), "--prompt", "A", "--prompt", "B", "--max-new-tokens", "3")
    assert [s.prompt for s in several] == [
        "A",
        "B",
    ] and "--- prompt 2/2, sample 1/1 (seed 1234) ---\nB" in out


def test_a_prompt_file_and_a_prompt_longer_than_the_context(run_dir, tmp_path, caplog):
    (tmp_path / "prompt.txt").write_text("x" * 100 + "ROMEO:")
    with caplog.at_level("WARNING", logger="fntrain.generate"):
        (sample,) = dispatch(["generate", str(run_dir), "--prompt-file", str(tmp_path / "prompt.txt"),
                              "--max-new-tokens", "4"])  # fmt: skip
    assert sample.prompt.endswith("ROMEO:") and len(sample.token_ids) == 4
    (warning,) = [record.getMessage() for record in caplog.records if record.name == "fntrain.generate"]
    assert "106 tokens, more than the 64" in warning and "first 42 are dropped" in warning


def test_bytes_stream_as_their_characters_complete():
    import io

    out = io.StringIO()
    streamer = ByteStreamer(out)
    for byte in "é!".encode():
        streamer.put([byte])
    streamer.put([256])  # an EOS: no text
    streamer.end()
    assert out.getvalue() == "é!\n"


@pytest.fixture
def generate_inputs(run_dir, tmp_path, monkeypatch) -> Path:
    """tmp_path as the working directory, with a copy of the run, one of its checkpoint damaged, a
    run directory with nothing to load, and a picture that is no image."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(run_dir, tmp_path / "run")
    damaged = tmp_path / "damaged" / "step_2"
    shutil.copytree(run_dir / "checkpoints" / "step_2", damaged)
    data = next(damaged.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-8] + b"\0" * 8)
    (tmp_path / "empty").mkdir()
    shutil.copy(run_dir / "config.json", tmp_path / "empty" / "config.json")
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "picture.png").write_text("not read: a text model takes no image")
    return tmp_path


BAD = [
    ("missing-source", ["nowhere"], "'nowhere' does not exist"),
    ("damaged-checkpoint", ["damaged/step_2"], "damaged checkpoint: damaged/step_2/__0_0.distcp"),
    ("nothing-to-load", ["empty"], "run directory 'empty' has no complete checkpoint and no export: train with --checkpoint.save-every N"),
    ("not-a-source", ["run/logs"], "'run/logs' is not a run directory, a checkpoint or a Hugging Face model directory"),
    ("top-p-above-1", ["run", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    ("top-p-zero", ["run", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    ("negative-temperature", ["run", "--temperature", "-1"], "--temperature must be >= 0.0, got -1.0"),
    ("no-new-tokens", ["run", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("no-samples", ["run", "--num-samples", "0"], "--num-samples must be >= 1, got 0"),
    ("prompt-file-missing", ["run", "--prompt-file", "nope.txt"], "--prompt-file 'nope.txt' does not exist"),
    ("image-for-a-text-model", ["run", "--image", "picture.png"], "--image 'picture.png': 'run' is a text model; it takes no image"),
    ("unknown-recipe", ["run/model.safetensors", "--recipe", "nope"], "--recipe 'nope'"),
    ("unknown-device", ["run", "--device", "tpu"], "--device 'tpu'"),
    ("empty-prompt", ["run", "--prompt", ""], "--prompt '' has no tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "needle"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_one_line_and_leaves_the_disk_as_it_was(generate_inputs, capsys, argv, needle):
    before = tree_hashes(generate_inputs)
    with pytest.raises(SystemExit) as exited:
        dispatch(["generate", *argv])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert exited.value.code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert needle in err, err
    assert err.startswith("fntrain generate: ")
    assert tree_hashes(generate_inputs) == before


def test_options_defaults_are_valid():
    GenerateOptions().validate()


@pytest.mark.parametrize(("argv", "recipe"), [
    (["/venv/bin/fntrain", "run", "tiny_gpt", "--run-dir", "runs/tiny"], "tiny_gpt"),
    (["/site/fntrain/__main__.py", "run", "./my_gpt.py"], "/work/my_gpt.py"),
    (["my_gpt.py", "--run-dir", "x"], "/work/my_gpt.py"),
    (["/site/fntrain/__main__.py", "plan", "--help"], None),
    (["python", "-c", "..."], None),
])  # fmt: skip
def test_a_run_without_checkpoints_names_its_recipe_by_its_command_line(tmp_path, argv, recipe):
    from fntrain.models.sources import recorded_recipe

    (tmp_path / "run_metadata.json").write_text(json.dumps({"command": {"argv": argv, "cwd": "/work"}}))
    assert recorded_recipe(tmp_path) == recipe


def test_tokens_stream_as_their_text_completes():
    import io

    from fntrain.models.generate import TokenStreamer

    class Bytes:  # a tokenizer whose ids are UTF-8 bytes: a character may span several ids
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    streamer = TokenStreamer(Bytes(), out)
    written = []
    for byte in "aé".encode():
        streamer.put([byte])
        written.append(out.getvalue())
    streamer.end()
    assert written == ["a", "a", "aé"] and out.getvalue() == "aé\n"  # the half of é waits for its other half
    out = io.StringIO()
    streamer = TokenStreamer(Bytes(), out)
    for byte in b"a\nb":
        streamer.put([byte])
    assert streamer.ids == [ord("b")]  # a line written is forgotten: decoding stays linear
    streamer.end()
    assert out.getvalue() == "a\nb\n"


def test_generate_writes_the_text_the_run_sampled_at_that_checkpoint(run_dir, capsys):
    """One sampling default (`fntrain.sampling.TEXT_DEFAULTS`) and seed for `fntrain generate` and the
    samples during training: the step-2 checkpoint writes the run's step-2 sample from its prompt."""
    (logged,) = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert (logged["step"], logged["prompt"]) == (2, "ROMEO:")  # tiny_gpt's default prompt, at the end
    (sample,), _ = generate(capsys, str(run_dir / "checkpoints" / "step_2"), "--prompt", "ROMEO:",
                            "--max-new-tokens", "64")  # fmt: skip  (the samples' length; defaults otherwise)
    assert sample.seed == 1234 and len(sample.token_ids) == 64
    assert sample.text == logged["text"]


def test_the_exports_carry_their_tokenizer_and_load_in_transformers(run_dir, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    dispatch(["export", str(run_dir / "checkpoints"), "--format", "hf", str(tmp_path / "exported")])
    greedy = ("--prompt", "ROMEO: é", "--temperature", "0", "--max-new-tokens", "12")
    (expected,), _ = generate(capsys, str(run_dir), *greedy)
    for directory in (run_dir / "hf_model", tmp_path / "exported"):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
        assert tokenizer("ROMEO: é")["input_ids"] == list("ROMEO: é".encode())
        assert tokenizer.eos_token_id is not None and model.config.vocab_size == 256
        (sample,), out = generate(capsys, str(directory), *greedy)  # through the exported tokenizer
        assert sample.token_ids == expected.token_ids and out.startswith("ROMEO: é")
