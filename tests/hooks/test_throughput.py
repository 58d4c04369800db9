"""Throughput meter [S28]: step time, rates, TFLOP/s and MFU arithmetic, peak table, memory, resume."""

from __future__ import annotations

import logging

import pytest
import torch

from fntrain.hooks import throughput as throughput_module
from fntrain.hooks.base import every, hook_states, load_hook_states, on
from fntrain.hooks.throughput import ThroughputConfig, throughput_meter
from fntrain.loop import Event, StepInfo
from fntrain.models.flops import dense_transformer_flops_per_token, measure_flops_per_token
from fntrain.runtime.peak_flops import peak_flops_for_name
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.hooks.drive import drive, state_at, torch_op_recorder


def figures_by_step(meter, every_n: int, first: int, last: int, *, tokens=1000, samples=4, step_time=0.5):
    """Steps first..last, the meter's figures read every `every_n` steps (as the metrics hook reads
    them); returns {step: figures} for the steps that read non-empty figures."""
    posted = {}

    def read(state, info):
        figures = meter.figures()
        if figures:
            posted[state.global_step] = figures

    def step_info(state):
        count = tokens(state.global_step) if callable(tokens) else tokens
        return StepInfo({}, count, samples, step_time)

    reader = every(every_n, on(Event.STEP_END, read))
    steps = last - first + 1
    drive([meter.hook, reader], steps, start=state_at(first - 1), info=step_info, begin=False, end=None)
    return posted


def test_peak_table_matches_specific_names_first():
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA H20") == 148e12
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA L40S") == 362e12
    assert peak_flops_for_name("NVIDIA L40") == 181e12
    assert peak_flops_for_name("NVIDIA B200") == 2250e12
    assert peak_flops_for_name("NVIDIA GeForce RTX 4090") == 165.2e12
    assert peak_flops_for_name("AMD Instinct MI300X") == 1307e12
    assert peak_flops_for_name("Ascend910B2") == 354e12
    assert peak_flops_for_name("Ascend910_9392") == 354e12
    assert peak_flops_for_name("Some Future Chip") is None


def test_flops_per_token_of_two_linear_layers_matches_a_hand_count():
    batch, seq, d_in, d_hidden, d_out = 2, 3, 8, 16, 4
    model = torch.nn.Sequential(
        torch.nn.Linear(d_in, d_hidden, bias=False), torch.nn.Linear(d_hidden, d_out, bias=False)
    )
    example = {"x": torch.randn(batch, seq, d_in), "token_count": batch * seq}
    measured = measure_flops_per_token(model, example, forward=lambda m, b: m(b["x"]))
    # forward 2*in*h + 2*h*out; backward: both weight grads (2*in*h + 2*h*out) and the input grad of the
    # second layer (2*h*out); the first layer's input needs no grad.
    assert measured == 4 * d_in * d_hidden + 6 * d_hidden * d_out
    forward_only = measure_flops_per_token(model, example, forward=lambda m, b: m(b["x"]), backward=False)
    assert forward_only == 2 * d_in * d_hidden + 2 * d_hidden * d_out
    assert model[0].weight.device.type == "cpu" and model[0].weight.grad is None  # the model is untouched


def test_flops_measured_from_a_factory_on_meta_keeps_tied_weights():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 6)
            self.head = torch.nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, input_ids, **_):
            return self.head(self.embed(input_ids))

    ids = torch.zeros(2, 5, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    model = Tied()
    rng = torch.get_rng_state()
    from_module = measure_flops_per_token(model, batch)
    from_factory = measure_flops_per_token(Tied, batch)
    # measured at TRAIN_BEGIN, after a checkpoint restored the RNG: drawing from it would break exact resume
    assert torch.equal(rng, torch.get_rng_state())
    assert from_module == from_factory > 0
    # labels[..., 1:] makes 2 x 4 tokens; the head's matmul over 10 positions: forward 2*6*10 each,
    # backward its weight grad and its input grad (the embedding needs it) 2*6*10 each; the embedding's
    # gather counts no FLOPs.
    assert from_module == (2 + 2 + 2) * 6 * 10 * 10 / 8


def test_flops_of_a_padded_batch_are_measured_although_the_model_reads_its_mask():
    """[issue 27] transformers asks whether a padding mask is all ones (`.item()`), which a meta tensor
    cannot answer: the padded batch is measured by its shapes, per valid token."""

    class ReadsMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 6)
            self.head = torch.nn.Linear(6, 10, bias=False)

        def forward(self, input_ids, attention_mask=None, **_):
            if attention_mask is not None and not bool(attention_mask.all()):  # what HF's mask code does
                pass
            return self.head(self.embed(input_ids))

    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    padded = measure_flops_per_token(ReadsMask, {"input_ids": ids, "labels": labels, "attention_mask": mask})
    # the head's three matmuls over all 2 x 8 positions, per valid target: 7 + 4 of labels[..., 1:]
    assert padded == (2 + 2 + 2) * 6 * 10 * 16 / 11
    with pytest.raises(RuntimeError, match="meta"):  # the failure the measure steps around
        ReadsMask().to("meta")(ids.to("meta"), mask.to("meta"))


@pytest.mark.slow
def test_flops_of_a_padded_batch_through_a_transformers_llama(recwarn):
    from transformers import LlamaConfig, LlamaForCausalLM

    from fntrain.step import causal_lm_loss

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    padded = measure_flops_per_token(lambda: LlamaForCausalLM(config),
                                     {"input_ids": ids, "labels": labels, "attention_mask": mask},
                                     loss_fn=causal_lm_loss)  # fmt: skip
    full = measure_flops_per_token(lambda: LlamaForCausalLM(config), {"input_ids": ids, "labels": ids},
                                   loss_fn=causal_lm_loss)  # fmt: skip
    assert padded == full * 30 / 24  # the same work over fewer valid tokens (15 + 9 of labels[..., 1:])
    model = LlamaForCausalLM(config)
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert 1.0 < full / (6 * matmul_weights) < 1.5  # sane: ~6 FLOPs per weight and token, plus attention
    assert not [w for w in recwarn if "FLOPs" in str(w.message)]


def test_dense_transformer_formula():
    assert dense_transformer_flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16


def test_rates_tflops_and_mfu_arithmetic():
    config = ThroughputConfig(flops_per_token=6e6, peak_tflops=100.0)
    meter = throughput_meter(config, Runtime(world_size=4, dp_size=2))
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    posted = figures_by_step(meter, 2, 1, 4, tokens=1000, samples=4, step_time=0.5)
    assert sorted(posted) == [2, 4]
    metrics = posted[4]
    # one rank's 1000 tokens per step x dp_size 2 = 2000 global tokens per step, 2 steps in 1.0 s
    assert metrics["step_time_s"] == 0.5
    assert metrics["tokens_per_s"] == 4000.0
    assert metrics["samples_per_s"] == 16.0
    assert metrics["tflops"] == pytest.approx(6e6 * 4000.0 / 4 / 1e12)  # per device: world of 4
    assert metrics["mfu"] == pytest.approx(6e6 * 4000.0 / 4 / 100e12)
    assert metrics["consumed_tokens"] == 8000 and metrics["consumed_samples"] == 32
    assert "peak_mem_gib" not in metrics  # cpu


def test_cpu_without_a_configured_peak_reports_no_mfu_and_unknown_flops_no_tflops():
    meter = throughput_meter(ThroughputConfig(), Runtime())
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    posted = figures_by_step(meter, 1, 1, 1)
    assert "tflops" not in posted[1] and "mfu" not in posted[1]
    meter = throughput_meter(ThroughputConfig(), Runtime(), flops_per_token=10.0)
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    posted = figures_by_step(meter, 1, 1, 1, tokens=100, step_time=1.0)
    assert posted[1]["tflops"] == pytest.approx(10.0 * 100 / 1e12) and "mfu" not in posted[1]


def test_tensor_and_int_token_counts_mix_and_many_unlogged_steps_are_folded():
    meter = throughput_meter(ThroughputConfig(), Runtime())
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    posted = figures_by_step(meter, 600, 1, 600, tokens=lambda s: torch.tensor(3) if s % 2 else 5)
    assert posted[600]["consumed_tokens"] == 300 * 3 + 300 * 5


def test_step_time_is_averaged_over_the_interval():
    meter = throughput_meter(ThroughputConfig(), Runtime())
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    for step, seconds in zip(range(1, 5), (0.1, 0.2, 0.3, 0.4), strict=True):
        meter.hook(Event.STEP_END, state_at(step), StepInfo({}, 10, 1, seconds))
    posted = meter.figures()
    assert posted["step_time_s"] == pytest.approx(0.25)
    assert posted["tokens_per_s"] == pytest.approx(40 / 1.0)


def test_device_sync_and_memory_only_on_logging_steps(monkeypatch):
    calls = []

    class FakeDevice:
        def synchronize(self):
            calls.append("sync")

        def max_memory_allocated(self, device):
            calls.append("memory")
            return 3 * 2**30

        def get_device_name(self, device):
            return "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(throughput_module, "_device_module", lambda device: FakeDevice())
    meter = throughput_meter(ThroughputConfig(flops_per_token=1.0), Runtime())
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    posted = figures_by_step(meter, 3, 1, 7)
    assert calls == ["sync", "memory", "sync", "memory"]  # steps 3 and 6
    assert posted[3]["peak_mem_gib"] == 3.0
    assert posted[3]["mfu"] == pytest.approx(posted[3]["tflops"] * 1e12 / 989e12)  # peak from the table


def test_non_logging_step_runs_no_torch_op():
    meter = throughput_meter(ThroughputConfig(), Runtime())
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    infos = [StepInfo({"loss": torch.tensor(1.0)}, torch.tensor(7), 2, 0.01) for _ in range(9)]
    with torch_op_recorder() as recorder:
        for step, step_info in enumerate(infos, start=1):
            meter.hook(Event.STEP_END, state_at(step), step_info)
    assert recorder.calls == []


def test_resume_restores_consumed_counts_including_unlogged_steps():
    first = throughput_meter(ThroughputConfig(), Runtime())
    first.hook(Event.TRAIN_BEGIN, TrainState(), None)
    figures_by_step(first, 2, 1, 5, tokens=lambda s: torch.tensor(10 * s), samples=2)
    saved = hook_states([first.hook])
    assert saved == {
        "throughput": {
            "consumed_tokens": 100,
            "consumed_samples": 8,
            "pending_tokens": 50,
            "pending_samples": 2,
        }
    }

    resumed = throughput_meter(ThroughputConfig(), Runtime())
    assert load_hook_states([resumed.hook], saved) == []
    resumed.hook(Event.TRAIN_BEGIN, state_at(5), None)
    posted = figures_by_step(resumed, 2, 6, 8, tokens=lambda s: torch.tensor(10 * s), samples=2, step_time=1.0)
    assert posted[8]["consumed_tokens"] == sum(10 * s for s in range(1, 9))
    assert posted[8]["consumed_samples"] == 16
    assert posted[6]["tokens_per_s"] == 60.0  # the restored steps count as consumed, not as this interval's


def test_load_state_rejects_a_foreign_state():
    meter = throughput_meter(ThroughputConfig(), Runtime())
    with pytest.raises(ValueError, match="consumed_tokens"):
        meter.hook.load_state_dict({"tokens": 1})


def test_flops_callable_measured_once_at_train_begin_and_failure_is_a_warning(caplog):
    calls = []

    def measure():
        calls.append(1)
        return 2.0

    meter = throughput_meter(ThroughputConfig(), Runtime(), flops_per_token=measure)
    assert calls == []  # built: nothing measured
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    figures_by_step(meter, 1, 1, 3)
    assert calls == [1]

    def broken():
        raise RuntimeError("no meta kernel")

    meter = throughput_meter(ThroughputConfig(), Runtime(), flops_per_token=broken)
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.throughput"):
        meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert "no meta kernel" in caplog.text
    assert "tflops" not in figures_by_step(meter, 1, 1, 1)[1]

    meter = throughput_meter(ThroughputConfig(flops_per_token=5.0), Runtime(), flops_per_token=broken)
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)  # the configured value wins: nothing is measured
    assert figures_by_step(meter, 1, 1, 1, tokens=10, step_time=1.0)[1]["tflops"] == pytest.approx(50 / 1e12)


def test_disabled_hook_posts_nothing_and_keeps_no_state():
    meter = throughput_meter(ThroughputConfig(enabled=False), Runtime())
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert figures_by_step(meter, 1, 1, 3) == {}
    assert meter.hook.name == "throughput" and meter.hook.state_dict() == {}


def test_abort_before_train_begin_is_a_no_op():
    """ABORT to a meter whose TRAIN_BEGIN never ran [S9]: nothing measured, the restored counters
    untouched (a later save would hold them), the figures those of a meter that never saw it."""
    measured = []
    restored = {"consumed_tokens": 100, "consumed_samples": 8, "pending_tokens": 5, "pending_samples": 1}
    meter, twin = (
        throughput_meter(ThroughputConfig(), Runtime(), flops_per_token=lambda: measured.append(1) or 6.0)
        for _ in range(2)
    )
    for each in (meter, twin):
        each.hook.load_state_dict(restored)
    meter.hook(Event.ABORT, TrainState(), RuntimeError("boom"))
    assert measured == [] and meter.hook.state_dict() == restored
    assert meter.figures() == twin.figures()


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="throughput.peak_tflops"):
        ThroughputConfig(peak_tflops=0.0).validate()
    with pytest.raises(TypeError, match="throughput.enabled"):
        ThroughputConfig(enabled=1).validate()
    with pytest.raises(TypeError, match="throughput.flops_per_token"):
        throughput_meter(ThroughputConfig(flops_per_token="6N"), Runtime())
