"""The profiler hook [S34], [S9]: validation, normalisation, rank selection, backends, the window, abort.

Most tests drive the hook by hand with `TrainState`s and a stand-in profiler module that follows
torch.profiler.profile's schedule semantics (the real `torch.profiler.schedule` decides the actions) and
records every call; the NPU tests put a stand-in `torch_npu` into `sys.modules`. Two tests run the real
torch.profiler on CPU through `fntrain.train`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import sys
import types
import warnings

import pytest
import torch

from fntrain import Event, RunPlan, StepInfo, TrainState, train
from fntrain.hooks.profiler import ProfilerConfig, check_profiler_config, profiled_ranks, profiler_hook
from fntrain.runtime import Runtime, profiling
from tests.hooks.drive import drive

RECORDING = ("RECORD", "RECORD_AND_SAVE")


# ----------------------------------------------------------------------------- stand-in profiler module


class FakeProfile:
    """Follows torch.profiler.profile's state machine (start/step/stop, schedule, on_trace_ready)."""

    def __init__(self, module: FakeProfilerModule, **kwargs):
        self.module = module
        self.kwargs = kwargs
        self.schedule = kwargs["schedule"]
        self.on_trace_ready = kwargs.get("on_trace_ready")
        self.step_num = 0
        self.action = self.schedule(0).name
        self.calls: list[tuple[str, int]] = []
        self.metadata: list[tuple[str, str]] = []
        self.step_labels: list[int] = []  # ProfilerStep#<n> markers that were recorded
        self.stop_error: Exception | None = None
        module.instances.append(self)

    def _transit(self, previous: str, current: str | None) -> None:
        if previous not in RECORDING and current in RECORDING:
            self.module.log.append(("start_trace", self.step_num))
        if previous in RECORDING and (current is None or current == "NONE" or previous == "RECORD_AND_SAVE"):
            self.module.log.append(("stop_trace", self.step_num))
            if self.on_trace_ready is not None:
                self.on_trace_ready(self)

    def start(self) -> None:
        self.calls.append(("start", self.step_num))
        self._transit("NONE", self.action)
        if self.action in RECORDING:
            self.step_labels.append(self.step_num)

    def step(self) -> None:
        self.calls.append(("step", self.step_num))
        previous = self.action
        self.step_num += 1
        self.action = self.schedule(self.step_num).name
        self._transit(previous, self.action)
        if self.action in RECORDING:
            self.step_labels.append(self.step_num)

    def stop(self) -> None:
        self.calls.append(("stop", self.step_num))
        if self.stop_error is not None:
            raise self.stop_error
        self._transit(self.action, None)

    def add_metadata_json(self, key: str, value: str) -> None:
        if self.module.metadata_error is not None:
            raise self.module.metadata_error
        self.metadata.append((key, value))


class FakeProfilerModule(types.ModuleType):
    """A module-like torch.profiler / torch_npu.profiler stand-in."""

    class ProfilerActivity:
        CPU, CUDA, NPU = "CPU", "CUDA", "NPU"

    def __init__(self, name: str = "fake_profiler"):
        super().__init__(name)
        self.instances: list[FakeProfile] = []
        self.schedules: list[dict] = []
        self.handlers: list[tuple[str, str | None]] = []
        self.exports: list[tuple[str, list[int]]] = []
        self.log: list[tuple[str, int]] = []
        self.metadata_error: Exception | None = None
        self.export_error: Exception | None = None

    def profile(self, **kwargs) -> FakeProfile:
        return FakeProfile(self, **kwargs)

    def schedule(self, **kwargs):
        self.schedules.append(kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.profiler.schedule(**kwargs)

    def tensorboard_trace_handler(self, dir_name: str, worker_name: str | None = None):
        self.handlers.append((dir_name, worker_name))

        def write(prof: FakeProfile) -> None:
            if self.export_error is not None:
                raise self.export_error
            self.exports.append((dir_name, list(prof.step_labels)))

        return write


class FakeExperimentalConfig:
    def __init__(
        self, profiler_level=None, aic_metrics=None, l2_cache=False, mstx=False, data_simplification=True,
        export_type=None,
    ):  # fmt: skip
        self.kwargs = dict(
            profiler_level=profiler_level,
            mstx=mstx,
            data_simplification=data_simplification,
            export_type=export_type,
        )


class OldFakeExperimentalConfig:
    """torch_npu before the `mstx` rename."""

    def __init__(self, profiler_level=None, msprof_tx=False, data_simplification=True, export_type=None):
        self.kwargs = dict(
            profiler_level=profiler_level, msprof_tx=msprof_tx, data_simplification=data_simplification,
            export_type=export_type,
        )  # fmt: skip


class FakeMstx:
    def __init__(self):
        self.log: list[tuple] = []
        self.streams: list = []  # the stream each range was started on
        self._next = 0

    def range_start(self, message: str, stream=None) -> int:
        self._next += 1
        self.log.append(("start", message, self._next))
        self.streams.append(stream)
        return self._next

    def range_end(self, range_id: int) -> None:
        self.log.append(("end", range_id))


@pytest.fixture
def fake(monkeypatch):
    """The cpu/cuda backend replaced by a stand-in; returns the stand-in module."""
    module = FakeProfilerModule()
    resolved: list[str] = []

    def resolve(device_type: str):
        resolved.append(device_type)
        return profiling.ProfilerBackend(module)

    monkeypatch.setattr(profiling, "resolve_backend", resolve)
    module.resolved = resolved
    return module


@pytest.fixture
def fake_npu(monkeypatch):
    """A stand-in torch_npu (torch_npu.profiler + torch_npu.npu.mstx) in sys.modules."""
    npu_profiler = FakeProfilerModule("torch_npu.profiler")
    npu_profiler._ExperimentalConfig = FakeExperimentalConfig
    npu_profiler.ProfilerLevel = types.SimpleNamespace(Level0="L0", Level1="L1", Level2="L2")
    npu_profiler.ExportType = types.SimpleNamespace(Text="text", Db="db")
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.profiler = npu_profiler
    stream = types.SimpleNamespace(name="npu stream 0")  # what torch_npu.npu.current_stream() returns
    torch_npu.npu = types.SimpleNamespace(mstx=FakeMstx(), current_stream=lambda: stream, stream=stream)
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    monkeypatch.setitem(sys.modules, "torch_npu.profiler", npu_profiler)
    return torch_npu


def cpu(**kwargs) -> Runtime:
    return Runtime(device=torch.device("cpu"), **kwargs)


def npu(**kwargs) -> Runtime:
    return Runtime(device="npu:0", **kwargs)  # a string: no NPU device exists here


def enabled(**kwargs) -> ProfilerConfig:
    return ProfilerConfig(enabled=True, **kwargs)


# ----------------------------------------------------------------------------- config


def test_defaults_are_the_specified_ones():
    config = ProfilerConfig()
    assert dataclasses.asdict(config) == {
        "enabled": False,
        "start_step": 1,
        "stop_step": 10,
        "start_on_init": False,
        "memory": True,
        "rank_ids": None,
        "pipeline_stage_leaders": False,
        "output_path": None,
        "level": 1,
        "with_stack": False,
        "data_simplification": False,
        "mstx": False,
        "record_shapes": False,
    }
    with pytest.raises(AttributeError):
        config.enabled = True  # frozen


def test_disabled_resolves_no_backend_and_imports_no_profiler(monkeypatch):
    def resolve(device_type):
        raise AssertionError("a disabled profiler resolved a backend")

    monkeypatch.setattr(profiling, "resolve_backend", resolve)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.delitem(sys.modules, "torch_npu.profiler", raising=False)
    # Settings that would fail or warn when enabled are not looked at: nothing else happens.
    config = ProfilerConfig(enabled=False, mstx=True, start_step=9, stop_step=2, rank_ids=[99], level=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hook = profiler_hook(config, npu(world_size=2))
    drive(hook, 3)
    hook(Event.ABORT, TrainState(), RuntimeError("x"))
    assert "torch_npu" not in sys.modules and "torch_npu.profiler" not in sys.modules


@pytest.mark.parametrize(
    "field, value",
    [
        ("enabled", 1),
        ("start_on_init", "yes"),
        ("memory", None),
        ("pipeline_stage_leaders", 0),
        ("with_stack", 1),
        ("data_simplification", "no"),
        ("mstx", 0),
        ("record_shapes", 1.0),
        ("start_step", True),
        ("start_step", 1.5),
        ("stop_step", False),
        ("stop_step", "10"),
        ("output_path", 3),
        ("output_path", b"out"),
        ("rank_ids", 0),
        ("rank_ids", "0"),
        ("rank_ids", {0}),
        ("level", "1"),
        ("level", True),
        ("level", 1.0),
    ],
)
def test_type_rules(field, value):
    kwargs = {"enabled": True, field: value}
    with pytest.raises(TypeError, match=rf"profiler\.{field}\b"):
        profiler_hook(ProfilerConfig(**kwargs), cpu())
    with pytest.raises(TypeError, match=rf"train\.prof\.{field}\b"):  # the runtime-free part, for recipes
        ProfilerConfig(**kwargs).validate("train.prof")


@pytest.mark.parametrize("rank_ids", [[8], [-1], [0, 9], [True], ["1"], [1.0]])
def test_rank_ids_outside_the_world_name_the_range(rank_ids):
    with pytest.raises(ValueError, match=r"profiler\.rank_ids must contain integers in \[0, 8\)"):
        profiler_hook(enabled(rank_ids=rank_ids), cpu(world_size=8))


def test_valid_rank_ids_and_output_path_are_accepted(fake):
    hook = profiler_hook(enabled(rank_ids=[0, 7], output_path="~/traces"), cpu(world_size=8))
    drive(hook, 1)
    assert fake.handlers == [(os.path.join(os.path.expanduser("~/traces"), "profile", "rank_0"), "rank_0")]


@pytest.mark.parametrize(
    "kwargs, expected, message",
    [
        (dict(start_step=0, stop_step=4), (1, 4), r"start_step must be >= 1, got 0"),
        (dict(start_step=-3, stop_step=4), (1, 4), r"start_step must be >= 1, got -3"),
        (dict(start_step=2, stop_step=0), (2, 10), r"stop_step must be >= 1, got 0"),
    ],
)
def test_bad_windows_normalise_with_a_warning(kwargs, expected, message):
    with pytest.warns(UserWarning) as record:
        config = check_profiler_config(enabled(**kwargs), cpu())
    assert re.search(message, "\n".join(str(w.message) for w in record))
    assert (config.start_step, config.stop_step) == expected


def test_a_reversed_window_is_a_setting_error():
    """A window that ends before it starts would record nothing: an error, as the memory hook's is."""
    from fntrain.config import ConfigError

    message = r"profiler\.stop_step must be >= profiler\.start_step \(10\), got 5"
    with pytest.raises(ConfigError, match=message):  # found by validate, before any runtime exists
        enabled(start_step=10, stop_step=5).validate()
    with pytest.raises(ConfigError, match=message):
        check_profiler_config(enabled(start_step=10, stop_step=5), cpu())
    ProfilerConfig(start_step=10, stop_step=5).validate()  # disabled: the window is never looked at
    with pytest.warns(UserWarning, match="stop_step must be >= 1"):  # -1 becomes the default 10, before 12
        with pytest.raises(ConfigError, match=r"start_step \(12\), got 10"):
            check_profiler_config(enabled(start_step=12, stop_step=-1), cpu())


def test_start_on_init_needs_start_step_one():
    with pytest.warns(UserWarning, match=r"start_on_init needs profiler\.start_step 1, got 3"):
        config = check_profiler_config(enabled(start_on_init=True, start_step=3, stop_step=5), cpu())
    assert config.start_on_init is False and config.start_step == 3
    # a window normalised to start 1 keeps start_on_init
    with pytest.warns(UserWarning, match="start_step must be >= 1"):
        config = check_profiler_config(enabled(start_on_init=True, start_step=0, stop_step=5), cpu())
    assert config.start_on_init is True and config.start_step == 1


@pytest.mark.parametrize("level, message", [(None, "is None"), (3, "got 3"), (-1, "got -1")])
def test_level_rules(level, message):
    with pytest.warns(UserWarning, match=rf"profiler\.level.*{message}"):
        config = check_profiler_config(enabled(level=level), cpu())
    assert config.level == 0


@pytest.mark.parametrize("level", [0, 1, 2])
def test_valid_levels_pass_without_warning(level):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_profiler_config(enabled(level=level), cpu()).level == level


def test_unknown_device_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="cpu, cuda or npu"):
        profiler_hook(enabled(), Runtime(device=torch.device("meta")))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_mstx_off_npu_is_a_value_error(device):
    with pytest.raises(ValueError, match=r"profiler\.mstx needs an npu device"):
        profiler_hook(enabled(mstx=True), Runtime(device=torch.device(device)))


# ----------------------------------------------------------------------------- rank selection


def test_explicit_rank_plus_stage_leaders():
    config = enabled(rank_ids=[3], pipeline_stage_leaders=True)
    assert profiled_ranks(config, world_size=8, pp_size=2) == {0, 3, 4}


def test_rank_four_profiles_rank_two_does_not(fake):
    config = enabled(rank_ids=[3], pipeline_stage_leaders=True, start_step=1, stop_step=1)
    drive(profiler_hook(config, cpu(rank=2, world_size=8, pp_size=2)), 2)
    assert fake.resolved == [] and fake.instances == []
    drive(profiler_hook(config, cpu(rank=4, world_size=8, pp_size=2)), 2)
    assert fake.resolved == ["cpu"] and len(fake.instances) == 1
    assert fake.handlers[0][0].endswith(os.path.join("output", "profile", "rank_4"))


def test_no_selection_means_every_rank(fake):
    assert profiled_ranks(enabled(rank_ids=[]), world_size=4) == {0, 1, 2, 3}
    assert profiled_ranks(enabled(), world_size=4) == {0, 1, 2, 3}
    drive(profiler_hook(enabled(rank_ids=[], stop_step=1), cpu(rank=3, world_size=4)), 1)
    assert len(fake.instances) == 1


def test_stage_leaders_alone():
    assert profiled_ranks(enabled(pipeline_stage_leaders=True), world_size=8, pp_size=4) == {0, 2, 4, 6}
    assert profiled_ranks(enabled(pipeline_stage_leaders=True), world_size=8, pp_size=0) == {0}  # stages >= 1


def test_world_not_divisible_by_stages_is_an_error():
    with pytest.raises(ValueError, match=r"world size \(6\) must be divisible .* pipeline stages \(4\)"):
        profiler_hook(enabled(pipeline_stage_leaders=True), cpu(world_size=6, pp_size=4))


# ----------------------------------------------------------------------------- the window


def test_window_three_to_four_on_cpu(fake, tmp_path):
    hook = profiler_hook(enabled(start_step=3, stop_step=4, output_path=str(tmp_path)), cpu())
    state = drive(hook, 2, end=None)
    # before the window the profiler is not even created
    assert fake.resolved == ["cpu"] and fake.instances == []
    for _ in (3, 4):
        hook(Event.STEP_BEGIN, state, None)
        state = state.after_step()
        hook(Event.STEP_END, state, StepInfo({}))
    hook(Event.TRAIN_END, state, None)

    assert fake.schedules == [dict(wait=0, warmup=0, active=2, repeat=1, skip_first=3)]
    (prof,) = fake.instances
    assert prof.kwargs["activities"] == ["CPU"]
    assert prof.kwargs["profile_memory"] is True and prof.kwargs["record_shapes"] is False
    assert prof.kwargs["with_stack"] is False and "experimental_config" not in prof.kwargs
    # started once (positioned at step 2), stepped into 3 and 4 and out of 4, stopped once
    assert prof.calls == [("start", 2), ("step", 2), ("step", 3), ("step", 4), ("stop", 5)]
    assert prof.step_labels == [3, 4]
    assert fake.log == [("start_trace", 3), ("stop_trace", 5)]
    assert fake.exports == [(str(tmp_path / "profile" / "rank_0"), [3, 4])]
    assert fake.handlers == [(str(tmp_path / "profile" / "rank_0"), "rank_0")]


def test_steps_after_the_window_do_nothing(fake):
    hook = profiler_hook(enabled(start_step=1, stop_step=2), cpu())
    drive(hook, 6)
    (prof,) = fake.instances
    assert [c for c, _ in prof.calls] == ["start", "step", "step", "step", "stop"]
    assert len(fake.exports) == 1


def test_window_counts_steps_of_this_run_not_restored_global_steps(fake):
    hook = profiler_hook(enabled(start_step=2, stop_step=3), cpu())
    drive(hook, 4, start=TrainState(epoch=3, global_step=500, cursor=7))
    (prof,) = fake.instances
    assert prof.step_labels == [2, 3] and fake.exports[0][1] == [2, 3]


def test_start_on_init(fake):
    runtime = cpu(world_size=4, rank=1, dp_size=2, tp_size=2, pp_size=1, ep_size=1, parallel_mode="fsdp2")
    hook = profiler_hook(enabled(start_on_init=True, start_step=1, stop_step=3), runtime)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    # started at TRAIN_BEGIN, before any step
    assert fake.schedules == [dict(wait=0, warmup=0, active=3, repeat=1, skip_first=1)]
    (prof,) = fake.instances
    # started at TRAIN_BEGIN and stepped into ProfilerStep#1 at once: recording from TRAIN_BEGIN
    assert prof.calls == [("start", 0), ("step", 0)]
    assert fake.log == [("start_trace", 1)] and prof.step_labels == [1]
    state = TrainState()
    for _ in range(3):
        hook(Event.STEP_BEGIN, state, None)
        state = state.after_step()
        hook(Event.STEP_END, state, StepInfo({}))
    hook(Event.TRAIN_END, state, None)
    assert [c for c, _ in prof.calls].count("start") == 1
    # step 1 runs inside ProfilerStep#1 (opened at TRAIN_BEGIN): steps 1..3 are labelled 1..3
    assert prof.calls == [("start", 0), ("step", 0), ("step", 1), ("step", 2), ("step", 3), ("stop", 4)]
    assert prof.step_labels == [1, 2, 3] and fake.exports[0][1] == [1, 2, 3]
    assert len(prof.metadata) == 1  # recorded once
    key, value = prof.metadata[0]
    assert key == "distributed_args"
    assert json.loads(value) == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 1,
        "data_parallel_size": 2,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "world_size": 4,
        "parallel_mode": "fsdp2",
        "rank": 1,
    }


def test_start_on_init_with_no_step_run_writes_the_init_phase_and_stops(fake):
    hook = profiler_hook(enabled(start_on_init=True, stop_step=3), cpu())
    drive(hook, 0)
    (prof,) = fake.instances
    assert prof.calls == [("start", 0), ("step", 0), ("stop", 1)]
    assert fake.exports == [(fake.handlers[0][0], [1])]  # the partial window: the init phase


def test_start_on_init_aborted_during_init_writes_nothing(fake):
    hook = profiler_hook(enabled(start_on_init=True, stop_step=3), cpu())
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.ABORT, TrainState(), RuntimeError("restore failed"))
    (prof,) = fake.instances
    assert prof.calls == [("start", 0), ("step", 0), ("stop", 1)] and fake.exports == []


def test_train_end_mid_window_writes_the_partial_window(fake):
    hook = profiler_hook(enabled(start_step=2, stop_step=6), cpu())
    drive(hook, 3)  # the run ends after step 3
    (prof,) = fake.instances
    assert fake.exports == [(fake.handlers[0][0], [2, 3])]
    assert [c for c, _ in prof.calls].count("stop") == 1
    hook(Event.TRAIN_END, TrainState(), None)  # stopping twice is safe
    hook(Event.ABORT, TrainState(), RuntimeError("late"))
    assert [c for c, _ in prof.calls].count("stop") == 1 and len(fake.exports) == 1


def test_a_window_the_run_never_reaches_creates_nothing(fake):
    drive(profiler_hook(enabled(start_step=5, stop_step=6), cpu()), 4)
    assert fake.instances == [] and fake.exports == []


def test_cuda_adds_the_cuda_activity(fake):
    drive(profiler_hook(enabled(stop_step=1), Runtime(device=torch.device("cuda", 1))), 1)
    assert fake.resolved == ["cuda"]
    assert fake.instances[0].kwargs["activities"] == ["CPU", "CUDA"]


def test_profile_options_are_passed_through(fake):
    config = enabled(stop_step=1, memory=False, record_shapes=True, with_stack=True)
    drive(profiler_hook(config, cpu()), 1)
    kwargs = fake.instances[0].kwargs
    assert (kwargs["profile_memory"], kwargs["record_shapes"], kwargs["with_stack"]) == (False, True, True)


# ----------------------------------------------------------------------------- abort and failures


def test_abort_mid_window_ends_the_session_without_a_trace(fake):
    hook = profiler_hook(enabled(start_step=1, stop_step=5), cpu())
    state = drive(hook, 2, end=None)
    hook(Event.STEP_BEGIN, state, None)  # step 3 fails inside the step
    error = RuntimeError("boom")
    hook(Event.ABORT, state, error)
    (prof,) = fake.instances
    assert prof.calls[-1][0] == "stop" and ("stop_trace", 3) in fake.log
    assert fake.exports == []  # no partial trace on abort
    hook(Event.ABORT, state, error)  # stopping twice is safe
    hook(Event.TRAIN_END, state, None)
    assert [c for c, _ in prof.calls].count("stop") == 1 and fake.exports == []


def test_abort_before_train_begin_is_a_no_op(fake):
    hook = profiler_hook(enabled(start_on_init=True), cpu())
    hook(Event.ABORT, TrainState(), RuntimeError("setup failed"))
    assert fake.resolved == [] and fake.instances == []


def test_abort_never_raises_even_when_stop_fails(fake, caplog):
    hook = profiler_hook(enabled(start_step=1, stop_step=5), cpu())
    drive(hook, 1, end=None)
    fake.instances[0].stop_error = RuntimeError("kineto exploded")
    with caplog.at_level(logging.ERROR, logger="fntrain.hooks.profiler"):
        hook(Event.ABORT, TrainState(global_step=1, cursor=1), KeyboardInterrupt())
    assert "kineto exploded" in caplog.text
    hook(Event.ABORT, TrainState(), KeyboardInterrupt())  # the session is gone: a no-op now


def test_failing_metadata_is_a_warning(fake, caplog):
    fake.metadata_error = RuntimeError("no session")
    hook = profiler_hook(enabled(stop_step=2), cpu())
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.profiler"):
        drive(hook, 2)
    assert "distributed_args" in caplog.text and "no session" in caplog.text
    assert len(fake.exports) == 1  # profiling went on


def test_a_failed_trace_write_is_logged_and_the_run_goes_on(fake, caplog):
    fake.export_error = OSError("disk full")
    hook = profiler_hook(enabled(stop_step=1), cpu())
    with caplog.at_level(logging.ERROR, logger="fntrain.hooks.profiler"):
        drive(hook, 3)
    assert "disk full" in caplog.text
    assert [c for c, _ in fake.instances[0].calls][-1] == "stop"


def test_train_begin_failure_leaves_abort_a_no_op(monkeypatch):
    def resolve(device_type):
        raise ImportError("no profiler here")

    monkeypatch.setattr(profiling, "resolve_backend", resolve)
    hook = profiler_hook(enabled(), cpu())
    with pytest.raises(ImportError):
        hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.ABORT, TrainState(), ImportError("no profiler here"))


# ----------------------------------------------------------------------------- NPU


def test_npu_backend_experimental_config_metadata_and_mstx(fake_npu, tmp_path):
    config = enabled(
        start_step=2, stop_step=3, mstx=True, level=2, data_simplification=True, output_path=str(tmp_path)
    )
    runtime = npu(world_size=8, rank=0, tp_size=2, pp_size=2, dp_size=2, ep_size=1, parallel_mode="fsdp2")
    hook = profiler_hook(config, runtime)
    assert "torch_npu" in sys.modules  # (the stand-in) and nothing was used yet
    drive(hook, 4, start=TrainState(global_step=10, cursor=10))

    npu_profiler = fake_npu.profiler
    (prof,) = npu_profiler.instances
    assert prof.kwargs["activities"] == ["CPU", "NPU"]
    assert prof.kwargs["experimental_config"].kwargs == dict(
        profiler_level="L2", mstx=True, data_simplification=True, export_type="text"
    )
    assert npu_profiler.schedules == [dict(wait=0, warmup=0, active=2, repeat=1, skip_first=2)]
    assert prof.step_labels == [2, 3]
    assert npu_profiler.exports == [(str(tmp_path / "profile" / "rank_0"), [2, 3])]
    (metadata,) = prof.metadata
    assert metadata[0] == "distributed_args"
    args = json.loads(metadata[1])
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (2, 2)
    assert (args["data_parallel_size"], args["expert_model_parallel_size"]) == (2, 1)
    assert (args["world_size"], args["parallel_mode"]) == (8, "fsdp2")
    # steps 2 and 3 of this run produce global steps 12 and 13; each range is opened and closed
    assert fake_npu.npu.mstx.log == [("start", "step 12", 1), ("end", 1), ("start", "step 13", 2), ("end", 2)]
    # on the current NPU stream, so the ranges show on the device timeline too
    assert fake_npu.npu.mstx.streams == [fake_npu.npu.stream, fake_npu.npu.stream]


def test_npu_mstx_ranges_use_the_current_stream_of_each_step(fake_npu):
    streams = iter(["stream A", "stream B"])
    fake_npu.npu.current_stream = lambda: next(streams)
    drive(profiler_hook(enabled(start_step=1, stop_step=2, mstx=True), npu()), 2)
    assert fake_npu.npu.mstx.streams == ["stream A", "stream B"]


def test_npu_without_current_stream_marks_host_ranges_with_a_warning(fake_npu, caplog):
    del fake_npu.npu.current_stream
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.profiler"):
        drive(profiler_hook(enabled(start_step=1, stop_step=1, mstx=True), npu()), 1)
    assert fake_npu.npu.mstx.streams == [None]
    assert "mstx ranges are marked on the host only" in caplog.text


def test_npu_abort_closes_the_open_mstx_range(fake_npu):
    hook = profiler_hook(enabled(start_step=1, stop_step=4, mstx=True), npu())
    state = drive(hook, 1, end=None)
    hook(Event.STEP_BEGIN, state, None)
    hook(Event.ABORT, state, RuntimeError("npu step failed"))
    assert fake_npu.npu.mstx.log == [("start", "step 1", 1), ("end", 1), ("start", "step 2", 2), ("end", 2)]
    assert fake_npu.profiler.exports == []


def test_npu_without_mstx_opens_no_ranges_and_maps_levels(fake_npu):
    drive(profiler_hook(enabled(stop_step=1, level=0), npu()), 1)
    (prof,) = fake_npu.profiler.instances
    assert prof.kwargs["experimental_config"].kwargs["profiler_level"] == "L0"
    assert prof.kwargs["experimental_config"].kwargs["mstx"] is False
    assert fake_npu.npu.mstx.log == []


def test_older_torch_npu_gets_msprof_tx(fake_npu):
    fake_npu.profiler._ExperimentalConfig = OldFakeExperimentalConfig
    drive(profiler_hook(enabled(stop_step=1, mstx=True), npu()), 1)
    assert fake_npu.profiler.instances[0].kwargs["experimental_config"].kwargs["msprof_tx"] is True


# ----------------------------------------------------------------------------- real torch.profiler on CPU


def _tiny_run(hooks, steps: int, fail_at: int | None = None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(steps)]

    def step_fn(state: TrainState, batch):
        if fail_at is not None and state.global_step + 1 == fail_at:
            raise RuntimeError("step failed")
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return {"loss": loss.detach()}

    plan = RunPlan(train_iters=steps, steps_per_epoch=steps, epochs=1)
    train(TrainState(), step_fn, hooks, data=lambda epoch, cursor: iter(batches[cursor:]), plan=plan)


def _trace_files(root) -> list[str]:
    return sorted(glob.glob(os.path.join(str(root), "profile", "rank_0", "*.pt.trace.json")))


def test_real_cpu_run_writes_a_trace_of_the_window(tmp_path):
    hook = profiler_hook(enabled(start_step=2, stop_step=3, output_path=str(tmp_path)), cpu())
    _tiny_run([hook], steps=4)
    (trace_file,) = _trace_files(tmp_path)
    assert os.path.basename(trace_file).startswith("rank_0.")
    with open(trace_file) as f:
        trace = json.load(f)  # a Chrome trace: what Perfetto and TensorBoard's profiler plugin read
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("name") == "aten::mse_loss" for e in trace["traceEvents"])
    assert trace["distributed_args"]["world_size"] == 1


def _trace_names(trace_file: str) -> set[str]:
    with open(trace_file) as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def _run_with_init_work(tmp_path, *, start_on_init: bool) -> set[str]:
    """A real CPU run: the profiler, then a hook doing "init_work" at TRAIN_BEGIN; data marks its fetches."""
    output = tmp_path / ("on" if start_on_init else "off")
    profiler = profiler_hook(
        enabled(start_on_init=start_on_init, start_step=1, stop_step=2, output_path=str(output)), cpu()
    )

    def init_hook(event, state, info):
        if event is Event.TRAIN_BEGIN:
            with torch.profiler.record_function("init_work"):
                torch.ones(8).sum()

    batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(3)]

    def data(epoch, cursor):
        for index in range(cursor, len(batches)):
            with torch.profiler.record_function(f"fetch_{index + 1}"):
                batch = tuple(t.clone() for t in batches[index])
            yield batch

    model = torch.nn.Linear(8, 4)

    def step_fn(state, batch):
        return {"loss": torch.nn.functional.mse_loss(model(batch[0]), batch[1]).detach()}

    train(TrainState(), step_fn, [profiler, init_hook], data=data, plan=RunPlan(3, 3, 1))
    (trace_file,) = _trace_files(output)
    return _trace_names(trace_file)


def test_real_cpu_start_on_init_records_the_init_phase(tmp_path):
    names = _run_with_init_work(tmp_path, start_on_init=True)
    # the work of a later TRAIN_BEGIN hook and the first batch fetch are in the trace
    assert {"init_work", "fetch_1", "fetch_2"} <= names
    assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#1", "ProfilerStep#2"}
    assert "fetch_3" not in names  # fetched after the window (steps 1..2)


def test_real_cpu_without_start_on_init_the_init_phase_is_absent(tmp_path):
    names = _run_with_init_work(tmp_path, start_on_init=False)
    assert "init_work" not in names and "fetch_1" not in names
    assert "fetch_2" in names  # fetched inside the window, between steps 1 and 2
    assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#1", "ProfilerStep#2"}


def test_real_cpu_run_aborted_mid_window_writes_nothing(tmp_path):
    hook = profiler_hook(enabled(start_step=2, stop_step=4, output_path=str(tmp_path)), cpu())
    with pytest.raises(RuntimeError, match="step failed"):
        _tiny_run([hook], steps=5, fail_at=3)
    assert _trace_files(tmp_path) == []
    # the profiler session really ended: a new one can start in this process
    hook2 = profiler_hook(enabled(start_step=1, stop_step=1, output_path=str(tmp_path / "again")), cpu())
    _tiny_run([hook2], steps=1)
    assert len(_trace_files(tmp_path / "again")) == 1


def test_tiny_gpt_recipe_profiles_a_window_into_its_run_dir(tmp_path):
    from fntrain.cli import dispatch

    run_dir = tmp_path / "run"
    final = dispatch(
        [
            "run", "tiny_gpt", "--run-dir", str(run_dir), "--train.train-iters", "3", "--train.global-batch-size", "4",
            "--train.micro-batch-size", "4", "--model.n-layer", "1", "--model.d-model", "32",
            "--model.context", "32", "--profiler.enabled", "--profiler.start-step", "2",
            "--profiler.stop-step", "3",
        ]
    ).state  # fmt: skip
    assert final.global_step == 3
    (trace_file,) = _trace_files(run_dir)  # output_path None: the run directory
    with open(trace_file) as f:
        trace = json.load(f)
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("name") == "aten::scaled_dot_product_attention" for e in trace["traceEvents"])


def test_tiny_gpt_recipe_rejects_a_bad_profiler_setting_before_building(tmp_path):
    import dataclasses as dc

    from fntrain.config import ConfigError
    from fntrain.run.job import run_job
    from recipes import tiny_gpt

    config = tiny_gpt.Config(run_dir=str(tmp_path / "run"))
    bad = dc.replace(config, profiler=ProfilerConfig(enabled=True, rank_ids=[1]))  # world size 1
    with pytest.raises(ConfigError, match=r"profiler\.rank_ids must contain integers in \[0, 1\)"):
        run_job(bad, tiny_gpt.spec)
    assert not (tmp_path / "run").exists()  # nothing was built or written
    with pytest.raises(TypeError, match=r"profiler\.start_step"):
        dc.replace(config, profiler=ProfilerConfig(start_step="2")).validate()
