"""[issue 38] A command line the parser rejects is one line, exit status 2, no traceback, naming the
flag as typed and the value, for every `fntrain` command and `python -m recipes.X` alike; `--help` is
a short list of the common flags and `--help-all` tyro's full help with every flag."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fntrain.cli import dispatch, recipe_main
from fntrain.cli.config_file import parse_config_cli
from fntrain.cli.errors import CommandError
from fntrain.cli.flags import command_flags
from fntrain.cli.recipes import load_recipe
from fntrain.cli.short_help import COMMON_SHARED
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("tiny_gpt", "hf_causal_lm", "vlm")

# (id, argv, the whole line on stderr)
CASES = [
    ("typo", ["run", "tiny_gpt", "--train.train-iter", "20"],
     "fntrain run: unknown flag --train.train-iter (did you mean --train.train-iters?)"),
    ("typo-equals", ["run", "tiny_gpt", "--train.train-iter=20"],
     "fntrain run: unknown flag --train.train-iter (did you mean --train.train-iters?)"),
    ("last-part", ["run", "tiny_gpt", "--lr", "0.1"], "fntrain run: unknown flag --lr (did you mean --optim.lr?)"),
    ("negated-typo", ["run", "tiny_gpt", "--runtime.no-tf33"],
     "fntrain run: unknown flag --runtime.no-tf33 (did you mean --runtime.no-tf32?)"),
    ("nothing-close", ["run", "tiny_gpt", "--frobnicate", "3"],
     "fntrain run: unknown flag --frobnicate (fntrain run tiny_gpt --help lists the flags)"),
    ("two-unknown", ["run", "tiny_gpt", "--train.train-iter", "2", "--bogus"],
     "fntrain run: unknown flag --train.train-iter (did you mean --train.train-iters?); also unknown: --bogus"),
    ("word-for-int", ["run", "tiny_gpt", "--train.train-iters", "twenty"],
     "fntrain run: --train.train-iters expects an integer (or None), got 'twenty'"),
    ("float-for-int", ["run", "tiny_gpt", "--train.train-iters", "1e3"],
     "fntrain run: --train.train-iters expects an integer (or None), got '1e3'"),
    ("typed-with-underscores", ["run", "tiny_gpt", "--train.train_iters=x"],
     "fntrain run: --train.train_iters expects an integer (or None), got 'x'"),
    ("seed-word", ["run", "tiny_gpt", "--seed", "abc"], "fntrain run: --seed expects an integer, got 'abc'"),
    ("lr-word", ["run", "tiny_gpt", "--optim.lr", "fast"], "fntrain run: --optim.lr expects a number, got 'fast'"),
    ("list-of-words", ["run", "tiny_gpt", "--profiler.rank-ids", "a", "b"],
     "fntrain run: --profiler.rank-ids expects a list of integers (or None), got 'a b'"),
    ("device-choice", ["run", "tiny_gpt", "--runtime.device", "gpu"],
     "fntrain run: --runtime.device must be one of cpu, cuda, npu, auto, got 'gpu'"),
    ("strategy-choice", ["run", "tiny_gpt", "--parallel.strategy", "fsdp3"],
     "fntrain run: --parallel.strategy must be one of none, ddp, fsdp2, got 'fsdp3'"),
    ("no-value", ["run", "tiny_gpt", "--seed"], "fntrain run: --seed needs a value (an integer)"),
    ("stray-word", ["run", "tiny_gpt", "extra"], "fntrain run: unexpected argument 'extra'"),
    ("no-recipe", ["run"],
     "fntrain run: missing RECIPE (one of: dpo, grpo, hf_causal_lm, kd, tiny_gpt, vlm, or a path to a recipe .py file); "
     "fntrain run --help for usage"),
    ("flag-before-recipe", ["run", "--seed", "3"],
     "fntrain run: missing RECIPE (one of: dpo, grpo, hf_causal_lm, kd, tiny_gpt, vlm, or a path to a recipe .py file); "
     "fntrain run --help for usage"),
    ("plan-type", ["plan", "tiny_gpt", "--world-size", "two"], "fntrain plan: --world-size expects an integer, got 'two'"),
    ("plan-typo", ["plan", "tiny_gpt", "--world-sise", "2"],
     "fntrain plan: unknown flag --world-sise (did you mean --world-size?)"),
    ("config-choice", ["config", "tiny_gpt", "--format", "yaml"],
     "fntrain config: --format must be one of toml, json, got 'yaml'"),
    ("cp-nothing", ["cp"], "fntrain cp: needs a RECIPE and a DEST.py, got nothing; fntrain cp --help for usage"),
    ("cp-unknown-flag", ["cp", "tiny_gpt", "mine.py", "--forse"],
     "fntrain cp: unknown flag --forse (fntrain cp takes only --force); fntrain cp --help for usage"),
    ("recipes-argument", ["recipes", "tiny_gpt"],
     "fntrain recipes: takes no arguments, got tiny_gpt; fntrain recipes --help for usage"),
    ("plot-nothing", ["plot"], "fntrain plot: missing RUN_DIR; fntrain plot --help for usage"),
    ("plot-typo", ["plot", "runs/x", "--out-dri", "p"], "fntrain plot: unknown flag --out-dri (did you mean --out-dir?)"),
    ("tokenize-no-output", ["tokenize", "data.parquet"], "fntrain tokenize: missing required option --output"),
    ("tokenize-choice", ["tokenize", "a.txt", "--output", "o", "--format", "csv"],
     "fntrain tokenize: --format must be one of bin, npy, got 'csv'"),
    ("export-format", ["export", "ckpt", "out", "--format", "onnx"],
     "fntrain export: --format must be one of hf, dcp, got 'onnx'"),
    ("export-no-out", ["export", "ckpt"], "fntrain export: missing OUT"),
    ("export-step", ["export", "ckpt", "out", "--step", "last"],
     "fntrain export: --step expects an integer (or None), got 'last'"),
    ("unknown-command", ["rnu"], "fntrain: unknown command 'rnu' (did you mean run?); fntrain --help for usage"),
]  # fmt: skip


def parse_error_line(capsys, run) -> str:
    """Call `run()`: it exits 2 with exactly one line on stderr and no traceback; that line."""
    with pytest.raises(SystemExit) as exited:
        run()
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err and "╭" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("argv, line", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_rejected_command_line_is_one_line(capsys, argv, line):
    assert parse_error_line(capsys, lambda: dispatch(argv)) == line


def test_the_parse_error_comes_before_any_file(tmp_path, capsys):
    run_dir = tmp_path / "run"
    line = parse_error_line(capsys, lambda: dispatch(["run", "tiny_gpt", "--run-dir", str(run_dir), "--seed", "x"]))
    assert line == "fntrain run: --seed expects an integer, got 'x'" and not run_dir.exists()


def test_a_recipe_file_gives_the_same_lines(capsys):
    spec = load_recipe("tiny_gpt").spec
    for args, ending in (
        (["--train.train-iter", "20"], "unknown flag --train.train-iter (did you mean --train.train-iters?)"),
        (["--runtime.device", "gpu"], "--runtime.device must be one of cpu, cuda, npu, auto, got 'gpu'"),
    ):
        line = parse_error_line(capsys, lambda args=args: recipe_main(spec, args))
        assert line.endswith(f".py: {ending}"), line


def test_parse_config_cli_raises_the_line():
    recipe = load_recipe("tiny_gpt")
    with pytest.raises(CommandError, match=r"^--seed expects an integer, got 'abc'$"):
        parse_config_cli(recipe.config_cls, ["--seed", "abc"], prog="drv")


def test_end_to_end_in_a_new_process(tmp_path, fork_env):
    done = run_to_end(
        [fork_env["PYTHON_FORK"], "-m", "fntrain", "run", "tiny_gpt", "--train.train-iters", "twenty"],
        "`fntrain run tiny_gpt --train.train-iters twenty`", 120, cwd=tmp_path, env=fork_env,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "fntrain run: --train.train-iters expects an integer (or None), got 'twenty'\n"


# ----------------------------------------------------------------------------- --help and --help-all


def help_text(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        dispatch(argv)
    assert exited.value.code == 0
    return capsys.readouterr().out


def _documented_flags(recipe: str) -> set[str]:
    """The flags docs/config.md lists for `recipe` (the shared sections and the recipe's own)."""
    from fntrain.cli.config_doc import config_reference

    return set(re.findall(r"^\| `(--[\w.-]+)` \|", config_reference((recipe,)), flags=re.MULTILINE))


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_is_short_and_help_all_lists_every_flag(capsys, recipe):
    pytest.importorskip("transformers") if recipe != "tiny_gpt" else None
    documented = _documented_flags(recipe)
    config_cls = load_recipe(recipe).config_cls
    assert set(command_flags(config_cls)) == documented  # the walk --help uses sees the flags tyro parses
    short = help_text(capsys, ["run", recipe, "--help"])
    assert len(short.splitlines()) < 80, short
    assert "--help-all" in short and f"all {len(documented)}" in short
    shown = set(re.findall(r"^  (--[\w.\[\]-]+)", short, flags=re.MULTILINE))
    shown = {flag.replace("[no-]", "") for flag in shown}
    for flag in documented:  # the common flags: the recipe's own, and the shared ones COMMON_SHARED names
        listed = any(
            flag == entry or (entry.endswith(".") and flag.startswith(entry)) for entry in COMMON_SHARED
        )
        assert (flag in shown) == (listed or flag.split(".")[0] not in _shared_sections()), flag
    full = help_text(capsys, ["run", recipe, "--help-all"])
    missing = [
        flag for flag in documented if not re.search(rf"(^|[\s│,]){re.escape(flag)}([\s,]|$)", full, re.M)
    ]
    assert not missing and len(full.splitlines()) > 300


def _shared_sections() -> set[str]:
    from fntrain.run.config import JobConfig

    return {flag.split(".")[0] for flag in command_flags(JobConfig)}


def test_command_help_before_a_recipe(capsys):
    out = help_text(capsys, ["run", "--help"])
    assert "fntrain run RECIPE" in out and "tiny_gpt" in out and "--help-all" in out
    assert "fntrain plot" not in out  # the command's own usage, not every command's
    plan = help_text(capsys, ["plan", "tiny_gpt", "--help"])
    assert "--world-size INT" in plan and "Ranks the run would use" in plan and len(plan.splitlines()) < 80


def test_an_event_of_another_shape_is_still_one_line(capsys, monkeypatch):
    def unreadable(*args):  # as a tyro whose (private) event records changed shape
        raise AttributeError("lowered")

    monkeypatch.setattr("fntrain.cli.parse.error_line", unreadable)
    line = parse_error_line(capsys, lambda: dispatch(["plan", "tiny_gpt", "--seed", "x"]))
    assert line == "fntrain plan: this command line is not valid; fntrain plan tiny_gpt --help for usage"
