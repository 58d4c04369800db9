"""Metrics logging [S30]: cadence, rank-0 output, number format, reduction, collisions, writers."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest
import torch

from fntrain.hooks import metrics as metrics_module
from fntrain.hooks.metrics import MetricsConfig, is_logging_step, metrics_hook
from fntrain.hooks.metrics_log import MetricsLog, format_record, metrics_log
from fntrain.loop import Event, StepInfo
from fntrain.runtime.collectives import reduce_scalars
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.helpers.waiting import spawn_to_end
from tests.hooks.drive import drive, torch_op_recorder


def step_state(step: int, epoch: int = 0) -> TrainState:
    return TrainState(epoch=epoch, global_step=step, cursor=step)


def info(loss: float = 2.5, grad_norm: float = 0.75, lr: float = 3e-4) -> StepInfo:
    return StepInfo({"loss": torch.tensor(loss), "grad_norm": torch.tensor(grad_norm), "lr": lr}, 64, 2, 0.01)


def run_metric_steps(hook, steps):
    drive(hook, steps, info=lambda state: info())


def test_format_record_sorts_names_and_uses_four_significant_digits():
    metrics = {"lr": 3e-4, "loss": 2.123456789123, "big": 1234567890123.0, "n": 7, "tokens": 1234567}
    line = format_record(3, 1, {**metrics, "zero": 0.0, "nan": float("nan"), "tflops": 8.76457984e-05})
    assert line == (
        "step=3 epoch=1 big=1.235e+12 loss=2.123 lr=3.000e-04 n=7 nan=nan tflops=8.765e-05 tokens=1234567 zero=0"
    )


def test_is_logging_step_cadence_zero_means_never_and_last_step_logs():
    assert [s for s in range(1, 11) if is_logging_step(s, 3)] == [3, 6, 9]
    assert [s for s in range(1, 11) if is_logging_step(s, 3, last_step=10)] == [3, 6, 9, 10]
    assert not any(is_logging_step(s, 0, last_step=10) for s in range(1, 11))


def test_logs_every_n_steps_and_the_last_step_to_logger_and_jsonl(tmp_path, caplog):
    runtime = Runtime()
    writer = metrics_log(MetricsConfig(), runtime, tmp_path)
    hook = metrics_hook(runtime, log_every=2, writer=writer, last_step=5)
    with caplog.at_level(logging.INFO, logger="fntrain.metrics"):
        run_metric_steps(hook, 5)
    lines = [r.getMessage() for r in caplog.records if r.name == "fntrain.metrics"]
    assert lines == [
        f"step={s} epoch=0 grad_norm=0.75 loss=2.5 loss_last=2.5 lr=3.000e-04" for s in (2, 4, 5)
    ]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 5]
    assert records[0] == {
        "step": 2, "epoch": 0, "attempt": 0, "grad_norm": 0.75, "loss": 2.5, "loss_last": 2.5, "lr": 0.0003
    }  # fmt: skip


def test_log_every_zero_never_logs(tmp_path):
    runtime = Runtime()
    hook = metrics_hook(
        runtime, log_every=0, writer=metrics_log(MetricsConfig(), runtime, tmp_path), last_step=4
    )
    run_metric_steps(hook, 4)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_only_rank_zero_writes_but_every_rank_reduces(tmp_path, caplog, monkeypatch):
    reduced = []

    def recording_reduce(values, op="mean", **kwargs):
        out = reduce_scalars(values, op, **kwargs)
        reduced.append(out)
        return out

    monkeypatch.setattr(metrics_module, "reduce_scalars", recording_reduce)
    runtime = Runtime(rank=1, world_size=2)
    writer = metrics_log(MetricsConfig(), runtime, tmp_path)
    hook = metrics_hook(runtime, log_every=1, writer=writer)
    with caplog.at_level(logging.INFO, logger="fntrain.metrics"):
        run_metric_steps(hook, 2)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert not [r for r in caplog.records if r.name == "fntrain.metrics"]
    assert reduced == [{"loss": 2.5, "grad_norm": 0.75}] * 2 and writer.latest() == {}


def test_values_leave_the_device_only_on_logging_steps(tmp_path, monkeypatch):
    calls = []

    def counting_reduce(values, op="mean", **kwargs):
        calls.append(sorted(values))
        return reduce_scalars(values, op, **kwargs)

    monkeypatch.setattr(metrics_module, "reduce_scalars", counting_reduce)
    runtime = Runtime()
    hook = metrics_hook(runtime, log_every=3, writer=metrics_log(MetricsConfig(), runtime, tmp_path))
    run_metric_steps(hook, 7)
    # steps 3 and 6, tensors only: on one CPU rank the window's means are read on the host already
    assert calls == [["loss_last"]] * 2


def test_non_logging_step_runs_no_torch_op(tmp_path):
    runtime = Runtime()
    hook = metrics_hook(runtime, log_every=10, writer=metrics_log(MetricsConfig(), runtime, tmp_path))
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    step_info = info()
    with torch_op_recorder() as recorder:
        drive(hook, 9, info=step_info, begin=False, end=None)
    assert recorder.calls == []


def test_source_metrics_are_merged_and_kept_as_the_latest_record(tmp_path):
    runtime = Runtime()
    writer = metrics_log(MetricsConfig(), runtime, tmp_path)
    asked = []

    def throughput_figures():
        asked.append(True)
        return {"tokens_per_s": 1234.5}

    hook = metrics_hook(runtime, log_every=2, writer=writer, sources=(throughput_figures,))
    hook(Event.STEP_END, step_state(1, epoch=2), info())
    assert asked == []  # a source is asked on logging steps only
    hook(Event.STEP_END, step_state(2, epoch=2), info())
    latest = writer.latest()
    assert latest["tokens_per_s"] == 1234.5 and latest["step"] == 2 and latest["epoch"] == 2
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["tokens_per_s"] == 1234.5 and record["epoch"] == 2


def test_name_collisions_are_value_errors(tmp_path):
    runtime = Runtime()
    writer = metrics_log(MetricsConfig(), runtime, tmp_path)
    hook = metrics_hook(runtime, log_every=1, writer=writer, sources=(lambda: {"loss": 1.0},))
    with pytest.raises(ValueError, match="'loss'"):
        hook(Event.STEP_END, step_state(1), info())
    sources = (lambda: {"x": 1.0}, lambda: {"x": 2.0})
    twice = metrics_hook(runtime, log_every=1, writer=writer, sources=sources)
    with pytest.raises(ValueError, match="posted twice"):
        twice(Event.STEP_END, step_state(2), info())
    hook = metrics_hook(runtime, log_every=1, writer=writer)
    with pytest.raises(ValueError, match="'step' is reserved"):
        hook(Event.STEP_END, step_state(1), StepInfo({"step": 1.0}))
    with pytest.raises(TypeError, match="'note'"):
        hook(Event.STEP_END, step_state(1), StepInfo({"note": "text"}))
    with pytest.raises(ValueError, match="scalar"):
        hook(Event.STEP_END, step_state(1), StepInfo({"loss": torch.ones(2)}))


def test_files_open_lazily_and_a_write_after_stop_appends(tmp_path):
    writer = metrics_log(MetricsConfig(jsonl_name="m.jsonl"), Runtime(), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # built: nothing created
    writer.write(1, 0, {"loss": 1.0})
    writer.stop()
    writer.stop()
    writer.write(2, 0, {"val_loss": 2.0})
    writer.stop()
    lines = (tmp_path / "run" / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_abort_before_train_begin_is_a_no_op(tmp_path):
    runtime = Runtime()
    hook = metrics_hook(runtime, log_every=1, writer=metrics_log(MetricsConfig(), runtime, tmp_path))
    hook(Event.ABORT, TrainState(), RuntimeError("boom"))
    assert not tmp_path.joinpath("metrics.jsonl").exists()


def test_tensorboard_missing_is_a_clear_import_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match="metrics.tensorboard"):
        metrics_log(MetricsConfig(tensorboard=True), Runtime(), tmp_path)


def test_tensorboard_scalars_written_when_available(tmp_path, monkeypatch):
    written, closed = [], []

    class FakeWriter:
        def __init__(self, log_dir, **options):  # filename_suffix: the sink finds its file by it
            self.log_dir = log_dir

        def add_scalar(self, name, value, step):
            written.append((self.log_dir, name, value, step))

        def flush(self):
            pass

        def close(self):
            closed.append(True)

    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    runtime = Runtime()
    writer = metrics_log(MetricsConfig(tensorboard=True), runtime, tmp_path)
    hook = metrics_hook(runtime, log_every=2, writer=writer)
    run_metric_steps(hook, 2)
    tb_dir = str(tmp_path / "tensorboard")
    assert written == [
        (tb_dir, "grad_norm", 0.75, 2), (tb_dir, "loss", 2.5, 2), (tb_dir, "loss_last", 2.5, 2),
        (tb_dir, "lr", 3e-4, 2),
    ]  # fmt: skip
    assert closed == [True]


def test_config_validation_names_the_field():
    with pytest.raises(TypeError, match="metrics.jsonl"):
        MetricsConfig(jsonl="yes").validate()
    with pytest.raises(ValueError, match="metrics.jsonl_name"):
        MetricsConfig(jsonl_name="").validate()
    with pytest.raises(ValueError, match="log_every"):
        metrics_hook(Runtime(), log_every=-1, writer=MetricsLog(enabled=False))


def test_reduce_scalars_without_a_process_group_reads_values_once():
    reduced = reduce_scalars({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor(3, dtype=torch.int64)})
    assert reduced == {"a": 1.5, "b": 2.0, "c": 3.0}
    assert reduce_scalars({}) == {}
    with pytest.raises(ValueError, match="reduce op"):
        reduce_scalars({"a": 1.0}, "median")


# ----------------------------------------------------------------------------- two ranks (gloo)


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        runtime = Runtime(rank=rank, world_size=2, dp_size=2, dp_rank=rank, backend="gloo")
        mixed = reduce_scalars(
            {"mean": torch.tensor(float(rank + 1)), "max": rank * 10.0, "sum": 1.0},
            {"max": "max", "sum": "sum"},
            dtype=torch.float64,
        )
        assert mixed == {"mean": 1.5, "max": 10.0, "sum": 2.0}, mixed
        assert reduce_scalars({"m": torch.tensor(float(rank))}, "max") == {"m": 1.0}
        writer = metrics_log(MetricsConfig(), runtime, out_dir)
        hook = metrics_hook(runtime, log_every=1, writer=writer)
        # token mode: each rank reports (local share x dp_size); their mean is the global loss
        hook(Event.STEP_END, step_state(1), StepInfo({"loss": torch.tensor(2.0 + 2 * rank), "lr": 0.1}))
        assert writer.latest().get("loss", 3.0) == 3.0  # rank 0 keeps the record; the file says the rest
        hook(Event.TRAIN_END, step_state(1), None)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_reduce_with_one_collective_and_rank_zero_writes(tmp_path):
    spawn_to_end(_two_rank_worker, (str(tmp_path / "init"), str(tmp_path)), 2, "the two metrics ranks", 120)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "epoch": 0, "attempt": 0, "loss": 3.0, "lr": 0.1}]


# ----------------------------------------------------------------------------- the window since the last log
# Issue 27 item 5: loss is the token-weighted mean over the steps since the last log, grad_norm the plain
# mean, loss_last the logging step's own loss; kept by reference on the device, resumable mid-window.

UNEVEN = [(2.0, 1, 0.5), (4.0, 9, 1.5), (1.0, 30, 2.5), (3.0, 2, 3.5), (5.0, 7, 1.0), (6.0, 1, 2.0)]
"""(loss, loss tokens, grad_norm) per step: very uneven token counts."""


def uneven_info(state: TrainState) -> StepInfo:
    loss, tokens, norm = UNEVEN[state.global_step - 1]
    metrics = {
        "loss": torch.tensor(loss),
        "grad_norm": torch.tensor(norm),
        "lr": 0.1 * state.global_step,
        "loss_tokens": torch.tensor(tokens, dtype=torch.int64),
    }
    return StepInfo(metrics, tokens, 1, 0.01)


def window_expectation(steps: range) -> dict[str, float]:
    rows = [UNEVEN[s - 1] for s in steps]
    return {
        "loss": sum(loss * tokens for loss, tokens, _ in rows) / sum(tokens for _, tokens, _ in rows),
        "grad_norm": sum(norm for _, _, norm in rows) / len(rows),
        "loss_last": rows[-1][0],
        "lr": 0.1 * steps[-1],
    }


def logged_records(tmp_path, steps: int, log_every: int, **kwargs) -> list[dict]:
    runtime = Runtime()
    hook = metrics_hook(
        runtime, log_every=log_every, writer=metrics_log(MetricsConfig(), runtime, tmp_path), **kwargs
    )
    drive(hook, steps, info=uneven_info)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(params=["host", "device"])
def window_path(request, monkeypatch):
    """Both ways the window reduces: CPU tensors read on the host, and (forced here on CPU) the stacked
    device path an accelerator takes."""
    if request.param == "device":
        from fntrain.hooks import metrics_window

        monkeypatch.setattr(metrics_window, "_on_device", lambda items: all(map(torch.is_tensor, items)))
    return request.param


def test_log_every_4_logs_the_token_weighted_mean_on_uneven_token_counts(tmp_path, window_path):
    records = logged_records(tmp_path, 6, 4, last_step=6)
    assert [r["step"] for r in records] == [4, 6]
    for record, window in zip(records, (range(1, 5), range(5, 7)), strict=True):
        want = window_expectation(window)
        assert {name: record[name] for name in want} == pytest.approx(want, rel=1e-12)
        assert "loss_tokens" not in record  # the weight is consumed, not logged
    assert records[0]["loss"] == pytest.approx((2 * 1 + 4 * 9 + 1 * 30 + 3 * 2) / 42)  # 1.762, not 3.0


def test_log_every_1_logs_each_step_exactly_and_no_loss_last(tmp_path):
    records = logged_records(tmp_path, 3, 1)
    assert [r["loss"] for r in records] == [2.0, 4.0, 1.0]
    assert all("loss_last" not in r for r in records)


def test_steps_without_loss_tokens_weigh_equally(tmp_path, window_path):
    runtime = Runtime()
    hook = metrics_hook(runtime, log_every=3, writer=metrics_log(MetricsConfig(), runtime, tmp_path))
    drive(hook, 3, info=lambda state: info(loss=float(state.global_step)))
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["loss"] == pytest.approx(2.0) and record["loss_last"] == 3.0


def test_skipped_steps_stay_out_of_the_window(tmp_path, window_path):
    def skipping(state):
        base = uneven_info(state)
        skipped = state.global_step == 2
        metrics = {**base.metrics, "skipped": float(skipped)}
        if skipped:
            metrics["loss"] = torch.tensor(float("nan"))
        return StepInfo(metrics, base.tokens, 1, 0.01)

    runtime = Runtime()
    hook = metrics_hook(runtime, log_every=3, writer=metrics_log(MetricsConfig(), runtime, tmp_path))
    drive(hook, 3, info=skipping)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["loss"] == pytest.approx((2 * 1 + 1 * 30) / 31)
    assert record["grad_norm"] == pytest.approx((0.5 + 2.5) / 2)


def test_a_long_window_folds_to_the_same_means(tmp_path, monkeypatch, window_path):
    from fntrain.hooks import metrics_window

    (unfolded,) = logged_records(tmp_path / "a", 6, 6)
    folds = []
    fold = metrics_window._fold
    monkeypatch.setattr(metrics_window, "FOLD_AT", 2)
    monkeypatch.setattr(metrics_window, "_fold", lambda window: (folds.append(1), fold(window)))
    (folded,) = logged_records(tmp_path / "b", 6, 6)
    assert len(folds) == 3 and folded == pytest.approx(unfolded, rel=1e-12)
    assert unfolded["loss"] == pytest.approx(window_expectation(range(1, 7))["loss"])


def test_a_resume_mid_window_logs_what_an_uninterrupted_run_logs(tmp_path, window_path):
    uninterrupted = logged_records(tmp_path / "whole", 6, 4, last_step=6)
    runtime = Runtime()
    first = metrics_hook(runtime, log_every=4, writer=metrics_log(MetricsConfig(), runtime, tmp_path / "a"))
    assert first.name == "metrics"
    drive(first, 5, info=uneven_info)  # logs step 4; step 5 is in the window when the checkpoint is taken
    saved = json.loads(json.dumps(first.state_dict()))  # the checkpoint keeps hook states as JSON
    assert saved["grad_norm_steps"] == 1 and saved["loss_weight"] == 7
    second = metrics_hook(runtime, log_every=4, writer=metrics_log(MetricsConfig(), runtime, tmp_path / "b"),
                          last_step=6)  # fmt: skip
    second.load_state_dict(saved)
    drive(second, 1, start=step_state(5), info=uneven_info)
    (resumed,) = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert resumed == pytest.approx(uninterrupted[-1], rel=1e-12)
    with pytest.raises(ValueError, match="metrics state is missing"):
        second.load_state_dict({"loss_sum": 1.0})


def test_non_logging_steps_with_token_weights_run_no_torch_op(tmp_path):
    """No host sync (and no device op at all) between logs: the window keeps references only."""
    runtime = Runtime()
    hook = metrics_hook(runtime, log_every=6, writer=metrics_log(MetricsConfig(), runtime, tmp_path))
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    infos = [uneven_info(step_state(step)) for step in range(1, 7)]
    with torch_op_recorder() as recorder:
        drive(hook, 5, info=lambda state: infos[state.global_step - 1], begin=False, end=None)
    assert recorder.calls == []
    with torch_op_recorder() as recorder:  # the logging step reduces the window: torch ops, then one read
        hook(Event.STEP_END, step_state(6), infos[5])
    assert recorder.calls
