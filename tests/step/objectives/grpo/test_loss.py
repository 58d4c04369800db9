"""GRPO's per-token log-probs, entropy, per-token objective, loss scaling and metrics (fntrain.step.
objectives.grpo.loss, logps.py): hand-computed values; TRL's own numbers are in test_trl_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives import logps as logps_module
from fntrain.step.objectives.grpo.config import GRPOConfig
from fntrain.step.objectives.grpo.loss import GRPOOutput, grpo_token_loss, make_grpo_forward, make_grpo_loss
from fntrain.step.objectives.logps import completion_logps, token_entropy, token_logps
from tests.runtime.conftest import one_rank_env  # noqa: F401 (the fixture: a 1-rank torchrun environment)
from tests.step.host_reads import no_host_reads

VOCAB, SEQ = 7, 6
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max")  # fmt: skip


def grpo_config(**fields) -> GRPOConfig:
    defaults = {"reward_funcs": ("tests.fake:reward",), "epsilon": 0.2, "epsilon_high": 0.28,
                "max_completion_length": 5}  # fmt: skip
    return GRPOConfig(**{**defaults, **fields})


def labels_of(rows: list[tuple[int, int]], seed: int = 0) -> torch.Tensor:
    """(B, SEQ) labels: per row (prompt length, completion length), the completion's ids trained."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.full((len(rows), SEQ), IGNORE_INDEX)
    for row, (prompt, completion) in enumerate(rows):
        labels[row, prompt : prompt + completion] = torch.randint(
            0, VOCAB, (completion,), generator=generator
        )
    return labels


def micro_batch(labels: torch.Tensor, advantages: list[float], **fields) -> dict:
    return {"labels": labels, "advantages": torch.tensor(advantages), **fields}


def output_of(logps: torch.Tensor, entropy: torch.Tensor | None = None) -> GRPOOutput:
    return GRPOOutput(logps, torch.zeros_like(logps) if entropy is None else entropy)


def naive_token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    targets, valid = labels[:, 1:], labels[:, 1:] != IGNORE_INDEX
    per_token = torch.log_softmax(logits[:, :-1].float() / temperature, -1)
    return per_token.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid


# ----------------------------------------------------------------------------- log-probs and entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_token_logps_are_log_softmax_at_the_temperature(dtype, temperature):
    labels = labels_of([(2, 3), (1, 5), (3, 0)])
    logits = (3 * torch.randn(3, SEQ, VOCAB, generator=torch.Generator().manual_seed(1))).to(dtype)
    values = token_logps(logits, labels, temperature)
    assert values.dtype == torch.float32 and values.shape == (3, SEQ - 1)
    assert torch.allclose(values, naive_token_logps(logits, labels, temperature), rtol=1e-5, atol=1e-5)
    assert values[labels[:, 1:] == IGNORE_INDEX].eq(0).all()


@pytest.mark.parametrize("chunk_elements", [1 << 26, 2 * VOCAB])  # whole rows; two positions a chunk
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logps_gradient_is_autograd_through_log_softmax(chunk_elements, temperature, monkeypatch):
    monkeypatch.setattr(logps_module, "_CHUNK_ELEMENTS", chunk_elements)
    labels = labels_of([(2, 3), (1, 5), (4, 1)])
    start = torch.randn(3, SEQ, VOCAB, generator=torch.Generator().manual_seed(2))
    weights = torch.randn(3, SEQ - 1, generator=torch.Generator().manual_seed(3))
    logits, naive = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    (token_logps(logits, labels, temperature) * weights).sum().backward()
    (naive_token_logps(naive, labels, temperature) * weights).sum().backward()
    assert torch.allclose(logits.grad, naive.grad, rtol=1e-5, atol=1e-6)
    assert logits.grad[:, -1].eq(0).all()  # the last position predicts nothing


def test_completion_logps_is_the_sum_of_token_logps_bit_for_bit():
    labels = labels_of([(2, 3), (1, 5), (3, 0)])
    logits = torch.randn(3, SEQ, VOCAB, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    sums, counts = completion_logps(logits, labels)
    assert torch.equal(sums, token_logps(logits, labels).sum(-1))
    assert counts.tolist() == [3, 5, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_token_entropy_is_the_entropy_at_the_temperature_without_gradient(temperature, monkeypatch):
    monkeypatch.setattr(logps_module, "_CHUNK_ELEMENTS", 3 * VOCAB)
    logits = torch.randn(2, SEQ, VOCAB, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    entropy = token_entropy(logits, temperature)
    log_p = torch.log_softmax(logits.detach()[:, :-1] / temperature, -1)
    assert entropy.shape == (2, SEQ - 1) and not entropy.requires_grad
    assert torch.allclose(entropy, -(log_p.exp() * log_p).sum(-1), rtol=1e-5, atol=1e-6)


def test_a_temperature_of_zero_is_refused():
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        token_logps(torch.zeros(1, 2, VOCAB), torch.zeros(1, 2, dtype=torch.long), 0.0)


def test_grpo_forward_scores_the_labels_at_the_temperature():
    labels = labels_of([(2, 3), (1, 0)])
    logits = torch.randn(2, SEQ, VOCAB, generator=torch.Generator().manual_seed(6)).requires_grad_(True)
    forward = make_grpo_forward(0.8, forward=lambda model, batch: logits)
    output = forward(None, {"labels": labels})
    assert torch.allclose(output.logps, naive_token_logps(logits, labels, 0.8), rtol=1e-5, atol=1e-6)
    assert output.logps.requires_grad and not output.entropy.requires_grad
    assert output.entropy[0, 1:4].gt(0).all() and output.entropy[labels[:, 1:] == IGNORE_INDEX].eq(0).all()


# ----------------------------------------------------------------------------- the loss


ROWS = [(1, 4), (2, 2), (1, 1), (3, 0)]  # the last row has no loss token
ADVANTAGES = [0.5, -1.5, 2.0, 3.0]
TOKENS = [4, 2, 1, 0]


def on_policy(loss_type: str, **fields) -> torch.Tensor:
    labels = labels_of(ROWS)
    logps = -torch.rand(4, SEQ - 1, generator=torch.Generator().manual_seed(7))
    batch = micro_batch(labels, ADVANTAGES, generation_tokens=torch.tensor(30.0))
    loss_fn = make_grpo_loss(grpo_config(loss_type=loss_type, **fields), micro_batches=2, steps_per_generation=4)
    with no_host_reads():
        loss, _ = loss_fn(output_of(logps * (labels[:, 1:] != IGNORE_INDEX)), batch)
    return loss


def test_on_policy_loss_is_minus_the_advantage_weighted_as_each_loss_type_says():
    signed = [-a * n for a, n in zip(ADVANTAGES, TOKENS, strict=True)]  # per row: -A x its tokens
    grpo = (
        sum(s / max(n, 1) for s, n in zip(signed, TOKENS, strict=True)) / 4
    )  # a row without tokens counts as 0
    assert on_policy("grpo").item() == pytest.approx(grpo)
    assert on_policy("bnpo").item() == pytest.approx(sum(signed) / sum(TOKENS))
    assert on_policy("dr_grpo").item() == pytest.approx(sum(signed) / (4 * 5))
    # dapo: the generation batch's 30 tokens over dp x S = 1 x 4 micro-steps
    assert on_policy("dapo").item() == pytest.approx(sum(signed) / (30 / 4))


def test_on_policy_gradient_is_minus_the_advantage_per_token():
    labels = labels_of(ROWS)
    mask = labels[:, 1:] != IGNORE_INDEX
    logps = torch.zeros(4, SEQ - 1, requires_grad=True)
    loss_fn = make_grpo_loss(grpo_config(loss_type="bnpo"), micro_batches=1, steps_per_generation=1)
    loss, _ = loss_fn(output_of(logps), micro_batch(labels, ADVANTAGES))
    loss.backward()
    expected = -torch.tensor(ADVANTAGES).unsqueeze(1) * mask / sum(TOKENS)
    assert torch.allclose(logps.grad, expected)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_micro_batch_without_loss_tokens_has_loss_zero_and_no_nan(loss_type, level):
    labels = torch.full((2, SEQ), IGNORE_INDEX)
    logps = torch.zeros(2, SEQ - 1, requires_grad=True)
    batch = micro_batch(labels, [1.0, -1.0], generation_tokens=torch.tensor(0.0),
                        old_logps=torch.zeros(2, SEQ - 1), ref_logps=torch.zeros(2, SEQ - 1))  # fmt: skip
    cfg = grpo_config(loss_type=loss_type, importance_sampling_level=level, beta=0.1)
    loss, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(output_of(logps), batch)
    loss.backward()
    assert loss.item() == 0.0 and logps.grad.eq(0).all()
    for name in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[name].item() == 0.0, name
    extremes = metrics["clip_ratio/low_min"].item(), metrics["clip_ratio/high_max"].item()
    if level == "token":  # TRL's nanmin / nanmax over no row with tokens: NaN
        assert math.isnan(extremes[0]) and math.isnan(extremes[1])
    else:  # one value per row, every row counted: none clipped (an empty row's ratio is 1)
        assert extremes == (0.0, 0.0)


def one_token_loss(ratio: float, advantage: float, **fields) -> tuple[float, float]:
    """(loss, d loss / d logps) of a single token whose importance ratio is `ratio` (bnpo: the token's ℓ)."""
    labels = labels_of([(1, 1)])
    logps = torch.zeros(1, SEQ - 1, requires_grad=True)
    old = torch.zeros(1, SEQ - 1)
    old[0, 0] = -math.log(ratio)
    loss_fn = make_grpo_loss(grpo_config(loss_type="bnpo", **fields), micro_batches=1, steps_per_generation=1)
    loss, _ = loss_fn(output_of(logps), micro_batch(labels, [advantage], old_logps=old))
    loss.backward()
    return loss.item(), logps.grad[0, 0].item()


@pytest.mark.parametrize(
    "ratio,advantage,loss,gradient",
    [(1.5, 1.0, -1.28, 0.0),  # above 1 + ε_high with A > 0: clipped, no gradient
     (1.1, 1.0, -1.1, -1.1),  # inside: −r A, d/dπ = −r A
     (0.5, 1.0, -0.5, -0.5),  # below 1 − ε with A > 0: the unclipped term is the smaller, kept
     (0.5, -1.0, 0.8, 0.0),  # below 1 − ε with A < 0: clipped
     (1.5, -1.0, 1.5, 1.5)],  # above with A < 0: kept (pessimistic)
)  # fmt: skip
def test_clipping_regions(ratio, advantage, loss, gradient):
    value, grad = one_token_loss(ratio, advantage)
    assert value == pytest.approx(loss) and grad == pytest.approx(gradient, abs=1e-7)


def test_delta_caps_the_unclipped_ratio():
    assert one_token_loss(3.0, -1.0) == pytest.approx((3.0, 3.0))
    assert one_token_loss(3.0, -1.0, delta=2.0) == pytest.approx((2.0, 0.0))  # capped: min(r, δ) A
    assert one_token_loss(1.5, 1.0, delta=2.0) == pytest.approx((-1.28, 0.0))  # the upper clip still wins


def test_sequence_importance_sampling_takes_one_ratio_per_row():
    labels = labels_of([(1, 3)])
    logps = torch.zeros(1, SEQ - 1, requires_grad=True)
    old = torch.zeros(1, SEQ - 1)
    old[0, :3] = torch.tensor([0.3, -0.1, 0.1])  # mean log-ratio −0.1
    objective = grpo_token_loss(logps, old, None, torch.tensor([1.0]), labels[:, 1:] != IGNORE_INDEX,
                                grpo_config(importance_sampling_level="sequence"))  # fmt: skip
    assert objective.ratio.shape == (1, 1) and objective.ratio.item() == pytest.approx(math.exp(-0.1))
    assert torch.allclose(objective.loss[0, :3], torch.full((3,), -math.exp(-0.1)))


@pytest.mark.parametrize("bias_correction", [True, False])
def test_kl_is_k3_to_the_reference_times_the_ratio_when_bias_corrected(bias_correction):
    labels = labels_of([(1, 2)])
    mask = labels[:, 1:] != IGNORE_INDEX
    logps, old, ref = torch.zeros(1, SEQ - 1), torch.zeros(1, SEQ - 1), torch.zeros(1, SEQ - 1)
    logps[0, :2], old[0, :2], ref[0, :2] = torch.tensor([-1.0, -2.0]), torch.tensor([-1.1, -2.0]), -1.5
    cfg = grpo_config(loss_type="bnpo", beta=0.1, use_bias_correction_kl=bias_correction)
    objective = grpo_token_loss(logps, old, ref, torch.tensor([0.0]), mask, cfg)
    difference = torch.tensor([-0.5, 0.5])  # ref − logps
    k3 = difference.exp() - difference - 1
    ratio = torch.tensor([math.exp(0.1), 1.0])
    expected = k3 * ratio if bias_correction else k3
    assert torch.allclose(objective.kl[0, :2], expected)
    assert torch.allclose(objective.loss[0, :2], 0.1 * expected)  # A = 0: only the KL term
    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(
        output_of(logps), micro_batch(labels, [0.0], old_logps=old, ref_logps=ref)
    )
    assert metrics["kl"].item() == pytest.approx(expected.mean().item())


def test_missing_inputs_and_bad_shapes_are_named():
    labels = labels_of([(1, 2)])
    output = output_of(torch.zeros(1, SEQ - 1))
    with pytest.raises(ValueError, match="needs the micro-batch's 'ref_logps'"):
        make_grpo_loss(grpo_config(beta=0.1), micro_batches=1, steps_per_generation=1)(
            output, micro_batch(labels, [1.0])
        )
    with pytest.raises(ValueError, match="needs the micro-batch's 'generation_tokens'"):
        make_grpo_loss(grpo_config(), micro_batches=1, steps_per_generation=1)(output, micro_batch(labels, [1.0]))
    with pytest.raises(ValueError, match="steps_per_generation must be a multiple .* \\(2\\), got 3"):
        make_grpo_loss(grpo_config(), micro_batches=2, steps_per_generation=3)
    with pytest.raises(ValueError, match="do not match labels"):
        make_grpo_loss(grpo_config(), micro_batches=1, steps_per_generation=1)(
            output_of(torch.zeros(1, SEQ)), micro_batch(labels, [1.0])
        )


# ----------------------------------------------------------------------------- metrics over ranks


def rank_batches() -> list[tuple[GRPOOutput, dict]]:
    """Two ranks' micro-batches of 3 rows each: ratios spread over the clipping regions (the old
    log-probs shifted against each row's advantage, plus noise), a row without tokens on rank 1,
    entropies and reference log-probs."""
    pieces = []
    rank_rows = [[(1, 4), (2, 3), (1, 1)], [(2, 2), (1, 0), (1, 5)]]
    rank_advantages = [[1.0, -0.5, 0.3], [-1.2, 0.8, 2.0]]
    for rank, (rows, advantages) in enumerate(zip(rank_rows, rank_advantages, strict=True)):
        generator = torch.Generator().manual_seed(10 + rank)
        labels = labels_of(rows, seed=rank)
        mask = labels[:, 1:] != IGNORE_INDEX
        logps = -torch.rand(3, SEQ - 1, generator=generator) * mask
        shift = 0.4 * torch.tensor(advantages).sign().unsqueeze(1)
        old = (logps - shift + 0.4 * torch.randn(3, SEQ - 1, generator=generator)) * mask
        ref = (logps + 0.3 * torch.randn(3, SEQ - 1, generator=generator)) * mask
        entropy = torch.rand(3, SEQ - 1, generator=generator) * mask
        batch = micro_batch(
            labels, advantages, old_logps=old, ref_logps=ref, generation_tokens=torch.tensor(15.0)
        )
        pieces.append((GRPOOutput(logps.requires_grad_(True), entropy), batch))
    return pieces


def joined(pieces: list[tuple[GRPOOutput, dict]]) -> tuple[GRPOOutput, dict]:
    """One process holding every rank's rows."""
    outputs, batches = zip(*pieces, strict=True)
    output = GRPOOutput(torch.cat([o.logps for o in outputs]), torch.cat([o.entropy for o in outputs]))
    batch = {key: torch.cat([b[key] for b in batches]) for key in batches[0] if key != "generation_tokens"}
    return output, {**batch, "generation_tokens": batches[0]["generation_tokens"]}


def losses_on_simulated_ranks(cfg: GRPOConfig, pieces: list) -> tuple[list, list[int]]:
    """Each rank's (loss, metrics) with an all_reduce that sees every rank's tensors: a first pass records
    what each rank contributes to each collective (the loss is deterministic), a second reduces them."""
    contributions: list[list[torch.Tensor]] = [[] for _ in pieces]

    def recording(rank: int):
        return lambda tensor, op: contributions[rank].append(tensor.clone()) or tensor

    for rank, (output, batch) in enumerate(pieces):
        make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1, dp_size=len(pieces),
                       all_reduce=recording(rank))(output, batch)  # fmt: skip
    results = []
    for rank, (output, batch) in enumerate(pieces):
        loss_fn = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1, dp_size=len(pieces),
                                 all_reduce=_reducer(contributions, rank))  # fmt: skip
        with no_host_reads():
            results.append(loss_fn(output, batch))
    return results, [len(c) for c in contributions]


def _reducer(contributions: list[list[torch.Tensor]], rank: int):
    """The all_reduce rank `rank` sees: its k-th call reduces every rank's k-th recorded tensor."""
    calls = iter(range(len(contributions[rank])))

    def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        index = next(calls)
        assert torch.equal(tensor, contributions[rank][index])
        stacked = torch.stack([ranks[index] for ranks in contributions])
        return {"sum": stacked.sum(0), "min": stacked.amin(0), "max": stacked.amax(0)}[op]

    return all_reduce


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_metrics_are_global_over_the_ranks_rows(level):
    cfg = grpo_config(beta=0.05, importance_sampling_level=level)
    pieces = rank_batches()
    results, collectives = losses_on_simulated_ranks(cfg, pieces)
    assert collectives == [2, 2]  # one sum, one max
    _, single = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(*joined(pieces))
    assert set(single) == {"kl", "entropy", *CLIP_METRICS}
    for _, metrics in results:
        for name, value in single.items():
            assert metrics[name].item() == pytest.approx(value.item(), rel=1e-6), name
    assert 0 < single["clip_ratio/region_mean"].item() < 1


def test_clip_extremes_are_the_min_and_max_of_the_rows_masked_means():
    cfg = grpo_config()
    output, batch = joined(rank_batches())
    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(output, batch)
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    objective = grpo_token_loss(output.logps, batch["old_logps"], None, batch["advantages"], mask, cfg)
    advantages = batch["advantages"].unsqueeze(1)
    low = ((objective.ratio < 0.8) & (advantages < 0) & mask).sum(-1) / mask.sum(-1)
    high = ((objective.ratio > 1.28) & (advantages > 0) & mask).sum(-1) / mask.sum(-1)
    rows = mask.any(-1)  # the row without tokens is left out
    assert metrics["clip_ratio/low_min"].item() == pytest.approx(low[rows].min().item())
    assert metrics["clip_ratio/high_max"].item() == pytest.approx(high[rows].max().item())
    assert metrics["clip_ratio/high_max"].item() > 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_rank_losses_average_to_the_one_process_loss_where_the_type_is_per_row_or_per_generation(loss_type):
    """DDP averages the ranks' gradients: for grpo, dr_grpo (equal rows per rank) and dapo (N over dp),
    the mean of the ranks' losses is the loss of one process holding all rows; bnpo is a per-rank token
    mean, as TRL's is."""
    cfg = grpo_config(loss_type=loss_type)
    pieces = rank_batches()
    results, _ = losses_on_simulated_ranks(cfg, pieces)
    single, _ = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(*joined(pieces))
    average = sum(loss for loss, _ in results) / 2
    if loss_type == "bnpo":
        tokens = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for _, b in pieces]
        assert tokens[0] != tokens[1] and average.item() != pytest.approx(single.item())
    else:
        assert average.item() == pytest.approx(single.item(), rel=1e-6)


# ----------------------------------------------------------------------------- vocabulary-parallel logits


@pytest.mark.slow
def test_grpo_forward_and_loss_over_vocabulary_parallel_logits(one_rank_env):  # noqa: F811 (the fixture)
    """Logits split over the vocabulary (a DTensor, tensor parallelism): the same log-probs, entropy,
    loss and gradient as plain logits. Slow tier: a real 1-rank gloo group and mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (1,))
        labels = labels_of([(1, 4), (2, 2)])
        full = torch.randn(2, SEQ, VOCAB, generator=torch.Generator().manual_seed(9)).requires_grad_(True)
        split = distribute_tensor(full.detach(), mesh, [Shard(-1)]).requires_grad_(True)
        batch = micro_batch(labels, [1.0, -0.5], generation_tokens=torch.tensor(6.0))
        loss_fn = make_grpo_loss(grpo_config(), micro_batches=1, steps_per_generation=1)
        results = []
        for logits in (full, split):
            with loss_parallel():
                output = make_grpo_forward(0.7, forward=lambda model, mb, logits=logits: logits)(None, batch)
                loss, metrics = loss_fn(output, batch)
                loss.backward()
            results.append((output, loss, metrics))
        (plain, plain_loss, plain_metrics), (parallel, loss, metrics) = results
        assert torch.allclose(parallel.logps, plain.logps) and torch.allclose(parallel.entropy, plain.entropy)
        assert torch.allclose(loss, plain_loss) and torch.allclose(
            metrics["entropy"], plain_metrics["entropy"]
        )
        assert torch.allclose(split.grad.full_tensor(), full.grad, atol=1e-6)
    finally:
        dist.destroy_process_group()
