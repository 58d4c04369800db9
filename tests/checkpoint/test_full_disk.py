"""A full disk for real: the checkpoint directory on a small tmpfs, mounted in a user and mount
namespace of the run's own (`unshare -rm`, no root needed where user namespaces are allowed; the test
is skipped where they are not), and a rerun's export on a filesystem too full for it (the previous
export stays whole). tests/checkpoint/test_save_faults.py and tests/checkpoint/test_atomic_exports.py cover the
same faults with a write shim in the default tier. Slow tier (a few `fntrain run` processes)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fntrain.checkpoint import list_checkpoints
from tests.helpers.commands import last_line
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
    "--train.global-batch-size", "8", "--train.micro-batch-size", "4", "--train.train-iters", "9",
    "--log-every", "0", "--progress.no-enabled", "--evaluate.eval-every", "0", "--evaluate.no-at-end",
    "--checkpoint.save-every", "3",
]  # fmt: skip


def _can_mount(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    command = f"mount -t tmpfs -o size=1m none {shlex.quote(str(probe))}"
    return run_to_end(["unshare", "-rm", "sh", "-c", command], "the probe mount", 120).returncode == 0


def run_on_tmpfs(tmp_path: Path, run_dir: Path, *args: str, size: int | None = None, driver: str | None = None,
        ) -> subprocess.CompletedProcess:  # fmt: skip
    """`fntrain run tiny_gpt` (or the fault driver) with the checkpoints on a `size`-byte tmpfs (None: the
    plain disk). The tmpfs lives only as long as the namespace: what it held at the end is copied to
    <run_dir>/checkpoints.tmpfs/."""
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:3000])
    checkpoints = run_dir / "checkpoints"
    head = (
        ["-m", "fntrain", "run", "tiny_gpt"]
        if driver is None
        else ["-m", "tests.run.fault_driver", str(tmp_path / "faults"), driver]
    )
    command = [sys.executable, *head, *TINY, "--data.path", str(corpus), "--run-dir", str(run_dir), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if size is not None:
        checkpoints.mkdir(parents=True, exist_ok=True)
        mount = f"mount -t tmpfs -o size={size} none {shlex.quote(str(checkpoints))}"
        keep = shlex.quote(str(run_dir / "checkpoints.tmpfs"))
        script = f"{mount} && {{ {shlex.join(command)}; rc=$?; mkdir -p {keep}; cp -a {shlex.quote(str(checkpoints))}/. {keep}/; exit $rc; }}"
        command = ["unshare", "-rm", "sh", "-c", script]
    where = "on the plain disk" if size is None else f"with its checkpoints on a {size}-byte tmpfs"
    what = f"the run in {run_dir.name} ({driver or '`fntrain run tiny_gpt`'}) {where}"
    return run_to_end(command, what, 180, cwd=tmp_path, env=env)


def checkpoint_size(tmp_path: Path) -> int:
    measured = tmp_path / "measured"
    result = run_on_tmpfs(tmp_path, measured)
    assert result.returncode == 0, result.stderr[-3000:]
    step = measured / "checkpoints" / "step_3"
    return sum(f.stat().st_size for f in step.rglob("*") if f.is_file())


@pytest.fixture
def one_checkpoint(tmp_path):
    """The size of one tiny checkpoint (skips where no tmpfs can be mounted)."""
    if not _can_mount(tmp_path):
        pytest.skip("cannot mount a tmpfs in a user namespace here (unshare -rm)")
    return checkpoint_size(tmp_path)


@pytest.mark.slow
def test_a_full_disk_inside_dcp_is_one_line_and_keeps_the_good_checkpoint(tmp_path, one_checkpoint):
    run_dir = tmp_path / "run"
    # Room for step_3 and a part of step_6: the write itself hits ENOSPC (the check before it is
    # switched off by the fault driver, as where free space cannot be known in advance).
    result = run_on_tmpfs(tmp_path, run_dir, size=int(one_checkpoint * 1.6), driver="nospacecheck")
    line = last_line(result)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "CheckpointSaveError: checkpoint step_6 not saved: " in line, line
    assert "ENOSPC" in line or "the filesystem is full" in line, line
    assert "step_3 is the newest good checkpoint" in line and "needs ~" in line and " free" in line
    metadata = json.loads((run_dir / "run_metadata.json").read_text())
    assert metadata["outcome"] == "failed" and "step_6 not saved" in metadata["error"]
    held = run_dir / "checkpoints.tmpfs"
    assert sorted(p.name for p in held.iterdir()) == ["latest", "step_3"]  # no partial under any name
    assert (held / "latest").read_text().strip() == "step_3"


@pytest.mark.slow
def test_a_save_that_will_not_fit_is_refused_early_and_the_run_resumes(tmp_path, one_checkpoint):
    run_dir = tmp_path / "run"
    result = run_on_tmpfs(tmp_path, run_dir, size=int(one_checkpoint * 1.6))
    line = last_line(result)
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        "checkpoint step_6 not saved: ENOSPC not enough free space" in line
        and "nothing was left behind" in line
    )
    held = run_dir / "checkpoints.tmpfs"
    assert sorted(p.name for p in held.iterdir()) == ["latest", "step_3"]
    # given room (what the tmpfs held, moved to the real disk), the run resumes from step_3
    for entry in held.iterdir():
        shutil.move(str(entry), str(run_dir / "checkpoints" / entry.name))
    again = run_on_tmpfs(tmp_path, run_dir, "--checkpoint.restore-from", "latest")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_3", "step_6", "step_9"]


@pytest.mark.slow
def test_continue_and_make_room_on_a_small_disk(tmp_path, one_checkpoint):
    run_dir = tmp_path / "run"
    kept = run_on_tmpfs(tmp_path, run_dir, "--checkpoint.on-save-failure", "continue", size=int(one_checkpoint * 1.6))
    assert kept.returncode == 0, kept.stderr[-3000:]
    warnings = [line for line in kept.stderr.splitlines() if "not saved" in line]
    assert "step_6 not saved" in warnings[0] and "step_9 not saved" in warnings[1]  # each cadence warns
    assert {line.split(" not saved")[0].split()[-1] for line in warnings} == {
        "step_6",
        "step_9",
    }  # (the end retries 9)
    assert all("training goes on" in line and "step_3 is the newest good" in line for line in warnings)

    roomy = tmp_path / "roomy"
    made = run_on_tmpfs(tmp_path, roomy, "--checkpoint.keep-last", "2", "--checkpoint.make-room",
               size=int(one_checkpoint * 2.6))  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    assert "checkpoint.make_room: removed step_3 to make room for step_9" in made.stderr
    assert "not saved" not in made.stderr
    assert [p.name for p in list_checkpoints(roomy / "checkpoints.tmpfs")] == ["step_6", "step_9"]


@pytest.mark.slow
def test_a_full_disk_at_the_export_keeps_the_previous_export_and_says_so(tmp_path):
    """A finished run rerun in its directory (it writes its exports again) on a tmpfs with less room left
    than hf_model needs: the write fails inside safetensors, the previous hf_model stays byte for byte,
    no temporary is left, and the line says what is kept."""
    if not _can_mount(tmp_path):
        pytest.skip("cannot mount a tmpfs in a user namespace here (unshare -rm)")
    run_dir = tmp_path / "run"
    done = run_on_tmpfs(tmp_path, run_dir, "--model.d-model", "64")
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir / "model.safetensors").unlink()  # only hf_model is there to be replaced
    before = {p.relative_to(run_dir / "hf_model"): p.read_bytes() for p in (run_dir / "hf_model").rglob("*") if p.is_file()}
    held = sum(-(-p.stat().st_size // 4096) * 4096 for p in run_dir.rglob("*") if p.is_file())
    shutil.move(str(run_dir), str(tmp_path / "done"))
    run_dir.mkdir()
    corpus = tmp_path / "corpus.txt"
    command = [sys.executable, "-m", "fntrain", "run", "tiny_gpt", *TINY, "--model.d-model", "64",
               "--data.path", str(corpus), "--run-dir", str(run_dir)]  # fmt: skip
    after = tmp_path / "after"
    script = (f"mount -t tmpfs -o size={held + (160 << 10)} none {shlex.quote(str(run_dir))} && "
              f"cp -a {shlex.quote(str(tmp_path / 'done'))}/. {shlex.quote(str(run_dir))}/ && "
              f"{{ {shlex.join(command)}; rc=$?; cp -a {shlex.quote(str(run_dir))} {shlex.quote(str(after))}; "
              "exit $rc; }")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    what = "the run exporting hf_model onto a full tmpfs"
    result = run_to_end(["unshare", "-rm", "sh", "-c", script], what, 180, cwd=tmp_path, env=env)
    line = last_line(result)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    # (safetensors' own error type: "SafetensorError: ... No space left on device (os error 28)")
    assert line.startswith("run failed at step 9 exporting hf_model: ") and "No space left on device" in line, line
    assert "; the checkpoints (newest step_9) and the previous hf_model are kept; full traceback in " in line, line
    kept = {p.relative_to(after / "hf_model"): p.read_bytes() for p in (after / "hf_model").rglob("*") if p.is_file()}
    assert kept == before
    assert not [p.name for p in after.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
