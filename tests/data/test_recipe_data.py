"""The tiny_gpt recipe's results do not depend on `--loader.num-workers` or `--loader.prefetch`."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading

import pytest

from fntrain import Event
from fntrain.data.settings import LoaderConfig
from fntrain.run.job import run_job

tiny_gpt = pytest.importorskip("recipes.tiny_gpt")


def losses_with_loader(tmp_path, *, num_workers: int, prefetch: bool) -> list[float]:
    losses: list[float] = []

    def record(event, state, info):
        if event is Event.STEP_END:
            losses.append(float(info.metrics["loss"]))

    config = tiny_gpt.Config(
        run_dir=str(tmp_path / f"w{num_workers}_p{int(prefetch)}"),
        log_every=0,
        model=tiny_gpt.ModelConfig(context=16, n_layer=1, n_head=2, d_model=16),
        loader=LoaderConfig(num_workers=num_workers, prefetch=prefetch),
        train=tiny_gpt.TrainConfig(train_iters=4, global_batch_size=8, micro_batch_size=4),
    )
    spec = dataclasses.replace(tiny_gpt.spec, hooks=lambda built: [record])
    assert run_job(config, spec).state.global_step == 4
    return losses


def test_losses_do_not_depend_on_workers_or_prefetch(tmp_path):
    baseline = threading.active_count()
    reference = losses_with_loader(tmp_path, num_workers=0, prefetch=False)
    assert len(reference) == 4
    for num_workers, prefetch in ((0, True), (2, False), (2, True)):
        assert losses_with_loader(tmp_path, num_workers=num_workers, prefetch=prefetch) == reference
    assert threading.active_count() == baseline and multiprocessing.active_children() == []


def test_data_fields_are_validated_by_name():
    config = tiny_gpt.Config(loader=LoaderConfig(num_workers=-1))
    with pytest.raises(ValueError, match="loader.num_workers must be >= 0, got -1"):
        config.validate()
