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
  weights, no device), in the same directory. Start-up is shared (tests/helpers/fork_server.py): the `fntrain`
  the lines find on PATH, and the Python torchrun starts its workers with, fork the command from one
  process that imported torch and transformers once;
- slow tier, the shell: the one a user has after the README's set-up, its venv activated (`activated`:
  what the venv's own `activate` script changes, nothing more; the fork server's `fntrain` and
  `torchrun` stand for the venv's console scripts, with the venv's import path);
- slow tier, learning: a line whose text promises its run learns carries a marker beside that text,
  `<!-- learns: RUN_DIR METRIC falls|rises by MARGIN, ... -->` (hidden when rendered; the margin is about
  half the smallest move measured over seeds). Such a line runs as written, unscaled (its few tens of
  steps are what learning needs), and its run's metrics.jsonl must show each METRIC move from its first
  logged value to its last by MARGIN or more (`learned`);
- NOT_HERE lists, with the reason, what cannot run here at all (installs, GPUs, NPUs, several nodes, a
  model no line can make); what docs/guide.md shows is run, in order, by tests/docs/test_guide.py.

No fixture stands for a user's file: the docs show how each is made (`fntrain tiny-llama my-llama`, a
heredoc, a `python -c` line). The working directory holds only what a source checkout has and a doc line
uses (`checkout_files`): `configs/` and the public config.json files under `tests/fixtures/models/`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from fntrain.hooks.metrics_file import read_records
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = ("bash", "sh", "shell")
HELP = ("-h", "--help", "--help-all")
# A command matching one of these cannot run on this machine: (pattern, reason).
NOT_HERE = (
    (
        r"^(python3? -m venv|pip |\.venv/bin/pip )",
        "installs packages (CI runs the install lines)",
    ),
    (
        r"^\. \.venv/bin/activate",
        "activates the venv: every line here runs in the shell it leaves (activated)",
    ),
    (r"^\.venv/bin/python -m pytest", "the test suite itself"),
    (r"^\.venv/bin/python -m coverage", "the test suite itself, under coverage"),
    (r"^python -c .import torch", "asks a GPU or NPU driver"),
    (
        r"^fntrain eval ",
        "lm-eval's task index alone takes tens of seconds; tests/cli/commands/test_eval_harness.py runs it",
    ),
    (
        r"--model\.path \./my-llava",
        "your own LLaVA-style model and images; tests/recipes/test_vlm.py trains on a tiny one made there",
    ),
)
GPU_OR_NODES = (  # 8 ranks: a GPU machine's line
    r"--runtime\.device[ =](cuda|npu)|--nnodes|^(torchrun|fntrain run) --nproc[_-]per[_-]node[ =]8 "
)


HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
LEARNS = re.compile(r"<!-- learns: (\S+) (.+?) -->")
MOVE = re.compile(r"^(\S+) (falls|rises) by ([0-9.]+)$")


@dataclass(frozen=True)
class Learns:
    """A document's promise that the run in `run_dir` moves `metric` (`rises`, or falls) by `margin` or
    more, from its first logged value to its last."""

    file: str
    run_dir: str
    metric: str
    rises: bool
    margin: float


def learning_promises(file: str, text: str) -> list[Learns]:
    """The `<!-- learns: RUN_DIR METRIC falls|rises by MARGIN, ... -->` markers of one document."""
    promises = []
    for run_dir, moves in LEARNS.findall(text):
        for move in moves.split(","):
            match = MOVE.match(move.strip())
            assert match, f"{file}: a learns marker reads METRIC falls|rises by MARGIN, got {move.strip()!r}"
            promises.append(Learns(file, run_dir, match[1], match[2] == "rises", float(match[3])))
    return promises


def learned(promise: Learns, metrics: Path) -> str | None:
    """None when the metrics log `metrics` shows `promise`'s move; else what it shows."""
    values = [record[promise.metric] for record in read_records(metrics) if promise.metric in record]
    if len(values) < 2:
        return f"{promise.metric} logged {len(values)} time(s) in {metrics}: too few to show it move"
    moved = (values[-1] - values[0]) * (1 if promise.rises else -1)
    if moved >= promise.margin:
        return None
    way = "rises" if promise.rises else "falls"
    return f"{promise.metric} {values[0]:.4g} -> {values[-1]:.4g}: the text says it {way} by {promise.margin} or more"


@dataclass(frozen=True)
class DocCommand:
    """One command of a doc: where it is, its text (no comment, one part of an `&&` chain; a heredoc's
    first line) and `raw`, the whole line as written (continuation lines and a heredoc's body included),
    which every part of an `&&` chain shares."""

    file: str
    line: int
    text: str
    raw: str = ""
    learns: tuple[Learns, ...] = ()
    """What its document promises its run shows (a `--run-dir` a learns marker names)."""

    @property
    def run_dir(self) -> str | None:
        """The `--run-dir` of a run line (None: another line, or one that names none)."""
        argv = self.argv
        if "run" not in argv or "--run-dir" not in argv[:-1]:
            return None
        return argv[argv.index("--run-dir") + 1]

    @property
    def argv(self) -> list[str]:
        """The words; `.venv/bin/fntrain` (the README's first line) is the `fntrain` on the PATH."""
        words = shlex.split(self.text)
        return ["fntrain", *words[1:]] if words[0].endswith("/fntrain") else words

    @property
    def heredoc(self) -> bool:
        return "\n" in self.raw and HEREDOC.search(self.text) is not None


def doc_commands(paths=DOCS) -> list[DocCommand]:
    """The shell commands of the fenced shell blocks of `paths`, in order; a run line whose `--run-dir` a
    learns marker of its document names carries those promises."""
    found = []
    for path in paths:
        name = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name)
        promises, start_of_file = learning_promises(name, path.read_text()), len(found)
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
        for index in range(start_of_file, len(found)):
            mine = tuple(promise for promise in promises if promise.run_dir == found[index].run_dir)
            found[index] = replace(found[index], learns=mine) if mine else found[index]
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


def activated(env: Mapping[str, str]) -> dict[str, str]:
    """`env` as the README's `. .venv/bin/activate` leaves a shell: what this Python's venv's own activate
    script changes (its bin first on PATH, VIRTUAL_ENV, PYTHONHOME unset), nothing more; outside a venv,
    this Python's bin first on PATH, as the venv's would be."""
    script = Path(sys.prefix) / "bin" / "activate"
    if sys.prefix == sys.base_prefix or not script.is_file():
        return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}

    def shell_after(line: str) -> dict[str, str]:
        out = run_to_end(["bash", "-c", f"{line}env -0"], f"bash's `{line}env -0`", 120, env=dict(env))
        assert out.returncode == 0, out.stderr[-3000:]
        return dict(item.split("=", 1) for item in out.stdout.split("\0") if "=" in item)

    before, after = shell_after(""), shell_after(f". {shlex.quote(str(script))} && ")
    kept = {name: value for name, value in env.items() if name in after or name not in before}
    return {**kept, **{name: value for name, value in after.items() if before.get(name) != value}}


def shell_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment a doc line runs in: the test's, with the venv activated as the README's set-up
    leaves a user's shell (`activated`: its `fntrain`, `python` and `torchrun` first on PATH, nothing on
    PYTHONPATH), HOME in the working directory, one torch thread (two documents run at once)."""
    return {
        **activated(os.environ),
        "OMP_NUM_THREADS": "1",
        "HOME": str(home),
        "WANDB_SILENT": "true",
        **extra,
    }


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
    assert by_document(lines) == [[lines[0], lines[2]], [lines[1], lines[3]]]
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


def test_the_readme_activates_the_venv_before_a_line_uses_a_bare_command():
    """A fresh shell finds `fntrain`, `python` and `torchrun` once the venv is active: the README's set-up
    names `.venv/bin/...` until it activates the venv, once, and every line after uses the bare names."""
    commands = doc_commands([ROOT / "README.md"])
    first = [shlex.split(command.text)[0] for command in commands]
    activate = commands.index(next(command for command in commands if command.text == ". .venv/bin/activate"))
    bare = [index for index, word in enumerate(first) if word in ("fntrain", "python", "torchrun")]
    assert bare and min(bare) > activate, [commands[index].text for index in bare if index < activate]
    assert all(word.startswith(".venv/bin/") or word == "python3" for word in first[:activate])


def test_the_lines_run_in_the_shell_the_readme_leaves_the_venv_activated():
    """What activation changes (the venv's bin first on PATH, VIRTUAL_ENV) and the test's own settings
    (HOME, one thread), nothing more: no checkout on PYTHONPATH."""
    env = shell_env(Path("/h"))
    changed = {"PATH", "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "PS1", "PYTHONHOME", "HOME", "OMP_NUM_THREADS",
               "WANDB_SILENT"}  # fmt: skip
    assert {name: value for name, value in env.items() if name not in changed} == {
        name: value for name, value in os.environ.items() if name not in changed
    }
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["PATH"].endswith(os.environ["PATH"])
    if sys.prefix != sys.base_prefix:  # a venv: what its activate script sets
        assert Path(env["VIRTUAL_ENV"]).resolve() == Path(sys.prefix).resolve()


def test_a_learns_marker_runs_its_line_as_written_and_reads_its_metrics(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("""```bash
fntrain run dpo --model.path m --train.train-iters 40 --optim.lr 1e-3 --run-dir runs/d
fntrain run dpo --model.path m --train.train-iters 40 --run-dir runs/other
```
The loss falls from 0.69 to about 0.3.
<!-- learns: runs/d loss falls by 0.2, rewards/accuracies rises by 0.25 -->
""")
    learning, other = doc_commands([doc])
    assert [(p.run_dir, p.metric, p.rises, p.margin) for p in learning.learns] == [
        ("runs/d", "loss", False, 0.2), ("runs/d", "rewards/accuracies", True, 0.25)]  # fmt: skip
    assert other.learns == () and "--train.train-iters 2" in tiny(other)
    assert [text for _, text in bash_lines([learning], lambda command: True)] == [learning.raw]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in (
        {"step": 10, "loss": 0.68, "rewards/accuracies": 0.6}, {"step": 10, "val_loss": 0.7},
        {"step": 40, "loss": 0.45, "rewards/accuracies": 0.8})))  # fmt: skip
    fell, rose = learning.learns
    assert learned(fell, metrics) is None
    assert learned(rose, metrics) == "rewards/accuracies 0.6 -> 0.8: the text says it rises by 0.25 or more"
    assert learned(replace(fell, metric="kd/kl"), metrics).startswith("kd/kl logged 0 time(s)")
    doc.write_text("<!-- learns: runs/d loss drops 0.2 -->")
    with pytest.raises(AssertionError, match="METRIC falls|rises by MARGIN, got 'loss drops 0.2'"):
        doc_commands([doc])


def _number(argv: list[str], flag: str, default: int) -> int:
    return int(argv[argv.index(flag) + 1]) if flag in argv else default


# The learns markers' margins, about half the smallest move over five seeds (tiny-llama --seed 0-4 for
# the DPO and KD lines, whose data is one batch, so their run seed changes nothing; the run's --seed
# 42, 1-4 for GRPO), first logged value -> last, 2026-12-07:
#   post_training dpo-colours  loss falls 0.30-0.41, rewards/accuracies rises 0.38-0.50
#   post_training dpo-lora     loss falls 0.23-0.27, rewards/accuracies rises 0.28-0.53
#   post_training teacher      loss falls 3.48-3.55; kd: loss falls 1.19-1.27, kd/kl 0.53-0.63, kd/ce 1.86-1.95
#   post_training grpo-a       reward rises 0.24-0.39 (0.053-0.073 at step 10, 0.29-0.46 at step 40)
#   README dpo                 loss falls 0.31-0.33
# Post-training runs whose text does not promise learning: (run directory, why).
WIRING_ONLY = {
    "runs/grpo-math": "a tiny random model earns no reward there, as its text says: the wiring a real model uses",
    "runs/grpo-lora": "4 steps showing LoRA, a KL reference and two passes per generation batch",
    "runs/grpo-fsdp": "4 steps showing GRPO on 2 ranks under fsdp2",
}


def test_every_post_training_example_promises_what_it_shows_or_says_it_shows_wiring():
    """A user who pastes a DPO, KD or GRPO example sees it learn (its learns marker) unless its text
    says it only shows wiring (WIRING_ONLY); a promise names one single-process run line of its
    document that logs its metrics more than once."""
    commands = [command for command in doc_commands() if runs_here(command)]
    post = [command for command in commands if command.argv[:2] == ["fntrain", "run"]
            and (plan_argv(command) or ["plan", None])[1] in ("dpo", "kd", "grpo")]  # fmt: skip
    assert len(post) >= 8
    for command in post:
        where = f"{command.file}:{command.line}: {command.text}"
        assert command.learns or command.run_dir in WIRING_ONLY, (
            f"{where}: promises nothing: add a learns marker"
        )
    for path in DOCS:
        name = str(path.relative_to(ROOT))
        for promise in learning_promises(name, path.read_text()):
            lines = [command for command in commands if promise in command.learns]
            assert len(lines) == 1, (
                f"{name}: the learns marker of {promise.run_dir} names {len(lines)} run lines"
            )
            argv = lines[0].argv
            assert not is_launcher(argv) and argv[0] == "fntrain", f"{name}: {lines[0].text}: one process"
            assert _number(argv, "--train.train-iters", 0) // _number(argv, "--log-every", 10) >= 2, (
                f"{name}: {lines[0].text}: logs its metrics fewer than twice: nothing to see move"
            )


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
    run at once); a `--help` line, and a line whose run promises to learn, as written."""
    argv = command.argv
    if any(word in HELP for word in argv) or command.learns:
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


def by_document(commands: list[DocCommand]) -> list[list[DocCommand]]:
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
    """Whether the run tier runs `command`: not NOT_HERE, not the guide's (tests/docs/test_guide.py), not a
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
    after its line (`document_steps`), a run that promises to learn checked for it (`learned`); the
    failures, one entry each (a failed line does not stop the ones below)."""
    failures = []
    for parts, text, planned in document_steps(commands):
        where = f"{parts[0].file}:{parts[0].line}: {text}"
        result = run_to_end(["bash", "-c", text], f"the line {where}", 600, cwd=work, env=env)
        if result.returncode != 0:
            failures.append(f"{where}\n    exit {result.returncode}: {result.stderr.strip()[-600:]}")
        elif planned and not re.search(r"^train_iters +[1-9]", result.stdout, re.M):
            failures.append(f"{where}\n    planned no steps: {result.stdout.strip()[-600:]}")
        elif not planned and any(trains_nothing(part, result.stdout + result.stderr) for part in parts):
            failures.append(f"{where}\n    trained nothing: its run directory holds this run already (the line "
                            "needs its own --run-dir)")  # fmt: skip
        elif not planned:
            for promise in (promise for part in parts for promise in part.learns):
                if (shown := learned(promise, work / promise.run_dir / "metrics.jsonl")) is not None:
                    failures.append(f"{where}\n    did not learn: {shown}")
    return failures


# Two documents at a time, each in its own fresh directory: the commands are one-thread processes
# (OMP_NUM_THREADS=1), forked from the shared start-up server or starting torchrun, so two keep both of
# CI's cores busy.
PARALLEL_DOCUMENTS = 2


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_the_doc_commands_run_on_cpu_in_order(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers.fork_server import PRELOAD, started

    pytest.importorskip("transformers")
    commands = doc_commands()
    assert sum(map(runs_here, commands)) > 40 and sum(map(plans_here, commands)) > 30

    def run_in_a_fresh_directory(commands: list[DocCommand], env: dict[str, str]) -> list[str]:
        work = checkout_files(tmp_path / Path(commands[0].file).stem)
        return run_document(commands, work, {**env, "HOME": str(work / "home")})

    longest_first = sorted(by_document(commands), key=lambda lines: len(document_steps(lines)), reverse=True)
    with started(shell_env(tmp_path), PRELOAD) as env, ThreadPoolExecutor(PARALLEL_DOCUMENTS) as pool:
        ran = pool.map(lambda lines: run_in_a_fresh_directory(lines, env), longest_first)
        failures = [line for lines in ran for line in lines]
    assert not failures, "\n".join(failures)
