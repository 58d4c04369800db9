"""`fntrain.cli.config_file` for field types the recipes' configs do not use (Any, Annotated, None,
paths, enums, dicts, unions of several arms), keys given twice, values the TOML writer must spell
(nan, inline tables) or refuse, and file errors without a position (TOML, YAML) or unreadable files."""

from __future__ import annotations

import dataclasses
import enum
import math
from pathlib import Path
from typing import Annotated, Any

import pytest

from fntrain.cli.config_file import ConfigFileError, config_from_dict, load_config, read_config_file
from fntrain.run.resolved import config_to_dict, dump_toml, write_config


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Odd:
    anything: Any = None
    width: Annotated[int, "pixels"] = 1
    nothing: None = None
    where: Path = Path("out")
    color: Color = Color.RED
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    either: int | str | None = None
    loss: float = 1.0
    max_len: int = 0


def test_each_field_type_converts_and_round_trips(tmp_path):
    data = {"anything": [1, {"x": 2}], "width": 4, "nothing": "None", "where": "runs/a", "color": "BLUE",
            "weights": {"a": 1, "b": 0.5}, "either": "auto", "loss": math.nan}  # fmt: skip
    config = config_from_dict(Odd, data)
    assert config.anything == [1, {"x": 2}] and config.width == 4 and config.nothing is None
    assert config.where == Path("runs/a") and config.color is Color.BLUE
    assert config.weights == {"a": 1.0, "b": 0.5} and config.either == "auto" and math.isnan(config.loss)
    assert config_from_dict(Odd, {"color": "red"}).color is Color.RED  # by value too
    plain = config_to_dict(config)
    assert (
        plain["where"] == "runs/a" and plain["color"] == "blue" and plain["weights"] == {"a": 1.0, "b": 0.5}
    )
    (path,) = write_config(config, tmp_path, formats=("toml",))
    assert "loss = nan" in path.read_text()
    again = load_config(Odd, path)
    assert dataclasses.replace(again, loss=0.0) == dataclasses.replace(config, loss=0.0) and math.isnan(
        again.loss
    )


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        ({"nothing": 3}, TypeError, r"nothing must be None, got 3 \(int\)"),
        ({"where": 3}, TypeError, r"where must be a path string, got 3 \(int\)"),
        ({"color": "green"}, ValueError, r"color must be one of \['RED', 'BLUE'\], got 'green'"),
        ({"weights": [1]}, TypeError, r"weights must be a table, got \[1\] \(list\)"),
        ({"weights": {"a": "x"}}, TypeError, r"weights.a must be a number, got 'x'"),
        ({"either": 1.5}, TypeError, r"either must be int \| str \| None, got 1.5 \(float\)"),
        ({"width-": 1}, ValueError, r"unknown config key 'width_'; did you mean 'width'\?"),
    ],
)
def test_wrong_values_name_the_field(data, error, message):
    with pytest.raises(error, match=message):
        config_from_dict(Odd, data)


def test_a_key_given_twice_in_two_spellings_is_refused():
    with pytest.raises(ValueError, match=r"config key 'max_len' is given twice"):
        config_from_dict(Odd, {"max_len": 1, "max-len": 2})


def test_not_a_dataclass_and_unknown_formats_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"is not a dataclass"):
        config_from_dict(dict, {})
    with pytest.raises(ValueError, match=r"unknown config format 'ini'; use json or toml"):
        write_config(Odd(), tmp_path, formats=("ini",))
    assert dump_toml({"t": {"inline": {1: "a"}}}) == '[t]\ninline = {1 = "a"}\n'
    with pytest.raises(TypeError, match=r"cannot write \{1, 2\} \(set\) as TOML"):
        dump_toml({"s": {1, 2}})


def test_file_errors_without_a_position_and_unreadable_files(tmp_path, monkeypatch):
    toml = tmp_path / "bad.toml"
    toml.write_text("a = 1\na = 2\n")  # a duplicate key: tomllib reports it with a position
    with pytest.raises(ConfigFileError, match=r"bad.toml' line 2: "):
        read_config_file(toml)
    yaml = pytest.importorskip("yaml")
    broken = tmp_path / "bad.yaml"
    broken.write_text("a: 1\n")

    def no_mark(_text):
        raise yaml.YAMLError("the reader gave up\nsecond line")

    monkeypatch.setattr(yaml, "safe_load", no_mark)
    with pytest.raises(ConfigFileError, match=r"bad.yaml': the reader gave up$"):
        read_config_file(broken)
    fifo_like = tmp_path / "locked.json"
    fifo_like.write_text("{}")
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if self == fifo_like:
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ConfigFileError, match=r"locked.json' cannot be read \(Permission denied\)"):
        read_config_file(fifo_like)
