"""The `fntrain` command: recipes by name, `plan` without a model or a device, `run` with config files
fed back, `plot`, usage errors, and the packaging that ships the built-in recipes as `fntrain_recipes`."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import recipes.tiny_gpt as tiny_gpt
from fntrain.cli import dispatch, main, resolve_config
from fntrain.config_file import load_config, read_config_file
from fntrain.plan_report import checkpoint_steps, describe_run_plan, format_run_plan
from fntrain.recipes_registry import RecipeNotFound, available_recipes, load_recipe
from fntrain.state import loader_length, make_run_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = [  # a tiny GPT that trains two steps in well under a second
    "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
    "--train.global-batch-size", "4", "--train.micro-batch-size", "2", "--train.train-iters", "2",
    "--log-every", "0", "--schedule.warmup-iters", "0",
]  # fmt: skip
if hasattr(tiny_gpt.TinyGPTConfig(), "evaluate"):  # keep any end-of-run evaluation to one micro-batch
    TINY += ["--evaluate.max-batches", "1"]


# ----------------------------------------------------------------------------- fntrain plan


def test_plan_for_two_ranks(capsys):
    report = dispatch(
        ["plan", "tiny_gpt", "--world-size", "2", "--train.global-batch-size", "32", "--train.micro-batch-size",
         "8", "--train.train-iters", "100", "--runtime.device", "cuda",
         "--profiler.enabled", "--profiler.start-step", "3", "--profiler.stop-step", "5", "--profiler.rank-ids", "1",
         "--memory.enable", "--memory.start-step", "2", "--memory.end-step", "4", "--memory.dump-ranks", "0", "1"]
    )  # fmt: skip
    train_len, _ = tiny_gpt.dataset_sizes(tiny_gpt.TinyGPTConfig())
    steps_per_epoch = loader_length(train_len, 8, 2, True) // 2
    assert report["recipe"] == "tiny_gpt"
    assert (report["world_size"], report["dp_size"], report["micro_batches"]) == (2, 2, 2)
    assert report["dataset_len"] == train_len
    assert (report["train_iters"], report["steps_per_epoch"]) == (100, steps_per_epoch)
    assert report["epochs"] == math.ceil(100 / steps_per_epoch)
    assert report["profiler"]["steps"] == [3, 5] and report["profiler"]["ranks"] == [1]
    memory = report["memory"]
    assert memory["recorded_steps"] == [2, 3] and memory["writes_at"] == "before step 4"
    assert memory["recording_ranks"] == [0, 1] and memory["writing_ranks"] == [0, 1]

    text = capsys.readouterr().out
    assert "world size          2 (data-parallel 2)" in text
    assert f"steps per epoch     {steps_per_epoch}" in text
    assert "micro-batches/step  2 (global batch 32 = micro-batch 8 x 2 x data-parallel 2)" in text
    assert "profiler            steps 3..5 (from step 3) on rank 1" in text
    assert "records on every rank (2), writes on every rank (2)" in text


def test_plan_json_output_and_default_profiler_ranks(capsys):
    dispatch(["plan", "tiny_gpt", "--world-size", "2", "--json", "--profiler.enabled",
              "--profiler.start-on-init", "--profiler.stop-step", "4"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 2
    assert report["profiler"]["ranks"] == [0, 1]  # no rank_ids, no stage leaders: every rank
    assert report["profiler"]["starts_at"] == "TRAIN_BEGIN" and report["profiler"]["steps"] == [1, 4]


def test_plan_builds_no_model_reads_no_corpus_touches_no_device(monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("plan must not build the model, read the corpus or set up the runtime")

    module = load_recipe("tiny_gpt").module
    for name in ("TinyGPT", "build_datasets", "build", "setup_runtime", "run"):
        monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr(Path, "read_bytes", forbidden)
    report = dispatch(
        ["plan", "tiny_gpt", "--world-size", "4", "--train.micro-batch-size", "8", "--runtime.device", "npu"]
    )
    assert report["dp_size"] == 4
    assert "torch_npu" not in sys.modules


def test_plan_notes_normalised_and_impossible_windows():
    plan = make_run_plan(global_batch_size=4, micro_batch_size=2, train_iters=6, dataset_len=100)
    profiler = tiny_gpt.ProfilerConfig(enabled=True, start_step=5, stop_step=3)
    memory = tiny_gpt.MemoryConfig(enable=True, start_step=4, end_step=9, dump_ranks=[3])
    report = describe_run_plan(plan, world_size=2, device_type="cpu", profiler=profiler, memory=memory)
    assert report["profiler"]["steps"] == [1, 6] and report["profiler"]["partial"]  # normalised to 1..10
    assert any("start_step" in note for note in report["profiler"]["notes"])
    assert report["memory"]["recorded_steps"] == [4, 6]
    assert report["memory"]["writes_at"] == "at TRAIN_END (partial window)"
    notes = " ".join(report["memory"]["notes"])
    assert "cuda or npu" in notes and "names no rank" in notes
    text = format_run_plan(report)
    assert "partial: stops at TRAIN_END" in text and "writes on no rank" in text


def test_checkpoint_steps_in_the_plan():
    plan = make_run_plan(global_batch_size=4, micro_batch_size=2, train_iters=100, dataset_len=120)
    assert plan.steps_per_epoch == 30
    assert checkpoint_steps(plan, save_every=40) == [40, 80, 100]
    assert checkpoint_steps(plan, save_epochs=2) == [60, 100]
    assert checkpoint_steps(plan) == []
    config = SimpleNamespace(save_every=25, save_epochs=0, keep_last=2)
    report = describe_run_plan(plan, checkpoint=config)
    assert report["checkpoint"]["steps"] == [25, 50, 75, 100]
    assert "steps 25, 50, 75, 100 (4 saves), keep last 2" in format_run_plan(report)
    long = describe_run_plan(plan, checkpoint=SimpleNamespace(save_every=1))
    assert "1, 2, 3, 4, 5, ..., 98, 99, 100 (100 saves)" in format_run_plan(long)


def test_tiny_gpt_plan_uses_its_checkpoint_config_when_it_has_one():
    config = tiny_gpt.TinyGPTConfig()
    checkpoint = getattr(config, "checkpoint", None)
    report = tiny_gpt.plan(config, world_size=1)
    if checkpoint is None:
        assert "checkpoint" not in report
    else:
        assert "checkpoint" in report and isinstance(report["checkpoint"]["steps"], list)


def test_dataset_sizes_match_the_built_datasets():
    for config in (tiny_gpt.TinyGPTConfig(), tiny_gpt.TinyGPTConfig(model=tiny_gpt.ModelConfig(context=100))):
        train_set, val_set = tiny_gpt.build_datasets(config)
        assert tiny_gpt.dataset_sizes(config) == (len(train_set), len(val_set))


def test_plan_errors_name_the_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["plan", "tiny_gpt", "--train.global-batch-size", "30", "--train.micro-batch-size", "4"])
    assert exit_info.value.code == 2
    assert "global_batch_size (30)" in capsys.readouterr().err


# ----------------------------------------------------------------------------- fntrain run / config


def test_run_writes_a_config_that_feeds_back(tmp_path, capsys):
    run_dir = tmp_path / "run"
    state = dispatch(["run", "tiny_gpt", "--run-dir", str(run_dir), *TINY])
    assert state.global_step == 2
    # The command's module: fntrain_recipes.tiny_gpt when installed (editable too), else recipes.tiny_gpt.
    recipe = load_recipe("tiny_gpt")
    resolved = load_config(recipe.config_cls, run_dir / "config.json")
    assert (
        resolved.run_dir == str(run_dir) and resolved.train.train_iters == 2 and resolved.model.d_model == 32
    )

    assert resolve_config(recipe, ["--config", str(run_dir / "config.json")]) == resolved
    override = resolve_config(recipe, ["--config", str(run_dir / "config.json"), "--train.train-iters", "5"])
    assert override.train.train_iters == 5 and override.model.d_model == 32

    text = dispatch(["config", "tiny_gpt", "--config", str(run_dir / "config.json"), "--seed", "3"])
    assert capsys.readouterr().out == text
    (tmp_path / "seed3.toml").write_text(text)
    again = load_config(recipe.config_cls, tmp_path / "seed3.toml")
    assert again.seed == 3 and again.model == resolved.model and again.train == resolved.train


def test_recipe_main_takes_config_files_too(tmp_path):
    (tmp_path / "base.yaml").write_text(f"run_dir: {tmp_path / 'r'}\nmodel:\n  d_model: 32\n")
    state = tiny_gpt.main(["--config", str(tmp_path / "base.yaml"), *TINY])
    assert state.global_step == 2
    assert load_config(tiny_gpt.TinyGPTConfig, tmp_path / "r" / "config.json").model.d_model == 32


def test_bad_config_file_is_an_error_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\ntrain_iters = 'ten'\n")
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["run", "tiny_gpt", "--config", str(bad)])
    assert exit_info.value.code == 2
    assert "train.train_iters must be an int, got 'ten'" in capsys.readouterr().err
    bad.write_text("[optim]\nlearning_rate = 0.1\n")
    with pytest.raises(SystemExit):
        dispatch(["plan", "tiny_gpt", "--config", str(bad)])
    assert "unknown config key 'optim.learning_rate'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- recipes and usage


def test_recipes_resolve_by_name_dotted_path_and_entry_point(monkeypatch):
    recipe = load_recipe("tiny_gpt")
    assert recipe.config_cls is recipe.module.TinyGPTConfig and recipe.plan is not None
    assert load_recipe("tiny-gpt").module is recipe.module
    assert load_recipe("recipes.tiny_gpt").config_cls.__name__ == "TinyGPTConfig"
    assert {"tiny_gpt", "hf_causal_lm"} <= set(available_recipes())

    entry = importlib.metadata.EntryPoint(name="mine", value="recipes.tiny_gpt", group="fntrain.recipes")
    monkeypatch.setattr("fntrain.recipes_registry._entry_points", lambda: {"mine": entry})
    assert load_recipe("mine").module.__name__ == "recipes.tiny_gpt"
    assert available_recipes()["mine"] == "recipes.tiny_gpt"


def test_a_module_without_a_config_is_not_a_recipe(monkeypatch):
    package, module = types.ModuleType("fake_pkg"), types.ModuleType("fake_pkg.not_a_recipe")
    package.__path__ = []
    module.run = lambda config: None
    monkeypatch.setitem(sys.modules, "fake_pkg", package)
    monkeypatch.setitem(sys.modules, "fake_pkg.not_a_recipe", module)
    with pytest.raises(TypeError, match="must expose `Config`"):
        load_recipe("fake_pkg.not_a_recipe")
    with pytest.raises(RecipeNotFound, match="known recipes: .*tiny_gpt"):
        load_recipe("no_such_recipe")


def test_usage_errors_exit_2(capsys):
    for argv, words in (
        ([], "usage"),
        (["frobnicate"], "unknown command 'frobnicate'"),
        (["run"], "needs a RECIPE"),
        (["plan", "--world-size", "2"], "needs a RECIPE"),
        (["run", "no_such_recipe"], "no recipe named 'no_such_recipe'"),
        (["plot"], "needs a RUN_DIR"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            dispatch(argv)
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert words in captured.out + captured.err


def test_help_lists_commands_and_recipes(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "fntrain plan RECIPE" in out and "tiny_gpt" in out and "hf_causal_lm" in out
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["run", "tiny_gpt", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--train.train-iters" in out and "--config FILE" in out
    with pytest.raises(SystemExit):
        dispatch(["plan", "tiny_gpt", "--help"])
    assert "--world-size" in capsys.readouterr().out


def test_plot_calls_plot_run_lazily(monkeypatch, tmp_path, capsys):
    calls = []

    def plot_run(run_dir: str, out_dir: str | None = None) -> list[Path]:
        calls.append((run_dir, out_dir))
        return [Path(out_dir or run_dir) / "loss.png"]

    monkeypatch.setitem(sys.modules, "fntrain.plot", SimpleNamespace(plot_run=plot_run))
    paths = dispatch(["plot", str(tmp_path), "--out-dir", str(tmp_path / "plots")])
    assert calls == [(str(tmp_path), str(tmp_path / "plots"))]
    assert paths == [tmp_path / "plots" / "loss.png"]
    assert str(tmp_path / "plots" / "loss.png") in capsys.readouterr().out


def test_fntrain_import_stays_light():
    code = "import sys, fntrain, fntrain.cli, fntrain.config_file, fntrain.recipes_registry, fntrain.plan_report; " \
           "print(sorted(m for m in ('torch', 'tyro', 'tqdm', 'matplotlib', 'transformers') if m in sys.modules))"  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------- packaging


def _pyproject() -> dict:
    return read_config_file(ROOT / "pyproject.toml")  # tomllib, or tomli before Python 3.11


def test_wheel_lists_every_package_and_ships_recipes_as_fntrain_recipes():
    setuptools = _pyproject()["tool"]["setuptools"]
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "fntrain").rglob("__init__.py")
        if "__pycache__" not in path.parts
    }
    assert found <= set(setuptools["packages"]), (
        f"add {sorted(found - set(setuptools['packages']))} to pyproject"
    )
    assert "recipes" not in setuptools["packages"]  # never a top-level `recipes` in the wheel
    assert setuptools["package-dir"]["fntrain_recipes"] == "recipes"
    assert _pyproject()["project"]["scripts"]["fntrain"] == "fntrain.cli:main"


def test_entry_points_name_the_checkouts_recipes():
    entry_points = _pyproject()["project"]["entry-points"]["fntrain.recipes"]
    assert {"tiny_gpt", "hf_causal_lm"} <= set(entry_points)
    for name, target in entry_points.items():
        package, module = target.split(".")
        assert package == "fntrain_recipes" and (ROOT / "recipes" / f"{module}.py").is_file(), name


@pytest.mark.slow
def test_installed_wheel_runs_plan_outside_the_checkout(tmp_path):
    """Build the wheel, install it (no deps: they come from this environment) into a fresh venv, and
    run `fntrain` from a directory with no checkout in sight."""
    import sysconfig

    source = tmp_path / "src"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "runs")
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
        check=True,
    )  # fmt: skip
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, tyro, ...
    wheel = next(wheels.glob("fntrain-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
    )  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def fntrain(*args: str) -> str:
        result = subprocess.run(
            [str(venv / "bin" / "fntrain"), *args], cwd=elsewhere, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    report = json.loads(fntrain("plan", "tiny_gpt", "--world-size", "2", "--json"))
    assert report["dp_size"] == 2 and report["dataset_len"] > 0  # the corpus ships as package data
    listed = fntrain("recipes")
    assert "fntrain_recipes.tiny_gpt" in listed and "fntrain_recipes.hf_causal_lm" in listed
    probe = "import importlib.util as u; print(u.find_spec('recipes'), u.find_spec('fntrain_recipes').origin)"
    out = subprocess.run(
        [str(python), "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True
    ).stdout
    assert out.startswith("None ") and str(venv) in out  # no top-level `recipes` installed
    assert "train_iters" in fntrain("config", "tiny_gpt", "--format", "toml")
