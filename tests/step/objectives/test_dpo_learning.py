"""DPO learns: on the synthetic preference set of tests/step/objectives/dpo_helpers.py (the chosen answer names the
thing's true colour, the rejected one another colour), 30 steps from a random tiny Llama take the
held-out reward accuracy (`val_rewards/accuracies`, the evaluation's name for the objective's
`rewards/accuracies`) well above chance. Slow tier (a Hugging Face model, a tokenizer trained here).

Held out: the validation pairs are drawn from the same things with another seed, and every pair that
also occurs in the training file (same prompt, chosen and rejected) is dropped, so each one scored is
a combination of question, thing and wrong colour the policy never trained on.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.models.hf_config import HFModelConfig
from fntrain.run.config import CheckpointConfig, TrainConfig
from fntrain.run.job import run_job
from fntrain.step.objectives import DPOConfig
from fntrain.step.optim import OptimizerConfig, ScheduleConfig
from tests.step.objectives.dpo_helpers import COLOURS, preference_rows, tiny_llama

pytestmark = pytest.mark.slow

# Six things of six different colours: enough for the 2-layer Llama to learn in 30 steps.
THINGS = ("the sky", "grass", "snow", "coal", "blood", "the sun")
assert len({COLOURS[thing] for thing in THINGS}) == len(THINGS)

# Final val_rewards/accuracies over seeds 0-7 (43 held-out pairs, this test's settings):
#   0.907, 0.884, 0.884, 0.814, 0.884, 0.930, 0.884, 0.907  (worst 0.814, mean 0.887).
# A policy blind to the prompt can only learn which colours are never right (orange, purple: 2 of the
# 7 wrong colours), worth about 2/7 + 5/7 * 0.5 = 0.64; the threshold sits above that and ~0.06 (3
# pairs) below the worst seed.
MIN_ACCURACY = 0.75


def _rows_file(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def preference_files(tmp_path_factory) -> tuple[Path, Path, Path, int]:
    """(model, train file, held-out validation file, validation pairs)."""
    root = tmp_path_factory.mktemp("dpo_learning")
    model = tiny_llama(root / "llama", max_positions=64)
    train = preference_rows(64, seed=0, things=THINGS)
    seen = {tuple(sorted(row.items())) for row in train}
    val = [
        row for row in preference_rows(64, seed=1, things=THINGS) if tuple(sorted(row.items())) not in seen
    ]
    assert len(val) >= 40
    return model, _rows_file(root / "train.jsonl", train), _rows_file(root / "val.jsonl", val), len(val)


def dpo_run_config(files: tuple[Path, Path, Path, int], run_dir: Path, *, steps: int, eval_micro: int,
            seed: int = 0) -> object:  # fmt: skip
    from recipes import dpo

    model, train, val, _ = files
    return dpo.Config(
        run_dir=str(run_dir), seed=seed, log_every=0,
        model=HFModelConfig(path=str(model)),
        data=dataclasses.replace(dpo.Config().data, path=str(train), val_path=str(val)),
        train=TrainConfig(train_iters=steps, global_batch_size=8, micro_batch_size=8, loss_weighting="mean"),
        optim=OptimizerConfig(lr=5e-3, weight_decay=0.0),
        schedule=ScheduleConfig(kind="constant", warmup_iters=0),
        dpo=DPOConfig(beta=0.1),
        evaluate=EvaluateConfig(at_end=True, with_validation=True, micro_batch_size=eval_micro),
        checkpoint=CheckpointConfig(save_every=0, save_every_minutes=0.0, export=False),
    )  # fmt: skip


def _final_validation(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "val_rewards/accuracies" in row][-1]


def test_held_out_reward_accuracy_rises_well_above_chance(preference_files, tmp_path):
    from recipes import dpo

    pairs = preference_files[3]
    # One evaluation micro-batch holds every held-out pair: its accuracy is the fraction of pairs.
    run_job(dpo_run_config(preference_files, tmp_path / "run", steps=30, eval_micro=pairs), dpo.spec)
    final = _final_validation(tmp_path / "run")
    assert final["step"] == 30
    accuracy = final["val_rewards/accuracies"]
    assert round(accuracy * pairs) == pytest.approx(accuracy * pairs, abs=1e-4)  # k of the pairs
    assert accuracy >= MIN_ACCURACY, final
    assert final["val_loss"] < 0.6931 - 0.1 and final["val_rewards/margins"] > 0


def test_held_out_metrics_do_not_depend_on_the_evaluation_micro_batch(preference_files, tmp_path):
    """DPO's loss is a mean over pairs (the recipe requires train.loss_weighting mean), and TRL's
    evaluation averages its per-batch pair means: the evaluation weighs micro-batches by their pairs,
    not their completion tokens, so the same model on the same pairs reports the same val_loss and a
    val_rewards/accuracies that is a fraction of the pairs whatever --evaluate.micro-batch-size is."""
    from recipes import dpo

    model, train, val, pairs = preference_files
    # Answers of several lengths: with every pair the same length the two weightings agree.
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    for row in rows[::3]:
        row["chosen"], row["rejected"] = row["chosen"] + " Truly so.", row["rejected"] + " Truly so."
    files = (model, train, _rows_file(tmp_path / "val.jsonl", rows), pairs)
    for name, micro in (("whole", pairs), ("single", 1)):
        run_job(dpo_run_config(files, tmp_path / name, steps=4, eval_micro=micro), dpo.spec)
    whole, single = _final_validation(tmp_path / "whole"), _final_validation(tmp_path / "single")
    assert single["val_rewards/accuracies"] * pairs == pytest.approx(
        round(single["val_rewards/accuracies"] * pairs)
    )
    for name in ("val_loss", "val_rewards/accuracies", "val_rewards/margins"):
        assert single[name] == pytest.approx(whole[name], rel=1e-5), name
