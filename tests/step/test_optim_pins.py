"""Behaviours of the optimizer and LR-schedule builders that mutation testing found unpinned (no default-tier
test called them directly): the schedule's value at every step of warmup and decay for each kind and
warmup style, its horizon, which parameters decay under each grouping (fntrain's, transformers' Trainer's,
decay_all, a pipeline stage decided by the whole model), the optimizer's settings and kernel, and the
line each bad setting gets."""

from __future__ import annotations

import math
import types

import pytest
import torch

from fntrain.state import RunPlan
from fntrain.step.optim import OptimizerConfig, ScheduleConfig, build_lr_schedule, build_optimizer, lr_factor


def factors(kind, warmup, horizon, floor=0.1, style="fntrain", steps=None):
    return [
        lr_factor(s, kind=kind, warmup_iters=warmup, horizon=horizon, min_lr_ratio=floor, warmup_style=style)
        for s in range(steps if steps is not None else horizon + 2)
    ]


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_warmup_rises_linearly_to_the_peak_in_either_style(kind):
    assert factors(kind, 4, 10, steps=5) == [0.25, 0.5, 0.75, 1.0, 1.0]  # step W: the peak, decay not begun
    assert factors(kind, 4, 10, style="hf", steps=5) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_constant_holds_the_peak_and_ignores_the_floor():
    assert factors("constant", 0, 5, floor=0.3) == [1.0] * 7


def test_linear_decays_to_the_floor_at_the_horizon_and_stays_there():
    got = factors("linear", 2, 6, floor=0.2)  # decay over steps 2..6
    want = [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    assert got == pytest.approx(want, abs=1e-12)


def test_cosine_follows_half_a_cosine_from_the_peak_to_the_floor():
    got = factors("cosine", 0, 8, floor=0.1)
    want = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(9)] + [0.1]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[4] == pytest.approx(0.55) and got[2] == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))


def test_a_horizon_no_longer_than_warmup_drops_to_the_floor_right_after_the_peak():
    assert factors("cosine", 3, 3, floor=0.25, steps=6) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 0.25, 0.25])
    assert factors("linear", 3, 2, floor=0.5, steps=5) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 0.5])


def toy_optimizer(lr=2.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def lrs(built, steps):
    optimizer = built.scheduler.optimizer
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        built.scheduler.step()
    return out


def test_the_schedule_scales_the_optimizers_lr_over_the_plans_horizon():
    plan = RunPlan(train_iters=6, steps_per_epoch=6, epochs=1, lr_schedule_iters=6)
    built = build_lr_schedule(
        ScheduleConfig(kind="linear", warmup_iters=2, min_lr_ratio=0.5), plan, toy_optimizer()
    )
    assert (built.horizon, built.warmup_iters) == (6, 2)
    assert lrs(built, 8) == pytest.approx([1.0, 2.0, 2.0, 1.75, 1.5, 1.25, 1.0, 1.0])


def test_a_set_horizon_wins_over_the_plans_and_hf_warmup_starts_at_zero():
    plan = RunPlan(train_iters=6, steps_per_epoch=6, epochs=1, lr_schedule_iters=6)
    config = ScheduleConfig(
        kind="cosine", warmup_iters=2, warmup_style="hf", min_lr_ratio=0.0, lr_schedule_iters=4
    )
    built = build_lr_schedule(config, plan, toy_optimizer())
    assert built.horizon == 4
    assert lrs(built, 5) == pytest.approx([0.0, 1.0, 2.0, 1.0, 0.0], abs=1e-12)


def test_a_plan_without_a_horizon_decays_over_train_iters_and_a_negative_one_is_refused():
    plan = RunPlan(train_iters=6, steps_per_epoch=6, epochs=1, lr_schedule_iters=0)
    assert build_lr_schedule(ScheduleConfig(), plan, toy_optimizer()).horizon == 6
    plan = RunPlan(train_iters=6, steps_per_epoch=6, epochs=1, lr_schedule_iters=-1)
    with pytest.raises(ValueError) as raised:
        build_lr_schedule(ScheduleConfig(), plan, toy_optimizer())
    assert str(raised.value) == "schedule.lr_schedule_iters must be > 0, got -1"


class Named(torch.nn.Module):
    """Parameters under the names each grouping rule looks at."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(5, 4)
        self.proj = torch.nn.Linear(4, 4)  # weight: matrix; bias: vector
        self.ln = torch.nn.LayerNorm(4)  # a LayerNorm instance, whatever its name
        self.attn_norm = torch.nn.Module()
        self.attn_norm.weight = torch.nn.Parameter(torch.ones(4))  # "_norm"
        self.norm = torch.nn.Module()
        self.norm.scale = torch.nn.Parameter(torch.ones(4, 4))  # a segment named "norm", a matrix
        self.final_RMSNorm = torch.nn.Module()
        self.final_RMSNorm.g = torch.nn.Parameter(torch.ones(4, 4))  # "rmsnorm", any case
        self.normal = torch.nn.Linear(4, 4, bias=False)  # "normal" is not "norm"
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.tok.weight  # tied to the embedding
        self.frozen = torch.nn.Parameter(torch.ones(3, 3), requires_grad=False)


def groups_of(built):
    names = {id(p): n for n, p in Named.last.named_parameters()}
    return [sorted(names[id(p)] for p in group["params"]) for group in built.optimizer.param_groups]


def build_named_optimizer(config, model=None, **kwargs):
    Named.last = model if model is not None else Named()
    return build_optimizer(config, Named.last, **kwargs)


def test_fntrain_grouping_leaves_vectors_and_embeddings_with_their_ties_undecayed():
    built = build_named_optimizer(OptimizerConfig(weight_decay=0.3))
    decayed, other = groups_of(built)
    assert decayed == ["final_RMSNorm.g", "norm.scale", "normal.weight", "proj.weight"]
    assert other == [
        "attn_norm.weight",
        "ln.bias",
        "ln.weight",
        "proj.bias",
        "tok.weight",
    ]  # head: tok's alias
    assert [g["weight_decay"] for g in built.optimizer.param_groups] == [0.3, 0.0]
    assert (built.decayed_params, built.undecayed_params) == (4 * 16, 4 + 8 + 4 + 20)


def test_hf_grouping_leaves_biases_and_norms_undecayed_as_transformers_trainer_does():
    decayed, other = groups_of(build_named_optimizer(OptimizerConfig(decay_grouping="hf")))
    assert decayed == ["normal.weight", "proj.weight", "tok.weight"]
    assert other == ["attn_norm.weight", "final_RMSNorm.g", "ln.bias", "ln.weight", "norm.scale", "proj.bias"]


def test_decay_all_decays_every_trainable_parameter():
    built = build_named_optimizer(OptimizerConfig(decay_all=True))
    (decayed,) = groups_of(built)
    assert "tok.weight" in decayed and "frozen" not in decayed and len(decayed) == 9  # the tied head once
    assert built.undecayed_params == 0


def test_a_pipeline_stage_decays_what_the_whole_model_decides():
    stage = torch.nn.Module()
    stage.head = torch.nn.Linear(4, 5, bias=False)  # the last stage's copy of the tied head
    alone = build_named_optimizer(OptimizerConfig(), stage)
    assert groups_of(alone) == [["head.weight"]]
    with_whole = build_named_optimizer(OptimizerConfig(), stage, full_model=Named())
    assert with_whole.optimizer.param_groups[0]["weight_decay"] == 0.0 and with_whole.decayed_params == 0


def test_the_optimizer_gets_its_settings_and_the_foreach_kernel_on_cpu():
    adamw = build_named_optimizer(OptimizerConfig(lr=0.01, betas=(0.8, 0.9), eps=1e-6)).optimizer
    assert isinstance(adamw, torch.optim.AdamW)
    assert (adamw.defaults["lr"], adamw.defaults["betas"], adamw.defaults["eps"]) == (0.01, (0.8, 0.9), 1e-6)
    assert adamw.defaults["foreach"] is True and not adamw.defaults["fused"]
    sgd = build_named_optimizer(OptimizerConfig(name="sgd", lr=0.5, momentum=0.9)).optimizer
    assert isinstance(sgd, torch.optim.SGD) and (sgd.defaults["lr"], sgd.defaults["momentum"]) == (0.5, 0.9)
    fused = build_named_optimizer(OptimizerConfig(fused=True)).optimizer
    assert fused.defaults["fused"] is True and not fused.defaults["foreach"]


def test_a_model_with_nothing_to_train_is_refused():
    model = torch.nn.Linear(2, 2)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="^the model has no trainable parameters$"):
        build_optimizer(OptimizerConfig(), model)


@pytest.mark.parametrize(
    "config, error, line",
    [
        (OptimizerConfig(lr=0), ValueError, "optim.lr must be > 0.0, got 0"),
        (OptimizerConfig(weight_decay=-1), ValueError, "optim.weight_decay must be >= 0.0, got -1"),
        (OptimizerConfig(eps=0), ValueError, "optim.eps must be > 0.0, got 0"),
        (OptimizerConfig(momentum=-1), ValueError, "optim.momentum must be >= 0.0, got -1"),
        (OptimizerConfig(name="adam"), ValueError, "optim.name must be one of ['adamw', 'sgd'], got 'adam'"),
        (OptimizerConfig(betas=(0.9,)), ValueError, "optim.betas must have 2 items, got (0.9,)"),
        (
            OptimizerConfig(betas=(0.9, 1.0)),
            ValueError,
            "optim.betas must be two numbers in [0, 1), got (0.9, 1.0)",
        ),
        (
            OptimizerConfig(betas=(-0.1, 0.9)),
            ValueError,
            "optim.betas must be two numbers in [0, 1), got (-0.1, 0.9)",
        ),
        (OptimizerConfig(decay_all=1), TypeError, "optim.decay_all must be a bool, got 1"),
        (
            OptimizerConfig(decay_grouping="x"),
            ValueError,
            "optim.decay_grouping must be one of ['fntrain', 'hf'], got 'x'",
        ),
        (
            OptimizerConfig(decay_all=True, decay_grouping="hf"),
            ValueError,
            "optim.decay_all decays every parameter, so optim.decay_grouping must stay 'fntrain', got 'hf'",
        ),
        (OptimizerConfig(fused=1), TypeError, "optim.fused must be a bool or None, got 1"),
        (
            ScheduleConfig(kind="x"),
            ValueError,
            "schedule.kind must be one of ['constant', 'cosine', 'linear'], got 'x'",
        ),
        (ScheduleConfig(warmup_iters=-1), ValueError, "schedule.warmup_iters must be >= 0, got -1"),
        (
            ScheduleConfig(warmup_style="x"),
            ValueError,
            "schedule.warmup_style must be one of ['fntrain', 'hf'], got 'x'",
        ),
        (ScheduleConfig(min_lr_ratio=1.5), ValueError, "schedule.min_lr_ratio must be <= 1.0, got 1.5"),
        (ScheduleConfig(min_lr_ratio=-0.1), ValueError, "schedule.min_lr_ratio must be >= 0.0, got -0.1"),
        (ScheduleConfig(lr_schedule_iters=0), ValueError, "schedule.lr_schedule_iters must be >= 1, got 0"),
    ],
)
def test_each_bad_setting_is_one_line_naming_its_field(config, error, line):
    with pytest.raises(error) as raised:
        config.validate()
    assert str(raised.value) == line


def test_the_edges_of_each_setting_are_accepted():
    OptimizerConfig(
        weight_decay=0.0, momentum=0.0, betas=(0.0, 0.0), decay_grouping="hf", fused=False
    ).validate()
    ScheduleConfig(kind="constant", warmup_iters=0, min_lr_ratio=0.0, lr_schedule_iters=1).validate()
    ScheduleConfig(kind="linear", min_lr_ratio=1.0, warmup_style="hf").validate()


class GatedLayerNorm(torch.nn.LayerNorm):
    """A LayerNorm with a submodule of its own: Trainer leaves every parameter under a LayerNorm undecayed."""

    def __init__(self):
        super().__init__(4)
        self.gate = torch.nn.Linear(4, 4, bias=False)


def test_hf_grouping_leaves_everything_under_a_layer_norm_undecayed():
    model = torch.nn.Module()
    model.ln = GatedLayerNorm()
    model.proj = torch.nn.Linear(4, 4, bias=False)
    Named.last = model
    decayed, other = groups_of(build_optimizer(OptimizerConfig(decay_grouping="hf"), model))
    assert (decayed, other) == (["proj.weight"], ["ln.bias", "ln.gate.weight", "ln.weight"])


def shared_module(first, second):
    model = torch.nn.Module()
    shared = torch.nn.Module()
    shared.weight = torch.nn.Parameter(torch.ones(4))
    setattr(model, first, shared)
    setattr(model, second, shared)
    model.proj = torch.nn.Linear(4, 4, bias=False)
    return model


def shared_parameter(first, second):
    model = torch.nn.Module()
    model.block = torch.nn.Module()
    weight = torch.nn.Parameter(torch.ones(4))
    setattr(model.block, first, weight)
    setattr(model.block, second, weight)
    model.proj = torch.nn.Linear(4, 4, bias=False)
    return model


@pytest.mark.parametrize("make", [shared_module, shared_parameter])
@pytest.mark.parametrize("names", [("x", "x_norm"), ("x_norm", "x")])
def test_hf_grouping_leaves_a_shared_parameter_undecayed_when_any_of_its_names_is_a_norms(make, names):
    """A pipeline stage may hold the parameter under either name: both must decide the same."""
    Named.last = make(*names)
    built = build_optimizer(OptimizerConfig(decay_grouping="hf"), Named.last)
    assert [len(g) for g in groups_of(built)] == [1, 1]
    assert (built.decayed_params, built.undecayed_params) == (16, 4)


@pytest.mark.parametrize(
    "model, grouping, decayed",
    [
        (torch.nn.Linear(4, 4), "hf", 16),  # the bias is named "bias" at the root
        (torch.nn.LayerNorm(4), "hf", 0),
        (torch.nn.Embedding(5, 4), "fntrain", 0),  # the model is an embedding table
        (torch.nn.Linear(4, 4), "fntrain", 16),
    ],
)
def test_a_bare_layer_as_the_model_is_grouped_like_the_same_layer_inside_one(model, grouping, decayed):
    built = build_optimizer(OptimizerConfig(decay_grouping=grouping), model)
    total = sum(p.numel() for p in model.parameters())
    assert (built.decayed_params, built.undecayed_params) == (decayed, total - decayed)


class ProjectedEmbedding(torch.nn.Embedding):
    """An embedding table with a projection matrix of its own."""

    def __init__(self):
        super().__init__(5, 4)
        self.out = torch.nn.Linear(4, 4, bias=False)


def test_fntrain_grouping_leaves_the_embedding_table_undecayed_but_not_a_matrix_inside_it():
    model = torch.nn.Module()
    model.tok = ProjectedEmbedding()
    Named.last = model
    assert groups_of(build_optimizer(OptimizerConfig(), model)) == [["tok.out.weight"], ["tok.weight"]]


class FakeParameter:
    """A trainable parameter on `device` (no such device is needed: the optimizer is a recorder)."""

    def __init__(self, device):
        self.device, self.requires_grad = types.SimpleNamespace(type=device), True  # npu: no torch_npu here

    def numel(self):
        return 4


class OnDevice(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.param = FakeParameter(device)

    def named_parameters(self, *args, **kwargs):
        return iter([("w", self.param)])


@pytest.mark.parametrize("name, cls", [("adamw", "AdamW"), ("sgd", "SGD")])
@pytest.mark.parametrize(
    "device, fused, kernel",
    [
        ("cuda", None, {"fused": True}),
        ("npu", None, {"fused": True}),
        ("cpu", None, {"foreach": True}),
        ("meta", None, {"foreach": True}),
        ("cuda", False, {"foreach": True}),
        ("cpu", True, {"fused": True}),
    ],
)
def test_the_kernel_is_fused_on_cuda_and_npu_and_foreach_elsewhere_unless_set(
    monkeypatch, name, cls, device, fused, kernel
):
    made = []
    monkeypatch.setattr(torch.optim, cls, lambda groups, **kwargs: made.append(kwargs))
    config = OptimizerConfig(name=name, fused=fused, decay_all=True)
    build_optimizer(config, OnDevice(device))
    assert len(made) == 1 and {k: made[0][k] for k in ("fused", "foreach") if k in made[0]} == kernel


def test_a_real_sgd_gets_the_foreach_kernel_on_cpu_and_the_fused_one_when_asked():
    assert build_named_optimizer(OptimizerConfig(name="sgd")).optimizer.defaults["foreach"] is True
    assert build_named_optimizer(OptimizerConfig(name="sgd", fused=True)).optimizer.defaults["fused"] is True


def test_a_one_step_horizon_decays_to_the_floor_after_its_step():
    plan = RunPlan(train_iters=1, steps_per_epoch=1, epochs=1)
    built = build_lr_schedule(ScheduleConfig(kind="cosine", min_lr_ratio=0.1), plan, toy_optimizer())
    assert built.horizon == 1 and lrs(built, 3) == pytest.approx([2.0, 0.2, 0.2])
