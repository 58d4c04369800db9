"""Behaviours of the run's first phase (`fntrain.run.checks`) that mutation testing found unpinned
(mutation/RESULTS.md): the exact one-line error each refused setting gives (naming the field and the
value), which settings are accepted at the edge, what phase 1 hands phase 2 (the launch environment,
the data-parallel size, the inputs read once, the data fingerprint, the launch decided against a
finished run), and that the path probes leave the run directory as found. In process, on the toy
recipe of tests/run/test_job.py: no model build, no device."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from fntrain.config import ConfigError
from fntrain.data.fingerprint import data_fingerprint
from fntrain.hooks.memory import MemoryConfig
from fntrain.hooks.profiler_config import ProfilerConfig
from fntrain.hooks.sample import SampleConfig
from fntrain.run.checks import (
    check_device_settings,
    check_launcher,
    check_paths,
    check_run,
    check_values,
    check_windows,
    dataset_len,
    full_model_on_meta,
    run_plan,
)
from fntrain.run.config import CheckpointConfig, ExportingJobConfig, TrainConfig
from fntrain.run.job import run_job
from fntrain.runtime import PipelineSplit
from fntrain.runtime.launch import LaunchEnv, read_launch_env
from fntrain.state import make_run_plan
from tests.run.test_job import JobLM, ToyConfig, ToyModelConfig, spec, toy, toy_datasets

LAUNCHED = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
PROBE_FAILS = "(a read-only or virtual filesystem)"


def parallel(config, **changes):
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **changes))


def refusal_of(call, *args) -> str:
    with pytest.raises((ValueError, OSError)) as caught:  # check_run makes each a ConfigError
        call(*args)
    return str(caught.value)


@dataclass(frozen=True)
class FileData:
    """A data section naming one file: what the fingerprint hashes."""

    path: str = ""

    def validate(self, prefix: str = "data") -> None:
        return None


@dataclass(frozen=True)
class FileToyConfig(ToyConfig):
    data: FileData = field(default_factory=FileData)


# ----------------------------------------------------------------------------- what phase 2 gets


def test_phase_one_hands_on_what_it_read_once(tmp_path, monkeypatch):
    for name in (*LAUNCHED, "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    data_file = tmp_path / "data.txt"
    data_file.write_text("the corpus")
    config = FileToyConfig(run_dir=str(tmp_path / "run"), data=FileData(str(data_file)))
    assets, collate_fn, seen = object(), object(), {}

    def build_datasets(config, given):
        seen["datasets"] = (config, given)
        return toy_datasets(config, given)

    def collate(config, given):
        seen["collate"] = (config, given)
        return collate_fn

    recipe = dataclasses.replace(
        spec, build_assets=lambda config: seen.setdefault("assets", (config, assets))[1],
        build_datasets=build_datasets, collate=collate, check=lambda *args: seen.setdefault("check", args),
    )  # fmt: skip
    checked = check_run(config, recipe)

    assert seen == {"assets": (config, assets), "datasets": (config, assets), "collate": (config, assets),
                    "check": (config, assets)}  # fmt: skip
    inputs = checked.inputs
    assert (inputs.assets, inputs.collate_fn, len(inputs.train_set), len(inputs.val_set)) == (
        assets,
        collate_fn,
        32,
        8,
    )
    assert checked.env == read_launch_env() and checked.dp_size == 1 and checked.plan.train_iters == 4
    assert checked.fingerprint == data_fingerprint(config, inputs.train_set)
    assert (
        list(checked.fingerprint["files"]) == ["data.path"]
        and checked.fingerprint["dataset"]["samples"] == 32
    )
    assert checked.launch.kind == "fresh" and checked.launch.restart_count == 0
    assert not (tmp_path / "run").exists()


def test_a_recipe_without_assets_or_collate_gets_none_for_them(tmp_path):
    checked = check_run(toy(tmp_path), spec)
    assert (checked.inputs.assets, checked.inputs.collate_fn) == (None, None)


def test_a_launched_process_is_checked_over_its_world(tmp_path, monkeypatch):
    for name, value in {**LAUNCHED, "TORCHELASTIC_RESTART_COUNT": "3"}.items():
        monkeypatch.setenv(name, value)
    checked = check_run(parallel(toy(tmp_path), strategy="ddp"), spec)
    assert (checked.env.world_size, checked.env.launched, checked.dp_size) == (2, True, 2)
    assert checked.launch.restart_count == 3 and checked.plan.train_iters == 4

    message = refusal_of(check_run, parallel(toy(tmp_path), tp_size=2), spec)
    assert message == "--parallel.tp-size 2: this recipe has no tensor-parallel plan for its model"


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(4))


def test_the_layout_is_checked_over_the_data_parallel_ranks_and_the_device(tmp_path, monkeypatch):
    for name, value in {**LAUNCHED, "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    piped = dataclasses.replace(
        spec, model_factory=lambda config: Blocks(), pipeline=PipelineSplit(layers="blocks")
    )
    assert refusal_of(check_run, parallel(toy(tmp_path), pp_size=4), piped) == (
        "--parallel.pp-schedule 1f1b needs at least --parallel.pp-size (4) micro-batches per step, got 2 "
        "(--train.global-batch-size / (--train.micro-batch-size x 1 data-parallel ranks)): lower "
        "--train.micro-batch-size or use --parallel.pp-schedule gpipe"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = toy(tmp_path)
    ring = parallel(dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device="cpu")),
                    cp_size=2, cp_style="ring", strategy="ddp")  # fmt: skip
    assert refusal_of(check_run, ring, dataclasses.replace(spec, attention_heads=lambda config: 2)) == (
        "--parallel.cp-style ring needs a CUDA or NPU device (torch's ring attention has no cpu kernel): use "
        "--parallel.cp-style ulysses"
    )


def test_a_setting_error_from_the_recipe_is_one_config_error_with_its_words(tmp_path):
    def unreadable(config, assets):
        raise OSError("data.path 'corpus.jsonl' cannot be read")

    with pytest.raises(ConfigError) as caught:
        check_run(toy(tmp_path), dataclasses.replace(spec, build_datasets=unreadable))
    assert str(caught.value) == "data.path 'corpus.jsonl' cannot be read"


def test_samples_are_asked_only_of_a_recipe_that_can_sample(tmp_path):
    config = dataclasses.replace(toy(tmp_path), sample=SampleConfig(every=2, prompts=("once",)))
    check_run(config, dataclasses.replace(spec, sampler=lambda config, built: None))
    message = refusal_of(check_run, config, spec)
    assert message == "sample.every 2: this recipe cannot sample text (its spec has no sampler)"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A toy run of 4 steps that saved its last one."""
    config = toy(tmp_path_factory.mktemp("finished"), checkpoint=CheckpointConfig(save_every=4))
    run_job(config, spec)
    return config


def test_a_finished_run_is_complete_and_other_data_is_refused(finished):
    assert check_run(finished, spec).launch.kind == "complete"
    fewer = dataclasses.replace(
        spec, build_datasets=lambda config, assets: (toy_datasets(config, assets)[0][:31], [])
    )
    step_4 = str(Path(finished.run_dir) / "checkpoints" / "step_4")
    assert refusal_of(check_run, finished, fewer) == (
        f"checkpoint.restore_from {step_4!r} was saved with other data: samples 32 -> 31; resume with the same "
        "data, or add data to checkpoint.allow_changes"
    )


# ----------------------------------------------------------------------------- values and launcher


def test_the_batch_shape_over_the_ranks_is_one_line_naming_the_numbers(tmp_path):
    config = toy(tmp_path)
    assert (
        refusal_of(check_values, parallel(config, tp_size=2), 3)
        == "world size 3 is not divisible by tp x pp x cp = 2"
    )
    assert refusal_of(check_values, parallel(config, ep_size=2, strategy="fsdp2"), 1) == (
        "--parallel.ep-size 2 must divide the data-parallel size (1)"
    )
    assert refusal_of(check_values, config, 2) == (
        "--parallel.strategy none cannot train 2 data-parallel ranks (their gradients would never be combined): "
        "use --parallel.strategy ddp or fsdp2"
    )
    odd = dataclasses.replace(parallel(config, strategy="ddp"),
                              train=TrainConfig(train_iters=4, global_batch_size=6, micro_batch_size=2))  # fmt: skip
    assert refusal_of(check_values, odd, 2) == (
        "train.global_batch_size (6) must be divisible by train.micro_batch_size (2) x data-parallel size (2) = 4"
    )
    assert check_values(parallel(config, strategy="ddp"), 2) == 2


def test_a_strategy_that_needs_a_process_group_needs_torchrun(tmp_path):
    plain, launched = LaunchEnv(), LaunchEnv(rank=0, world_size=2, launched=True)
    config = toy(tmp_path)
    assert refusal_of(check_launcher, parallel(config, strategy="ddp"), plain) == (
        "parallel.strategy 'ddp' (tp x pp x cp = 1) needs a process group: launch with "
        "`torchrun --nproc_per_node N -m fntrain run ...`, or use parallel.strategy none"
    )
    assert "parallel.strategy 'none' (tp x pp x cp = 2) needs a process group" in refusal_of(
        check_launcher, parallel(config, tp_size=2), plain
    )
    check_launcher(config, plain)
    check_launcher(parallel(config, strategy="ddp"), launched)
    check_launcher(parallel(config, tp_size=2), launched)


# ----------------------------------------------------------------------------- device settings


def test_a_device_this_machine_lacks_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = dataclasses.replace(
        toy(tmp_path), runtime=dataclasses.replace(toy(tmp_path).runtime, device="cuda")
    )
    with pytest.raises(ConfigError) as caught:
        check_device_settings(config, LaunchEnv())
    assert str(caught.value) == "runtime.device is 'cuda' but torch.cuda.is_available() is False"


def test_memory_history_is_checked_for_the_device_named(tmp_path, monkeypatch):
    # As on a GPU machine (nothing touches the device: the check only looks up the cuda allocator's API).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = dataclasses.replace(toy(tmp_path), memory=MemoryConfig(enable=True))
    check_device_settings(
        dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device="cuda")), LaunchEnv()
    )


def test_the_hooks_are_checked_for_this_device_and_world(tmp_path):
    config = dataclasses.replace(
        toy(tmp_path), runtime=dataclasses.replace(toy(tmp_path).runtime, device="cpu")
    )
    profiled = dataclasses.replace(config, profiler=ProfilerConfig(enabled=True, rank_ids=[1]))
    # cpu has a profiler backend, and rank 1 is in a world of 2
    check_device_settings(profiled, LaunchEnv(rank=0, world_size=2, launched=True))
    with pytest.raises(ConfigError) as caught:
        check_device_settings(dataclasses.replace(config, memory=MemoryConfig(enable=True)), LaunchEnv())
    assert str(caught.value).startswith("memory.enable needs a device allocator that records history (cuda or npu); "
                                        "device 'cpu' has none.")  # fmt: skip
    leaders = parallel(dataclasses.replace(config, profiler=ProfilerConfig(enabled=True, pipeline_stage_leaders=True)),
                       pp_size=2)  # fmt: skip
    check_device_settings(leaders, LaunchEnv(rank=0, world_size=4, launched=True))
    assert refusal_of(check_device_settings, leaders, LaunchEnv(rank=0, world_size=3, launched=True)) == (
        "profiler.pipeline_stage_leaders: the world size (3) must be divisible by the number of pipeline stages (2)"
    )


# ----------------------------------------------------------------------------- paths


def test_each_path_that_is_a_file_is_named_by_its_field(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert (
        refusal_of(check_paths, toy(tmp_path, run_dir=str(a_file)))
        == f"run_dir {str(a_file)!r} is a file, not a directory"
    )
    checkpoint_dir = toy(tmp_path, checkpoint=CheckpointConfig(dir=str(a_file)))
    assert (
        refusal_of(check_paths, checkpoint_dir) == f"checkpoint.dir {str(a_file)!r} is a file, not a directory"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("x")  # the default checkpoint root, under run_dir: named by run_dir
    assert (
        refusal_of(check_paths, toy(tmp_path))
        == f"run_dir {str(run / 'checkpoints')!r} is a file, not a directory"
    )
    assert refusal_of(check_paths, toy(tmp_path, run_dir=str(a_file / "run"))) == (
        f"run_dir {str(a_file / 'run')!r} cannot be created: {str(a_file)!r} is a file"
    )


def test_output_dir_is_checked_when_the_recipe_has_one(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    exporting = ExportingJobConfig(run_dir=str(tmp_path / "run"), output_dir=str(a_file))
    assert refusal_of(check_paths, exporting) == f"output_dir {str(a_file)!r} is a file, not a directory"
    check_paths(dataclasses.replace(exporting, output_dir=str(tmp_path / "out" / "model")))
    check_paths(dataclasses.replace(exporting, output_dir=None))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # checked, nothing created


def test_a_directory_nothing_can_be_created_in_is_refused(tmp_path, monkeypatch):
    # /proc is a virtual filesystem: os.access may pass (it does for root), mkdir still fails. Access is
    # granted here so the probe alone decides, for any user.
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    assert refusal_of(check_paths, toy(tmp_path, run_dir="/proc")) == "run_dir '/proc' is not writable"
    assert refusal_of(check_paths, toy(tmp_path, run_dir="/proc/fntrain-run")) == (
        f"run_dir '/proc/fntrain-run' cannot be created: nothing can be created in '/proc' {PROBE_FAILS}"
    )
    (tmp_path / "run").mkdir()
    check_paths(toy(tmp_path))  # a real directory passes the probe, which leaves nothing behind
    assert os.listdir(tmp_path / "run") == []


def test_a_directory_without_write_permission_is_refused(tmp_path, monkeypatch):
    # Permission bits do not stop root: the missing write permission is os.access's answer.
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK)
    existing = tmp_path / "run"
    existing.mkdir()
    assert refusal_of(check_paths, toy(tmp_path)) == f"run_dir {str(existing)!r} is not writable"
    new = tmp_path / "new" / "run"
    assert refusal_of(check_paths, toy(tmp_path, run_dir=str(new))) == (
        f"run_dir {str(new)!r} cannot be created: {str(tmp_path)!r} is not writable"
    )
    assert os.listdir(existing) == []


# ----------------------------------------------------------------------------- plan, windows, sizes


def test_the_run_plan_counts_samples_and_the_schedule(tmp_path):
    by_samples = toy(tmp_path, train=TrainConfig(train_iters=None, train_samples=12, global_batch_size=4,
                                                 micro_batch_size=2))  # fmt: skip
    assert run_plan(by_samples, 32, 1).train_iters == 3
    longer_schedule = toy(
        tmp_path, schedule=dataclasses.replace(toy(tmp_path).schedule, lr_schedule_iters=50)
    )
    assert run_plan(longer_schedule, 32, 1).lr_schedule_iters == 50


def test_a_window_after_the_last_step_is_refused_and_one_at_it_accepted(tmp_path):
    config, plan = toy(tmp_path), make_run_plan(global_batch_size=4, micro_batch_size=2, train_iters=4)
    profiled = dataclasses.replace(config, profiler=ProfilerConfig(enabled=True, start_step=5, stop_step=9))
    assert refusal_of(check_windows, profiled, plan) == (
        "profiler.start_step (5) is after the run's last step (4): it would record nothing"
    )
    peaks = dataclasses.replace(config, memory=MemoryConfig(mem_info=True, start_step=5, end_step=6))
    assert (
        refusal_of(check_windows, peaks, plan)
        == "memory.start_step (5) is after the run's last step (4): it would record nothing"
    )
    check_windows(
        dataclasses.replace(config, profiler=ProfilerConfig(enabled=True, start_step=4, stop_step=9)), plan
    )
    check_windows(dataclasses.replace(config, profiler=ProfilerConfig(start_step=5, stop_step=9),
                                      memory=MemoryConfig(start_step=5, end_step=6)), plan)  # fmt: skip


def test_a_streamed_dataset_has_no_length():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert dataset_len(Stream()) is None and dataset_len([1, 2, 3]) == 3


def test_the_whole_model_on_meta_is_the_configs():
    config = ToyConfig(model=ToyModelConfig(vocab=5, width=3))
    model = full_model_on_meta(config, spec)
    assert isinstance(model, JobLM) and tuple(model.embed.weight.shape) == (5, 3)
    assert {p.device.type for p in model.parameters()} == {"meta"}
