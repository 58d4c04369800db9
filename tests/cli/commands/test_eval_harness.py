"""`fntrain eval` through lm-eval (slow tier: lm-eval's imports take seconds). One test runs lm-eval's
own command line and `fntrain eval` on the same tiny Llama directory and local multiple-choice task,
and pins that both give the same accuracy and the same per-sample log-likelihoods; the same test then
evaluates a tiny-GPT run directory made with relative paths from another directory (its byte-level
tokenizer), runs lm-eval's own command line on that run's hf_model export (which carries the tokenizer)
with the same log-likelihoods, and checks the bad inputs that need lm-eval's task index.

Both sides index only the tasks of --include-path (lm-eval's TaskManager with include_defaults=False,
in this process and in lm-eval's command line): the thousands of tasks lm-eval ships cost ~16 s of CPU
to index per process and play no part in a local task's numbers or in an unknown name's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fntrain.checkpoint.hf_load import OFFLINE_SWITCHES
from fntrain.cli import dispatch
from fntrain.models import harness
from tests.helpers.commands import eval_refusal
from tests.helpers.waiting import run_to_end, wait_for_end

pytestmark = [pytest.mark.slow, pytest.mark.skipif(harness.importlib.util.find_spec("lm_eval") is None,
                                                   reason="needs the eval extra")]  # fmt: skip

SMALL = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.d-model", "16", "--model.context", "32",
    "--train.train-iters", "2", "--train.global-batch-size", "4", "--train.micro-batch-size", "4",
    "--progress.no-enabled", "--log-every", "1", "--checkpoint.save-every", "1",
]  # fmt: skip


def _task(tasks: Path, name: str, data: Path) -> None:
    """A multiple-choice task over a local JSONL file: question, three choices, the gold index."""
    (tasks / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{q}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n'
    )


def _samples(path: Path) -> list[list[float]]:
    """Per document, the log-likelihood of each choice (lm-eval's CLI writes them as strings)."""
    return [
        [float(ll) for ll, _ in json.loads(line)["filtered_resps"]] for line in path.read_text().splitlines()
    ]


# lm-eval's command line (`python -m lm_eval ...`) with its TaskManager limited to --include_path's tasks.
LM_EVAL_OWN_TASKS_ONLY = """
import lm_eval.tasks as tasks
class OwnTasksOnly(tasks.TaskManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "include_defaults": False})
tasks.TaskManager = OwnTasksOnly
from lm_eval.__main__ import cli_evaluate
cli_evaluate()
"""


def _index_own_tasks_only(monkeypatch) -> None:
    """fntrain's harness.task_manager, as written, over a TaskManager that skips lm-eval's own tasks."""
    harness.set_offline()  # as harness.task_manager does before lm-eval imports datasets
    import lm_eval.tasks

    class OwnTasksOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", OwnTasksOnly)


def test_fntrain_eval_gives_lm_evals_own_results(tmp_path, capsys, monkeypatch):
    from tests.helpers.hf import save_tiny_llama

    lines = ["the cat sat on the mat", "a dog runs fast", "one plus one is two", "birds fly high"] * 4
    model = save_tiny_llama(tmp_path / "llama", lines, vocab_size=300, max_positions=64)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "tiny_mc.jsonl"
    items = [{"q": f"what is {i} plus one?", "choices": [str(i + 1), str(i + 2), "the cat"], "gold": i % 3}
             for i in range(8)]  # fmt: skip
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    _task(tasks, "tiny_mc", data)
    _task(tasks, "tiny_gone", tmp_path / "gone.jsonl")

    # lm-eval's own command line on the directory, in a process of its own while fntrain eval runs here
    env = {**os.environ, **OFFLINE_SWITCHES}
    theirs = tmp_path / "theirs"
    log = (tmp_path / "lm_eval.log").open("wb")  # a file, not a pipe: its progress bars would fill one
    lm_eval_cli = subprocess.Popen([sys.executable, "-c", LM_EVAL_OWN_TASKS_ONLY, "--model", "hf", "--model_args",
                                    f"pretrained={model}", "--tasks", "tiny_mc", "--include_path", str(tasks),
                                    "--device", "cpu", "--batch_size", "1", "--output_path", str(theirs),
                                    "--log_samples"], env=env, stdout=subprocess.DEVNULL, stderr=log)  # fmt: skip

    # fntrain eval, its task index over --include-path's tasks alone
    _index_own_tasks_only(monkeypatch)
    ours = tmp_path / "ours"
    results = dispatch(["eval", str(model), "--tasks", "tiny_mc", "--include-path", str(tasks), "--device", "cpu",
                        "--output", str(ours)])  # fmt: skip
    out = capsys.readouterr().out
    (written,) = ours.iterdir()
    wait_for_end(lm_eval_cli, "the lm-eval CLI on the tiny Llama", 600, (tmp_path / "lm_eval.log").read_text)
    assert lm_eval_cli.returncode == 0, (tmp_path / "lm_eval.log").read_text()[-2000:]
    log.close()
    their_results = json.loads(next(theirs.rglob("results_*.json")).read_text())["results"]["tiny_mc"]
    their_samples = _samples(next(theirs.rglob("samples_tiny_mc_*.jsonl")))
    assert results["results"]["tiny_mc"]["acc,none"] == their_results["acc,none"]
    assert _samples(written / "samples_tiny_mc.jsonl") == their_samples
    assert (
        json.loads((written / "results.json").read_text())["results"]["tiny_mc"]["acc,none"]
        == their_results["acc,none"]
    )
    assert (written / "table.txt").read_text().splitlines()[1].split()[:2] == ["tiny_mc", "acc"]
    assert (written / "table.txt").read_text() in out

    # bad tasks: one line, before the model, nothing written
    include = ["--include-path", str(tasks), "--output", str(tmp_path / "bad")]
    assert eval_refusal([str(model), "--tasks", "tiny_mc,nope", *include], capsys) == (
        "fntrain eval: --tasks: unknown task 'nope' (see lm-eval --tasks list)")  # fmt: skip
    assert eval_refusal([str(model), "--tasks", "tiny_gone", *include], capsys) == (
        f"fntrain eval: task 'tiny_gone' needs the data file '{tmp_path / 'gone.jsonl'}' (nothing is downloaded): "
        "provide it")  # fmt: skip
    assert not (tmp_path / "bad").exists()

    # a tiny-GPT run directory made with relative paths (its token shards too), evaluated from another
    # directory: its latest checkpoint, exported to a GPT-2 with its byte-level tokenizer (the shards' EOS)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "corpus.txt").write_text("the cat sat on the mat. one plus one is two.\n" * 40)
    dispatch(["tokenize", "corpus.txt", "--output", "shards"])
    dispatch(["run", "tiny_gpt", "--run-dir", "run", "--data.shards", "shards", *SMALL])
    monkeypatch.chdir(tmp_path)
    run_dir = work / "run"
    capsys.readouterr()
    results = dispatch(["eval", "work/run", "--tasks", "tiny_mc", "--include-path", str(tasks), "--device", "cpu",
                        "--limit", "4"])  # fmt: skip
    capsys.readouterr()
    (written,) = (run_dir / "eval").iterdir()
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
    assert len((written / "samples_tiny_mc.jsonl").read_text().splitlines()) == 4
    assert {p.name for p in written.iterdir()} == {"results.json", "samples_tiny_mc.jsonl", "table.txt"}

    # the run's own export carries that tokenizer: lm-eval's command line takes it as it is, with the same
    # log-likelihoods (it holds the step-2 weights the latest checkpoint holds)
    theirs = tmp_path / "theirs_gpt"
    cli = run_to_end([sys.executable, "-c", LM_EVAL_OWN_TASKS_ONLY, "--model", "hf", "--model_args",
                      f"pretrained={run_dir / 'hf_model'}", "--tasks", "tiny_mc", "--include_path", str(tasks),
                      "--device", "cpu", "--batch_size", "1", "--limit", "4", "--output_path", str(theirs),
                      "--log_samples"], "the lm-eval CLI on the tiny GPT's export", 600, env=env)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert _samples(next(theirs.rglob("samples_tiny_mc_*.jsonl"))) == _samples(written / "samples_tiny_mc.jsonl")

    # a damaged checkpoint named by path: the verified-checkpoint line
    step = run_dir / "checkpoints" / "step_2"
    victim = max(step.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-8])
    err = eval_refusal([str(step), "--tasks", "tiny_mc", *include], capsys)
    assert "step_2" in err and victim.name in err, err
    assert len(list((run_dir / "eval").iterdir())) == 1 and not (tmp_path / "bad").exists()
