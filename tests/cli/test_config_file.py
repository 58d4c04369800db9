"""Config files seed a frozen config: TOML / YAML / JSON, unknown keys and wrong types name the dotted
field, CLI flags override the file, and a written config reads back equal."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Literal

import pytest

from fntrain.cli.config_file import (
    ConfigFileError,
    _toml_module,
    config_from_dict,
    load_config,
    parse_config_cli,
    read_config_file,
    split_config_args,
)
from fntrain.run.resolved import class_defaults, config_to_dict, dump_toml, write_config


@dataclass(frozen=True)
class Inner:
    """Nested section."""

    steps: int | None = 10
    """Steps."""
    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Betas."""
    kind: Literal["cosine", "linear"] = "cosine"
    """Kind."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks."""
    path: str | None = None
    """Path."""
    warmup_iters: int = 0
    """Warmup."""


@dataclass(frozen=True)
class Outer:
    """Top level."""

    name: str = "run"
    """Name."""
    enabled: bool = False
    """Flag."""
    inner: Inner = field(default_factory=Inner)
    other: Inner = field(default_factory=lambda: Inner(steps=5))


def write_config_file(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- formats


def test_toml_seeds_fields_and_keeps_unset_defaults(tmp_path):
    path = write_config_file(
        tmp_path,
        "c.toml",
        'name = "exp"\nenabled = true\n[inner]\nsteps = 3\nlr = 1\nbetas = [0.8, 0.9]\nkind = "linear"\n'
        "ranks = [0, 2]\n",
    )
    config = load_config(Outer, path)
    assert config == Outer(
        name="exp", enabled=True, inner=Inner(steps=3, lr=1.0, betas=(0.8, 0.9), kind="linear", ranks=[0, 2])
    )
    assert isinstance(config.inner.lr, float) and isinstance(config.inner.betas, tuple)
    assert config.other == Inner(steps=5)  # a section the file leaves out keeps its own default


def test_nested_table_merges_into_a_non_trivial_default(tmp_path):
    path = write_config_file(tmp_path, "c.toml", "[other]\nlr = 0.5\n")
    assert load_config(Outer, path).other == Inner(steps=5, lr=0.5)


def test_yaml_and_json_with_null(tmp_path):
    yaml_path = write_config_file(tmp_path, "c.yaml", "name: y\ninner:\n  steps: null\n  path: /data\n")
    json_path = write_config_file(tmp_path, "c.json", json.dumps({"inner": {"steps": None, "kind": "linear"}}))
    assert load_config(Outer, yaml_path).inner == Inner(steps=None, path="/data")
    assert load_config(Outer, json_path).inner == Inner(steps=None, kind="linear")


def test_toml_spells_none_as_a_string_and_accepts_hyphenated_keys(tmp_path):
    path = write_config_file(tmp_path, "c.toml", '[inner]\nsteps = "None"\n')
    assert load_config(Outer, path).inner.steps is None
    assert config_from_dict(Outer, {"inner": {"steps": 4}}).inner.steps == 4
    assert config_from_dict(Inner, {"steps": 7, "lr": 2}) == Inner(steps=7, lr=2.0)
    assert config_from_dict(Outer, {"other": {"steps": 1}}, base=Outer(name="b")).name == "b"
    hyphen = write_config_file(tmp_path, "h.toml", "[inner]\nwarmup-iters = 4\n")
    assert load_config(Outer, hyphen).inner.warmup_iters == 4


def test_later_files_override_earlier_ones(tmp_path):
    first = write_config_file(tmp_path, "a.toml", 'name = "a"\n[inner]\nsteps = 1\nlr = 0.1\n')
    second = write_config_file(tmp_path, "b.json", json.dumps({"inner": {"steps": 2}}))
    config = load_config(Outer, first, second)
    assert (config.name, config.inner.steps, config.inner.lr) == ("a", 2, 0.1)


def test_empty_yaml_is_all_defaults(tmp_path):
    assert load_config(Outer, write_config_file(tmp_path, "e.yml", "")) == Outer()


# ----------------------------------------------------------------------------- errors name the field


@pytest.mark.parametrize(
    ("data", "error", "words"),
    [
        ({"nmae": "x"}, ValueError, ["'nmae'", "did you mean 'name'"]),
        ({"inner": {"stepz": 1}}, ValueError, ["'inner.stepz'", "'inner.steps'"]),
        ({"inner": {"steps": "5"}}, TypeError, ["inner.steps", "'5'"]),
        ({"inner": {"steps": True}}, TypeError, ["inner.steps", "True"]),
        ({"inner": {"steps": 2.5}}, TypeError, ["inner.steps", "2.5"]),
        ({"enabled": 1}, TypeError, ["enabled", "bool"]),
        ({"inner": {"lr": "fast"}}, TypeError, ["inner.lr", "'fast'"]),
        ({"inner": {"betas": [0.9]}}, ValueError, ["inner.betas", "2 items"]),
        ({"inner": {"betas": [0.9, "x"]}}, TypeError, ["inner.betas[1]"]),
        ({"inner": {"kind": "step"}}, ValueError, ["inner.kind", "'step'", "cosine"]),
        ({"inner": {"ranks": [0, "1"]}}, TypeError, ["inner.ranks[1]"]),
        ({"inner": {"ranks": 3}}, TypeError, ["inner.ranks", "list"]),
        ({"inner": 3}, TypeError, ["inner", "table"]),
        ({"name": None}, TypeError, ["name", "string"]),
    ],
)
def test_bad_keys_and_types_name_the_dotted_field(data, error, words):
    with pytest.raises(error) as caught:
        config_from_dict(Outer, data)
    for word in words:
        assert word in str(caught.value)


def test_file_errors_name_the_file_and_the_field(tmp_path):
    path = write_config_file(tmp_path, "bad.toml", "[inner]\nsteps = 'many'\n")
    with pytest.raises(TypeError, match=r"bad\.toml.*inner\.steps must be an int, got 'many'"):
        load_config(Outer, path)
    unknown = write_config_file(tmp_path, "unknown.yaml", "inner:\n  nope: 1\n")
    with pytest.raises(ValueError, match=r"unknown\.yaml.*'inner\.nope'"):
        load_config(Outer, unknown)


def test_unreadable_files(tmp_path, monkeypatch):
    with pytest.raises(ConfigFileError, match="--config '.*missing.toml' does not exist"):
        load_config(Outer, tmp_path / "missing.toml")
    with pytest.raises(ConfigFileError, match="unknown format '.ini'"):
        read_config_file(write_config_file(tmp_path, "c.ini", "x=1"))
    with pytest.raises(ConfigFileError, match=r"c\.toml' line 1: Invalid value \(column 8\)"):
        read_config_file(write_config_file(tmp_path, "c.toml", "name = \n"))
    with pytest.raises(ConfigFileError, match="table of fields"):
        read_config_file(write_config_file(tmp_path, "c.json", "[1, 2]"))
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    with pytest.raises(ConfigFileError, match=r"fntrain\[yaml\]"):
        read_config_file(write_config_file(tmp_path, "c.yaml", "name: x\n"))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.yaml", "train:\n  train_iters: [3\n  seed: 1\n",
         r"--config 'bad.yaml' line 3: while parsing a flow sequence from line 2: expected ',' or ']', but got ':'"),
        ("tab.yaml", "a: b\n\tc: d\n", r"--config 'tab.yaml' line 2: .*found character '\\t'"),
        ("bad.json", '{"train":\n  {"train_iters": 3,}\n}', r"--config 'bad.json' line 2: Expecting property name"),
        ("bad.toml", "[train\ntrain_iters = 3\n", r"--config 'bad.toml' line 1: Expected ']'"),
        ("binary.toml", bytes(range(256)) * 4, r"--config 'binary.toml' is not UTF-8 text"),
        ("a-dir.toml", None, r"--config 'a-dir.toml' is a directory, not a config file"),
    ],
)  # fmt: skip
def test_a_bad_config_file_is_one_line_naming_the_file_as_typed(
    tmp_path, monkeypatch, name, content, message
):
    """A syntax error is one line with its line number (PyYAML's own message spans eight), a binary
    file or a directory says so; the file is named as the user typed it (here: relative)."""
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    monkeypatch.chdir(tmp_path)
    if content is None:
        (tmp_path / name).mkdir()
    else:
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigFileError, match=message) as caught:
        read_config_file(name)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigFileError, match=message):
        load_config(Outer, name)


# ----------------------------------------------------------------------------- writing and round trips


def test_written_config_reads_back_equal_in_json_and_toml(tmp_path):
    config = Outer(name='we"ird\nname', enabled=True, inner=Inner(steps=None, betas=(0.5, 0.25), path=None))
    json_path, toml_path = write_config(config, tmp_path / "run", formats=("json", "toml"))
    assert json_path.name == "config.json" and toml_path.name == "config.toml"
    assert load_config(Outer, json_path) == config
    assert load_config(Outer, toml_path) == config
    assert json.loads(json_path.read_text())["inner"]["betas"] == [0.5, 0.25]


def test_dump_toml_is_valid_toml():
    tomllib = _toml_module()  # tomllib, or tomli before Python 3.11

    data = config_to_dict(Outer())
    assert tomllib.loads(dump_toml(data))["inner"]["betas"] == [0.9, 0.95]
    assert tomllib.loads(dump_toml({"a": {"b": {"c": 1}}, "x": float("inf")}))["a"]["b"]["c"] == 1


def test_toml_comments_out_nones_that_are_defaults_and_reads_back_the_same(tmp_path):
    """[issue 27] `fntrain config` wrote every None as the string "None": a None that is the default is
    now a commented line (an absent key keeps it), and only a None over another default stays "None"."""
    tomllib = _toml_module()
    config = Outer(inner=Inner(steps=None))  # steps' default is 10: the string; path's is None: commented
    text = dump_toml(config_to_dict(config), class_defaults(config))
    assert "# path = None" in text and 'steps = "None"' in text and 'path = "None"' not in text
    assert text.startswith("# TOML has no null")
    assert "path" not in tomllib.loads(text)["inner"]
    assert load_config(Outer, write_config_file(tmp_path, "c.toml", text)) == config
    assert dump_toml({"a": 1}, {"a": 1}) == "a = 1\n"  # nothing None: no note


def test_fntrain_config_toml_reads_back_and_spells_no_default_none(tmp_path, capsys):
    from fntrain.cli import dispatch
    from recipes import hf_causal_lm

    text = dispatch(["config", "recipes.hf_causal_lm"])
    assert '= "None"' not in text and "# output_dir = None" in text
    path = write_config_file(tmp_path, "c.toml", text)
    assert load_config(hf_causal_lm.Config, path) == hf_causal_lm.Config()


def test_tiny_gpt_resolved_config_round_trip(tmp_path):
    from recipes.tiny_gpt import Config

    config = parse_config_cli(Config, ["--seed", "7", "--train.train-iters", "None", "--train.train-samples",
                                              "640", "--optim.betas", "0.8", "0.9"])  # fmt: skip
    write_config(config, tmp_path)
    assert load_config(Config, tmp_path / "config.json") == config
    write_config(config, tmp_path, formats=("toml",))
    assert load_config(Config, tmp_path / "config.toml") == config


# ----------------------------------------------------------------------------- the command line


def test_split_config_args():
    assert split_config_args(["--config", "a.toml", "--x", "1", "--config=b.yaml"]) == (
        ["a.toml", "b.yaml"],
        ["--x", "1"],
    )
    with pytest.raises(ConfigFileError, match="needs a file path"):
        split_config_args(["--config"])


def test_cli_flags_override_the_file(tmp_path):
    path = write_config_file(tmp_path, "c.toml", 'name = "file"\n[inner]\nsteps = 3\nlr = 0.5\n')
    config = parse_config_cli(Outer, ["--config", str(path), "--inner.steps", "9"])
    assert (config.name, config.inner.steps, config.inner.lr) == ("file", 9, 0.5)
    assert parse_config_cli(Outer, []) == Outer()
    assert dataclasses.is_dataclass(config)
