"""`fntrain plan` shows the disk a run's checkpoints take [issue 48]: one checkpoint from the model's size
and its optimizer's state, and at most how many exist at once under keep_last / keep_best; an estimate
that says so, and one a real checkpoint bears out."""

from __future__ import annotations

import dataclasses

import pytest

from fntrain.plan.checkpoint_disk import checkpoint_bytes, checkpoints_at_once
from fntrain.plan.render import format_run_plan
from fntrain.run.config import CheckpointConfig
from fntrain.run.job import plan_job, run_job
from recipes import tiny_gpt


def config_with_checkpoint(tmp_path, **checkpoint) -> tiny_gpt.Config:
    base = tiny_gpt.Config()
    return dataclasses.replace(base, run_dir=str(tmp_path / "run"), checkpoint=CheckpointConfig(**checkpoint))


@pytest.mark.parametrize(
    ("saves", "keep_last", "keep_best", "timed", "most"),
    [
        (40, 3, True, False, 5),  # the newest 3, the best, the one being written
        (40, 3, False, False, 4),
        (2, 3, True, False, 2),  # never more than the run saves
        (40, 0, True, False, 40),  # keep all
        (40, 0, False, True, None),  # time-based saves, all kept: no bound
        (4, 3, True, True, 5),  # time-based saves beside the cadence, keep_last bounds them
    ],
)
def test_at_most_how_many_checkpoints_exist_at_once(saves, keep_last, keep_best, timed, most):
    assert checkpoints_at_once(saves, keep_last, keep_best, timed=timed) == most


def test_one_checkpoint_is_the_fp32_state_dict_and_the_optimizers_states():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))  # 15 + 8 parameters
    model[1].bias.requires_grad_(False)
    adamw = checkpoint_bytes(tiny_gpt.Config(), model)
    assert (adamw["weights"], adamw["optimizer_state"]) == (23 * 4, 21 * 2 * 4)
    assert adamw["headers"] == (4 + 3 * 3) * 1843 + 32 * 1024  # 4 weights, 3 trained x (2 states + step)
    assert adamw["total"] == adamw["weights"] + adamw["optimizer_state"] + adamw["headers"]
    sgd = tiny_gpt.Config(optim=dataclasses.replace(tiny_gpt.Config().optim, name="sgd"))
    assert (checkpoint_bytes(sgd, model)["optimizer_state"], checkpoint_bytes(sgd, model)["headers"]) == (
        0, 4 * 1843 + 32 * 1024)  # fmt: skip
    momentum = tiny_gpt.Config(optim=dataclasses.replace(sgd.optim, momentum=0.9))
    assert checkpoint_bytes(momentum, model)["optimizer_state"] == 21 * 4


def test_the_plan_shows_the_checkpoints_disk_and_says_it_is_an_estimate(tmp_path):
    report = plan_job(config_with_checkpoint(tmp_path, save_every=10), tiny_gpt.spec)
    disk = report["checkpoint"]["disk"]
    assert (disk["at_once"], disk["kept_best"]) == (5, True)  # tiny_gpt evaluates every 50 steps
    assert disk["at_once_bytes"] == 5 * disk["total"]
    text = format_run_plan(report)
    assert "(40 saves), keep last 3 + the best by val_loss ->" in text
    assert f"at most ~{disk['at_once_bytes'] / 2**20:.2f} MiB (5 at once); an estimate" in text
    keep_all = plan_job(config_with_checkpoint(tmp_path, save_every=10, keep_last=0), tiny_gpt.spec)
    assert keep_all["checkpoint"]["disk"]["at_once"] == 40
    quiet = dataclasses.replace(config_with_checkpoint(tmp_path, save_every=10), evaluate=tiny_gpt.EvaluateConfig())
    unevaluated = plan_job(quiet, tiny_gpt.spec)
    assert unevaluated["checkpoint"]["disk"]["at_once"] == 4
    assert "+ the best by val_loss (none: no evaluation)" in format_run_plan(unevaluated)


def test_the_estimate_is_within_a_twentieth_of_a_real_checkpoint(tmp_path):
    run = dataclasses.replace(
        config_with_checkpoint(tmp_path, save_every=1),
        train=dataclasses.replace(tiny_gpt.Config().train, train_iters=1, global_batch_size=2, micro_batch_size=2),
        evaluate=tiny_gpt.EvaluateConfig(), progress=dataclasses.replace(tiny_gpt.Config().progress, enabled=False),
    )  # fmt: skip
    estimate = plan_job(run, tiny_gpt.spec)["checkpoint"]["disk"]["total"]
    run_job(run, tiny_gpt.spec)
    step = tmp_path / "run" / "checkpoints" / "step_1"
    real = sum(path.stat().st_size for path in step.iterdir())
    assert abs(estimate - real) < real / 20, (estimate, real)
