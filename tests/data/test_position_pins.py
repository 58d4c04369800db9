"""Data behaviours a resume or a multi-rank run would lose silently (issue 30) [S11] [S16]: the saved
stream position is a copy taken when the step is consumed (prefetch reading ahead never moves it), it is
numbered from the restored cursor, a map-style dataset learns its epoch, and in a job each data-parallel
rank reads its own shard."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fntrain.data.pipeline import batches, build_data
from fntrain.data.settings import Batching, LoaderConfig
from fntrain.run.build import build_job
from fntrain.run.checks import Checked, Inputs, read_inputs, run_plan
from fntrain.run.launch import Launch
from fntrain.runtime.launch import LaunchEnv
from fntrain.runtime.runtime import Runtime
from tests.data.datasets import Indexed, StatefulStream
from tests.helpers.waiting import wait_until


class LiveStateStream(StatefulStream):
    """A stateful stream whose `state_dict()` hands out its live position record (one dict it keeps
    updating as it reads), as some stream libraries do: whoever keeps it must copy it."""

    def __init__(self, length: int):
        super().__init__(length)
        self.live = {"position": 0}

    def __iter__(self):
        for sample in super().__iter__():
            self.live["position"] = self.position
            yield sample

    def state_dict(self) -> dict:
        return self.live


def test_the_saved_position_is_the_consumed_step_even_while_prefetch_reads_ahead():
    stream = LiveStateStream(40)
    spec = build_data(
        stream, Batching(2, 1), LoaderConfig(shuffle=False, prefetch=True, prefetch_depth=3, pin_memory=False)
    )
    steps = batches(spec, 0, 0)
    try:
        first = next(steps)
        assert first[0]["index"].tolist() == [0, 1]
        assert wait_until(lambda: stream.read >= 6)  # the prefetch thread has read steps 2 and 3 already
        assert spec.position.state_dict() == {"epoch": 0, "cursor": 1, "dataset": {"position": 2}}
    finally:
        steps.close()


def test_the_position_after_a_resume_counts_from_the_restored_cursor():
    """Restored at cursor 2 of epoch 0, the next consumed step is step 3: the position saved then must say
    cursor 3, or the next resume finds no position for its cursor and re-reads the stream."""
    stream = StatefulStream(40)
    spec = build_data(stream, Batching(2, 1), LoaderConfig(shuffle=False, pin_memory=False))
    spec.position.load_state_dict({"epoch": 0, "cursor": 2, "dataset": {"position": 4}})
    steps = batches(spec, 0, 2)
    try:
        assert next(steps)[0]["index"].tolist() == [4, 5]  # the stream was put back, not re-read
        assert stream.loads == [{"position": 4}]
        assert spec.position.state_dict() == {"epoch": 0, "cursor": 3, "dataset": {"position": 6}}
        next(steps)
        assert spec.position.resume_state(0, 4) == {"position": 8}
    finally:
        steps.close()


class EpochIndexed(Indexed):
    """Samples that depend on the epoch (like a Mixture's): `set_epoch` must come before any read."""

    def __init__(self, length: int):
        super().__init__(length)
        self.epochs: list[tuple[int, int]] = []  # (epoch, samples read before it was set)

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append((epoch, len(self.reads)))


def test_a_map_style_dataset_learns_its_epoch_before_it_is_read():
    dataset = EpochIndexed(16)
    spec = build_data(dataset, Batching(2, 1), LoaderConfig(shuffle=False, pin_memory=False))
    for epoch, cursor in ((0, 0), (3, 2)):
        steps = batches(spec, epoch, cursor)
        try:
            next(steps)
        finally:
            steps.close()
    assert dataset.epochs == [(0, 0), (3, 2)]


# ----------------------------------------------------------------------------- the job's data shards


def _first_epoch(config, spec, rank: int, world: int) -> list[int]:
    """The sample indices data-parallel rank `rank` of `world` trains on in epoch 0, as the job builds it."""
    inputs = read_inputs(config, spec)
    indexed = Inputs(inputs.assets, [dict(sample, index=torch.tensor(i)) for i, sample in enumerate(inputs.train_set)],
                     inputs.val_set, inputs.collate_fn)  # fmt: skip
    plan = run_plan(config, len(indexed.train_set), world)
    checked = Checked(LaunchEnv(rank=rank, world_size=world), world, Launch(), indexed, plan)
    runtime = Runtime(rank=rank, world_size=world, dp_size=world, dp_rank=rank)
    built = build_job(config, spec, runtime, checked)
    steps = batches(built.data, 0, 0)
    try:
        return [i for step in steps for micro in step for i in micro["index"].tolist()]
    finally:
        steps.close()


def test_each_data_parallel_rank_of_a_job_reads_its_own_shard(tmp_path):
    from tests.run.test_job import JobLM, spec, toy

    # The model is beside the point (and a 2-rank DDP needs a process group): a bare one.
    spec = dataclasses.replace(spec, build_model=lambda config, runtime: JobLM(config.model))
    config = toy(tmp_path)
    one = _first_epoch(config, spec, 0, 1)
    shards = [_first_epoch(config, spec, rank, 2) for rank in (0, 1)]
    assert all(len(shard) == len(one) // 2 for shard in shards)
    assert not set(shards[0]) & set(shards[1])  # no sample trained on twice in an epoch
    assert sorted(shards[0] + shards[1]) == sorted(one)
    assert not Path(config.run_dir).exists()  # building the data wrote nothing
