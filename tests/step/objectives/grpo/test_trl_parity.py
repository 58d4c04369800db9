"""TRL 1.16's own GRPO code on the same rollouts as fntrain's (slow tier: importing trl takes seconds).

(a) `GRPOTrainer._compute_loss` on a stand-in trainer (exactly the attributes it reads) and a stand-in
model with TRL's fused-LM-head outputs from fixed logits at the sampling temperature, fed TRL's layout
(left-padded prompts, right-padded completions) of rollouts whose fntrain micro-batches (right-padded
prompt + completion rows) go through `make_grpo_forward` and `make_grpo_loss`: the loss, the gradient
with respect to every completion logit and every metric agree. fntrain's per-micro-batch loss is
TRL's times GA (the step divides by GA), so a whole optimizer step is compared.
(b) `GRPOTrainer._generate_and_score_completions` on a stand-in trainer whose `_generate` returns
recorded completions and whose reward functions return recorded scores (None included), through
TRL's own `_calculate_rewards`: its advantages and reward metrics against `group_advantages`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives.grpo.advantages import group_advantages
from fntrain.step.objectives.grpo.config import GRPOConfig
from fntrain.step.objectives.grpo.loss import make_grpo_forward, make_grpo_loss

pytestmark = pytest.mark.slow

VOCAB, PAD, TEMPERATURE, MAX_COMPLETION = 11, 0, 0.7, 6
METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "clip_ratio/low_min", "clip_ratio/high_max")  # fmt: skip


@dataclass
class Rollout:
    """One micro-batch of rollouts: per row its prompt and completion ids, whether it is trained (a
    masked truncated row is not), its advantage; the logits that predict each completion position
    (B, C, V), and the old/reference log-probs of the completion tokens (B, C) or None."""

    prompts: list[list[int]]
    completions: list[list[int]]
    trained: list[bool]
    advantages: torch.Tensor
    completion_logits: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None

    @property
    def completion_mask(self) -> torch.Tensor:
        width = self.completion_logits.shape[1]
        return torch.tensor(
            [
                [int(t < len(c) and on) for t in range(width)]
                for c, on in zip(self.completions, self.trained, strict=True)
            ]
        )


def make_rollout(
    seed: int, old: bool, ref: bool, trained: list[bool] | None = None, advantages: list[float] | None = None
) -> Rollout:
    """Three rows of random prompts (1-4 tokens) and completions (1-MAX_COMPLETION tokens), with
    advantages of both signs (default: +, −, either). The old log-probs sit off the policy's own by
    per-token noise and, for the first two rows, a shift against their advantage, so ratios land in
    every clipping region (high-clipped, low-clipped, inside, capped by δ); the reference's by noise."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randint(1, VOCAB, shape, generator=generator).tolist()  # noqa: E731
    prompts = [draw(n) for n in (3, 1, 4)]
    completions = [draw(n) for n in (MAX_COMPLETION, 2, 1)]
    logits = 2 * torch.randn(3, MAX_COMPLETION, VOCAB, generator=generator)
    size = 0.5 + torch.rand(3, generator=generator)
    signs = torch.tensor([1.0, -1.0, 1.0 if torch.rand(1, generator=generator) < 0.5 else -1.0])
    values = torch.tensor(advantages) if advantages is not None else signs * size
    rollout = Rollout(prompts, completions, trained or [True] * 3, values, logits, None, None)
    mask = rollout.completion_mask.bool()
    targets = torch.tensor([c + [PAD] * (MAX_COMPLETION - len(c)) for c in completions])
    policy = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    noise = lambda: 0.4 * torch.randn(policy.shape, generator=generator)  # noqa: E731
    shift = 0.5 * torch.sign(values) * torch.tensor([1.0, 1.0, 0.0])  # old below the policy: ratio above 1
    rollout.old = (policy - shift.unsqueeze(1) + noise()).masked_fill(~mask, 0) if old else None
    rollout.ref = (policy + noise()).masked_fill(~mask, 0) if ref else None
    return rollout


def filler(rows: int, positions: int, seed: int) -> torch.Tensor:
    """Logits at positions no completion token is predicted from (their values never matter)."""
    return torch.randn(rows, positions, VOCAB, generator=torch.Generator().manual_seed(seed))


def trl_inputs(rollout: Rollout, logits: torch.Tensor, generation_tokens: int) -> tuple[dict, torch.Tensor]:
    """TRL's micro-batch (prompts left-padded, completions right-padded) and its full logits (B, P+C, V),
    built from `logits` (the completion logits, B x C x V) so its gradient reaches them."""
    rows, width = len(rollout.prompts), logits.shape[1]
    longest = max(map(len, rollout.prompts))
    prompt_ids = torch.tensor([[PAD] * (longest - len(p)) + p for p in rollout.prompts])
    prompt_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in rollout.prompts])
    completion_ids = torch.tensor([c + [PAD] * (width - len(c)) for c in rollout.completions])
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": rollout.completion_mask, "advantages": rollout.advantages,
              "num_items_in_batch": torch.tensor(generation_tokens)}  # fmt: skip
    if rollout.old is not None:
        inputs["old_per_token_logps"] = rollout.old
    if rollout.ref is not None:
        inputs["ref_per_token_logps"] = rollout.ref
    # position P-1+k predicts completion token k
    full = torch.cat([filler(rows, longest - 1, 1), logits, filler(rows, 1, 2)], dim=1)
    return inputs, full


def fntrain_micro_batch(
    rollout: Rollout, logits: torch.Tensor, generation_tokens: int
) -> tuple[dict, torch.Tensor]:
    """fntrain's micro-batch (each row [prompt + completion], right-padded, the schema of the GRPO notes)
    and its logits (B, T, V) built from the completion logits."""
    width = logits.shape[1]
    seq = max(map(len, rollout.prompts)) + width
    ids, labels, attention, rows = [], [], [], []
    extra = filler(len(rollout.prompts), seq, 3)
    for row, (prompt, completion) in enumerate(zip(rollout.prompts, rollout.completions, strict=True)):
        pad = seq - len(prompt) - len(completion)
        ids.append(prompt + completion + [PAD] * pad)
        attention.append([1] * (len(prompt) + len(completion)) + [0] * pad)
        trained = completion if rollout.trained[row] else [IGNORE_INDEX] * len(completion)
        labels.append([IGNORE_INDEX] * len(prompt) + trained + [IGNORE_INDEX] * pad)
        start = len(prompt) - 1  # position start+k predicts completion token k
        rows.append(torch.cat([extra[row, :start], logits[row], extra[row, start + width :]]))
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(attention),
             "labels": torch.tensor(labels), "advantages": rollout.advantages,
             "generation_tokens": torch.tensor(float(generation_tokens))}  # fmt: skip
    for name, values in (("old_logps", rollout.old), ("ref_logps", rollout.ref)):
        if values is not None:
            aligned = torch.zeros(len(ids), seq - 1)
            for row, prompt in enumerate(rollout.prompts):
                aligned[row, len(prompt) - 1 : len(prompt) - 1 + width] = values[row]
            batch[name] = aligned
    return batch, torch.stack(rows)


class FusedHead(nn.Module):
    """Stands in for a model with TRL's fused LM head (`add_fused_lm_head`): per-token log-probs and
    entropy of softmax(logits / temperature) from fixed logits, 0 where the label is -100 (with
    gradient, as the kernel's)."""

    def __init__(self, logits: list[torch.Tensor]) -> None:
        super().__init__()
        self.calls = iter(logits)  # one logits tensor per micro-batch, in order
        self.is_gradient_checkpointing = False

    def forward(self, input_ids, attention_mask, labels, fused_lm_head, **_) -> SimpleNamespace:
        assert fused_lm_head
        logits = next(self.calls)
        assert logits.shape[:2] == input_ids.shape
        # times 1 / temperature, as TRL's kernel scales the logits (`inv_t`)
        log_softmax = torch.log_softmax(logits[:, :-1] * (1 / TEMPERATURE), -1)
        targets = labels[:, 1:]
        mask = targets != IGNORE_INDEX
        logps = log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        return SimpleNamespace(log_probs=logps.masked_fill(~mask, 0), entropy=entropy.masked_fill(~mask, 0),
                               aux_loss=None)  # fmt: skip


def trl_loss_stub(config: GRPOConfig, model: FusedHead, accumulation: int, steps_per_generation: int):
    """Just what `GRPOTrainer._compute_loss` (and the `_get_per_token_logps_and_entropies` it calls)
    reads of its trainer, with one process's identity gathers and reductions."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    identity = lambda x: x  # noqa: E731
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, is_main_process=True,
                                  gather=identity, reduce=lambda x, reduction: x, autocast=contextlib.nullcontext)  # fmt: skip
    args = SimpleNamespace(use_bias_correction_kl=config.use_bias_correction_kl, delta=config.delta,
                           steps_per_generation=steps_per_generation, report_to=[])  # fmt: skip
    stub = SimpleNamespace(
        accelerator=accelerator, args=args, model=model.train(), state=SimpleNamespace(global_step=0),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=config.importance_sampling_level, beta=config.beta, loss_type=config.loss_type,
        epsilon_low=config.epsilon, epsilon_high=config.upper_epsilon, use_vllm=False,
        current_gradient_accumulation_steps=accumulation, max_completion_length=config.max_completion_length,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
    )  # fmt: skip
    stub._get_per_token_logps_and_entropies = functools.partial(
        GRPOTrainer._get_per_token_logps_and_entropies, stub
    )
    return stub


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| over max |expected| (0 when both are 0)."""
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    return error / scale if scale > 0 else error


MAX_DIFFERENCES: dict[str, float] = defaultdict(
    float
)  # the largest relative differences seen, for the report


def run_both(
    config: GRPOConfig,
    rollouts: list[Rollout],
    accumulation: int,
    steps_per_generation: int,
    generation_tokens: int | None = None,
) -> dict:
    """One optimizer step over `rollouts` (its micro-batches) by TRL and by fntrain: each side's summed
    loss, the gradients of every completion logit, and the metrics averaged over the micro-batches.
    `generation_tokens`: the generation batch's loss tokens (None: those of `rollouts`)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    tokens = generation_tokens or sum(int(r.completion_mask.sum()) for r in rollouts)
    trl_leaves = [r.completion_logits.clone().requires_grad_(True) for r in rollouts]
    trl_parts = [trl_inputs(r, leaf, tokens) for r, leaf in zip(rollouts, trl_leaves, strict=True)]
    stub = trl_loss_stub(
        config, FusedHead([full for _, full in trl_parts]), accumulation, steps_per_generation
    )
    trl_loss = sum(GRPOTrainer._compute_loss(stub, stub.model, inputs) for inputs, _ in trl_parts)
    trl_loss.backward()
    trl_metrics = {name: sum(values) / len(values) for name, values in stub._metrics["train"].items()}

    leaves = [r.completion_logits.clone().requires_grad_(True) for r in rollouts]
    loss_fn = make_grpo_loss(config, micro_batches=accumulation, steps_per_generation=steps_per_generation)
    loss, metrics = 0.0, defaultdict(list)
    for rollout, leaf in zip(rollouts, leaves, strict=True):
        batch, logits = fntrain_micro_batch(rollout, leaf, tokens)
        output = make_grpo_forward(TEMPERATURE, forward=lambda model, micro_batch, logits=logits: logits)(
            None, batch
        )
        part, part_metrics = loss_fn(output, batch)
        loss = loss + part / len(rollouts)  # the step's "mean" weighting: each micro-batch's loss over GA
        for name, value in part_metrics.items():
            metrics[name].append(value.item())
    loss.backward()
    metrics = {name: sum(values) / len(values) for name, values in metrics.items()}
    return {"trl": (trl_loss, [leaf.grad for leaf in trl_leaves], trl_metrics),
            "fntrain": (loss, [leaf.grad for leaf in leaves], metrics)}  # fmt: skip


def assert_same(result: dict, beta: float) -> None:
    (trl_loss, trl_grads, trl_metrics), (loss, grads, metrics) = result["trl"], result["fntrain"]
    loss_difference = relative_difference(loss.detach(), trl_loss.detach())
    assert loss_difference <= 1e-5 or abs(loss.item() - trl_loss.item()) <= 1e-7, (
        loss.item(),
        trl_loss.item(),
    )
    MAX_DIFFERENCES["loss"] = max(MAX_DIFFERENCES["loss"], loss_difference)
    for grad, trl_grad in zip(grads, trl_grads, strict=True):
        difference = relative_difference(grad, trl_grad)
        MAX_DIFFERENCES["gradient"] = max(MAX_DIFFERENCES["gradient"], difference)
        assert difference <= 1e-5, difference
    expected = METRICS + (("kl",) if beta > 0 else ())
    assert set(metrics) == set(expected) and set(expected) <= set(trl_metrics)
    for name in expected:
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6, nan_ok=True), name
        if not math.isnan(trl_metrics[name]) and trl_metrics[name] != 0:
            difference = abs(metrics[name] - trl_metrics[name]) / abs(trl_metrics[name])
            MAX_DIFFERENCES["metric"] = max(MAX_DIFFERENCES["metric"], difference)


def config_of(loss_type: str, beta: float, level: str, delta: float | None, bias_correction: bool = True):
    return GRPOConfig(reward_funcs=("tests.fake:reward",), loss_type=loss_type, beta=beta, epsilon=0.2,
                      epsilon_high=0.28, delta=delta, importance_sampling_level=level, temperature=TEMPERATURE,
                      max_completion_length=MAX_COMPLETION, use_bias_correction_kl=bias_correction)  # fmt: skip


@pytest.mark.parametrize("accumulation,old", [(1, False), (1, True), (2, False), (2, True)], ids=str)
@pytest.mark.parametrize("delta", [None, 1.5], ids=lambda d: f"delta={d}")
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta,bias_correction", [(0.0, True), (0.04, True), (0.04, False)], ids=str)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_compute_loss_gives_the_same_loss_gradients_and_metrics(
    loss_type, beta, bias_correction, level, delta, accumulation, old
):
    pytest.importorskip("trl")
    config = config_of(loss_type, beta, level, delta, bias_correction)
    # the last micro-batch's second row is a masked truncated completion (mask_truncated_completions)
    rollouts = [make_rollout(10 * accumulation + index, old, beta > 0, [True, index == 0, True])
                for index in range(accumulation)]  # fmt: skip
    assert_same(run_both(config, rollouts, accumulation, steps_per_generation=accumulation), beta)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_dapo_normaliser_over_a_generation_spanning_two_optimizer_steps(accumulation, level):
    """S = 2 GA: the generation batch's loss tokens N feed two optimizer steps (TRL: N x GA / S a window)."""
    pytest.importorskip("trl")
    config = config_of("dapo", 0.0, level, None)
    rollouts = [make_rollout(40 + index, old=True, ref=False) for index in range(2 * accumulation)]
    tokens = sum(int(r.completion_mask.sum()) for r in rollouts)
    for step in range(2):
        window = rollouts[step * accumulation : (step + 1) * accumulation]
        assert_same(run_both(config, window, accumulation, 2 * accumulation, generation_tokens=tokens), 0.0)


def test_trl_compute_loss_of_a_micro_batch_without_loss_tokens():
    """Every row masked: loss 0 and zero gradients on both sides, token means 0, low_min/high_max NaN."""
    pytest.importorskip("trl")
    for level in ("token", "sequence"):
        config = config_of("grpo", 0.04, level, None)
        rollout = make_rollout(50, old=True, ref=True, trained=[False] * 3)
        result = run_both(config, [rollout], 1, 1)
        assert result["fntrain"][0].item() == 0.0 and not result["fntrain"][1][0].any()
        assert_same(result, 0.04)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_clip_extremes_when_every_row_is_low_clipped(level):
    """Every row's advantage negative and its ratio well below 1 − ε: clip_ratio/low_min above 0."""
    pytest.importorskip("trl")
    rollout = make_rollout(60, old=True, ref=False, advantages=[-1.0, -0.5, -2.0])
    rollout.old = (rollout.old + 1.0).masked_fill(~rollout.completion_mask.bool(), 0)
    result = run_both(config_of("bnpo", 0.0, level, None), [rollout], 1, 1)
    assert_same(result, 0.0)
    assert result["fntrain"][2]["clip_ratio/low_min"] > 0


# ----------------------------------------------------------------------------- (b) advantages

GROUP = 4
NAN = float("nan")
# Recorded scores of 5 prompts x 4 completions by two reward functions (None: could not score). Groups:
# varied; all equal (zero std); partly unscored with one row no function scored; a single scored row of
# the weighted sum (no std: advantages 0); varied again with a negative score.
SCORES = {
    "accuracy": [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5, None, None, 1.0, None, None, 2.0, None,
                 0.3, -1.0, 0.7, 0.2],
    "format": [0.5, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, None, 0.25, None, 0.75, None, None, None, None,
               1.0, 0.0, None, 0.5],
}  # fmt: skip


def recording_reward(name: str):
    """A reward function (TRL's signature) returning the recorded scores of the completions "c{row}"."""

    def reward(prompts, completions, completion_ids, **kwargs):
        return [SCORES[name][int(completion[1:])] for completion in completions]

    reward.__name__ = name
    return reward


def trl_scoring_stub(aggregation: str, scale_rewards: str, weights: tuple[float, ...]):
    """Just what `GRPOTrainer._generate_and_score_completions` and `_calculate_rewards` read of their
    trainer (one process, no reference, no old log-probs), `_generate` returning recorded completions."""
    from accelerate import PartialState
    from trl.trainer.grpo_trainer import GRPOTrainer

    PartialState()  # accelerate's gather / gather_object ask it whether the run is distributed
    identity = lambda x: x  # noqa: E731
    rows = len(SCORES["accuracy"])

    def generate(prompts):
        completions = [f"c{row}" for row in range(rows)]
        completion_ids = [[1 + row % 5] * (1 + row % 3) for row in range(rows)]
        return [[7, 8]] * rows, completion_ids, None, completions, None, {}, None, None

    stub = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=identity, process_index=0, is_main_process=True),
        args=SimpleNamespace(per_device_train_batch_size=rows, gradient_checkpointing_kwargs=None,
                             steps_per_generation=1, gradient_accumulation_steps=1, report_to=[]),
        model=nn.Linear(1, 1).train(), state=SimpleNamespace(global_step=0), environment_factories=None,
        tools=None, environments=None, _generate=generate, _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None, mask_truncated_completions=False, num_iterations=1, use_vllm=False, beta=0.0,
        ref_model=None, reward_funcs=[recording_reward(name) for name in SCORES], reward_func_names=list(SCORES),
        reward_processing_classes=[None] * len(SCORES), reward_weights=torch.tensor(weights),
        num_generations=GROUP, multi_objective_aggregation=aggregation, scale_rewards=scale_rewards,
        _metrics={"train": defaultdict(list)}, _pending_extra_logs=defaultdict(list),
        _pending_metrics=defaultdict(list), log_multimodal=False,
        _logs={"prompt": [], "completion": [], "advantages": [], "rewards": defaultdict(list),
               "extra": defaultdict(list)},
    )  # fmt: skip
    stub.model.is_gradient_checkpointing = False
    stub._log_completion_extra = stub._log_metric = lambda *args: None
    stub._calculate_rewards = functools.partial(GRPOTrainer._calculate_rewards, stub)
    return stub


@pytest.mark.parametrize(
    "aggregation,scale_rewards",
    [("sum_then_normalize", "group"), ("sum_then_normalize", "batch"), ("sum_then_normalize", "none"),
     ("normalize_then_sum", "group")],
)  # fmt: skip
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 0.5)], ids=str)
def test_trl_generate_and_score_gives_the_same_advantages_and_reward_metrics(
    aggregation, scale_rewards, weights
):
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    stub = trl_scoring_stub(aggregation, scale_rewards, weights)
    rows = len(SCORES["accuracy"])
    inputs = [
        {"prompt": f"p{row // GROUP}"} for row in range(rows)
    ]  # TRL's sampler repeats each prompt G times
    output = GRPOTrainer._generate_and_score_completions(stub, inputs)
    scores = torch.tensor([[NAN if v is None else v for v in SCORES[name]] for name in SCORES]).T
    result = group_advantages(scores, weights, GROUP, scale_rewards, aggregation, list(SCORES))
    difference = relative_difference(result.advantages, output["advantages"])
    MAX_DIFFERENCES["advantage"] = max(MAX_DIFFERENCES["advantage"], difference)
    assert difference <= 1e-6, (result.advantages, output["advantages"])
    assert result.advantages[10] == 0  # no function scored it
    if aggregation == "sum_then_normalize":
        assert result.advantages[12:16].eq(0).all()  # one scored row in the group: its own mean
    trl_metrics = {name: values[0] for name, values in stub._metrics["train"].items()}
    assert set(result.metrics) <= set(trl_metrics)
    for name, value in result.metrics.items():
        assert value.item() == pytest.approx(trl_metrics[name], rel=1e-6, abs=1e-7, nan_ok=True), name
    assert (
        trl_metrics["frac_reward_zero_std"] > 0
        or scale_rewards == "batch"
        or aggregation != "sum_then_normalize"
    )


@pytest.fixture(scope="module", autouse=True)
def report_differences():
    yield
    print("\nlargest relative differences against TRL:", dict(MAX_DIFFERENCES))
