"""An objective as one entry (fntrain.step.objective): the layouts it runs on and its own rules are
checked in the run's first phase, each a one-line ConfigError; its rollout phase wraps the step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fntrain.config import ConfigError
from fntrain.step.objective import (
    GenerationShape,
    ObjectiveSpec,
    check_objective,
    check_parallel,
    with_rollout,
)


def parallel_sizes(**sizes):
    parallel = {"tp_size": 1, "pp_size": 1, "cp_size": 1, "ep_size": 1, **sizes}
    return SimpleNamespace(parallel=SimpleNamespace(**parallel))


def _build(config, built):
    raise AssertionError("not built in these tests")


@pytest.mark.parametrize("size, flag", [("pp_size", "--parallel.pp-size"), ("cp_size", "--parallel.cp-size"),
                                        ("ep_size", "--parallel.ep-size"), ("tp_size", "--parallel.tp-size")])  # fmt: skip
def test_a_model_parallel_size_the_objective_does_not_name_is_refused(size, flag):
    spec = ObjectiveSpec("grpo", _build)
    with pytest.raises(ConfigError) as raised:
        check_parallel(parallel_sizes(**{size: 2}), spec)
    assert str(raised.value) == f"{flag} 2: grpo runs on one process, ddp and fsdp2 only"


def test_the_sizes_an_objective_names_pass_and_are_listed_when_another_is_refused():
    spec = ObjectiveSpec("dpo", _build, parallel=("tp",))
    check_parallel(parallel_sizes(tp_size=2), spec)
    with pytest.raises(ConfigError, match=r"^--parallel.pp-size 4: dpo runs on one process, ddp, fsdp2 and tp only$"):
        check_parallel(parallel_sizes(tp_size=2, pp_size=4), spec)
    check_parallel(parallel_sizes(pp_size=4), None)  # no objective: nothing to refuse


def test_an_unknown_dimension_is_a_spec_error():
    with pytest.raises(ValueError, match=r"ObjectiveSpec.parallel names \['dp'\]"):
        ObjectiveSpec("x", _build, parallel=("dp",))


def test_the_objective_check_gets_the_data_parallel_size_and_its_errors_become_config_errors():
    seen = []

    def check(config, dp_size):
        seen.append(dp_size)
        raise ValueError("grpo.num_generations (3) must divide 8")

    with pytest.raises(ConfigError, match=r"^grpo.num_generations \(3\) must divide 8$"):
        check_objective(parallel_sizes(), ObjectiveSpec("grpo", _build, check=check), dp_size=4)
    assert seen == [4]
    check_objective(parallel_sizes(), ObjectiveSpec("kd", _build), dp_size=1)  # no check: nothing happens


def test_a_generation_shape_is_positive():
    assert GenerationShape(prompts=4, steps=2) == GenerationShape(4, 2)
    with pytest.raises(ValueError, match="GenerationShape.steps must be a positive int, got 0"):
        GenerationShape(prompts=4, steps=0)


def test_the_rollout_runs_before_the_layout_step_and_sees_it():
    calls = []

    def step_fn(state, micro_batches):
        calls.append(("train", state, micro_batches))
        return {"loss": 1.0}

    def rollout(state, batch, train):
        calls.append(("rollout", state, batch))
        return {**train(state, [{"made": batch}]), "reward": 0.5}

    assert with_rollout(None, step_fn) is step_fn
    assert with_rollout(rollout, step_fn)("s", ["prompts"]) == {"loss": 1.0, "reward": 0.5}
    assert calls == [("rollout", "s", ["prompts"]), ("train", "s", [{"made": ["prompts"]}])]
