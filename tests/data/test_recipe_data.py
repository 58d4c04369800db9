"""The tiny_gpt recipe's results do not depend on `--data.num-workers` or `--data.prefetch`."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from fntrain import Event

tiny_gpt = pytest.importorskip("recipes.tiny_gpt")


def _losses(tmp_path, monkeypatch, *, num_workers: int, prefetch: bool) -> list[float]:
    losses: list[float] = []

    def record(event, state, info):
        if event is Event.STEP_END:
            losses.append(float(info.metrics["loss"]))

    monkeypatch.setattr(tiny_gpt, "build_hooks", lambda *args, **kwargs: [record])
    config = tiny_gpt.TinyGPTConfig(
        run_dir=str(tmp_path / f"w{num_workers}_p{int(prefetch)}"),
        log_every=0,
        model=tiny_gpt.ModelConfig(context=16, n_layer=1, n_head=2, d_model=16),
        data=tiny_gpt.DataConfig(num_workers=num_workers, prefetch=prefetch),
        train=tiny_gpt.TrainConfig(train_iters=4, global_batch_size=8, micro_batch_size=4),
    )
    final = tiny_gpt.run(config)
    assert final.global_step == 4
    return losses


def test_losses_do_not_depend_on_workers_or_prefetch(tmp_path, monkeypatch):
    baseline = threading.active_count()
    reference = _losses(tmp_path, monkeypatch, num_workers=0, prefetch=False)
    assert len(reference) == 4
    for num_workers, prefetch in ((0, True), (2, False), (2, True)):
        assert _losses(tmp_path, monkeypatch, num_workers=num_workers, prefetch=prefetch) == reference
    assert threading.active_count() == baseline and multiprocessing.active_children() == []


def test_data_fields_are_validated_by_name():
    config = tiny_gpt.TinyGPTConfig(data=tiny_gpt.DataConfig(num_workers=-1))
    with pytest.raises(ValueError, match="data.num_workers must be >= 0, got -1"):
        config.validate()
