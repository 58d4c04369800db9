"""Behaviours of the metrics window that mutation testing found unpinned (mutation/RESULTS.md): an
objective's grouped metrics ("rewards/chosen") are plain means that survive a fold and a resume, device
tensors are never read on the host, a window of zero-token steps logs loss 0, and each window starts
from scratch."""

from __future__ import annotations

import pytest
import torch

from fntrain.hooks import metrics_window as mw
from fntrain.hooks.metrics_window import Window, add_step, load_window_state, window_means, window_state


def fill(window, steps):
    for metrics in steps:
        add_step(window, metrics)
    return window


STEPS = [
    {"loss": 1.0, "rewards/chosen": 2.0, "rewards/margin": -1.0},
    {"loss": 3.0, "rewards/chosen": 4.0},
    {"loss": 5.0, "rewards/chosen": 9.0, "rewards/margin": 3.0, "skipped": False},
    {"loss": float("nan"), "rewards/chosen": 100.0, "skipped": True},  # a skipped step stays out
]


def test_grouped_metrics_are_plain_means_over_their_steps():
    means = window_means(fill(Window(), STEPS), reduced=False)
    assert means == {"loss": 3.0, "rewards/chosen": 5.0, "rewards/margin": 1.0}
    assert mw.is_group_metric("rewards/chosen") and not mw.is_group_metric("loss")


def test_every_objective_metric_is_a_window_mean_but_the_steps_own_and_running_counts():
    """GRPO's TRL names carry no "/" ("reward", "kl", "entropy"): they are window means like DPO's; the
    learning rate, the skip flag and running counts (GRPO's num_tokens) are the logging step's own."""
    steps = [{"loss": 1.0, "reward": 0.25, "kl": 1.0, "lr": 0.1, "num_tokens": 100},
             {"loss": 1.0, "kl": 3.0, "lr": 0.2, "num_tokens": 100},
             {"loss": 1.0, "reward": 0.75, "kl": 5.0, "lr": 0.3, "num_tokens": 180}]  # fmt: skip
    assert window_means(fill(Window(), steps), reduced=False) == {"loss": 1.0, "reward": 0.5, "kl": 3.0}
    assert [name for name in ("reward", "kl", "entropy", "time/train_s", "moe/aux_loss") if mw.is_group_metric(name)] \
        == ["reward", "kl", "entropy", "time/train_s", "moe/aux_loss"]  # fmt: skip
    assert not any(map(mw.is_group_metric, ("loss", "grad_norm", "loss_tokens", "lr", "skipped", "num_tokens",
                                            "consumed_tokens", "consumed_samples")))  # fmt: skip


def test_grouped_metrics_survive_a_fold(monkeypatch):
    monkeypatch.setattr(mw, "FOLD_AT", 2)
    window = fill(Window(), STEPS)
    assert window.grouped_steps == {"rewards/chosen": 2, "rewards/margin": 1}  # the first two steps, folded
    assert window_means(window, reduced=False) == {"loss": 3.0, "rewards/chosen": 5.0, "rewards/margin": 1.0}


def test_a_resume_mid_window_logs_what_an_uninterrupted_run_logs():
    whole = window_means(fill(Window(), STEPS), reduced=False)
    saved = window_state(fill(Window(), STEPS[:2]))
    assert saved == {
        "loss_sum": 4.0, "loss_weight": 2.0, "grad_norm_sum": 0.0, "grad_norm_steps": 0,
        "grouped": {"rewards/chosen": [6.0, 2], "rewards/margin": [-1.0, 1]},
    }  # fmt: skip
    resumed = Window()
    load_window_state(resumed, saved)
    assert window_means(fill(resumed, STEPS[2:]), reduced=False) == whole
    assert "grouped" not in window_state(fill(Window(), [{"loss": 1.0}]))


def test_reduced_means_are_float64_tensors_and_reduced_is_the_default():
    tensor_steps = [{"loss": torch.tensor(1.0), "rewards/chosen": torch.tensor(0.1)},
                    {"loss": torch.tensor(2.0), "rewards/chosen": torch.tensor(0.2)}]
    means = window_means(fill(Window(), tensor_steps))
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in means.values())
    assert means["loss"].item() == 1.5 and means["rewards/chosen"].item() == pytest.approx(0.15, rel=1e-6)
    host = window_means(fill(Window(), [{"loss": 1.0}]), reduced=True)
    assert host == {"loss": 1.0} and type(host["loss"]) is float  # host numbers stay host numbers


def test_a_window_starts_from_scratch_after_a_tensor_window():
    window = fill(Window(), [{"loss": torch.tensor(2.0)}])
    window_means(window)
    means = window_means(fill(window, [{"loss": 4.0}]))
    assert means == {"loss": 4.0} and type(means["loss"]) is float  # a host number, not a tensor


def test_zero_token_steps_log_loss_zero():
    assert window_means(fill(Window(), [{"loss": 0.0, "loss_tokens": 0}]), reduced=False) == {"loss": 0.0}


def test_unweighted_steps_weigh_one_each():
    assert window_state(fill(Window(), [{"loss": 1.0}, {"loss": 2.0}]))["loss_weight"] == 2.0


@pytest.fixture
def device_path(monkeypatch):
    """CPU tensors taken down the device path (stacked and reduced as tensors), to see its numbers."""
    monkeypatch.setattr(mw, "_on_device", lambda items: all(map(torch.is_tensor, items)))


class DeviceOnly(torch.Tensor):
    """A tensor that refuses to be read as a host number: stands in for an accelerator's (a read syncs)."""

    def __float__(self):
        raise AssertionError("a device tensor was read on the host")


def test_device_tensors_are_never_read_on_the_host(device_path):
    steps = [{"loss": torch.tensor(float(k)).as_subclass(DeviceOnly),
              "grad_norm": torch.tensor(0.5).as_subclass(DeviceOnly)} for k in (1, 2, 3)]
    means = window_means(fill(Window(), steps))
    assert {k: v.as_subclass(torch.Tensor).item() for k, v in means.items()} == {"loss": 2.0, "grad_norm": 0.5}


def test_device_losses_with_host_weights_are_weighted(device_path):
    steps = [{"loss": torch.tensor(1.0), "loss_tokens": 1}, {"loss": torch.tensor(3.0), "loss_tokens": 3}]
    assert float(window_means(fill(Window(), steps))["loss"]) == 2.5


def test_a_single_token_window_on_the_device_is_not_divided_further(device_path):
    steps = [{"loss": torch.tensor(3.0), "loss_tokens": torch.tensor(1)}]
    assert float(window_means(fill(Window(), steps))["loss"]) == 3.0
