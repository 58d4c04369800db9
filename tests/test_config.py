"""Every field of every config is type- and value-checked by its `validate`, and the error names the field.

The fields are discovered with `dataclasses.fields`, and each field's wrong values are derived from its
annotation (a str for a number, an int 1 for a bool, True for an int, NaN for a float, None where None
is not allowed, ...), so a field added later is covered without touching this file.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from fntrain.checkpoint.export_options import ExportOptions
from fntrain.config import require_bool_or_none, require_float, require_float_tuple
from fntrain.data.settings import LoaderConfig
from fntrain.data.sft import SFTDataConfig
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.gc import GCConfig
from fntrain.hooks.memory import MemoryConfig
from fntrain.hooks.metrics import MetricsConfig
from fntrain.hooks.profiler import ProfilerConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.hooks.throughput import ThroughputConfig
from fntrain.models.hf_config import AssetsConfig, HFModelConfig
from fntrain.run.config import CheckpointConfig, TrainConfig
from fntrain.runtime.parallel import ParallelConfig
from fntrain.runtime.setup import RuntimeConfig
from fntrain.runtime.watchdog import WatchdogConfig
from fntrain.step.optim import OptimizerConfig, ScheduleConfig

CONFIGS = [
    OptimizerConfig, ScheduleConfig, RuntimeConfig, ParallelConfig, TrainConfig, LoaderConfig,
    MemoryConfig, ProfilerConfig, CheckpointConfig, EvaluateConfig, GCConfig, MetricsConfig, ProgressConfig,
    ThroughputConfig, WatchdogConfig, SFTDataConfig, HFModelConfig, AssetsConfig, ExportOptions,
]  # fmt: skip


def _recipe_sections() -> list[type]:
    """The config sections of the built-in recipes' configs that the list above does not name."""
    from recipes import dpo, hf_causal_lm, kd, tiny_gpt, vlm

    found: list[type] = []
    for recipe in (tiny_gpt, hf_causal_lm, vlm, dpo, kd):
        hints = typing.get_type_hints(recipe.Config)
        for item in dataclasses.fields(recipe.Config):
            hint = hints[item.name]
            if dataclasses.is_dataclass(hint) and hasattr(hint, "validate") and hint not in CONFIGS + found:
                found.append(hint)
    return found


CONFIGS += _recipe_sections()  # tiny_gpt's model and data, the vlm recipe's, ...
_NAN = float("nan")


def _wrong_values(hint: Any) -> list[Any]:
    """Values that are not what the annotation `hint` claims."""
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    wrong: list[Any] = [] if optional else [None]
    origin = typing.get_origin(hint)
    if hint is bool:
        wrong += [1, 0, "no", "yes"]
    elif hint is int:
        wrong += [True, "1", 1.5]
    elif hint is float:
        wrong += [_NAN, float("inf"), "x", True]
    elif hint is str:
        wrong += [1, b"bytes"]
    elif origin is Literal:
        wrong += ["no-such-choice", 1, True]
    elif origin is tuple and typing.get_args(hint)[-1] is Ellipsis:  # tuple[str, ...]
        wrong += ["x", (1,), (None,)]
    elif origin is tuple:  # a fixed-size tuple of numbers
        wrong += [(0.9, "x"), ("x", 0.9), (0.9, _NAN), (0.9, True), (0.9,), "0.9", 0.9]
    elif origin is list:
        wrong += ["x", 1, ["x"], [True], [1.5]]
    else:
        raise AssertionError(f"no wrong values for {hint!r}: teach this test the new field type")
    return wrong


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> dict[type, Any]:
    """A valid instance of every config (files the configs need exist)."""
    root = tmp_path_factory.mktemp("configs")
    data = root / "train.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    instances = {cls: cls() for cls in CONFIGS}
    instances[SFTDataConfig] = SFTDataConfig(path=str(data))
    from recipes import hf_causal_lm

    instances[hf_causal_lm.DataConfig] = hf_causal_lm.DataConfig(path=str(data))
    instances[HFModelConfig] = HFModelConfig(path=str(model))
    from fntrain.data.preference import PreferenceDataConfig
    from fntrain.step.objectives import KDConfig

    instances[PreferenceDataConfig] = PreferenceDataConfig(path=str(data))
    instances[KDConfig] = KDConfig(teacher_path=str(model))
    return instances


def _prefix(cls: type) -> str:
    return inspect.signature(cls.validate).parameters["prefix"].default


def _cases() -> list[Any]:
    cases = []
    for cls in CONFIGS:
        hints = typing.get_type_hints(cls)
        for item in dataclasses.fields(cls):
            for value in _wrong_values(hints[item.name]):
                cases.append(pytest.param(cls, item.name, value, id=f"{cls.__name__}.{item.name}={value!r}"))
    return cases


def test_the_valid_instances_pass(valid):
    for cls, config in valid.items():
        config.validate(_prefix(cls))


@pytest.mark.parametrize("cls, name, value", _cases())
def test_a_wrongly_typed_field_fails_validation_naming_it(valid, cls, name, value):
    config = dataclasses.replace(valid[cls], **{name: value})
    prefix = _prefix(cls)
    with pytest.raises((TypeError, ValueError)) as caught:
        config.validate(prefix)
    assert f"{prefix}.{name}" in str(caught.value)


# ----------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("betas", [(0.9, "x"), None])
def test_bad_betas_are_a_type_error_naming_optim_betas(betas):
    with pytest.raises(TypeError, match=r"optim\.betas"):
        OptimizerConfig(betas=betas).validate()


def test_decay_all_must_be_a_bool():
    with pytest.raises(TypeError, match=r"optim\.decay_all must be a bool, got 'no'"):
        OptimizerConfig(decay_all="no").validate()


def test_betas_out_of_range_keep_their_message():
    with pytest.raises(ValueError, match=r"optim\.betas must be two numbers in \[0, 1\)"):
        OptimizerConfig(betas=(0.9, 1.0)).validate()
    OptimizerConfig(betas=[0.8, 0.99]).validate()  # a list (from a JSON/TOML file) is fine


def test_helpers():
    assert require_float_tuple("f", [1, 2.5], length=2) == (1.0, 2.5)
    with pytest.raises(ValueError, match=r"f must have 2 items"):
        require_float_tuple("f", (1.0,), length=2)
    with pytest.raises(ValueError, match=r"f\[1\] must be < 1.0"):
        require_float_tuple("f", (0.5, 1.0), max=1.0, max_exclusive=True)
    with pytest.raises(TypeError, match=r"f\[0\] must be a number"):
        require_float_tuple("f", (False,))
    assert require_bool_or_none("b", None) is None and require_bool_or_none("b", True) is True
    with pytest.raises(TypeError, match="b must be a bool or None"):
        require_bool_or_none("b", 0)
    assert math.isclose(require_float("x", 2), 2.0)


@pytest.mark.parametrize(
    "flags, named",
    [(["--optim.betas", "0.9", "x"], "optim.betas"), (["--optim.lr", "nan"], "optim.lr")],
)
def test_the_cli_names_a_bad_flag(tmp_path, capsys, flags, named):
    from fntrain.cli import dispatch

    with pytest.raises(SystemExit) as caught:
        dispatch(["run", "tiny_gpt", "--run-dir", str(tmp_path / "run"), *flags])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert named.replace("_", "-") in captured.err + captured.out
    assert not Path(tmp_path / "run").exists()


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: _job(seed=2**32), r"seed must be <= 4294967295, got 4294967296"),
        (lambda: TrainConfig(train_iters=99999999999999999999999), r"train\.train_iters must be <= 10+, got 9+"),
        (lambda: TrainConfig(train_iters=None, train_samples=10**13), r"train\.train_samples must be <= 10+"),
        (lambda: ParallelConfig(compile=True, compile_backend="bogus"),
         r"parallel\.compile_backend 'bogus' is not a torch.compile backend; use one of .*inductor"),
        (lambda: ProfilerConfig(enabled=True, start_step=10, stop_step=5),
         r"profiler\.stop_step must be >= profiler\.start_step \(10\), got 5"),
    ],
)  # fmt: skip
def test_values_past_what_a_run_can_use_are_errors_naming_the_field(config, message):
    """Values a user typed that used to train (1.9e20 epochs), warn, or fail deep inside numpy or
    torch.compile are caught by `validate`, the run's first check."""
    with pytest.raises(ValueError, match=message):
        config().validate()


def _job(**changes: Any) -> Any:
    from fntrain.run.config import JobConfig

    return JobConfig(**changes)


def test_a_compile_backend_is_checked_only_when_compiling():
    ParallelConfig(compile=False, compile_backend="bogus").validate()
    ParallelConfig(compile=True, compile_backend="aot_eager").validate()  # a debugging backend counts
