"""Run metadata (`<run_dir>/run_metadata.json`) and per-rank logs (`<run_dir>/logs/rank_<r>.log`):
present, parseable, complete; git state recorded when there is a checkout and never an error without."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

import fntrain
from fntrain import TrainState
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.run.logs import RankFormatter, launch_rank, rank_log_path, rank_logs, setup_console_logging
from fntrain.run.metadata import METADATA_FILE, git_state, record_start, write_run_metadata
from fntrain.runtime.runtime import Runtime
from recipes import tiny_gpt
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]


def read_metadata(run_dir: Path) -> dict:
    return json.loads((run_dir / METADATA_FILE).read_text())


def git(directory: Path, *args: str) -> str:
    command = ["git", "-C", str(directory), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    done = run_to_end(command, f"`git {' '.join(args)}`", 60)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_metadata_fields(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a git checkout
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    path = write_run_metadata(tmp_path / "run", Runtime(seed=7, restart_count=2), argv=["train.py", "--x", "1"])
    metadata = read_metadata(tmp_path / "run")
    assert path == tmp_path / "run" / METADATA_FILE
    assert metadata["command"]["argv"] == ["train.py", "--x", "1"]
    assert metadata["command"]["executable"] == sys.executable and metadata["command"]["cwd"] == str(tmp_path)
    assert metadata["command"]["launcher"]["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert metadata["restart_count"] == 2 and metadata["config_file"] == "config.json"
    assert metadata["versions"]["fntrain"] == fntrain.__version__
    assert metadata["versions"]["torch"] == torch.__version__
    assert metadata["world_size"] == 1 and metadata["device_type"] == "cpu" and metadata["seed"] == 7
    assert metadata["parallel"]["dp_size"] == 1 and metadata["parallel"]["mode"] == "none"
    (rank,) = metadata["ranks"]
    assert rank["rank"] == 0 and rank["device"] == "cpu" and rank["device_name"]
    assert metadata["hostname"] == rank["hostname"] and metadata["hosts"] == [rank["hostname"]]
    assert re.match(r"\d{4}-\d\d-\d\dT", metadata["start_time"]) and metadata["start_timestamp"] > 0
    assert metadata["git"] is None  # the working directory is not in a checkout
    assert metadata["start_state"] is None and len(metadata["launches"]) == 1


def test_start_state_and_launch_history(tmp_path):
    write_run_metadata(tmp_path, Runtime(), argv=["a"])
    record_start(tmp_path, Runtime(), TrainState(1, 40, 3))
    write_run_metadata(tmp_path, Runtime(), argv=["b"])
    record_start(tmp_path, Runtime(), TrainState(2, 80, 0))
    metadata = read_metadata(tmp_path)
    assert metadata["command"]["argv"] == ["b"] and metadata["start_state"]["global_step"] == 80
    assert [launch["start_step"] for launch in metadata["launches"]] == [40, 80]
    assert write_run_metadata(tmp_path / "other", Runtime(rank=1, world_size=1), argv=["c"]) is None
    assert not (tmp_path / "other").exists()  # only rank 0 writes


def test_git_commit_and_dirty_flag(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("one")
    git(repo, "add", "a.txt")
    git(repo, "commit", "-q", "-m", "first")
    commit = git(repo, "rev-parse", "HEAD")
    assert git_state(repo) == {"root": str(repo.resolve()), "commit": commit, "dirty": False}
    (repo / "untracked.txt").write_text("new")
    assert git_state(repo)["dirty"] is False  # untracked files do not count
    (repo / "a.txt").write_text("two")
    assert git_state(repo)["dirty"] is True
    monkeypatch.chdir(repo)
    write_run_metadata(tmp_path / "run", Runtime())
    assert read_metadata(tmp_path / "run")["git"]["commit"] == commit


def test_without_git_nothing_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))  # no git executable
    assert git_state(ROOT) is None
    write_run_metadata(tmp_path, Runtime())
    assert read_metadata(tmp_path)["git"] is None
    empty = tmp_path / "empty_repo"
    empty.mkdir()
    monkeypatch.undo()
    git(empty, "init", "-q")  # a checkout without any commit
    assert git_state(empty) is None


# ----------------------------------------------------------------------------- logs


def test_rank_prefix_on_every_line_including_tracebacks():
    formatter = RankFormatter(3)
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "a\nb", (), sys.exc_info()
        )
    lines = formatter.format(record).split("\n")
    assert len(lines) > 3 and all(line.startswith("[rank 3] ") for line in lines)
    assert any("ValueError: boom" in line for line in lines)


def test_rank_logs_write_the_file_and_restore_the_root_logger(tmp_path):
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    with rank_logs(tmp_path, rank=1) as path:
        assert path == rank_log_path(tmp_path, 1) == tmp_path / "logs" / "rank_1.log"
        logging.getLogger("fntrain.test").info("hello\nsecond line")
        logging.getLogger("fntrain.test").debug("not at INFO")
    assert root.level == level and root.handlers == handlers
    with pytest.raises(RuntimeError, match="failed"):
        with rank_logs(tmp_path, rank=1):
            raise RuntimeError("failed")
    text = path.read_text()
    assert "hello" in text and "second line" in text and "not at INFO" not in text
    assert all(line.startswith("[rank 1] ") for line in text.splitlines())
    assert text.count("=== launch") == 2  # appended, one marker per launch
    assert "run ended by RuntimeError('failed')" in text and "Traceback" in text


def test_console_rank_0_info_other_ranks_warnings(monkeypatch):
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        monkeypatch.setenv("RANK", "2")
        assert launch_rank() == 2
        handler = setup_console_logging()
        assert handler.level == logging.ERROR and isinstance(handler.formatter, RankFormatter)
        assert handler.formatter.prefix == "[rank 2] "
        again = setup_console_logging(rank=0)
        assert again.level == logging.INFO and handler not in root.handlers  # replaced, not added
    finally:
        for handler in list(root.handlers):
            if handler not in saved[1]:
                root.removeHandler(handler)
        root.setLevel(saved[0])
        logging.captureWarnings(False)


# ----------------------------------------------------------------------------- the recipe


def test_recipe_run_writes_metadata_and_rank_log(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 60)
    base = tiny_gpt.Config()
    config = dataclasses.replace(
        base,
        run_dir=str(tmp_path / "run"),
        log_every=2,
        model=dataclasses.replace(base.model, context=16, n_layer=1, n_head=2, d_model=16),
        data=dataclasses.replace(base.data, path=str(corpus)),
        train=dataclasses.replace(base.train, train_iters=4, global_batch_size=4, micro_batch_size=2),
        checkpoint=dataclasses.replace(base.checkpoint, export=False),
        evaluate=EvaluateConfig(eval_every=0, at_end=False),
        progress=ProgressConfig(enabled=False),
    )
    from fntrain.run.job import run_job

    run_job(config, tiny_gpt.spec)
    run_dir = tmp_path / "run"
    metadata = read_metadata(run_dir)
    assert (run_dir / metadata["config_file"]).is_file()  # the resolved config it refers to
    assert metadata["start_state"] == {"epoch": 0, "global_step": 0, "cursor": 0}
    assert metadata["git"] is None or len(metadata["git"]["commit"]) == 40
    text = (run_dir / "logs" / "rank_0.log").read_text()
    assert "=== launch" in text and "step=4" in text  # the launch marker and the metrics lines
    assert all(line.startswith("[rank 0] ") for line in text.splitlines())
