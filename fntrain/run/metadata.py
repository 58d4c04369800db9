"""`<run_dir>/run_metadata.json`: what ran, where, with which code (written once per launch).

    write_run_metadata(run_dir, runtime)            # every rank calls (a gather); rank 0 writes
    record_start(run_dir, runtime, state)           # after the restore: the step this launch starts at

Contents (JSON): the command line (`argv`, the Python executable, the working directory, the launcher's
environment: torchrun's restart count, rendezvous settings, SLURM job id), the resolved config
(`config_file`: the name of the `config.json` the recipe writes beside it, which reads back with
`--config`), the versions of fntrain, torch (and its CUDA / torch_npu when present), Python and the
platform, the world size, backend and parallel sizes, one entry per rank (hostname, pid, device and its
name), rank 0's hostname, the start time, the TrainState this launch starts from, and the git commit of
the working tree (`git.commit`, `git.dirty`: tracked files modified) when the working directory is in a
git checkout (`git: null` otherwise, or when git is missing: never an error), plus the same for
fntrain's own source when it lives in another checkout. A job restarted under torchrun rewrites the
file; earlier launches stay listed under `launches` (time, restart count, host, start step, commit).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fntrain.runtime.runtime import Runtime

__all__ = [
    "METADATA_FILE",
    "collect_run_metadata",
    "write_run_metadata",
    "record_start",
    "record_outcome",
    "read_attempt",
    "git_state",
]

log = logging.getLogger("fntrain.run.metadata")

METADATA_FILE = "run_metadata.json"
_LAUNCH_ENV = (
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "GROUP_RANK",
    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_NODELIST",
    "SLURM_RESTART_COUNT",
)  # fmt: skip
_HISTORY = 50  # launches kept in the list


def _git(directory: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs on a network filesystem
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_state(directory: str | os.PathLike) -> dict[str, Any] | None:
    """{"root", "commit", "dirty"} of the git checkout holding `directory`, or None (not a checkout,
    no commit yet, or git unavailable). `dirty`: tracked files differ from the commit (untracked files
    do not count); None when that could not be determined."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    root = _git(directory, "rev-parse", "--show-toplevel")
    commit = _git(directory, "rev-parse", "HEAD") if root else None
    if not root or not commit:
        return None
    status = _git(directory, "status", "--porcelain", "--untracked-files=no")
    return {"root": root, "commit": commit, "dirty": None if status is None else bool(status)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _device_name(device: torch.device) -> str:
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
        if device.type == "npu":
            from fntrain.runtime.device import device_module  # torch_npu is imported only on npu

            return str(device_module("npu").get_device_name(device.index or 0))
        if device.type == "cpu":
            return _cpu_name()
    except Exception as error:  # noqa: BLE001 - metadata never fails a run
        return f"unknown ({error!r})"
    return device.type


def _this_rank(runtime: Runtime) -> dict[str, Any]:
    return {
        "rank": runtime.rank,
        "local_rank": runtime.local_rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(runtime.device),
        "device_name": _device_name(runtime.device),
    }


def _versions() -> dict[str, Any]:
    import fntrain  # the package itself, for its version (a module-level import would read as a cycle)

    versions: dict[str, Any] = {
        "fntrain": getattr(fntrain, "__version__", None),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
    }
    npu = sys.modules.get("torch_npu")  # only if the runtime imported it: never imported here
    if npu is not None:
        versions["torch_npu"] = getattr(npu, "__version__", None)
    return versions


def collect_run_metadata(
    runtime: Runtime,
    *,
    ranks: Sequence[Mapping[str, Any]] | None = None,
    argv: Sequence[str] | None = None,
    config_file: str | None = "config.json",
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The metadata of this launch as a JSON-ready dict (see the module docstring). `ranks`: every
    rank's entry (default: this rank's alone); `argv` defaults to `sys.argv`."""
    import fntrain  # the package itself, for its source directory (see _versions)

    now = time.time()
    ranks = list(ranks) if ranks is not None else [_this_rank(runtime)]
    cwd = os.getcwd()
    git = git_state(cwd)
    source = git_state(Path(fntrain.__file__).resolve().parent)
    metadata: dict[str, Any] = {
        "command": {
            "argv": list(sys.argv if argv is None else argv),
            "executable": sys.executable,
            "cwd": cwd,
            "launcher": {name: os.environ[name] for name in _LAUNCH_ENV if name in os.environ},
        },
        "config_file": config_file,
        "versions": _versions(),
        "world_size": runtime.world_size,
        "backend": runtime.backend,
        "parallel": {
            "mode": runtime.parallel_mode,
            **{f"{name}_size": getattr(runtime, f"{name}_size") for name in ("dp", "tp", "pp", "cp", "ep")},
        },
        "device_type": runtime.device.type,
        "hostname": socket.gethostname(),
        "hosts": sorted({str(entry.get("hostname")) for entry in ranks}),
        "ranks": ranks,
        "start_time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
        "start_timestamp": now,
        "restart_count": runtime.restart_count,
        "seed": runtime.seed,
        "start_state": None,
        "git": git,
    }
    if source is not None and (git is None or source["root"] != git["root"]):
        metadata["fntrain_git"] = source
    if extra:
        metadata.update(extra)
    return metadata


def _launch_summary(metadata: Mapping[str, Any]) -> dict[str, Any]:
    git = metadata.get("git") or {}
    start = metadata.get("start_state") or {}
    return {
        "start_time": metadata.get("start_time"),
        "restart_count": metadata.get("restart_count"),
        "hostname": metadata.get("hostname"),
        "world_size": metadata.get("world_size"),
        "start_step": start.get("global_step"),
        "git_commit": git.get("commit"),
    }


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, metadata: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(metadata, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def write_run_metadata(
    run_dir: str | os.PathLike,
    runtime: Runtime,
    *,
    argv: Sequence[str] | None = None,
    config_file: str | None = "config.json",
    extra: Mapping[str, Any] | None = None,
) -> Path | None:
    """Gather every rank's entry (a collective when a process group exists: call it on every rank)
    and write `<run_dir>/run_metadata.json` on rank 0; return its path there, None elsewhere. A
    failure to write is logged, never raised."""
    own = _this_rank(runtime)
    ranks: list[Any] = [own]
    if runtime.world_size > 1 and dist.is_available() and dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, own)
    if runtime.rank != 0:
        return None
    path = Path(run_dir).expanduser() / METADATA_FILE
    try:
        metadata = collect_run_metadata(runtime, ranks=ranks, argv=argv, config_file=config_file, extra=extra)
        previous = _read(path)
        launches = list(previous.get("launches", [])) if previous else []
        metadata["launches"] = (launches + [_launch_summary(metadata)])[-_HISTORY:]
        metadata["attempt"] = int(previous.get("attempt", -1)) + 1 if previous else 0
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, metadata)
    except Exception as error:  # noqa: BLE001 - metadata never fails a run
        log.warning("could not write %s: %r", path, error)
        return None
    return path


def _update(run_dir: str | os.PathLike, runtime: Runtime, change: Any) -> None:
    """Rank 0: apply `change(metadata, path)` to run_metadata.json in place (nothing when absent); a
    failure to write is logged, never raised."""
    if runtime.rank != 0:
        return
    path = Path(run_dir).expanduser() / METADATA_FILE
    metadata = _read(path)
    if metadata is None:
        return
    change(metadata, path)
    try:
        _write(path, metadata)
    except OSError as error:
        log.warning("could not update %s: %r", path, error)


def record_start(run_dir: str | os.PathLike, runtime: Runtime, state: Any) -> None:
    """Rank 0: note in run_metadata.json the TrainState this launch starts from (after a restore)."""
    start = state.as_dict() if hasattr(state, "as_dict") else dict(state)

    def change(metadata: dict[str, Any], path: Path) -> None:
        metadata["start_state"] = start
        if metadata.get("launches"):
            metadata["launches"][-1]["start_step"] = start.get("global_step")

    _update(run_dir, runtime, change)


def read_attempt(run_dir: str | os.PathLike) -> int:
    """Which launch of the run in `run_dir` this is (0 for the first; +1 per launch, restarts and
    resumes alike), as `write_run_metadata` counted it; 0 when there is no metadata."""
    metadata = _read(Path(run_dir).expanduser() / METADATA_FILE)
    return int(metadata.get("attempt", 0)) if metadata else 0


def record_outcome(run_dir: str | os.PathLike, runtime: Runtime, outcome: str, **details: Any) -> None:
    """Rank 0: note in run_metadata.json how this launch ended ("completed", "preempted", "failed
    before training", ...) with `details` (final state, error, allowed config changes, exports)."""

    def change(metadata: dict[str, Any], path: Path) -> None:
        metadata["outcome"] = outcome
        metadata["end_time"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        metadata.update(details)
        if metadata.get("config_file") and not (path.parent / metadata["config_file"]).is_file():
            metadata["config_file"] = None  # the run failed before writing it

    _update(run_dir, runtime, change)
