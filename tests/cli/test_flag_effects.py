"""Every setting does what it says (issue 49 item 1): one entry per user-facing flag in the flag table
(tests/cli/flag_table.py), the flags derived from the config dataclasses by the walkers that write
docs/config.md (fntrain.cli.config_doc), so a new flag without an entry fails here, naming it.

Each `Effect` entry runs the recipe at two values of its flag and asserts, one check each, the effects
its help text promises; an `Inert` entry asserts the numbers are unchanged; a `TestedElsewhere` entry
names an existing test function. Shared flags run on tiny_gpt in the default tier; the Hugging Face
recipes' own flags (and the slower shared ones) in the slow tier.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from fntrain.cli.config_doc import RECIPES, _rows
from fntrain.cli.recipes import load_recipe
from fntrain.run.config import JobConfig
from tests.cli.flag_kinds import Effect, Inert, TestedElsewhere, flag_args
from tests.cli.flag_runs import FlagRuns
from tests.cli.flag_table import TABLE

ROOT = Path(__file__).resolve().parents[2]


def user_flags() -> list[str]:
    """Every user-facing flag's key: a shared `JobConfig` flag once as `--section.name` (one code path
    for every recipe: the table exercises it on tiny_gpt), a flag only a recipe has as `recipe:--flag`."""
    shared = [row[0] for row in _rows(JobConfig, JobConfig(), "")]
    own = [f"{name}:{row[0]}" for name in RECIPES for config in [load_recipe(name).spec.config]
           for row in _rows(config, config(), "") if row[0] not in shared]  # fmt: skip
    return shared + own


def test_every_flag_has_an_entry():
    missing = [key for key in user_flags() if key not in TABLE]
    assert not missing, f"flags with no entry in tests/cli/flag_table.py: {missing}"


def test_every_entry_is_a_flag():
    flags = set(user_flags())
    stale = [key for key in TABLE if key not in flags]
    assert not stale, f"entries of tests/cli/flag_table.py for flags that no longer exist: {stale}"


def test_the_table_covers_all_of_the_flags():
    assert len(user_flags()) == len(set(user_flags())) == len(TABLE)


@cache
def _test_names(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


DEFAULT_TIER = frozenset({
    "--seed", "--log-every", "--train.train-iters", "--train.global-batch-size", "--train.micro-batch-size",
    "--optim.lr", "--optim.weight-decay", "--optim.name", "--schedule.warmup-iters", "--schedule.warmup-style",
    "--loader.shuffle", "--throughput.enabled", "--metrics.jsonl",
})  # fmt: skip
"""The entries whose runs the default tier affords (about 15 tiny runs, sharing what they can)."""


def _param(key: str):
    entry = TABLE[key]
    slow = not isinstance(entry, TestedElsewhere) and (entry.slow or key not in DEFAULT_TIER)
    return pytest.param(key, id=key, marks=[pytest.mark.slow] if slow else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> FlagRuns:
    return FlagRuns(tmp_path_factory.mktemp("flags"))


@pytest.mark.parametrize("key", [_param(key) for key in TABLE])
def test_flag_does_what_it_says(key, runs):
    entry = TABLE[key]
    recipe, _, flag = key.rpartition(":")
    recipe = recipe or getattr(entry, "recipe", None) or "tiny_gpt"
    if isinstance(entry, TestedElsewhere):
        path, _, name = entry.test.partition("::")
        assert (ROOT / path).is_file() and name in _test_names(path), f"{key}: {entry.test} does not exist"
        return
    first, second = (runs.observe(recipe, (*entry.base, *flag_args(flag, value)), entry_before(entry))
                     for value in entry.values)  # fmt: skip
    if isinstance(entry, Inert):
        from tests.cli.flag_table import same_numbers

        same_numbers(first, second)
        return
    assert isinstance(entry, Effect)
    failed = []
    for check in entry.checks:
        try:
            check(first, second)
        except AssertionError as error:
            failed.append(f"{check.__name__}: {error}")
    assert not failed, f"{key} at {entry.values[0]!r} and {entry.values[1]!r}:\n" + "\n".join(failed)


def entry_before(entry):
    return getattr(entry, "before", None)
