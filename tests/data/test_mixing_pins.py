"""Behaviours of weighted mixing that mutation testing found unpinned (mutation/RESULTS.md): the exact
order of a run's samples (frozen: a resumed checkpoint of an earlier version must read the same samples),
the permutations being permutations that depend on every part of their key, the counts' rounding, the
view's index rules, and the exact message each bad argument gets."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fntrain.data.mixing import Mixture, _mix64, interleave, mixture_counts, permute_index
from tests.data.test_mixing import TaggedSource, mixture

# --- the hash and the permutation -------------------------------------------------------------------


def test_the_scramble_is_splitmix64():
    """The first outputs of splitmix64 seeded with 0 (the published reference sequence): the scramble is
    the finalizer of splitmix64, not a weaker look-alike, and stays inside 64 bits."""
    state, outputs = 0, []
    for _ in range(5):
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        outputs.append(_mix64(state))
    assert outputs == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
        0xF88BB8A8724C81EC,
        0x1B39896A51A8749B,
    ]


@pytest.mark.parametrize("size", [*range(1, 70), 127, 128, 129, 255, 256, 257, 1023, 1025])
def test_permute_index_is_a_permutation_of_the_range(size):
    for key in (0, 7, 2**63 - 1):
        assert sorted(permute_index(i, size, key) for i in range(size)) == list(range(size))


def test_permute_index_depends_on_the_whole_key():
    orders = {tuple(permute_index(i, 50, key) for i in range(50)) for key in [*range(16), 2**40, 2**62]}
    assert len(orders) == 18  # no two keys of these 18 (low bits, high bits) give the same order
    assert all(order != tuple(range(50)) for order in orders)  # and none leaves the range in order


# Frozen: the order every shuffled run reads its sources in. A changed value reorders the samples of a run
# resumed from a checkpoint saved by the previous version (its cursor would point at other samples).
# fmt: off
FROZEN_PERMUTATIONS = {
    3: [2, 0, 1, 1, 0, 2, 1, 0, 2],
    4: [2, 0, 3, 1, 1, 0, 2, 3, 1, 0, 3, 2],
    7: [6, 4, 1, 3, 5, 0, 2, 4, 0, 3, 2, 6, 5, 1, 2, 1, 6, 3, 4, 5, 0],
    64: [14, 32, 17, 3, 53, 46, 39, 38, 29, 2, 41, 40, 32, 9, 59, 27, 24, 61, 52, 3, 18, 39, 6, 28],
    65: [0, 13, 37, 51, 1, 9, 21, 30, 42, 2, 8, 58, 52, 21, 32, 51, 36, 2, 62, 45, 31, 56, 54, 39],
    1000: [258, 395, 581, 801, 382, 201, 37, 414, 944, 546, 479, 173, 378, 807, 155, 982, 557, 6, 740, 605,
           987, 614, 800, 232],
}
# fmt: on


@pytest.mark.parametrize("size", sorted(FROZEN_PERMUTATIONS))
def test_permute_index_values_are_frozen(size):
    """See FROZEN_PERMUTATIONS: a resumed run depends on these values."""
    values = [permute_index(i, size, key) for key in (0, 5, 2**62 + 3) for i in range(min(size, 8))]
    assert values == FROZEN_PERMUTATIONS[size]


def test_a_one_sample_source_always_gives_its_sample():
    assert [permute_index(0, 1, key) for key in range(8)] == [0] * 8


# --- counts and the round's interleave ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "total", "counts"),
    [
        ([0.2, 0.3, 0.5], 7, [1, 2, 4]),  # the largest remainder (0.5 of source 2) gets the extra slot
        ([0.6, 0.4], 7, [4, 3]),  # remainders 0.2 and 0.8: the smaller source gets it
        ([1, 1, 1], 4, [2, 1, 1]),  # ties go to the earlier source
        ([1, 1, 1], 5, [2, 2, 1]),
    ],
)
def test_counts_give_the_extra_slots_to_the_largest_remainders(weights, total, counts):
    assert mixture_counts(weights, total) == counts


def test_the_round_order_is_frozen():
    """Slot times (k + 1/2) / count, ties to the earlier source: a round of (5, 3, 2) reads sources in this
    order. Frozen: a resumed run of an earlier version depends on which source fills which slot."""
    sources, ordinals = interleave([5, 3, 2])
    assert sources.tolist() == [0, 1, 2, 0, 0, 1, 0, 2, 1, 0]
    assert ordinals.tolist() == [0, 0, 0, 1, 2, 1, 3, 1, 2, 4]
    assert interleave([2, 2])[0].tolist() == [0, 1, 0, 1]


def test_a_round_without_slots_is_empty():
    sources, ordinals = interleave([0, 0])
    assert sources.tolist() == [] and ordinals.tolist() == []


# --- the view -----------------------------------------------------------------------------------------


def test_the_mixtures_samples_are_frozen():
    """The (source, position) of the first samples of epochs 0 and 3 of the mixture of the module's tests.
    Frozen: a run resumed from a checkpoint saved by the previous version reads these samples."""
    dataset = mixture()
    assert [dataset.locate(i) for i in range(10)] == [
        (0, 155), (1, 10), (2, 835), (0, 309), (0, 331), (1, 27), (0, 247), (2, 435), (1, 12), (0, 320),
    ]  # fmt: skip
    dataset.set_epoch(3)
    assert [dataset.locate(i) for i in range(10)] == [
        (0, 231), (1, 18), (2, 730), (0, 196), (0, 123), (1, 28), (0, 237), (2, 10), (1, 21), (0, 309),
    ]  # fmt: skip


def order_of(dataset: Mixture, source: int) -> list[int]:
    return [p for s, p in map(dataset.locate, range(len(dataset))) if s == source]


def test_the_seed_and_each_source_key_their_own_shuffle():
    same = [TaggedSource(0, 40), TaggedSource(1, 40)]
    dataset = Mixture(same, [1, 1], seed=5)
    assert order_of(dataset, 0) != order_of(dataset, 1)  # equal sources, each shuffled its own way
    assert order_of(Mixture(same, [1, 1], seed=6), 0) != order_of(dataset, 0)  # another seed, another order
    default = Mixture(same, [1, 1])
    assert [default.locate(i) for i in range(80)] == [
        Mixture(same, [1, 1], seed=42).locate(i) for i in range(80)
    ]


@pytest.mark.parametrize("resolution", [1, 3, 7, 64, 1000])
def test_epoch_counts_are_what_an_epoch_reads(resolution):
    dataset = mixture(resolution=resolution)
    read = Counter(dataset.locate(i)[0] for i in range(len(dataset)))
    assert dataset.epoch_counts == tuple(read[s] for s in range(3))
    assert sum(dataset.epoch_counts) == 600


def test_negative_indices_count_from_the_end():
    dataset = mixture()
    assert [dataset.locate(-i) for i in (1, 2, 600)] == [
        dataset.locate(599),
        dataset.locate(598),
        dataset.locate(0),
    ]


@pytest.mark.parametrize("index", [600, 601, -601, -700])
def test_an_index_outside_the_view_is_named_as_given(index):
    with pytest.raises(IndexError) as raised:
        mixture()[index]
    assert str(raised.value) == f"mixture index {index} is outside [-600, 600)"


def test_the_first_and_last_index_from_either_end_are_inside():
    dataset = mixture()
    assert dataset[-600] == dataset[0] and dataset[-1] == dataset[599]


def test_samples_are_the_sources_own_unless_a_source_key_is_asked():
    dataset = mixture()
    assert set(dataset[3]) == {"id"}  # no extra key
    tagged = mixture(source_key="source")[1]
    assert tagged["source"].dtype == torch.int64 and int(tagged["source"]) == 1
    # Samples that are not dicts stay as they are, even with a source_key.
    plain = Mixture([torch.arange(5)], [1], source_key="source")
    assert sorted(int(plain[i]) for i in range(5)) == [0, 1, 2, 3, 4]


def test_the_repr_shows_the_normalized_weights():
    dataset = Mixture([TaggedSource(0, 4), TaggedSource(1, 4)], [1, 2], samples_per_epoch=8)
    assert repr(dataset) == "Mixture(sources=2, weights=(0.3333, 0.6667), samples_per_epoch=8)"
    assert dataset.weights == pytest.approx((1 / 3, 2 / 3))


def test_an_empty_source_of_weight_zero_is_allowed():
    dataset = Mixture([TaggedSource(0, 5), TaggedSource(1, 0)], [1, 0], samples_per_epoch=6)
    assert [dataset.locate(i)[0] for i in range(6)] == [0] * 6


@pytest.mark.parametrize("options", [{"seed": 0}, {"resolution": 1}, {"samples_per_epoch": 1}])
def test_the_smallest_settings_are_accepted(options):
    assert len(mixture(**options)) == options.get("samples_per_epoch", 600)


class OnlyGetitem:
    def __getitem__(self, index):
        return index


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (
            lambda: Mixture([TaggedSource(0, 3)] * 2, [True, 1]),
            TypeError,
            "mixing weights must be numbers, got weights[0] = True",
        ),
        (
            lambda: Mixture([TaggedSource(0, 3)] * 2, [1, "2"]),
            TypeError,
            "mixing weights must be numbers, got weights[1] = '2'",
        ),
        (lambda: Mixture([{1, 2}], [1]), TypeError, "mixing source 0 must be a map-style dataset, got set"),
        (
            lambda: Mixture([OnlyGetitem()], [1]),
            TypeError,
            "mixing source 0 must be a map-style dataset, got OnlyGetitem",
        ),
        (lambda: mixture(seed=-1), ValueError, "seed must be >= 0, got -1"),
        (lambda: mixture(seed=1.0), TypeError, "seed must be an int, got 1.0"),
        (lambda: mixture(shuffle=1), TypeError, "shuffle must be a bool, got 1"),
        (lambda: mixture(resolution=0), ValueError, "resolution must be >= 1, got 0"),
        (lambda: mixture(resolution=-3), ValueError, "resolution must be >= 1, got -3"),
        (lambda: mixture(resolution=2.0), TypeError, "resolution must be an int, got 2.0"),
        (lambda: mixture(samples_per_epoch=0), ValueError, "samples_per_epoch must be >= 1, got 0"),
        (lambda: mixture(samples_per_epoch=-5), ValueError, "samples_per_epoch must be >= 1, got -5"),
        (lambda: mixture(samples_per_epoch=1.5), TypeError, "samples_per_epoch must be an int, got 1.5"),
        (lambda: mixture().set_epoch(-1), ValueError, "epoch must be >= 0, got -1"),
        (lambda: mixture().set_epoch(1.0), TypeError, "epoch must be an int, got 1.0"),
    ],
)
def test_bad_arguments_are_named(build, error, message):
    with pytest.raises(error) as raised:
        build()
    assert str(raised.value) == message
