"""DPO resumes exactly: a `fntrain run dpo` SIGKILLed inside step 5 (after step 3's checkpoint, between
the logs at steps 4 and 6) and launched again continues with the per-step loss, rewards, log-probs and
grad_norm of a run never interrupted (==, as float.hex), and its metrics.jsonl (log_every 2: the window
at step 4 holds step 3, restored from the checkpoint, and step 4) is the uninterrupted run's row for
row. The same with `--dpo.reference precomputed`, whose table is computed again at each launch. A
relaunch with another `--dpo.beta` is refused with one line naming it (exit 2, the run directory as
it was) unless `--checkpoint.allow-changes dpo.beta`. Slow tier (kills and relaunches processes).

Runs go through tests/step/objectives/dpo_resume_driver.py with tests/checkpoint/test_resume.py's process helpers,
each its own process forked from one that imported torch and transformers once (tests/helpers/fork_server.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from fntrain.checkpoint import find_latest, read_meta
from tests.checkpoint.test_resume import assert_latest_is_complete, env, finish
from tests.helpers.fork_server import DPO_PRELOAD, started
from tests.step.objectives.dpo_helpers import preference_rows, tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
STEPS = 6
KILL = "optimizer:5"  # inside step 5: updated weights, nothing of it saved or logged
TIMING = ("samples_per_s", "step_time_s", "tflops", "tokens_per_s")  # wall-clock figures: differ by run
LAUNCH = "attempt"  # which launch logged the row: 0 before the kill, 1 after it


@pytest.fixture(scope="module")
def dpo_launch_env():
    with started(env(), DPO_PRELOAD) as launched:
        yield launched


@pytest.fixture(scope="module")
def resume_flags(tmp_path_factory) -> list[str]:
    """The common flags: a tiny Llama, 24 preference pairs (one epoch of 6 steps, shuffled), AdamW,
    a checkpoint every 3 steps, a log every 2."""
    root = tmp_path_factory.mktemp("dpo_resume")
    model = tiny_llama(root / "llama", max_positions=64)
    data = root / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in preference_rows(24, seed=5)))
    return [
        "--model.path", str(model), "--data.path", str(data), "--train.train-iters", str(STEPS),
        "--train.global-batch-size", "4", "--train.micro-batch-size", "2", "--optim.lr", "5e-3",
        "--log-every", "2", "--progress.no-enabled", "--evaluate.no-with-validation",
        "--checkpoint.save-every", "3", "--checkpoint.no-export",
    ]  # fmt: skip


def launch_dpo_driver(run_dir: Path, kill: str, args: list[str], launch_env: dict[str, str],
           driver: str = "tests.step.objectives.dpo_resume_driver") -> subprocess.Popen:  # fmt: skip
    """tests/step/objectives/dpo_resume_driver.py (or another `driver` module) in its own session, its output in a file
    (see test_resume.ended, whose wait that runs out names it by `what`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [launch_env["PYTHON_FORK"], "-m", driver, str(run_dir), kill, *args, "--run-dir", str(run_dir)]
    output = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(command, cwd=ROOT, env=launch_env, stdout=output, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    process.output = output  # type: ignore[attr-defined]
    stop = "to its end" if kill == "none" else f"to its kill point {kill}"
    process.what = f"`{driver}`'s run in {run_dir}, {stop},"  # type: ignore[attr-defined]
    return process


def recorded_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def logged_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows if "loss" in row]


def without_launch(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != LAUNCH} for row in rows]


def uninterrupted_and_killed(
    reference: Path, run_dir: Path, args: list[str], launch_env: dict[str, str]
) -> None:
    """The uninterrupted run, and beside it (both at once, as tests/checkpoint/test_resume.py does) one
    killed inside step 5, which left step 3's checkpoint latest."""
    running = launch_dpo_driver(reference, "none", args, launch_env)
    killed = launch_dpo_driver(run_dir, KILL, args, launch_env)
    finish(running, killed=False)
    finish(killed, killed=True)
    assert_latest_is_complete(run_dir)
    assert read_meta(find_latest(run_dir / "checkpoints"))["train_state"]["global_step"] == 3
    assert [row["step"] for row in recorded_steps(run_dir)] == [1, 2, 3, 4]


def assert_same_dpo_run(reference: Path, run_dir: Path) -> None:
    """Every step the run recorded (steps 4 recorded twice: before the kill and redone) equals the
    uninterrupted run's step, metric by metric; and metrics.jsonl is the uninterrupted run's."""
    expected = {row["step"]: row for row in recorded_steps(reference)}
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert {"loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "logps/chosen", "logps/rejected"} <= set(expected[1])  # fmt: skip
    recorded = recorded_steps(run_dir)
    assert [row["step"] for row in recorded] == [1, 2, 3, 4, 4, 5, 6]
    mismatches = [
        (row["step"], name) for row in recorded for name in row if row[name] != expected[row["step"]][name]
    ]
    assert not mismatches, f"steps differ from the uninterrupted run: {mismatches}"
    want, got = logged_rows(reference), logged_rows(run_dir)
    # Step 4's row of the killed launch was moved to the superseded log; the relaunch logged it again.
    assert [(row["step"], row[LAUNCH]) for row in got] == [(2, 0), (4, 1), (6, 1)]
    assert without_launch(got) == without_launch(want)
    # The resumed window really held two steps at step 4: its mean is not step 4's own value.
    assert float.fromhex(expected[4]["loss"]) != got[1]["loss"]


def test_dpo_killed_between_logs_resumes_bit_for_bit(tmp_path, resume_flags, dpo_launch_env):
    uninterrupted_and_killed(tmp_path / "reference", tmp_path / "run", resume_flags, dpo_launch_env)
    finish(launch_dpo_driver(tmp_path / "run", "none", resume_flags, dpo_launch_env), killed=False)
    assert_same_dpo_run(tmp_path / "reference", tmp_path / "run")


def sizes_and_mtimes(run_dir: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under `run_dir`, a file's size and mtime (a directory's mtime moves with phase 1's
    writability probe, a directory made and removed at once: fntrain.run.checks)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in run_dir.rglob("*")}  # fmt: skip


def test_precomputed_reference_resumes_bit_for_bit_and_a_changed_beta_is_refused(tmp_path, resume_flags, dpo_launch_env,
                                                                                 capsys):  # fmt: skip
    from fntrain.cli import dispatch

    args = [*resume_flags, "--dpo.reference", "precomputed"]
    run_dir = tmp_path / "run"
    uninterrupted_and_killed(tmp_path / "reference", run_dir, args, dpo_launch_env)

    # Another beta changes every number after the restored step: refused before any model work.
    before = sizes_and_mtimes(run_dir)
    with pytest.raises(SystemExit) as exited:
        dispatch(["run", "dpo", *args, "--run-dir", str(run_dir), "--dpo.beta", "0.2"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "dpo.beta" in err and "0.1 -> 0.2" in err and "allow" in err, err
    assert sizes_and_mtimes(run_dir) == before

    # Allowed, it resumes from step 3 with the new beta (a copy: the original resumes below).
    allowed = tmp_path / "allowed"
    shutil.copytree(run_dir, allowed)
    dispatch(["run", "dpo", *args, "--run-dir", str(allowed), "--dpo.beta", "0.2",
              "--checkpoint.allow-changes", "dpo.beta"])  # fmt: skip
    metadata = json.loads((allowed / "run_metadata.json").read_text())
    assert metadata["launches"][-1]["start_step"] == 3
    assert metadata["allowed_changes"] == {"dpo.beta": [0.1, 0.2]}
    assert [row["step"] for row in logged_rows(allowed)] == [2, 4, 6]

    finish(launch_dpo_driver(run_dir, "none", args, dpo_launch_env), killed=False)
    assert_same_dpo_run(tmp_path / "reference", run_dir)
