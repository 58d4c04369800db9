"""Weighted mixing: proportions per epoch and within tolerance inside it, deterministic in (seed, epoch),
identical after a resume at any step (issue 12, item 6)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from fntrain import RunPlan, StopTraining, TrainState, train
from fntrain.data.mixing import Mixture, interleave, mixture_counts, permute_index
from fntrain.data.pipeline import build_data, data_fn, steps_per_epoch
from fntrain.data.settings import Batching, LoaderConfig


class TaggedSource(torch.utils.data.Dataset):
    """Sample i of source `tag` is {"id": tag * 1000 + i}."""

    def __init__(self, tag: int, length: int):
        self.tag, self.length = tag, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return {"id": torch.tensor(self.tag * 1000 + index)}


WEIGHTS = [0.5, 0.3, 0.2]


def mixture(**options) -> Mixture:
    options = {"samples_per_epoch": 600, "seed": 11, **options}
    return Mixture([TaggedSource(0, 400), TaggedSource(1, 30), TaggedSource(2, 900)], WEIGHTS, **options)


def mixing_spec_of(dataset, *, dp_rank=0, dp_size=1, shuffle=True, num_workers=0):
    loader = LoaderConfig(shuffle=shuffle, num_workers=num_workers, pin_memory=False)
    return build_data(dataset, Batching(4, 2, seed=11, dp_rank=dp_rank, dp_size=dp_size), loader)


def read_ids(data, epoch: int, cursor: int) -> list[list[int]]:
    """Each remaining step of `epoch` as the flat list of its sample ids."""
    iterator = data(epoch, cursor)
    try:
        return [[i for mb in step for i in mb["id"].tolist()] for step in iterator]
    finally:
        iterator.close()


def test_counts_and_the_interleave_follow_the_weights():
    assert mixture_counts([0.5, 0.3, 0.2], 7) == [4, 2, 1] and sum(mixture_counts([1, 1, 1], 10)) == 10
    sources, ordinals = interleave([5, 3, 2])
    assert sorted(Counter(sources.tolist()).items()) == [(0, 5), (1, 3), (2, 2)]
    for s in range(3):
        assert ordinals[sources == s].tolist() == list(range([5, 3, 2][s]))
    # Every prefix of a round is within one sample of the weights (stride scheduling).
    for prefix in range(1, 11):
        counts = np.bincount(sources[:prefix], minlength=3)
        assert np.all(np.abs(counts - np.array([0.5, 0.3, 0.2]) * prefix) <= 1)
    for size in (1, 2, 7, 64, 1000, 4097):
        assert sorted(permute_index(i, size, key=3) for i in range(size)) == list(range(size))
    assert [permute_index(i, 100, 1) for i in range(100)] != [permute_index(i, 100, 2) for i in range(100)]


def test_proportions_per_epoch_and_within_tolerance_inside_it():
    dataset = mixture()
    assert dataset.epoch_counts == (300, 180, 120) and dataset.proportions == pytest.approx(WEIGHTS)
    data = data_fn(mixing_spec_of(dataset))
    for epoch in range(3):
        steps = read_ids(data, epoch, 0)
        ids = [i for step in steps for i in step]
        assert len(ids) == 600
        assert Counter(i // 1000 for i in ids) == {0: 300, 1: 180, 2: 120}  # exact over the epoch
        head = Counter(i // 1000 for i in ids[:160])  # the sampler's shuffle: close to the weights early on
        for source, weight in enumerate(WEIGHTS):
            assert abs(head[source] / 160 - weight) < 0.1
    # Unshuffled, every window of the epoch holds the weights to within a sample.
    in_order = [
        i // 1000 for step in read_ids(data_fn(mixing_spec_of(mixture(), shuffle=False)), 0, 0) for i in step
    ]
    for start in range(0, 600, 40):
        window = Counter(in_order[start : start + 40])
        assert all(abs(window[s] - w * 40) <= 1 for s, w in enumerate(WEIGHTS))


def test_sources_are_walked_without_repeats_and_upsampled_evenly():
    dataset = mixture()
    seen = {0: [], 1: [], 2: []}
    for epoch in range(5):
        dataset.set_epoch(epoch)
        for index in range(len(dataset)):
            source, position = dataset.locate(index)
            assert dataset[index]["id"] == source * 1000 + position
            seen[source].append(position)
    # Source 2 (900 samples, 120 per epoch) shows new samples every epoch until it has shown 600 distinct.
    assert len(set(seen[2])) == len(seen[2]) == 600
    # Source 0 (400 samples, 300 per epoch): its second pass starts in epoch 1 and reshuffles.
    assert len(set(seen[0][:400])) == 400 and seen[0][400:800] != seen[0][:400]
    # Source 1 (30 samples, 180 per epoch) is upsampled: each sample 6 times per epoch.
    assert set(Counter(seen[1][:180]).values()) == {6}
    unshuffled = mixture(shuffle=False)
    assert [unshuffled.locate(i)[1] for i in range(600) if unshuffled.locate(i)[0] == 2][:5] == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_deterministic_in_seed_and_epoch():
    first = read_ids(data_fn(mixing_spec_of(mixture())), 2, 0)
    assert read_ids(data_fn(mixing_spec_of(mixture())), 2, 0) == first  # a rebuilt mixture: same epoch
    assert read_ids(data_fn(mixing_spec_of(mixture())), 3, 0) != first  # another epoch
    reseeded = build_data(mixture(seed=12), Batching(4, 2, seed=12))
    assert read_ids(data_fn(reseeded), 2, 0) != first  # another seed


@pytest.mark.parametrize(("dp_rank", "dp_size"), [(0, 1), (1, 2)])
def test_identical_after_resume_at_every_cursor(dp_rank, dp_size):
    spec = mixing_spec_of(mixture(), dp_rank=dp_rank, dp_size=dp_size)
    data = data_fn(spec)
    full = read_ids(data, 1, 0)
    assert len(full) == steps_per_epoch(spec)
    for cursor in [*range(0, len(full), 6), len(full) - 1, len(full)]:
        # A fresh mixture each time, as after a restart: only (epoch, cursor) carries over.
        assert (
            read_ids(data_fn(mixing_spec_of(mixture(), dp_rank=dp_rank, dp_size=dp_size)), 1, cursor)
            == full[cursor:]
        )


def test_train_stopped_and_resumed_sees_the_same_mixture_across_epochs():
    def run(state: TrainState, stop_after: int | None, num_workers: int = 0) -> tuple[TrainState, list]:
        spec = mixing_spec_of(mixture(), num_workers=num_workers)
        per_epoch = steps_per_epoch(spec)
        plan = RunPlan(train_iters=2 * per_epoch + 5, steps_per_epoch=per_epoch, epochs=3)
        seen = []

        def step_fn(state, batch):
            seen.append([i for mb in batch for i in mb["id"].tolist()])
            return {}

        def stopper(event, state, info):
            if stop_after is not None and info is not None and state.global_step == stop_after:
                raise StopTraining

        return train(state, step_fn, [stopper], data=data_fn(spec), plan=plan).state, seen

    _, uninterrupted = run(TrainState(), None)
    epochs = [
        Counter(i // 1000 for step in uninterrupted[e * 75 : (e + 1) * 75] for i in step) for e in range(2)
    ]
    assert epochs[0] == epochs[1] == {0: 300, 1: 180, 2: 120}
    state, first = run(TrainState(), 40)
    state, second = run(state, 100)  # resumed mid-epoch 0, stopped in epoch 1
    assert state.epoch == 1
    _, last = run(state, None, num_workers=1)  # a worker process reads the resumed epoch's mixture too
    assert first + second + last == uninterrupted


def test_source_tags_and_validation():
    tagged = mixture(source_key="source")
    tagged.set_epoch(1)
    sample = tagged[5]
    assert int(sample["source"]) == int(sample["id"]) // 1000
    assert mixture(samples_per_epoch=None).samples_per_epoch == 1330
    with pytest.raises(ValueError, match="one weight per source"):
        Mixture([TaggedSource(0, 3)], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"weights\[1\] = -1"):
        Mixture([TaggedSource(0, 3), TaggedSource(1, 3)], [1, -1])
    with pytest.raises(ValueError, match="needs a positive weight"):
        Mixture([TaggedSource(0, 3)], [0])
    with pytest.raises(ValueError, match="source 1 is empty"):
        Mixture([TaggedSource(0, 3), TaggedSource(1, 0)], [1, 1])
    with pytest.raises(TypeError, match="map-style"):
        Mixture([iter([1, 2])], [1])
    with pytest.raises(IndexError):
        mixture()[600]
    zero = Mixture([TaggedSource(0, 5), TaggedSource(1, 5)], [1, 0], samples_per_epoch=8)
    assert zero.epoch_counts == (8, 0) and all(zero.locate(i)[0] == 0 for i in range(8))
