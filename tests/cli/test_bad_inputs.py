"""Bad input, as a new user types it: exit status 2, one line naming the flag or file as typed and the
value, no traceback, no file created, and an existing good run left byte for byte as it was.

Each case is a command line of `fntrain run`; `{tmp}` is the test's temporary directory, `{good}` a
finished tiny-GPT run with checkpoints (copied per test), `{hf}` a tiny Hugging Face model directory.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from fntrain.cli import dispatch
from tests.helpers.commands import expect_one_line
from tests.helpers.files import file_hashes_and_siblings, write_file

SMALL = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.d-model", "16", "--model.context", "16",
    "--train.train-iters", "2", "--train.global-batch-size", "4", "--train.micro-batch-size", "4",
    "--progress.no-enabled", "--log-every", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """A finished tiny-GPT run with two checkpoints."""
    run_dir = tmp_path_factory.mktemp("good") / "run"
    dispatch(["run", "tiny_gpt", "--run-dir", str(run_dir), *SMALL, "--checkpoint.save-every", "1"])
    return run_dir


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.helpers.hf import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "model", ["to be or not to be"] * 8, vocab_size=300,
                           max_positions=64)  # fmt: skip


# (id, extra args after `run tiny_gpt --run-dir {tmp}/run`, what the line must contain)
TINY_CASES = [
    ("seed-negative", ["--seed", "-1"], "--seed"),
    ("seed-too-big", ["--seed", str(2**32)], "--seed"),
    ("log-every-negative", ["--log-every", "-1"], "--log-every"),
    ("train-iters-zero", ["--train.train-iters", "0"], "--train.train-iters"),
    ("train-iters-huge", ["--train.train-iters", "99999999999999999999999"], "--train.train-iters"),
    ("global-batch-indivisible", ["--train.global-batch-size", "6"], "--train.global-batch-size"),
    ("micro-batch-zero", ["--train.micro-batch-size", "0"], "--train.micro-batch-size"),
    ("grad-norm-negative", ["--train.max-grad-norm", "-1"], "--train.max-grad-norm"),
    ("samples-and-iters", ["--train.train-samples", "8"], "--train.train-iters"),
    ("lr-negative", ["--optim.lr", "-1"], "--optim.lr"),
    ("warmup-negative", ["--schedule.warmup-iters", "-1"], "--schedule.warmup-iters"),
    ("workers-negative", ["--loader.num-workers", "-1"], "--loader.num-workers"),
    ("prefetch-depth-zero", ["--loader.prefetch-depth", "0"], "--loader.prefetch-depth"),
    ("heads-indivisible", ["--model.d-model", "15"], "--model.d-model"),
    ("dropout-above-one", ["--model.dropout", "2"], "--model.dropout"),
    ("vocab-too-small", ["--model.vocab-size", "10"], "--model.vocab-size"),
    ("data-missing", ["--data.path", "{tmp}/missing.txt"], "missing.txt"),
    ("data-directory", ["--data.path", "{tmp}"], "directory"),
    ("data-empty", ["--data.path", "{empty}"], "empty.txt"),
    ("data-too-small", ["--data.path", "{short}"], "optimizer step"),
    ("shards-missing", ["--data.shards", "{tmp}/no-shards"], "--data.shards"),
    ("shards-garbage-index", ["--data.shards", "{garbage_shards}"], "garbage"),
    ("val-fraction-large", ["--data.val-fraction", "0.9"], "--data.val-fraction"),
    ("ddp-without-torchrun", ["--parallel.strategy", "ddp"], "torchrun"),
    ("fsdp2-without-torchrun", ["--parallel.strategy", "fsdp2"], "torchrun"),
    ("tp-larger-than-world", ["--parallel.tp-size", "2"], "tp"),
    ("pp-larger-than-world", ["--parallel.pp-size", "3"], "pp"),
    ("compile-backend-bogus", ["--parallel.compile", "--parallel.compile-backend", "bogus"], "bogus"),
    ("cuda-on-cpu", ["--runtime.device", "cuda"], "cuda"),
    ("memory-history-on-cpu", ["--memory.enable"], "--memory.enable"),
    ("memory-window-reversed", ["--memory.start-step", "3", "--memory.end-step", "1"], "--memory.end-step"),
    ("profiler-rank-out-of-range", ["--profiler.enabled", "--profiler.rank-ids", "8"], "--profiler.rank-ids"),
    ("profiler-window-reversed", ["--profiler.enabled", "--profiler.start-step", "10", "--profiler.stop-step", "5"],
     "--profiler.stop-step"),
    ("profiler-window-after-run", ["--profiler.enabled", "--profiler.start-step", "50", "--profiler.stop-step", "60"],
     "--profiler.start-step"),
    ("memory-window-after-run", ["--memory.mem-info", "--memory.start-step", "50", "--memory.end-step", "60"],
     "--memory.start-step"),
    ("keep-last-negative", ["--checkpoint.keep-last", "-1"], "--checkpoint.keep-last"),
    ("save-every-negative", ["--checkpoint.save-every", "-1"], "--checkpoint.save-every"),
    ("restore-missing", ["--checkpoint.restore-from", "{tmp}/nowhere/step_3"], "nowhere"),
    ("preempt-sigint", ["--checkpoint.preempt-signals", "SIGINT"], "SIGINT"),
    ("preempt-unknown-signal", ["--checkpoint.preempt-signals", "SIGBOGUS"], "SIGBOGUS"),
    ("checkpoint-dir-is-file", ["--checkpoint.dir", "{afile}", "--checkpoint.save-every", "1"], "a-file"),
    ("eval-every-negative", ["--evaluate.eval-every", "-1"], "--evaluate.eval-every"),
    ("gc-every-negative", ["--gc.gc-every", "-1"], "--gc.gc-every"),
    ("watchdog-factor-negative", ["--watchdog.factor", "-1"], "--watchdog.factor"),
    ("config-missing", ["--config", "{tmp}/missing.toml"], "missing.toml"),
    ("config-directory", ["--config", "{tmp}"], "directory"),
    ("config-bad-toml", ["--config", "{bad_toml}"], "bad.toml"),
    ("config-bad-yaml", ["--config", "{bad_yaml}"], "bad.yaml"),
    ("config-binary", ["--config", "{binary}"], "binary.toml"),
    ("config-unknown-key", ["--config", "{unknown_key}"], "bogus"),
    ("config-wrong-type", ["--config", "{wrong_type}"], "train_iters"),
    # /proc exists on every Linux and takes no new directory, even from root (os.access says it would)
    ("run-dir-on-proc", ["--run-dir", "/proc/fntrain-run"], "--run-dir '/proc/fntrain-run' cannot be created"),
    ("run-dir-is-proc", ["--run-dir", "/proc"], "--run-dir '/proc' is not writable"),
]  # fmt: skip


def _files(tmp: Path) -> dict[str, str]:
    """The input files the cases name, made in `tmp`."""
    shards = tmp / "garbage-shards"
    return {
        "tmp": str(tmp),
        "empty": write_file(tmp / "inputs" / "empty.txt", b""),
        "short": write_file(tmp / "inputs" / "short.txt", "to be or not to be, that is the question\n"),
        "garbage_shards": (write_file(shards / "index.json", "garbage, not an index"), str(shards))[1],
        "afile": write_file(tmp / "inputs" / "a-file", "not a directory"),
        "bad_toml": write_file(tmp / "inputs" / "bad.toml", "[train\ntrain_iters = 3\n"),
        "bad_yaml": write_file(tmp / "inputs" / "bad.yaml", "train:\n  train_iters: [3\n  seed: 1\n"),
        "binary": write_file(tmp / "inputs" / "binary.toml", bytes(range(256)) * 4),
        "unknown_key": write_file(tmp / "inputs" / "unknown.toml", "[train]\nbogus = 3\n"),
        "wrong_type": write_file(tmp / "inputs" / "wrong.toml", '[train]\ntrain_iters = "many"\n'),
    }


@pytest.mark.parametrize("args, needle", [case[1:] for case in TINY_CASES], ids=[case[0] for case in TINY_CASES])
def test_a_bad_setting_is_one_line_and_creates_nothing(tmp_path, capsys, args, needle):
    pytest.importorskip("yaml")
    files = _files(tmp_path / "in")
    before = file_hashes_and_siblings(tmp_path)
    argv = ["run", "tiny_gpt", "--run-dir", str(tmp_path / "run"), *SMALL, *[a.format(**files) for a in args]]
    expect_one_line(capsys, argv, needle)
    assert file_hashes_and_siblings(tmp_path) == before


GOOD_RUN_CASES = [
    ("resume-with-wandb-missing", ["--checkpoint.restore-from", "latest", "--metrics.wandb"], "--metrics.wandb"),
    ("resume-with-mlflow-missing", ["--checkpoint.restore-from", "latest", "--metrics.mlflow"], "--metrics.mlflow"),
    ("resume-with-tensorboard-missing", ["--checkpoint.restore-from", "latest", "--metrics.tensorboard"],
     "--metrics.tensorboard"),
    ("resume-with-other-settings", ["--checkpoint.restore-from", "latest", "--optim.lr", "0.5"], "optim.lr"),
    ("resume-bad-profiler-rank", ["--checkpoint.restore-from", "latest", "--profiler.enabled",
                                  "--profiler.rank-ids", "8"], "--profiler.rank-ids"),
    ("second-run-into-it", ["--checkpoint.restore-from", "none"], "already holds a run"),
    ("rerun-with-other-settings", ["--seed", "7"], "--seed 42 -> 7; resume with the same settings, or name each "
     "field in --checkpoint.allow-changes; for a new run: --overwrite (which moves this one to"),
    ("overwrite-with-too-small-data", ["--overwrite", "--data.path", "{short}"], "optimizer step"),
    ("overwrite-with-missing-data", ["--overwrite", "--data.path", "{tmp}/missing.txt"], "missing.txt"),
    ("overwrite-with-bad-seed", ["--overwrite", "--seed", "-5"], "--seed"),
    ("restore-step-missing", ["--checkpoint.restore-from", "{good}/checkpoints/step_99"], "step_99"),
]  # fmt: skip


@pytest.mark.parametrize("args, needle", [c[1:] for c in GOOD_RUN_CASES], ids=[c[0] for c in GOOD_RUN_CASES])
def test_a_bad_command_leaves_a_good_run_byte_identical(tmp_path, capsys, monkeypatch, good_run, args, needle):
    for package in ("wandb", "mlflow", "tensorboard"):  # as on a machine without the extras
        monkeypatch.setitem(sys.modules, package, None)
    good = tmp_path / "good"
    shutil.copytree(good_run, good)
    files = {**_files(tmp_path / "in"), "good": str(good)}
    before = file_hashes_and_siblings(good)
    argv = ["run", "tiny_gpt", "--run-dir", str(good), *SMALL, *[a.format(**files) for a in args]]
    expect_one_line(capsys, argv, needle)
    assert file_hashes_and_siblings(good) == before


def test_a_rerun_with_other_settings_names_both_ways_to_a_new_run_and_each_works(tmp_path, capsys, good_run):
    """[issue 48] The refusal named resuming and allow-changes only; a user who wants a new run is told
    --overwrite and another --run-dir, and either just works."""
    good = tmp_path / "kept" / "good"  # alone in its parent: the snapshot sees its siblings
    shutil.copytree(good_run, good)
    before = file_hashes_and_siblings(good)
    argv = ["run", "tiny_gpt", "--run-dir", str(good), *SMALL, "--seed", "7"]
    err = expect_one_line(capsys, argv, "--seed 42 -> 7")
    assert "for a new run: --overwrite (which moves this one to " in err and err.endswith("or another --run-dir")
    assert file_hashes_and_siblings(good) == before
    other = ["run", "tiny_gpt", "--run-dir", str(tmp_path / "other"), *SMALL, "--seed", "7"]
    assert dispatch(other).outcome == "completed"
    assert file_hashes_and_siblings(good) == before
    assert dispatch([*argv, "--overwrite"]).outcome == "completed"
    assert len(list(good.parent.glob("good.replaced-*"))) == 1  # the old run, moved aside whole


def test_another_runs_checkpoint_dir_is_refused_and_restore_from_is_the_way_out(tmp_path, capsys, good_run):
    """[issue 48] A new run pointed at another run's checkpoints adopted them and wrote there: two run
    directories shared one checkpoint directory. Refused in one line naming both, before any work;
    --checkpoint.restore-from starts the new run from that checkpoint without writing into it."""
    good = tmp_path / "kept" / "good"  # alone in its parent: the snapshot sees its siblings
    shutil.copytree(good_run, good)
    before = file_hashes_and_siblings(good)
    new = tmp_path / "new"
    argv = ["run", "tiny_gpt", "--run-dir", str(new), *SMALL, "--checkpoint.dir", str(good / "checkpoints")]
    err = expect_one_line(capsys, argv, f"--checkpoint.dir '{good / 'checkpoints'}' holds the checkpoints of the run in")
    assert f"not of run_dir '{new}'" in err and "two run directories cannot share one checkpoint directory" in err
    assert f"--checkpoint.restore-from '{good / 'checkpoints' / 'step_2'}' and no --checkpoint.dir" in err
    assert not new.exists() and file_hashes_and_siblings(good) == before
    longer = ["--train.train-iters", "3", "--checkpoint.allow-changes", "train.train_iters"]
    result = dispatch(["run", "tiny_gpt", "--run-dir", str(new), *SMALL, "--checkpoint.restore-from",
                       str(good / "checkpoints" / "step_2"), *longer])  # fmt: skip
    assert result.state.global_step == 3 and (new / "checkpoints" / "step_3").is_dir()
    assert file_hashes_and_siblings(good) == before
    assert dispatch(["run", "tiny_gpt", "--run-dir", str(new), *SMALL, *longer]).outcome == "completed"  # its own


def test_a_moved_or_copied_run_directory_keeps_its_checkpoints(tmp_path, good_run):
    """Its checkpoints record the run directory they were written in; under the run directory they are
    its own wherever it went (one run per directory holds, and a run directory travels)."""
    moved = tmp_path / "moved"
    shutil.copytree(good_run, moved)
    longer = ["--train.train-iters", "3", "--checkpoint.allow-changes", "train.train_iters"]
    assert dispatch(["run", "tiny_gpt", "--run-dir", str(moved), *SMALL, *longer]).state.global_step == 3


def _hf_files(tmp: Path, hf_model: Path) -> dict[str, str]:
    rows = [{"prompt": "to be", "completion": " or not"}] * 4
    jsonl = "".join(json.dumps(row) + "\n" for row in rows)
    no_tokenizer = tmp / "no-tokenizer"
    shutil.copytree(hf_model, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    return {
        "tmp": str(tmp),
        "hf": str(hf_model),
        "no_tokenizer": str(no_tokenizer),
        "good_jsonl": write_file(tmp / "good.jsonl", jsonl),
        "bad_json": write_file(tmp / "bad.jsonl", jsonl[: len(jsonl) // 2] + "{not json\n" + jsonl),
        "empty_jsonl": write_file(tmp / "empty.jsonl", ""),
        "not_json": write_file(tmp / "prose.jsonl", "It was the best of times.\nIt was the worst of times.\n"),
        "no_field": write_file(tmp / "nofield.jsonl", '{"title": "x"}\n' * 4),
        "afile": write_file(tmp / "out-file", "a file"),
        "qa_jsonl": write_file(tmp / "qa.jsonl", '{"question": "to be", "answer": " or not"}\n' * 4),
        # config.json alone decides the kind (the weights file only has to be there)
        "vlm_dir": (write_file(tmp / "llava" / "config.json", json.dumps(
            {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"})),
            write_file(tmp / "llava" / "model.safetensors", b""), str(tmp / "llava"))[2],
        "bert_dir": (write_file(tmp / "bert" / "config.json", json.dumps(
            {"architectures": ["BertForMaskedLM"], "model_type": "bert"})),
            write_file(tmp / "bert" / "model.safetensors", b""), str(tmp / "bert"))[2],
    }


HF_CASES = [
    ("model-path-missing", ["--model.path", "{tmp}/nowhere"], "nowhere"),
    ("model-without-tokenizer", ["--model.path", "{no_tokenizer}"], "tokenizer"),
    ("jsonl-bad-line", ["--data.path", "{bad_json}"], "line 3"),
    ("jsonl-empty", ["--data.path", "{empty_jsonl}"], "empty.jsonl"),
    ("jsonl-not-json", ["--data.path", "{not_json}"], "prose.jsonl"),
    ("jsonl-missing-field", ["--data.path", "{no_field}"], "nofield.jsonl"),
    ("chat-format-on-prompt-rows", ["--data.format", "chat"], "good.jsonl"),
    ("lora-target-missing", ["--lora.rank", "4", "--lora.target-modules", "nonexistent_proj"], "nonexistent_proj"),
    ("output-dir-is-file", ["--output-dir", "{afile}"], "out-file"),
    ("model-is-a-vlm", ["--model.path", "{vlm_dir}"],
     "is a vision-language model (LlavaForConditionalGeneration): the hf_causal_lm recipe needs"),
    ("model-not-causal", ["--model.path", "{bert_dir}"], "is not a causal LM (BertForMaskedLM)"),
    ("completion-key-typo", ["--data.path", "{qa_jsonl}", "--data.prompt-key", "question",
                             "--data.completion-key", "answr"],
     "keys ['answer', 'question']: --data.completion-key 'answr' is not among them"),
]  # fmt: skip


@pytest.mark.parametrize("args, needle", [c[1:] for c in HF_CASES], ids=[c[0] for c in HF_CASES])
def test_a_bad_hf_input_is_one_line_and_creates_nothing(tmp_path, capsys, tiny_llama_dir, args, needle):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    files = _hf_files(tmp_path / "in", tiny_llama_dir)
    before = file_hashes_and_siblings(tmp_path)
    argv = ["run", "hf_causal_lm", "--run-dir", str(tmp_path / "run"), "--model.path", files["hf"],
            "--data.path", files["good_jsonl"], "--train.train-iters", "2", "--train.global-batch-size", "2",
            "--train.micro-batch-size", "2", "--progress.no-enabled", *[a.format(**files) for a in args]]  # fmt: skip
    expect_one_line(capsys, argv, needle)
    assert file_hashes_and_siblings(tmp_path) == before


def test_a_vlm_run_of_a_text_only_model_is_one_line(tmp_path, capsys, tiny_llama_dir):
    """Every recipe given a model of the wrong kind says so in one line, before any work."""
    pytest.importorskip("transformers")
    files = _hf_files(tmp_path / "in", tiny_llama_dir)
    before = file_hashes_and_siblings(tmp_path)
    argv = ["run", "vlm", "--run-dir", str(tmp_path / "run"), "--model.path", files["hf"], "--data.path",
            files["good_jsonl"], "--data.val-fraction", "0.25", "--model.cache-dir", str(tmp_path / "cache")]  # fmt: skip
    err = expect_one_line(capsys, argv, "is a text-only causal LM (LlamaForCausalLM): the vlm recipe needs a "
                          "vision-language model (LLaVA-style, with a processor)")  # fmt: skip
    assert f"--model.path {files['hf']!r}" in err
    assert file_hashes_and_siblings(tmp_path) == before


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, tiny_llama_dir) -> Path:
    """A finished one-step DPO run of the tiny Llama, with its checkpoint."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("dpo")
    rows = [{"prompt": "to be", "chosen": " or not", "rejected": " to be"}] * 4
    data = write_file(root / "prefs.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    dispatch(["run", "dpo", "--run-dir", str(root / "run"), "--model.path", str(tiny_llama_dir), "--data.path", data,
              "--train.train-iters", "1", "--train.global-batch-size", "2", "--train.micro-batch-size", "2",
              "--checkpoint.save-every", "1", "--progress.no-enabled"])  # fmt: skip
    return root / "run"


def test_a_checkpoint_of_another_recipe_is_one_line_naming_the_recipe_that_wrote_it(tmp_path, capsys, good_run,
                                                                                    dpo_run):  # fmt: skip
    """[issue 48] "unknown config key 'assets'", "data.path must be a string", and a MissingKeysError after
    the model was built: each is one line naming the recipe that wrote the checkpoint, before any model
    work, and the command without the wrong recipe works."""
    dpo_step, tiny_step = dpo_run / "checkpoints" / "step_1", good_run / "checkpoints" / "step_2"
    before = file_hashes_and_siblings(dpo_run), file_hashes_and_siblings(good_run)
    expect_one_line(capsys, ["generate", str(dpo_step), "--recipe", "tiny_gpt", "--prompt", "to"],
                    f"--recipe 'tiny_gpt': '{dpo_step}' was written by the dpo recipe; leave --recipe out to use it")
    expect_one_line(capsys, ["generate", str(good_run), "--recipe", "dpo", "--prompt", "to"],
                    f"--recipe 'dpo': '{tiny_step}' was written by the tiny_gpt recipe")
    expect_one_line(capsys, ["export", str(dpo_step), "--format", "hf", str(tmp_path / "out"), "--recipe", "tiny_gpt"],
                    "was written by the dpo recipe")  # fmt: skip
    run = ["run", "tiny_gpt", "--run-dir", str(tmp_path / "run"), *SMALL, "--checkpoint.restore-from", str(dpo_step)]
    err = expect_one_line(capsys, run, f"--checkpoint.restore-from '{dpo_step}' was written by the dpo recipe, not "
                          "tiny_gpt: resume it with `fntrain run dpo`")  # fmt: skip
    assert err.endswith("start a new tiny_gpt run from its weights with --checkpoint.weights-only")
    assert list(tmp_path.iterdir()) == [] and (file_hashes_and_siblings(dpo_run), file_hashes_and_siblings(good_run)) == before
    samples = dispatch(["generate", str(good_run), "--prompt", "to", "--max-new-tokens", "2"])  # the way out
    assert len(samples) == 1


def test_the_cases_cover_the_issue(tmp_path):
    """At least 60 bad inputs are pinned here (the run layer's rule), every id distinct."""
    ids = [case[0] for case in TINY_CASES + GOOD_RUN_CASES + HF_CASES]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)
