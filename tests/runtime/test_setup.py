"""setup_runtime / teardown (§5) [S2] [S3]: torchrun environment, backend and timeout, mesh, seeding,
determinism, and a teardown that destroys the process group even when the barrier fails."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fntrain.runtime import device as devices
from fntrain.runtime import threads
from fntrain.runtime.launch import LaunchEnv, read_launch_env
from fntrain.runtime.mesh import coordinates, parallel_sizes
from fntrain.runtime.parallel import ParallelConfig
from fntrain.runtime.process_group import resolve_backend
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.runtime.threads import choose_cpu_threads

LAUNCH = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}


# ----------------------------------------------------------------------------- environment


def test_plain_python_run_is_not_launched():
    assert read_launch_env({}) == LaunchEnv()


def test_torchrun_environment_is_read():
    env = read_launch_env({**LAUNCH, "LOCAL_WORLD_SIZE": "2"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launched) == (
        1,
        1,
        4,
        2,
        True,
    )


def test_local_rank_defaults_to_the_rank_within_the_node():
    env = {k: v for k, v in LAUNCH.items() if k != "LOCAL_RANK"}
    assert read_launch_env({**env, "RANK": "3", "LOCAL_WORLD_SIZE": "2"}).local_rank == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0"}, "WORLD_SIZE is not set but RANK is"),
        ({**LAUNCH, "RANK": "x"}, "RANK must be an integer, got 'x'"),
        ({**LAUNCH, "RANK": "4"}, r"RANK must be in \[0, 4\), got 4"),
        ({**LAUNCH, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE must be >= 1"),
        ({k: v for k, v in LAUNCH.items() if k != "MASTER_ADDR"}, "MASTER_ADDR is not"),
    ],
)
def test_bad_launch_environment_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        read_launch_env(env)


def test_the_restart_count_is_read_once_into_the_launch_and_the_runtime(one_rank_env, monkeypatch):
    assert read_launch_env({**LAUNCH, "TORCHELASTIC_RESTART_COUNT": "2"}).restart_count == 2
    assert read_launch_env({**LAUNCH, "TORCHELASTIC_RESTART_COUNT": ""}).restart_count == 0
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT must be an integer, got 'x'"):
        read_launch_env({**LAUNCH, "TORCHELASTIC_RESTART_COUNT": "x"})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    with setup_runtime(RuntimeConfig()) as runtime:
        assert runtime.restart_count == 3


# ----------------------------------------------------------------------------- backend, sizes


def test_backend_follows_the_device():
    assert resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("auto", "cuda") == "nccl"
    assert resolve_backend("auto", "npu") == "hccl"
    assert resolve_backend("gloo", "cuda") == "gloo"
    assert resolve_backend("cuda:nccl,cpu:gloo", "cuda") == "cuda:nccl,cpu:gloo"
    with pytest.raises(ValueError, match="runtime.backend 'nccl' needs device 'cuda', got device 'cpu'"):
        resolve_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="runtime.backend 'hccl' needs device 'npu'"):
        resolve_backend("hccl", "cuda")


def test_runtime_config_validation_names_the_field():
    with pytest.raises(ValueError, match="runtime.device must be one of"):
        RuntimeConfig(device="gpu").validate()
    with pytest.raises(ValueError, match="runtime.backend must be one of"):
        RuntimeConfig(backend="mpi").validate()
    with pytest.raises(ValueError, match="runtime.timeout_s must be > 0"):
        RuntimeConfig(timeout_s=0).validate()
    with pytest.raises(TypeError, match="runtime.tf32 must be a bool"):
        RuntimeConfig(tf32=1).validate()


def test_data_parallel_size_is_what_model_parallelism_leaves():
    sizes = parallel_sizes(ParallelConfig(tp_size=2, pp_size=2), 8)
    assert sizes == {"tp_size": 2, "pp_size": 2, "cp_size": 1, "ep_size": 1, "dp_size": 2}
    assert parallel_sizes(None, 4)["dp_size"] == 4
    # rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    coords = [coordinates(rank, sizes) for rank in range(8)]
    assert [c["dp"] for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [c["tp"] for c in coords] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [c["pp"] for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="world size 6 must be divisible by .* = 4"):
        parallel_sizes(ParallelConfig(tp_size=4), 6)
    with pytest.raises(ValueError, match=r"parallel.ep_size \(3\) must divide"):
        parallel_sizes(ParallelConfig(ep_size=3), 4)


# ----------------------------------------------------------------------------- single process


def test_single_process_runtime_has_no_group(no_launch_env):
    with setup_runtime(RuntimeConfig(), ParallelConfig(strategy="none"), seed=7) as runtime:
        assert not dist.is_initialized()
        assert (runtime.rank, runtime.world_size, runtime.dp_size, runtime.dp_rank) == (0, 1, 1, 0)
        assert runtime.device == torch.device("cpu") and runtime.backend is None and runtime.mesh is None
        assert not runtime.distributed and runtime.seed == 7 and runtime.parallel_mode == "none"


def test_seed_is_applied_to_python_numpy_and_torch(no_launch_env):
    with setup_runtime(RuntimeConfig(), seed=123):
        drawn = (random.random(), np.random.rand(), torch.rand(()).item())
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    assert drawn == (random.random(), np.random.rand(), torch.rand(()).item())


def test_determinism_is_on_inside_and_restored_after(no_launch_env, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with setup_runtime(RuntimeConfig(deterministic=True)):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_cpu_runtime_never_imports_torch_npu(fake_torch_npu, no_launch_env):
    from fntrain.runtime.parallel import parallelize

    with setup_runtime(RuntimeConfig(device="cpu"), ParallelConfig()) as runtime:
        parallelize(torch.nn.Linear(2, 2), runtime, "none")
    assert "torch_npu" not in sys.modules


# ----------------------------------------------------------------------------- torchrun, 1 rank, real gloo


def test_torchrun_runtime_builds_group_and_mesh(one_rank_env):
    with setup_runtime(RuntimeConfig(timeout_s=60.0), ParallelConfig(strategy="fsdp2")) as runtime:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert runtime.distributed and runtime.backend == "gloo"
        assert runtime.mesh.mesh_dim_names == ("dp",) and runtime.mesh.size() == 1
        assert (runtime.dp_size, runtime.dp_rank, runtime.parallel_mode) == (1, 0, "fsdp2")
    assert not dist.is_initialized()


def test_teardown_synchronizes_then_barriers_then_destroys(one_rank_env, monkeypatch):
    calls = []
    monkeypatch.setattr(devices, "synchronize", lambda device: calls.append("synchronize"))
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (calls.append("barrier"), real_barrier())[1])
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(
        dist, "destroy_process_group", lambda *a: (calls.append("destroy"), real_destroy())[1]
    )
    with setup_runtime(RuntimeConfig()):
        pass
    assert calls == ["synchronize", "barrier", "destroy"]
    assert not dist.is_initialized()


def test_teardown_destroys_the_group_when_the_barrier_fails(one_rank_env, monkeypatch):
    def broken_barrier(*args, **kwargs):
        raise RuntimeError("barrier failed: peer gone")

    monkeypatch.setattr(dist, "barrier", broken_barrier)
    with pytest.raises(RuntimeError, match="barrier failed: peer gone"):
        with setup_runtime(RuntimeConfig()):
            assert dist.is_initialized()
    assert not dist.is_initialized()
    assert not torch.are_deterministic_algorithms_enabled()


def test_failure_inside_skips_the_barrier_and_keeps_the_original_exception(one_rank_env, monkeypatch):
    barrier_calls = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barrier_calls.append(1))
    monkeypatch.setattr(dist, "destroy_process_group", _failing_destroy(dist.destroy_process_group))
    original = KeyError("from the training loop")
    with pytest.raises(KeyError) as raised:
        with setup_runtime(RuntimeConfig()):
            raise original
    assert raised.value is original
    assert barrier_calls == []  # peers may be stuck elsewhere: no barrier on the failure path
    assert not dist.is_initialized()


def _failing_destroy(real):
    def destroy(*args):
        real()
        raise RuntimeError("destroy hiccup")  # logged, must not replace the original exception

    return destroy


def test_an_existing_group_is_reused_and_left_alone(one_rank_env):
    dist.init_process_group("gloo")
    with setup_runtime(RuntimeConfig()) as runtime:
        assert runtime.distributed and runtime.world_size == 1
    assert dist.is_initialized()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- CPU threads


def test_cpu_threads_given_explicitly_win():
    assert choose_cpu_threads(3, env={"OMP_NUM_THREADS": "8"}, available_cores=16) == 3


def test_cpu_threads_follow_omp_num_threads_when_set():
    assert choose_cpu_threads(0, env={"OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "2"}, available_cores=16) == 5


def test_cpu_threads_split_the_available_cores_between_local_ranks():
    assert choose_cpu_threads(0, env={}, available_cores=16) == 16
    assert choose_cpu_threads(0, env={"LOCAL_WORLD_SIZE": "4"}, available_cores=16) == 4
    assert choose_cpu_threads(0, env={"LOCAL_WORLD_SIZE": "8", "OMP_NUM_THREADS": ""}, available_cores=2) == 1


def test_cpu_threads_config_is_validated():
    with pytest.raises(ValueError, match="runtime.cpu_threads"):
        RuntimeConfig(cpu_threads=-1).validate()


def test_setup_runtime_applies_the_thread_choice_and_restores_it(no_launch_env, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    wanted = 1 if before != 1 else 2
    with setup_runtime(RuntimeConfig(cpu_threads=wanted)):
        assert torch.get_num_threads() == wanted
    assert torch.get_num_threads() == before
    monkeypatch.setattr(threads, "_available_cores", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with setup_runtime(RuntimeConfig()):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == before
