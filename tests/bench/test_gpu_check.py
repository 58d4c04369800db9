"""bench/gpu_check.py on a machine without CUDA: every section runs, skips with a reason, and the one table
and the JSON still come out."""

from __future__ import annotations

import json

import torch

from bench import gpu_check


def test_every_section_skips_with_a_reason_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    sections = {row["section"] for row in rows}
    assert {section.__name__ for section in gpu_check.SECTIONS} <= sections
    skipped = [row for row in rows if row["section"] != "environment"]
    assert skipped and all(row["measure"] == "skipped" and row["value"] == "no CUDA device" for row in skipped)
    assert "torch" in payload["machine"]
    table = capsys.readouterr().out
    assert table.startswith("| section | measure | value | goal | met |")


def test_sections_not_started_within_the_budget_skip_with_that_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--json", str(out), "--budget-s", "-1"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all("time budget" in row["value"] for row in rows)
