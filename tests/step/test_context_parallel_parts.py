"""Context parallelism's pieces as plain functions (issue 28, item 4): the Ulysses all-to-alls over
simulated ranks and over a real 1-rank gloo group, the sequence slice (global positions and targets,
document masks kept whole), the slices' loss shares, and the phase-1 refusals. The multi-process runs
(cp 2 = cp 1, cp 2 x fsdp2 dp 2, resume) are tests/step/test_context_parallel.py (slow)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fntrain.data.packing import document_causal_mask, pack_sequence
from fntrain.step import causal_lm_loss
from fntrain.step.context_parallel import (
    context_parallel_parts,
    heads_to_seq,
    seq_to_heads,
    shard_micro_batch,
    to_heads,
    to_seq,
    ulysses_attention,
)
from tests.cli.test_bad_inputs import SMALL
from tests.helpers.commands import expect_one_line
from tests.runtime.conftest import one_rank_env  # noqa: F401 (the fixture: a 1-rank torchrun environment)


def _simulated(per_rank: list[torch.Tensor], step) -> list[torch.Tensor]:
    """Run `step(x, size, exchange)` on every simulated rank at once: rank r's received chunk j is
    rank j's sent chunk r (what all_to_all_single does)."""
    size = len(per_rank)
    sent: dict[int, torch.Tensor] = {}
    results: list[torch.Tensor | None] = [None] * size

    def exchange_for(rank: int):
        def exchange(send: torch.Tensor) -> torch.Tensor:
            sent[rank] = send
            return send  # replaced below, once every rank has sent
        return exchange

    # Two passes: collect what every rank sends, then give each rank what it receives.
    for rank, x in enumerate(per_rank):
        step(x, size, exchange_for(rank))
    for rank, x in enumerate(per_rank):
        received = torch.stack([sent[other][rank] for other in range(size)])
        results[rank] = step(x, size, lambda send, received=received: received)
    return results


@pytest.mark.parametrize("size", [2, 4])
def test_seq_to_heads_gives_each_rank_every_token_of_its_heads_and_back(size):
    torch.manual_seed(0)
    whole = torch.randn(2, 8, 4 * size, 3)  # [B, H, S, D]
    part, heads = whole.size(2) // size, whole.size(1) // size
    slices = [whole[:, :, r * part : (r + 1) * part] for r in range(size)]
    by_heads = _simulated(slices, to_heads)
    for rank, got in enumerate(by_heads):
        torch.testing.assert_close(got, whole[:, rank * heads : (rank + 1) * heads], rtol=0, atol=0)
    back = _simulated(by_heads, to_seq)
    for rank, got in enumerate(back):
        torch.testing.assert_close(got, slices[rank], rtol=0, atol=0)


def test_heads_that_do_not_divide_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--parallel.cp-size 2 must divide the attention heads, got 3"):
        to_heads(torch.zeros(1, 3, 4, 2), 2, lambda send: send)


def _packed(batch: int = 2, length: int = 8) -> dict[str, torch.Tensor]:
    """Packed sequences with a document boundary inside every half, a masked label, and the SDPA mask."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for sample in range(batch):
        ids = torch.randint(0, 50, (length,), generator=generator)
        documents = torch.tensor([0] * (3 + sample) + [1] * (length - 3 - sample))
        samples.append(pack_sequence(ids, document_ids=documents))
    packed = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    packed["attention_mask"] = document_causal_mask(packed["document_ids"])
    packed["labels"][0, 6] = -100
    return packed


def test_a_slice_keeps_global_positions_targets_and_the_whole_document_mask():
    packed = _packed()
    left, right = (shard_micro_batch(packed, rank, 2) for rank in (0, 1))
    torch.testing.assert_close(left["input_ids"], packed["input_ids"][:, :4])
    torch.testing.assert_close(right["position_ids"], packed["position_ids"][:, 4:])  # global, restarting per document
    # The last token of the left slice predicts the first of the right one; the sequence's last predicts nothing.
    assert torch.equal(left["shift_labels"][:, 3], packed["labels"][:, 4])
    assert (right["shift_labels"][:, -1] == -100).all()
    assert right["shift_labels"][0, 1] == -100  # labels[0, 6] was masked: position 5's target
    assert left["attention_mask"] is packed["attention_mask"]  # [B, 1, S, S]: attention sees the whole sequence
    assert left["document_ids"] is packed["document_ids"]
    assert "labels" not in left and "loss_mask" not in left
    plain = shard_micro_batch({"input_ids": packed["input_ids"], "labels": packed["labels"]}, 1, 2)
    assert torch.equal(plain["position_ids"], torch.arange(4, 8).expand(2, 4))  # none given: global arange


def test_a_sequence_that_does_not_divide_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--parallel.cp-size 3 must divide the sequence length, got 8 tokens"):
        shard_micro_batch(_packed(), 0, 3)


def test_loss_mask_is_applied_before_slicing():
    packed = _packed()
    packed["loss_mask"] = torch.ones_like(packed["labels"])
    packed["loss_mask"][1, 5] = 0  # unshifted: masks the target of position 4
    right = shard_micro_batch(packed, 1, 2)
    assert right["shift_labels"][1, 0] == -100


@pytest.mark.parametrize("size", [2, 4])
def test_the_slices_token_shares_add_up_to_the_whole_sequence_loss(size):
    """sum over cp ranks of (slice mean x slice tokens / all tokens) = the whole micro-batch's mean."""
    packed = _packed(length=8)
    logits = torch.randn(2, 8, 50, generator=torch.Generator().manual_seed(1))
    want = causal_lm_loss(logits, packed)
    part = 8 // size
    total = sum(
        causal_lm_loss(logits[:, r * part : (r + 1) * part], local := shard_micro_batch(packed, r, size))
        * (local["shift_labels"] != -100).sum() / (packed["labels"][:, 1:] != -100).sum()
        for r in range(size)
    )
    torch.testing.assert_close(total, want)


# ----------------------------------------------------------------------------- a real 1-rank gloo group


@pytest.fixture
def gloo_world(one_rank_env):  # noqa: F811 (the imported fixture, requested by name)
    dist.init_process_group("gloo")
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_all_to_alls_run_on_gloo_with_autograd(gloo_world):
    x = torch.randn(2, 4, 6, 3, requires_grad=True)
    y = heads_to_seq(seq_to_heads(x, gloo_world) * 2, gloo_world)
    y.sum().backward()
    torch.testing.assert_close(y, x * 2)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_ulysses_attention_routes_sdpa_and_is_entered_once(gloo_world, monkeypatch):
    import fntrain.step.context_parallel as cp

    calls = []
    real = cp.ulysses_sdpa
    monkeypatch.setattr(cp, "ulysses_sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = (torch.randn(1, 2, 4, 3) for _ in range(3))
    with ulysses_attention(gloo_world), ulysses_attention(gloo_world):  # nested: still one split
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls == [1]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    F.scaled_dot_product_attention(q, k, v)  # outside: plain attention again
    assert calls == [1]


def test_context_parallel_parts_on_one_rank_match_the_plain_forward_and_loss(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh

    from fntrain.models.gpt import ModelConfig, TinyGPT
    from fntrain.step import default_forward

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    parts = context_parallel_parts(default_forward, causal_lm_loss, mesh=mesh)
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=8, n_layer=1, n_head=2, d_model=8, vocab_size=50))
    packed = _packed()
    want = causal_lm_loss(default_forward(model, packed), packed)
    with parts.context():
        got = parts.train_loss(parts.forward(model, packed), packed)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(parts.eval_loss(parts.forward(model, packed), packed), want)
    with pytest.raises(ValueError, match="--parallel.cp-style must be one of ulysses, ring, got 'zigzag'"):
        context_parallel_parts(default_forward, causal_lm_loss, mesh=mesh, style="zigzag")


# ----------------------------------------------------------------------------- phase 1: one line, exit 2


def _launched_env(monkeypatch, world: int) -> None:
    """What torchrun gives rank 0 of `world`: phase 1 sees that world (it fails before any group)."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)


# (id, world size, args besides --parallel.cp-size 2, what the one line says)
CP_CASES = [
    ("strategy-none", 2, [], "--parallel.cp-size 2 needs --parallel.strategy ddp or fsdp2"),
    ("heads", 2, ["--parallel.strategy", "ddp", "--model.n-head", "1", "--model.d-model", "16"],
     "--parallel.cp-size 2 must divide the model's attention heads, got 1"),
    ("context", 2, ["--parallel.strategy", "ddp", "--model.context", "15"],
     "--parallel.cp-size 2 must divide --model.context, got 15"),
    ("ring-on-cpu", 2, ["--parallel.strategy", "ddp", "--parallel.cp-style", "ring"],
     "--parallel.cp-style ring needs a CUDA or NPU device"),
    ("with-activation-checkpointing", 2, ["--parallel.strategy", "fsdp2", "--parallel.activation-checkpointing"],
     "--parallel.cp-size 2 cannot be combined with --parallel.activation-checkpointing True yet"),
    ("with-tensor-parallel", 4, ["--parallel.strategy", "fsdp2", "--parallel.tp-size", "2"],
     "--parallel.cp-size 2 cannot be combined with --parallel.tp-size 2 yet"),
    ("with-compile", 2, ["--parallel.strategy", "fsdp2", "--parallel.compile", "--parallel.compile-backend", "eager"],
     "--parallel.cp-size 2 cannot be combined with --parallel.compile True yet"),
]  # fmt: skip


@pytest.mark.parametrize("world, args, needle", [c[1:] for c in CP_CASES], ids=[c[0] for c in CP_CASES])
def test_a_bad_cp_setting_is_one_line_and_creates_nothing(tmp_path, capsys, monkeypatch, world, args, needle):
    _launched_env(monkeypatch, world)
    # "recipes.tiny_gpt": this checkout's recipe (a bare "tiny_gpt" may find an installed copy first)
    argv = ["run", "recipes.tiny_gpt", "--run-dir", str(tmp_path / "run"), *SMALL, "--parallel.cp-size", "2", *args]
    expect_one_line(capsys, argv, needle)
    assert not any(tmp_path.iterdir())


def test_a_recipe_without_splittable_attention_refuses_cp(tmp_path):
    from fntrain.config import ConfigError
    from fntrain.step.layouts import check_context_parallel
    from recipes import hf_causal_lm, tiny_gpt

    config = tiny_gpt.Config(run_dir=str(tmp_path))
    config = type(config)(**{**config.__dict__, "parallel": type(config.parallel)(cp_size=2, strategy="ddp")})
    check_context_parallel(config, tiny_gpt.spec)  # the tiny GPT splits
    assert hf_causal_lm.spec.attention_heads is None
    with pytest.raises(ConfigError, match=r"^--parallel.cp-size 2: this recipe's model has no context-parallel attention"):
        check_context_parallel(config, hf_causal_lm.spec)


# ----------------------------------------------------------------------------- the plan


def test_the_plan_shows_cp_in_the_mesh_and_divides_activations_by_it():
    import dataclasses

    from fntrain.run.job import plan_job
    from recipes import tiny_gpt

    def plan(world: int, cp: int) -> dict:
        parallel = dataclasses.replace(tiny_gpt.Config().parallel, strategy="fsdp2", cp_size=cp)
        return plan_job(dataclasses.replace(tiny_gpt.Config(), parallel=parallel), tiny_gpt.spec, world_size=world)

    plain, split = plan(2, 1), plan(4, 2)  # both dp 2: the same batches per rank group
    assert split["mesh"]["dims"] == [["dp", 2], ["cp", 2]]
    assert split["mesh"]["ranks"][1]["groups"]["cp"] == [0, 1]
    assert split["micro_batches"] == plain["micro_batches"]
    memory, reference = split["memory_per_rank"], plain["memory_per_rank"]
    assert memory["activations"] * 2 == pytest.approx(reference["activations"], rel=1e-3)
    assert memory["params_per_rank"] * 2 == pytest.approx(reference["params_per_rank"], rel=1e-3)  # fsdp2 over dp x cp


def test_the_plan_refuses_what_the_run_would_refuse_but_not_ring_off_the_gpu_machine():
    import dataclasses

    from fntrain.config import ConfigError
    from fntrain.run.job import plan_job
    from recipes import tiny_gpt

    def config(**parallel) -> tiny_gpt.Config:
        return dataclasses.replace(tiny_gpt.Config(), parallel=dataclasses.replace(tiny_gpt.Config().parallel, **parallel))

    with pytest.raises(ConfigError, match=r"--parallel.cp-size 2 needs --parallel.strategy ddp or fsdp2"):
        plan_job(config(cp_size=2), tiny_gpt.spec, world_size=2)
    ring = plan_job(config(cp_size=2, strategy="fsdp2", cp_style="ring"), tiny_gpt.spec, world_size=2)
    assert ring["mesh"]["dims"] == [["dp", 1], ["cp", 2]]
