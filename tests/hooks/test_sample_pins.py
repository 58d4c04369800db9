"""Pins of fntrain/hooks/sample.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from fntrain.hooks.sample import SampleConfig, sample_hook, whole_logits_on_each_rank
from fntrain.runtime.runtime import Runtime
from tests.hooks.drive import drive
from tests.hooks.test_sample import read_samples, small_model


def parallel_config(pp_size: int = 1, tp_size: int = 1, loss_parallel: bool = False) -> types.SimpleNamespace:
    return types.SimpleNamespace(pp_size=pp_size, tp_size=tp_size, loss_parallel=loss_parallel)


@pytest.mark.parametrize(
    "sizes, whole",
    [
        ({}, True),
        ({"tp_size": 2}, True),  # tensor parallel with the head gathered: every rank has whole logits
        ({"loss_parallel": True}, True),  # loss_parallel without tensor parallelism splits nothing
        ({"pp_size": 2}, False),
        ({"tp_size": 2, "loss_parallel": True}, False),
        ({"pp_size": 2, "tp_size": 2, "loss_parallel": True}, False),
    ],
)
def test_samples_during_training_need_whole_logits_on_every_rank(caplog, sizes, whole):
    """Pipeline parallelism or a loss-parallel head: no samples, and one warning saying so."""
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.sample"):
        assert whole_logits_on_each_rank(parallel_config(**sizes)) is whole
    expected = (
        []
        if whole
        else ["sample: no samples during training with pipeline parallelism or a loss-parallel head"]
    )
    assert [record.getMessage() for record in caplog.records] == expected


def test_samples_go_to_a_run_directory_not_made_yet_as_readable_utf8(tmp_path):
    """The run directory (here two levels that do not exist yet) is made; non-ASCII text is written as it
    is, not as JSON escapes."""
    model = small_model()
    run_dir = tmp_path / "runs" / "first"
    hook = sample_hook(SampleConfig(every=1, prompts=("café ",)), lambda p, s, g: "déjà vu ✓", model,
                       Runtime(), run_dir, last_step=1)  # fmt: skip
    drive(hook, 1)
    assert (run_dir / "samples.jsonl").read_text(encoding="utf-8") == (
        '{"step": 1, "prompt": "café ", "text": "déjà vu ✓"}\n'
    )
    assert read_samples(run_dir) == [{"step": 1, "prompt": "café ", "text": "déjà vu ✓"}]


def test_a_runtime_on_the_meta_device_samples_as_on_the_cpu(tmp_path):
    """The meta device has no random state to fork: a model planned there samples without one."""
    model = small_model()
    runtime = Runtime(device=torch.device("meta"))
    hook = sample_hook(
        SampleConfig(every=1, prompts=("x",)), lambda p, s, g: "y", model, runtime, tmp_path, last_step=1
    )
    drive(hook, 1)
    assert read_samples(tmp_path) == [{"step": 1, "prompt": "x", "text": "y"}]


def test_a_runtime_on_the_meta_device_still_leaves_the_global_rng_as_it_was(tmp_path):
    """torch's fork_rng forks nothing at all for the meta device type: the CPU generator must still be."""

    def careless(prompt, settings, generator):
        return str(torch.rand(1).item())

    model = small_model()
    runtime = Runtime(device=torch.device("meta"))
    hook = sample_hook(SampleConfig(every=1, prompts=("x",)), careless, model, runtime, tmp_path, last_step=1)
    before = torch.get_rng_state()
    drive(hook, 1)
    assert torch.equal(torch.get_rng_state(), before)


def test_sampling_at_the_end_without_the_last_step_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError) as error:
        sample_hook(SampleConfig(prompts=("x",)), lambda p, s, g: "", small_model(), Runtime(), tmp_path)
    assert str(error.value) == "sample.at_end needs the run's last step (last_step=plan.train_iters)"


def test_without_at_end_the_last_step_is_sampled_only_on_the_cadence(tmp_path):
    model = small_model()
    config = SampleConfig(every=3, prompts=("x",), at_end=False)
    drive(sample_hook(config, lambda p, s, g: "y", model, Runtime(), tmp_path, last_step=5), 5)
    assert [record["step"] for record in read_samples(tmp_path)] == [3]


def test_another_rank_never_calls_the_sampler_of_a_model_it_holds_whole(tmp_path):
    """An unsharded model is sampled on rank 0 alone: other ranks spend no forward on it."""
    calls = []
    hook = sample_hook(SampleConfig(every=1, prompts=("x",)), lambda p, s, g: calls.append(p) or "y", small_model(),
                       Runtime(rank=1, world_size=2), tmp_path, last_step=2)  # fmt: skip
    drive(hook, 2)
    assert calls == []


def test_every_rank_samples_a_sharded_model_and_only_rank_0_writes(tmp_path, one_rank_group):
    """Parameters sharded as DTensors: every rank runs the sampler (its forwards' collectives must match)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = torch.nn.Linear(2, 2)
    mesh = init_device_mesh("cpu", (1,))
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
    calls = []
    hook = sample_hook(SampleConfig(every=1, prompts=("x",)), lambda p, s, g: calls.append(p) or "y", model,
                       Runtime(rank=1, world_size=2), tmp_path, last_step=2)  # fmt: skip
    drive(hook, 2)
    assert calls == ["x", "x"] and not (tmp_path / "samples.jsonl").exists()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"prompts": "x"}, "sample.prompts must be a list of strings, got 'x'"),
        ({"seed": -1}, "sample.seed must be >= 0, got -1"),
        ({"seed": 2**32}, "sample.seed must be <= 4294967295, got 4294967296"),
        ({"seed": "1"}, "sample.seed must be an int, got '1'"),
    ],
)
def test_a_bad_prompt_list_or_seed_is_refused_naming_it(changes, message):
    with pytest.raises((TypeError, ValueError)) as error:
        SampleConfig(**changes).validate()
    assert str(error.value) == message


def test_every_seed_a_generator_takes_is_accepted():
    for seed in (0, 2**32 - 1):
        SampleConfig(prompts=("x",), seed=seed).validate()
