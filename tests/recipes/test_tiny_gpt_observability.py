"""The tiny_gpt recipe with its observability hooks: metrics.jsonl holds training and validation loss and
throughput, and the plot command turns it into non-empty PNGs."""

from __future__ import annotations

import dataclasses
import json
import math

from fntrain.cli.plot import main as plot_main
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.run.job import run_job
from recipes import tiny_gpt


def observed_run_config(tmp_path) -> tiny_gpt.Config:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 200)  # 8.8 kB
    base = tiny_gpt.Config()
    return dataclasses.replace(
        base,
        run_dir=str(tmp_path / "run"),
        log_every=2,
        model=dataclasses.replace(base.model, context=32, n_layer=1, n_head=2, d_model=32),
        data=dataclasses.replace(base.data, path=str(corpus), val_fraction=0.1),
        train=dataclasses.replace(base.train, train_iters=6, global_batch_size=4, micro_batch_size=2),
        schedule=dataclasses.replace(base.schedule, warmup_iters=2),
        checkpoint=dataclasses.replace(base.checkpoint, save_at_end=False, export=False),
        evaluate=EvaluateConfig(eval_every=3, at_end=True, max_batches=2),
        progress=ProgressConfig(enabled=False),
    )


def test_recipe_run_logs_train_and_validation_metrics_and_plots_them(tmp_path, capsys):
    config = observed_run_config(tmp_path)
    final = run_job(config, tiny_gpt.spec).state
    assert final.global_step == 6

    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert [r["step"] for r in val] == [3, 6]
    for record in val:
        assert math.isfinite(record["val_loss"]) and record["val_ppl"] == math.exp(record["val_loss"])
    last = train[-1]
    for name in ("grad_norm", "lr", "step_time_s", "tokens_per_s", "samples_per_s", "tflops"):
        assert name in last and last[name] >= 0, name
    assert "mfu" not in last  # cpu, no configured peak
    assert last["consumed_samples"] == 6 * 4
    assert last["consumed_tokens"] == 6 * 4 * (32 - 1)  # labels[..., 1:] of every sequence

    capsys.readouterr()
    assert plot_main([str(run_dir)]) == 0
    assert capsys.readouterr().out.split() == [str(run_dir / "loss.png"), str(run_dir / "throughput.png")]
    for name in ("loss.png", "throughput.png"):
        assert (run_dir / name).stat().st_size > 1000


def test_consumed_counts_continue_after_a_checkpoint_resume(tmp_path):
    config = observed_run_config(tmp_path)
    first = dataclasses.replace(
        config, checkpoint=dataclasses.replace(config.checkpoint, save_every=3), evaluate=EvaluateConfig()
    )
    run_job(first, tiny_gpt.spec)
    # step 3 is not a logging step: its tokens were still unreduced when the checkpoint was taken
    step_3 = tmp_path / "run" / "checkpoints" / "step_3"
    resumed = dataclasses.replace(
        config,
        checkpoint=dataclasses.replace(config.checkpoint, restore_from=str(step_3)),
        evaluate=EvaluateConfig(),
    )
    assert run_job(resumed, tiny_gpt.spec).state.global_step == 6
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    per_step = 4 * (32 - 1)
    # The first run's rows after step 3 were superseded by the resumed run's: one story, two attempts.
    assert [(r["step"], r["attempt"], r["consumed_tokens"]) for r in records] == [
        (2, 0, 2 * per_step), (4, 1, 4 * per_step), (6, 1, 6 * per_step),
    ]  # fmt: skip
    assert records[1]["tokens_per_s"] > 0  # a rate over the resumed run's own step
