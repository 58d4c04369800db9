"""Mutation testing of the core, one module at a time: which behaviours does no test pin?

    .venv/bin/python -m mutation.run fntrain/loop.py [more modules ...]   # or --all, or --list

For each module (mutation/targets.py names the modules and the test files that pin each one) this:
1. copies the checkout's fntrain/, recipes/, tests/ and configs/ into mutation/.work/<module>/ with a
   pyproject.toml that tells mutmut (the mutation tester, `pip install -e .[mutation]`) to mutate that
   one file and to run only that module's test files; a fresh copy every time, so the run sees the
   tests as they are now and nobody else's edits land in the middle of it;
2. runs `mutmut run` there under `nice -n 19`: mutmut runs the tests once unmutated to learn which
   tests reach which function, then, for every mutant, only those tests (the first failure kills it);
3. reads back each mutant's verdict, matches the survivors against mutation/equivalent/*.toml (mutants
   argued equivalent or harmless, with the reason) and records the module's score, killed /
   (total - equivalent), in mutation/results.json and mutation/RESULTS.md, where every survivor that
   is neither killed nor argued is listed with its diff: a behaviour of the core no test pins.

It is not part of CI (a module takes minutes on 2 cores); docs/mutation.md says how to read and act on
the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from mutation import report
from mutation.targets import ROOT, TARGETS, Target

WORK = ROOT / "mutation" / ".work"
COPIED = ("fntrain", "recipes", "tests", "configs")
# mutmut's verdicts (mutmut.stats.status_by_exit_code) folded into the three this report needs: a
# timeout or a crash is a mutant the tests noticed; "no tests" means no selected test reaches it.
KILLED = {"killed", "timeout", "segfault", "caught by type check"}
SURVIVED = {"survived", "no tests", "suspicious"}


def work_dir(target: Target) -> Path:
    """mutation/.work/<module path with dots>: one scratch copy per module (git ignores it)."""
    return WORK / target.module.replace("/", ".")


def mutmut_config(target: Target, pins: bool) -> str:
    """The [tool.mutmut] table for one module: mutate the file, run its test files, fork per mutant.

    forkserver: torch is not fork-safe once it has run ops, so the mutants fork from a process that
    imported the tests but ran none of them.
    """
    tests = ", ".join(json.dumps(t) for t in target.test_files(pins))
    deselect = "".join(f', "--deselect", {json.dumps(test)}' for test in target.skip)
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["fntrain"]\n'
        'also_copy = ["recipes", "configs"]\n'  # tests build recipes' jobs and read their configs
        f"only_mutate = [{json.dumps(target.module)}]\n"
        f"pytest_add_cli_args_test_selection = [{tests}]\n"
        f'pytest_add_cli_args = ["-p", "no:cacheprovider", "-W", "ignore"{deselect}]\n'
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
    )


def prepare(target: Target, pins: bool) -> Path:
    """A fresh scratch copy of the checkout for `target`, with its mutmut configuration."""
    work = work_dir(target)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        if (ROOT / name).exists():
            shutil.copytree(ROOT / name, work / name, ignore=skip)
    text = (ROOT / "pyproject.toml").read_text()
    (work / "pyproject.toml").write_text(text + mutmut_config(target, pins))
    return work


def run_mutmut(work: Path, max_children: int, log: Path, names: tuple[str, ...] = ()) -> int:
    """`nice -n 19 mutmut run [names]` in `work` (every mutant, or only those named), its output in
    `log`; returns mutmut's exit status."""
    mutmut = Path(sys.executable).with_name("mutmut")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    # mutmut forks a child per mutant from the process that ran the tests once: torch imports dynamo the
    # first time an optimizer is built, which each child would then pay again (seconds per mutant);
    # loading it as a pytest plugin puts it in the parent, once.
    env["PYTEST_ADDOPTS"] = f"{os.environ.get('PYTEST_ADDOPTS', '')} -p torch._dynamo".strip()
    with log.open("w") as out:
        done = subprocess.run(
            ["nice", "-n", "19", str(mutmut), "run", "--max-children", str(max_children), *names],
            cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, check=False,
        )
    return done.returncode


def verdicts(work: Path, target: Target) -> dict[str, str]:
    """Each mutant's name and mutmut's verdict, from the .meta file mutmut leaves beside the mutant."""
    from mutmut.stats import status_by_exit_code

    meta = json.loads((work / "mutants" / (target.module + ".meta")).read_text())
    return {name: status_by_exit_code[code] for name, code in sorted(meta["exit_code_by_key"].items())}


def _mutmut_or_exit(target: Target, work: Path, status: int, log: Path) -> None:
    if status != 0 or not (work / "mutants" / (target.module + ".meta")).exists():
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"mutmut failed on {target.module} (exit {status}); its log: {log}\n{tail}")


def diff_of(work: Path, target: Target, name: str) -> str:
    """The mutant's unified diff against the original function (mutmut's `show`)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    cwd = Path.cwd()
    os.chdir(work)
    try:
        return get_diff_for_mutant(name, path=Path(target.module))
    finally:
        os.chdir(cwd)


def measure(target: Target, max_children: int, pins: bool = True) -> dict:
    """Run one module's mutants; return its record for results.json (see mutation/report.py)."""
    work = prepare(target, pins)
    log = work / "mutmut.log"
    started = datetime.now(timezone.utc)
    status = run_mutmut(work, max_children, log)
    _mutmut_or_exit(target, work, status, log)
    by_name = verdicts(work, target)
    survivors = {name: diff_of(work, target, name) for name, v in by_name.items() if v in SURVIVED}
    return report.record(
        target, by_name, survivors, killed_verdicts=KILLED, pins=pins,
        started=started, seconds=(datetime.now(timezone.utc) - started).total_seconds(),
    )


def retest(target: Target, max_children: int) -> dict:
    """Run only the open survivors of the module's last recorded run against the tests as they are now
    (minutes instead of the whole module's run); the mutants that run killed stay killed. Refused when
    the module's source changed since (its mutants are no longer the recorded ones): run it whole."""
    previous = report.stored(target.module)
    if previous is None or not previous["survived"]:
        raise SystemExit(f"{target.module}: no recorded run with open survivors to test again")
    work = prepare(target, pins=True)
    log = work / "mutmut.log"
    started = datetime.now(timezone.utc)
    names = tuple(s["name"] for s in previous["survived"])
    _mutmut_or_exit(target, work, run_mutmut(work, max_children, log, names), log)
    by_name = verdicts(work, target)
    changed = len(by_name) != previous["total"] or any(
        diff_of(work, target, s["name"]) != s["diff"] for s in previous["survived"]
    )
    if changed:
        raise SystemExit(f"{target.module} changed since its last run: run it whole (python -m mutation.run "
                         f"{target.module})")  # fmt: skip
    again = {name: by_name[name] for name in names}
    survivors = {name: diff_of(work, target, name) for name, v in again.items() if v in SURVIVED}
    return report.retested(
        target, previous, again, survivors, killed_verdicts=KILLED,
        started=started, seconds=(datetime.now(timezone.utc) - started).total_seconds(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mutation.run", description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="module paths as in mutation/targets.py, e.g. fntrain/loop.py")
    parser.add_argument("--all", action="store_true", help="every module in mutation/targets.py, in its order")
    parser.add_argument("--list", action="store_true", help="print the modules and their test files, run nothing")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default 1)")
    parser.add_argument("--baseline", action="store_true",
                        help="run without the module's pin file (tests/.../test_<stem>_pins.py) and record it as the module's first run")
    parser.add_argument("--survivors", action="store_true",
                        help="test only the open survivors of the module's last run again (after new pins)")
    parser.add_argument("--render", action="store_true", help="rewrite RESULTS.md from results.json only")
    args = parser.parse_args(argv)
    if args.list:
        for t in TARGETS.values():
            print(f"{t.module}  (goal {t.goal:.0%}): {' '.join(t.test_files())}")
        return 0
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        print(f"python -m mutation.run: {unknown[0]!r} is not a target (see --list)", file=sys.stderr)
        return 2
    chosen = list(TARGETS) if args.all else args.modules
    if not chosen and not args.render:
        parser.print_usage(sys.stderr)
        return 2
    if chosen and not Path(sys.executable).with_name("mutmut").exists():
        print("python -m mutation.run: mutmut is not installed (.venv/bin/pip install -e '.[mutation]')",
              file=sys.stderr)
        return 2
    for module in chosen:
        print(f"mutating {module} ...", flush=True)
        if args.survivors:
            rec = retest(TARGETS[module], args.max_children)
        else:
            rec = measure(TARGETS[module], args.max_children, pins=not args.baseline)
        report.store(rec, baseline=args.baseline)
        print(report.summary_line(rec), flush=True)
    report.render()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
