"""GRPO in fntrain gives TRL's numbers over whole runs: every metric both log, the grad norm, the learning
rate and the final weights equal TRL 1.16's `GRPOTrainer.train()` on the same tiny Llama, prompts, reward
functions and settings (slow: trains with both; needs the `trl` test extra).

fntrain samples its own completions (one generator per row), so TRL replays them: its
`_generate_single_turn` returns, for each generation batch, the completions fntrain drew for the same
prompts, and its per-generation shuffle (`shuffle_sequence_dict`, global RNG) applies fntrain's row
permutation (`layout.shuffled_rows`), so both train on the same micro-batches in the same order. TRL reads
the prompts in fntrain's order: its dataset is written in that order and read unshuffled.

The shape: 4 optimizer steps of 2 micro-batches of 4 completions (gradient accumulation 2), one generation
batch (2 prompts x 4 completions) per 2 micro-steps, reused for 2 iterations (so old log-probs are kept
and the second pass's ratios move off 1 and get clipped), beta > 0 (a frozen reference), two weighted
reward functions (one reading a column), temperature 0.9, a linear schedule, fp32, dropout off.

By design fntrain right-pads [prompt + completion] where TRL left-pads the prompt: RoPE makes it the same
math up to float rounding. That rounding is the whole difference: changing only TRL's own padding
(`pad_to_multiple_of`) moves its metrics and weights by as much as fntrain differs from it (~1e-5 at most).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fntrain.cli import dispatch
from fntrain.step.objectives.grpo import objective as grpo_objective
from fntrain.step.objectives.grpo.layout import shuffled_rows
from tests.step.objectives.dpo_helpers import tiny_llama

pytestmark = pytest.mark.slow

STEPS, MICRO, ACCUM, GENERATIONS, ITERATIONS = 4, 4, 2, 4, 2
STEPS_PER_GENERATION = 2  # micro-steps per generation: one optimizer step's rows, trained ITERATIONS times
GENERATION_STEPS = (1, 3)  # the optimizer steps that generate (and log the generation's metrics)
COMPLETION, TEMPERATURE, BETA, SEED = 12, 0.9, 0.04, 3
# A large lr, so that the second pass's ratios leave the clipping range [0.8, 1.2]. Adam's eps 1e-6, not
# 1e-8: Adam's first step moves a weight by about lr whatever its gradient's size, so a gradient that is
# rounding noise moves its weight by lr in a direction the rounding sets. With eps 1e-8 padding alone (TRL
# against TRL with another pad_to_multiple_of) moved the final weights by 3e-5 to 3e-4 of their norm in
# the settings tried; with 1e-6 by 3e-6.
LR, EPS = 2e-2, 1e-6
REL, ABS = 1e-4, 1e-6  # ABS: the floor for values 0 up to rounding (the first step's kl, an on-policy loss)
EOS_PULL = 2.0  # the EOS's logit along the mean hidden state: about half of the first batch's rows end

REWARD_MODULE = "grpo_trl_rewards"
REWARDS = '''
def even_tokens(completion_ids, **kwargs):
    """The share of the completion's token ids that are even."""
    return [sum(1 for token in ids if token % 2 == 0) / max(1, len(ids)) for ids in completion_ids]


def letters(completions, letter, **kwargs):
    """How often the row's `letter` column appears in the completion's text, capped at 3."""
    return [min(3, text.count(wanted)) / 3 for text, wanted in zip(completions, letter)]
'''
GENERATION_METRICS = (
    "reward", "reward_std", "frac_reward_zero_std", "rewards/even_tokens/mean", "rewards/even_tokens/std",
    "rewards/letters/mean", "rewards/letters/std", "completions/mean_length", "completions/min_length",
    "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
    "completions/min_terminated_length", "completions/max_terminated_length", "num_tokens",
)  # fmt: skip
STEP_METRICS = (
    "loss", "grad_norm", "learning_rate", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
)  # fmt: skip
OURS = {"learning_rate": "lr"}  # fntrain's name where it is not TRL's


@pytest.fixture(scope="module")
def trl_run_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama whose EOS comes often enough that some completions end and others are cut, eight
    prompts with a `letter` column, and the reward module."""
    root = tmp_path_factory.mktemp("grpo_trl")
    words = ("kings", "queens", "fools", "ghosts", "swords", "crowns", "storms", "roses")
    rows = [{"prompt": f"Tell me a tale of {word}:", "letter": "etaoinsh"[i]} for i, word in enumerate(words)]
    model = tiny_llama(root / "llama")
    _pull_eos(model, [row["prompt"] for row in rows])
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / f"{REWARD_MODULE}.py").write_text(REWARDS)
    return {"model": model, "prompts": prompts, "root": root}


@pytest.fixture
def trl_rewards_importable(trl_run_inputs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The reward module importable by name (fntrain loads it as module:function; TRL gets the same
    function objects from sys.modules), and forgotten after the test."""
    monkeypatch.syspath_prepend(str(trl_run_inputs["root"]))
    yield
    sys.modules.pop(REWARD_MODULE, None)


def _pull_eos(model_dir: Path, prompts: list[str]) -> None:
    """The EOS's output row set along the mean of the final hidden states over the prompts: a random tiny
    Llama gives its EOS 1/vocab of each step's probability, so within COMPLETION tokens no row would end."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        hidden = [model.model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
                  for text in prompts]  # fmt: skip
        direction = torch.cat(hidden).mean(0)
        model.lm_head.weight[model.config.eos_token_id] = EOS_PULL * direction / direction.norm()
    model.save_pretrained(model_dir)


# ----------------------------------------------------------------------------- fntrain


def _fntrain_run(inputs: dict[str, Path], run_dir: Path, monkeypatch: pytest.MonkeyPatch, loss_type: str,
                 level: str) -> tuple[list[dict], list[tuple[list[Any], Any]]]:  # fmt: skip
    """fntrain's per-step metrics and each generation batch as rolled out: (its prompt rows, `Generation`)."""
    generations: list[tuple[list[Any], Any]] = []
    rollout = grpo_objective.rollout

    def recording(prompts, index, parts, settings, trainer_state=None):
        generation = rollout(prompts, index, parts, settings, trainer_state=trainer_state)
        generations.append((list(prompts), generation))
        return generation

    monkeypatch.setattr(grpo_objective, "rollout", recording)
    dispatch([
        "run", "grpo", "--run-dir", str(run_dir), "--seed", str(SEED), "--log-every", "1",
        "--model.path", str(inputs["model"]), "--data.path", str(inputs["prompts"]),
        "--grpo.reward-funcs", f"{REWARD_MODULE}:even_tokens", f"{REWARD_MODULE}:letters",
        "--grpo.reward-weights", "1.0", "0.5", "--grpo.num-generations", str(GENERATIONS),
        "--grpo.max-completion-length", str(COMPLETION), "--grpo.temperature", str(TEMPERATURE),
        "--grpo.beta", str(BETA), "--grpo.loss-type", loss_type, "--grpo.importance-sampling-level", level,
        "--grpo.steps-per-generation", str(STEPS_PER_GENERATION), "--grpo.num-iterations", str(ITERATIONS),
        "--train.train-iters", str(STEPS), "--train.global-batch-size", str(MICRO * ACCUM),
        "--train.micro-batch-size", str(MICRO), "--train.max-grad-norm", "1.0",
        "--optim.lr", str(LR), "--optim.betas", "0.9", "0.99", "--optim.eps", str(EPS),
        "--optim.weight-decay", "0",
        "--schedule.kind", "linear", "--schedule.min-lr-ratio", "0", "--schedule.warmup-iters", "0",
        "--schedule.warmup-style", "hf", "--checkpoint.save-every", "0", "--progress.no-enabled",
    ])  # fmt: skip
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in history if "loss" in row], generations


# ----------------------------------------------------------------------------- TRL replaying fntrain


def _permuted(batch: dict[str, Any], order: torch.Tensor) -> dict[str, Any]:
    """`shuffle_sequence_dict` with a given permutation: tensors and lists along their first dimension."""

    def permute(value: Any) -> Any:
        if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
            return value
        return value[order] if isinstance(value, torch.Tensor) else [value[i] for i in order]

    return {key: permute(value) for key, value in batch.items()}


def _trl_run(inputs: dict[str, Path], out: Path, generations: list[tuple[list[Any], Any]], loss_type: str,
             level: str) -> tuple[list[dict], dict[str, torch.Tensor]]:  # fmt: skip
    """TRL's per-step log (logging_steps 1) and final weights, its completions and shuffles fntrain's."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer import grpo_trainer

    rewards = __import__(REWARD_MODULE)
    replay, current = iter(generations), {}

    def replayed(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        prompts, generation = next(replay)
        current["index"] = generation.index
        expected = [list(prompt.prompt_ids) for prompt in prompts for _ in range(num_generations)]
        assert [list(ids) for ids in prompt_ids] == expected  # the same prompts, tokenized alike, row p*G + j
        return [list(generation.rows[i].completion_ids) for i in range(len(prompt_ids))], None

    def shuffled(batch: dict[str, Any]) -> dict[str, Any]:
        rows = len(next(value for value in batch.values() if value is not None))
        return _permuted(batch, torch.tensor(shuffled_rows(rows, SEED, current["index"])))

    args = trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        steps_per_generation=STEPS_PER_GENERATION, num_iterations=ITERATIONS, num_generations=GENERATIONS,
        max_completion_length=COMPLETION, temperature=TEMPERATURE, beta=BETA, loss_type=loss_type,
        importance_sampling_level=level, reward_weights=[1.0, 0.5], max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="linear", warmup_steps=0, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.99,
        adam_epsilon=EPS, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to=[], bf16=False, use_cpu=True, seed=SEED, disable_dropout=True, shuffle_dataset=False,
        dataloader_num_workers=0, log_completions=False,
    )  # fmt: skip
    rows = [{"prompt": row.prompt, **row.columns} for prompts, _ in generations for row in prompts]
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(inputs["model"]), args=args,
        train_dataset=Dataset.from_list(rows),
        reward_funcs=[rewards.even_tokens, rewards.letters],
        processing_class=AutoTokenizer.from_pretrained(inputs["model"]),
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_trainer.GRPOTrainer, "_generate_single_turn", replayed)
        patch.setattr(grpo_trainer, "shuffle_sequence_dict", shuffled)
        trainer.train()
    assert next(replay, None) is None, "TRL generated fewer batches than fntrain"
    history = [row for row in trainer.state.log_history if "loss" in row]
    return history, {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}


# ----------------------------------------------------------------------------- the comparison


def _close(ours: Any, theirs: Any) -> bool:
    """Equal within REL (ABS near 0); TRL logs None (and fntrain NaN) for a min or max over no row."""
    if theirs is None or (isinstance(theirs, float) and math.isnan(theirs)):
        return ours is None or (isinstance(ours, float) and math.isnan(ours))
    return ours is not None and math.isclose(ours, theirs, rel_tol=REL, abs_tol=ABS)


RUNS = [("dapo", "token"), ("grpo", "sequence"), ("bnpo", "token"), ("dr_grpo", "token")]  # (loss, level)


@pytest.mark.parametrize(("loss_type", "level"), RUNS)
def test_a_grpo_run_matches_trls_metrics_and_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trl_run_inputs,
                                                      trl_rewards_importable, loss_type: str, level: str) -> None:
    pytest.importorskip("trl")
    ours, generations = _fntrain_run(trl_run_inputs, tmp_path / "run", monkeypatch, loss_type, level)
    theirs, weights = _trl_run(trl_run_inputs, tmp_path / "trl", generations, loss_type, level)
    assert len(ours) == len(theirs) == STEPS and [generation.index for _, generation in generations] == [0, 1]
    lengths = [len(row.completion_ids) for _, generation in generations for row in generation.rows.values()]
    assert min(lengths) < COMPLETION == max(lengths)  # some completions end, some are cut
    assert max(row["clip_ratio/region_mean"] for row in theirs) > 0.1  # the second pass clips
    for step, (row, trl_row) in enumerate(zip(ours, theirs, strict=True), start=1):
        compared = STEP_METRICS + (GENERATION_METRICS if step in GENERATION_STEPS else ())
        for name in compared:  # TRL logs a generation's metrics at the step that made it, as fntrain does
            ours_name = OURS.get(name, name)
            assert name in trl_row and ours_name in row, (step, name)
            assert _close(row[ours_name], trl_row[name]), (step, name, row[ours_name], trl_row[name])
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "run" / "hf_model" / "model.safetensors"))
    assert set(saved) == set(weights)
    for name, value in saved.items():  # relative to each tensor's norm: single weights near 0 carry no scale
        assert float((value - weights[name]).norm()) <= REL * float(weights[name].norm()), name
