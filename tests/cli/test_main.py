"""The `fntrain` command: recipes by name, `plan` without a model or a device, `run` with config files
fed back, `plot`, usage errors, and the packaging that ships the built-in recipes as `fntrain_recipes`."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import shutil
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

import recipes.tiny_gpt as tiny_gpt
from fntrain.cli import dispatch, main, recipe_main, resolve_config
from fntrain.cli.config_file import load_config, read_config_file
from fntrain.cli.recipes import RecipeNotFound, available_recipes, load_recipe
from fntrain.config import ConfigError
from fntrain.hooks.memory import MemoryConfig
from fntrain.hooks.profiler import ProfilerConfig
from fntrain.plan.render import format_run_plan
from fntrain.plan.report import PlanInputs, checkpoint_steps, describe_run_plan
from fntrain.run.config import CheckpointConfig
from fntrain.run.job import plan_job
from fntrain.runtime.parallel import ParallelConfig
from fntrain.state import loader_length, make_run_plan
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
TINY = [  # a tiny GPT that trains two steps in well under a second
    "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
    "--train.global-batch-size", "4", "--train.micro-batch-size", "2", "--train.train-iters", "2",
    "--log-every", "0", "--schedule.warmup-iters", "0",
]  # fmt: skip
TINY += ["--evaluate.max-batches", "1"]  # keep the end-of-run evaluation to one micro-batch


# ----------------------------------------------------------------------------- fntrain plan


def test_plan_for_two_ranks(capsys):
    report = dispatch(
        ["plan", "tiny_gpt", "--world-size", "2", "--train.global-batch-size", "32", "--train.micro-batch-size",
         "8", "--train.train-iters", "100", "--runtime.device", "cuda", "--parallel.strategy", "ddp",
         "--profiler.enabled", "--profiler.start-step", "3", "--profiler.stop-step", "5", "--profiler.rank-ids", "1",
         "--memory.enable", "--memory.start-step", "2", "--memory.end-step", "4", "--memory.dump-ranks", "0", "1"]
    )  # fmt: skip
    train_len, _ = tiny_gpt.dataset_sizes(tiny_gpt.Config())
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
    dispatch(["plan", "tiny_gpt", "--world-size", "2", "--parallel.strategy", "ddp", "--json", "--profiler.enabled",
              "--profiler.start-on-init", "--profiler.stop-step", "4"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 2
    assert report["profiler"]["ranks"] == [0, 1]  # no rank_ids, no stage leaders: every rank
    assert report["profiler"]["starts_at"] == "TRAIN_BEGIN" and report["profiler"]["steps"] == [1, 4]


def test_plan_prints_the_mesh_and_its_stage_leaders(capsys):
    dispatch(["plan", "tiny_gpt", "--world-size", "2", "--parallel.strategy", "ddp", "--json"])
    assert json.loads(capsys.readouterr().out)["mesh"]["dims"] == [["dp", 2]]
    plan = make_run_plan(
        global_batch_size=32, micro_batch_size=8, train_iters=10, dataset_len=1000, dp_size=2
    )
    parallel = ParallelConfig(strategy="fsdp2", tp_size=2, pp_size=2)
    profiler = ProfilerConfig(enabled=True, pipeline_stage_leaders=True)
    report = describe_run_plan(plan, PlanInputs(world_size=8, pp_size=2, parallel=parallel, profiler=profiler))
    mesh = report["mesh"]
    assert mesh["dims"] == [["pp", 2], ["dp", 2], ["tp", 2]]
    assert [entry["rank"] for entry in mesh["ranks"]] == list(range(8)) and mesh["all_ranks_shown"]
    rank5 = mesh["ranks"][5]
    assert rank5["coordinates"] == {"pp": 1, "dp": 0, "tp": 1}
    assert rank5["groups"] == {"pp": [1, 5], "dp": [5, 7], "tp": [4, 5]}
    assert mesh["stage_leaders"] == [0, 4] == report["profiler"]["ranks"]  # the profiler agrees
    text = format_run_plan(report)
    assert "mesh                pp 2 x dp 2 x tp 2 (row-major" in text
    assert "  rank 5            pp 1, dp 0, tp 1  [pp group 1, 5; dp group 5, 7; tp group 4, 5]" in text
    assert "  stage leaders     ranks 0, 4" in text


def test_plan_mesh_of_a_large_hsdp_world_shows_head_and_tail():
    plan = make_run_plan(
        global_batch_size=64, micro_batch_size=1, train_iters=10, dataset_len=1000, dp_size=32
    )
    parallel = ParallelConfig(strategy="fsdp2", tp_size=2, replicate=4)
    report = describe_run_plan(plan, PlanInputs(world_size=64, parallel=parallel))
    mesh = report["mesh"]
    assert mesh["dims"] == [["dp_replicate", 4], ["dp_shard", 8], ["tp", 2]]
    assert [entry["rank"] for entry in mesh["ranks"]] == [0, 1, 2, 3, 60, 61, 62, 63]
    last = mesh["ranks"][-1]
    assert last["coordinates"] == {"dp_replicate": 3, "dp_shard": 7, "tp": 1, "dp": 31}
    assert last["groups"]["dp_shard"] == list(range(49, 64, 2)) and last["groups"]["dp"] == list(
        range(1, 64, 2)
    )
    text = format_run_plan(report)
    assert "  ...               ranks 4..59 not shown" in text
    assert (
        "  rank 63           dp 31 (replica 3, shard 7), tp 1  [dp group 1, 3, 5, 7, 9, ..., 59, 61, 63; "
        in text
    )


def test_plan_renders_the_memory_per_rank_estimate():
    from fntrain.plan.memory import plan_memory

    config = dataclasses.replace(tiny_gpt.Config(), parallel=ParallelConfig(strategy="ddp"))
    plan = make_run_plan(
        global_batch_size=32, micro_batch_size=16, train_iters=10, dataset_len=1000, dp_size=2
    )
    memory = plan_memory(config, tiny_gpt.spec.model_factory, world_size=2)
    text = format_run_plan(describe_run_plan(plan, PlanInputs(world_size=2), extra={"memory_per_rank": memory}))
    assert "memory per rank     84.19 MiB: weights 3.21 MiB, grads 6.43 MiB, AdamW 6.43 MiB" in text
    assert "842,496 parameters, 842,496 per rank; micro-batch 16 x 128 tokens, fp32" in text


def test_plan_builds_no_model_reads_no_corpus_touches_no_device(monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("plan must not build the model, read the corpus or set up the runtime")

    module = load_recipe("tiny_gpt").module
    for name in ("build_datasets", "build_model"):
        monkeypatch.setattr(module, name, forbidden)
    real_model = module.TinyGPT

    def on_meta_only(*args, **kwargs):  # the memory estimate counts parameters on the meta device
        import torch

        if torch.empty(0).device.type != "meta":
            forbidden()
        return real_model(*args, **kwargs)

    monkeypatch.setattr(module, "TinyGPT", on_meta_only)

    monkeypatch.setattr("fntrain.runtime.setup.setup_runtime", forbidden)
    monkeypatch.setattr(Path, "read_bytes", forbidden)
    report = dispatch(
        [
            "plan",
            "tiny_gpt",
            "--world-size",
            "4",
            "--train.micro-batch-size",
            "8",
            "--runtime.device",
            "npu",
            "--parallel.strategy",
            "fsdp2",
        ]
    )
    assert report["dp_size"] == 4
    assert "torch_npu" not in sys.modules


def test_plan_notes_normalised_and_impossible_windows():
    plan = make_run_plan(global_batch_size=4, micro_batch_size=2, train_iters=6, dataset_len=100)
    with pytest.raises(ConfigError, match="profiler.stop_step"):  # a reversed window is refused
        describe_run_plan(plan, PlanInputs(world_size=2, device_type="cpu", profiler=ProfilerConfig(enabled=True, start_step=5, stop_step=3)))
    profiler = ProfilerConfig(enabled=True, start_step=5, stop_step=9)
    memory = MemoryConfig(enable=True, start_step=4, end_step=9, dump_ranks=[3])
    report = describe_run_plan(plan, PlanInputs(world_size=2, device_type="cpu", profiler=profiler, memory=memory))
    assert report["profiler"]["steps"] == [5, 6] and report["profiler"]["partial"]  # the run ends at 6
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
    report = describe_run_plan(plan, PlanInputs(checkpoint=config))
    assert report["checkpoint"]["steps"] == [25, 50, 75, 100]
    assert "steps 25, 50, 75, 100 (4 saves), keep last 2" in format_run_plan(report)
    long = describe_run_plan(plan, PlanInputs(checkpoint=SimpleNamespace(save_every=1)))
    assert "1, 2, 3, 4, 5, ..., 98, 99, 100 (100 saves)" in format_run_plan(long)


def test_tiny_gpt_plan_uses_its_checkpoint_config():
    config = dataclasses.replace(tiny_gpt.Config(), checkpoint=CheckpointConfig(save_every=100))
    report = plan_job(config, tiny_gpt.spec, world_size=1)
    assert report["checkpoint"]["steps"] == [100, 200, 300, 400]


def test_dataset_sizes_match_the_built_datasets():
    for config in (tiny_gpt.Config(), tiny_gpt.Config(model=tiny_gpt.ModelConfig(context=100))):
        train_set, val_set = tiny_gpt.build_datasets(config)
        assert tiny_gpt.dataset_sizes(config) == (len(train_set), len(val_set))


def test_plan_errors_name_the_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["plan", "tiny_gpt", "--train.global-batch-size", "30", "--train.micro-batch-size", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--train.global-batch-size (30) must be divisible by --train.micro-batch-size (4)" in err
    assert len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- fntrain run / config


def test_run_writes_a_config_that_feeds_back(tmp_path, capsys):
    run_dir = tmp_path / "run"
    result = dispatch(["run", "tiny_gpt", "--run-dir", str(run_dir), *TINY])
    assert (result.state.global_step, result.outcome, result.exit_code) == (2, "completed", 0)
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
    with pytest.raises(SystemExit) as exit_info:  # python -m recipes.tiny_gpt ends the process
        recipe_main(tiny_gpt.spec, ["--config", str(tmp_path / "base.yaml"), *TINY])
    assert exit_info.value.code == 0
    assert load_config(tiny_gpt.Config, tmp_path / "r" / "config.json").model.d_model == 32


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
    assert recipe.config_cls is recipe.module.Config and recipe.spec is recipe.module.spec
    assert load_recipe("tiny-gpt").module is recipe.module
    assert load_recipe("recipes.tiny_gpt").config_cls.__name__ == "Config"
    assert {"tiny_gpt", "hf_causal_lm"} <= set(available_recipes())

    entry = importlib.metadata.EntryPoint(name="mine", value="recipes.tiny_gpt", group="fntrain.recipes")
    monkeypatch.setattr("fntrain.cli.recipes._entry_points", lambda: {"mine": entry})
    assert load_recipe("mine").module.__name__ == "recipes.tiny_gpt"
    assert available_recipes()["mine"] == "recipes.tiny_gpt"


def test_a_module_without_a_spec_is_not_a_recipe(monkeypatch):
    package, module = types.ModuleType("fake_pkg"), types.ModuleType("fake_pkg.not_a_recipe")
    package.__path__ = []
    module.run = lambda config: None
    monkeypatch.setitem(sys.modules, "fake_pkg", package)
    monkeypatch.setitem(sys.modules, "fake_pkg.not_a_recipe", module)
    with pytest.raises(RecipeNotFound, match="must define `spec = fntrain.run.config.RecipeSpec"):
        load_recipe("fake_pkg.not_a_recipe")
    with pytest.raises(RecipeNotFound, match="known recipes: .*tiny_gpt"):
        load_recipe("no_such_recipe")


def test_usage_errors_exit_2(capsys):
    for argv, words in (
        ([], "usage"),
        (["frobnicate"], "unknown command 'frobnicate'"),
        (["rnu"], "unknown command 'rnu' (did you mean run?)"),
        (["run"], "missing RECIPE"),
        (["plan", "--world-size", "2"], "missing RECIPE"),
        (["run", "no_such_recipe"], "no recipe named 'no_such_recipe'"),
        (["plot"], "missing RUN_DIR"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            dispatch(argv)
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert words in captured.out + captured.err
        assert not argv or len(captured.err.strip().splitlines()) == 1, captured.err  # [issue 38] no usage block


def test_help_lists_commands_and_recipes(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "fntrain plan RECIPE" in out and "tiny_gpt" in out and "hf_causal_lm" in out
    # [issue 27] the recipes named are the registry's, all of them, and the prose names no subset
    prose, listing = out.split("\nrecipes:\n")
    assert "the built-ins:" not in prose
    listed = [line.split()[0] for line in listing.strip().splitlines()]
    assert listed == sorted(available_recipes()) and {"tiny_gpt", "hf_causal_lm", "vlm"} <= set(listed)
    assert all("(built-in)" in line for line in listing.splitlines() if line.split()[:1] == ["vlm"])
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

    monkeypatch.setitem(sys.modules, "fntrain.cli.plot", SimpleNamespace(plot_run=plot_run))
    paths = dispatch(["plot", str(tmp_path), "--out-dir", str(tmp_path / "plots")])
    assert calls == [(str(tmp_path), str(tmp_path / "plots"))]
    assert paths == [tmp_path / "plots" / "loss.png"]
    assert str(tmp_path / "plots" / "loss.png") in capsys.readouterr().out


def test_fntrain_import_stays_light():
    code = "import sys, fntrain, fntrain.cli, fntrain.cli.config_file, fntrain.cli.recipes, fntrain.plan.report; " \
           "print(sorted(m for m in ('torch', 'tyro', 'tqdm', 'matplotlib', 'transformers') if m in sys.modules))"  # fmt: skip
    done = run_to_end([sys.executable, "-c", code], "the import of fntrain's CLI modules", 120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "[]"


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
    # Not the dot directories: .git, and the .venv CI creates in the checkout (2 GB of torch)
    skipped = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "runs")
    shutil.copytree(ROOT, source, ignore=skipped)
    wheels = tmp_path / "wheels"

    def checked(command: list[str], what: str, timeout: float = 120) -> str:
        done = run_to_end(command, what, timeout)
        assert done.returncode == 0, f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    pip = [sys.executable, "-m", "pip"]
    checked([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
            "`pip wheel` of the copied checkout", 300)  # fmt: skip
    venv = tmp_path / "venv"
    checked([sys.executable, "-m", "venv", "--without-pip", str(venv)], "the creation of the venv")
    python = venv / "bin" / "python"
    purelib = checked([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                      "the venv's Python asked for its purelib").strip()  # fmt: skip
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, tyro, ...
    wheel = next(wheels.glob("fntrain-*.whl"))
    checked([*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
            "`pip install` of the wheel into the venv", 300)  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def fntrain(*args: str) -> str:
        what = f"the installed `fntrain {' '.join(args)}`"
        result = run_to_end([str(venv / "bin" / "fntrain"), *args], what, 120, cwd=elsewhere, env=env)
        assert result.returncode == 0, result.stderr
        return result.stdout

    report = json.loads(
        fntrain("plan", "tiny_gpt", "--world-size", "2", "--parallel.strategy", "ddp", "--json")
    )
    assert report["dp_size"] == 2 and report["dataset_len"] > 0  # the corpus ships as package data
    listed = fntrain("recipes")
    assert "fntrain_recipes.tiny_gpt" in listed and "fntrain_recipes.hf_causal_lm" in listed
    probe = "import importlib.util as u; print(u.find_spec('recipes'), u.find_spec('fntrain_recipes').origin)"
    out = run_to_end([str(python), "-c", probe], "the venv's probe", 120, cwd=elsewhere, env=env).stdout
    assert out.startswith("None ") and str(venv) in out  # no top-level `recipes` installed
    assert "train_iters" in fntrain("config", "tiny_gpt", "--format", "toml")


# ----------------------------------------------------------------------------- one-line errors, cp


BAD_VALUES = [
    (["--optim.lr", "-1"], "--optim.lr must be > 0.0, got -1.0"),
    (["--optim.lr", "nan"], "--optim.lr must be a finite number, got nan"),
    (["--optim.lr", "inf"], "--optim.lr must be a finite number, got inf"),
    (["--train.train-iters", "-3"], "--train.train-iters must be >= 1, got -3"),
    (["--checkpoint.save-every", "-1"], "--checkpoint.save-every must be >= 0, got -1"),
    (["--model.n-head", "3"], "--model.d-model (128) must be divisible by --model.n-head (3)"),
    (["--train.global-batch-size", "30"], "--train.global-batch-size (30) must be divisible by"),
    (["--data.path", "no_such.txt"], "--data.path 'no_such.txt' does not exist"),
    (
        ["--profiler.enabled", "--profiler.rank-ids", "8"],
        "--profiler.rank-ids must contain integers in [0, 1)",
    ),
    (["--memory.enable"], "cpu"),
]


@pytest.mark.parametrize("args, words", BAD_VALUES)
def test_every_bad_value_is_one_line_naming_the_flag_before_any_file(tmp_path, capsys, args, words):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["run", "tiny_gpt", "--run-dir", str(run_dir), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and words in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "[S" not in err
    assert not run_dir.exists()  # no file was written


def test_python_dash_m_recipe_gives_the_same_one_line_errors(tmp_path, fork_env):
    for args, words in (BAD_VALUES[0], (["--config", str(tmp_path / "missing.toml")], "missing.toml")):
        result = run_to_end(
            [fork_env["PYTHON_FORK"], "-m", "recipes.tiny_gpt", "--run-dir", str(tmp_path / "run"), *args],
            f"`python -m recipes.tiny_gpt {' '.join(args)}`", 120, cwd=ROOT, env=fork_env,
        )  # fmt: skip
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_help_shows_no_spec_tags(capsys):
    import re

    for recipe in ("tiny_gpt", "hf_causal_lm"):
        with pytest.raises(SystemExit):
            dispatch(["run", recipe, "--help"])
        out = capsys.readouterr().out
        assert "--train.train-iters" in out and not re.search(r"\[S\d+", out), re.findall(r".*\[S\d+.*", out)


def test_cp_copies_a_recipe_that_runs_from_its_new_place(tmp_path, capsys):
    dest = tmp_path / "mine" / "my_gpt.py"
    assert dispatch(["cp", "tiny_gpt", str(dest)]) == str(dest)
    assert "fntrain run" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # never overwrites without --force
        dispatch(["cp", "tiny_gpt", str(dest)])
    assert exit_info.value.code == 2 and "--force" in capsys.readouterr().err
    report = dispatch(["plan", str(dest), "--world-size", "2", "--parallel.strategy", "ddp", "--json"])
    assert report["dp_size"] == 2 and report["dataset_len"] > 0  # the corpus is found through the package
    result = dispatch(["run", str(dest), "--run-dir", str(tmp_path / "a"), *TINY])
    assert result.state.global_step == 2
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = run_to_end([sys.executable, str(dest), "--run-dir", str(tmp_path / "b"), *TINY],
                     "the copied recipe run as a script", 180, cwd=tmp_path, env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_layers_only_import_downwards():
    """Nothing below the hooks imports fntrain.hooks, fntrain.cli, fntrain.run or recipes; state.py,
    loop.py and stateful.py import only the standard library (and each other)."""
    import ast

    forbidden = ("fntrain.hooks", "fntrain.cli", "fntrain.run.", "recipes", "fntrain_recipes")
    lower = ["state.py", "loop.py", "stateful.py", "config.py", "data", "checkpoint", "runtime", "models"]
    for entry in lower:
        for path in (
            sorted((ROOT / "fntrain" / entry).rglob("*.py"))
            if entry.find(".") < 0
            else [ROOT / "fntrain" / entry]
        ):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                )  # fmt: skip
                for name in names:
                    assert not name.startswith(forbidden) and name != "fntrain.run", f"{path.relative_to(ROOT)} imports {name}"
                    if path.name in ("state.py", "loop.py", "stateful.py"):
                        assert not name.startswith(("torch", "numpy", "optree")), (
                            f"{path.name} imports {name}"
                        )


def test_plan_of_a_world_with_strategy_none_plans_ddp_and_says_so(capsys):
    """Asked for 8 ranks, `fntrain plan` shows them (as ddp, with a note naming the flag); a run stays
    strict: strategy none over 8 data-parallel ranks is refused, naming --parallel.strategy."""
    from fntrain.run.checks import check_values
    from recipes import tiny_gpt

    report = dispatch(["plan", "tiny_gpt", "--world-size", "8", "--train.micro-batch-size", "4"])
    assert (report["dp_size"], report["mesh"]["dims"]) == (8, [["dp", 8]])
    assert report["notes"] == ["--parallel.strategy none cannot train 8 data-parallel ranks: planned as ddp; "
                               "pass --parallel.strategy ddp (or fsdp2) to run it"]  # fmt: skip
    assert "note                --parallel.strategy none cannot train 8" in capsys.readouterr().out
    assert dispatch(["plan", "tiny_gpt", "--world-size", "8", "--train.micro-batch-size", "4",
                     "--parallel.strategy", "fsdp2"])["notes"] == []  # fmt: skip
    with pytest.raises(ValueError, match="--parallel.strategy none cannot train 8 data-parallel ranks"):
        check_values(tiny_gpt.Config(), 8)
