"""Samples during training (fntrain/hooks/sample.py): at its steps, rank 0 samples each prompt in eval mode
and writes the log, samples.jsonl and the text sinks; it restores the model's mode, touches no global RNG,
adds no work to other steps, and leaves a run's losses bit for bit as they were."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import types

import pytest
import torch

from fntrain.config import ConfigError
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.metrics_log import MetricsLog
from fntrain.hooks.progress import ProgressConfig
from fntrain.hooks.sample import SampleConfig, check_sampling, generator_for, sample_hook
from fntrain.hooks.sinks import JsonlSink
from fntrain.loop import Event, StepInfo
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.run.checks import check_run
from fntrain.run.job import run_job
from fntrain.runtime.runtime import Runtime
from fntrain.sampling import sample_tokens
from fntrain.state import TrainState
from recipes import tiny_gpt
from tests.hooks.drive import drive, torch_op_recorder


def gpt_sampler(model):
    """The tiny_gpt recipe's byte sampler over a bare model."""

    def sample(prompt, settings, generator):
        ids = torch.tensor(list(prompt.encode("utf-8")))
        return bytes(t for t in sample_tokens(model, ids, settings, generator) if t < 256).decode(errors="replace")

    return sample


def small_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(ModelConfig(context=16, n_layer=1, n_head=2, d_model=16)).train()


def read_samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


class TextSink(JsonlSink):
    """A JSON-lines sink that also takes text, as TensorBoard, W&B and MLflow do."""

    def __init__(self, path):
        super().__init__(path)
        self.texts = []

    def text(self, step, name, text):
        self.texts.append((step, name, text))


def test_samples_at_the_cadence_and_the_end_go_to_the_log_the_file_and_text_sinks(tmp_path, caplog):
    model = small_model()
    sink, plain = TextSink(tmp_path / "a.jsonl"), JsonlSink(tmp_path / "b.jsonl")  # the plain one ignores text
    writer = MetricsLog(enabled=True, sinks=[sink, plain])
    config = SampleConfig(every=2, prompts=("ROMEO:", "JULIET:"), max_new_tokens=8)
    hook = sample_hook(config, gpt_sampler(model), model, Runtime(), tmp_path, writer=writer, last_step=5)
    with caplog.at_level(logging.INFO, logger="fntrain.hooks.sample"):
        drive(hook, 5)
    records = read_samples(tmp_path)
    assert [(r["step"], r["prompt"]) for r in records] == [
        (2, "ROMEO:"), (2, "JULIET:"), (4, "ROMEO:"), (4, "JULIET:"), (5, "ROMEO:"), (5, "JULIET:"),
    ]  # fmt: skip
    assert all(0 < len(r["text"].encode()) <= 8 * 3 for r in records)
    lines = [r.getMessage() for r in caplog.records if r.name == "fntrain.hooks.sample"]
    assert len(lines) == 6 and all("\n" not in line for line in lines)
    assert lines[0] == "sample step=2 " + json.dumps("ROMEO:" + records[0]["text"], ensure_ascii=False)
    assert [(s, n) for s, n, _ in sink.texts] == [(2, "sample/0"), (2, "sample/1"), (4, "sample/0"),
                                                  (4, "sample/1"), (5, "sample/0"), (5, "sample/1")]  # fmt: skip
    assert sink.texts[0][2] == "ROMEO:" + records[0]["text"]
    assert not (tmp_path / "b.jsonl").exists()
    assert model.training  # train mode restored


def test_a_sample_draws_from_its_own_generator_only_and_restores_the_mode(tmp_path):
    model = small_model()
    config = SampleConfig(every=1, prompts=("ab", "ab"), max_new_tokens=6, temperature=1.0, seed=5)
    hook = sample_hook(config, gpt_sampler(model), model, Runtime(), tmp_path, last_step=2)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    drive(hook, 2)
    assert torch.equal(torch.get_rng_state(), before)
    assert model.training
    # each prompt draws afresh from a generator seeded by sample.seed alone, the one `fntrain generate
    # --seed` draws its first sample from: the same prompt writes the same text at every step of an
    # unchanged model, and twice in one step
    expected = gpt_sampler(model.eval())("ab", config.settings(), torch.Generator().manual_seed(5))
    assert [r["text"] for r in read_samples(tmp_path)] == [expected] * 4
    assert generator_for(5).initial_seed() == 5


def test_the_samples_draw_with_fntrain_generates_defaults():
    from fntrain.models.generate import GenerateOptions
    from fntrain.sampling import TEXT_DEFAULTS

    sample, generate = SampleConfig(), GenerateOptions()
    drawn = [(o.temperature, o.top_k, o.top_p) for o in (sample, generate, TEXT_DEFAULTS)]
    assert drawn == [(0.8, None, 1.0)] * 3 and sample.seed == generate.seed
    assert sample.settings().top_p == 1.0 and SampleConfig(top_p=0.5).settings().top_p == 0.5


def test_a_sampler_that_uses_the_global_rng_leaves_it_as_it_was(tmp_path):
    def careless(prompt, settings, generator):
        return str(torch.rand(1).item())  # e.g. a library seeding and drawing from torch's global RNG

    model = small_model()
    hook = sample_hook(SampleConfig(every=1, prompts=("x",)), careless, model, Runtime(), tmp_path, last_step=1)
    before = torch.get_rng_state()
    drive(hook, 1)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_mode_is_restored_even_when_the_sampler_fails(tmp_path):
    def broken(prompt, settings, generator):
        raise RuntimeError("boom")

    model = small_model()
    hook = sample_hook(SampleConfig(every=1, prompts=("x",)), broken, model, Runtime(), tmp_path, last_step=1)
    with pytest.raises(RuntimeError, match="boom"):
        drive(hook, 1)
    assert model.training


def test_steps_without_a_sample_do_no_torch_work_and_other_ranks_none_at_all(tmp_path):
    model = small_model()
    config = SampleConfig(every=3, prompts=("x",), max_new_tokens=2)
    hook = sample_hook(config, gpt_sampler(model), model, Runtime(), tmp_path, last_step=10)
    with torch_op_recorder() as recorder:
        for event in (Event.STEP_BEGIN, Event.STEP_END):
            hook(event, TrainState(global_step=1), StepInfo({}))
    assert recorder.calls == []
    other = sample_hook(config, gpt_sampler(model), model, Runtime(rank=1, world_size=2), tmp_path, last_step=10)
    drive(other, 3)
    assert not (tmp_path / "samples.jsonl").exists()


def test_at_end_alone_samples_once_after_the_last_step(tmp_path):
    model = small_model()
    hook = sample_hook(SampleConfig(prompts=("x",), max_new_tokens=2), gpt_sampler(model), model, Runtime(),
                       tmp_path, last_step=4)  # fmt: skip
    drive(hook, 4)
    assert [r["step"] for r in read_samples(tmp_path)] == [4]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SampleConfig(every=-1), "sample.every must be >= 0, got -1"),
        (SampleConfig(every=5), "sample.every 5 needs sample.prompts (the text to continue)"),
        (SampleConfig(prompts=("",)), "sample.prompts[0] must not be empty"),
        (SampleConfig(max_new_tokens=0), "sample.max_new_tokens must be >= 1, got 0"),
        (SampleConfig(temperature=-0.5), "sample.temperature must be >= 0.0, got -0.5"),
        (SampleConfig(top_k=-1), "sample.top_k must be >= 0, got -1"),
        (SampleConfig(top_p=0.0), "sample.top_p must be in (0, 1], got 0.0"),
        (SampleConfig(at_end=1), "sample.at_end must be a bool, got 1"),
    ],
)
def test_config_errors_name_the_field(config, message):
    with pytest.raises((TypeError, ValueError)) as error:
        config.validate()
    assert str(error.value) == message


def test_samples_asked_of_a_recipe_without_a_sampler_are_refused_naming_the_flag():
    check_sampling(SampleConfig(), has_sampler=False)  # no prompts: nothing asked
    with pytest.raises(ValueError, match=r"^sample\.every 5: this recipe cannot sample text"):
        check_sampling(SampleConfig(every=5, prompts=("x",)), has_sampler=False)
    with pytest.raises(ValueError, match=r"^sample\.prompts \['x'\]: this recipe cannot sample text"):
        check_sampling(SampleConfig(prompts=("x",)), has_sampler=False)


# ----------------------------------------------------------------------------- the tiny_gpt recipe


def sample_run_config(tmp_path, name: str, **sample) -> tiny_gpt.Config:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 50)
    base = tiny_gpt.Config()
    return dataclasses.replace(
        base,
        run_dir=str(tmp_path / name),
        log_every=1,
        model=dataclasses.replace(base.model, context=16, n_layer=1, n_head=2, d_model=16),
        data=dataclasses.replace(base.data, path=str(corpus), val_fraction=0.1),
        train=dataclasses.replace(base.train, train_iters=3, global_batch_size=4, micro_batch_size=2),
        schedule=dataclasses.replace(base.schedule, warmup_iters=1),
        checkpoint=dataclasses.replace(base.checkpoint, save_every=0, save_at_end=False, export=False),
        evaluate=EvaluateConfig(),
        progress=ProgressConfig(enabled=False),
        throughput=dataclasses.replace(base.throughput, enabled=False),
        sample=dataclasses.replace(base.sample, max_new_tokens=8, **sample),
    )


def test_samples_leave_every_loss_of_the_tiny_gpt_recipe_bit_for_bit_as_without_them(tmp_path):
    def losses(config):
        run_job(config, tiny_gpt.spec)
        lines = (tmp_path / config.run_dir / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r]

    without = losses(sample_run_config(tmp_path, "without", at_end=False))
    with_samples = losses(sample_run_config(tmp_path, "with", every=1))
    assert [step for step, _, _ in with_samples] == [1, 2, 3]
    assert with_samples == without
    assert not (tmp_path / "without" / "samples.jsonl").exists()
    assert [(r["step"], r["prompt"]) for r in read_samples(tmp_path / "with")] == [(1, "ROMEO:"), (2, "ROMEO:"),
                                                                                   (3, "ROMEO:")]  # fmt: skip


def test_samples_on_a_recipe_without_a_sampler_are_a_config_error_before_anything_is_written(tmp_path):
    spec = dataclasses.replace(tiny_gpt.spec, sampler=None)
    config = sample_run_config(tmp_path, "run", every=2)
    with pytest.raises(ConfigError, match=r"^sample\.every 2: this recipe cannot sample text"):
        check_run(config, spec)
    assert not (tmp_path / "run").exists()
    check_run(sample_run_config(tmp_path, "run", prompts=()), spec)  # no prompts: nothing asked


def test_the_command_line_refuses_samples_of_a_recipe_without_a_sampler_in_one_line(tmp_path, capsys, monkeypatch):
    from fntrain.cli import dispatch

    package, module = types.ModuleType("mine"), types.ModuleType("mine.no_sampler")
    package.__path__ = []
    module.Config, module.spec = tiny_gpt.Config, dataclasses.replace(tiny_gpt.spec, sampler=None)
    monkeypatch.setitem(sys.modules, "mine", package)
    monkeypatch.setitem(sys.modules, "mine.no_sampler", module)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["run", "mine.no_sampler", "--run-dir", str(run_dir), "--sample.every", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--sample.every 2: this recipe cannot sample text" in err and "Traceback" not in err
    assert not run_dir.exists()


# ----------------------------------------------------------------------------- the sinks that take text


def test_tensorboard_shows_a_sample_as_text_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fntrain.hooks.sinks import TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb")
    sink.text(3, "sample/0", "ROMEO: hi")
    sink.close()
    sink.text(5, "sample/0", "ROMEO: again")  # reopened: appended to the same file
    sink.close()
    events = EventAccumulator(str(next((tmp_path / "tb").iterdir())))
    events.Reload()
    texts = events.Tensors("sample/0/text_summary")
    assert [e.step for e in texts] == [3, 5] and "ROMEO: hi" in texts[0].tensor_proto.string_val[0].decode()


@pytest.mark.slow
def test_mlflow_keeps_each_sample_as_a_text_artifact(tmp_path):
    pytest.importorskip("mlflow")
    from fntrain.hooks.sinks import MlflowSink

    sink = MlflowSink(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="e", run_name="r",
                      artifact_dir=tmp_path / "artifacts")  # fmt: skip
    sink.text(7, "sample/0", "ROMEO: hi")
    sink.close()
    files = list((tmp_path / "artifacts").rglob("step_00000007.txt"))
    assert len(files) == 1 and files[0].read_text() == "ROMEO: hi" and files[0].parent.name == "0"


@pytest.mark.slow
def test_wandb_logs_a_sample_as_html_at_its_step(tmp_path):
    pytest.importorskip("wandb")
    from fntrain.hooks.sinks import WandbSink
    from tests.hooks.test_trackers import wandb_history, wandb_records

    sink = WandbSink(project="p", entity=None, name="r", mode="offline", dir=tmp_path)
    sink.text(4, "sample/0", "ROMEO: <hi>")
    sink.close()
    rows = [row for row in wandb_history(wandb_records(tmp_path)) if "sample/0/_type" in row]
    assert len(rows) == 1 and rows[0]["_step"] == 4 and rows[0]["sample/0/_type"] == "html-file"
    html = list(tmp_path.rglob(f"files/{rows[0]['sample/0/path']}"))
    assert len(html) == 1 and "ROMEO: &lt;hi&gt;" in html[0].read_text()
