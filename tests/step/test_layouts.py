"""`fntrain.step.layouts`: the table of layouts. The parallel settings pick one entry (context-parallel
before pipeline before plain); each entry's checks run the sizes' own rules first (a tensor-parallel
plan, a pipeline split), then its own, with the messages the run prints; only the context-parallel
entry has a device rule (ring attention), which a plan never runs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from fntrain.config import ConfigError
from fntrain.runtime.parallel import ParallelConfig
from fntrain.step.layouts import LAYOUTS, choose_layout
from recipes import tiny_gpt


def config_with_parallel(**parallel):
    return dataclasses.replace(tiny_gpt.Config(), parallel=ParallelConfig(**parallel))


@pytest.mark.parametrize(
    ("parallel", "name"),
    [
        ({}, "plain"),
        ({"tp_size": 2}, "plain"),
        ({"pp_size": 2}, "pipeline"),
        ({"cp_size": 2}, "context-parallel"),
        ({"cp_size": 2, "pp_size": 2}, "context-parallel"),
    ],
)
def test_the_parallel_settings_pick_one_entry(parallel, name):
    assert choose_layout(ParallelConfig(**parallel)).name == name


def test_every_entry_is_named_once_and_plain_takes_what_the_others_leave():
    names = [layout.name for layout in LAYOUTS]
    assert len(names) == len(set(names)) and names[-1] == "plain"
    assert LAYOUTS[-1].applies(SimpleNamespace()) is True


def test_a_spec_without_a_plan_is_refused_by_every_entry_before_its_own_rules():
    no_plan = dataclasses.replace(tiny_gpt.spec, tensor_parallel=None)
    for parallel in ({"tp_size": 2}, {"tp_size": 2, "pp_size": 2}, {"tp_size": 2, "cp_size": 2, "strategy": "ddp"}):
        config = config_with_parallel(**parallel)
        with pytest.raises(ConfigError, match=r"^--parallel.tp-size 2: this recipe has no tensor-parallel plan"):
            choose_layout(config.parallel).check(config, no_plan, 1)


def test_context_parallel_names_a_pipeline_problem_before_the_combination():
    no_split = dataclasses.replace(tiny_gpt.spec, pipeline=None)
    config = config_with_parallel(cp_size=2, pp_size=2, strategy="ddp")
    with pytest.raises(ConfigError, match=r"^--parallel.pp-size 2: this recipe has no pipeline split"):
        choose_layout(config.parallel).check(config, no_split, 1)
    with pytest.raises(ConfigError, match=r"^--parallel.cp-size 2 cannot be combined with --parallel.pp-size 2 yet$"):
        choose_layout(config.parallel).check(config, tiny_gpt.spec, 1)


def test_only_the_ring_style_has_a_device_rule():
    ring = dataclasses.replace(config_with_parallel(cp_size=2, cp_style="ring", strategy="ddp"),
                               runtime=dataclasses.replace(tiny_gpt.Config().runtime, device="cpu"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"^--parallel.cp-style ring needs a CUDA or NPU device"):
        choose_layout(ring.parallel).check_device(ring)
    for config in (config_with_parallel(), config_with_parallel(pp_size=2), config_with_parallel(cp_size=2, strategy="ddp")):
        choose_layout(config.parallel).check_device(config)  # nothing to refuse
