"""The README's complete custom recipe runs as written (`fntrain run FILE.py`), so the docs stay true."""

from __future__ import annotations

import re
from pathlib import Path

from fntrain.cli import dispatch

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_recipe_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A recipe is a spec", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "my_recipe.py"
    path.write_text(code)
    result = dispatch(["run", str(path), "--run-dir", str(tmp_path / "run"), "--train.train-iters", "3",
                       "--progress.no-enabled", "--log-every", "1"])  # fmt: skip
    assert (result.outcome, result.state.global_step) == ("completed", 3)
    assert (tmp_path / "run" / "model.safetensors").is_file()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"loss"' in line]) == 3
