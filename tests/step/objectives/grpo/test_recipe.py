"""The `grpo` recipe end to end on a tiny Llama (a few steps in this process): what it logs, samples,
exports and refuses. TRL parity: tests/step/objectives/grpo/test_trl_parity.py (loss, advantages) and
tests/step/objectives/grpo/test_trl_runs.py (whole runs); ranks and kills: tests/step/objectives/grpo/test_distributed.py, tests/step/objectives/grpo/test_resume.py;
learning: tests/step/objectives/grpo/test_learning.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fntrain.cli import dispatch
from tests.helpers.commands import expect_one_line
from tests.helpers.files import file_hashes_and_siblings
from tests.step.objectives.dpo_helpers import tiny_llama

pytest.importorskip("transformers")

REWARDS = '''
def letter_a(completions, **kwargs):
    """The share of the completion's characters that are the letter a."""
    return [c.count("a") / max(1, len(c)) for c in completions]


def picky(completions, answer, **kwargs):
    """Cannot score rows whose answer is odd."""
    return [None if int(a) % 2 else float(len(c) > 3) for c, a in zip(completions, answer)]


def broken(completions, answer, **kwargs):
    """Fails on the row whose answer is 3."""
    return [1.0 / (int(a) - 3) for a in answer]
'''


@pytest.fixture(scope="module")
def recipe_inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama, 16 prompts with an `answer` column, and a module of reward functions."""
    root = tmp_path_factory.mktemp("grpo")
    model = tiny_llama(root / "llama")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say a {i}:", "answer": str(i)}) + "\n" for i in range(16)))
    (root / "grpo_test_rewards.py").write_text(REWARDS)
    return {"model": model, "prompts": prompts, "root": root}


@pytest.fixture
def rewards_importable(recipe_inputs, monkeypatch):
    monkeypatch.syspath_prepend(str(recipe_inputs["root"]))
    yield
    sys.modules.pop("grpo_test_rewards", None)


def _argv(inputs: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return ["run", "grpo", "--run-dir", str(run_dir), "--model.path", str(inputs["model"]), "--data.path",
            str(inputs["prompts"]), "--grpo.reward-funcs", "grpo_test_rewards:letter_a", "grpo_test_rewards:picky",
            "--grpo.reward-weights", "1.0", "0.5", "--grpo.num-generations", "4", "--grpo.max-completion-length", "8",
            "--train.global-batch-size", "8", "--train.micro-batch-size", "4", "--log-every", "1",
            "--checkpoint.save-every", "0", "--progress.no-enabled", *extra]  # fmt: skip


def jsonl_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_logs_trls_names_the_time_split_and_sample_completions(tmp_path, recipe_inputs, rewards_importable):
    run = tmp_path / "run"
    dispatch(_argv(recipe_inputs, run, "--train.train-iters", "2", "--grpo.beta", "0.04"))
    records = jsonl_records(run / "metrics.jsonl")
    assert [record["step"] for record in records] == [1, 2]
    names = set(records[0])
    for name in ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "rewards/letter_a/mean",
                 "rewards/letter_a/std", "rewards/picky/mean", "rewards/picky/std", "completions/mean_length",
                 "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                 "completions/mean_terminated_length", "kl", "entropy", "clip_ratio/region_mean",
                 "clip_ratio/low_min", "clip_ratio/high_max", "num_tokens", "time/generation_s", "time/rewards_s",
                 "time/logprobs_s", "time/train_s"):  # fmt: skip
        assert name in names, name
    assert records[1]["num_tokens"] > records[0]["num_tokens"] > 0  # one generation batch per step here
    assert 0 <= records[0]["completions/clipped_ratio"] <= 1 and records[0]["completions/max_length"] <= 8
    samples = jsonl_records(run / "samples.jsonl")
    assert len(samples) == 8 and {sample["step"] for sample in samples} == {1, 2}  # 4 per generation batch
    first = samples[0]
    assert set(first["rewards"]) == {"letter_a", "picky"} and isinstance(first["completion"], str)
    assert first["prompt"].startswith("Say a ") and isinstance(first["advantage"], float)
    picky = first["rewards"]["picky"]
    answer = int(first["columns"]["answer"])
    assert picky is None if answer % 2 else picky in (0.0, 1.0)  # None: the row could not be scored
    assert (run / "hf_model" / "model.safetensors").exists()


def test_plan_counts_the_rollout_rows_the_reference_and_the_logprob_buffers(capsys, recipe_inputs, rewards_importable):
    dispatch(["plan", *_argv(recipe_inputs, Path("unused"), "--grpo.beta", "0.04", "--grpo.num-iterations", "2",
                                 "--world-size", "2", "--parallel.strategy", "ddp")[1:]])  # fmt: skip
    out = capsys.readouterr().out
    assert "2 prompts x 4 = 8 completions per generation batch (4 per rank), 2 optimizer step(s) each" in out
    assert "old and reference: 4 rows x (prompt + 8) float32 each" in out
    assert "frozen model" in out  # the reference's weights per rank


BAD = [
    ("batch-groups", ["--train.global-batch-size", "6", "--train.micro-batch-size", "2"],
     "train.global-batch-size (6) must be divisible by --grpo.num-generations (4)"),
    ("one-generation", ["--grpo.num-generations", "1"], "--grpo.num-generations must be >= 2, got 1"),
    ("no-module", ["--grpo.reward-funcs", "nowhere_rewards:f", "--grpo.reward-weights", "1"],
     "--grpo.reward-funcs[0] 'nowhere_rewards:f'"),
    ("no-function", ["--grpo.reward-funcs", "grpo_test_rewards:missing", "--grpo.reward-weights", "1"],
     "'grpo_test_rewards:missing'"),
    ("prompt-fills-context", ["--grpo.max-completion-length", "250"],
     "line 11: its prompt is 8 tokens, and with --grpo.max-completion-length 250 it does not fit the model's "
     "context of 256 positions"),
    ("epsilon", ["--grpo.epsilon", "0"], "--grpo.epsilon must be > 0.0, got 0"),
    ("beta", ["--grpo.beta", "-0.1"], "--grpo.beta must be >= 0.0, got -0.1"),
    ("temperature", ["--grpo.temperature", "0"], "--grpo.temperature must be > 0.0, got 0"),
    ("pipeline", ["--parallel.pp-size", "2"], "--parallel.pp-size 2: grpo runs on one process, ddp and fsdp2 only"),
    ("context-parallel", ["--parallel.cp-size", "2"], "--parallel.cp-size 2: grpo runs on"),
    ("expert-parallel", ["--parallel.strategy", "fsdp2", "--parallel.ep-size", "2"],
     "--parallel.ep-size 2: grpo runs on"),
    ("steps-per-generation", ["--grpo.steps-per-generation", "3"],
     "--grpo.steps-per-generation (3) must be a multiple of the micro-batches per optimizer step (2"),
    ("adapter-off", ["--grpo.beta", "0.1", "--grpo.reference", "adapter-off"], "needs LoRA"),
    ("token-weighting", ["--train.loss-weighting", "token"], "--train.loss-weighting must be 'mean'"),
    ("evaluate", ["--evaluate.at-end"], "GRPO has no validation loss"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "needle"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_a_bad_grpo_input_is_one_line_and_creates_nothing(tmp_path, capsys, recipe_inputs, rewards_importable, args, needle):
    before = file_hashes_and_siblings(tmp_path)
    expect_one_line(capsys, _argv(recipe_inputs, tmp_path / "run", "--train.train-iters", "2", *args), needle)
    assert file_hashes_and_siblings(tmp_path) == before


def test_a_reward_function_that_raises_ends_the_run_in_one_line_naming_it_and_the_row(tmp_path, capsys, recipe_inputs,
                                                                                      rewards_importable):  # fmt: skip
    """Prompts 0..7 make the first generation batch (2 prompts a step); `broken` divides by zero on the row
    whose answer is 3, so the run fails at the step that scores it, after the step before was saved."""
    run = tmp_path / "run"
    argv = [*_argv(recipe_inputs, run, "--train.train-iters", "8", "--checkpoint.save-every", "1", "--loader.no-shuffle"),
            "--grpo.reward-funcs", "grpo_test_rewards:broken", "--grpo.reward-weights", "1.0"]  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        dispatch(argv)
    assert exited.value.code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]  # the run's log lines come before it
    assert line.startswith("run failed at step 2: RewardError: reward function 'grpo_test_rewards:broken' raised on "
                           f"data.path '{recipe_inputs['prompts']}' line 4, completion 1 of 4: ZeroDivisionError"), line  # fmt: skip
    saved = sorted(path.name for path in (run / "checkpoints").iterdir() if path.name.startswith("step_"))
    assert saved == ["step_1"]  # the good checkpoint before the failing step is intact
