"""Every setting does what it says (issue 49 item 1): one entry per user-facing flag in the flag table
(tests/cli/flag_table.py), the flags derived from the config dataclasses by the walkers that write
docs/config.md (fntrain.cli.config_doc), so a new flag without an entry fails here, naming it.

A flag is keyed by the config dataclass that declares its field: a `JobConfig` flag (every recipe has it)
as `--section.name`, run on tiny_gpt; any other as `recipes:--section.name`, `recipes` the recipes whose
configs hold that same declaring class at that place joined by "+" (`hf_causal_lm+dpo+kd+grpo:--lora.rank`:
one `LoraConfig`; `hf_causal_lm+kd:--data.packing`: one SFT data config), exercised once on the cheapest of
them (RUN_ORDER).

Each `Effect` entry observes its flag at two values, on two tiny runs, or (`read=True`) on the parsed config
and the inputs a run reads (`FlagRuns.read`: no model; a data flag's batches, an objective's loss on a fixed
batch, the watchdog's limit on a fake clock), and asserts, one check each, the effects its help text
promises; an `Inert` entry asserts the numbers are unchanged; a `TestedElsewhere` entry names an existing
test function whose source (or a helper or worker it uses) names the flag. Runs are in the slow tier but
for a few shared flags (DEFAULT_TIER); reads are in the default tier but for the VLM's (its tiny LLaVA
takes seconds to build), GRPO's loss and advantages and the watchdog's limit (the default tier's budget:
each entry costs two parses of its flags).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from fntrain.cli.config_doc import RECIPES, _rows, flag_name
from fntrain.cli.recipes import load_recipe
from fntrain.run.config import JobConfig
from tests.cli.flag_kinds import Effect, Inert, TestedElsewhere, flag_args
from tests.cli.flag_runs import FlagRuns
from tests.cli.flag_table import TABLE

ROOT = Path(__file__).resolve().parents[2]


RUN_ORDER = ("tiny_gpt", "hf_causal_lm", "dpo", "kd", "grpo", "vlm")
"""The recipes from the cheapest to run: a flag several recipes share runs on the first of them."""


def _declaring(cls: type, name: str) -> type:
    """The class of `cls`'s MRO that declares the dataclass field `name`."""
    return next(klass for klass in cls.__mro__ if name in vars(klass).get("__annotations__", {}))


def _owned_flags(cls: type, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(flag, declaring dataclass) of every leaf field of the dataclass `cls`, walked as config_doc's `_rows`
    walks it (test_the_walk_is_config_docs checks they agree)."""
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        hint = hints[item.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _owned_flags(hint, f"{prefix}{item.name}.")
        else:
            yield flag_name(f"{prefix}{item.name}"), _declaring(cls, item.name)


@cache
def user_flags() -> list[str]:
    """Every user-facing flag's key: a shared `JobConfig` flag once as `--section.name` (one code path
    for every recipe: the table exercises it on tiny_gpt); any other once per declaring dataclass, as
    `recipe+recipe:--flag` naming the recipes whose configs hold it (`recipe:--flag` for one recipe)."""
    shared = [row[0] for row in _rows(JobConfig, JobConfig(), "")]
    owners: dict[tuple[str, type], list[str]] = {}
    for name in RECIPES:
        for flag, owner in _owned_flags(load_recipe(name).spec.config):
            if flag not in shared:
                owners.setdefault((flag, owner), []).append(name)
    return shared + [f"{'+'.join(recipes)}:{flag}" for (flag, _), recipes in owners.items()]


def recipe_of(key: str) -> str | None:
    """The recipe an entry runs on: the cheapest of those its key names (None for a `JobConfig` flag)."""
    names = key.rpartition(":")[0]
    return min(names.split("+"), key=RUN_ORDER.index) if names else None


def test_the_walk_is_config_docs():
    for name in RECIPES:
        config = load_recipe(name).spec.config
        assert [flag for flag, _ in _owned_flags(config)] == [row[0] for row in _rows(config, config(), "")]


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
def _test_sources(path: str) -> dict[str, str]:
    """Function name -> its source, of every function in the file `path`."""
    text = (ROOT / path).read_text()
    lines = text.splitlines()
    return {node.name: "\n".join(lines[node.lineno - 1 : node.end_lineno]) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}  # fmt: skip


def _names_the_flag(path: str, name: str, flag: str) -> bool:
    """Whether test `name` of `path`, a function of that file it calls or takes as a fixture, or a worker
    module they launch by name (`tests.x.y_worker`), names the flag (as a flag, a field or a keyword):
    the flag's last word, with - or _."""
    sources = _test_sources(path)
    used = [sources[name], *(source for helper, source in sources.items()
                             if helper != name and re.search(rf"\b{helper}\b", sources[name]))]  # fmt: skip
    workers = {module for source in used for module in re.findall(r"\btests(?:\.\w+)+", source)}
    used += [(ROOT / f"{module.replace('.', '/')}.py").read_text() for module in sorted(workers)
             if (ROOT / f"{module.replace('.', '/')}.py").is_file()]  # fmt: skip
    last = flag.rpartition(".")[2].lstrip("-")
    return any(last in source or last.replace("-", "_") in source for source in used)


DEFAULT_TIER = frozenset({
    "--seed", "--log-every", "--train.train-iters", "--train.global-batch-size", "--train.micro-batch-size",
    "--optim.lr", "--optim.weight-decay", "--optim.name", "--schedule.warmup-iters", "--schedule.warmup-style",
    "--loader.shuffle", "--throughput.enabled", "--metrics.jsonl",
})  # fmt: skip
"""The entries whose runs the default tier affords (about 15 tiny runs, sharing what they can)."""


def _param(key: str):
    entry = TABLE[key]
    reads = isinstance(entry, Effect) and entry.read
    slow = not isinstance(entry, TestedElsewhere) and (entry.slow or (key not in DEFAULT_TIER and not reads))
    return pytest.param(key, id=key, marks=[pytest.mark.slow] if slow else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> FlagRuns:
    return FlagRuns(tmp_path_factory.mktemp("flags"))


@pytest.mark.parametrize("key", [_param(key) for key in TABLE])
def test_flag_does_what_it_says(key, runs):
    entry = TABLE[key]
    flag = key.rpartition(":")[2]
    recipe = recipe_of(key) or getattr(entry, "recipe", None) or "tiny_gpt"
    if isinstance(entry, TestedElsewhere):
        path, _, name = entry.test.partition("::")
        assert (ROOT / path).is_file() and name in _test_sources(path), f"{key}: {entry.test} does not exist"
        assert _names_the_flag(path, name, flag), f"{key}: {entry.test} does not name {flag}"
        return
    if isinstance(entry, Effect) and entry.read:
        first, second = (runs.read(recipe, (*entry.base, *flag_args(flag, value))) for value in entry.values)
    else:
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
