"""The flag table: for every user-facing flag (tests/cli/test_flag_effects.py derives the list from the
config dataclasses), what it promises and how it shows. Keys: a shared (`JobConfig`) flag as
`--section.name`, run on tiny_gpt, the cheapest recipe, since every recipe shares its code path; any other
flag as `recipes:--section.name`, the recipes whose configs share the dataclass declaring it (one recipe,
or several joined by "+"), run on the cheapest of them. A check reads what the two runs
(tests/cli/flag_runs.py) left: their metrics, samples, checkpoints, traces, trackers' records, what the
progress bar drew, optimizer, weights and batches; or, for an entry with `read=True`, the parsed config
and the inputs a run reads.

To add a flag: add its key to SHARED or to its recipe's table with one `Effect` (one check per thing its
help text says it controls), `Inert` (with the reason it changes no number) or `TestedElsewhere` (only
when one CPU process cannot show it: the test that does, which must name the flag).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from fntrain.checkpoint import list_checkpoints
from fntrain.data.corpora import corpus_path
from tests.cli.flag_kinds import Effect, Inert, TestedElsewhere, named, same, values_differ
from tests.cli.flag_table_hf import HF_RECIPES

SGD = ("--optim.name", "sgd", "--optim.weight-decay", "0")
EVAL = ("--evaluate.eval-every", "1", "--evaluate.max-batches", "2")
SAVES = ("--checkpoint.save-every", "1", "--checkpoint.keep-last", "0")
SAMPLE = ("--sample.prompts", "ROMEO:", "--sample.max-new-tokens", "8", "--sample.temperature", "1.0")
FIVE = ("--train.train-iters", "5")
BAR = ("--progress.enabled", "--progress.mininterval", "0")
PROFILE = ("--profiler.enabled",)
DDP = ("--parallel.strategy", "ddp")
MOE = ("--model.experts", "4")
SHARED_MLFLOW = ("--metrics.mlflow", "--metrics.mlflow-tracking-uri", "sqlite:///{mlflow_db}")  # one store: one migration  # a gloo group of one rank (tests/cli/flag_runs.py)
PROFILE_STEP_3 = (*PROFILE, "--profiler.start-step", "3", "--profiler.stop-step", "3")

# ----------------------------------------------------------------------------- checks, one promise each

# ----------------------------------------------------------------------------- trackers


def tensorboard_losses(log_dir) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {path.parent for path in log_dir.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return [event.value for event in accumulator.Scalars("loss")]


def tensorboard_scalars_or_a_refusal_naming_the_package(first, second):
    """With the tensorboard package: the losses as scalars under <run_dir>/tensorboard; without it, the
    run refuses the flag in one line naming it and the package."""
    assert second.ok() and not (second.run_dir / "tensorboard").exists()
    if importlib.util.find_spec("tensorboard") is None:
        message = str(first.error)
        assert len(message.splitlines()) == 1 and "metrics.tensorboard" in message and "tensorboard package" in message
        return
    assert tensorboard_losses(first.ok().run_dir / "tensorboard") == pytest.approx(first.losses)


def tensorboard_writes_to_the_given_dir(first, second):
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("the tensorboard package is not installed: a run refuses metrics.tensorboard")
    assert tensorboard_losses(first.ok().run_dir / "tensorboard") == pytest.approx(first.losses)
    given = Path(second.ok().config.metrics.tensorboard_dir)
    assert tensorboard_losses(given) == pytest.approx(second.losses) and not (second.run_dir / "tensorboard").exists()


def wandb_run(outcome):
    """The offline W&B run the run wrote under <run_dir>/wandb: its run record and its history rows."""
    from tests.hooks.test_trackers import wandb_history, wandb_records

    records = wandb_records(outcome.ok().run_dir)
    return [record.run for kind, record in records if kind == "run"][-1], wandb_history(records)


def wandb_offline_writes_the_metrics_to_run_dir_wandb(first, second):
    _, history = wandb_run(first)
    assert [row["loss"] for row in history if "loss" in row] == first.losses
    assert not (second.ok().run_dir / "wandb").exists()


def disabled_wandb_writes_nothing(first, second):
    assert wandb_run(first)[1] and not (second.ok().run_dir / "wandb").exists()


def wandb_run_field(field, values):
    def check(first, second):
        seen = [getattr(wandb_run(outcome)[0], field) for outcome in (first, second)]
        assert seen == list(values), seen

    return named(f"wandb run {field}", check)


def run_name_defaults_to_the_run_directory(first, second):
    assert wandb_run(first)[0].display_name == first.run_dir.name and wandb_run(second)[0].display_name == "myrun"


def tags_reach_the_tracker(first, second):
    assert {"a", "k=v"}.isdisjoint(wandb_run(first)[0].tags) and {"a", "k=v"} <= set(wandb_run(second)[0].tags)


def mlflow_run_of(outcome, experiment="fntrain", uri=None):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri or f"sqlite:///{outcome.ok().run_dir.resolve() / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no mlflow experiment {experiment!r}"
    (run,) = client.search_runs([found.experiment_id])
    return client, run


def mlflow_records_the_metrics_in_the_run_dirs_sqlite(first, second):
    client, run = mlflow_run_of(first)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == first.losses
    assert not (second.ok().run_dir / "mlflow.db").exists()


def mlflow_experiment_is_named(first, second):
    uri = first.ok().config.metrics.mlflow_tracking_uri  # both runs log to one store, each to its experiment
    assert mlflow_run_of(first, "fntrain", uri)[1].info.run_name == first.run_dir.name
    assert mlflow_run_of(second, "exp1", uri)[1].info.run_name == second.ok().run_dir.name


def mlflow_logs_to_the_given_uri(first, second):
    client, run = mlflow_run_of(second, uri=second.ok().config.metrics.mlflow_tracking_uri)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == second.losses
    assert (first.ok().run_dir / "mlflow.db").is_file() and not (second.run_dir / "mlflow.db").exists()




def run_files_land_in_run_dir(first, second):
    for outcome in (first.ok(), second.ok()):
        held = {path.name for path in outcome.run_dir.iterdir()}
        assert {"metrics.jsonl", "config.json", "logs", "run_metadata.json"} <= held, held
    assert first.run_dir != second.run_dir


def overwrite_starts_over_and_moves_the_old_run_aside(first, second):
    assert [row["attempt"] for row in first.ok().train_rows] == [0, 0, 0]  # a fresh run, not a resume
    aside = list(first.run_dir.parent.glob(f"{first.run_dir.name}.replaced-*"))
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").is_file(), aside


def without_overwrite_the_complete_run_is_left_as_it_was(first, second):
    assert second.error is not None or second.result.reason == "already complete", second.result
    assert not list(second.run_dir.parent.glob(f"{second.run_dir.name}.replaced-*"))


initialisation_differs = values_differ("initial weights", lambda o: o.seen.initial)
data_order_differs = values_differ("training batches", lambda o: o.train_batches)


def logged_steps_follow_log_every(first, second):
    assert [row["step"] for row in first.ok().train_rows] == [1, 2, 3]
    assert [row["step"] for row in second.ok().train_rows] == [2, 3]  # and the last step


def logged_loss_is_the_mean_since_the_last_log(first, second):
    losses = first.losses
    assert math.isclose(second.train_rows[0]["loss"], (losses[0] + losses[1]) / 2, rel_tol=1e-5)
    norms = [row["grad_norm"] for row in first.train_rows]
    assert math.isclose(second.train_rows[0]["grad_norm"], (norms[0] + norms[1]) / 2, rel_tol=1e-5)


def torch_threads_follow_the_value(first, second):
    assert set(first.ok().seen.threads) == {1} and set(second.ok().seen.threads) == {2}


def bf16_computes_in_bf16(first, second):
    assert set(first.ok().seen.output_dtypes) == {torch.float32}
    assert set(second.ok().seen.output_dtypes) == {torch.bfloat16}


def bf16_keeps_fp32_weights(first, second):
    assert all(value.dtype == torch.float32 for value in second.ok().final.values())


def blocks_recompute_in_backward(first, second):
    # 3 steps of 2 micro-batches: each attention runs once per forward, once more in backward when recomputed
    assert first.ok().seen.attention_calls == 12 and second.ok().seen.attention_calls == 6


def same_numbers(first, second):
    """Losses and final weights equal: the flag changed how, not what, was computed."""
    assert first.ok().losses == second.ok().losses, (first.losses, second.losses)
    assert same(first.final, second.final)


def blocks_are_compiled(first, second):
    def compiled(outcome):
        return all(getattr(block, "_compiled_call_impl", None) is not None for block in outcome.model.blocks)

    assert compiled(first.ok()) and not compiled(second.ok())


def steps_run_follow_train_iters(first, second):
    assert first.ok().result.state.global_step == 2 and second.ok().result.state.global_step == 3


def steps_are_train_samples_over_global_batch(first, second):
    assert first.ok().result.state.global_step == 2 and second.ok().result.state.global_step == 3


def samples_per_step_follow_global_batch(first, second):
    assert first.ok().train_rows[0]["consumed_samples"] == 2 and second.ok().train_rows[0]["consumed_samples"] == 4


def micro_batches_per_step_follow_global_batch(first, second):
    assert len(first.train_batches) == 3 * 2 and len(second.train_batches) == 3 * 4


def rows_per_forward_follow_micro_batch(first, second):
    assert {len(batch) for batch in first.ok().train_batches} == {1}
    assert {len(batch) for batch in second.ok().train_batches} == {2}


def samples_per_step_do_not_follow_micro_batch(first, second):
    assert first.ok().train_rows[-1]["consumed_samples"] == second.ok().train_rows[-1]["consumed_samples"]


def update_norm(outcome) -> float:
    return sum(((outcome.final[k] - outcome.seen.initial[k]) ** 2).sum() for k in outcome.final).sqrt().item()


def clipping_bounds_the_update(first, second):
    # SGD at lr 1: each step's update is the (clipped) gradient, so 3 steps move the weights <= 3 * 1e-3
    assert update_norm(first.ok()) <= 3e-3 * 1.001 < update_norm(second.ok())


def token_weighting_weights_micro_batches_by_their_tokens(first, second):
    assert first.ok().losses != second.ok().losses


def shuffle_changes_the_order(first, second):
    assert not same(first.ok().train_batches, second.ok().train_batches)


def unshuffled_windows_come_in_corpus_order(first, second):
    corpus = corpus_path("shakespeare").read_bytes()
    starts = [corpus.find(bytes(batch[0].tolist())) for batch in second.ok().train_batches]
    assert starts == sorted(starts) and starts[0] == 0, starts


def optimizer_class_follows_name(first, second):
    assert type(first.ok().optimizer).__name__ == "AdamW" and type(second.ok().optimizer).__name__ == "SGD"


def logged_lr_is_the_peak(first, second):
    assert {row["lr"] for row in first.ok().train_rows} == {1e-3}
    assert {row["lr"] for row in second.ok().train_rows} == {2e-3}


def larger_lr_moves_the_weights_further(first, second):
    assert update_norm(first) < update_norm(second)


def decay(outcome) -> dict[str, float]:
    """Parameter name -> the weight decay its optimizer group applies."""
    names = {id(param): name for name, param in outcome.model.named_parameters()}
    return {names[id(p)]: group["weight_decay"] for group in outcome.optimizer.param_groups for p in group["params"]}


def matrices_get_the_decay(first, second):
    assert decay(first.ok())["blocks.0.attn.q.weight"] == 0.0 and decay(second.ok())["blocks.0.attn.q.weight"] == 0.5


def vectors_get_no_decay(first, second):
    assert all(value == 0.0 for name, value in decay(second.ok()).items() if name.endswith(("bias", "ln1.weight")))


def group_setting(key):
    return values_differ(f"param_groups[{key}]", lambda o: [group[key] for group in o.optimizer.param_groups])


def decay_all_decays_vectors_and_embeddings(first, second):
    assert decay(first.ok())["blocks.0.attn.q.bias"] == 0.0 and decay(first)["tok.weight"] == 0.0
    assert set(decay(second.ok()).values()) == {0.1}


def hf_grouping_decays_embeddings_not_biases(first, second):
    assert decay(first.ok())["tok.weight"] == 0.0 and decay(second.ok())["tok.weight"] == 0.1
    assert decay(second)["blocks.0.attn.q.bias"] == 0.0 and decay(second)["ln_f.weight"] == 0.0


def fused_kernel_is_asked(first, second):
    assert {group["fused"] for group in first.ok().optimizer.param_groups} in ({False}, {None})
    assert {group["fused"] for group in second.ok().optimizer.param_groups} == {True}


def logged_lrs(outcome) -> list[float]:
    return [row["lr"] for row in outcome.ok().train_rows]


def constant_lr_stays_and_linear_decays(first, second):
    assert logged_lrs(first) == [1e-3] * 5
    assert all(math.isclose(a, b) for a, b in zip(logged_lrs(second), [1e-3 * (1 - 0.9 * s / 5) for s in range(5)], strict=True))


def warmup_rises_linearly_to_the_peak(first, second):
    assert logged_lrs(first)[:2] == [1e-3, 1e-3]
    assert all(math.isclose(a, b) for a, b in zip(logged_lrs(second)[:3], [1e-3 / 2, 1e-3, 1e-3], strict=True))


def hf_warmup_starts_at_zero(first, second):
    assert math.isclose(logged_lrs(first)[0], 1e-3 / 2) and logged_lrs(second)[0] == 0.0 and math.isclose(logged_lrs(second)[2], 1e-3)


def min_lr_ratio_is_the_floor(first, second):
    # linear over the 5 steps: the lr after the last scheduler step is peak * ratio
    assert math.isclose(first.ok().optimizer.param_groups[0]["lr"], 1e-3 * 0.1)
    assert math.isclose(second.ok().optimizer.param_groups[0]["lr"], 1e-3 * 0.5)


def horizon_stretches_the_decay(first, second):
    assert math.isclose(logged_lrs(first)[-1], 1e-3 * (1 - 0.9 * 4 / 5)) and math.isclose(logged_lrs(second)[-1], 1e-3 * (1 - 0.9 * 4 / 10))


def peak_memory_is_logged(first, second):
    assert "peak" in first.ok().log.lower() and "peak" not in second.ok().log.lower()


def throughput_is_reported(first, second):
    assert "tokens_per_s" in first.ok().train_rows[0] and "tokens_per_s" not in second.ok().train_rows[0]


def tflops_follow_flops_per_token(first, second):
    for outcome, flops in ((first, 1e9), (second, 2e9)):
        row = outcome.ok().train_rows[-1]
        assert math.isclose(row["tflops"], row["tokens_per_s"] * flops / 1e12, rel_tol=1e-6), row


def flops_are_measured(first, second):
    assert first.ok().train_rows[-1].get("tflops", 0) > 0 and "tflops" not in second.ok().train_rows[-1]


def mfu_is_tflops_over_the_peak(first, second):
    row = first.ok().train_rows[-1]
    assert math.isclose(row["mfu"], row["tflops"] / 1.0, rel_tol=1e-6) and "mfu" not in second.ok().train_rows[-1]


def metrics_file_is_written(first, second):
    assert (first.ok().run_dir / "metrics.jsonl").is_file() and not (second.ok().run_dir / "metrics.jsonl").exists()


def metrics_file_takes_the_name(first, second):
    assert (first.ok().run_dir / "a.jsonl").is_file() and (second.ok().run_dir / "b.jsonl").is_file()
    assert not (first.run_dir / "metrics.jsonl").exists()


def val_steps(outcome) -> list[int]:
    return [row["step"] for row in outcome.ok().val_rows]


def evaluation_every_n_steps(first, second):
    assert val_steps(first) == [1, 2, 3, 4, 5] and val_steps(second) == [2, 4]


def evaluation_after_epochs(first, second):
    assert val_steps(first) == [] and len(val_steps(second)) >= 1


def evaluation_at_the_end(first, second):
    assert val_steps(first) == [3] and val_steps(second) == []


def eval_batches_per_evaluation(first, second):
    assert len(first.ok().seen.eval_batches) == 5 * 1 and len(second.ok().seen.eval_batches) == 5 * 2


def eval_rows_per_forward(first, second):
    assert {len(b) for b in first.ok().seen.eval_batches} == {1} and {len(b) for b in second.ok().seen.eval_batches} == {3}


def with_validation_evaluates_by_itself(first, second):
    assert len(val_steps(first)) >= 1 and val_steps(second) == []


def sample_steps(outcome) -> list[int]:
    return [row["step"] for row in outcome.ok().samples]


def samples_every_n_steps(first, second):
    assert sample_steps(first) == [1, 2, 3, 4, 5] and sample_steps(second) == [2, 4, 5]


def one_sample_per_prompt(first, second):
    assert [row["prompt"] for row in first.ok().samples] == ["ROMEO:"]
    assert [row["prompt"] for row in second.ok().samples] == ["ROMEO:", "JULIET:"]


def sample_length_is_bounded(first, second):
    assert all(len(row["text"].encode()) <= 2 for row in first.ok().samples)
    assert any(len(row["text"].encode()) > 2 for row in second.ok().samples)


sample_text_differs = values_differ("sample text", lambda o: [row["text"] for row in o.samples])


def greedy_continuation(outcome, prompt: str = "ROMEO:", tokens: int = 8) -> str:
    """The likeliest continuation of `prompt` under the run's final weights, byte by byte (argmax)."""
    model, ids = outcome.model.eval(), list(prompt.encode())
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return bytes(ids[len(prompt.encode()):]).decode("utf-8", errors="replace")


def end_sample(outcome) -> str:
    """The text sampled after the last step (sample.at_end), under the final weights."""
    (row,) = [row for row in outcome.ok().samples if row["step"] == outcome.result.state.global_step]
    return row["text"]


def first_is_greedy(first, second):
    assert end_sample(first) == greedy_continuation(first), (end_sample(first), greedy_continuation(first))
    assert end_sample(second) != greedy_continuation(second), end_sample(second)  # drawn: not the argmax here


def seed_changes_the_text_not_the_training(first, second):
    assert end_sample(first) != end_sample(second)
    same_numbers(first, second)  # each prompt's own generator: the global RNGs (and so training) untouched


def samples_at_the_end(first, second):
    assert sample_steps(first) == [3] and sample_steps(second) == []


def gc_automatic(first, second):
    assert set(first.ok().seen.gc_enabled) == {False} and set(second.ok().seen.gc_enabled) == {True}


def trace_files(outcome):
    return sorted(p for p in outcome.run_dir.rglob("*") if p.is_file() and "profile" in p.parts)


def profile_traces_are_written(first, second):
    assert trace_files(first.ok()) and not trace_files(second.ok())


def checkpoints(outcome, root=None):
    return [int(path.name.split("_")[1]) for path in list_checkpoints(root or outcome.run_dir / "checkpoints")]


def checkpoint_root_follows_dir(first, second):
    assert checkpoints(first.ok(), first.run_dir.parent / f"{first.run_dir.name}_files" / "ckpt") == [1, 2, 3]
    assert not (first.run_dir / "checkpoints").exists()


def saves_every_k_steps(first, second):
    assert checkpoints(first.ok()) == [1, 2, 3, 4, 5] and checkpoints(second.ok()) == [2, 4, 5]


def saves_at_epoch_ends(first, second):
    # 5 steps an epoch (the small corpus): epochs end at steps 5 and 10
    assert not {5, 10} & set(checkpoints(first.ok())) and {5, 10} <= set(checkpoints(second.ok()))


def saves_the_last_step_without_a_cadence_under_auto(first, second):
    # no save_every, save_epochs or save_every_minutes; restore_from auto (the default): the end is saved
    assert checkpoints(first.ok()) == [3] and not (second.ok().run_dir / "checkpoints").exists()



def keeps_the_newest_k(first, second):
    assert checkpoints(first.ok()) == [1, 2, 3, 4, 5] and checkpoints(second.ok()) == [4, 5]


def keeps_the_best_too(first, second):
    kept = checkpoints(first.ok())
    best = min(first.val_rows, key=lambda row: row["val_loss"])["step"]
    assert kept == sorted({best, 5}) and checkpoints(second.ok()) == [5]


def exports_model_safetensors(first, second):
    assert (first.ok().run_dir / "model.safetensors").is_file() and not (second.ok().run_dir / "model.safetensors").exists()


def this_launch(outcome) -> list[int]:
    """The steps the last launch in the run directory logged (a resume keeps the earlier launch's rows)."""
    rows = outcome.ok().train_rows
    return [row["step"] for row in rows if row["attempt"] == rows[-1]["attempt"]]


def resumes_from_the_newest_checkpoint(first, second):
    assert this_launch(first) == [4, 5]


def none_never_resumes(first, second):
    # the old run is there: `none` refuses to resume it (and to write into it) rather than continue it
    assert second.error is not None and "already holds a run" in str(second.error), second.error


def weights_only_restarts_at_step_zero(first, second):
    assert this_launch(first) == [1, 2, 3, 4, 5] and this_launch(second) == [4, 5]


def weights_only_starts_from_the_checkpoints_weights(first, second):
    # step 1 of the restarted run trains the saved weights: below the first run's step-1 loss (fresh weights)
    assert first.ok().losses[0] < second.ok().losses[0], (first.losses, second.losses)


def allowed_change_lets_the_resume_run(first, second):
    assert first.ok().result.state.global_step == 5
    assert second.error is not None and "train.train_iters" in str(second.error)


def tiny_gpt_batch_width(first, second):
    assert {b.shape[1] for b in first.ok().train_batches} == {16} and {b.shape[1] for b in second.ok().train_batches} == {8}


def shape(name):
    return values_differ(f"{name}'s shape", lambda o: tuple(o.final[name].shape))


def block_count(first, second):
    assert len(first.ok().model.blocks) == 1 and len(second.ok().model.blocks) == 2


def head_count(first, second):
    assert first.ok().model.blocks[0].attn.head_dim == 8 and second.ok().model.blocks[0].attn.head_dim == 4


def moe_of(outcome):
    return outcome.ok().model.blocks[0].moe


def routed_rows(outcome) -> int:
    """(token, expert) pairs the router makes of 5 tokens in a training forward of the final block's MoE."""
    moe = moe_of(outcome).train()
    moe.step_load.zero_()
    moe(torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0)))
    return int(moe.step_load.sum())


def each_token_goes_to_k_experts(first, second):
    assert routed_rows(first) == 5 * 1 and routed_rows(second) == 5 * 2, (routed_rows(first), routed_rows(second))


def shared_mlp_of_an_experts_width(first, second):
    assert moe_of(first).shared is None
    assert moe_of(second).shared[0].weight.shape == (64, 16)  # 1 shared expert of 4 x d_model hidden units


def expert_mlps_have_expert_hidden_units(first, second):
    assert moe_of(first).experts.w_in.shape == (4, 16, 64) and moe_of(second).experts.w_in.shape == (4, 16, 8)


def aux_loss_is_added_by_its_weight(first, second):
    # the same first step (same seed, same weights): the trained loss grows by weight x the logged aux loss
    a, b = first.ok().train_rows[0], second.ok().train_rows[0]
    assert math.isclose(b["loss"] - a["loss"], 1.0 * b["moe/aux_loss"], rel_tol=1e-4), (a, b)


def routing_bias_moves_by_the_rate_each_step(first, second):
    assert torch.equal(moe_of(first).expert_bias, torch.zeros(4))
    steps = moe_of(second).expert_bias / 0.5  # each step adds +-rate (or 0) per expert: 3 steps
    assert steps.abs().max() > 0 and torch.equal(steps, steps.round()) and steps.abs().max() <= 3, steps


def dropout_masks(outcome) -> torch.Tensor:
    return outcome.ok().seen.dropout_masks[0]


def dropout_follows_the_seed(first, second):
    assert not torch.equal(dropout_masks(first), dropout_masks(second))


def dropout_changes_training_losses(first, second):
    assert first.ok().losses != second.ok().losses and first.seen.initial.keys() == second.seen.initial.keys()


def has_experts(first, second):
    assert not hasattr(first.ok().model.blocks[0], "moe") and hasattr(second.ok().model.blocks[0], "moe")


def corpus_windows(outcome):
    return {bytes(row.tolist()) for batch in outcome.ok().train_batches for row in batch}


def trains_on_windows_of_the_shards(first, second):
    from tests.data.test_tokenize import stream_of

    stream = stream_of(second.ok().config.data.shards)
    text = f",{','.join(map(str, stream))},"  # each window: a run of the stream's tokens
    assert all(f",{','.join(map(str, row.tolist()))}," in text for batch in second.train_batches for row in batch)
    assert not any(256 in batch for batch in first.ok().train_batches)  # the bundled corpus: bytes, no EOS


def vocabulary_grows_to_the_shards(first, second):
    assert first.ok().model.tok.weight.shape[0] == 256 and second.ok().model.tok.weight.shape[0] == 257


def trains_on_the_given_text(first, second):
    assert all(window in b"abcdefgh" * 64 for window in corpus_windows(second))
    assert not all(window in b"abcdefgh" * 64 for window in corpus_windows(first))


def val_split_holds_the_tail(first, second):
    assert len(first.ok().seen.eval_batches) != len(second.ok().seen.eval_batches) or first.val_rows != second.val_rows


# ----------------------------------------------------------------------------- the shared flags, on tiny_gpt

# ----------------------------------------------------------------------------- the progress bar (stderr faked as a terminal)


def bar_draws(outcome) -> list[str]:
    """The bar's states as drawn, one per redraw ("epoch 0:  33%|...| 1/3 ...")."""
    return [part for part in outcome.ok().seen.terminal.split("\r") if "step/s" in part]


def bar_is_drawn_on_a_terminal(first, second):
    assert bar_draws(first) and "3/3" in bar_draws(first)[-1], first.seen.terminal[-300:]
    assert bar_draws(second) == [], second.seen.terminal[-300:]


def redraws_wait_mininterval(first, second):
    counts = [[draw.split("|")[2].split()[0] for draw in bar_draws(outcome)] for outcome in (first, second)]
    assert {"1/3", "2/3"} <= set(counts[0]) and not {"1/3", "2/3"} & set(counts[1]), counts


def finished_bar_stays_or_is_cleared(first, second):
    assert first.ok().seen.terminal.endswith("\n") and "3/3" in first.seen.terminal.rsplit("\r", 2)[-1]
    assert second.ok().seen.terminal.rstrip(" ").endswith("\r") and not second.seen.terminal.rsplit("\r", 2)[-2].strip()


def log_lines_print_above_the_bar(first, second):
    # routed through tqdm.write: the bar's line is cleared, the record printed, the bar redrawn below it
    assert re.search(r"\r +\rstep=2 epoch=0 .*\n\repoch 0:", first.ok().seen.terminal), first.seen.terminal[-500:]
    assert "step=2 epoch=0" not in second.ok().seen.terminal  # the console handler writes on its own


# ----------------------------------------------------------------------------- garbage collection


def steps_of_collections(outcome) -> list[tuple[float, object]]:
    """(step, generation) of each gc.collect call made at a step's end (2 micro-batches a step)."""
    return [(batches / 2, generation) for batches, generation in outcome.ok().seen.collections if batches and generation is not None]


def collects_every_n_steps(first, second):
    assert [step for step, _ in steps_of_collections(first)] == [1, 2, 3, 4]
    assert [step for step, _ in steps_of_collections(second)] == [2, 4]


def collects_the_oldest_generation_given(first, second):
    assert {g for _, g in steps_of_collections(first)} == {0} and {g for _, g in steps_of_collections(second)} == {1}


# ----------------------------------------------------------------------------- the profiler's traces


def traces(outcome, root=None) -> list[dict]:
    """The events of each trace the run wrote under <root or run_dir>/profile/rank_0."""
    import json

    root = Path(root) if root else outcome.ok().run_dir
    return [json.loads(path.read_text())["traceEvents"] for path in sorted((root / "profile" / "rank_0").glob("*.json"))]


def profiled_steps(outcome, root=None) -> list[int]:
    return sorted(int(e["name"].split("#")[1]) for events in traces(outcome, root) for e in events
                  if str(e.get("name", "")).startswith("ProfilerStep#"))  # fmt: skip


def window_starts_at_start_step(first, second):
    assert profiled_steps(first) == [2, 3] and profiled_steps(second) == [3], (profiled_steps(first), profiled_steps(second))


def window_ends_at_stop_step(first, second):
    assert profiled_steps(first) == [2] and profiled_steps(second) == [2, 3], (profiled_steps(first), profiled_steps(second))


def count_events(outcome, test) -> int:
    return sum(1 for events in traces(outcome) for e in events if test(e))


def operator_shapes_are_recorded(first, second):
    assert count_events(first, lambda e: "Input Dims" in e.get("args", {})) == 0
    assert count_events(second, lambda e: "Input Dims" in e.get("args", {})) > 0


def python_stacks_are_recorded(first, second):
    assert count_events(first, lambda e: e.get("cat") == "python_function") == 0
    assert count_events(second, lambda e: e.get("cat") == "python_function") > 0


def allocations_are_recorded(first, second):
    assert count_events(first, lambda e: e.get("name") == "[memory]") > 0
    assert count_events(second, lambda e: e.get("name") == "[memory]") == 0


def traces_go_under_output_path(first, second):
    assert profiled_steps(first) == [3] and profiled_steps(second, second.ok().config.profiler.output_path) == [3]
    assert not (second.run_dir / "profile").exists()


def init_phase_is_traced(first, second):
    # the init phase opens the loader: its epoch's shuffle (randperm) shows only when traced from TRAIN_BEGIN
    def shuffles(outcome) -> int:
        return count_events(outcome, lambda e: e.get("name") == "aten::randperm")

    assert shuffles(first) == 0 < shuffles(second), (shuffles(first), shuffles(second))


# ----------------------------------------------------------------------------- the watchdog (its limit, on a fake clock)


def watchdog_of(read, aborted=None):
    import tempfile

    from fntrain.hooks.watchdog import Watchdog
    from tests.hooks.test_watchdog import FakeClock

    clock = FakeClock()
    dog = Watchdog(read.settings.watchdog, rank=0, stacks_dir=Path(tempfile.mkdtemp()) / "stacks", clock=clock,
                   abort=(aborted if aborted is not None else []).append)  # fmt: skip
    return dog, clock


def limit_after(read, durations: list[float]) -> float:
    from tests.hooks.test_watchdog import beat_steps

    dog, clock = watchdog_of(read)
    beat_steps(dog, clock, durations)
    return dog.limit()[0]


def limit_is_factor_times_the_median_step(first, second):
    assert limit_after(first, [9, 9, 2, 2, 2]) == 3 * 2.0 and limit_after(second, [9, 9, 2, 2, 2]) == 5 * 2.0


def limit_is_at_least_the_floor(first, second):
    assert limit_after(first, [9, 9, 2, 2, 2]) == 6.0 and limit_after(second, [9, 9, 2, 2, 2]) == 10.0


def first_steps_stay_out_of_the_median(first, second):
    durations = [30, 20, 5, 5, 5, 1, 1]  # after 2 steps: median of 5 5 5 1 1; after 4: of 5 1 1
    assert limit_after(first, durations) == 3 * 5.0 and limit_after(second, durations) == 3 * 1.0


def limit_before_any_period_is_grace_s(first, second):
    assert limit_after(first, [30, 20]) == 60.0 and limit_after(second, [30, 20]) == 100.0  # the first steps: grace


def median_over_the_last_window_steps(first, second):
    durations = [9, 9, 1, 1, 1, 4, 4, 4]
    assert limit_after(first, durations) == 3 * 4.0 and limit_after(second, durations) == 3 * 2.5


def a_stall_aborts_with_the_exit_code(first, second):
    from tests.hooks.test_watchdog import beat_steps

    for read, code in ((first, 124), (second, 7)):
        aborted: list[int] = []
        dog, clock = watchdog_of(read, aborted)
        step = beat_steps(dog, clock, [1.0] * 4)
        dog.beat("step", step + 1)
        clock.now += 1000
        assert dog.check() and aborted == [code], aborted


# ----------------------------------------------------------------------------- data parallelism on a group of one rank


def data_parallel_wraps_the_model_and_trains_alike(first, second):
    assert type(first.ok().model_wrapper).__name__ == "TinyGPT"
    assert type(second.ok().model_wrapper).__name__ == "DistributedDataParallel"
    assert second.losses == pytest.approx(first.losses, rel=1e-5)  # one rank: the same numbers


def process_group_waits_timeout_s(first, second):
    import datetime

    assert first.ok().seen.group_timeouts == [datetime.timedelta(seconds=1800)]
    assert second.ok().seen.group_timeouts == [datetime.timedelta(seconds=77)]


def ddp_buckets_hold_the_cap(first, second):
    assert first.ok().model_wrapper.bucket_bytes_cap == 25 * 2**20 and second.ok().model_wrapper.bucket_bytes_cap == 2**20


def ddp_looks_for_unused_parameters(first, second):
    assert not first.ok().model_wrapper.find_unused_parameters and second.ok().model_wrapper.find_unused_parameters


def blocks_reshard_after_forward_but_the_last(first, second):
    def resharded(outcome) -> list[bool]:
        return [block._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                for block in outcome.ok().model.blocks]  # fmt: skip

    assert resharded(first) == [True, False] and resharded(second) == [False, False], (resharded(first), resharded(second))


ELSEWHERE_MULTI = "needs several ranks under torchrun"
SHARED = {
    "--run-dir": Effect(("{root}/a", "{root}/b"), (run_files_land_in_run_dir,)),
    "--overwrite": Effect((True, False), (overwrite_starts_over_and_moves_the_old_run_aside,
                                          without_overwrite_the_complete_run_is_left_as_it_was), before=()),
    "--seed": Effect((1, 2), (initialisation_differs, data_order_differs, dropout_follows_the_seed), base=("--model.dropout", "0.5")),
    "--log-every": Effect((1, 2), (logged_steps_follow_log_every, logged_loss_is_the_mean_since_the_last_log)),
    "--runtime.device": TestedElsewhere("tests/runtime/test_device.py::test_cuda_requested_without_a_gpu_is_a_clear_error",
                                        "cuda and npu need the device"),
    "--runtime.deterministic": TestedElsewhere("tests/runtime/test_setup.py::test_determinism_is_on_inside_and_restored_after",
                                               "the cuBLAS/cuDNN/HCCL settings need the device; the test reads them inside the run"),
    "--runtime.backend": TestedElsewhere("tests/runtime/test_setup.py::test_backend_follows_the_device", ELSEWHERE_MULTI),
    "--runtime.timeout-s": Effect((1800.0, 77.0), (process_group_waits_timeout_s,), base=DDP, slow=True),
    "--runtime.tf32": TestedElsewhere("tests/runtime/test_device.py::test_cuda_precision_flags_set_and_restore", "TF32/HF32 exist on cuda/npu only"),
    "--runtime.cpu-threads": Effect((1, 2), (torch_threads_follow_the_value,)),
    "--parallel.strategy": Effect(("none", "ddp"), (data_parallel_wraps_the_model_and_trains_alike,), slow=True),
    "--parallel.mixed-precision": Effect(("fp32", "bf16"), (bf16_computes_in_bf16, bf16_keeps_fp32_weights)),
    "--parallel.reshard-after-forward": Effect((True, False), (blocks_reshard_after_forward_but_the_last,), base=("--parallel.strategy", "fsdp2", "--model.n-layer", "2"), slow=True),
    "--parallel.activation-checkpointing": Effect((True, False), (blocks_recompute_in_backward, same_numbers)),
    "--parallel.compile": Effect((True, False), (blocks_are_compiled,), base=("--parallel.compile-backend", "eager"), slow=True),
    "--parallel.compile-backend": TestedElsewhere("tests/runtime/test_parallel.py::test_compile_compiles_each_block_in_place",
                                                  "the backend is torch.compile's: which one ran is not visible after the run"),
    "--parallel.ddp-bucket-cap-mb": Effect((25, 1), (ddp_buckets_hold_the_cap,), base=DDP, slow=True),
    "--parallel.find-unused-parameters": Effect((False, True), (ddp_looks_for_unused_parameters,), base=DDP, slow=True),
    "--parallel.tp-size": TestedElsewhere("tests/runtime/test_model_parallel.py::test_model_parallel_runs_match_one_rank", ELSEWHERE_MULTI),
    "--parallel.pp-size": TestedElsewhere("tests/runtime/test_model_parallel.py::test_model_parallel_runs_match_one_rank", ELSEWHERE_MULTI),
    "--parallel.pp-schedule": TestedElsewhere("tests/runtime/test_model_parallel.py::test_1f1b_needs_a_micro_batch_per_stage", "a pipeline schedule needs several stages, each a rank"),
    "--parallel.loss-parallel": TestedElsewhere("tests/models/test_hf_tp.py::test_styles_translate_to_torch_parallel_styles", "vocabulary-parallel logits need a tensor-parallel mesh of several ranks"),
    "--parallel.cp-size": TestedElsewhere("tests/step/test_context_parallel.py::test_cp2_equals_one_rank", ELSEWHERE_MULTI),
    "--parallel.cp-style": TestedElsewhere("tests/step/test_context_parallel.py::test_ring_slices_like_torchs_load_balancer_and_reaches_its_dispatcher", ELSEWHERE_MULTI),
    "--parallel.ep-size": TestedElsewhere("tests/runtime/test_parallel.py::test_expert_parallelism_needs_fsdp2", "expert parallelism " + ELSEWHERE_MULTI),
    "--parallel.replicate": TestedElsewhere("tests/runtime/test_hsdp.py::test_two_rank_hsdp_replicate_2_shard_1_matches_ddp", ELSEWHERE_MULTI),
    "--parallel.meta-init": Inert("the same weights, built on meta then allocated", (True, False)),
    "--train.train-iters": Effect((2, 3), (steps_run_follow_train_iters,)),
    "--train.train-samples": Effect((4, 6), (steps_are_train_samples_over_global_batch,), base=("--train.train-iters", "None")),
    "--train.global-batch-size": Effect((2, 4), (samples_per_step_follow_global_batch, micro_batches_per_step_follow_global_batch)),
    "--train.micro-batch-size": Effect((1, 2), (rows_per_forward_follow_micro_batch, samples_per_step_do_not_follow_micro_batch)),
    "--train.max-grad-norm": Effect((1e-3, 0), (clipping_bounds_the_update,), base=(*SGD, "--optim.lr", "1")),
    "--train.loss-weighting": Effect(("token", "mean"), (token_weighting_weights_micro_batches_by_their_tokens,),
                                     base=("--train.global-batch-size", "4", "--train.micro-batch-size", "2"),
                                     recipe="hf_causal_lm", slow=True),  # tiny_gpt's windows all hold equal tokens
    "--loader.shuffle": Effect((True, False), (shuffle_changes_the_order, unshuffled_windows_come_in_corpus_order)),
    "--loader.num-workers": Inert("results do not depend on it", (0, 1), slow=True),
    "--loader.prefetch": Inert("results do not depend on it", (False, True)),
    "--loader.prefetch-depth": Inert("results do not depend on it", (1, 3), base=("--loader.prefetch",)),
    "--loader.pin-memory": Inert("ignored on CPU; page-locking moves no number", (True, False)),
    "--optim.name": Effect(("adamw", "sgd"), (optimizer_class_follows_name,)),
    "--optim.lr": Effect((1e-3, 2e-3), (logged_lr_is_the_peak, larger_lr_moves_the_weights_further)),
    "--optim.weight-decay": Effect((0.0, 0.5), (matrices_get_the_decay, vectors_get_no_decay)),
    "--optim.betas": Effect(((0.9, 0.95), (0.5, 0.6)), (group_setting("betas"),)),
    "--optim.eps": Effect((1e-8, 1e-3), (group_setting("eps"),)),
    "--optim.momentum": Effect((0.0, 0.9), (group_setting("momentum"),), base=SGD),
    "--optim.decay-all": Effect((False, True), (decay_all_decays_vectors_and_embeddings,), base=("--optim.weight-decay", "0.1")),
    "--optim.decay-grouping": Effect(("fntrain", "hf"), (hf_grouping_decays_embeddings_not_biases,), base=("--optim.weight-decay", "0.1")),
    "--optim.fused": Effect(("False", "True"), (fused_kernel_is_asked,)),
    "--schedule.kind": Effect(("constant", "linear"), (constant_lr_stays_and_linear_decays,), base=(*FIVE, "--optim.lr", "1e-3")),
    "--schedule.warmup-iters": Effect((0, 2), (warmup_rises_linearly_to_the_peak,), base=("--optim.lr", "1e-3")),
    "--schedule.warmup-style": Effect(("fntrain", "hf"), (hf_warmup_starts_at_zero,), base=("--optim.lr", "1e-3", "--schedule.warmup-iters", "2")),
    "--schedule.min-lr-ratio": Effect((0.1, 0.5), (min_lr_ratio_is_the_floor,), base=(*FIVE, "--optim.lr", "1e-3", "--schedule.kind", "linear")),
    "--schedule.lr-schedule-iters": Effect(("None", 10), (horizon_stretches_the_decay,), base=(*FIVE, "--optim.lr", "1e-3", "--schedule.kind", "linear")),
    **{f"--memory.{name}": TestedElsewhere(test, "allocator history is recorded on cuda/npu only") for name, test in (
        ("enable", "tests/hooks/test_memory.py::test_window_1_to_3_records_once_then_writes_and_stops"),
        ("start-step", "tests/hooks/test_memory.py::test_equal_bounds_mid_run"),
        ("end-step", "tests/hooks/test_memory.py::test_equal_bounds_mid_run"),
        ("save-path", "tests/hooks/test_memory.py::test_recipe_puts_the_memory_hook_first_with_save_path_under_run_dir"),
        ("dump-ranks", "tests/hooks/test_memory.py::test_selected_nonzero_rank_writes_its_own_file"),
        ("stacks", "tests/hooks/test_memory.py::test_window_1_to_3_records_once_then_writes_and_stops"),
        ("max-entries", "tests/hooks/test_memory.py::test_unbounded_max_entries_is_passed_as_sys_maxsize"),
    )},  # fmt: skip
    "--memory.mem-info": Effect((True, False), (peak_memory_is_logged,)),
    "--throughput.enabled": Effect((True, False), (throughput_is_reported,)),
    "--throughput.flops-per-token": Effect((1e9, 2e9), (tflops_follow_flops_per_token,)),
    "--throughput.measure-flops": Effect((True, False), (flops_are_measured,)),
    "--throughput.peak-tflops": Effect((1.0, "None"), (mfu_is_tflops_over_the_peak,), base=("--throughput.flops-per-token", "1e9")),
    "--throughput.memory": TestedElsewhere("tests/hooks/test_throughput.py::test_device_sync_and_memory_only_on_logging_steps", "device memory is not reported on cpu"),
    "--metrics.jsonl": Effect((True, False), (metrics_file_is_written,)),
    "--metrics.jsonl-name": Effect(("a.jsonl", "b.jsonl"), (metrics_file_takes_the_name,)),
    "--metrics.tensorboard": Effect((True, False), (tensorboard_scalars_or_a_refusal_naming_the_package,)),
    "--metrics.tensorboard-dir": Effect(("None", "{root}/tb"), (tensorboard_writes_to_the_given_dir,), base=("--metrics.tensorboard",), slow=True),
    "--metrics.wandb": Effect((True, False), (wandb_offline_writes_the_metrics_to_run_dir_wandb,), slow=True),
    "--metrics.wandb-mode": Effect(("offline", "disabled"), (disabled_wandb_writes_nothing,), base=("--metrics.wandb",), slow=True),
    "--metrics.wandb-project": Effect(("fntrain", "proj1"), (wandb_run_field("project", ("fntrain", "proj1")),), base=("--metrics.wandb",), slow=True),
    "--metrics.wandb-entity": Effect(("None", "team1"), (wandb_run_field("entity", ("", "team1")),), base=("--metrics.wandb",), slow=True),
    "--metrics.run-name": Effect(("None", "myrun"), (run_name_defaults_to_the_run_directory,), base=("--metrics.wandb",), slow=True),
    "--metrics.tags": Effect(((), ("a", "k=v")), (tags_reach_the_tracker,), base=("--metrics.wandb",), slow=True),
    "--metrics.mlflow": Effect((True, False), (mlflow_records_the_metrics_in_the_run_dirs_sqlite,), slow=True),
    "--metrics.mlflow-experiment": Effect(("fntrain", "exp1"), (mlflow_experiment_is_named,), base=SHARED_MLFLOW, slow=True),
    "--metrics.mlflow-tracking-uri": Effect(("None", "sqlite:///{mlflow_db}"), (mlflow_logs_to_the_given_uri,), base=("--metrics.mlflow",), slow=True),
    "--progress.enabled": Effect((True, False), (bar_is_drawn_on_a_terminal,), base=BAR, slow=True),
    "--progress.mininterval": Effect((0.0, 1000.0), (redraws_wait_mininterval,), base=("--progress.enabled", "--progress.no-redirect-logging"), slow=True),
    "--progress.leave": Effect((True, False), (finished_bar_stays_or_is_cleared,), base=BAR, slow=True),
    "--progress.redirect-logging": Effect((True, False), (log_lines_print_above_the_bar,), base=BAR, slow=True),
    "--evaluate.eval-every": Effect((1, 2), (evaluation_every_n_steps,), base=(*FIVE, "--evaluate.max-batches", "1")),
    "--evaluate.eval-epochs": Effect((0, 1), (evaluation_after_epochs,), base=("--data.path", "{corpus}", "--data.val-fraction", "0.2", "--evaluate.max-batches", "1", "--train.train-iters", "12")),
    "--evaluate.at-end": Effect((True, False), (evaluation_at_the_end,), base=("--evaluate.max-batches", "1")),
    "--evaluate.max-batches": Effect((1, 2), (eval_batches_per_evaluation,), base=(*FIVE, "--evaluate.eval-every", "1")),
    "--evaluate.micro-batch-size": Effect((0, 3), (eval_rows_per_forward,), base=(*FIVE, "--evaluate.eval-every", "1", "--evaluate.max-batches", "1")),
    "--evaluate.with-validation": Effect((True, False), (with_validation_evaluates_by_itself,), base=("--evaluate.max-batches", "1")),
    "--sample.every": Effect((1, 2), (samples_every_n_steps,), base=(*FIVE, *SAMPLE)),
    "--sample.prompts": Effect((("ROMEO:",), ("ROMEO:", "JULIET:")), (one_sample_per_prompt,), base=(*SAMPLE, )),
    "--sample.max-new-tokens": Effect((2, 8), (sample_length_is_bounded,), base=SAMPLE),
    "--sample.temperature": Effect((0.0, 1.0), (first_is_greedy,), base=SAMPLE),
    "--sample.top-k": Effect((1, "None"), (first_is_greedy,), base=SAMPLE),
    "--sample.top-p": Effect((1e-6, 1.0), (first_is_greedy,), base=SAMPLE),
    "--sample.seed": Effect((1, 2), (seed_changes_the_text_not_the_training,), base=SAMPLE),
    "--sample.at-end": Effect((True, False), (samples_at_the_end,), base=SAMPLE),
    "--gc.gc-every": Effect((1, 2), (collects_every_n_steps,), base=("--train.train-iters", "4", "--gc.generation", "0")),
    "--gc.generation": Effect((0, 1), (collects_the_oldest_generation_given,), base=("--train.train-iters", "4", "--gc.gc-every", "1")),
    "--gc.empty-cache-every": TestedElsewhere("tests/hooks/test_gc.py::test_empty_cache_every_n_steps_on_an_accelerator_only", "ignored on cpu"),
    "--gc.disable-automatic": Effect((True, False), (gc_automatic,)),
    "--profiler.enabled": Effect((True, False), (profile_traces_are_written,), slow=True),
    "--profiler.start-step": Effect((2, 3), (window_starts_at_start_step,), base=(*PROFILE, "--profiler.stop-step", "3"), slow=True),
    "--profiler.stop-step": Effect((2, 3), (window_ends_at_stop_step,), base=(*PROFILE, "--profiler.start-step", "2"), slow=True),
    "--profiler.start-on-init": Effect((False, True), (init_phase_is_traced,), base=(*PROFILE, "--profiler.start-step", "1", "--profiler.stop-step", "1"), slow=True),
    "--profiler.record-shapes": Effect((False, True), (operator_shapes_are_recorded,), base=PROFILE_STEP_3, slow=True),
    "--profiler.with-stack": Effect((False, True), (python_stacks_are_recorded,), base=PROFILE_STEP_3, slow=True),
    "--profiler.memory": Effect((True, False), (allocations_are_recorded,), base=PROFILE_STEP_3, slow=True),
    "--profiler.output-path": Effect(("None", "{root}/traces"), (traces_go_under_output_path,), base=PROFILE_STEP_3, slow=True),
    **{f"--profiler.{name}": TestedElsewhere(f"tests/hooks/test_profiler.py::{test}", why) for name, test, why in (
        ("rank-ids", "test_rank_four_profiles_rank_two_does_not", ELSEWHERE_MULTI),
        ("pipeline-stage-leaders", "test_stage_leaders_alone", ELSEWHERE_MULTI),
        ("level", "test_npu_backend_experimental_config_metadata_and_mstx", "npu only"),
        ("data-simplification", "test_npu_backend_experimental_config_metadata_and_mstx", "npu only"),
        ("mstx", "test_npu_backend_experimental_config_metadata_and_mstx", "npu only"),
    )},  # fmt: skip
    "--checkpoint.dir": Effect(("{root}/ckpt", "None"), (checkpoint_root_follows_dir,), base=SAVES),
    "--checkpoint.save-every": Effect((1, 2), (saves_every_k_steps,), base=(*FIVE, "--checkpoint.keep-last", "0")),
    "--checkpoint.save-epochs": Effect((0, 1), (saves_at_epoch_ends,), base=("--data.path", "{corpus}", "--data.val-fraction", "0.2", "--train.train-iters", "12")),
    "--checkpoint.save-at-end": Effect((True, False), (saves_the_last_step_without_a_cadence_under_auto,)),
    "--checkpoint.keep-last": Effect((0, 2), (keeps_the_newest_k,), base=(*FIVE, "--checkpoint.save-every", "1", "--checkpoint.no-keep-best")),
    "--checkpoint.keep-best": Effect((True, False), (keeps_the_best_too,), base=(*FIVE, "--checkpoint.save-every", "1", "--checkpoint.keep-last", "1", *EVAL, "--optim.lr", "0.3")),
    "--checkpoint.async-save": Inert("the same checkpoints, written in the background", (True, False), base=SAVES),
    "--checkpoint.save-on-interrupt": TestedElsewhere("tests/hooks/test_checkpoint.py::test_ctrl_c_inside_a_step_saves_at_the_next_boundary_and_stops_with_130", "needs a Ctrl-C inside a step (the named test raises it from the step)"),
    "--checkpoint.preempt-signals": TestedElsewhere("tests/hooks/test_preemption_runs.py::test_the_checkpoint_hook_installs_the_configured_signals_itself", "needs a signal"),
    "--checkpoint.preempt-check-every": TestedElsewhere("tests/hooks/test_checkpoint_pins.py::test_ranks_stop_at_the_agreed_step_and_the_reason_names_the_step_the_notice_came", "ranks agree on a step only with several of them (the named test fakes a world of 2)"),
    "--checkpoint.preempt-exit-code": TestedElsewhere("tests/hooks/test_preemption_runs.py::test_the_checkpoint_hook_installs_the_configured_signals_itself", "the process exits with it: needs a signal and a process of its own"),
    "--checkpoint.save-every-minutes": TestedElsewhere("tests/checkpoint/test_time_based.py::test_saves_every_n_minutes_of_the_clock", "needs minutes of a clock: the named test drives the hook on a fake one, which a run cannot be given"),
    "--checkpoint.time-based-temporary": TestedElsewhere("tests/checkpoint/test_time_based.py::test_temporary_time_based_checkpoints_are_removed_once_superseded", "needs minutes of a clock: the named test drives the hook on a fake one, which a run cannot be given"),
    "--checkpoint.abort-wait-s": TestedElsewhere("tests/hooks/test_checkpoint_pins.py::test_abort_waits_no_longer_than_abort_wait_s", "needs an async write held in flight at an abort"),
    "--checkpoint.thread-count": Inert("the same checkpoint, written by more threads", (1, 2), base=SAVES),
    "--checkpoint.on-save-failure": TestedElsewhere("tests/checkpoint/test_save_faults.py::test_continue_warns_on_each_failure_and_tries_again_at_the_next_cadence", "needs a failing disk"),
    "--checkpoint.make-room": TestedElsewhere("tests/checkpoint/test_full_disk.py::test_continue_and_make_room_on_a_small_disk", "needs a full disk"),
    "--checkpoint.restore-from": Effect(("auto", "none"), (resumes_from_the_newest_checkpoint, none_never_resumes), base=(*FIVE, "--checkpoint.save-every", "3", "--checkpoint.allow-changes", "train.train_iters"), before=("--checkpoint.save-every", "3")),
    "--checkpoint.allow-changes": Effect((("train.train_iters",), ()), (allowed_change_lets_the_resume_run,), base=(*FIVE, "--checkpoint.save-every", "3"), before=("--checkpoint.save-every", "3")),
    "--checkpoint.weights-only": Effect((True, False), (weights_only_restarts_at_step_zero, weights_only_starts_from_the_checkpoints_weights), base=(*FIVE, "--checkpoint.save-every", "3", "--checkpoint.restore-from", "{run}/checkpoints/step_3", "--checkpoint.allow-changes", "train.train_iters"), before=("--checkpoint.save-every", "3")),
    "--checkpoint.export": Effect((True, False), (exports_model_safetensors,)),
    "--watchdog.enabled": TestedElsewhere("tests/hooks/test_watchdog.py::test_disabled_starts_nothing", "its thread aborts the process: a run cannot be shown stalling and surviving"),
    "--watchdog.factor": Effect((3.0, 5.0), (limit_is_factor_times_the_median_step,), base=("--watchdog.floor-s", "1", "--watchdog.grace-steps", "2"), read=True, slow=True),
    "--watchdog.floor-s": Effect((1.0, 10.0), (limit_is_at_least_the_floor,), base=("--watchdog.factor", "3", "--watchdog.grace-steps", "2"), read=True, slow=True),
    "--watchdog.grace-steps": Effect((2, 4), (first_steps_stay_out_of_the_median,), base=("--watchdog.factor", "3", "--watchdog.floor-s", "1"), read=True, slow=True),
    "--watchdog.grace-s": Effect((60.0, 100.0), (limit_before_any_period_is_grace_s,), base=("--watchdog.grace-steps", "2", "--watchdog.floor-s", "1"), read=True, slow=True),
    "--watchdog.window": Effect((3, 10), (median_over_the_last_window_steps,), base=("--watchdog.factor", "3", "--watchdog.floor-s", "1", "--watchdog.grace-steps", "2"), read=True, slow=True),
    "--watchdog.poll-s": TestedElsewhere("tests/hooks/test_watchdog.py::test_in_a_training_loop_the_thread_finds_the_stalled_step", "how often its thread looks: a stall that it finds aborts the process"),
    "--watchdog.exit-code": Effect((124, 7), (a_stall_aborts_with_the_exit_code,), base=("--watchdog.floor-s", "1", "--watchdog.grace-steps", "2"), read=True, slow=True),
}

TINY_GPT = {
    "tiny_gpt:--model.context": Effect((16, 8), (tiny_gpt_batch_width, shape("pos.weight"))),
    "tiny_gpt:--model.n-layer": Effect((1, 2), (block_count,)),
    "tiny_gpt:--model.n-head": Effect((2, 4), (head_count,)),
    "tiny_gpt:--model.d-model": Effect((16, 32), (shape("tok.weight"), shape("blocks.0.attn.q.weight"))),
    "tiny_gpt:--model.dropout": Effect((0.0, 0.5), (dropout_changes_training_losses,)),
    "tiny_gpt:--model.vocab-size": Effect((256, 300), (shape("tok.weight"), shape("head.weight"))),
    "tiny_gpt:--model.experts": Effect((0, 2), (has_experts,)),
    "tiny_gpt:--model.experts-per-token": Effect((1, 2), (each_token_goes_to_k_experts,), base=MOE),
    "tiny_gpt:--model.shared-experts": Effect((0, 1), (shared_mlp_of_an_experts_width,), base=MOE),
    "tiny_gpt:--model.expert-hidden": Effect((0, 8), (expert_mlps_have_expert_hidden_units,), base=MOE),
    "tiny_gpt:--model.router-aux-loss-weight": Effect((0.0, 1.0), (aux_loss_is_added_by_its_weight,), base=MOE),
    "tiny_gpt:--model.router-bias-rate": Effect((0.0, 0.5), (routing_bias_moves_by_the_rate_each_step,), base=MOE),
    "tiny_gpt:--data.path": Effect(("None", "{abc}"), (trains_on_the_given_text,)),
    "tiny_gpt:--data.shards": Effect(("None", "{byte_shards}"), (trains_on_windows_of_the_shards, vocabulary_grows_to_the_shards), slow=True),
    "tiny_gpt:--data.val-fraction": Effect((0.02, 0.3), (val_split_holds_the_tail,), base=("--data.path", "{corpus}", "--evaluate.at-end")),
}

TABLE = {**SHARED, **TINY_GPT, **HF_RECIPES}
"""Every user-facing flag's entry, keyed as tests/cli/test_flag_effects.py's `user_flags` keys them."""
