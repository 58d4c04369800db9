"""The flag table's entries of the Hugging Face recipes' own flags (hf_causal_lm, vlm, dpo, kd, grpo). A
flag whose field several recipes share (one declaring dataclass: the model, assets and LoRA sections,
the SFT data of hf_causal_lm and kd) has one entry, keyed `hf_causal_lm+dpo+kd+grpo:--lora.rank`, run on
the cheapest of them. A run loads a tiny Llama (tests/cli/flag_runs.py), so every run-based entry here is
in the slow tier; a data flag is observed on the inputs a run reads (`read=True`: no model, default tier),
and an objective's flag on the loss the recipe builds from the parsed config, over a fixed tiny batch."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from fntrain.data.tokens import IGNORE_INDEX
from tests.cli.flag_kinds import Effect, Inert, TestedElsewhere, same, values_differ
from tests.step.objectives.preference_helpers import logsigmoid

HF = "hf_causal_lm+dpo+kd+grpo"  # the causal-LM recipes' model, assets and LoRA sections
SFT = "hf_causal_lm+kd"  # hf_causal_lm's data section, which kd's config inherits
EXPORTING = "hf_causal_lm+vlm+dpo+kd+grpo"  # ExportingJobConfig's output_dir
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


losses_differ = values_differ("training losses", lambda o: o.losses)


# ----------------------------------------------------------------------------- the inputs a run reads


def texts(read) -> list[str]:
    return [read.text(ids) for ids, _ in read.ok().rows]


def trained_texts(read) -> list[str]:
    return [read.trained_text(i) for i in range(len(read.ok().rows))]


def reads_the_given_file(first, second):
    assert trained_texts(first)[0] == "<s>the sky is blue</s>", trained_texts(first)  # {sft}'s first row
    assert trained_texts(second)[0] == "A king.</s>\n", trained_texts(second)  # {chat}'s


def text_format_reads_the_text_key(first, second):
    assert set(texts(first)) == {"<s>plain</s>"}, texts(first)


def chat_format_renders_the_messages(first, second):
    assert set(trained_texts(second)) == {"A king.</s>\n"}, trained_texts(second)


def text_is_read_from_the_key(first, second):
    assert set(texts(first)) == {"<s>plain</s>"} and set(texts(second)) == {"<s>other</s>"}, (texts(first), texts(second))


def prompt_is_read_from_the_key(first, second):
    assert set(texts(first)) == {"<s>ask yes</s>"} and set(texts(second)) == {"<s>query yes</s>"}, (texts(first), texts(second))


def completion_is_read_from_the_key(first, second):
    assert set(trained_texts(first)) == {" yes</s>"} and set(trained_texts(second)) == {" no</s>"}


def messages_are_read_from_the_key(first, second):
    assert set(trained_texts(first)) == {"A king.</s>\n"} and set(trained_texts(second)) == {"Well met.</s>\nLa la.</s>\n"}


def lengths(read) -> list[int]:
    return [len(ids) for ids, _ in read.ok().rows]


def longer_examples_are_cut_to_max_length(first, second):
    cut, whole = [ids for ids, _ in first.ok().rows], [ids for ids, _ in second.ok().rows]
    assert max(map(len, cut)) == 8 < max(map(len, whole)), (lengths(first), lengths(second))
    assert all(any(row == other[: len(row)] for other in whole) for row in cut)  # the start is kept


def widths(read) -> list[int]:
    return [len(batch["input_ids"][0]) for batch in read.ok().train]


def longest(batch) -> int:
    """The longest example's tokens (a batch whose rows are all that long may come without a mask)."""
    return max(sum(mask) for mask in batch["attention_mask"]) if "attention_mask" in batch else len(batch["input_ids"][0])


def packed_samples_fill_max_length_with_several_examples(first, second):
    assert set(widths(first)) == {48}, widths(first)
    assert any(sum(p == 0 for p in row) > 1 for batch in first.train for row in batch["position_ids"])


def packed_examples_attend_only_to_themselves(first, second):
    # a new example (document) starts its positions at 0: attention and positions restart there
    for batch in first.ok().train:
        for positions, documents in zip(batch["position_ids"], batch["document_ids"], strict=True):
            starts = [t for t in range(len(documents)) if t == 0 or documents[t] != documents[t - 1]]
            assert starts == [t for t, p in enumerate(positions) if p == 0], (positions, documents)


def padded_samples_hold_one_example(first, second):
    assert "position_ids" not in second.ok().train[0]
    bos = second.inputs.assets.tokenizer.bos_token_id
    assert all(ids.count(bos) == 1 and ids[0] == bos for ids, _ in second.rows)


def every_batch_is_max_length(first, second):
    assert set(widths(first)) == {48}, widths(first)


def padded_to(multiple: int, batch, cap: int) -> int:
    return min(cap, math.ceil(longest(batch) / multiple) * multiple)


def longest_pads_each_batch_to_its_longest_rounded(first, second):
    assert [len(b["input_ids"][0]) for b in second.ok().train] == [padded_to(8, b, 48) for b in second.train]


def each_batch_is_padded_to_the_multiple(first, second):
    for read in (first.ok(), second.ok()):
        multiple, cap = read.config.data.pad_multiple, read.config.data.max_length
        assert [len(b["input_ids"][0]) for b in read.train] == [padded_to(multiple, b, cap) for b in read.train]
    assert any(longest(b) % 16 for b in first.train)  # so rounding happened


def prompts_of_prompt_completion_examples_are_trained(first, second):
    assert "what color is the sky? blue</s>" in trained_texts(first)[1], trained_texts(first)
    assert trained_texts(second)[1] == " blue</s>"


def user_turns_of_chats_are_trained(first, second):
    assert "Who art thou?" in trained_texts(first)[2] and "Who art thou?" not in trained_texts(second)[2]


def text_examples_end_with_eos(first, second):
    assert trained_texts(first)[0] == "<s>the sky is blue</s>" and trained_texts(second)[0] == "<s>the sky is blue"


def completions_end_with_eos(first, second):
    assert trained_texts(first)[1] == " blue</s>" and trained_texts(second)[1] == " blue"


def chat_turns_end_themselves(first, second):
    assert trained_texts(first)[2] == trained_texts(second)[2] == "A king.</s>\n"


def val_texts(read) -> list[str]:
    return [read.text([t for t, m in zip(ids, mask, strict=True) if m])
            for batch in read.ok().val for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]  # fmt: skip


def validation_comes_from_val_path(first, second):
    assert val_texts(first) == ["<s>held out one</s>", "<s>held out two</s>"], val_texts(first)
    assert second.ok().val is None


def val_path_holds_nothing_of_data_path_out(first, second):
    assert texts(first) == texts(second)


def the_tail_is_held_out(first, second):
    assert first.ok().val is None
    assert texts(second) + val_texts(second) == texts(first) and len(val_texts(second)) >= 2, val_texts(second)


def shards_are_windows_of_max_length_every_token_trained(first, second):
    from tests.data.test_tokenize import stream_of

    assert first.error is not None and "data.shards" in str(first.error), first.error
    rows = second.ok().rows
    assert {len(ids) for ids, _ in rows} == {48} and all(ids == labels for ids, labels in rows)
    stream = stream_of(second.config.data.shards)  # windows in order, each next one from the last's final token
    assert [ids for ids, _ in rows] == [stream[47 * k : 47 * k + 48] for k in range(len(rows))]


def reads_the_given_tokenizer(first, second):
    assert texts(first)[0] == "<s>the sky is blue</s>"  # model.path's own tokenizer
    assert second.ok().rows[0][0] == [*(byte + 3 for byte in b"the sky is blue"), 1]  # the byte vocabulary's ids


def pair_texts(read, row: int) -> tuple[str, str]:
    """(whole text, trained text) of preference row `row` (micro-batches of 2 pairs: chosen, chosen, rejected, rejected)."""
    return texts(read)[row], trained_texts(read)[row]


def reads_the_given_pairs(first, second):
    assert pair_texts(first, 0)[0].startswith("<s>What colour") or pair_texts(first, 0)[0].startswith("<s>Name") or \
        pair_texts(first, 0)[0].startswith("<s>Tell"), pair_texts(first, 0)  # fmt: skip
    assert pair_texts(second, 0) == ("<s>Pick a colour for pair 0: blue, the colour of the clear sky</s>",
                                     " blue, the colour of the clear sky</s>")  # fmt: skip


def pair_prompt_from_the_key(first, second):
    assert pair_texts(first, 0)[0].startswith("<s>Pick a colour for pair 0:")
    assert pair_texts(second, 0)[0].startswith("<s>Which colour, pair 0?")


def chosen_from_the_key(first, second):
    assert pair_texts(first, 0)[1] == " blue, the colour of the clear sky</s>" and pair_texts(second, 0)[1] == " green</s>"


def rejected_from_the_key(first, second):
    assert pair_texts(first, 2)[1] == " red, the colour of a rose in bloom</s>" and pair_texts(second, 2)[1] == " grey</s>"


def keep_start_keeps_the_first_max_length_tokens(first, second):
    cut, whole = [ids for ids, _ in first.ok().rows], [ids for ids, _ in second.ok().rows]
    assert max(map(len, cut)) == 24 < max(map(len, whole)), (lengths(first), lengths(second))
    assert all(row == other[: len(row)] for row, other in zip(cut, whole, strict=True))


def error_refuses_a_long_row_in_one_line_naming_the_setting(first, second):
    assert first.ok() and second.error is not None
    message = str(second.error)
    assert len(message.splitlines()) == 1 and "data.truncation" in message, message


def pairs_are_padded_to_the_multiple(first, second):
    for read, multiple in ((first, 8), (second, 1)):
        assert [len(b["input_ids"][0]) for b in read.ok().train] == [math.ceil(longest(b) / multiple) * multiple for b in read.train]
    assert any(longest(b) % 8 for b in first.train)


def validation_pairs_come_from_val_path(first, second):
    assert [row for row in val_texts(first)][0].startswith("<s>Pick a colour for pair 0:") and second.ok().val is None


def the_tail_pairs_are_held_out(first, second):
    assert first.ok().val is None and len(second.ok().val) >= 1
    assert len(second.rows) + sum(len(b["input_ids"]) for b in second.val) == len(first.rows)


def prompts(read) -> list:
    return [row for batch in read.ok().train for row in batch]


def prompts_come_from_the_file(first, second):
    assert prompts(first)[0].prompt == "Count to 0:" and prompts(second)[0].prompt == "Pick a colour for pair 0:"


def prompt_from_the_key_and_the_other_columns_for_rewards(first, second):
    assert prompts(first)[0].prompt == "Pick a colour for pair 0:" and prompts(second)[0].prompt == "Which colour, pair 0?"
    assert {"chosen", "good"} <= set(prompts(second)[0].columns) and "question" not in prompts(second)[0].columns


# ----------------------------------------------------------------------------- objectives' losses, on a fixed batch

LOGITS = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([[IGNORE_INDEX, 1, 2], [IGNORE_INDEX, IGNORE_INDEX, 0]])  # 2 completion tokens, then 1
REFERENCE = torch.tensor([-3.0, -2.5])


def policy_logps() -> tuple[float, float, int, int]:
    """(chosen, rejected) summed completion log-probs of LOGITS at LABELS, and their token counts."""
    logps = F.log_softmax(LOGITS[:, :-1], dim=-1).gather(-1, LABELS[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    valid = LABELS[:, 1:] != IGNORE_INDEX
    sums = (logps * valid).sum(-1)
    return sums[0].item(), sums[1].item(), int(valid[0].sum()), int(valid[1].sum())


def dpo_loss_of(read) -> tuple[float, dict]:
    from fntrain.step.objectives.dpo import PreferenceOutput, make_dpo_loss

    config = read.settings.dpo
    reference = REFERENCE if config.needs_reference else None
    loss, metrics = make_dpo_loss(config)(PreferenceOutput(LOGITS, reference), {"labels": LABELS})
    return loss.item(), {key: value.item() for key, value in metrics.items()}


def delta() -> float:
    chosen, rejected, _, _ = policy_logps()
    return (chosen - REFERENCE[0].item()) - (rejected - REFERENCE[1].item())


def sigmoid_loss_at_beta(first, second):
    for read, beta in ((first, 0.1), (second, 1.0)):
        assert math.isclose(dpo_loss_of(read)[0], -logsigmoid(beta * delta()), rel_tol=1e-5), (dpo_loss_of(read), beta)


def rewards_are_beta_times_the_log_ratios(first, second):
    chosen = policy_logps()[0] - REFERENCE[0].item()
    for read, beta in ((first, 0.1), (second, 1.0)):
        assert math.isclose(dpo_loss_of(read)[1]["rewards/chosen"], beta * chosen, rel_tol=1e-5)


def ipo_and_simpo_losses_as_their_formulas(first, second):
    chosen, rejected, chosen_len, rejected_len = policy_logps()
    ipo = ((chosen - REFERENCE[0].item()) / chosen_len - (rejected - REFERENCE[1].item()) / rejected_len - 1 / (2 * 0.1)) ** 2
    assert math.isclose(dpo_loss_of(first)[0], ipo, rel_tol=1e-5), (dpo_loss_of(first), ipo)
    simpo = -logsigmoid(0.1 * (chosen / chosen_len - rejected / rejected_len - 0.5 / 0.1))  # no reference read
    assert math.isclose(dpo_loss_of(second)[0], simpo, rel_tol=1e-5), (dpo_loss_of(second), simpo)


def robust_loss_with_the_smoothing(first, second):
    x = 0.1 * delta()
    for read, eps in ((first, 0.0), (second, 0.3)):
        robust = (-(1 - eps) * logsigmoid(x) + eps * logsigmoid(-x)) / (1 - 2 * eps)
        assert math.isclose(dpo_loss_of(read)[0], robust, rel_tol=1e-5), (dpo_loss_of(read), robust)


def simpo_margin_is_gamma(first, second):
    chosen, rejected, chosen_len, rejected_len = policy_logps()
    for read, gamma in ((first, 0.0), (second, 2.0)):
        simpo = -logsigmoid(0.1 * (chosen / chosen_len - rejected / rejected_len) - gamma)
        assert math.isclose(dpo_loss_of(read)[0], simpo, rel_tol=1e-5), (dpo_loss_of(read), simpo)


STUDENT, TEACHER = LOGITS[:1], torch.randn(1, 3, 5, generator=torch.Generator().manual_seed(1))


def kd_loss_of(read) -> tuple[float, dict]:
    from fntrain.step.objectives.kd import KDOutput, make_kd_loss

    loss, metrics = make_kd_loss(read.settings.kd)(KDOutput(STUDENT, TEACHER), {"labels": LABELS[:1]})
    return loss.item(), {key: value.item() for key, value in metrics.items()}


def kd_terms(temperature: float) -> tuple[float, float]:
    """(cross-entropy, temperature² · −Σ softmax(t/T) log softmax(s/T)) over the 2 scored positions."""
    targets = LABELS[0, 1:]
    ce = F.cross_entropy(STUDENT[0, :-1], targets).item()
    per = -(F.softmax(TEACHER[0, :-1] / temperature, -1) * F.log_softmax(STUDENT[0, :-1] / temperature, -1)).sum(-1)
    return ce, temperature**2 * per.mean().item()


def loss_mixes_ce_and_kl_by_ratio(first, second):
    ce, kl = kd_terms(1.0)
    for read, ratio in ((first, 0.25), (second, 1.0)):
        assert math.isclose(kd_loss_of(read)[0], (1 - ratio) * ce + ratio * kl, rel_tol=1e-5), (kd_loss_of(read), ce, kl)


def both_parts_are_logged(first, second):
    ce, kl = kd_terms(1.0)
    metrics = kd_loss_of(first)[1]
    assert math.isclose(metrics["kd/ce"], ce, rel_tol=1e-5) and math.isclose(metrics["kd/kl"], kl, rel_tol=1e-5)


def kl_at_the_temperature_scaled_by_its_square(first, second):
    for read, temperature in ((first, 1.0), (second, 4.0)):
        kl = kd_terms(temperature)[1]
        assert math.isclose(kd_loss_of(read)[1]["kd/kl"], kl, rel_tol=1e-5), (kd_loss_of(read), kl)


# ----------------------------------------------------------------------------- runs


def model_is_loaded_from_the_directory(first, second):
    from safetensors.torch import load_file

    for outcome in (first.ok(), second.ok()):
        saved = load_file(str(outcome.config.model.path) + "/model.safetensors")
        assert all(torch.equal(outcome.seen.initial[name], value) for name, value in saved.items() if name in outcome.seen.initial)
    assert first.model.config.hidden_size == 32 and second.model.config.hidden_size == 64


def lora_modules(outcome) -> dict:
    return {name: module for name, module in outcome.ok().model.named_modules() if hasattr(module, "lora_A") and module.lora_A}


def adapter_output_is_scaled_by_alpha_over_rank(first, second):
    for outcome, alpha in ((first, 4.0), (second, 16.0)):
        assert {module.scaling["default"] for module in lora_modules(outcome).values()} == {alpha / 2}


def adapter_input_dropout(first, second):
    def rates(outcome):
        return {module.lora_dropout["default"].p if isinstance(module.lora_dropout["default"], torch.nn.Dropout) else 0.0
                for module in lora_modules(outcome).values()}  # fmt: skip

    assert rates(first) == {0.0} and rates(second) == {0.5}, (rates(first), rates(second))


def adapters_only_on_the_named_layers(first, second):
    assert {name.rpartition(".")[2] for name in lora_modules(first)} == {"q_proj"}
    assert {name.rpartition(".")[2] for name in lora_modules(second)} == {"q_proj", "v_proj"}


def merged_export_is_a_whole_model(first, second):
    merged, adapter = (outcome.ok().run_dir / "hf_model" for outcome in (first, second))
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()


def chats_render_with_the_template(first, second):
    tokenizer = first.ok().seen.built.assets.tokenizer
    texts = [tokenizer.decode(batch[0], skip_special_tokens=True) for batch in first.train_batches]
    # the template joins the turns' contents, nothing else: "Say 3." then "3 it is." read "Say 3.3 it is."
    assert texts and all(re.fullmatch(r"Say (\d+)\.\1 it is\.|Who art thou\?A king\.|Speak as a bard\..*", text)
                         for text in texts), texts  # fmt: skip


def teacher_is_loaded_from_the_directory(first, second):
    # the distillation term compares the student with the teacher's logits: another teacher, another KL
    kl = [[row["kd/kl"] for row in outcome.ok().train_rows] for outcome in (first, second)]
    assert kl[0][0] != kl[1][0], kl


def completion_lengths(outcome) -> list[int]:
    return [len(row["completion_ids"]) if "completion_ids" in row else row.get("completion_length") for row in outcome.ok().samples]


def completions_logged(first, second):
    assert len(first.ok().samples) == 2 and len(second.ok().samples) == 0, first.samples


# ----------------------------------------------------------------------------- GRPO runs


def groups(outcome) -> dict[tuple[int, int], list[dict]]:
    """The logged completions by (step, prompt_index)."""
    found: dict[tuple[int, int], list[dict]] = {}
    for row in outcome.ok().samples:
        found.setdefault((row["step"], row["prompt_index"]), []).append(row)
    return found


def each_prompt_gets_num_generations_completions(first, second):
    for outcome, size in ((first, 2), (second, 4)):
        assert {len(rows) for rows in groups(outcome).values()} == {size}, groups(outcome)
        assert all(sorted(row["sample"] for row in rows) == list(range(size)) for rows in groups(outcome).values())


def advantages_are_centred_in_each_group(first, second):
    for outcome in (first, second):
        assert all(abs(sum(row["advantage"] for row in rows)) < 1e-4 for rows in groups(outcome).values())


def completions_are_cut_at_max_completion_length(first, second):
    for outcome, most in ((first, 2), (second, 6)):
        assert {row["completions/max_length"] for row in outcome.ok().train_rows} == {most}, outcome.train_rows


def logged_completions_per_generation(first, second):
    assert [row["step"] for row in first.ok().samples] == [1, 1, 1, 2, 2, 2] and second.ok().samples == []


def completions_of_a_prompt(outcome) -> list[set[str]]:
    return [{row["completion"] for row in rows} for rows in groups(outcome).values()]


def top_k_one_samples_the_likeliest_token_only(first, second):
    assert any(len(texts) > 1 for texts in completions_of_a_prompt(first))
    assert all(len(texts) == 1 for texts in completions_of_a_prompt(second)), completions_of_a_prompt(second)


def a_tiny_top_p_samples_the_likeliest_token_only(first, second):
    assert any(len(texts) > 1 for texts in completions_of_a_prompt(first))
    assert all(len(texts) == 1 for texts in completions_of_a_prompt(second)), completions_of_a_prompt(second)


def rewards_are_the_named_functions(first, second):
    even, odd = ([row["rewards"] for row in outcome.ok().samples] for outcome in (first, second))
    assert {name for row in even for name in row} == {"even_share"} and {name for row in odd for name in row} == {"odd_share"}
    # the same first completions (same seed, same policy), scored by each function: shares of one whole
    assert [row["completion"] for row in first.samples[:2]] == [row["completion"] for row in second.samples[:2]]
    assert all(abs(a["even_share"] + b["odd_share"] - 1) < 1e-6 for a, b in zip(even[:2], odd[:2], strict=True))


def one_generation_feeds_several_steps(first, second):
    assert sorted({row["step"] for row in first.ok().samples}) == [1, 2]
    assert sorted({row["step"] for row in second.ok().samples}) == [1], second.samples


def truncated_completions_leave_the_loss(first, second):
    # every completion here reaches max_completion_length without an EOS
    moved = [not same(outcome.ok().final, outcome.seen.initial) for outcome in (first, second)]
    assert moved == [True, False], moved


def reference_is_the_given_directory(first, second):
    # at step 1 the policy is model.path: its own copy as the reference gives a KL of 0, another model does not
    kl = [outcome.ok().train_rows[0]["kl"] for outcome in (first, second)]
    assert kl[0] == 0.0 < kl[1], kl


def dpo_reference_is_the_given_directory(first, second):
    rewards = [outcome.ok().train_rows[0]["rewards/chosen"] for outcome in (first, second)]
    assert rewards[0] == 0.0 and rewards[1] != 0.0, rewards


def teacher_loads_in_its_dtype(first, second):
    from recipes.kd import teacher_model

    assert teacher_model(first.settings).dtype == "float32" and teacher_model(second.settings).dtype == "bfloat16"


# ----------------------------------------------------------------------------- VLM inputs (the tiny LLaVA's processor)


def answers_of(read) -> list[str]:
    return [text.removesuffix("</s>").strip() for text in trained_texts(read)]


def file_answers(read) -> list[str]:
    import json

    rows = [json.loads(line) for line in Path(read.config.data.path).read_text().splitlines()]
    return [row["messages"][-1]["content"] for row in rows]


def vlm_reads_the_file_or_generates(first, second):
    assert len(first.ok().rows) == 4 and len([r for b in first.val for r in b["input_ids"]]) == 2  # generated
    assert answers_of(second) == file_answers(second), (answers_of(second), file_answers(second))


def vlm_validation_from_val_path(first, second):
    val = [first.text(ids) for batch in first.ok().val for ids in batch["input_ids"]]
    assert len(val) == 4 and all("What is it?" in text for text in val) and second.ok().val is None


def vlm_tail_held_out(first, second):
    assert first.ok().val is None and answers_of(second) == answers_of(first)[:2]
    assert len([r for b in second.val for r in b["input_ids"]]) == 2


def pixels(read) -> list:
    return [row for batch in read.ok().train for row in batch["pixel_values"]]


def images_come_from_the_key(first, second):
    assert pixels(second) == pixels(first)[1:] + pixels(first)[:1]  # each row's picture: the next row's image


def vlm_messages_from_the_key(first, second):
    assert answers_of(first) == file_answers(first) and set(answers_of(second)) == {"circle"}


def vlm_prompt_from_the_key(first, second):
    assert all("What is it?" in text for text in texts(first)) and all("What shape is it?" in text for text in texts(second))


def vlm_completion_from_the_key(first, second):
    assert set(answers_of(first)) == {"circle"} and set(answers_of(second)) == {"cross"}


def a_longer_example_is_an_error_naming_max_length(first, second):
    assert first.ok().rows
    try:
        read = second.rows
    except ValueError as error:
        assert len(str(error).splitlines()) == 1 and "data.max_length (40)" in str(error), error
    else:
        raise AssertionError(f"{len(read)} examples longer than data.max_length were read")


def vlm_every_batch_is_max_length(first, second):
    assert set(widths(first)) == {100} and [len(b["input_ids"][0]) for b in second.ok().train] == [longest(b) for b in second.train]


def generated_training_examples(first, second):
    assert len(first.ok().rows) == 4 and len(second.ok().rows) == 2


def generated_validation_examples(first, second):
    assert [len([r for b in read.ok().val for r in b["input_ids"]]) for read in (first, second)] == [2, 3]


def generated_images_are_image_size_square(first, second):
    assert {row["image"].size for row in first.ok().inputs.train_set.rows} == {(48, 48)}
    assert {row["image"].size for row in second.ok().inputs.train_set.rows} == {(32, 32)}


def answers_are_scored_on_held_out_images(first, second):
    scored = [[row.get("val_accuracy") for row in outcome.ok().val_rows] for outcome in (first, second)]
    assert len(scored[0]) == 1 and 0.0 <= scored[0][0] <= 1.0 and scored[1] == [None], scored


def tiny_llava_is_built_under_cache_dir(first, second):
    for read in (first.ok(), second.ok()):
        assert list(Path(read.config.model.cache_dir).expanduser().rglob("config.json")), read.config.model.cache_dir
    assert first.config.model.cache_dir != second.config.model.cache_dir


HF_SHARED = {
    f"{EXPORTING}:--output-dir": Effect(("{root}/out", "None"), (model_saved_to_output_dir,), slow=True),
    f"{HF}:--model.path": Effect(("{llama}", "{teacher}"), (model_is_loaded_from_the_directory,), slow=True),
    f"{HF}:--model.dtype": Effect(("float32", "bfloat16"), (weights_load_in_the_dtype,), slow=True),
    f"{HF}:--model.attn-implementation": Effect(("sdpa", "eager"), (attention_kernel_follows,), slow=True),
    f"{HF}:--assets.tokenizer-path": Effect(("None", "{bytes}"), (reads_the_given_tokenizer,), read=True),
    f"{HF}:--assets.chat-template": Effect((TEMPLATE, "None"), (chats_render_with_the_template, template_is_saved_with_the_tokenizer), slow=True),
    f"{HF}:--lora.rank": Effect((0, 2), (only_adapters_train,), slow=True),
    f"{HF}:--lora.alpha": Effect((4.0, 16.0), (adapter_output_is_scaled_by_alpha_over_rank,), base=("--lora.rank", "2"), slow=True),
    f"{HF}:--lora.dropout": Effect((0.0, 0.5), (adapter_input_dropout,), base=("--lora.rank", "2"), slow=True),
    f"{HF}:--lora.target-modules": Effect((("q_proj",), ("q_proj", "v_proj")), (adapters_only_on_the_named_layers,), base=("--lora.rank", "2"), slow=True),
    f"{HF}:--lora.merge-on-export": Effect((True, False), (merged_export_is_a_whole_model,), base=("--lora.rank", "2"), slow=True),
}

KEYS = ("--data.path", "{keys}", "--data.max-length", "128")
SFT_DATA = {
    f"{SFT}:--data.path": Effect(("{sft}", "{chat}"), (reads_the_given_file,), read=True),
    f"{SFT}:--data.format": Effect(("text", "chat"), (text_format_reads_the_text_key, chat_format_renders_the_messages), base=KEYS, read=True),
    f"{SFT}:--data.text-key": Effect(("text", "body"), (text_is_read_from_the_key,), base=(*KEYS, "--data.format", "text"), read=True),
    f"{SFT}:--data.prompt-key": Effect(("prompt", "question"), (prompt_is_read_from_the_key,), base=(*KEYS, "--data.format", "prompt_completion"), read=True),
    f"{SFT}:--data.completion-key": Effect(("completion", "answer"), (completion_is_read_from_the_key,), base=(*KEYS, "--data.format", "prompt_completion"), read=True),
    f"{SFT}:--data.messages-key": Effect(("messages", "dialog"), (messages_are_read_from_the_key,), base=(*KEYS, "--data.format", "chat"), read=True),
    f"{SFT}:--data.max-length": Effect((8, 128), (longer_examples_are_cut_to_max_length,), read=True),
    f"{SFT}:--data.packing": Effect((True, False), (packed_samples_fill_max_length_with_several_examples, packed_examples_attend_only_to_themselves, padded_samples_hold_one_example), read=True),
    f"{SFT}:--data.pad-to": Effect(("max_length", "longest"), (every_batch_is_max_length, longest_pads_each_batch_to_its_longest_rounded), read=True),
    f"{SFT}:--data.pad-multiple": Effect((16, 1), (each_batch_is_padded_to_the_multiple,), read=True),
    f"{SFT}:--data.train-on-prompt": Effect((True, False), (prompts_of_prompt_completion_examples_are_trained, user_turns_of_chats_are_trained), read=True),
    f"{SFT}:--data.add-eos": Effect((True, False), (text_examples_end_with_eos, completions_end_with_eos, chat_turns_end_themselves), read=True),
    f"{SFT}:--data.val-path": Effect(("{val}", "None"), (validation_comes_from_val_path, val_path_holds_nothing_of_data_path_out), read=True),
    f"{SFT}:--data.val-fraction": Effect((0.0, 0.5), (the_tail_is_held_out,), read=True),
    f"{SFT}:--data.shards": Effect(("None", "{shards}"), (shards_are_windows_of_max_length_every_token_trained,), base=("--data.path", ""), read=True),
}

PAIRS = ("--data.path", "{pairs}", "--data.max-length", "128")
DPO = {
    "dpo:--data.path": Effect(("{pref}", "{pairs}"), (reads_the_given_pairs,), base=("--data.max-length", "128"), read=True),
    "dpo:--data.prompt-key": Effect(("prompt", "question"), (pair_prompt_from_the_key,), base=PAIRS, read=True),
    "dpo:--data.chosen-key": Effect(("chosen", "good"), (chosen_from_the_key,), base=PAIRS, read=True),
    "dpo:--data.rejected-key": Effect(("rejected", "bad"), (rejected_from_the_key,), base=PAIRS, read=True),
    "dpo:--data.max-length": Effect((24, 128), (keep_start_keeps_the_first_max_length_tokens,), base=("--data.path", "{pairs}"), read=True),
    "dpo:--data.truncation": Effect(("keep_start", "error"), (error_refuses_a_long_row_in_one_line_naming_the_setting,), base=("--data.path", "{pairs}", "--data.max-length", "24"), read=True),
    "dpo:--data.pad-multiple": Effect((8, 1), (pairs_are_padded_to_the_multiple,), base=PAIRS, read=True),
    "dpo:--data.val-path": Effect(("{pairs}", "None"), (validation_pairs_come_from_val_path,), read=True),
    "dpo:--data.val-fraction": Effect((0.0, 0.25), (the_tail_pairs_are_held_out,), read=True),
    "dpo:--dpo.beta": Effect((0.1, 1.0), (sigmoid_loss_at_beta, rewards_are_beta_times_the_log_ratios), read=True),
    "dpo:--dpo.loss-type": Effect(("ipo", "simpo"), (ipo_and_simpo_losses_as_their_formulas,), read=True),
    "dpo:--dpo.label-smoothing": Effect((0.0, 0.3), (robust_loss_with_the_smoothing,), base=("--dpo.loss-type", "robust"), read=True),
    "dpo:--dpo.simpo-gamma": Effect((0.0, 2.0), (simpo_margin_is_gamma,), base=("--dpo.loss-type", "simpo"), read=True),
    "dpo:--dpo.reference": TestedElsewhere("tests/step/objectives/test_dpo_recipe.py::test_the_precomputed_reference_gives_the_copys_numbers_and_simpo_needs_none", "copy and precomputed give the same numbers; adapter-off needs the lora extra"),
    "dpo:--dpo.reference-path": Effect(("None", "{teacher}"), (dpo_reference_is_the_given_directory,), base=("--train.train-iters", "1"), slow=True),
}

KD = {
    "kd:--kd.ratio": Effect((0.25, 1.0), (loss_mixes_ce_and_kl_by_ratio, both_parts_are_logged), read=True),
    "kd:--kd.temperature": Effect((1.0, 4.0), (kl_at_the_temperature_scaled_by_its_square,), read=True),
    "kd:--kd.teacher-path": Effect(("{llama}", "{teacher}"), (teacher_is_loaded_from_the_directory,), slow=True),
    "kd:--kd.teacher-dtype": Effect(("None", "bfloat16"), (teacher_loads_in_its_dtype,), read=True),
}

GRPO_LOSS = "tests/step/objectives/grpo/test_loss.py::"
GRPO_ONE = ("--train.train-iters", "1")
GRPO_FOUR = ("--train.global-batch-size", "4", "--train.micro-batch-size", "2")
GRPO = {
    "grpo:--data.path": Effect(("{prompts}", "{pairs}"), (prompts_come_from_the_file,), read=True),
    "grpo:--data.prompt-key": Effect(("prompt", "question"), (prompt_from_the_key_and_the_other_columns_for_rewards,), base=("--data.path", "{pairs}"), read=True),
    "grpo:--grpo.reward-funcs": Effect(("flag_rewards:even_share", "flag_rewards:odd_share"), (rewards_are_the_named_functions,), base=GRPO_ONE, slow=True),
    "grpo:--grpo.num-generations": Effect((2, 4), (each_prompt_gets_num_generations_completions, advantages_are_centred_in_each_group), base=GRPO_FOUR, slow=True),
    "grpo:--grpo.max-completion-length": Effect((2, 6), (completions_are_cut_at_max_completion_length,), base=GRPO_ONE, slow=True),
    "grpo:--grpo.temperature": TestedElsewhere(GRPO_LOSS + "test_token_logps_are_log_softmax_at_the_temperature", "sampling at a temperature draws at random: the log-probs the loss takes at it are the loss's own test"),
    "grpo:--grpo.top-p": Effect((1.0, 1e-6), (a_tiny_top_p_samples_the_likeliest_token_only,), base=GRPO_ONE, slow=True),
    "grpo:--grpo.top-k": Effect((0, 1), (top_k_one_samples_the_likeliest_token_only,), base=GRPO_ONE, slow=True),
    "grpo:--grpo.steps-per-generation": Effect(("None", 4), (one_generation_feeds_several_steps,), slow=True),
    "grpo:--grpo.num-iterations": Effect((1, 2), (one_generation_feeds_several_steps,), slow=True),
    "grpo:--grpo.mask-truncated-completions": Effect((False, True), (truncated_completions_leave_the_loss,), base=GRPO_ONE, slow=True),
    "grpo:--grpo.reference": TestedElsewhere("tests/step/objectives/test_reference.py::test_adapter_off_reference_with_real_peft_lora", "copy and adapter-off give the same numbers at the start: adapter-off's own test"),
    "grpo:--grpo.reference-path": Effect(("None", "{teacher}"), (reference_is_the_given_directory,), base=(*GRPO_ONE, "--grpo.beta", "0.1"), slow=True),
    "grpo:--grpo.disable-dropout": TestedElsewhere("tests/step/objectives/test_dpo.py::test_disable_dropout_sets_every_dropout_to_zero", "the tiny Llama has no dropout"),
    "grpo:--grpo.completions-to-log": Effect((3, 0), (logged_completions_per_generation,), base=GRPO_FOUR, slow=True),
    "grpo:--grpo.decode-batch-size": Inert("rows decoded together or one at a time: the same texts", (0, 1), slow=True),
}

SHAPES = ("--data.path", "{shapes}")
SHAPES_PC = ("--data.path", "{shapes_pc}")
VLM = {
    "vlm:--answer-tokens": Effect((2, 0), (answers_are_scored_on_held_out_images,), base=("--evaluate.at-end",), slow=True),
    "vlm:--model.path": TestedElsewhere("tests/recipes/test_vlm.py::test_the_default_learns_the_shapes_and_the_export_answers_with_transformers", "needs a second LLaVA directory"),
    "vlm:--model.cache-dir": Effect(("{llava}", "{root}/llava"), (tiny_llava_is_built_under_cache_dir,), read=True, slow=True),
    "vlm:--model.dtype": Effect(("float32", "bfloat16"), (weights_load_in_the_dtype,), slow=True),
    "vlm:--model.attn-implementation": Effect(("sdpa", "eager"), (attention_kernel_follows,), slow=True),
    "vlm:--data.path": Effect(("", "{shapes}"), (vlm_reads_the_file_or_generates,), read=True, slow=True),
    "vlm:--data.val-path": Effect(("{shapes_pc}", "None"), (vlm_validation_from_val_path,), base=SHAPES, read=True, slow=True),
    "vlm:--data.val-fraction": Effect((0.0, 0.5), (vlm_tail_held_out,), base=SHAPES, read=True, slow=True),
    "vlm:--data.image-key": Effect(("image", "picture"), (images_come_from_the_key,), base=SHAPES, read=True, slow=True),
    "vlm:--data.messages-key": Effect(("messages", "dialog"), (vlm_messages_from_the_key,), base=SHAPES, read=True, slow=True),
    "vlm:--data.prompt-key": Effect(("prompt", "question"), (vlm_prompt_from_the_key,), base=SHAPES_PC, read=True, slow=True),
    "vlm:--data.completion-key": Effect(("completion", "answer"), (vlm_completion_from_the_key,), base=SHAPES_PC, read=True, slow=True),
    "vlm:--data.max-length": Effect((512, 40), (a_longer_example_is_an_error_naming_max_length,), read=True, slow=True),
    "vlm:--data.pad-to": Effect(("max_length", "longest"), (vlm_every_batch_is_max_length,), base=("--data.max-length", "100"), read=True, slow=True),
    "vlm:--data.train-samples": Effect((4, 2), (generated_training_examples,), read=True, slow=True),
    "vlm:--data.val-samples": Effect((2, 3), (generated_validation_examples,), read=True, slow=True),
    "vlm:--data.image-size": Effect((48, 32), (generated_images_are_image_size_square,), read=True, slow=True),
}



# ----------------------------------------------------------------------------- GRPO's loss, on a fixed micro-batch

GRPO_LOGPS = torch.tensor([[-1.0, -0.5], [-2.0, 0.0]])  # two completions: 2 tokens, then 1 (the second is masked)
GRPO_OLD = GRPO_LOGPS - torch.log(torch.tensor([[1.5, 1.1], [0.5, 1.0]]))  # importance ratios 1.5, 1.1 and 0.5
GRPO_REF = GRPO_LOGPS + torch.tensor([[0.3, -0.2], [0.4, 0.0]])
GRPO_BATCH = {
    "labels": torch.tensor([[0, 5, 6], [0, 7, IGNORE_INDEX]]), "advantages": torch.tensor([1.0, -1.0]),
    "old_logps": GRPO_OLD, "ref_logps": GRPO_REF, "generation_tokens": torch.tensor(3.0),
}  # fmt: skip
RATIOS, ADVANTAGES, MASK = [[1.5, 1.1], [0.5, None]], [1.0, -1.0], [[True, True], [True, False]]


def grpo_loss_of(read) -> tuple[float, dict]:
    from fntrain.step.objectives.grpo.loss import GRPOOutput, make_grpo_loss

    config = read.settings.grpo
    loss, metrics = make_grpo_loss(config, micro_batches=1, steps_per_generation=1)(
        GRPOOutput(GRPO_LOGPS, torch.zeros_like(GRPO_LOGPS)), GRPO_BATCH)
    return loss.item(), {key: value.item() for key, value in metrics.items()}


def token_losses(low: float, high: float, cap: float | None = None, ratios=RATIOS) -> list[list[float]]:
    """−min(r·A, clip(r, low, high)·A) per token (the unclipped r capped at `cap`), as the help texts say."""
    return [[-min(min(r, cap or r) * a, min(max(r, low), high) * a) for r in row if r is not None]
            for row, a in zip(ratios, ADVANTAGES, strict=True)]  # fmt: skip


def dapo(losses: list[list[float]]) -> float:
    """dapo (the default): the tokens' sum over the generation batch's tokens (3)."""
    return sum(map(sum, losses)) / 3


def ratio_is_clipped_to_one_plus_minus_epsilon(first, second):
    for read, eps in ((first, 0.2), (second, 0.5)):
        assert math.isclose(grpo_loss_of(read)[0], dapo(token_losses(1 - eps, 1 + eps)), rel_tol=1e-5)


def upper_clip_is_epsilon_high(first, second):
    for read, high in ((first, 1.2), (second, 1.6)):
        assert math.isclose(grpo_loss_of(read)[0], dapo(token_losses(0.8, high)), rel_tol=1e-5)


def unclipped_ratio_is_capped_at_delta(first, second):
    assert math.isclose(grpo_loss_of(first)[0], dapo(token_losses(0.8, 1.2)), rel_tol=1e-5)
    assert math.isclose(grpo_loss_of(second)[0], dapo(token_losses(0.8, 1.2, cap=1.3)), rel_tol=1e-5)


def k3(row: int, token: int) -> float:
    d = (GRPO_REF - GRPO_LOGPS)[row, token].item()
    return math.exp(d) - d - 1


def kl_penalty_weighs_beta(first, second):
    plain = token_losses(0.8, 1.2)
    assert math.isclose(grpo_loss_of(first)[0], dapo(plain), rel_tol=1e-5) and "kl" not in grpo_loss_of(first)[1]
    kl = [[0.5 * k3(i, j) * RATIOS[i][j] for j in range(2) if MASK[i][j]] for i in range(2)]  # bias-corrected
    assert math.isclose(grpo_loss_of(second)[0], dapo([[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(plain, kl, strict=True)]), rel_tol=1e-5)


def kl_is_multiplied_by_the_ratio_only_when_bias_corrected(first, second):
    plain = token_losses(0.8, 1.2)
    for read, corrected in ((first, True), (second, False)):
        kl = [[0.5 * k3(i, j) * (RATIOS[i][j] if corrected else 1.0) for j in range(2) if MASK[i][j]] for i in range(2)]
        expected = dapo([[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(plain, kl, strict=True)])
        assert math.isclose(grpo_loss_of(read)[0], expected, rel_tol=1e-5), (grpo_loss_of(read), expected)


def sequence_level_takes_one_ratio_per_completion(first, second):
    assert math.isclose(grpo_loss_of(first)[0], dapo(token_losses(0.8, 1.2)), rel_tol=1e-5)
    one = [[math.exp((math.log(1.5) + math.log(1.1)) / 2)] * 2, [0.5, None]]  # the geometric mean of the row's
    assert math.isclose(grpo_loss_of(second)[0], dapo(token_losses(0.8, 1.2, ratios=one)), rel_tol=1e-5)


def loss_type_normalises_as_documented(first, second):
    losses = token_losses(0.8, 1.2)
    grpo = sum(sum(row) / len(row) for row in losses) / 2  # per-completion token mean, then the mean
    assert math.isclose(grpo_loss_of(first)[0], grpo, rel_tol=1e-5)
    dr_grpo = sum(map(sum, losses)) / (2 * 6)  # rows x max_completion_length (6)
    assert math.isclose(grpo_loss_of(second)[0], dr_grpo, rel_tol=1e-5)


# ----------------------------------------------------------------------------- GRPO's advantages

REWARDS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # 2 prompts x 2 generations, 2 functions


def grpo_advantages_of(read) -> list[float]:
    """The advantages the rollout gives REWARDS under the parsed grpo settings (fntrain's group_advantages)."""
    from fntrain.step.objectives.grpo.advantages import group_advantages

    grpo = read.settings.grpo
    weights = grpo.reward_weights or (1.0,) * REWARDS.shape[1]
    return group_advantages(REWARDS, weights, grpo.num_generations, grpo.scale_rewards,
                            grpo.multi_objective_aggregation, ("a", "b")).advantages.tolist()  # fmt: skip


def centred(rewards: list[float]) -> list[float]:
    return [r - (rewards[i // 2 * 2] + rewards[i // 2 * 2 + 1]) / 2 for i, r in enumerate(rewards)]


def std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def advantages_are_scaled_by_the_groups_or_the_batchs_std(first, second):
    summed = [1.0, 1.0, 2.0, 0.0]
    group = [c / (std(summed[i // 2 * 2 : i // 2 * 2 + 2]) + 1e-4) for i, c in enumerate(centred(summed))]
    batch = [c / (std(summed) + 1e-4) for c in centred(summed)]
    assert grpo_advantages_of(first) == pytest_approx(group) and grpo_advantages_of(second) == pytest_approx(batch)


def weights_scale_each_function(first, second):
    for read, weights in ((first, (1.0, 1.0)), (second, (1.0, 3.0))):
        summed = [a * weights[0] + b * weights[1] for a, b in REWARDS.tolist()]
        assert grpo_advantages_of(read) == pytest_approx([c / (std(summed[i // 2 * 2 : i // 2 * 2 + 2]) + 1e-4)
                                                     for i, c in enumerate(centred(summed))])  # fmt: skip


def normalize_then_sum_scales_each_function_in_its_group_first(first, second):
    assert grpo_advantages_of(first) != grpo_advantages_of(second)
    per = [[c / (std(col[i // 2 * 2 : i // 2 * 2 + 2]) + 1e-4) for i, c in enumerate(centred(col))]
           for col in (REWARDS[:, 0].tolist(), REWARDS[:, 1].tolist())]  # fmt: skip
    summed = [a + b for a, b in zip(*per, strict=True)]
    assert grpo_advantages_of(second) == pytest_approx([s / (std(summed) + 1e-4) for s in summed])


def pytest_approx(values):
    import pytest

    return pytest.approx(values, rel=1e-4, abs=1e-5)


GRPO.update({
    "grpo:--grpo.epsilon": Effect((0.2, 0.5), (ratio_is_clipped_to_one_plus_minus_epsilon,), read=True, slow=True),
    "grpo:--grpo.epsilon-high": Effect(("None", 0.6), (upper_clip_is_epsilon_high,), read=True, slow=True),
    "grpo:--grpo.delta": Effect(("None", 1.3), (unclipped_ratio_is_capped_at_delta,), read=True, slow=True),
    "grpo:--grpo.beta": Effect((0.0, 0.5), (kl_penalty_weighs_beta,), read=True, slow=True),
    "grpo:--grpo.use-bias-correction-kl": Effect((True, False), (kl_is_multiplied_by_the_ratio_only_when_bias_corrected,), base=("--grpo.beta", "0.5"), read=True, slow=True),
    "grpo:--grpo.importance-sampling-level": Effect(("token", "sequence"), (sequence_level_takes_one_ratio_per_completion,), read=True, slow=True),
    "grpo:--grpo.loss-type": Effect(("grpo", "dr_grpo"), (loss_type_normalises_as_documented,), base=("--grpo.max-completion-length", "6"), read=True, slow=True),
    "grpo:--grpo.scale-rewards": Effect(("group", "batch"), (advantages_are_scaled_by_the_groups_or_the_batchs_std,), base=("--grpo.num-generations", "2"), read=True, slow=True),
    "grpo:--grpo.reward-weights": Effect(("None", (1.0, 3.0)), (weights_scale_each_function,), base=("--grpo.num-generations", "2", "--grpo.reward-funcs", "flag_rewards:even_share", "flag_rewards:even_share"), read=True, slow=True),
    "grpo:--grpo.multi-objective-aggregation": Effect(("sum_then_normalize", "normalize_then_sum"), (normalize_then_sum_scales_each_function_in_its_group_first,), base=("--grpo.num-generations", "2"), read=True, slow=True),
})

HF_RECIPES = {**HF_SHARED, **SFT_DATA, **VLM, **DPO, **KD, **GRPO}
