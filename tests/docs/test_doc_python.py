"""Every Python block of README.md and docs/*.md runs as a user pastes it: each block is named in HOW with
the way it runs (here, or by the test named there), so a new block fails here until it says how it is run.

- `exec`: run here in the default tier (definitions a user pastes and builds on);
- `python`: run here as `python -c BLOCK` in an empty directory (slow tier), its printed loss falling;
- `torchrun`: saved as a script and run by `torchrun --standalone --nproc_per_node 2` (slow tier);
- a test file's name: that test runs the block (tests/docs/test_readme.py the README's recipe, tests/docs/test_guide.py
  the guide's loading script).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.docs.test_doc_commands import DOCS, ROOT, activated
from tests.helpers.waiting import run_to_end

# (document, a line of the block that tells it apart, how it runs)
HOW = (
    ("README.md", "spec = RecipeSpec(", "tests/docs/test_readme.py"),
    ("README.md", "model = TinyGPT(ModelConfig(n_layer=2, d_model=64))", "python"),
    ("README.md", "hooks = [every(10, print_loss), on(Event.EPOCH_END", "exec"),
    (
        "docs/distributed.md",
        'parallel = ParallelConfig(strategy="fsdp2", mixed_precision="bf16")',
        "torchrun",
    ),
    ("docs/guide.md", "AutoModelForCausalLM.from_pretrained", "tests/docs/test_guide.py"),
)


def python_blocks() -> list[tuple[str, str]]:
    """(document, code) for every ```python block of README.md and docs/*.md, in order."""
    return [(str(path.relative_to(ROOT)), code) for path in DOCS
            for code in re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)]  # fmt: skip


def block(document: str, marker: str) -> str:
    return next(code for name, code in python_blocks() if name == document and marker in code)


def test_every_python_block_says_how_it_runs():
    for document, code in python_blocks():
        ways = [how for name, marker, how in HOW if name == document and marker in code]
        assert len(ways) == 1, f"{document}: a Python block HOW does not name once:\n{code[:300]}"
        assert ways[0] in ("exec", "python", "torchrun") or (ROOT / ways[0]).is_file()
    assert len(python_blocks()) == len(HOW)


def test_the_hooks_block_runs_as_written():
    from fntrain import Event, TrainState

    names: dict = {}
    exec(block("README.md", "hooks = [every(10"), names)  # noqa: S102 - the README's own text
    assert len(names["hooks"]) == 2 and all(map(callable, names["hooks"]))
    names["hooks"][1](Event.EPOCH_END, TrainState(epoch=0), None)


def activated_env() -> dict[str, str]:
    return {**activated(os.environ), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_the_readme_loop_of_your_own_runs_as_written_and_learns(tmp_path):
    loop = block("README.md", "model = TinyGPT(")
    result = run_to_end([sys.executable, "-c", loop], "the README's own loop", 300, cwd=tmp_path, env=activated_env())
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.split()[1]) for line in result.stdout.splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0, losses  # about 4.3 -> 2.8, as the text says


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_own_script_of_distributed_md_runs_under_torchrun(tmp_path):
    script = tmp_path / "my_loop.py"
    script.write_text(block("docs/distributed.md", "ParallelConfig(strategy="))
    torchrun = Path(sys.executable).parent / "torchrun"
    result = run_to_end([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script)],
                        "distributed.md's own script on 2 ranks (torchrun)", 540, cwd=tmp_path, env=activated_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(re.findall(r"rank \d: completed at step 10", result.stdout)) == [
        "rank 0: completed at step 10", "rank 1: completed at step 10"]  # fmt: skip
