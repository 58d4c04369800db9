"""CPU contention: the tiny-GPT recipe's step time with 0 and 1 competing busy processes, at several thread
settings, each in a fresh subprocess (OpenMP reads its environment once, at start-up).

    python -m bench.contention [--quick] [--json FILE]

Settings: torch's default (one thread per core), the runtime's automatic choice (`cpu_threads=0`),
threads = the cores left free by the competitor, one thread, OMP_WAIT_POLICY=passive (threads asleep
rather than spinning while they wait) with the default and the automatic threads, and fntrain's defaults as
a user gets them (`import fntrain` before torch, which sets the passive policy, and the automatic threads).
The competitor is a pure-Python busy loop started and stopped here, bounded in time whatever happens.
Not part of `python -m bench`: its figures are about load, not about fntrain against a baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BUSY_LOOP = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def _worker(steps: int, threads: int, automatic: bool, fntrain_first: bool) -> None:
    """Time `steps` steps of the recipe (after 2 warm-up steps); print one JSON line. `fntrain_first`:
    import fntrain before torch, as the `fntrain` command and the recipes do."""
    import dataclasses
    import logging

    if fntrain_first:
        import fntrain  # noqa: F401  (its environment defaults must precede torch's OpenMP start-up)
    policy = os.environ.get("OMP_WAIT_POLICY", "")  # what libgomp reads when torch loads it, just below
    import torch

    import recipes.tiny_gpt as recipe
    from fntrain.data.pipeline import batches
    from fntrain.run.build import build_job
    from fntrain.run.checks import check_run
    from fntrain.runtime import Runtime
    from fntrain.runtime.setup import RuntimeConfig
    from fntrain.runtime.threads import choose_cpu_threads
    from fntrain.state import TrainState
    from fntrain.step import StepSettings, make_train_step

    logging.getLogger("fntrain").setLevel(logging.WARNING)
    if automatic:
        torch.set_num_threads(choose_cpu_threads(RuntimeConfig().cpu_threads))
    elif threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        config = recipe.Config(run_dir=tmp)
        config = dataclasses.replace(config, evaluate=dataclasses.replace(config.evaluate, eval_every=0))
        built = build_job(config, recipe.spec, Runtime(), check_run(config, recipe.spec))
        parts = built.components
        step_fn = make_train_step(
            parts.model, parts.loss_fn, parts.optimizers, parts.schedulers, settings=StepSettings(max_grad_norm=1.0)
        )
        iterator = batches(built.data, 0, 0)
        state, times = TrainState(), []
        for index in range(steps + 2):
            batch = next(iterator)
            started = time.perf_counter()
            float(step_fn(state, batch)["loss"])
            if index >= 2:
                times.append(time.perf_counter() - started)
    print(json.dumps({"threads": torch.get_num_threads(), "policy": policy, "step_s": statistics.median(times),
                      "times": times}))  # fmt: skip


SETTINGS = {
    "torch default threads": ({}, ["--threads", "0"]),
    "automatic (cpu_threads=0)": ({}, ["--automatic"]),
    "threads = free cores": ({}, ["--threads", "free"]),
    "one thread": ({}, ["--threads", "1"]),
    "default threads, OMP_WAIT_POLICY=passive": ({"OMP_WAIT_POLICY": "passive"}, ["--threads", "0"]),
    "automatic, OMP_WAIT_POLICY=passive": ({"OMP_WAIT_POLICY": "passive"}, ["--automatic"]),
    "fntrain defaults (import fntrain first, automatic threads)": ({}, ["--automatic", "--fntrain-first"]),
}


def measure(steps: int, busy: int, env: dict[str, str], args: list[str], timeout_s: float = 300) -> dict:
    """Run the worker with `busy` busy-loop processes alongside (each killed at the end, bounded anyway)."""
    cores = len(os.sched_getaffinity(0))
    args = [str(max(1, cores - busy)) if arg == "free" else arg for arg in args]
    competitors = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(seconds=timeout_s)]) for _ in range(busy)
    ]
    try:
        time.sleep(0.2 * busy)
        child_env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
        }
        child_env.update(env)
        out = subprocess.run(
            [sys.executable, "-m", "bench.contention", "--worker", "--steps", str(steps), *args],
            env=child_env, capture_output=True, text=True, timeout=timeout_s, check=True,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for process in competitors:
            process.kill()
            process.wait()


def run_all(quick: bool, only: str = "") -> list[dict]:
    steps = 3 if quick else 8
    results = []
    for name, (env, args) in SETTINGS.items():
        if only and name not in only.split(";"):
            continue
        for busy in (0, 1):
            result = measure(steps, busy, env, args)
            results.append({"setting": name, "busy": busy, **result})
            print(f"{name}, {busy} busy: {result['threads']} threads, {result['step_s']:.3f} s/step",
                  file=sys.stderr, flush=True)  # fmt: skip
    return results


def format_table(results: list[dict]) -> str:
    lines = [
        "| setting | threads (idle / 1 busy) | OpenMP wait | step, idle | step, 1 busy process | slowdown |",
        "|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["setting"] for r in results):
        idle = next(r for r in results if r["setting"] == name and r["busy"] == 0)
        busy = next(r for r in results if r["setting"] == name and r["busy"] == 1)
        policy = idle.get("policy") or "libgomp default (spins)"
        lines.append(
            f"| {name} | {idle['threads']} / {busy['threads']} | {policy} | {idle['step_s']:.3f} s "
            f"| {busy['step_s']:.3f} s | {busy['step_s'] / idle['step_s']:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--only", default="", help="settings to run, separated by ';'")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--automatic", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fntrain-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.steps, args.threads, args.automatic, args.fntrain_first)
        return 0
    results = run_all(args.quick, args.only)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
