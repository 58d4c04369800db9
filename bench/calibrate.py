"""Record each row's run-to-run spread from earlier full runs: `python -m bench.calibrate A.json B.json ...`.

One run's bootstrap interval sees the variation between its rounds and between its processes, not what
changes between runs: the machine's state minutes apart, or a busy neighbour (on the 2-core VM these
figures come from, a row's median moved by up to 3x its own interval between an idle and a loaded run).
This takes several `python -m bench --json` runs of the same suite, ideally some idle and some with a
competing process, and writes, for every row with an interval in at least two of them, the standard
deviation of its median across the runs (in the row's unit) to bench/run_to_run.json; the harness then
adds it to that row's interval in quadrature (`harness.with_run_to_run`). It includes the runs' own
statistical noise, so it errs wide. Rows never calibrated keep their bootstrap interval alone. Calibrate
on the machine the figures are for; a run to be judged should not be one the spreads came from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.harness import RUN_TO_RUN


def spreads(runs: list[dict]) -> dict[str, float]:
    """measure -> the standard deviation of its median across the runs that have an interval for it."""
    medians: dict[str, list[float]] = {}
    for run in runs:
        for row in run["rows"]:
            if row.get("interval"):
                medians.setdefault(row["measure"], []).append(row["interval"]["median"])
    return {measure: statistics.stdev(values) for measure, values in medians.items() if len(values) >= 2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="`python -m bench --json` files of full (not --quick) runs")
    parser.add_argument("--output", default=str(RUN_TO_RUN), help="where to write (default: %(default)s)")
    args = parser.parse_args(argv)
    runs = [json.loads(Path(path).read_text()) for path in args.runs]
    quick = [path for path, run in zip(args.runs, runs, strict=True) if run.get("quick")]
    if quick:
        print(
            f"bench.calibrate: {', '.join(quick)} are --quick runs; calibrate on full runs", file=sys.stderr
        )
        return 2
    payload = {
        "runs": [
            {
                "file": Path(path).name,
                "time": run.get("time"),
                "load_average": run["machine"].get("load_average"),
            }
            for path, run in zip(args.runs, runs, strict=True)
        ],  # fmt: skip
        "machine": runs[0]["machine"],
        "spread": spreads(runs),
    }
    Path(args.output).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(payload['spread'])} rows calibrated from {len(runs)} runs -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
