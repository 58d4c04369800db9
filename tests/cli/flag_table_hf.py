"""The flag table's entries of the Hugging Face recipes' own flags (hf_causal_lm, vlm, dpo, kd, grpo): each
run loads a tiny Llama (tests/cli/flag_runs.py), so every runnable entry here is in the slow tier.
Where a recipe's flag is the same code as another recipe's (the model and LoRA sections, kd's SFT data),
one recipe's entry runs it and the others point at the parametrized effect test that runs it."""

from __future__ import annotations

import json

import torch

from tests.cli.flag_kinds import Effect, TestedElsewhere, values_differ

EFFECT_TEST = "tests/cli/test_flag_effects.py::test_flag_does_what_it_says"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def model_saved_to_output_dir(first, second):
    assert (first.ok().run_dir.parent / f"{first.run_dir.name}_files" / "out" / "config.json").is_file()
    assert (second.ok().run_dir / "hf_model" / "config.json").is_file()


def weights_load_in_the_dtype(first, second):
    assert {p.dtype for p in first.ok().model.parameters()} == {torch.float32}
    assert {p.dtype for p in second.ok().model.parameters()} == {torch.bfloat16}


def attention_kernel_follows(first, second):
    assert first.ok().model.config._attn_implementation == "sdpa"
    assert second.ok().model.config._attn_implementation == "eager"


def template_is_saved_with_the_tokenizer(first, second):
    saved = json.loads((first.ok().run_dir / "hf_model" / "tokenizer_config.json").read_text())
    assert saved.get("chat_template") == TEMPLATE or (first.run_dir / "hf_model" / "chat_template.jinja").read_text() == TEMPLATE


def only_adapters_train(first, second):
    trained = [p for group in second.ok().optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in second.model.named_parameters()}
    assert trained and all("lora_" in names[id(p)] for p in trained)
    assert not any("lora_" in name for name, _ in first.ok().model.named_parameters())


def widths(outcome):
    return {batch.shape[1] for batch in outcome.ok().train_batches}


def max_length_bounds_the_width(first, second):
    assert max(widths(first)) <= 32 < max(widths(second))


def packing_fills_every_window(first, second):
    # packed: several examples share each max_length window; padded: one example a row, shorter than that
    assert widths(first) == {48} and max(widths(second)) < 48, (widths(first), widths(second))


def pad_to_max_length_is_static(first, second):
    assert widths(first) == {48} and widths(second) != {48}


def pad_multiple_rounds_the_width(first, second):
    assert all(w % 16 == 0 for w in widths(first)) and any(w % 16 for w in widths(second))


losses_differ = values_differ("training losses", lambda o: o.losses)


def rewards_scale_with_beta(first, second):
    chosen = [(row["rewards/chosen"], row["rewards/rejected"]) for row in (first.ok().train_rows[1], second.ok().train_rows[1])]
    assert chosen[0] != chosen[1], chosen


def kd_parts_are_logged(first, second):
    for outcome in (first.ok(), second.ok()):
        assert {"kd/ce", "kd/kl"} <= set(outcome.train_rows[0])


def kd_loss_mixes_by_ratio(first, second):
    for outcome, ratio in ((first, 0.0), (second, 1.0)):
        row = outcome.ok().train_rows[0]
        assert abs(row["loss"] - ((1 - ratio) * row["kd/ce"] + ratio * row["kd/kl"])) < 1e-4, row


def completions_logged(first, second):
    assert len(first.ok().samples) > 0 and len(second.ok().samples) == 0


def hf_shared(recipe: str) -> dict:
    """The model, assets, output and LoRA flags every Hugging Face causal-LM recipe has, run on hf_causal_lm."""
    own = recipe == "hf_causal_lm"

    def run_here(effect: Effect) -> Effect | TestedElsewhere:
        return effect if own else TestedElsewhere(EFFECT_TEST, "the same fntrain.models.hf code: run as hf_causal_lm's entry")

    return {
        f"{recipe}:--output-dir": Effect(("{root}/out", "None"), (model_saved_to_output_dir,), recipe=recipe, slow=True),
        f"{recipe}:--model.path": TestedElsewhere("tests/models/test_hf.py::test_load_causal_lm_then_save_reloads_with_equal_logits", "needs a second model directory"),
        f"{recipe}:--model.dtype": run_here(Effect(("float32", "bfloat16"), (weights_load_in_the_dtype,), slow=True)),
        f"{recipe}:--model.attn-implementation": run_here(Effect(("sdpa", "eager"), (attention_kernel_follows,), slow=True)),
        f"{recipe}:--assets.tokenizer-path": TestedElsewhere("tests/models/test_hf.py::test_load_assets_reads_the_local_tokenizer", "needs a second tokenizer directory"),
        f"{recipe}:--assets.chat-template": run_here(Effect((TEMPLATE, "None"), (template_is_saved_with_the_tokenizer,), slow=True)),
        f"{recipe}:--lora.rank": run_here(Effect((0, 2), (only_adapters_train,), slow=True)),
        f"{recipe}:--lora.alpha": TestedElsewhere("tests/models/test_lora.py::test_only_the_adapter_trains_and_has_optimizer_state", "peft's scaling; needs the lora extra"),
        f"{recipe}:--lora.dropout": TestedElsewhere("tests/models/test_lora.py::test_bad_values_name_the_field", "peft's dropout; needs the lora extra"),
        f"{recipe}:--lora.target-modules": TestedElsewhere("tests/models/test_lora.py::test_lora_targets_that_name_layers_pass", "peft's targets; needs the lora extra"),
        f"{recipe}:--lora.merge-on-export": TestedElsewhere("tests/models/test_lora.py::test_train_resume_bitwise_and_export_the_adapter", "peft's export; needs the lora extra"),
    }


SFT = "tests/data/test_sft.py::"
SFT_DATA = {
    "data.path": TestedElsewhere(SFT + "test_prompt_completion_and_text_examples", "the SFT transform's own tests"),
    "data.format": TestedElsewhere(SFT + "test_prompt_completion_and_text_examples", "the SFT transform's own tests"),
    "data.text-key": TestedElsewhere("tests/data/test_table_sources.py::test_sft_columns_are_keys_and_give_the_examples_of_the_same_jsonl", "column names"),
    "data.prompt-key": TestedElsewhere("tests/data/test_table_sources.py::test_sft_columns_are_keys_and_give_the_examples_of_the_same_jsonl", "column names"),
    "data.completion-key": TestedElsewhere("tests/data/test_table_sources.py::test_sft_columns_are_keys_and_give_the_examples_of_the_same_jsonl", "column names"),
    "data.messages-key": TestedElsewhere("tests/data/test_table_sources.py::test_sft_columns_are_keys_and_give_the_examples_of_the_same_jsonl", "column names"),
    "data.max-length": Effect((32, 64), (max_length_bounds_the_width,), slow=True),
    "data.packing": Effect((True, False), (packing_fills_every_window,), slow=True),
    "data.pad-to": Effect(("max_length", "longest"), (pad_to_max_length_is_static,), slow=True),
    "data.pad-multiple": Effect((16, 1), (pad_multiple_rounds_the_width,), slow=True),
    "data.train-on-prompt": Effect((True, False), (losses_differ,), slow=True),
    "data.add-eos": TestedElsewhere(SFT + "test_prompt_completion_and_text_examples", "the SFT transform's own tests (chat data ends its turns itself)"),
    "data.val-path": TestedElsewhere(SFT + "test_validation_split_and_truncated_away_examples", "the SFT split's own tests"),
    "data.val-fraction": TestedElsewhere(SFT + "test_validation_split_and_truncated_away_examples", "the SFT split's own tests"),
    "data.shards": TestedElsewhere("tests/data/test_shards_recipe.py::test_three_steps_on_shards_through_the_cli", "needs fntrain tokenize's output"),
}


def sft_data(recipe: str) -> dict:
    if recipe == "hf_causal_lm":
        return {f"{recipe}:--{name}": entry for name, entry in SFT_DATA.items()}
    return {f"{recipe}:--{name}": entry if isinstance(entry, TestedElsewhere) else
            TestedElsewhere(EFFECT_TEST, "kd reads its data with hf_causal_lm's builder: run as hf_causal_lm's entry")
            for name, entry in SFT_DATA.items()}  # fmt: skip


PREF = "tests/data/test_preference.py::"
DPO = {
    **hf_shared("dpo"),
    "dpo:--data.path": TestedElsewhere(PREF + "test_text_row_masks_the_prompt_and_appends_eos", "the preference transform's own tests"),
    "dpo:--data.prompt-key": TestedElsewhere(PREF + "test_parquet_save_to_disk_and_val_fraction", "column names"),
    "dpo:--data.chosen-key": TestedElsewhere(PREF + "test_parquet_save_to_disk_and_val_fraction", "column names"),
    "dpo:--data.rejected-key": TestedElsewhere(PREF + "test_parquet_save_to_disk_and_val_fraction", "column names"),
    "dpo:--data.max-length": TestedElsewhere(PREF + "test_keep_start_truncation_is_counted_in_the_log", "the preference transform's own tests"),
    "dpo:--data.truncation": TestedElsewhere(PREF + "test_keep_start_truncation_is_counted_in_the_log", "the preference transform's own tests"),
    "dpo:--data.pad-multiple": TestedElsewhere(PREF + "test_collate_stacks_chosen_then_rejected", "the preference collate's own tests"),
    "dpo:--data.val-path": TestedElsewhere(PREF + "test_parquet_save_to_disk_and_val_fraction", "the preference split's own tests"),
    "dpo:--data.val-fraction": TestedElsewhere(PREF + "test_parquet_save_to_disk_and_val_fraction", "the preference split's own tests"),
    "dpo:--dpo.beta": Effect((0.1, 1.0), (rewards_scale_with_beta,), slow=True),
    "dpo:--dpo.loss-type": Effect(("sigmoid", "hinge"), (losses_differ,), slow=True),
    "dpo:--dpo.label-smoothing": Effect((0.0, 0.3), (losses_differ,), base=("--dpo.loss-type", "robust"), slow=True),
    "dpo:--dpo.simpo-gamma": Effect((0.0, 2.0), (losses_differ,), base=("--dpo.loss-type", "simpo"), slow=True),
    "dpo:--dpo.reference": TestedElsewhere("tests/step/objectives/test_dpo_recipe.py::test_the_precomputed_reference_gives_the_copys_numbers_and_simpo_needs_none", "copy and precomputed give the same numbers; adapter-off needs the lora extra"),
    "dpo:--dpo.reference-path": TestedElsewhere("tests/step/objectives/test_reference.py::test_frozen_copy_gives_log2_at_step_zero_and_gradients_only_to_the_policy", "needs a second model directory"),
}

KD = {
    **hf_shared("kd"),
    **sft_data("kd"),
    "kd:--kd.ratio": Effect((0.0, 1.0), (kd_parts_are_logged, kd_loss_mixes_by_ratio), slow=True),
    "kd:--kd.temperature": Effect((1.0, 4.0), (values_differ("kd/kl", lambda o: [r["kd/kl"] for r in o.train_rows]),), slow=True),
    "kd:--kd.teacher-path": TestedElsewhere("tests/step/objectives/test_dpo_recipe.py::test_a_kd_run_logs_both_parts_of_its_loss", "needs a second model directory"),
    "kd:--kd.teacher-dtype": TestedElsewhere("tests/models/test_hf.py::test_bfloat16_dtype_is_passed_to_transformers", "the teacher is loaded by the model's loader"),
}

GRPO_LOSS = "tests/step/objectives/grpo/test_loss.py::"
GRPO_ADV = "tests/step/objectives/grpo/test_advantages.py::"
GRPO = {
    **hf_shared("grpo"),
    "grpo:--data.path": TestedElsewhere("tests/data/test_prompts.py::test_text_prompts_are_tokenized_with_special_tokens_and_keep_their_columns", "the prompt reader's own tests"),
    "grpo:--data.prompt-key": TestedElsewhere("tests/data/test_prompts.py::test_jsonl_gzip_parquet_and_save_to_disk_give_the_same_items", "column names"),
    "grpo:--grpo.reward-funcs": TestedElsewhere("tests/step/objectives/grpo/test_rewards.py::test_builtins_load_with_their_names", "the reward loader's own tests"),
    "grpo:--grpo.reward-weights": TestedElsewhere(GRPO_ADV + "test_weights_sum_the_functions_skipping_unscored_ones", "the advantage's own tests"),
    "grpo:--grpo.num-generations": Effect((2, 4), (losses_differ,), base=("--train.global-batch-size", "4", "--train.micro-batch-size", "2"), slow=True),
    "grpo:--grpo.max-completion-length": Effect((2, 6), (losses_differ,), slow=True),
    "grpo:--grpo.temperature": TestedElsewhere(GRPO_LOSS + "test_token_logps_are_log_softmax_at_the_temperature", "the loss's own tests"),
    "grpo:--grpo.top-p": TestedElsewhere("tests/sampling/test_pick.py::test_top_k_and_top_p_keep_only_the_likely_tokens", "sampling's own tests"),
    "grpo:--grpo.top-k": TestedElsewhere("tests/sampling/test_pick.py::test_top_k_and_top_p_keep_only_the_likely_tokens", "sampling's own tests"),
    "grpo:--grpo.steps-per-generation": TestedElsewhere("tests/step/objectives/grpo/test_rollout.py::test_old_log_probs_are_kept_only_when_a_batch_serves_several_steps_and_the_reference_only_with_a_kl", "the rollout's own tests"),
    "grpo:--grpo.num-iterations": TestedElsewhere("tests/step/objectives/grpo/test_rollout.py::test_the_phase_generates_once_per_batch_and_a_checkpoint_inside_it_resumes_the_same_micro_batches", "the rollout's own tests"),
    "grpo:--grpo.beta": TestedElsewhere(GRPO_LOSS + "test_kl_is_k3_to_the_reference_times_the_ratio_when_bias_corrected", "the loss's own tests"),
    "grpo:--grpo.epsilon": TestedElsewhere(GRPO_LOSS + "test_clipping_regions", "the loss's own tests"),
    "grpo:--grpo.epsilon-high": TestedElsewhere(GRPO_LOSS + "test_clipping_regions", "the loss's own tests"),
    "grpo:--grpo.delta": TestedElsewhere(GRPO_LOSS + "test_delta_caps_the_unclipped_ratio", "the loss's own tests"),
    "grpo:--grpo.importance-sampling-level": TestedElsewhere(GRPO_LOSS + "test_sequence_importance_sampling_takes_one_ratio_per_row", "the loss's own tests"),
    "grpo:--grpo.scale-rewards": TestedElsewhere(GRPO_ADV + "test_batch_scaling_divides_by_the_whole_batch_std_and_none_does_not_divide", "the advantage's own tests"),
    "grpo:--grpo.loss-type": TestedElsewhere(GRPO_LOSS + "test_on_policy_loss_is_minus_the_advantage_weighted_as_each_loss_type_says", "the loss's own tests"),
    "grpo:--grpo.mask-truncated-completions": TestedElsewhere("tests/step/objectives/grpo/test_trl_parity.py::test_trl_compute_loss_gives_the_same_loss_gradients_and_metrics", "TRL's loss on a masked truncated row"),
    "grpo:--grpo.use-bias-correction-kl": TestedElsewhere(GRPO_LOSS + "test_kl_is_k3_to_the_reference_times_the_ratio_when_bias_corrected", "the loss's own tests"),
    "grpo:--grpo.multi-objective-aggregation": TestedElsewhere(GRPO_ADV + "test_normalize_then_sum_scales_each_function_in_its_group_then_the_sum_over_the_batch", "the advantage's own tests"),
    "grpo:--grpo.reference": TestedElsewhere("tests/step/objectives/test_reference.py::test_adapter_off_reference_with_real_peft_lora", "adapter-off needs the lora extra"),
    "grpo:--grpo.reference-path": TestedElsewhere("tests/step/objectives/test_reference.py::test_frozen_copy_gives_log2_at_step_zero_and_gradients_only_to_the_policy", "needs a second model directory"),
    "grpo:--grpo.disable-dropout": TestedElsewhere("tests/step/objectives/test_dpo.py::test_disable_dropout_sets_every_dropout_to_zero", "the tiny Llama has no dropout"),
    "grpo:--grpo.completions-to-log": Effect((2, 0), (completions_logged,), slow=True),
    "grpo:--grpo.decode-batch-size": TestedElsewhere("tests/step/objectives/grpo/test_rollout.py::test_a_rows_completion_does_not_depend_on_the_world_size", "the rollout's own tests"),
}

VLM_RECIPE = "tests/recipes/test_vlm.py::test_three_steps_train_on_images_evaluate_accuracy_and_export"
VLM_DATA = "tests/data/test_vlm.py::"
VLM = {
    "vlm:--output-dir": TestedElsewhere(VLM_RECIPE, "building the tiny LLaVA takes the slow tier's seconds"),
    "vlm:--answer-tokens": TestedElsewhere(VLM_RECIPE, "building the tiny LLaVA takes the slow tier's seconds"),
    "vlm:--model.path": TestedElsewhere("tests/recipes/test_vlm.py::test_the_default_learns_the_shapes_and_the_export_answers_with_transformers", "needs a second model directory"),
    "vlm:--model.cache-dir": TestedElsewhere(VLM_RECIPE, "building the tiny LLaVA takes the slow tier's seconds"),
    "vlm:--model.dtype": TestedElsewhere("tests/models/test_hf.py::test_bfloat16_dtype_is_passed_to_transformers", "the model loader's own tests"),
    "vlm:--model.attn-implementation": TestedElsewhere(EFFECT_TEST, "the same loader: run as hf_causal_lm's entry"),
    "vlm:--data.path": TestedElsewhere(VLM_DATA + "test_jsonl_rows_with_relative_image_paths_and_prompt_completion", "the VLM reader's own tests"),
    "vlm:--data.val-path": TestedElsewhere(VLM_DATA + "test_jsonl_rows_with_relative_image_paths_and_prompt_completion", "the VLM reader's own tests"),
    "vlm:--data.val-fraction": TestedElsewhere(VLM_DATA + "test_jsonl_rows_with_relative_image_paths_and_prompt_completion", "the VLM reader's own tests"),
    "vlm:--data.image-key": TestedElsewhere("tests/data/test_table_sources.py::test_vlm_images_as_bytes_structs_and_relative_paths", "column names"),
    "vlm:--data.messages-key": TestedElsewhere(VLM_DATA + "test_jsonl_rows_with_relative_image_paths_and_prompt_completion", "column names"),
    "vlm:--data.prompt-key": TestedElsewhere(VLM_DATA + "test_jsonl_rows_with_relative_image_paths_and_prompt_completion", "column names"),
    "vlm:--data.completion-key": TestedElsewhere(VLM_DATA + "test_jsonl_rows_with_relative_image_paths_and_prompt_completion", "column names"),
    "vlm:--data.max-length": TestedElsewhere(VLM_DATA + "test_bad_rows_are_errors_naming_the_row", "the VLM transform's own tests"),
    "vlm:--data.pad-to": TestedElsewhere(VLM_DATA + "test_collate_pads_text_and_stacks_images", "the VLM collate's own tests"),
    "vlm:--data.train-samples": TestedElsewhere(VLM_DATA + "test_generated_rows_are_a_pure_function_of_seed_and_index", "the generated set's own tests"),
    "vlm:--data.val-samples": TestedElsewhere(VLM_DATA + "test_generated_rows_are_a_pure_function_of_seed_and_index", "the generated set's own tests"),
    "vlm:--data.image-size": TestedElsewhere(VLM_DATA + "test_a_square_is_painted_in_its_colour", "the generated set's own tests"),
}

HF_RECIPES = {
    **hf_shared("hf_causal_lm"), **sft_data("hf_causal_lm"), **VLM, **DPO, **KD, **GRPO,
}
