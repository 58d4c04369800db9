"""Run every benchmark and print one table: `python -m bench [--quick] [--record] [--json FILE] [--only NAME,...]`.

Each benchmark module exposes `run(quick: bool) -> list[Row]`. `--quick` runs few repeats (CI checks
the harness, not the figures); `--record` appends the table to bench/RESULTS.md; `--json FILE` writes
the machine, torch's version and thread counts and every row's interval, for comparing runs by script.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from bench.harness import Row, append_results, format_table, quiet, write_json

BENCHMARKS = [
    "bench.import_time",
    "bench.loop_overhead",
    "bench.tiny_gpt_throughput",
    "bench.resume_cost",
    "bench.prefetch",
    "bench.checkpoint",
    "bench.lora",
    "bench.pipeline_overhead",  # 2 ranks under torchrun: about 12 s quick, 95 s full
    "bench.tokenize_throughput",  # against datasets.map; quick about 1 min, full (a 4.8 GiB corpus) about 10 min
    "bench.cp_overhead",  # 2 ranks under torchrun: about 30 s quick, 90 s full
    "bench.sampling",  # the tiny GPT's KV cache: about 25 s quick, 2 min full
    "bench.sampler_batched",  # the batched sampler against generate, a Llama 4x256: about 15 s quick, 3 min full
    "bench.dpo",  # a Llama 4x256: about 1 min quick, 3 min full
    "bench.grpo",  # against TRL's GRPOTrainer, a Llama 4x256: about 20 s quick, 3 min full
    "bench.peers",  # against TRL's SFTTrainer and DPOTrainer, whole runs in child processes: about 35 s quick, 8 min full
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="few repeats: checks the harness, not the figures"
    )
    parser.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--json", default="", help="also write the rows and the machine as JSON to this file")
    parser.add_argument("--only", default="", help="comma-separated module names (e.g. loop_overhead)")
    args = parser.parse_args(argv)
    wanted = {f"bench.{name}" for name in args.only.split(",") if name}
    quiet()
    rows: list[Row] = []
    failed = []
    for name in BENCHMARKS:
        if wanted and name not in wanted:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name == name:
                continue  # not written yet
            raise
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            rows.extend(module.run(quick=args.quick))
        except Exception:
            traceback.print_exc()
            failed.append(name)
    print(format_table(rows))
    uncalibrated = [row.measure for row in rows if row.interval and not row.interval.spread]
    if uncalibrated and not args.quick:
        print(f"no run-to-run spread recorded for {len(uncalibrated)} rows (their intervals are this run's alone; "
              f"recalibrate with python -m bench.calibrate): {'; '.join(uncalibrated)}", file=sys.stderr)  # fmt: skip
    if args.record:
        append_results("Benchmark suite" + (" (quick)" if args.quick else ""), rows)
    if args.json:
        write_json(args.json, rows, quick=args.quick, failed=failed)
    if failed:
        print(f"benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
