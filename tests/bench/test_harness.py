"""The benchmark harness (bench/harness.py): paired block/process bootstrap intervals, goal verdicts, the speed
yardstick, step shares, pinning and measuring in fresh processes."""

from __future__ import annotations

import json

import pytest

from bench.harness import (
    REFERENCE_YARDSTICK_S,
    YARDSTICK,
    Interval,
    Target,
    Timing,
    bootstrap_median,
    in_fresh_processes,
    interleave,
    one_core,
    overhead_row,
    paired_ratio_row,
    rounds_to_decide,
    share_row,
    verdict,
    write_json,
    yardstick,
)


def test_bootstrap_interval_contains_the_median_and_is_seeded():
    samples = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    first, again = bootstrap_median(samples), bootstrap_median(samples)
    assert first == again
    assert first.median == 5.0 and first.n == 9
    assert first.low <= 5.0 <= first.high
    assert 1.0 <= first.low and first.high <= 9.0


def test_bootstrap_interval_narrows_with_more_rounds():
    few = bootstrap_median([float(i % 7) for i in range(14)])
    many = bootstrap_median([float(i % 7) for i in range(700)])
    assert many.width < few.width


def test_one_sample_gives_a_point_and_none_is_an_error():
    assert bootstrap_median([3.0]) == Interval(3.0, 3.0, 3.0, 1)
    with pytest.raises(ValueError, match="at least one sample"):
        bootstrap_median([])


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(1.0, 9.0, "met"), (1.0, 10.0, "met"), (8.0, 12.0, "undecided"), (10.5, 12.0, "NOT met")],
)
def test_verdict_needs_the_whole_interval_on_one_side_of_the_goal(low, high, expected):
    assert verdict(Interval((low + high) / 2, low, high, 10), 10.0) == expected


@pytest.mark.parametrize(
    ("low", "high", "expected"), [(0.96, 1.0, "met"), (0.9, 1.0, "undecided"), (0.8, 0.94, "NOT met")]
)
def test_verdict_for_a_higher_is_better_goal(low, high, expected):
    assert verdict(Interval((low + high) / 2, low, high, 10), 0.95, lower_is_better=False) == expected


def test_no_goal_has_no_verdict():
    assert verdict(Interval(1.0, 0.0, 2.0, 5), None) == "-"


def test_rounds_to_decide_scales_with_the_square_of_the_width():
    # half-width 4 on the goal's side, 2 away from the goal: (4 / 2) ** 2 = 4 times the rounds
    assert rounds_to_decide(Interval(8.0, 4.0, 12.0, 10), 10.0) == 40
    assert rounds_to_decide(Interval(10.0, 4.0, 12.0, 10), 10.0) is None


def test_paired_differences_cancel_drift_that_hits_both_variants():
    drift = [0.0, 5.0, -3.0, 8.0, 2.0, -6.0, 4.0, 1.0]
    timing = Timing({"ours": [10.0 + d + 1.0 for d in drift], "base": [10.0 + d for d in drift]})
    assert timing.paired("ours", "base") == pytest.approx([1.0] * len(drift))
    row = overhead_row("r", timing, "ours", "base", goal_us=2e6)
    assert row.interval.low == pytest.approx(1e6) and row.interval.high == pytest.approx(1e6)
    assert row.verdict == "met" and row.met is True


def test_undecided_row_says_how_many_rounds_would_decide():
    timing = Timing({"ours": [1.0, 3.0, 2.0, 4.0, 0.5], "base": [1.0] * 5})
    row = paired_ratio_row("r", timing, "ours", "base", goal_ratio=1.5)
    assert row.verdict == "undecided"
    assert "rounds in all would decide it" in row.note


def test_interleave_keeps_the_time_measured_outside_the_step_and_stops_on_narrow_targets():
    calls = {"a": 0, "b": 0}

    def variant(name):
        def run():
            calls[name] += 1
            return 2, 0.25

        return run

    timing = interleave(
        {"a": variant("a"), "b": variant("b")}, repeats=3, warmup=0,
        targets=[Target("a", "b", width=1.0)], budget_s=60.0,
    )  # fmt: skip
    assert len(timing.samples["a"]) == 3 and calls == {"a": 3, "b": 3}
    assert timing.outside["a"] == [0.25] * 3 and timing.samples["a"][0] < 0.25


def test_json_has_the_machine_and_every_interval(tmp_path):
    timing = Timing({"ours": [2.0, 2.1, 1.9], "base": [1.0, 1.0, 1.0]})
    write_json(tmp_path / "r.json", [overhead_row("r", timing, "ours", "base", goal_us=None)])
    payload = json.loads((tmp_path / "r.json").read_text())
    assert {"torch", "torch_threads", "cores_available"} <= set(payload["machine"])
    interval = payload["rows"][0]["interval"]
    assert interval["low"] <= interval["median"] <= interval["high"] and interval["n"] == 3


def test_compare_reports_overlapping_intervals():
    from bench.compare import compare

    def row(low, median, high):
        return {"verdict": "met", "interval": {"low": low, "median": median, "high": high, "n": 9}}

    first = {"a": row(1.0, 2.0, 3.0), "b": row(1.0, 2.0, 3.0), "c": {"verdict": "-", "interval": None}}
    second = {"a": row(2.5, 3.5, 4.5), "b": row(3.5, 4.0, 5.0), "c": {"verdict": "-", "interval": None}}
    records = {record["measure"]: record for record in compare(first, second)}
    assert set(records) == {"a", "b"}
    assert records["a"]["overlap"] and not records["a"]["medians_inside"]
    assert not records["b"]["overlap"]


def test_slow_drift_widens_the_block_interval():
    # a slow climb across the run: rounds next to each other agree, the run as a whole does not
    drift = [1.0 + 0.1 * index + 0.01 * (index % 3) for index in range(25)]
    blocks, rounds = bootstrap_median(drift), bootstrap_median(drift, block=1)
    assert blocks.low <= blocks.median <= blocks.high
    assert blocks.width > rounds.width


def test_rounds_from_several_processes_are_resampled_by_process():
    # two processes that each agree with themselves and disagree with each other
    values = [1.0, 1.01, 0.99, 1.0, 2.0, 2.01, 1.99, 2.0]
    one_process = bootstrap_median(values)
    by_process = bootstrap_median(values, groups=[0, 0, 0, 0, 1, 1, 1, 1])
    assert by_process.low <= 1.01 and by_process.high >= 1.99
    assert by_process.width >= one_process.width


def test_merged_timings_label_each_round_with_its_process():
    first = Timing({"a": [1.0, 2.0]}, {"a": [0.1, 0.2]})
    second = Timing({"a": [3.0]}, {"a": [0.3]})
    merged = Timing.merge([first, second])
    assert merged.samples["a"] == [1.0, 2.0, 3.0] and merged.outside["a"] == [0.1, 0.2, 0.3]
    assert merged.groups == [0, 0, 1]


def test_differences_at_reference_speed_scale_by_the_yardstick_of_their_round():
    slow = 2 * REFERENCE_YARDSTICK_S
    timing = Timing({"ours": [3e-6, 6e-6], "base": [1e-6, 2e-6], YARDSTICK: [REFERENCE_YARDSTICK_S, slow]})
    # the second round ran on a machine twice as slow: its 4 us difference is 2 us at reference speed
    assert timing.at_reference_speed(timing.paired("ours", "base")) == pytest.approx([2e-6, 2e-6])
    row = overhead_row("r", timing, "ours", "base", goal_us=3, speed=True)
    assert row.interval.median == pytest.approx(2.0) and row.verdict == "met"
    assert "at reference speed" in row.difference and row.fntrain == "4.5 us"
    with pytest.raises(ValueError, match="yardstick"):
        Timing({"ours": [1.0], "base": [1.0]}).at_reference_speed([0.0])


def test_share_row_divides_each_round_by_the_baseline_step_of_that_round():
    timing = Timing(
        {"ours": [10.0, 20.0, 30.0], "base": [10.0, 20.0, 30.0]},
        {"ours": [0.2, 0.4, 0.6], "base": [0.1, 0.2, 0.3]},
    )
    row = share_row("r", timing, "ours", "base", goal_percent=None, outside=True)
    assert row.interval.low == pytest.approx(1.0) and row.interval.high == pytest.approx(1.0)
    assert row.unit == "% of the step" and row.verdict == "-"


def test_yardstick_runs_as_one_more_variant():
    assert yardstick(10) == 10
    timing = interleave({"a": lambda: 1}, repeats=2, warmup=0, with_yardstick=True)
    assert set(timing.samples) == {"a", YARDSTICK} and len(timing.samples[YARDSTICK]) == 2


def test_one_core_pins_and_restores():
    import os

    import torch

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with one_core() as core:
        assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads


def fixed_timing(value: float) -> Timing:
    """Measured in a child process by the test below."""
    return Timing({"ours": [value, value]}, {"ours": [value, value]})


def test_fresh_processes_each_give_a_group_of_rounds():
    assert in_fresh_processes(fixed_timing, 1, value=2.0).groups == []
    merged = in_fresh_processes(fixed_timing, 2, value=2.0)
    assert merged.samples["ours"] == [2.0] * 4 and merged.groups == [0, 0, 1, 1]


def test_run_to_run_spread_widens_each_side_in_quadrature_around_the_same_median():
    from bench.harness import Z95, with_run_to_run

    within = Interval(1.0, 0.97, 1.01, 12)
    wide = with_run_to_run(within, 0.01)
    assert wide.median == 1.0 and wide.n == 12 and wide.spread == 0.01
    assert wide.low == pytest.approx(1.0 - (0.03**2 + (Z95 * 0.01) ** 2) ** 0.5)
    assert wide.high == pytest.approx(1.0 + (0.01**2 + (Z95 * 0.01) ** 2) ** 0.5)
    assert with_run_to_run(within, 0.0) is within


def test_rows_keep_the_within_run_interval_and_judge_the_widened_one(tmp_path):
    timing = Timing({"ours": [1.04, 1.05, 1.06, 1.05, 1.04], "base": [1.0] * 5})
    narrow = paired_ratio_row("r", timing, "ours", "base", goal_ratio=1.06, spread=0.0)
    wide = paired_ratio_row("r", timing, "ours", "base", goal_ratio=1.06, spread=0.02)
    assert narrow.verdict == "met" and narrow.interval == narrow.within_run
    assert wide.within_run == narrow.interval and wide.interval.high > 1.06
    assert wide.verdict == "undecided"
    assert "the run-to-run spread alone reaches the goal" in wide.note
    write_json(tmp_path / "r.json", [wide])
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert row["interval"]["spread"] == 0.02 and row["within_run"]["high"] < row["interval"]["high"]


def test_rounds_to_decide_lets_only_the_bootstrap_part_shrink():
    from bench.harness import Z95, with_run_to_run

    # bootstrap half-width 4 toward a goal 2 away; a run-to-run part of 1 does not shrink with rounds
    wide = with_run_to_run(Interval(8.0, 4.0, 12.0, 10), 1.0 / Z95)
    assert rounds_to_decide(wide, 10.0) == 54  # 10 * 16 / (4 - 1), rounded up
    assert rounds_to_decide(with_run_to_run(Interval(8.0, 7.0, 9.0, 10), 2.5 / Z95), 10.0) is None


def test_calibrate_records_the_spread_of_each_rows_median_across_runs(tmp_path):
    from bench import calibrate

    def run(median_a, median_b=None, quick=False):
        rows = [{"measure": "a", "interval": {"median": median_a, "low": 0, "high": 9, "n": 5}},
                {"measure": "once", "interval": None}]  # fmt: skip
        if median_b is not None:
            rows.append({"measure": "b", "interval": {"median": median_b, "low": 0, "high": 9, "n": 5}})
        return {"time": "t", "quick": quick, "machine": {"load_average": [1, 1, 1]}, "rows": rows}

    assert calibrate.spreads([run(1.0, 5.0), run(3.0)]) == {"a": pytest.approx(2**0.5)}
    paths = []
    for index, payload in enumerate([run(1.0), run(2.0), run(3.0)]):
        paths.append(tmp_path / f"{index}.json")
        paths[-1].write_text(json.dumps(payload))
    out = tmp_path / "run_to_run.json"
    assert calibrate.main([*map(str, paths), "--output", str(out)]) == 0
    recorded = json.loads(out.read_text())
    assert recorded["spread"] == {"a": pytest.approx(1.0)} and len(recorded["runs"]) == 3
    paths[0].write_text(json.dumps(run(1.0, quick=True)))
    assert calibrate.main([*map(str, paths), "--output", str(out)]) == 2


def test_the_recorded_calibration_comes_from_several_runs():
    """bench/run_to_run.json is what the full suite's rows are widened by (`python -m bench` names on stderr
    any interval row it has no spread for)."""
    from bench.harness import RUN_TO_RUN

    recorded = json.loads(RUN_TO_RUN.read_text())
    assert len(recorded["runs"]) >= 4
    assert all(value > 0 for value in recorded["spread"].values())


def test_compare_within_run_reads_each_runs_own_interval(tmp_path):
    from bench.compare import _load

    row = {"measure": "a", "verdict": "-", "interval": {"median": 1.0, "low": 0.5, "high": 1.5, "n": 5},
           "within_run": {"median": 1.0, "low": 0.9, "high": 1.1, "n": 5}}  # fmt: skip
    old = {"measure": "b", "verdict": "-", "interval": {"median": 2.0, "low": 1.9, "high": 2.1, "n": 5}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": [row, old]}))
    assert _load(str(path))["a"]["interval"]["low"] == 0.5
    within = _load(str(path), within_run=True)
    assert within["a"]["interval"]["low"] == 0.9 and within["b"]["interval"]["low"] == 1.9
