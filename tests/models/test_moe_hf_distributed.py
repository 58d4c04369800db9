"""Expert parallelism for a Hugging Face MoE model through hf_causal_lm under torchrun (gloo, CPU): a
tiny Qwen3-MoE (4 experts, router loss on) at `--parallel.strategy fsdp2 --parallel.ep-size 2` on 2
ranks trains as fsdp2 at ep 1 on 2 ranks and as one process do: the same losses over 4 steps and the
same exported weights, every expert at its global index; its checkpoint resumes at ep 1
(fntrain.models.moe_hf_ep). SGD with momentum throughout, so the checkpoint carries optimizer state: the
one ep 2 run serves both tests, and every launch forks from one process that imported torch and
transformers (a launch's imports cost more than these steps)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.fork_server import HF_PRELOAD, started
from tests.helpers.hf import save_tiny_llama
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-layer Qwen3-MoE with the BPE tokenizer of tests/helpers/hf.py, and a text JSONL."""
    root = tmp_path_factory.mktemp("hf_moe")
    text = (ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_text()[:20_000]
    lines = [line for line in text.splitlines() if line.strip()]
    model_dir = save_tiny_llama(root / "model", lines, vocab_size=320, max_positions=64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.1, max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(model_dir)  # replaces the Llama
    data_path = root / "text.jsonl"
    data_path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:32]))
    return model_dir, data_path


# What the launches import, once (tests/helpers/fork_server.py's server): each launch, torchrun's agent and its
# workers fork from it instead of importing torch and transformers again.
PRELOAD = (*HF_PRELOAD, "transformers.models.qwen3_moe.modeling_qwen3_moe", "fntrain.models.moe_hf_ep")


@pytest.fixture(scope="module")
def moe_hf_launch_env():
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with started(env, PRELOAD) as launch:
        yield launch


def train_moe(env: dict, tiny_moe: tuple[Path, Path], run_dir: Path, ranks: int, *layout: str) -> tuple[list, dict]:
    """4 steps of SGD with momentum of hf_causal_lm (this checkout's); the logged losses and the exported
    weights."""
    from safetensors.torch import load_file

    model_dir, data_path = tiny_moe
    torchrun = ["torchrun", "--standalone", f"--nproc_per_node={ranks}"]
    command = [
        *(torchrun if ranks > 1 else [env["PYTHON_FORK"]]), "-m", "recipes.hf_causal_lm",
        "--run-dir", str(run_dir),
        "--model.path", str(model_dir), "--data.path", str(data_path), "--data.max-length", "32",
        "--train.train-iters", "4", "--train.global-batch-size", "4", "--train.micro-batch-size", "1",
        "--optim.name", "sgd", "--optim.lr", "0.1", "--optim.momentum", "0.9", "--log-every", "1",
        "--progress.no-enabled", *layout,
    ]  # fmt: skip
    what = f"the MoE hf_causal_lm run on {ranks} rank(s) with {' '.join(layout) or 'no parallel flags'}"
    result = run_to_end(command, what, 280, cwd=ROOT, env=env)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row], load_file(
        run_dir / "hf_model" / "model.safetensors"
    )


EP2 = ["--parallel.strategy", "fsdp2", "--parallel.ep-size", "2"]
SAVE = ["--checkpoint.save-every", "2", "--checkpoint.restore-from", "latest"]


@pytest.fixture(scope="module")
def moe_hf_ep2_run(moe_hf_launch_env, tiny_moe, tmp_path_factory) -> tuple[Path, list[float], dict]:
    """The ep 2 run under FSDP2 on 2 ranks, saving every 2 steps: its directory, losses and weights."""
    run_dir = tmp_path_factory.mktemp("ep2")
    return run_dir, *train_moe(moe_hf_launch_env, tiny_moe, run_dir, 2, *EP2, *SAVE)


def test_ep2_under_fsdp2_trains_like_ep1_and_one_process(moe_hf_launch_env, tiny_moe, moe_hf_ep2_run, tmp_path):
    one_losses, one_weights = train_moe(moe_hf_launch_env, tiny_moe, tmp_path / "one", 1)
    fsdp_losses, _ = train_moe(moe_hf_launch_env, tiny_moe, tmp_path / "fsdp2", 2, "--parallel.strategy", "fsdp2")
    _, ep_losses, ep_weights = moe_hf_ep2_run
    assert len(one_losses) == 4 and one_losses[-1] < one_losses[0]
    assert ep_losses == pytest.approx(fsdp_losses, rel=1e-5)
    assert ep_losses == pytest.approx(one_losses, rel=1e-5)
    # Exported whole (transformers saves one tensor per expert): every expert, at its global index.
    assert all(
        ep_weights[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].shape == (16, 32) for e in range(4)
    )
    assert ep_weights.keys() == one_weights.keys()
    for key in one_weights:
        torch.testing.assert_close(ep_weights[key], one_weights[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_checkpoint_saved_at_ep2_resumes_in_one_process(moe_hf_launch_env, tiny_moe, moe_hf_ep2_run, tmp_path):
    """Step 2's checkpoint of the ep 2 run (experts DTensors over the ep mesh, SGD momentum) resumed by
    one process: steps 3-4 log the uninterrupted run's losses, and the exported weights are its."""
    import shutil

    reference, want_losses, want_weights = moe_hf_ep2_run
    resumed = tmp_path / "resumed"
    shutil.copytree(reference / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    (resumed / "checkpoints" / "latest").write_text("step_2\n")
    allow = ["--checkpoint.allow-changes", "parallel.ep_size", "parallel.strategy"]
    got_losses, got_weights = train_moe(moe_hf_launch_env, tiny_moe, resumed, 1, *SAVE, *allow)
    assert len(got_losses) == 2
    assert got_losses == pytest.approx(want_losses[2:], rel=1e-5)
    for key in want_weights:
        torch.testing.assert_close(got_weights[key], want_weights[key], rtol=1e-5, atol=1e-6, msg=key)
