"""The README's complete custom recipe runs as written (`fntrain run FILE.py`), and its printout of the main
job is what the job prints, so the docs stay true."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fntrain.cli import dispatch

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_readme_printout_of_the_main_job_is_what_it_prints(tmp_path):
    """The README's example output: each line from the logger that prints it, and the summary line as
    `summary_line` writes it from the metrics lines above it (the wall time elided): its loss is the last
    metrics line's `loss`, not `loss_last`, named as the mean of the steps that line covers."""
    from fntrain.hooks import metrics_log, sample
    from fntrain.run import build, finish
    from tests.run.test_launch import launch_config

    readme = (ROOT / "README.md").read_text()
    printed = readme.split("It prints what is about to run", 1)[1].split("```", 2)[1].strip().splitlines()
    lines = dict(re.match(r"\.\.\. (\S+) INFO (\S+)", line).groups()[::-1] for line in printed)
    assert {lines["model:"], lines["world:"], lines["plan:"]} == {build.log.name}
    assert (lines["step=400"], lines["sample"], lines["run"]) == (metrics_log.log.name, sample.log.name,
                                                                   finish.log.name)  # fmt: skip
    figures = dict(re.findall(r"(\w+)=([\d.e+-]+)", " ".join(line for line in printed if "step=400" in line)))
    run = launch_config(tmp_path)
    Path(run.run_dir).mkdir()
    (Path(run.run_dir) / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in (
        {"step": 390, "loss": 2.1, "consumed_tokens": 1584960},
        {"step": 400, "loss": float(figures["loss"]), "loss_last": float(figures["loss_last"]),
         "consumed_tokens": int(figures["consumed_tokens"])},
        {"step": 400, "val_loss": float(figures["val_loss"])})))  # fmt: skip
    summary = finish.summary_line(
        run, "completed", 400, 1.0, exported=["runs/tiny/hf_model", "runs/tiny/model.safetensors"]
    )
    assert printed[-1].split(" INFO ", 1)[1] == summary.replace("; 1.0 s;", "; ... s;")
