"""Trackers as metric sinks: Weights & Biases (offline) and MLflow (SQLite), with the real libraries.

Each test runs the metrics hook for a few steps, ends it with TRAIN_END or ABORT, and reads back what the
tracker stored: wandb's offline run file (`run-<id>.wandb`, LevelDB-log framed protobuf records) and
MLflow's SQLite database through `MlflowClient`.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import time

import pytest
import torch

from fntrain.config import ConfigError
from fntrain.hooks.metrics import MetricsConfig, check_metric_packages, metrics_hook
from fntrain.hooks.metrics_log import metrics_log
from fntrain.hooks.sinks import MlflowSink, WandbSink
from fntrain.loop import Event, StepInfo
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.hooks.drive import drive

CONFIG = {"seed": 7, "optim": {"lr": 0.003, "name": "adamw"}, "run_dir": "runs/x"}


def tracked_info(state: TrainState) -> StepInfo:
    step = state.global_step
    metrics = {"loss": torch.tensor(3.0 - 0.25 * step), "lr": 3e-3, "consumed_tokens": 64 * step}
    return StepInfo(metrics, 64, 2, 0.01)


def with_config(run_dir, config=CONFIG):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config))  # what the job writes before training
    return run_dir


# ----------------------------------------------------------------------------- wandb


def wandb_records(run_dir, wait_s: float = 20.0):
    """Every record of each offline wandb run under `run_dir`, as (kind, message) pairs, once each run's
    file holds its "exit" record (wandb's service process may still be writing the file after finish())."""
    deadline = time.monotonic() + wait_s
    while True:
        found = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        runs = [read_wandb_file(path) for path in found]
        if (
            runs and all(any(kind == "exit" for kind, _ in records) for records in runs)
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert found, "no offline wandb run was written"
    return [record for records in runs for record in records]


def read_wandb_file(path):
    """The records of one `run-<id>.wandb` file (LevelDB log framing: 32 KiB blocks of
    checksum/length/type headers; FULL, or FIRST..MIDDLE..LAST pieces); a record still being written
    at the end is left out."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < 7:
        return []
    assert data[:4] == b":W&B"
    records, pos, block, chunk = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append((record.WhichOneof("record_type"), record))
            chunk = b""
    return records


def wandb_history(records):
    rows = []
    for kind, record in records:
        if kind == "history":
            rows.append(
                {
                    "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def wandb_summary(records):
    summary = {}
    for kind, record in records:
        if kind == "summary":
            for item in record.summary.update:
                summary["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return summary


def test_wandb_offline_gets_metrics_config_tags_summary_and_is_finished_at_train_end(tmp_path):
    pytest.importorskip("wandb")
    run_dir = with_config(tmp_path / "run")
    runtime = Runtime()
    config = MetricsConfig(wandb=True, tags=("baseline", "team=nlp"))
    writer = metrics_log(config, runtime, run_dir, attempt=1)
    hook = metrics_hook(runtime, log_every=2, writer=writer, last_step=5)
    assert not (run_dir / "wandb").exists()  # nothing opens at build time
    drive(hook, 5, info=tracked_info)
    records = wandb_records(run_dir)
    runs = [record.run for kind, record in records if kind == "run"]  # the start, then updates
    assert runs, [kind for kind, _ in records]
    assert runs[0].project == "fntrain" and runs[0].display_name == "run"
    assert set(runs[-1].tags) >= {"baseline", "team=nlp", "attempt=1"}
    config_items = {}
    for kind, record in records:
        updates = (
            record.run.config.update if kind == "run" else record.config.update if kind == "config" else ()
        )
        config_items.update((item.key, json.loads(item.value_json)) for item in updates)
    assert config_items["optim"] == {"lr": 0.003, "name": "adamw"} and config_items["seed"] == 7
    history = wandb_history(records)
    steps = [row["_step"] for row in history if "loss" in row]
    assert steps == [2, 4, 5]
    assert [row["loss"] for row in history if "loss" in row] == [2.625, 2.125, 1.75]  # means since the last log
    assert [row["consumed_tokens"] for row in history if "loss" in row] == [128, 256, 320]
    summary = wandb_summary(records)
    assert summary["loss"] == 1.75 and summary["step"] == 5
    assert any(kind == "exit" for kind, _ in records)  # finished at TRAIN_END
    assert writer.sinks[-1]._run is None


def test_wandb_finished_on_abort_with_outcome_and_job_summary_after_the_end(tmp_path):
    pytest.importorskip("wandb")
    run_dir = with_config(tmp_path / "run")
    runtime = Runtime()
    writer = metrics_log(MetricsConfig(wandb=True), runtime, run_dir)
    hook = metrics_hook(runtime, log_every=1, writer=writer)
    drive(hook, 2, info=tracked_info, end=Event.ABORT)
    records = wandb_records(run_dir)
    assert wandb_summary(records)["outcome"] == "aborted"
    assert any(kind == "exit" for kind, _ in records)
    writer.summary({"wall_s": 1.5})  # the job's summary after the end: wandb's run is finished, dropped
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1
    assert "wall_s" not in wandb_summary(wandb_records(run_dir))


# ----------------------------------------------------------------------------- mlflow


def mlflow_run(run_dir, experiment="fntrain"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_mlflow_sqlite_gets_metrics_params_tags_summary_and_is_finished_at_train_end(tmp_path):
    pytest.importorskip("mlflow")
    run_dir = with_config(tmp_path / "run")
    runtime = Runtime()
    writer = metrics_log(MetricsConfig(mlflow=True, tags=("baseline", "team=nlp")), runtime, run_dir)
    hook = metrics_hook(runtime, log_every=2, writer=writer, last_step=5)
    assert not (run_dir / "mlflow.db").exists()  # nothing opens at build time
    drive(hook, 5, info=tracked_info)
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(2, 2.625), (4, 2.125), (5, 1.75)]  # means since the last log
    tokens = client.get_metric_history(run.info.run_id, "consumed_tokens")
    assert [m.value for m in tokens] == [128, 256, 320]
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["optim.name"] == "adamw"
    assert run.data.params["seed"] == "7"
    assert (
        run.data.tags["team"] == "nlp" and run.data.tags["baseline"] == "" and run.data.tags["attempt"] == "0"
    )
    assert run.data.metrics["summary.loss"] == 1.75 and run.data.metrics["summary.step"] == 5


def test_mlflow_run_failed_on_abort_and_job_summary_logged_after_the_end(tmp_path):
    pytest.importorskip("mlflow")
    run_dir = with_config(tmp_path / "run")
    runtime = Runtime()
    writer = metrics_log(MetricsConfig(mlflow=True, mlflow_experiment="exp"), runtime, run_dir)
    hook = metrics_hook(runtime, log_every=1, writer=writer)
    drive(hook, 2, info=tracked_info, end=Event.ABORT)
    client, run = mlflow_run(run_dir, "exp")
    assert run.info.status == "FAILED" and run.data.tags["summary.outcome"] == "aborted"
    writer.summary({"wall_s": 2.5, "exported": "model.safetensors"})
    client, run = mlflow_run(run_dir, "exp")
    assert (
        run.data.metrics["summary.wall_s"] == 2.5 and run.data.tags["summary.exported"] == "model.safetensors"
    )
    assert run.info.status == "FAILED"  # logged to the same, ended run


def test_mlflow_explicit_tracking_uri(tmp_path):
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    sink = MlflowSink(tracking_uri=uri, experiment="e", run_name="r", artifact_dir=None)
    sink.write(1, {"step": 1, "epoch": 0, "attempt": 0, "loss": 1.0})
    sink.close()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    assert client.get_metric_history(sink.run_id, "loss")[0].value == 1.0


# ----------------------------------------------------------------------------- config and rank


@pytest.mark.parametrize(
    ("flag", "package", "extra"),
    [("wandb", "wandb", "fntrain[wandb]"), ("mlflow", "mlflow", "fntrain[mlflow]")],
)
def test_missing_tracker_package_is_an_error_at_build_time_naming_flag_and_extra(
    tmp_path, monkeypatch, flag, package, extra
):
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(
        ImportError, match=rf"metrics\.{flag}=True needs the {package} package.*{re.escape(extra)}"
    ):
        metrics_log(MetricsConfig(**{flag: True}), Runtime(), tmp_path)


def test_tracker_fields_are_validated_naming_the_field():
    with pytest.raises(ValueError, match="metrics.wandb_mode"):
        MetricsConfig(wandb_mode="sometimes").validate()
    with pytest.raises(TypeError, match="metrics.mlflow"):
        MetricsConfig(mlflow="yes").validate()
    with pytest.raises(TypeError, match=r"metrics.tags\[1\]"):
        MetricsConfig(tags=("a", 3)).validate()
    with pytest.raises(ValueError, match="metrics.mlflow_experiment"):
        MetricsConfig(mlflow_experiment="").validate()


def test_trackers_only_on_rank_zero(tmp_path):
    writer = metrics_log(MetricsConfig(wandb=True, mlflow=True), Runtime(rank=1, world_size=2), tmp_path)
    assert not writer.enabled and writer.sinks[1:] == []
    writer.write(1, 0, {"loss": 1.0})
    writer.stop()
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "mlflow.db").exists()


def test_sinks_are_built_as_configured(tmp_path):
    writer = metrics_log(MetricsConfig(wandb=True, mlflow=True, run_name="named"), Runtime(), tmp_path)
    wandb_sink, mlflow_sink = writer.sinks[1:]
    assert isinstance(wandb_sink, WandbSink) and wandb_sink.mode == "offline" and wandb_sink.name == "named"
    assert isinstance(mlflow_sink, MlflowSink)
    assert mlflow_sink.tracking_uri == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"


@pytest.mark.parametrize("flag", ["tensorboard", "wandb", "mlflow"])
def test_missing_package_is_a_config_error_before_anything_is_built(tmp_path, monkeypatch, flag):
    monkeypatch.setitem(sys.modules, flag, None)
    with pytest.raises(ConfigError, match=rf"metrics\.{flag}=True needs the {flag} package"):
        check_metric_packages(MetricsConfig(**{flag: True}))
    with pytest.raises(ConfigError, match=rf"job\.metrics\.{flag}=True"):
        check_metric_packages(MetricsConfig(**{flag: True}), field_prefix="job.metrics")
    check_metric_packages(MetricsConfig())  # nothing turned on: nothing needed
    assert list(tmp_path.iterdir()) == []


def test_building_the_mlflow_sink_creates_no_directory_until_its_first_record(tmp_path):
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "new-run"
    writer = metrics_log(MetricsConfig(mlflow=True), Runtime(), run_dir)
    assert len(writer.sinks) == 2 and not run_dir.exists()  # the SQLite directory is made at first use
    writer.write(1, 0, {"loss": 1.0})
    writer.stop()
    assert (run_dir / "mlflow.db").is_file()


def test_tensorboard_writes_one_event_file_even_when_reopened_after_close(tmp_path):
    """[issue 27] the job's summary comes after the metrics hook closed the sinks: it (and any record
    after close) goes into the same event file, not a second one holding only that."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fntrain.hooks.sinks import TensorBoardSink

    other = tmp_path / "tb" / "events.out.tfevents.1.other.1.0"  # another run's file in the same directory
    other.parent.mkdir()
    other.write_bytes(b"")
    sink = TensorBoardSink(tmp_path / "tb")
    sink.log_config({"seed": 1}, {})
    sink.write(1, {"step": 1, "epoch": 0, "loss": 2.5})
    sink.summary({"loss": 2.5})
    sink.close()
    sink.summary({"outcome": "completed"})  # reopened after close
    sink.write(2, {"step": 2, "epoch": 0, "loss": 2.0})
    sink.close()
    files = sorted(p for p in (tmp_path / "tb").iterdir() if p != other)
    assert len(files) == 1
    events = EventAccumulator(str(files[0]))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.5), (2, 2.0)]
    texts = [event.tensor_proto.string_val[0].decode() for event in events.Tensors("summary/text_summary")]
    assert len(texts) == 2 and "completed" in texts[1]
