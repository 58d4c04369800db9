"""Every shell command in README.md and docs/*.md works as written, in the order written.

The commands are extracted from the ```bash blocks (continuation lines joined, comments dropped, `&&`
chains split) and each one gets a way to be checked:

- default tier: every command is extracted and has a check (no `python -m recipes.*` left);
- slow tier, planned: every `fntrain run`, `fntrain run --nproc-per-node N` and `torchrun ... -m fntrain
  run` command is planned with its own arguments at its own world size (`fntrain plan`: every flag
  parsed, every value and the batch shape over the ranks checked, no weights, no device), and the cheap
  ones (`fntrain plan`, `config`, `cp`, `tokenize`, `--version`, `--help`) run as written;
- slow tier, run: as a user pastes them. Each document gets ONE fresh working directory and its
  commands run there through bash, top to bottom, each seeing what the lines above it left (a run
  directory, a `base.toml`, a copied recipe, shards): a second run into a run directory that holds one,
  a file no line made, a checkpoint the run above did not save all fail here. Only the scale is the
  test's: `tiny()` appends small overrides (run lengths, checkpoint cadences and `step_<N>` paths divided
  by 25, a small batch and model unless the line names its own), the same to every line, so the lines
  of a document still agree on their settings. A run line that trains nothing ("run already complete")
  fails too unless it names `--checkpoint.restore-from` (then resuming is its point): it means the line
  needs its own `--run-dir`;
- NOT_HERE lists, with the reason, what cannot run here at all (installs, GPUs, NPUs, several nodes);
  what docs/guide.md shows is run, in order, by tests/test_guide.py.

The fixtures (FIXTURES below: `write_fixtures`) are the user's own inputs the docs name, never a file a
doc line makes: `~/models/Llama-3.2-1B` (HOME points into the working directory) is a model's
config.json-only directory, `./my-llama` a tiny Llama, the corpora small text, JSONL, Parquet and
`save_to_disk` sources.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = ("bash", "sh", "shell")
HELP = ("-h", "--help", "--help-all")
# A command matching one of these cannot run on this machine: (pattern, reason).
NOT_HERE = (
    (
        r"^(python3? -m venv|\. \.venv/bin/activate|pip |\.venv/bin/pip )",
        "installs packages (CI runs the install lines)",
    ),
    (r"^\.venv/bin/python -m pytest", "the test suite itself"),
    (r"^\.venv/bin/python -m coverage", "the test suite itself, under coverage"),
    (r"^python -c .import torch", "asks a GPU or NPU driver"),
    (
        r"^fntrain eval ",
        "lm-eval's task index alone takes tens of seconds; tests/test_eval_harness.py runs it",
    ),
)
GPU_OR_NODES = (  # 8 ranks: a GPU machine's line
    r"--runtime\.device[ =](cuda|npu)|--nnodes|^(torchrun|fntrain run) --nproc[_-]per[_-]node[ =]8 "
)


@dataclass(frozen=True)
class DocCommand:
    """One command of a doc: where it is and its text (no comment, one part of an `&&` chain)."""

    file: str
    line: int
    text: str

    @property
    def argv(self) -> list[str]:
        """The words; `.venv/bin/fntrain` (the README's first line) is the `fntrain` on the PATH."""
        words = shlex.split(self.text)
        return ["fntrain", *words[1:]] if words[0].endswith("/fntrain") else words


def doc_commands(paths=DOCS) -> list[DocCommand]:
    """The shell commands of the fenced shell blocks of `paths`, in order."""
    found = []
    for path in paths:
        language, start, pending = None, 0, ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                language = None if language is not None else line[3:].strip() or "text"
                continue
            if language not in SHELL_LANGUAGES:
                continue
            start = start if pending else number
            pending += line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            words = shlex.split(pending, comments=True)
            pending = ""
            for part in " ".join(
                shlex.quote(word) if word not in ("&&", ">") else word for word in words
            ).split(" && "):
                if part.strip():
                    found.append(DocCommand(str(path.relative_to(ROOT)), start, part.strip()))
    return found


def _world_size(argv: list[str]) -> int:
    """nnodes x nproc-per-node of a torchrun or launcher command line (either spelling of the flags)."""
    sizes = {"nnodes": 1, "nproc_per_node": 1}
    for index, word in enumerate(argv):
        name, _, value = word[2:].replace("-", "_").partition("=") if word.startswith("--") else ("", "", "")
        if name in sizes:
            sizes[name] = int(value or argv[index + 1])
    return sizes["nnodes"] * sizes["nproc_per_node"]


def is_launcher(argv: list[str]) -> bool:
    """`fntrain run --nproc-per-node N ... RECIPE ...`: torchrun's options before the recipe."""
    return (
        argv[:2] == ["fntrain", "run"] and len(argv) > 2 and argv[2].startswith("--") and argv[2] not in HELP
    )


def plan_argv(command: DocCommand) -> list[str] | None:
    """The `fntrain plan` arguments that check `command` without running it (None: not a recipe run)."""
    argv = command.argv
    if argv[0] == "torchrun":
        module = argv.index("-m")
        if argv[module + 1 : module + 3] != ["fntrain", "run"]:
            raise AssertionError(
                f"{command.file}:{command.line}: torchrun must start `-m fntrain run`: {command.text}"
            )
        return ["plan", *argv[module + 3 :], "--world-size", str(_world_size(argv))]
    if is_launcher(argv):
        from fntrain.cli.launcher import split_launch

        _, recipe, rest = split_launch(argv[2:])
        return ["plan", recipe, *rest, "--world-size", str(_world_size(argv))]
    if argv[:2] == ["fntrain", "run"]:
        return ["plan", *argv[2:]]
    if argv[:2] == ["fntrain", "plan"]:
        return argv[1:]
    return None


def not_here(command: DocCommand) -> str | None:
    for pattern, reason in NOT_HERE:
        if re.search(pattern, command.text):
            return reason
    return None


def write_fixtures(work: Path) -> None:
    """FIXTURES: the user's own files the docs' commands name, as a user would have them:
    `~/models/Llama-3.2-1B` holds only the model's config.json (a plan reads no weights), `./my-llama` is
    a tiny Llama with its tokenizer, the corpora are small text, JSONL, Parquet and `save_to_disk`
    sources. Nothing a doc line makes itself (a config file, a run, shards) is here."""
    from tests.hf_helpers import CHATS, save_tiny_llama

    (work / "configs").symlink_to(ROOT / "configs")
    (work / "home" / "models").mkdir(parents=True)
    models = ROOT / "tests" / "fixtures" / "models"
    shutil.copytree(models / "Llama-3.2-1B", work / "home" / "models" / "Llama-3.2-1B")
    save_tiny_llama(work / "my-llama", [turn["content"] for chat in CHATS for turn in chat] * 4, vocab_size=300,
                    max_positions=128)  # fmt: skip
    (work / "chat.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS * 8))
    text = next(iter((ROOT / "fntrain" / "data" / "corpora").glob("*.txt"))).read_text()[:60_000]
    (work / "my_corpus.txt").write_text(text)
    paragraphs = [part for part in text.split("\n\n") if part.strip()]
    (work / "corpus.jsonl").write_text("".join(json.dumps({"text": part}) + "\n" for part in paragraphs))
    with contextlib.suppress(ImportError):  # the `data` extra: Parquet and save_to_disk sources
        import datasets
        import pyarrow as pa
        import pyarrow.parquet as pq

        (work / "data").mkdir()
        pq.write_table(pa.table({"content": paragraphs}), work / "data" / "part-0.parquet")
        questions = [chat[-2]["content"] for chat in CHATS] * 20
        answers = [chat[-1]["content"] for chat in CHATS] * 20
        pq.write_table(pa.table({"question": questions, "answer": answers}), work / "qa.parquet")
        datasets.Dataset.from_dict({"text": paragraphs}).save_to_disk(str(work / "saved_dataset" / "train"))


def clear_outputs(argv: list[str], work: Path) -> None:
    """Each doc example starts where a user would: the output a `tokenize` or `cp` names not there yet."""
    targets = [argv[argv.index("--output") + 1]] if "--output" in argv else []
    targets += [argv[-1]] if argv[:2] == ["fntrain", "cp"] else []
    for target in targets:
        path = work / target
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


# The planned tier runs these as written (cheap: no model, no training); the rest of what is not a recipe
# run (plot, export, generate, eval, and what reads a run's files) needs a run: the run tier has one.
CHEAP = ("plan", "config", "cp", "tokenize", "recipes", "--version")
NEEDS_A_RUN = (r"runs/[\w.-]+/config\.json",)
NEEDS_A_REAL_MODEL = (r"--model\.path \./my-llava",)


def test_every_doc_command_is_checked_somewhere():
    commands = doc_commands()
    assert len(commands) > 30
    texts = [command.text for command in commands]
    assert any(text.startswith("fntrain run tiny_gpt --train.train-iters 200") for text in texts)
    assert any(command.file == "docs/distributed.md" and command.text.startswith("torchrun --nnodes=4")
               for command in commands)  # fmt: skip
    for command in commands:
        where = f"{command.file}:{command.line}: {command.text}"
        assert "python -m recipes" not in command.text and "-m recipes." not in command.text, where
        if not_here(command) or command.file == "docs/guide.md":
            continue
        argv = command.argv
        assert argv[0] in ("fntrain", "torchrun", "cp"), (
            f"{where}: a new kind of command; say how it is checked"
        )


def test_the_slow_tier_scales_every_line_alike_and_keeps_what_a_line_names():
    own = tiny(DocCommand("a.md", 1, "fntrain run tiny_gpt --model.n-layer 6 --train.train-iters 200"))
    assert own.count("--model.n-layer") == 1 and "--model.n-layer 6" in own and "--train.train-iters 8" in own
    assert "--model.d-model 32" in own and "--progress.no-enabled" in own
    # the default cadence scaled as a named one is: runs/tiny_gpt/checkpoints/step_100 of a 200-step run
    # is step_4 of its 8 steps
    assert "--checkpoint.save-every 4" in own
    named = tiny(DocCommand("a.md", 2, "fntrain run tiny_gpt --checkpoint.restore-from runs/x/step_100 "
                                       "--checkpoint.save-every 50"))  # fmt: skip
    assert (
        "runs/x/step_4" in named and named.count("--checkpoint.save-every") == 1 and "save-every 2" in named
    )
    launched = tiny(DocCommand("a.md", 3, "fntrain run --nproc-per-node 2 tiny_gpt --parallel.strategy ddp"))
    assert launched.startswith("fntrain run --standalone --nproc-per-node 2 tiny_gpt")
    assert tiny(DocCommand("a.md", 4, "fntrain run tiny_gpt --help")) == "fntrain run tiny_gpt --help"
    assert _world_size(["fntrain", "run", "--nnodes=2", "--nproc-per-node", "4"]) == 8


def test_each_document_runs_alone_in_its_own_order():
    lines = [DocCommand(name, number, f"fntrain plan tiny_gpt --seed {number}")
             for name, number in (("README.md", 1), ("docs/a.md", 3), ("README.md", 5), ("docs/a.md", 9))]  # fmt: skip
    assert documents(lines) == [[lines[0], lines[2]], [lines[1], lines[3]]]
    resumed = DocCommand("a.md", 1, "fntrain run tiny_gpt --checkpoint.restore-from latest")
    again = DocCommand("a.md", 2, "fntrain run tiny_gpt")
    done = "... WARNING run already complete at step 16; nothing to do\n"
    assert trains_nothing(again, done) and not trains_nothing(resumed, done)
    assert not trains_nothing(again, "run completed at step 16")


@pytest.mark.slow  # ~40 commands, each a tyro parse and a plan: 15-25 s on 2 shared cores
def test_every_doc_command_plans_or_runs_as_written(tmp_path, monkeypatch, capsys):
    """Planned at its world size, or (plan, config, cp, tokenize, --version, --help) run as written; in
    document order in one directory, so a `--config base.toml` finds the base.toml a line above wrote."""
    pytest.importorskip("transformers")
    from fntrain.cli import dispatch

    work = tmp_path / "work"
    work.mkdir()
    write_fixtures(work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(work / "home"))
    failures, checked = [], 0
    for command in doc_commands():
        if not_here(command) or command.file == "docs/guide.md":
            continue
        if any(re.search(p, command.text) for p in (*NEEDS_A_RUN, *NEEDS_A_REAL_MODEL)):
            continue
        argv = command.argv
        helps = any(word in HELP for word in argv)
        if argv[0] == "fntrain" and plan_argv(command) is None and argv[1] not in CHEAP and not helps:
            continue
        clear_outputs(argv, work)
        try:
            if argv[0] == "cp":
                shutil.copyfile(argv[1], argv[2])
            elif not helps and (plan := plan_argv(command)) is not None:
                report = dispatch(plan)
                assert report["train_iters"] > 0
            elif ">" in argv:
                dispatch(argv[1 : argv.index(">")])
                (work / argv[argv.index(">") + 1]).write_text(capsys.readouterr().out)
            else:
                dispatch(argv[1:])
            checked += 1
        except SystemExit as error:
            if error.code not in (0, None):
                failures.append(f"{command.file}:{command.line}: {command.text}\n    exit {error.code}: "
                                f"{capsys.readouterr().err.strip()[-300:]}")  # fmt: skip
        except Exception as error:  # the check itself reports every failing command at once
            failures.append(
                f"{command.file}:{command.line}: {command.text}\n    {type(error).__name__}: {error}"
            )
        capsys.readouterr()
    assert not failures, "\n".join(failures)
    assert checked > 25


# ----------------------------------------------------------------------------- slow tier: run them

# Divided by 25 wherever a line names them: 400 steps -> 16, `--checkpoint.save-every 50` -> 2 (and the
# `step_<N>` paths alike), so the lines of one document keep agreeing on their run's settings.
SCALED = {"--train.train-iters": 25, "--checkpoint.save-every": 25, "--data.max-length": 32}
# What a run line gets unless it names its own, flag by flag (2 layers: the pipeline line has 2 stages;
# the recipe's 400 steps and checkpoint every 100 divided as SCALED divides named ones).
TINY_GPT = {"--model.n-layer": "2", "--model.d-model": "32", "--model.n-head": "2",
            "--train.global-batch-size": "8", "--train.micro-batch-size": "4", "--train.train-iters": "16",
            "--checkpoint.save-every": "4"}  # fmt: skip
SMALL = {"tiny_gpt": TINY_GPT, "my_gpt.py": TINY_GPT,
         "hf_causal_lm": {"--train.global-batch-size": "4", "--train.micro-batch-size": "2", "--train.train-iters": "4"},
         "vlm": {"--train.train-iters": "12"}}  # fmt: skip


def tiny(command: DocCommand) -> str:
    """`command` at the slow tier's scale: the step counts, checkpoint cadences, `step_<N>` paths and
    sequence lengths it names divided (SCALED), a short run length when it names none, a smaller batch
    and model unless it names its own, a standalone torchrun rendezvous (no fixed port: two documents
    run at once); a `--help` line as written."""
    argv = command.argv
    if any(word in HELP for word in argv):
        return command.text
    for index, word in enumerate(argv[:-1]):
        if word in SCALED and argv[index + 1].isdigit():
            argv[index + 1] = str(max(2, int(argv[index + 1]) // SCALED[word]))
    argv = [re.sub(r"step_(\d+)", lambda m: f"step_{int(m.group(1)) // 25}", word) for word in argv]
    if argv[0] == "torchrun" or is_launcher(argv):
        argv.insert(1 if argv[0] == "torchrun" else 2, "--standalone")
    recipe = next((word for word in argv if word in SMALL), None)
    if recipe is not None and ("run" in argv):
        argv += ["--progress.no-enabled"]
        for flag, value in SMALL[recipe].items():
            argv += [] if flag in argv else [flag, value]
    return " ".join(shlex.quote(word) if word != ">" else word for word in argv)


def documents(commands: list[DocCommand]) -> list[list[DocCommand]]:
    """`commands` grouped by document, each group in the document's order (a user pastes one document
    top to bottom; two documents do not share a directory)."""
    grouped: dict[str, list[DocCommand]] = {}
    for command in commands:
        grouped.setdefault(command.file, []).append(command)
    return list(grouped.values())


def trains_nothing(command: DocCommand, output: str) -> bool:
    """A run line that found its run already complete and trained nothing: a line that needs its own
    `--run-dir`, unless it names `--checkpoint.restore-from` (a resume, whose point that is)."""
    return "nothing to do" in output and "--checkpoint.restore-from" not in command.text


def run_document(commands: list[DocCommand], work: Path, env: dict[str, str]) -> list[str]:
    """Run `commands` (one document's) as written, at the slow tier's scale, through bash, one after
    the other in `work`; the failures, one entry each (a failed line does not stop the ones below)."""
    failures = []
    for command in commands:
        text = tiny(command)
        result = subprocess.run(
            ["bash", "-c", text], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        if result.returncode != 0:
            failures.append(f"{command.file}:{command.line}: {text}\n    exit {result.returncode}: "
                            f"{result.stderr.strip()[-600:]}")  # fmt: skip
        elif trains_nothing(command, result.stdout + result.stderr):
            failures.append(f"{command.file}:{command.line}: {text}\n    trained nothing: its run directory "
                            "holds this run already (the line needs its own --run-dir)")  # fmt: skip
    return failures


# Two documents at a time, each in its own fresh directory: the commands are one-thread processes
# (OMP_NUM_THREADS=1) that spend their first seconds importing, so two keep both of CI's cores busy.
PARALLEL_DOCUMENTS = 2


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_the_doc_commands_run_on_cpu_in_order(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("transformers")
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    write_fixtures(fixtures)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "WANDB_SILENT": "true"}  # fmt: skip
    runnable = [
        command
        for command in doc_commands()
        if not (not_here(command) or command.file == "docs/guide.md" or re.search(GPU_OR_NODES, command.text))
        and not any(re.search(p, command.text) for p in NEEDS_A_REAL_MODEL)
    ]

    def run_in_a_fresh_directory(commands: list[DocCommand]) -> list[str]:
        work = tmp_path / Path(commands[0].file).stem
        shutil.copytree(fixtures, work, symlinks=True)
        return run_document(commands, work, {**env, "HOME": str(work / "home")})

    longest_first = sorted(documents(runnable), key=len, reverse=True)  # README.md: the others beside it
    with ThreadPoolExecutor(PARALLEL_DOCUMENTS) as pool:
        failures = [line for lines in pool.map(run_in_a_fresh_directory, longest_first) for line in lines]
    assert len(runnable) > 30
    assert not failures, "\n".join(failures)
