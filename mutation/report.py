"""The results of mutation runs: one record per module in results.json, rendered to RESULTS.md.

A module's score is killed / (total - equivalent): a mutant the tests notice (a failure, a timeout, a
crash) is killed; a surviving mutant matched by an entry of mutation/equivalent/<module stem>.toml (same module, same
function, same changed lines) is argued equivalent or harmless and leaves the denominator; every other survivor is
listed in RESULTS.md with its diff, a behaviour no test pins. Matching by the change, not by mutmut's
numbering, keeps a reason attached to its mutant when the function's other lines change.
"""

from __future__ import annotations

import fcntl
import json
import sys
from datetime import datetime

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project's own dependency before 3.11
    import tomli as tomllib

from mutation.targets import ROOT, TARGETS, Target

HERE = ROOT / "mutation"
RESULTS_JSON = HERE / "results.json"
RESULTS_MD = HERE / "RESULTS.md"
EQUIVALENT = HERE / "equivalent"  # one <module stem>.toml per module


def function_of(name: str) -> str:
    """`fntrain.loop.x_train__mutmut_3` -> `train`; `...xǁCǁm__mutmut_1` -> `C.m`."""
    last = name.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
    if last.startswith("xǁ"):
        return last[2:].replace("ǁ", ".")
    return last[2:] if last.startswith("x_") else last


def change_of(diff: str) -> str:
    """The changed lines of a unified diff, sign kept, indentation dropped: what identifies a mutant."""
    lines = [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    return "\n".join(ln[0] + ln[1:].strip() for ln in lines)


def load_equivalent() -> list[dict]:
    """The argued mutants: the [[mutant]] tables (module, function, change, reason) of every
    mutation/equivalent/<module stem>.toml."""
    return [entry for path in sorted(EQUIVALENT.glob("*.toml")) for entry in tomllib.loads(path.read_text())["mutant"]]


def reason_for(module: str, name: str, diff: str, argued: list[dict]) -> str | None:
    """The reason recorded for this survivor, or None when nobody has argued it."""
    func, change = function_of(name), change_of(diff)
    for entry in argued:
        if entry["module"] == module and entry["function"] == func and entry["change"].strip() == change:
            return entry["reason"]
    return None


def _argued_and_open(target: Target, survivors: dict[str, str], verdicts: dict[str, str]) -> tuple[list, list]:
    """The survivors (name -> diff) split into those argued in mutation/equivalent/ (with the reason) and
    those still open (with mutmut's verdict)."""
    argued = load_equivalent()
    equivalent, open_ = [], []
    for name, diff in survivors.items():
        reason = reason_for(target.module, name, diff, argued)
        entry = {"name": name, "function": function_of(name), "change": change_of(diff), "diff": diff}
        if reason is None:
            open_.append({**entry, "verdict": verdicts[name]})
        else:
            equivalent.append({**entry, "reason": reason})
    return equivalent, open_


def record(target: Target, by_name: dict[str, str], survivors: dict[str, str], *, killed_verdicts: set[str],
           pins: bool, started: datetime, seconds: float) -> dict:
    """One module's result record from mutmut's verdicts and the survivors' diffs."""
    equivalent, open_ = _argued_and_open(target, survivors, by_name)
    total = len(by_name)
    killed = sum(v in killed_verdicts for v in by_name.values())
    denominator = total - len(equivalent)
    return {
        "module": target.module, "goal": target.goal, "tests": list(target.test_files(pins)),
        "date": started.strftime("%Y-%m-%d %H:%M UTC"), "seconds": round(seconds),
        "command": f".venv/bin/python -m mutation.run {'' if pins else '--baseline '}{target.module}",
        "total": total, "killed": killed, "equivalent": equivalent, "survived": open_,
        "timeouts": sum(v == "timeout" for v in by_name.values()),
        "score": killed / denominator if denominator else 1.0,
    }


def retested(target: Target, previous: dict, again: dict[str, str], survivors: dict[str, str], *,
             killed_verdicts: set[str], started: datetime, seconds: float) -> dict:
    """The module's record after its open survivors (`again`: name -> new verdict) were tested again:
    the previous run's kills and argued mutants kept, the newly killed counted, the rest re-matched
    against the equivalent files."""
    argued, open_ = _argued_and_open(target, survivors, again)
    equivalent = [*previous["equivalent"], *argued]
    killed = previous["killed"] + sum(v in killed_verdicts for v in again.values())
    denominator = previous["total"] - len(equivalent)
    return {
        **previous, "tests": list(target.test_files(True)),
        "date": started.strftime("%Y-%m-%d %H:%M UTC"), "seconds": previous["seconds"] + round(seconds),
        "command": f".venv/bin/python -m mutation.run {target.module}, then --survivors",
        "killed": killed, "equivalent": equivalent, "survived": open_,
        "timeouts": previous["timeouts"] + sum(v == "timeout" for v in again.values()),
        "score": killed / denominator if denominator else 1.0,
    }


def stored(module: str) -> dict | None:
    """The module's record in results.json, or None."""
    return json.loads(RESULTS_JSON.read_text()).get(module) if RESULTS_JSON.exists() else None


def store(rec: dict, baseline: bool = False) -> None:
    """Put `rec` into results.json. The module's first recorded score is kept as its baseline (the
    score before tests were written against its survivors); a `baseline` run replaces that one only."""
    summary = {k: rec[k] for k in ("date", "total", "killed", "score", "command")}
    # Two modules' runs may end at once (one per terminal): the read-modify-write holds a lock so
    # neither loses the other's record.
    with (HERE / ".results.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
        previous = data.get(rec["module"])
        if baseline and previous is not None:
            data[rec["module"]] = {**previous, "first": summary}
        else:
            data[rec["module"]] = {**rec, "first": (previous or {}).get("first") or summary}
        RESULTS_JSON.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def summary_line(rec: dict) -> str:
    return (f"{rec['module']}: {rec['killed']}/{rec['total']} killed, {len(rec['equivalent'])} equivalent, "
            f"{len(rec['survived'])} open; score {rec['score']:.1%} (goal {rec['goal']:.0%})")


HEADER = """# Mutation testing results

Generated by `.venv/bin/python -m mutation.run MODULE ...` (docs/mutation.md) from mutation/results.json;
do not edit by hand. Score = killed / (total - equivalent). *Killed* counts the mutants that made a test
fail and, in brackets, those that ran past mutmut's CPU-time limit (a mutated loop that never ends).
*First run* is the module's score before tests were written against its survivors (`--baseline` runs
it without its pin file, `tests/<folder>/test_<stem>_pins.py`). A module marked *not run* has no result
yet: nothing is known about it.

| module | goal | mutants | killed | equivalent | open survivors | score | first run | date | time |
|---|---|---|---|---|---|---|---|---|---|
"""


def _row(module: str, goal: float, rec: dict | None) -> str:
    if rec is None:
        return f"| {module} | {goal:.0%} | not run | | | | | | | |"
    first = rec["first"]
    mark = "" if rec["score"] >= goal else " (below goal)"
    timeouts = f" ({rec['timeouts']} timeouts)" if rec.get("timeouts") else ""
    return (f"| {module} | {goal:.0%} | {rec['total']} | {rec['killed']}{timeouts} | {len(rec['equivalent'])} | "
            f"{len(rec['survived'])} | {rec['score']:.1%}{mark} | {first['score']:.1%} "
            f"({first['killed']}/{first['total']}) | {rec['date']} | {rec['seconds']} s |")


def _details(data: dict) -> list[str]:
    out = ["", "## Open survivors: behaviours no test pins", ""]
    for module, rec in data.items():
        for s in rec["survived"]:
            out += [f"- `{module}` `{s['name']}` ({s['verdict']})", "", "  ```diff",
                    *("  " + ln for ln in s["diff"].splitlines()[2:]), "  ```", ""]
    if not any(rec["survived"] for rec in data.values()):
        out.append("None in the modules run.")
    out += ["", "## Equivalent or harmless mutants (mutation/equivalent/)", ""]
    for module, rec in data.items():
        for e in rec["equivalent"]:
            change = " / ".join(f"`{ln}`" for ln in e["change"].splitlines())
            out.append(f"- `{module}` `{e['function']}`: {change}: {e['reason']}")
    out += ["", "## Test files per module", ""]
    for m, rec in data.items():
        left_out = "".join(f"; left out: `{t}`" for t in TARGETS[m].skip)
        out.append(f"- `{m}`: {', '.join(f'`{t}`' for t in rec['tests'])}{left_out}")
    return out


def render() -> None:
    """Rewrite RESULTS.md: every target (run or not) in targets.py order, then the details."""
    data = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    rows = [_row(m, t.goal, data.get(m)) for m, t in TARGETS.items()]
    ordered = {m: data[m] for m in TARGETS if m in data}
    missing = [m for m in TARGETS if m not in data]
    gaps = ["", f"{len(missing)} of {len(TARGETS)} target modules have no result yet: what their tests miss is "
            "unknown until someone runs them." if missing else "Every target module has a result."]
    RESULTS_MD.write_text(HEADER + "\n".join(rows) + "\n" + "\n".join(gaps + _details(ordered)) + "\n")
