"""bench/contention.py: the table it prints, and a worker run of the real recipe that reports the OpenMP wait
policy torch started with (fntrain's default only when fntrain is imported first)."""

from __future__ import annotations

import pytest

from bench import contention


def result(setting: str, busy: int, step_s: float, threads: int = 2, policy: str = "") -> dict:
    return {"setting": setting, "busy": busy, "threads": threads, "policy": policy, "step_s": step_s}


def test_table_has_one_line_per_setting_with_the_slowdown():
    table = contention.format_table(
        [
            result("spin", 0, 0.2),
            result("spin", 1, 2.0),
            result("passive", 0, 0.25, policy="PASSIVE"),
            result("passive", 1, 0.4, threads=2, policy="PASSIVE"),
        ]
    )
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2] == "| spin | 2 / 2 | libgomp default (spins) | 0.200 s | 2.000 s | 10.0x |"
    assert lines[3] == "| passive | 2 / 2 | PASSIVE | 0.250 s | 0.400 s | 1.6x |"


def test_every_setting_has_a_worker_command_line():
    names = set(contention.SETTINGS)
    assert "fntrain defaults (import fntrain first, automatic threads)" in names
    for env, args in contention.SETTINGS.values():
        assert set(env) <= {"OMP_WAIT_POLICY", "OMP_NUM_THREADS"}
        assert args


@pytest.mark.slow
def test_fntrain_first_starts_torch_with_the_passive_policy_and_torch_first_does_not(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the parent's setting must not leak into a setting
    # One thread: the policy is read all the same, and no thread spins beside the other test processes.
    one = {"OMP_NUM_THREADS": "1"}
    ours = contention.measure(1, 0, one, ["--automatic", "--fntrain-first"], timeout_s=120)
    plain = contention.measure(1, 0, one, ["--threads", "0"], timeout_s=120)
    assert ours["policy"] == "PASSIVE"
    assert plain["policy"] == ""
    assert ours["threads"] == 1 and ours["step_s"] > 0 and len(ours["times"]) == 1
