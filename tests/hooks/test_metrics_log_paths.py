"""`MetricsLog` paths the metrics tests do not reach: config and tags sent ahead of any record (and
not again), a summary after stop closing the sinks, every sink closed before the first close failure
is raised, an unreadable config file giving the sinks an empty config, and a disabled log doing
nothing."""

from __future__ import annotations

import pytest

from fntrain.hooks.metrics_log import MetricsLog


class SinkRecorder:
    """A sink that records what it is sent (and optionally fails to close)."""

    def __init__(self, fail_close: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail_close = fail_close

    def log_config(self, config, tags):
        self.calls.append(("config", dict(config), dict(tags)))

    def write(self, step, record):
        self.calls.append(("write", step))

    def summary(self, values):
        self.calls.append(("summary", dict(values)))

    def close(self):
        self.calls.append(("close",))
        if self.fail_close:
            raise OSError("tracker unreachable")


def test_config_sent_ahead_is_not_sent_again():
    sink = SinkRecorder()
    log = MetricsLog(enabled=True, sinks=[sink], tags={"team": "a"})
    log.log_config({"lr": 0.1}, {"stage": "sft"})
    log.write(1, 0, {"loss": 2.0})
    assert sink.calls == [("config", {"lr": 0.1}, {"team": "a", "stage": "sft"}), ("write", 1)]


def test_a_summary_after_stop_reaches_the_sinks_and_closes_them():
    sink = SinkRecorder()
    log = MetricsLog(enabled=True, sinks=[sink], run_config={})
    log.summary({})  # nothing to send
    log.stop()
    assert sink.calls == [("close",)]  # nothing was written: no summary of records
    log.summary({"outcome": "completed"})
    assert sink.calls[-2:] == [("summary", {"outcome": "completed"}), ("close",)]


def test_every_sink_is_closed_before_the_first_failure_is_raised():
    failing, healthy = SinkRecorder(fail_close=True), SinkRecorder()
    log = MetricsLog(enabled=True, sinks=[failing, healthy], run_config={})
    with pytest.raises(OSError, match="tracker unreachable"):
        log.stop()
    assert healthy.calls == [("close",)]


def test_an_unreadable_config_file_gives_an_empty_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{not json")
    sink = SinkRecorder()
    MetricsLog(enabled=True, sinks=[sink], config_path=config, attempt=2).write(3, 0, {"loss": 1.0})
    assert sink.calls[0] == ("config", {}, {"attempt": "2"})


def test_a_disabled_log_sends_nothing():
    sink = SinkRecorder()
    log = MetricsLog(enabled=False, sinks=[sink])
    log.log_config({"lr": 1}, None)
    log.summary({"outcome": "completed"})
    assert sink.calls == []
