"""Every shell command in README.md and docs/*.md works as written, in the order written.

The commands are extracted from the ```bash blocks (continuation lines joined, comments dropped, `&&`
chains split; a heredoc, `cat > chat.jsonl <<'EOF'` to its `EOF`, is one command) and each one gets a way
to be checked:

- default tier: every command is extracted and has a check (no `python -m recipes.*` left);
- slow tier: as a user pastes them. Each document gets ONE fresh working directory and its
  lines run there through bash, top to bottom, each seeing what the lines above it left (a tiny model,
  a chat.jsonl, a run directory, a `base.toml`, a copied recipe, shards): a second run into a run
  directory that holds one, a file no line made, a checkpoint the run above did not save all fail here.
  A line runs exactly as written unless it trains: only the scale is the test's: `tiny()` appends
  small overrides (run lengths, checkpoint cadences and `step_<N>` paths divided by 25, a small batch
  and model unless the line names its own), the same to every line, so the lines of a document still
  agree on their settings. A run line that trains nothing ("run already complete") fails too unless it
  names `--checkpoint.restore-from` (then resuming is its point): it means the line needs its own
  `--run-dir`. The cheap lines (`fntrain plan`, `config`, `cp`, `tokenize`, `tiny-llama`,
  `--version`, `--help`) and the lines that make a user's files (`python -c ...`, heredocs, `mkdir`,
  `cp`) run as written;
- slow tier, planned: after its line ran (or where it stands, for a GPU machine's or several nodes'
  line, which does not run here), every `fntrain run`, `fntrain run --nproc-per-node N` and
  `torchrun ... -m fntrain run` command is planned with its own arguments, unscaled, at its own world
  size (`fntrain plan`: every flag parsed, every value and the batch shape over the ranks checked, no
  weights, no device), in the same directory. Start-up is shared (tests/fork_server.py): the `fntrain`
  the lines find on PATH, and the Python torchrun starts its workers with, fork the command from one
  process that imported torch and transformers once;
- NOT_HERE lists, with the reason, what cannot run here at all (installs, GPUs, NPUs, several nodes, a
  model no line can make); what docs/guide.md shows is run, in order, by tests/test_guide.py.

No fixture stands for a user's file: the docs show how each is made (`fntrain tiny-llama my-llama`, a
heredoc, a `python -c` line). The working directory holds only what a source checkout has and a doc line
uses (`checkout_files`): `configs/` and the public config.json files under `tests/fixtures/models/`.
"""

from __future__ import annotations

import os
import re
import shlex
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
    (
        r"--model\.path \./my-llava",
        "your own LLaVA-style model and images; tests/test_vlm_recipe.py trains on a tiny one made there",
    ),
)
GPU_OR_NODES = (  # 8 ranks: a GPU machine's line
    r"--runtime\.device[ =](cuda|npu)|--nnodes|^(torchrun|fntrain run) --nproc[_-]per[_-]node[ =]8 "
)


HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


@dataclass(frozen=True)
class DocCommand:
    """One command of a doc: where it is, its text (no comment, one part of an `&&` chain; a heredoc's
    first line) and `raw`, the whole line as written (continuation lines and a heredoc's body included),
    which every part of an `&&` chain shares."""

    file: str
    line: int
    text: str
    raw: str = ""

    @property
    def argv(self) -> list[str]:
        """The words; `.venv/bin/fntrain` (the README's first line) is the `fntrain` on the PATH."""
        words = shlex.split(self.text)
        return ["fntrain", *words[1:]] if words[0].endswith("/fntrain") else words

    @property
    def heredoc(self) -> bool:
        return "\n" in self.raw and HEREDOC.search(self.text) is not None


def doc_commands(paths=DOCS) -> list[DocCommand]:
    """The shell commands of the fenced shell blocks of `paths`, in order."""
    found = []
    for path in paths:
        name = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name)
        language, start, pending, raw, heredoc = None, 0, "", [], None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if heredoc is not None:  # a heredoc's body, to its terminator: data, not commands
                raw.append(line)
                if line.strip() == heredoc[1]:
                    found.append(DocCommand(name, start, heredoc[0], "\n".join(raw)))
                    heredoc, raw = None, []
                continue
            if line.startswith("```"):
                language = None if language is not None else line[3:].strip() or "text"
                continue
            if language not in SHELL_LANGUAGES:
                continue
            start = start if pending else number
            pending += line.strip()
            raw.append(line)
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            if match := HEREDOC.search(pending):
                heredoc, pending = (pending, match.group(1)), ""
                continue
            words = shlex.split(pending, comments=True)
            pending, text, raw = "", "\n".join(raw), []
            for part in " ".join(
                shlex.quote(word) if word not in ("&&", ">") else word for word in words
            ).split(" && "):
                if part.strip():
                    found.append(DocCommand(name, start, part.strip(), text))
    return found


def bash_lines(commands: list[DocCommand], runs) -> list[tuple[list[DocCommand], str]]:
    """One document's `commands` as the bash lines that run them, in order: (the parts that run, the
    text to run), for each line with a part that `runs`. A line whose parts all run and none is scaled
    runs exactly as written (`raw`: continuation lines, heredoc, shell syntax and all); otherwise its
    parts that run, each at the test's scale (`tiny`), joined by `&&`."""
    lines: list[list[DocCommand]] = []
    for command in commands:
        same = lines and command.raw and (lines[-1][0].line, lines[-1][0].raw) == (command.line, command.raw)
        lines[-1].append(command) if same else lines.append([command])
    out = []
    for parts in lines:
        running = [part for part in parts if runs(part)]
        if not running:
            continue
        scaled = [tiny(part) for part in running]
        as_written = len(running) == len(parts) and all(
            part.heredoc or shlex.split(text) == part.argv for text, part in zip(scaled, running, strict=True)
        )
        out.append((running, parts[0].raw if as_written and parts[0].raw else " && ".join(scaled)))
    return out


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


def checkout_files(work: Path) -> Path:
    """`work` as the source checkout the docs are read in (README's first line installs it there): the
    checkout's files a doc line uses, linked (`configs/`, and the public config.json files of
    `tests/fixtures/models/` that docs/models.md copies to plan a model whose weights are not here).
    Nothing of a user's: the docs make those. Returns `work`."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "configs").symlink_to(ROOT / "configs")
    (work / "tests" / "fixtures").mkdir(parents=True)
    (work / "tests" / "fixtures" / "models").symlink_to(ROOT / "tests" / "fixtures" / "models")
    (work / "home").mkdir()
    return work


def shell_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment a doc line runs in: this Python's `fntrain` and `python` first on PATH, the
    checkout importable, HOME in the working directory, one torch thread (two documents run at once)."""
    path = os.pathsep.join([str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]).rstrip(
        os.pathsep
    )
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HOME": str(home), "WANDB_SILENT": "true",
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra}  # fmt: skip


# A line that reads a run's files (its config.json) is not planned: its run is at the test's scale.
NEEDS_A_RUN = (r"runs/[\w.-]+/config\.json",)


# Lines that make a user's files (a heredoc, a `python -c` writing JSONL or Parquet, a copy): run as written.
SHELL = ("cp", "mkdir", "cat", "python")


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
        assert argv[0] in ("fntrain", "torchrun", *SHELL), (
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


def test_each_recipe_run_is_planned_unscaled_after_its_line_and_a_gpu_line_only_planned():
    chain = "fntrain cp tiny_gpt my_gpt.py && fntrain run my_gpt.py --train.train-iters 200"
    lines = [DocCommand("a.md", 1, part, chain) for part in chain.split(" && ")]
    gpu = (
        "torchrun --nproc_per_node=8 -m fntrain run tiny_gpt --runtime.device cuda --parallel.strategy fsdp2"
    )
    lines += [
        DocCommand("a.md", 2, gpu, gpu),
        DocCommand("a.md", 3, "fntrain run tiny_gpt --help", "fntrain run tiny_gpt --help"),
    ]
    steps = [(text, planned) for _, text, planned in document_steps(lines)]
    assert steps[0][0].startswith(
        "fntrain cp tiny_gpt my_gpt.py && fntrain run my_gpt.py --train.train-iters 8"
    )
    assert steps[1:] == [
        ("fntrain plan my_gpt.py --train.train-iters 200", True),
        ("fntrain plan tiny_gpt --runtime.device cuda --parallel.strategy fsdp2 --world-size 8", True),
        ("fntrain run tiny_gpt --help", False),
    ]


def test_a_heredoc_is_one_command_and_a_line_runs_as_written_unless_it_trains(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("""```bash
fntrain tiny-llama my-llama
cat > chat.jsonl <<'EOF'
{"text": "All the world's a stage && more"}
EOF
mkdir -p ~/m && cp -n x.json ~/m/   # a comment
fntrain run hf_causal_lm --model.path ./my-llama \\
    --data.path chat.jsonl
python3 -m venv .venv && fntrain --version
```
""")
    commands = doc_commands([doc])
    assert [(c.line, c.text) for c in commands] == [
        (2, "fntrain tiny-llama my-llama"), (3, "cat > chat.jsonl <<'EOF'"), (6, "mkdir -p '~/m'"),
        (6, "cp -n x.json '~/m/'"), (7, "fntrain run hf_causal_lm --model.path ./my-llama --data.path chat.jsonl"),
        (9, "python3 -m venv .venv"), (9, "fntrain --version"),
    ]  # fmt: skip
    assert commands[1].heredoc and commands[1].raw.endswith('stage && more"}\nEOF')
    ran = [text for _, text in bash_lines(commands, lambda command: not not_here(command))]
    assert ran[:3] == ["fntrain tiny-llama my-llama", commands[1].raw,
                       "mkdir -p ~/m && cp -n x.json ~/m/   # a comment"]  # fmt: skip
    assert ran[3].startswith(
        "fntrain run hf_causal_lm --model.path ./my-llama --data.path chat.jsonl --progress"
    )
    assert ran[4] == "fntrain --version"  # the install before it is not run here


def _needs_a_run(command: DocCommand) -> bool:
    return any(re.search(pattern, command.text) for pattern in NEEDS_A_RUN)


# ----------------------------------------------------------------------------- slow tier: run them

# Divided by 25 wherever a line names them: 400 steps -> 16, `--checkpoint.save-every 50` -> 2 (and the
# `step_<N>` paths alike), so the lines of one document keep agreeing on their run's settings; a
# sequence length by 32. (tokenize's `--workers 8` runs as written: forked workers, the same work.)
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


def runs_here(command: DocCommand) -> bool:
    """Whether the run tier runs `command`: not NOT_HERE, not the guide's (tests/test_guide.py), not a
    GPU machine's or several nodes'."""
    return not (not_here(command) or command.file == "docs/guide.md" or re.search(GPU_OR_NODES, command.text))


def plans_here(command: DocCommand) -> bool:
    """Whether the slow tier plans `command` with its own arguments at its world size: a recipe run (or
    plan) of a document it reads, a GPU machine's and several nodes' included; not a `--help` line, not
    one that reads a run's files."""
    return not (
        not_here(command)
        or command.file == "docs/guide.md"
        or _needs_a_run(command)
        or any(word in HELP for word in command.argv)
    ) and (plan_argv(command) is not None)


def document_steps(commands: list[DocCommand]) -> list[tuple[list[DocCommand], str, bool]]:
    """One document's bash lines in order, as (the parts, the text to run, whether it is a plan): each
    line that runs here (`bash_lines`), then the `fntrain plan` of each of its parts that plans; a line
    that does not run here (a GPU machine's) only planned, where it stands."""
    lines = {(parts[0].line, parts[0].raw): (parts, text) for parts, text in bash_lines(commands, runs_here)}
    steps: list[tuple[list[DocCommand], str, bool]] = []
    for command in commands:
        if (key := (command.line, command.raw)) in lines:
            steps.append((*lines.pop(key), False))
        if plans_here(command):
            steps.append(([command], shlex.join(["fntrain", *plan_argv(command)]), True))
    return steps


def run_document(commands: list[DocCommand], work: Path, env: dict[str, str]) -> list[str]:
    """Run `commands` (one document's, all of them: a line runs as written only when all its parts run)
    at the slow tier's scale through bash, one line after the other in `work`, each recipe run planned
    after its line (`document_steps`); the failures, one entry each (a failed line does not stop the
    ones below)."""
    failures = []
    for parts, text, planned in document_steps(commands):
        result = subprocess.run(
            ["bash", "-c", text], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        where = f"{parts[0].file}:{parts[0].line}: {text}"
        if result.returncode != 0:
            failures.append(f"{where}\n    exit {result.returncode}: {result.stderr.strip()[-600:]}")
        elif planned and not re.search(r"^train_iters +[1-9]", result.stdout, re.M):
            failures.append(f"{where}\n    planned no steps: {result.stdout.strip()[-600:]}")
        elif not planned and any(trains_nothing(part, result.stdout + result.stderr) for part in parts):
            failures.append(f"{where}\n    trained nothing: its run directory holds this run already (the line "
                            "needs its own --run-dir)")  # fmt: skip
    return failures


# Two documents at a time, each in its own fresh directory: the commands are one-thread processes
# (OMP_NUM_THREADS=1), forked from the shared start-up server or starting torchrun, so two keep both of
# CI's cores busy.
PARALLEL_DOCUMENTS = 2


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_the_doc_commands_run_on_cpu_in_order(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tests.fork_server import PRELOAD, started

    pytest.importorskip("transformers")
    commands = doc_commands()
    assert sum(map(runs_here, commands)) > 40 and sum(map(plans_here, commands)) > 30

    def run_in_a_fresh_directory(commands: list[DocCommand], env: dict[str, str]) -> list[str]:
        work = checkout_files(tmp_path / Path(commands[0].file).stem)
        return run_document(commands, work, {**env, "HOME": str(work / "home")})

    longest_first = sorted(documents(commands), key=lambda lines: len(document_steps(lines)), reverse=True)
    with started(shell_env(tmp_path), PRELOAD) as env, ThreadPoolExecutor(PARALLEL_DOCUMENTS) as pool:
        ran = pool.map(lambda lines: run_in_a_fresh_directory(lines, env), longest_first)
        failures = [line for lines in ran for line in lines]
    assert not failures, "\n".join(failures)
