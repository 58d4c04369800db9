"""`fntrain.run.job`: the run skeleton driven by a spec written here, as a user would write a recipe.

The recipe below (config, model, data, a custom forward) is the ~40 lines a user writes; everything else
(runtime, hooks, checkpoints, evaluation, export, plans, the one-line errors) comes from the job."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from fntrain import Event, StopTraining
from fntrain.config import ConfigError, require_int
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.run.checks import check_values
from fntrain.run.config import CheckpointConfig, JobConfig, RecipeSpec, TrainConfig
from fntrain.run.job import plan_job, run_job
from fntrain.runtime.materialize import build_seeded_model

# ----------------------------------------------------------------------------- a recipe in ~40 lines


@dataclass(frozen=True)
class ToyModelConfig:
    vocab: int = 16
    width: int = 8

    def validate(self, prefix: str = "model") -> None:
        require_int(f"{prefix}.vocab", self.vocab, min=2)
        require_int(f"{prefix}.width", self.width, min=1)


@dataclass(frozen=True)
class ToyConfig(JobConfig):
    run_dir: str = "runs/toy"
    log_every: int = 2
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(train_iters=4, global_batch_size=4, micro_batch_size=2)
    )
    progress: ProgressConfig = field(default_factory=lambda: ProgressConfig(enabled=False))
    model: ToyModelConfig = field(default_factory=ToyModelConfig)


class JobLM(nn.Module):
    """Embeddings plus a per-sample bias vector ("features", like an image) and a linear head."""

    def __init__(self, cfg: ToyModelConfig):
        super().__init__()
        self.embed, self.head = nn.Embedding(cfg.vocab, cfg.width), nn.Linear(cfg.width, cfg.vocab)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids) + features[:, None, :])


def toy_datasets(config: ToyConfig, assets: Any) -> tuple[list, list]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.model.vocab, (40, 6), generator=generator)
    feats = torch.randn(40, config.model.width, generator=generator)
    samples = [{"input_ids": i, "labels": i, "features": f} for i, f in zip(ids, feats, strict=True)]
    return samples[:32], samples[32:]


def toy_forward(model: nn.Module, batch: Any) -> torch.Tensor:  # passes what model(**batch) would not
    return model(batch["input_ids"], batch["features"])


spec = RecipeSpec(
    config=ToyConfig,
    build_model=lambda config, runtime: build_seeded_model(
        lambda: JobLM(config.model), runtime, config.parallel, seed=config.seed
    ),
    build_datasets=toy_datasets,
    forward=toy_forward,
    model_factory=lambda config: JobLM(config.model),
    dataset_sizes=lambda config: (32, 8),
)

# ----------------------------------------------------------------------------- tests


def toy(tmp_path, **changes: Any) -> ToyConfig:
    return dataclasses.replace(ToyConfig(run_dir=str(tmp_path / "run")), **changes)


def records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_run_job_trains_logs_evaluates_checkpoints_and_exports(tmp_path):
    config = toy(tmp_path, evaluate=EvaluateConfig(eval_every=2), checkpoint=CheckpointConfig(save_every=2))
    result = run_job(config, spec)
    assert (result.outcome, result.exit_code, result.state.global_step) == ("completed", 0, 4)
    run_dir = tmp_path / "run"
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["model"] == {"vocab": 16, "width": 8} and saved["seed"] == 42
    rows = records(tmp_path)
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]  # evaluation went through toy_forward
    assert all(r["tflops"] > 0 for r in rows if "loss" in r)  # FLOPs counted through toy_forward too
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_2", "step_4"]
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "run_metadata.json").is_file()


def test_the_specs_forward_reaches_step_evaluation_and_flop_counting(tmp_path):
    seen: list[int] = []

    def counting_forward(model: nn.Module, batch: Any) -> torch.Tensor:
        seen.append(batch["input_ids"].shape[0])
        return toy_forward(model, batch)

    config = toy(tmp_path, evaluate=EvaluateConfig(eval_every=4, max_batches=1, micro_batch_size=3))
    run_job(config, dataclasses.replace(spec, forward=counting_forward))
    # one FLOP count (micro-batch 2), 4 steps x 2 micro-batches of 2, one evaluation micro-batch of 3
    assert seen.count(2) == 1 + 8 and seen.count(3) == 1


def test_resume_continues_where_the_checkpoint_left_off(tmp_path):
    whole = run_job(toy(tmp_path / "a"), spec)
    first = toy(tmp_path / "b", train=dataclasses.replace(ToyConfig().train, train_iters=4))
    run_job(dataclasses.replace(first, checkpoint=CheckpointConfig(save_every=2, save_at_end=False)), spec)
    step_2 = tmp_path / "b" / "run" / "checkpoints" / "step_2"
    resumed = run_job(dataclasses.replace(first, checkpoint=CheckpointConfig(restore_from=str(step_2))), spec)
    assert resumed.state == whole.state
    a = [r["loss"] for r in records(tmp_path / "a") if "loss" in r]
    b = [r["loss"] for r in records(tmp_path / "b") if "loss" in r]
    assert b[-1] == a[-1]  # the resumed run's step 4 equals the uninterrupted one, bit for bit


def test_extra_hooks_run_and_a_stop_is_a_value(tmp_path):
    events: list[tuple[Event, int]] = []

    def stop_at_3(event: Event, state: Any, info: Any) -> None:
        events.append((event, state.global_step))
        if event is Event.STEP_END and state.global_step == 3:
            raise StopTraining("enough")

    result = run_job(toy(tmp_path), dataclasses.replace(spec, hooks=lambda built: [stop_at_3]))
    assert (result.outcome, result.reason, result.state.global_step) == ("stopped", "enough", 3)
    assert events[0][0] is Event.TRAIN_BEGIN and events[-1] == (Event.TRAIN_END, 3)


def test_a_loss_with_bind_model_is_bound_once_to_the_built_model(tmp_path):
    from fntrain.step import causal_lm_loss

    bound: list[nn.Module] = []

    class BindingLoss:
        def __call__(self, output: Any, batch: Any) -> torch.Tensor:
            return causal_lm_loss(output, batch)

        def bind_model(self, model: nn.Module) -> None:
            bound.append(model)

    run_job(toy(tmp_path), dataclasses.replace(spec, loss=BindingLoss()))
    assert len(bound) == 1 and isinstance(bound[0], JobLM)


def test_plan_job_resolves_without_building(tmp_path):
    config = toy(tmp_path, checkpoint=CheckpointConfig(save_every=3))
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, strategy="ddp"))
    report = plan_job(config, spec, world_size=2)

    assert (report["dp_size"], report["micro_batches"], report["train_iters"]) == (2, 1, 4)
    assert report["steps_per_epoch"] == 32 // 4 and report["checkpoint"]["steps"] == [3, 4]
    assert report["val_samples"] == 8 and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"seed": -1}, "seed must be >= 0, got -1"),
        ({"model": ToyModelConfig(vocab=1)}, "model.vocab must be >= 2, got 1"),
        (
            {"train": TrainConfig(train_iters=None)},
            "set exactly one of train.train_iters and train.train_samples",
        ),
        (
            {"train": TrainConfig(global_batch_size=6, micro_batch_size=4)},
            "train.global_batch_size (6) must be",
        ),
        (
            {"optim": dataclasses.replace(ToyConfig().optim, lr=float("inf"))},
            "optim.lr must be a finite number",
        ),
        (
            {"optim": dataclasses.replace(ToyConfig().optim, lr=float("nan"))},
            "optim.lr must be a finite number",
        ),
    ],
)
def test_every_bad_value_fails_before_any_file_or_model(tmp_path, changes, message):
    config = toy(tmp_path, **changes)
    with pytest.raises((ValueError, TypeError)) as caught:
        check_values(config, 1)
    assert message in str(caught.value)
    with pytest.raises((ValueError, TypeError)):
        run_job(config, dataclasses.replace(spec, build_model=lambda *a: pytest.fail("built a model")))
    assert not (tmp_path / "run").exists()


def test_data_smaller_than_one_step_is_a_setting_error(tmp_path):
    tiny_data = dataclasses.replace(
        spec, build_datasets=lambda config, assets: (toy_datasets(config, assets)[0][:3], [])
    )
    with pytest.raises(ConfigError, match="must provide one complete optimizer step"):
        run_job(toy(tmp_path), tiny_data)


def test_a_spec_needs_a_job_config():
    with pytest.raises(TypeError, match="JobConfig subclass"):
        RecipeSpec(config=dict, build_model=lambda *a: None, build_datasets=lambda *a: None)


def test_the_specs_eval_metrics_join_each_evaluation(tmp_path):
    calls: list[int] = []

    def eval_metrics(config: ToyConfig, built: Any) -> Any:
        assert built.components.model is not None
        return lambda: calls.append(1) or {"val_accuracy": 0.5}

    config = toy(tmp_path, evaluate=EvaluateConfig(eval_every=2, max_batches=1))
    run_job(config, dataclasses.replace(spec, eval_metrics=eval_metrics))
    rows = [r for r in records(tmp_path) if "val_loss" in r]
    assert [(r["step"], r["val_accuracy"]) for r in rows] == [(2, 0.5), (4, 0.5)] and len(calls) == 2
