"""Compare two `python -m bench --json` runs row by row: do their intervals agree?

    python -m bench.compare idle.json loaded.json

For every row with an interval in both runs it prints the two medians and intervals, whether the intervals
overlap, and whether each run's median lies inside the other's interval; the last line counts the rows
that agree (intervals overlap). `--within-run` compares the intervals of each run's own rounds instead (no
run-to-run spread added: see bench/calibrate.py). Exit status 0 either way: this reports, it does not gate.
"""

from __future__ import annotations

import argparse
import json
import sys


def _load(path: str, within_run: bool = False) -> dict[str, dict]:
    with open(path) as handle:
        payload = json.load(handle)
    if within_run:  # runs written before the run-to-run spread existed have only `interval`
        return {
            row["measure"]: {**row, "interval": row.get("within_run") or row["interval"]}
            for row in payload["rows"]
        }
    return {row["measure"]: row for row in payload["rows"]}


def compare(first: dict[str, dict], second: dict[str, dict]) -> list[dict]:
    """One record per measure with an interval in both runs."""
    records = []
    for measure, row in first.items():
        other = second.get(measure)
        if other is None or row.get("interval") is None or other.get("interval") is None:
            continue
        a, b = row["interval"], other["interval"]
        records.append(
            {
                "measure": measure,
                "first": a,
                "second": b,
                "overlap": a["low"] <= b["high"] and b["low"] <= a["high"],
                "medians_inside": a["low"] <= b["median"] <= a["high"]
                and b["low"] <= a["median"] <= b["high"],
                "verdicts": (row["verdict"], other["verdict"]),
            }
        )
    return records


def _show(interval: dict) -> str:
    return f"{interval['median']:.4g} [{interval['low']:.4g}, {interval['high']:.4g}] (n={interval['n']})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--within-run", action="store_true", help="compare each run's own-rounds intervals")
    args = parser.parse_args(argv)
    records = compare(_load(args.first, args.within_run), _load(args.second, args.within_run))
    lines = [
        "| measure | first run | second run | overlap | medians inside | verdicts |",
        "|---|---|---|---|---|---|",
    ]
    for record in records:
        lines.append(
            f"| {record['measure']} | {_show(record['first'])} | {_show(record['second'])} | "
            f"{'yes' if record['overlap'] else 'NO'} | {'yes' if record['medians_inside'] else 'no'} | "
            f"{' / '.join(record['verdicts'])} |"
        )
    print("\n".join(lines))
    agree = sum(record["overlap"] for record in records)
    print(f"\n{agree} of {len(records)} rows have overlapping intervals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
