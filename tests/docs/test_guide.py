"""docs/guide.md's commands, as written, at a tiny scale on CPU (slow tier): a tiny Llama built from a
config and saved with save_pretrained, generated Parquet files for $DATA and $CORPUS, torchrun with 2
processes over gloo. What the test changes is listed in REWRITES and SMALL: the process count, a
standalone rendezvous (no fixed port), the CPU device and a run of a few tiny steps; the multi-node line
is planned at its world size (16) instead of run. Then it checks what each step promises: the plan, the
checkpoints and hf_model of the run, the resumed extension, the export, and transformers loading it.
The `fntrain` and `torchrun` the lines find on PATH (and torchrun's workers) fork from one process that
imported torch and transformers once (tests/helpers/fork_server.py): each is its own process all the same.

tests/docs/test_doc_commands.py runs every other document's lines and leaves docs/guide.md to this test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.test_doc_commands import activated
from tests.helpers.fork_server import HF_PRELOAD, started
from tests.helpers.hf import CHATS, save_tiny_llama
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
SMALL = ("--runtime.device cpu --parallel.mixed-precision fp32 --data.max-length 64 --train.global-batch-size 16 "
         "--train.micro-batch-size 1 --schedule.warmup-iters 1 --evaluate.eval-every 2 --checkpoint.save-every 2 "
         "--log-every 1 --progress.no-enabled")  # fmt: skip
TINY_ITERS = "--train.train-iters 4"  # unless the command sets its own (rewritten below)
REWRITES = {
    "torchrun --nproc_per_node 8": "torchrun --standalone --nproc_per_node 2",
    "--train.train-iters 2500": "--train.train-iters 6",
    "--workers 8": "--workers 2",
}


def guide_blocks(language: str) -> list[str]:
    """The guide's fenced code blocks of `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", GUIDE.read_text(), re.S | re.M)


def guide_commands() -> list[str]:
    """Every shell command of the guide, in order, without installs and variable assignments."""
    commands = []
    for block in guide_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith(("#", "pip ")) and not re.match(r"^[A-Z_]+=", line):
                commands.append(line)
    return commands


def tiny_command(command: str) -> str:
    """`command` at the test's scale (see the module docstring)."""
    if command.startswith("torchrun --nnodes"):  # several nodes cannot run here: plan that world
        nodes, per_node = (
            int(re.search(rf"--{flag} (\d+)", command).group(1)) for flag in ("nnodes", "nproc_per_node")
        )
        command = (
            "fntrain plan " + command.split(" -m fntrain run ", 1)[1] + f" --world-size {nodes * per_node}"
        )
    for old, new in REWRITES.items():
        command = command.replace(old, new)
    if " hf_causal_lm " in command:
        command += " " + SMALL + ("" if "--train.train-iters" in command else " " + TINY_ITERS)
    return command


def _corpora(tmp: Path) -> tuple[Path, Path]:
    """$DATA (chat rows in a `messages` column) and $CORPUS (a `text` column) as Parquet files."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    chats = [[{"role": turn["role"], "content": f"{turn['content']} {index}"} for turn in CHATS[index % 2]]
             for index in range(200)]  # fmt: skip
    pq.write_table(pa.table({"messages": chats}), tmp / "sft.parquet")
    texts = [
        f"Document {index}: {CHATS[index % 2][-1]['content']} and so on, line {index}."
        for index in range(1000)
    ]
    pq.write_table(pa.table({"text": texts}), tmp / "corpus.parquet")
    return tmp / "sft.parquet", tmp / "corpus.parquet"


def run_in_bash(command: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return run_to_end(["bash", "-c", command], f"the guide's command `{command}`", 600, cwd=cwd, env=env)


def test_the_guide_commands_are_the_ones_this_test_runs():
    commands = guide_commands()
    assert [command.split()[:2] for command in commands] == [
        ["fntrain", "plan"], ["torchrun", "--nproc_per_node"], ["torchrun", "--nnodes"],
        ["torchrun", "--nproc_per_node"], ["fntrain", "export"], ["torchrun", "--nproc_per_node"],
        ["fntrain", "tokenize"], ["torchrun", "--nproc_per_node"],
    ], "the guide changed: update the checks of test_the_guide_runs_at_a_tiny_scale"  # fmt: skip
    assert tiny_command(commands[2]).startswith(
        "fntrain plan hf_causal_lm --config configs/llama-3.2-1b-sft.toml"
    )
    assert tiny_command(commands[2]).endswith("--world-size 16 " + SMALL + " " + TINY_ITERS)
    assert len(guide_blocks("python")) == 1


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_guide_runs_at_a_tiny_scale(tmp_path):
    pytest.importorskip("transformers")
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("torchrun not installed")
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    data, corpus = _corpora(tmp_path)
    lines = [turn["content"] for chat in CHATS for turn in chat] * 4
    model = save_tiny_llama(tmp_path / "Llama-3.2-1B", lines, vocab_size=300, max_positions=128)
    # the shell the README's set-up leaves, its venv activated (tests/docs/test_doc_commands.py's `activated`)
    env = {**activated(os.environ), "OMP_NUM_THREADS": "1", "MODEL": str(model), "DATA": str(data),
           "CORPUS": str(corpus)}  # fmt: skip
    commands = [tiny_command(command) for command in guide_commands()]
    with started(env, HF_PRELOAD) as launch_env:
        _run_the_guide(commands, work, launch_env, env)


def _run_the_guide(commands: list[str], work: Path, launch_env: dict, env: dict) -> None:
    """The guide's lines (through the shared start-up: `launch_env`) and the checks of what each promises;
    its Python block in a fresh interpreter (`env`)."""
    outputs = []
    for command in commands[:6]:  # plan, train, plan 2 nodes, extend, export, CPT on the Parquet corpus
        result = run_in_bash(command, work, launch_env)
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        outputs.append(result.stdout + result.stderr)
    run = work / "runs" / "llama-3.2-1b-sft"
    assert "world size          8 (data-parallel 8)" in outputs[0]
    assert "world size          16 (data-parallel 16)" in outputs[2]
    assert (run / "checkpoints" / "step_4").is_dir() and (run / "checkpoints" / "step_6").is_dir()
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [int(re.search(r'"step": (\d+)', line).group(1)) for line in steps] == [1, 2, 3, 4, 5, 6]
    assert (run / "hf_model" / "config.json").is_file() and (
        work / "llama-1b-sft-hf" / "config.json"
    ).is_file()
    loaded = run_to_end([sys.executable, "-c", guide_blocks("python")[0]], "the guide's Python block", 300,
                        cwd=work, env=env)  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-3000:]  # generated a reply from the exported model
    assert (work / "runs" / "llama-3.2-1b-cpt" / "hf_model" / "config.json").is_file()
    shutil.rmtree(work / "runs" / "llama-3.2-1b-cpt")
    for command in commands[6:]:  # tokenize the Parquet corpus, then train on its shards
        result = run_in_bash(command, work, launch_env)
        assert result.returncode == 0, f"{command}\n{result.stderr[-4000:]}"
