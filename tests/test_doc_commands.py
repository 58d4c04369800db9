"""Every shell command in README.md and docs/*.md works as written.

The commands are extracted from the ```bash blocks (continuation lines joined, comments dropped, `&&`
chains split) and each one gets a way to be checked:

- default tier: every command is extracted and has a check (no `python -m recipes.*` left);
- slow tier, planned: every `fntrain` and `torchrun ... -m fntrain run` command is planned with its
  own arguments at its own world size (`fntrain plan`: every flag parsed, every value and the batch
  shape over the ranks checked, no weights, no device), and the cheap ones (`fntrain plan`, `config`,
  `cp`, `tokenize`, `--version`) run as written;
- slow tier, run: the commands that can run on CPU run as written through bash, in order, with the
  small overrides of `tiny()` appended (run length divided, a small batch and model unless the line
  names its own, so each takes seconds); a line another one repeats word for word runs once;
- NOT_HERE lists, with the reason, what cannot run here at all (installs, GPUs, NPUs, several nodes);
  what docs/guide.md shows is run by tests/test_guide.py.

The working directory is a temporary one holding the files the commands name (FIXTURES), with HOME
pointing into it, so `~/models/Llama-3.2-1B` there is the model's config.json-only directory.
"""

from __future__ import annotations

import contextlib
import io
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
# A command matching one of these cannot run on this machine: (pattern, reason).
NOT_HERE = (
    (
        r"^(python3? -m venv|\. \.venv/bin/activate|pip |\.venv/bin/pip )",
        "installs packages (CI runs the install lines)",
    ),
    (r"^\.venv/bin/python -m pytest", "the test suite itself"),
    (r"^\.venv/bin/python -m coverage", "the test suite itself, under coverage"),
    (r"^python -c .import torch", "asks a GPU or NPU driver"),
)
GPU_OR_NODES = (
    r"--runtime\.device[ =](cuda|npu)|--nnodes|^torchrun --nproc_per_node[ =]8 "  # 8 ranks: a GPU machine's line
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
    sizes = {"nnodes": 1, "nproc_per_node": 1}
    for index, word in enumerate(argv):
        for name in sizes:
            if word.startswith(f"--{name}="):
                sizes[name] = int(word.split("=", 1)[1])
            elif word == f"--{name}":
                sizes[name] = int(argv[index + 1])
    return sizes["nnodes"] * sizes["nproc_per_node"]


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
    """The files the docs' commands name, as a user would have them: `~/models/Llama-3.2-1B` holds only
    the model's config.json (a plan reads no weights), `./my-llama` is a tiny Llama with its tokenizer,
    the corpora are small text, JSONL, Parquet and `save_to_disk` sources."""
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
    base = io.StringIO()
    with contextlib.redirect_stdout(base):
        from fntrain.cli import dispatch

        dispatch(["config", "tiny_gpt"])
    (work / "base.toml").write_text(base.getvalue())


def clear_outputs(argv: list[str], work: Path) -> None:
    """Each doc example starts where a user would: the output a `tokenize` or `cp` names not there yet."""
    targets = [argv[argv.index("--output") + 1]] if "--output" in argv else []
    targets += [argv[-1]] if argv[:2] == ["fntrain", "cp"] else []
    for target in targets:
        path = work / target
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


# Commands the default tier does not plan, with the reason (the slow tier runs them).
NEEDS_A_RUN = (r"runs/tiny_gpt/config\.json", r"^fntrain (plot|export)")
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


def test_the_slow_tier_keeps_what_a_line_names_and_runs_a_repeated_line_once():
    own = tiny(DocCommand("a.md", 1, "fntrain run tiny_gpt --model.n-layer 6 --train.train-iters 200"))
    assert own.count("--model.n-layer") == 1 and "--model.n-layer 6" in own and "--train.train-iters 8" in own
    assert "--model.d-model 32" in own and "--progress.no-enabled" in own
    ddp, fsdp2 = (f"-m fntrain run tiny_gpt --parallel.strategy {name}" for name in ("ddp", "fsdp2"))
    first = DocCommand("a.md", 2, f"torchrun --nproc_per_node 2 {ddp}")
    again = DocCommand("b.md", 7, f"torchrun --nproc_per_node=2 {ddp}")
    other = DocCommand("b.md", 8, f"torchrun --nproc_per_node=2 {fsdp2}")
    assert once_each([[first], [again], [other]]) == [[first], [other]]


@pytest.mark.slow  # ~40 commands, each a tyro parse and a plan: 15-25 s on 2 shared cores
def test_every_doc_command_plans_or_runs_as_written(tmp_path, monkeypatch, capsys):
    """Planned at its world size, or (plan, config, cp, tokenize, --version) run as written."""
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
        clear_outputs(argv, work)
        try:
            if argv[0] == "cp":
                shutil.copyfile(argv[1], argv[2])
            elif (plan := plan_argv(command)) is not None:
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

SCALED = {"--train.train-iters": 25, "--checkpoint.save-every": 25, "--data.max-length": 32}
# What a run line gets unless it names its own, flag by flag (2 layers: the pipeline line has 2 stages).
TINY_GPT = {"--model.n-layer": "2", "--model.d-model": "32", "--model.n-head": "2",
            "--train.global-batch-size": "8", "--train.micro-batch-size": "4", "--train.train-iters": "16"}  # fmt: skip
SMALL = {"tiny_gpt": TINY_GPT, "my_gpt.py": TINY_GPT,
         "hf_causal_lm": {"--train.global-batch-size": "4", "--train.micro-batch-size": "2", "--train.train-iters": "4"},
         "vlm": {"--train.train-iters": "12"}}  # fmt: skip


def tiny(command: DocCommand) -> str:
    """`command` at the slow tier's scale: the step counts, checkpoint cadences, `step_<N>` paths and
    sequence lengths it names divided (SCALED), a short run length when it names none, a smaller batch
    and model unless it names its own, a standalone torchrun rendezvous (no fixed port)."""
    argv = command.argv
    for index, word in enumerate(argv[:-1]):
        if word in SCALED and argv[index + 1].isdigit():
            argv[index + 1] = str(max(2, int(argv[index + 1]) // SCALED[word]))
    argv = [re.sub(r"step_(\d+)", lambda m: f"step_{int(m.group(1)) // 25}", word) for word in argv]
    if argv[0] == "torchrun":
        argv.insert(1, "--standalone")
    recipe = next((word for word in argv if word in SMALL), None)
    if recipe is not None and ("run" in argv):
        argv += ["--progress.no-enabled"]
        for flag, value in SMALL[recipe].items():
            argv += [] if flag in argv else [flag, value]
    return " ".join(shlex.quote(word) if word != ">" else word for word in argv)


def chains(commands: list[DocCommand]) -> list[list[DocCommand]]:
    """`commands` grouped by the doc line they came from: the parts of one `&&` chain run in order, in
    one working directory (a `tokenize` then the run on its shards); separate lines do not depend on
    each other, since each starts from the fixtures and, where it names one, the prepared finished run."""
    grouped: dict[tuple[str, int], list[DocCommand]] = {}
    for command in commands:
        grouped.setdefault((command.file, command.line), []).append(command)
    return list(grouped.values())


def once_each(groups: list[list[DocCommand]]) -> list[list[DocCommand]]:
    """`groups` without repeats: a chain that another doc line already runs word for word (at the
    slow tier's scale, `--flag=value` read as `--flag value`) runs once."""
    distinct: dict[tuple[str, ...], list[DocCommand]] = {}
    for chain in groups:
        words = [part for command in chain for word in shlex.split(tiny(command)) for part in word.split("=")]
        distinct.setdefault(tuple(words), chain)
    return list(distinct.values())


def run_chain(chain: list[DocCommand], work: Path, prepared_runs: Path, env: dict[str, str]) -> list[str]:
    """Run each command of `chain` as written (at the slow tier's scale) through bash in `work`; the
    failures, one entry each."""
    failures = []
    for command in chain:
        argv = command.argv
        shutil.rmtree(work / "runs", ignore_errors=True)
        clear_outputs(argv, work)
        if any(word.startswith("runs/tiny_gpt") or word in ("latest", "--overwrite") for word in argv):
            shutil.copytree(prepared_runs, work / "runs")  # the finished run it refers to
        text = tiny(command)
        result = subprocess.run(
            ["bash", "-c", text], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        if result.returncode != 0:
            failures.append(f"{command.file}:{command.line}: {text}\n    exit {result.returncode}: "
                            f"{result.stderr.strip()[-600:]}")  # fmt: skip
    return failures


# Doc lines run two at a time, each in its own copy of the working directory: the commands are
# one-thread processes (OMP_NUM_THREADS=1) that spend their first seconds importing, so two keep both
# of CI's cores busy and halve the test's time.
PARALLEL_CHAINS = 2


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_the_doc_commands_run_on_cpu(tmp_path):
    import queue
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("transformers")
    work = tmp_path / "work0"
    work.mkdir()
    write_fixtures(work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]), "OMP_NUM_THREADS": "1", "HOME": str(work / "home"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "WANDB_SILENT": "true"}  # fmt: skip
    prepared = tiny(DocCommand("test", 0, "fntrain run tiny_gpt --checkpoint.save-every 100"))
    assert subprocess.run(["bash", "-c", prepared], cwd=work, env=env, capture_output=True).returncode == 0
    shutil.copytree(work / "runs", tmp_path / "prepared-runs")
    free: queue.SimpleQueue[tuple[Path, dict[str, str]]] = queue.SimpleQueue()
    for index in range(PARALLEL_CHAINS):
        copy = tmp_path / f"work{index}"
        if index:
            shutil.copytree(work, copy, symlinks=True)
        free.put((copy, {**env, "HOME": str(copy / "home")}))
    runnable = [
        command
        for command in doc_commands()
        if not (not_here(command) or command.file == "docs/guide.md" or re.search(GPU_OR_NODES, command.text))
        and not any(re.search(p, command.text) for p in NEEDS_A_REAL_MODEL)
    ]

    def run_in_a_free_copy(chain: list[DocCommand]) -> list[str]:
        copy, copy_env = free.get()
        try:
            return run_chain(chain, copy, tmp_path / "prepared-runs", copy_env)
        finally:
            free.put((copy, copy_env))

    with ThreadPoolExecutor(PARALLEL_CHAINS) as pool:
        found = pool.map(run_in_a_free_copy, once_each(chains(runnable)))
        failures = [line for lines in found for line in lines]
    assert len(runnable) > 30
    assert not failures, "\n".join(failures)
