"""GRPO: fntrain's step against TRL 1.16's `GRPOTrainer` on the same model, prompts and completions, piece
by piece (the optimizer step, the rollout's scoring and extra log-probs, generation), and the time split
of a GRPO step as fntrain's recipe logs it.

The model is a Llama built here from a config (nothing is downloaded: 4 layers, hidden 256, vocabulary
2048, about 4.2 M parameters, float32) with a word-level tokenizer built in memory whose EOS (id 2048) is
outside the model's vocabulary, so every completion runs to its full length on both sides: both train
the same tokens. A generation batch is 4 prompts of 16 to 40 random tokens x 4 completions of 64
tokens (16 rows), trained as 2 micro-batches of 8 (gradient accumulation 2, one generation per optimizer
step), beta 0.04 (a frozen reference), loss dapo, temperature 1, AdamW, clipping at 1. Six variants
alternate, one call each per round (paired rounds, process CPU time, one torch thread):

- **fntrain train** / **TRL train**: one optimizer step on the same 16 rows in the same two micro-batches.
  fntrain: `make_train_step` with `make_grpo_forward` and `make_grpo_loss` on the micro-batches its rollout
  laid out (right-padded [prompt + completion] per micro-batch). TRL: `GRPOTrainer.training_step` on each
  of the micro-batches its `_generate_and_score_completions` made (prompts left-padded to the generation
  batch's longest, completions right-padded), shuffled by fntrain's row permutation, then the Trainer's
  clip, `optimizer.step()`, scheduler step and `zero_grad` (what its inner loop does between them);
- **fntrain score** / **TRL score**: a rollout with its completions given (the sampler replaced by the
  recorded tokens): reward function, advantages, layout, the reference's log-probs (fntrain's `rollout`;
  TRL's `_generate_and_score_completions`);
- **fntrain generate** / **TRL generate**: the 16 completions of 64 tokens at temperature 1 for the same
  prompts: fntrain's batched sampler (`fntrain.sampling.decode`, one generator per row, the model's KV
  cache) against TRL's transformers path (`_generate_single_turn`: `model.generate` with its generation
  config), rows / prompts as each trainer makes them.

Then fntrain's grpo recipe runs on the same model (saved to a temporary directory with a tokenizer
without an EOS: the recipe refuses one larger than the model) for a few steps of the same shape on one
thread, and each step's logged time/generation_s, time/rewards_s, time/logprobs_s and time/train_s are
read as shares of their sum (the first step, with its one-off costs, left out).

Run: `python -m bench.grpo [--quick] [--json FILE]` (`--quick`: one round of 8-token completions and a
3-step recipe run, checks that it runs; a full run is 12 to 30 rounds and 10 recipe steps, about 3 min
on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.harness import Row, Target, Timing, bench_main, interleave, paired_ratio_row, quiet
from bench.hf_parts import llama, word_tokenizer, words

SHAPE = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=256,
)  # fmt: skip
PROMPTS, GENERATIONS, SHORTEST, LONGEST, COMPLETION = 4, 4, 16, 40, 64
MICRO, ACCUM, BETA, LR, SEED = 8, 2, 0.04, 1e-5, 0
WHERE = f"Llama 4x256, vocab 2048, {PROMPTS} prompts x {GENERATIONS}, CPU 1 thread"
RECIPE_STEPS = 10
SPLIT = ("generation", "rewards", "logprobs", "train")  # fntrain's logged time/<name>_s of a generation step


def even_tokens(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """The reward: the share of a completion's token ids that are even (cheap and deterministic)."""
    return [sum(1 for token in ids if token % 2 == 0) / max(1, len(ids)) for ids in completion_ids]


# ----------------------------------------------------------------------------- the shared pieces


def _model() -> torch.nn.Module:
    return llama(SHAPE, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def _eos() -> int:
    """The tokenizer's EOS: the first id past the model's vocabulary, which it cannot emit, so every
    completion runs to its full length."""
    return SHAPE["vocab_size"]


def _tokenizer(eos: bool = True) -> Any:
    """Words t1, t2, ... as ids 1 to vocabulary - 1, <pad> 0, and <eos> `_eos()` (TRL needs an EOS id).
    Without `eos`, for the recipe (which refuses a tokenizer larger than the model), no EOS at all."""
    return word_tokenizer(_eos(), eos_id=_eos() if eos else None)


def _prompt_texts() -> list[str]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.linspace(SHORTEST, LONGEST, PROMPTS).round().long().tolist()
    prompts = [torch.randint(1, _eos(), (length,), generator=generator).tolist() for length in lengths]
    return [words(prompt) for prompt in prompts]


def _grpo_config(completion: int) -> Any:
    from fntrain.step.objectives.grpo import GRPOConfig

    return GRPOConfig(reward_funcs=("bench.grpo:even_tokens",), num_generations=GENERATIONS,
                      max_completion_length=completion, beta=BETA, completions_to_log=0)  # fmt: skip


@contextlib.contextmanager
def _replayed_decode(completions: dict[tuple[int, int], list[int]]):
    """fntrain's rollout with its sampler replaced by `completions[(prompt index, sample)]`."""
    from fntrain.sampling import Decoded
    from fntrain.step.objectives.grpo import rollout as rollout_module

    real = rollout_module.decode
    rows: list[tuple[int, int]] = []

    def replay(model, prompt_ids, settings, generators, **kwargs):
        tokens = [completions[key] for key in rows[: len(prompt_ids)]]
        del rows[: len(prompt_ids)]
        return Decoded(tokens, [True] * len(tokens))

    def keyed(seed: int, index: int, prompt: int, sample: int) -> torch.Generator:
        rows.append((prompt, sample))
        return torch.Generator()

    real_generator = rollout_module.row_generator
    rollout_module.decode, rollout_module.row_generator = replay, keyed
    try:
        yield
    finally:
        rollout_module.decode, rollout_module.row_generator = real, real_generator


# ----------------------------------------------------------------------------- fntrain's variants


def _fntrain(completion: int, tokenizer: Any) -> dict[str, Any]:
    """fntrain's policy, reference, rollout parts and the generation batch's prompt rows."""
    from fntrain.data.prompts import PromptRow
    from fntrain.step.losses import default_forward
    from fntrain.step.objectives.grpo.rewards import RewardFunction
    from fntrain.step.objectives.grpo.rollout import RolloutParts, RolloutSettings
    from fntrain.step.objectives.logps import output_logits, token_logps

    grpo = _grpo_config(completion)
    policy, reference = _model(), _model().eval()
    texts = _prompt_texts()
    prompts = [PromptRow(index, text, tuple(tokenizer(text=text)["input_ids"]), {}, f"prompt {index}")
               for index, text in enumerate(texts)]  # fmt: skip

    def score(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        logits = output_logits(default_forward(model, micro_batch))
        return token_logps(logits, micro_batch["labels"], grpo.temperature)

    # The rollout calls reference_logps(policy, micro_batch): the frozen copy scores (frozen_reference's way).
    parts = RolloutParts(policy, score, lambda _, micro_batch: score(reference, micro_batch),
                         lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         (RewardFunction("bench.grpo:even_tokens", "even_tokens", even_tokens),))  # fmt: skip
    settings = RolloutSettings(grpo, SEED, MICRO, ACCUM, pad_id=0, eos_ids=(_eos(),))
    return {"grpo": grpo, "policy": policy, "prompts": prompts, "parts": parts, "settings": settings}


def _fntrain_variants(side: dict[str, Any], completions: dict[tuple[int, int], list[int]]
                      ) -> tuple[dict[str, Any], Any]:  # fmt: skip
    """fntrain's train, score and generate variants, and the generation it trains on."""
    from fntrain.sampling import SampleSettings, decode, row_generator
    from fntrain.state import TrainState
    from fntrain.step import StepSettings, make_train_step
    from fntrain.step.objectives.grpo.loss import make_grpo_forward, make_grpo_loss
    from fntrain.step.objectives.grpo.rollout import rollout

    grpo, policy, prompts = side["grpo"], side["policy"], side["prompts"]
    parts, settings = side["parts"], side["settings"]
    with _replayed_decode(completions):
        generation = rollout(prompts, 0, parts, settings)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    loss = make_grpo_loss(grpo, micro_batches=ACCUM, steps_per_generation=ACCUM)
    clipped_mean = StepSettings(loss_weighting="mean", max_grad_norm=1.0)
    step = make_train_step(policy, loss, optimizer, settings=clipped_mean,
                           forward=make_grpo_forward(grpo.temperature))  # fmt: skip
    micro_batches = list(generation.steps[0])
    rows = sorted(generation.rows)
    sample = SampleSettings(max_new_tokens=grpo.max_completion_length, temperature=grpo.temperature,
                            eos_id=(_eos(),))  # fmt: skip

    def train() -> int:
        step(TrainState(), micro_batches)
        return 1

    def score() -> int:
        with _replayed_decode(completions):
            rollout(prompts, 0, parts, settings)
        return 1

    def generate() -> int:
        prompt_ids = [prompts[i // GENERATIONS].prompt_ids for i in rows]
        generators = [row_generator(SEED, 0, prompts[i // GENERATIONS].index, i % GENERATIONS) for i in rows]
        policy.eval()
        decoded = decode(policy, prompt_ids, sample, generators)
        policy.train()
        side["generated"] = decoded.tokens
        return 1

    return {"fntrain train": train, "fntrain score": score, "fntrain generate": generate}, generation


# ----------------------------------------------------------------------------- TRL's variants


def _trl_config(completion: int, out: Path) -> Any:
    import trl

    return trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        num_generations=GENERATIONS, max_completion_length=completion, temperature=1.0, beta=BETA,
        loss_type="dapo", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=1000, report_to=[], bf16=False, use_cpu=True, seed=SEED, disable_dropout=True,
        shuffle_dataset=False, dataloader_num_workers=0, log_completions=False, save_strategy="no",
    )  # fmt: skip


def _trl_variants(completion: int, tokenizer: Any, completions: dict[tuple[int, int], list[int]], out: Path,
                  generation: Any) -> dict[str, Any]:  # fmt: skip
    """TRL's train, score and generate variants on its own copy of the model and its own optimizer (and,
    under "trainer" and "shapes", the trainer and its micro-batches' shapes)."""
    import trl
    from datasets import Dataset
    from trl.trainer.utils import split_tensor_dict

    from fntrain.step.objectives.grpo.layout import shuffled_rows

    args, texts = _trl_config(completion, out), _prompt_texts()
    with _no_hub_reference(_model().eval()):
        dataset = Dataset.from_list([{"prompt": text} for text in texts])
        trainer = trl.GRPOTrainer(model=_model(), reward_funcs=[even_tokens], args=args,
                                  train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    trainer.current_gradient_accumulation_steps = ACCUM  # set by Trainer's inner loop, which is not run here
    inputs = [{"prompt": text} for text in texts for _ in range(GENERATIONS)]
    replayed = [completions[(i // GENERATIONS, i % GENERATIONS)] for i in range(len(inputs))]

    def score() -> int:
        trainer.model.train()  # as in a training step
        trainer._generate_and_score_completions(inputs)
        return 1

    trainer._generate_single_turn = lambda *args, **kwargs: ([list(ids) for ids in replayed], None)
    score()  # warms its paths once; the batch it trains on is made next
    batch = trainer._generate_and_score_completions(inputs)
    order = torch.tensor(shuffled_rows(len(inputs), SEED, generation.index))  # fntrain's row order
    shuffled = {key: value[order] if isinstance(value, torch.Tensor) and value.dim() else value
                for key, value in batch.items()}  # fmt: skip
    micro_batches = split_tensor_dict(shuffled, ACCUM)
    trainer._prepare_inputs = lambda micro_batch: micro_batch  # training_step: TRL's micro-batches as made

    def train() -> int:
        for micro_batch in micro_batches:
            trainer.training_step(trainer.model, micro_batch, None)
        trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), args.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.model.zero_grad()
        return 1

    prompt_ids = [list(tokenizer(text=item["prompt"])["input_ids"]) for item in inputs]
    real_generate = type(trainer)._generate_single_turn.__get__(trainer)

    def generate() -> int:
        trainer.model.train()  # unwrap_model_for_generation switches it to eval and back, as in training
        trainer.generated, _ = real_generate(prompt_ids, None, {}, GENERATIONS)
        return 1

    shapes = [(b["prompt_ids"].shape[0], b["prompt_ids"].shape[1] + b["completion_ids"].shape[1])
              for b in micro_batches]  # fmt: skip
    variants = {"TRL train": train, "TRL score": score, "TRL generate": generate}
    return {**variants, "trainer": trainer, "shapes": shapes}


@contextlib.contextmanager
def _no_hub_reference(reference: torch.nn.Module) -> Iterator[None]:
    """TRL builds its reference from the policy's hub name (`create_model_from_path`); here it is the
    in-memory copy with the policy's starting weights."""
    from trl.trainer import grpo_trainer

    real = grpo_trainer.create_model_from_path
    grpo_trainer.create_model_from_path = lambda *args, **kwargs: reference
    try:
        yield
    finally:
        grpo_trainer.create_model_from_path = real


# ----------------------------------------------------------------------------- fntrain's time split


def _time_split(completion: int, steps: int, root: Path) -> Timing:
    """fntrain's grpo recipe on the same model and shape, one thread: each step's four logged times and
    their sum (the first step, with its one-off costs, left out)."""
    from fntrain.cli import dispatch

    model_dir, data, run_dir = root / "model", root / "prompts.jsonl", root / "run"
    _model().save_pretrained(model_dir)
    _tokenizer(eos=False).save_pretrained(model_dir)
    data.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in _prompt_texts()))
    dispatch([
        "run", "grpo", "--run-dir", str(run_dir), "--seed", str(SEED), "--log-every", "1",
        "--model.path", str(model_dir), "--data.path", str(data),
        "--grpo.reward-funcs", "bench.grpo:even_tokens",
        "--grpo.num-generations", str(GENERATIONS), "--grpo.max-completion-length", str(completion),
        "--grpo.beta", str(BETA), "--grpo.completions-to-log", "0", "--train.train-iters", str(steps),
        "--train.global-batch-size", str(MICRO * ACCUM), "--train.micro-batch-size", str(MICRO),
        "--optim.lr", str(LR), "--runtime.cpu-threads", "1", "--checkpoint.save-every", "0",
        "--checkpoint.no-export", "--progress.no-enabled",
    ])  # fmt: skip
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [record for record in records if "time/train_s" in record][1:]
    samples = {name: [record[f"time/{name}_s"] for record in records] for name in SPLIT}
    samples["step"] = [sum(values) for values in zip(*samples.values(), strict=True)]
    return Timing(samples, samples)


# ----------------------------------------------------------------------------- the run


def _completions(completion: int) -> dict[tuple[int, int], list[int]]:
    """(prompt, sample) -> the completion both sides train on: random ids of full length."""
    generator = torch.Generator().manual_seed(2)
    return {(prompt, sample): torch.randint(1, _eos(), (completion,), generator=generator).tolist()
            for prompt in range(PROMPTS) for sample in range(GENERATIONS)}  # fmt: skip


def measure(quick: bool) -> tuple[Timing, Timing, dict[str, Any]]:
    """(the paired rounds of the six variants, fntrain's per-step time split, facts for the notes)."""
    completion, tokenizer = (8 if quick else COMPLETION), _tokenizer()
    completions = _completions(completion)
    with tempfile.TemporaryDirectory() as tmp:
        side = _fntrain(completion, tokenizer)
        ours, generation = _fntrain_variants(side, completions)
        theirs = _trl_variants(completion, tokenizer, completions, Path(tmp) / "trl", generation)
        trainer, shapes = theirs.pop("trainer"), theirs.pop("shapes")
        targets = [Target("fntrain train", "TRL train", 0.04, ratio=True),
                   Target("fntrain generate", "TRL generate", 0.04, ratio=True)]  # fmt: skip
        timing = interleave({**ours, **theirs}, repeats=1 if quick else 12, warmup=0 if quick else 1,
                            targets=() if quick else targets, budget_s=0.0 if quick else 150.0,
                            max_repeats=30, clock=time.process_time)  # fmt: skip
        lengths = {len(ids) for ids in side["generated"]} | {len(ids) for ids in trainer.generated}
        if lengths != {completion}:
            raise AssertionError(f"completions of {sorted(lengths)} tokens: each side must make {completion}")
        split = _time_split(completion, 3 if quick else RECIPE_STEPS, Path(tmp))
    ours_shapes = [tuple(batch["input_ids"].shape) for batch in generation.steps[0]]
    return timing, split, {"completion": completion, "shapes": {"fntrain": ours_shapes, "TRL": shapes}}


def run(quick: bool = False) -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=UserWarning)
            timing, split, facts = measure(quick)
    finally:
        torch.set_num_threads(threads)
    completion, rows = facts["completion"], PROMPTS * GENERATIONS
    where = f"{WHERE}, {completion}-token completions"
    shapes = ", ".join(f"{side} {value}" for side, value in facts["shapes"].items())
    return [
        paired_ratio_row(
            f"GRPO optimizer step, fntrain vs TRL GRPOTrainer ({where}, 2 micro-batches of {MICRO})", timing,
            "fntrain train", "TRL train", goal_ratio=None,
            note=f"the same {rows} rows in the same micro-batches, beta {BETA}, dapo; (rows, width) {shapes}",
        ),
        paired_ratio_row(
            f"GRPO rollout less sampling, fntrain vs TRL ({where})", timing, "fntrain score", "TRL score",
            goal_ratio=None, note="rewards, advantages, layout and the reference's log-probs of the same "
            "completions: fntrain's rollout and TRL's _generate_and_score_completions, sampling replayed",
        ),
        paired_ratio_row(
            f"GRPO generation, fntrain's batched sampler vs TRL's generate path ({where}, temperature 1)",
            timing, "fntrain generate", "TRL generate", goal_ratio=None, unit="tokens/s",
            rate=float(rows * completion), higher_is_better=True,
            note=f"{rows} rows x {completion} new tokens on each side (no EOS can come): tokens/s ratio",
        ),
        *[paired_ratio_row(
            f"GRPO step split, fntrain's recipe ({where}): time/{name}_s / the step", split, name, "step",
            goal_ratio=None, note="a generation step's four logged times; the share of their sum",
        ) for name in SPLIT],
    ]  # fmt: skip


if __name__ == "__main__":
    quiet()
    bench_main(run, "GRPO: fntrain's step against TRL's GRPOTrainer", __doc__.splitlines()[0])
