"""Behaviours of the checkpoint restorer that mutation testing found unpinned (mutation/RESULTS.md): the
exact line of each refused source, the warnings a restore gives (damaged checkpoints passed over, a
different world size or thread count, missing RNG or hook state, model keys or optimizer entries or
schedulers that differ from the save), what a pipeline stage gets of a whole-model checkpoint (a tied
head's optimizer state included), what a section the checkpoint lacks leaves, where the RNG is restored,
that a pickled object in a checkpoint runs no code, what rank 0 shares under a process group, and, in
one process, what the kill-and-resume tests check across processes: a resumed run continues bit for bit
and an interrupted save leaves the previous checkpoint the one that is restored."""

from __future__ import annotations

import json
import logging
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fntrain.checkpoint import SaveTarget, restore, save, step_dir
from fntrain.checkpoint import restorer as restorer_module
from fntrain.checkpoint.layout import DCP_METADATA, LATEST, MANIFEST, MARKER
from fntrain.checkpoint.restorer import CheckpointDamagedError, read_meta, resolve_source
from fntrain.config import ConfigError
from fntrain.hooks.base import stateful
from fntrain.state import TrainState
from tests.checkpoint import toy

DATA = "__0_0.distcp"


def restorer_logs(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fntrain.checkpoint"]


def truncate_data(path) -> None:
    blob = (path / DATA).read_bytes()
    (path / DATA).write_bytes(blob[: len(blob) // 2])


def test_each_refused_source_is_one_exact_line(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        restore(tmp_path / "nope", toy.components())
    assert str(raised.value) == f"checkpoint {str(tmp_path / 'nope')!r} does not exist"
    for source in ("latest", "auto"):
        with pytest.raises(ValueError) as raised:
            resolve_source(source)
        assert str(raised.value) == f'restore "{source}" needs the checkpoint root directory (root=...)'
    empty_root = tmp_path / "runs"
    (empty_root / "step_3").mkdir(parents=True)  # a partial: not a checkpoint
    with pytest.raises(ValueError) as raised:
        resolve_source(empty_root)
    assert str(raised.value) == f"checkpoint root {str(empty_root)!r} holds no complete checkpoint"
    partial = empty_root / "step_3"
    (partial / DCP_METADATA).write_bytes(b"x")
    with pytest.raises(ConfigError) as raised:
        resolve_source(partial)
    assert str(raised.value) == (
        f"{str(partial)!r} is not a complete checkpoint (missing {MARKER}: an interrupted save?)"
    )
    (partial / DCP_METADATA).unlink()
    with pytest.raises(ConfigError) as raised:
        resolve_source(partial)
    assert f"(missing {DCP_METADATA}, {MARKER}: an interrupted save?)" in str(raised.value)
    assert resolve_source(None) is None and resolve_source("none", tmp_path) is None


def test_a_checkpoint_of_another_format_is_refused_by_name(tmp_path):
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    meta = json.loads((path / "meta.json").read_text())
    for found in (2, None):
        meta["format"] = found
        (path / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError) as raised:
            read_meta(path)
        assert str(raised.value) == f"checkpoint {path} has format {found!r}; this fntrain reads 1"


def test_a_checkpoint_root_named_by_path_means_its_newest_intact_one_left_in_place(tmp_path, caplog):
    toy.two_checkpoints(tmp_path)
    (tmp_path / LATEST).unlink()  # found from the step directories alone
    assert resolve_source(tmp_path) == step_dir(tmp_path, 4)
    truncate_data(step_dir(tmp_path, 4))
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert resolve_source(tmp_path) == step_dir(tmp_path, 2)
    assert restorer_logs(caplog) == [(logging.WARNING, f"skipping damaged checkpoint {step_dir(tmp_path, 4)}/{DATA}: "
                             + restorer_logs(caplog)[0][1].split(f"{DATA}: ", 1)[1])]  # fmt: skip
    assert restorer_logs(caplog)[0][1].endswith("(trying step_2)")
    assert (
        step_dir(tmp_path, 4).is_dir() and not (tmp_path / LATEST).exists()
    )  # not the run's root: untouched


def test_latest_passes_over_damage_with_one_warning_each_and_says_when_none_is_left(tmp_path, caplog):
    toy.two_checkpoints(tmp_path)
    for step in (2, 4):
        truncate_data(step_dir(tmp_path, step))
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        with pytest.raises(CheckpointDamagedError) as raised:
            restore("latest", toy.components(), root=tmp_path)
    assert str(raised.value).endswith("; no intact checkpoint to restore (2 damaged)")
    first, second = (message for _, message in restorer_logs(caplog))
    assert first.startswith(f"skipping damaged checkpoint {step_dir(tmp_path, 4)}/{DATA}: truncated")
    assert first.endswith("(moved aside to step_4.damaged; trying step_2)")
    assert second.endswith("(moved aside to step_2.damaged; no older checkpoint to try)")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        with pytest.warns(UserWarning) as said:
            assert restore("latest", toy.components(), root=tmp_path) == TrainState()
        assert restore("auto", toy.components(), root=tmp_path) == TrainState()
    note = " (2 damaged checkpoint(s) set aside there: step_2.damaged, step_4.damaged)"
    assert [str(w.message) for w in said] == [
        f"no complete checkpoint under {tmp_path}; starting fresh{note}"
    ]
    assert restorer_logs(caplog)[-1] == (logging.WARNING, f"restore auto: no complete checkpoint under {tmp_path}; "
                                f"starting fresh{note}")  # fmt: skip


def test_auto_on_an_empty_root_logs_a_quiet_fresh_start(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert restore("auto", toy.components(), root=tmp_path) == TrainState()
    assert restorer_logs(caplog) == [
        (logging.INFO, f"restore auto: no complete checkpoint under {tmp_path}; starting fresh")
    ]


def test_a_damaged_checkpoint_that_cannot_be_moved_aside_is_still_skipped(tmp_path, caplog, monkeypatch):
    toy.two_checkpoints(tmp_path)
    truncate_data(step_dir(tmp_path, 4))

    def refuse(path, suffix):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(restorer_module, "move_aside", refuse)
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert restore("latest", toy.components(), root=tmp_path) == TrainState(0, 2, 2)
    (message,) = (m for _, m in restorer_logs(caplog))
    assert message.endswith("(could not move it aside ([Errno 13] Permission denied); trying step_2)")
    assert (tmp_path / LATEST).read_text() == "step_2\n"  # the pointer names what was restored


def test_a_named_checkpoint_clears_the_roots_partials_and_a_damaged_one_says_what_to_do(tmp_path):
    toy.two_checkpoints(tmp_path)
    (tmp_path / "step_9").mkdir()
    (tmp_path / "step_9" / DATA).write_bytes(b"partial")
    assert resolve_source(step_dir(tmp_path, 2), tmp_path) == step_dir(tmp_path, 2)
    assert (tmp_path / "step_9.incomplete" / DATA).is_file()
    truncate_data(step_dir(tmp_path, 2))
    with pytest.raises(CheckpointDamagedError) as raised:
        resolve_source(step_dir(tmp_path, 2), tmp_path)
    assert str(raised.value).endswith('; restore another checkpoint ("latest" skips damaged ones)')


def test_restore_logs_what_it_restored_and_what_differs_from_the_save(tmp_path, caplog, monkeypatch):
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(1, 5, 2))
    meta = json.loads((path / "meta.json").read_text())
    meta["world_size"] = 2
    meta["num_threads"] = torch.get_num_threads() + 3
    (path / "meta.json").write_text(json.dumps(meta))
    (path / MANIFEST).unlink()  # an edited checkpoint: restored unverified, with one warning
    hook = stateful("kept", lambda *a: None, lambda: {}, lambda s: None)
    newcomer = stateful("newcomer", lambda *a: None, lambda: {}, lambda s: None)
    other = stateful("other", lambda *a: None, lambda: {}, lambda s: None)
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        state = restore(path, toy.components(), hooks=lambda: [hook, newcomer, other])
    assert state == TrainState(1, 5, 2)
    assert restorer_logs(caplog) == [
        (logging.WARNING, f"checkpoint {path} has no manifest (saved by an older fntrain): its file sizes and "
                          "metadata were checked, its contents could not be verified"),
        (logging.WARNING, f"checkpoint {path} was saved by 2 rank(s), restoring on 1"),
        (logging.WARNING, f"checkpoint {path} was saved with torch.get_num_threads() == "
                          f"{torch.get_num_threads() + 3}, this process has {torch.get_num_threads()}: CPU results "
                          "may differ from an uninterrupted run in the last bits"),
        (logging.WARNING, f"checkpoint {path} has no state for hook(s) kept, newcomer, other; they start fresh"),
        (logging.INFO, f"restored checkpoint {path} (epoch 1, step 5, cursor 2)"),
    ]  # fmt: skip


def test_another_rank_without_its_own_file_keeps_its_rng_and_takes_rank_zeros_hook_states(
    tmp_path, caplog, monkeypatch
):
    box = {"n": 7}
    hook = stateful("counter", lambda *a: None, lambda: dict(box), lambda s: box.update(s))
    path = save(SaveTarget(tmp_path, toy.components(), hooks=[hook]), TrainState(0, 3, 3))
    box["n"] = 0
    monkeypatch.setattr(restorer_module._dist, "rank", lambda group=None: 1)
    monkeypatch.setattr(restorer_module._dist, "world_size", lambda group=None: 2)
    fresh = toy.components()
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        restore(path, fresh, hooks=[hook], verified=True)
    assert torch.equal(torch.rand(3), expected)  # no rank_1.json: the RNG keeps its seeded state
    assert box == {"n": 7}
    assert (
        logging.WARNING,
        f"checkpoint {path} has no RNG state for rank 1; its RNG keeps the seeded state",
    ) in restorer_logs(caplog)


def test_weights_only_restores_the_model_alone_and_says_so(tmp_path, caplog):
    parts = toy.components()
    toy.step(parts, toy.batches(1)[0])
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))
    fresh = toy.components(seed=4)
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        assert restore(path, fresh, weights_only=True) == TrainState()
    assert toy.same_weights(fresh, parts) and not fresh.optimizers[0].state
    assert fresh.schedulers[0].last_epoch == 0
    assert restorer_logs(caplog)[-1] == (
        logging.INFO,
        f"restored model weights from {path} (weights only; training starts at step 0)",
    )


def test_the_grad_scaler_and_every_scheduler_are_restored(tmp_path):
    def parts_with_scaler(seed, scale):
        parts = toy.components(seed)
        optimizer = parts.optimizers[0]
        second = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=True)
        return parts.__class__(parts.model, parts.loss_fn, parts.optimizers, (parts.schedulers[0], second),
                               grad_scaler=scaler)  # fmt: skip

    parts = parts_with_scaler(0, 64.0)
    toy.step(parts, toy.batches(1)[0])
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))
    fresh = parts_with_scaler(1, 2.0)
    restore(path, fresh)
    assert fresh.grad_scaler.state_dict()["scale"] == 64.0
    assert [s.last_epoch for s in fresh.schedulers] == [s.last_epoch for s in parts.schedulers] == [1, 1]
    assert fresh.optimizers[0].param_groups[0]["lr"] == parts.optimizers[0].param_groups[0]["lr"]


@pytest.mark.parametrize("interrupted", ["before the marker", "before latest"])
def test_a_resume_after_an_interrupted_save_continues_bit_for_bit_from_the_previous_one(
    tmp_path, interrupted
):
    """What the kill-and-resume tests check across processes, in one: a run saved at step 2, interrupted
    inside the save of step 4, resumed from "latest", gives the uninterrupted run's later losses (==)."""
    data = toy.batches(6)
    live = toy.components(seed=0)
    torch.manual_seed(3)
    for ids in data[:2]:
        toy.step(live, ids)
    save(SaveTarget(tmp_path, live), TrainState(0, 2, 2))
    expected = [toy.step(live, ids) for ids in data[2:]]
    if interrupted == "before the marker":  # the later save's files are there, its marker is not
        path = save(SaveTarget(tmp_path, live), TrainState(0, 4, 4))
        (path / MARKER).unlink()
        (tmp_path / LATEST).write_text("step_2\n")
    else:  # complete, but the pointer still names the previous checkpoint
        save(SaveTarget(tmp_path, live), TrainState(0, 4, 4))
        (tmp_path / LATEST).write_text("step_2\n")
    fresh = toy.components(seed=99)
    torch.manual_seed(1234)
    state = restore("latest", fresh, root=tmp_path)
    assert state == TrainState(0, 2, 2)
    assert [toy.step(fresh, ids) for ids in data[2:]] == expected


@pytest.fixture
def group_of_one(monkeypatch):
    """A process group stand-in with this process as rank 0 of 1: the restorer takes the plan rank 0
    sends every rank (here, itself) instead of the one it made. Returns what rank 0 sent."""
    sent: list[str | None] = []
    dist = restorer_module._dist
    monkeypatch.setattr(dist, "initialized", lambda: True)
    monkeypatch.setattr(dist, "rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(dist, "agree", lambda problem, group=None: problem)
    monkeypatch.setattr(dist, "broadcast_text", lambda text, group=None: sent.append(text) or text)
    return sent


def test_under_a_process_group_latest_passes_over_damage_as_alone(tmp_path, group_of_one, caplog):
    toy.two_checkpoints(tmp_path)
    truncate_data(step_dir(tmp_path, 4))
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert restore("latest", toy.components(), root=tmp_path) == TrainState(0, 2, 2)
    assert len(group_of_one) == 1  # the plan went through the broadcast
    assert (tmp_path / "step_4.damaged").is_dir() and (tmp_path / LATEST).read_text() == "step_2\n"
    (message,) = (m for _, m in restorer_logs(caplog))
    assert message.endswith("(moved aside to step_4.damaged; trying step_2)")


def test_under_a_process_group_a_named_damaged_checkpoint_is_refused_as_alone(tmp_path, group_of_one):
    toy.two_checkpoints(tmp_path)
    truncate_data(step_dir(tmp_path, 4))
    with pytest.raises(CheckpointDamagedError) as raised:
        restore(step_dir(tmp_path, 4), toy.components(), root=tmp_path)
    assert str(raised.value).endswith(restorer_module.NAMED_DAMAGED_HINT)
    assert step_dir(tmp_path, 4).is_dir()  # named by the user: never moved


def test_under_a_process_group_an_empty_root_says_fresh_start_as_alone(tmp_path, group_of_one, caplog):
    with pytest.warns(UserWarning) as said:
        assert restore("latest", toy.components(), root=tmp_path) == TrainState()
    assert [str(w.message) for w in said] == [f"no complete checkpoint under {tmp_path}; starting fresh"]
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        assert restore("auto", toy.components(), root=tmp_path) == TrainState()
    assert restorer_logs(caplog) == [(logging.INFO, f"restore auto: no complete checkpoint under {tmp_path}; starting fresh")]


def test_another_rank_resolves_rank_zeros_plan_or_says_rank_zeros_error(tmp_path, group_of_one, monkeypatch):
    toy.two_checkpoints(tmp_path)
    assert resolve_source("latest", tmp_path) == step_dir(tmp_path, 4)
    (plan,) = group_of_one
    monkeypatch.setattr(restorer_module._dist, "rank", lambda group=None: 1)
    monkeypatch.setattr(restorer_module._dist, "broadcast_text", lambda text, group=None: plan)
    assert resolve_source("latest", tmp_path) == step_dir(tmp_path, 4)
    said = f"error:checkpoint {str(tmp_path / 'nope')!r} does not exist"
    monkeypatch.setattr(restorer_module._dist, "broadcast_text", lambda text, group=None: said)
    with pytest.raises(RuntimeError) as raised:
        resolve_source(tmp_path / "nope", tmp_path)
    assert str(raised.value) == (
        f"rank 0 could not resolve checkpoint {str(tmp_path / 'nope')!r}: checkpoint "
        f"{str(tmp_path / 'nope')!r} does not exist"
    )


def test_latest_tries_the_next_older_checkpoint_and_names_the_newest_damage(tmp_path, caplog):
    parts = toy.components()
    for step in (2, 4, 6):
        save(SaveTarget(tmp_path, parts), TrainState(0, step, step))
    truncate_data(step_dir(tmp_path, 6))
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert restore("latest", toy.components(), root=tmp_path) == TrainState(0, 4, 4)
    (message,) = (m for _, m in restorer_logs(caplog))
    assert message.endswith("(moved aside to step_6.damaged; trying step_4)")
    for step in (2, 4):
        truncate_data(step_dir(tmp_path, step))
    with pytest.raises(CheckpointDamagedError) as raised:
        restore("latest", toy.components(), root=tmp_path)
    assert str(raised.value).startswith(f"damaged checkpoint: {step_dir(tmp_path, 4)}/{DATA}: truncated")
    assert raised.value.damage.path == step_dir(tmp_path, 4)


def test_the_plan_is_shared_and_the_checkpoint_verified_over_the_callers_group(
    tmp_path, group_of_one, monkeypatch
):
    toy.two_checkpoints(tmp_path)
    groups = []
    monkeypatch.setattr(restorer_module, "verify_collectively", lambda path, group=None: groups.append(group))
    monkeypatch.setattr(
        restorer_module._dist, "broadcast_text", lambda text, group=None: groups.append(group) or text
    )
    group = object()
    assert resolve_source("latest", tmp_path, process_group=group) == step_dir(tmp_path, 4)
    assert groups == [group, group]  # rank 0's plan, then the verification


def test_a_checkpoint_without_a_world_size_counts_as_one_rank(tmp_path, caplog):
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    meta = json.loads((path / "meta.json").read_text())
    del meta["world_size"]  # written by an fntrain that did not record it
    (path / "meta.json").write_text(json.dumps(meta))
    (path / MANIFEST).unlink()  # its files are then checked by size, not checksum
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        restore(path, toy.components())
    assert not any("rank(s), restoring on" in m for _, m in restorer_logs(caplog))


def test_a_model_without_parameters_restores_its_rng_and_buffers(tmp_path):
    def model():
        module = torch.nn.Module()
        module.register_buffer("counts", torch.zeros(3))
        return module

    source = toy.Components(model(), None, ())
    source.model.counts += 2
    torch.manual_seed(5)
    path = save(SaveTarget(tmp_path, source), TrainState(0, 1, 1))
    expected = torch.rand(3)
    target = toy.Components(model(), None, ())
    torch.manual_seed(0)
    restore(path, target)
    assert torch.equal(target.model.counts, torch.full((3,), 2.0)) and torch.equal(torch.rand(3), expected)


def test_each_rank_takes_its_own_hook_state_when_it_has_a_file(tmp_path, monkeypatch):
    box = {}
    hook = stateful("h", lambda *a: None, lambda: dict(box), lambda state: box.update(loaded=state))
    path = save(SaveTarget(tmp_path, toy.components(), hooks=[hook]), TrainState(0, 1, 1))
    own = json.loads((path / "rank_0.json").read_text())
    own["rank"], own["hooks"] = 1, {"h": {"mine": 1}}
    (path / "rank_1.json").write_text(json.dumps(own))
    monkeypatch.setattr(restorer_module._dist, "rank", lambda group=None: 1)
    monkeypatch.setattr(restorer_module._dist, "world_size", lambda group=None: 2)
    restorer_module._restore_rank_state(path, read_meta(path), [hook], toy.components(), None)  # rank 1's part
    assert box["loaded"] == {"mine": 1}


class _Stage(torch.nn.Module):
    """One pipeline stage of `toy.Toy`: the named submodules alone, under their names in the whole."""

    def __init__(self, names):
        super().__init__()
        whole = toy.Toy()
        for name in names:
            setattr(self, name, getattr(whole, name))


def _stage(names) -> toy.Components:
    torch.manual_seed(5)
    model = _Stage(names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
    return toy.Components(model, None, (optimizer,), (schedule,))


def _moments(parts) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's optimizer state by name (a tied weight under its first name)."""
    names = {}
    for name, parameter in parts.model.named_parameters():
        names.setdefault(id(parameter), name)
    return {names[id(p)]: state for p, state in parts.optimizers[0].state.items()}


@pytest.mark.parametrize("names", [("hidden", "norm"), ("head",)], ids=["middle", "tied-head"])
def test_a_pipeline_stage_gets_each_of_its_parameters_saved_optimizer_state_quietly(tmp_path, caplog, names):
    """A stage restored from a whole-model checkpoint: its weights, its optimizer's hyperparameters (the
    scheduled lr) and every moment of its parameters are the saved ones, the output head's under the name
    of the embedding it is tied to; nothing warns."""
    whole = toy.components()
    toy.step(whole, toy.batches(1)[0])
    path = save(SaveTarget(tmp_path, whole), TrainState(0, 1, 1))
    saved = _moments(whole)
    stage = _stage(names)
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert restore(path, stage, model_part=True) == TrainState(0, 1, 1)
    assert restorer_logs(caplog) == []
    weights = whole.model.state_dict()
    assert all(torch.equal(value, weights[key]) for key, value in stage.model.state_dict().items())

    def settings(parts):
        return {key: value for key, value in parts.optimizers[0].param_groups[0].items() if key != "params"}

    assert settings(stage) == settings(whole)
    restored = _moments(stage)
    assert sorted(restored) == sorted(f"{n}.{p}" for n in names for p, _ in getattr(stage.model, n).named_parameters())
    for name, state in restored.items():
        source = saved["embed.weight" if name == "head.weight" else name]
        assert state.keys() == source.keys() and all(torch.equal(state[k], source[k]) for k in state)


@pytest.mark.parametrize("kwargs", [{}, {"model_part": True}], ids=["whole-model", "stage"])
def test_model_keys_the_model_lacks_are_one_warning_naming_them_unless_it_is_a_stage(tmp_path, caplog, kwargs):
    path = save(SaveTarget(tmp_path, toy.components(extra=True)), TrainState(0, 1, 1))
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        restore(path, toy.components(), **kwargs)
    expected = [] if kwargs else [
        (logging.WARNING, f"checkpoint {path} has model keys the model does not: extra.bias, extra.weight (ignored)")
    ]
    assert restorer_logs(caplog) == expected


@pytest.mark.parametrize("tied_listed", [True, False], ids=["tied-listed", "older-meta-without-tied"])
def test_optimizer_entries_the_checkpoint_lacks_keep_fresh_values_with_one_warning_naming_them(
    tmp_path, tied_listed
):
    """`extra` takes no part in the forward pass: the saved optimizer has no state for it. A checkpoint of
    an fntrain that wrote no list of tied weights restores the same way."""
    parts = toy.components(extra=True)
    toy.step(parts, toy.batches(1)[0])
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))
    if not tied_listed:
        meta = json.loads((path / "meta.json").read_text())
        del meta["tied"]
        (path / "meta.json").write_text(json.dumps(meta))
    fresh = toy.components(seed=3, extra=True)
    with pytest.warns(UserWarning) as said:
        restore(path, fresh, verified=True)
    fields = ", ".join(f"{p}.{f}" for p in ("extra.bias", "extra.weight") for f in ("exp_avg", "exp_avg_sq", "step"))
    assert [str(w.message) for w in said] == [
        f"checkpoint {path} lacks optimizer state for: {fields}; those entries keep their fresh values"
    ]
    saved, restored = _moments(parts), _moments(fresh)
    assert all(torch.equal(restored["hidden.weight"][k], v) for k, v in saved["hidden.weight"].items())
    assert not restored["extra.weight"]["exp_avg"].any()  # fresh


@pytest.mark.parametrize("saved, live", [(1, 2), (2, 1)])
def test_a_different_number_of_schedulers_restores_the_first_min_of_both_with_one_warning(tmp_path, saved, live):
    def parts_with(count, seed):
        parts = toy.components(seed)
        optimizer = parts.optimizers[0]
        extra = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) for _ in range(count - 1)]
        return parts.__class__(parts.model, parts.loss_fn, parts.optimizers, (parts.schedulers[0], *extra))

    source = parts_with(saved, 0)
    for ids in toy.batches(2):
        toy.step(source, ids)
    path = save(SaveTarget(tmp_path, source), TrainState(0, 2, 2))
    fresh = parts_with(live, 1)
    with pytest.warns(UserWarning) as said:
        restore(path, fresh)
    assert [str(w.message) for w in said] == [
        f"checkpoint {path} has {saved} LR scheduler state(s), the run {live}; restoring the first min of both"
    ]
    assert [s.last_epoch for s in fresh.schedulers] == [2] + [0] * (live - 1)


@pytest.mark.parametrize("trained", [False, True], ids=["fresh-optimizer", "trained-optimizer"])
def test_an_optimizer_the_checkpoint_has_no_state_for_keeps_the_state_it_had(tmp_path, trained):
    """A fresh optimizer stays without state (its first step is step 1), a trained one keeps its moments."""
    path = save(SaveTarget(tmp_path, toy.components(optimizer=False)), TrainState(0, 1, 1))
    parts = toy.components(seed=2)
    if trained:
        toy.step(parts, toy.batches(1)[0])
    before = {name: {k: v.clone() for k, v in state.items()} for name, state in _moments(parts).items()}
    with pytest.warns(UserWarning) as said:
        restore(path, parts)
    assert [str(w.message) for w in said] == [
        f"checkpoint {path} has no {section} state; it starts fresh" for section in ("optimizer", "schedulers")
    ]
    after = _moments(parts)
    assert after.keys() == before.keys() and len(after) == (5 if trained else 0)
    assert all(torch.equal(after[n][k], v) for n, state in before.items() for k, v in state.items())


@pytest.mark.parametrize("device, expected", [(None, "cpu"), ("meta", "meta")])
def test_the_rng_is_restored_onto_the_named_device_else_the_models(tmp_path, monkeypatch, device, expected):
    """The model's parameters sit on the CPU; a run whose device is another restores that one's generator."""
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    onto = []
    monkeypatch.setattr(restorer_module, "set_rng_state", lambda state, device="cpu": onto.append(device))
    restore(path, toy.components(), device=device)
    assert [torch.device(d) for d in onto] == [torch.device(expected)]


def test_a_checkpoint_without_any_rank_file_restores_with_fresh_rng_and_hooks(tmp_path, caplog):
    box = {"n": 7}
    hook = stateful("counter", lambda *a: None, lambda: dict(box), lambda s: box.update(s))
    path = save(SaveTarget(tmp_path, toy.components(), hooks=[hook]), TrainState(0, 3, 3))
    (path / "rank_0.json").unlink()
    box["n"] = 0
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert restore(path, toy.components(), hooks=[hook], verified=True) == TrainState(0, 3, 3)
    assert box == {"n": 0} and restorer_logs(caplog) == [
        (logging.WARNING, f"checkpoint {path} has no RNG state for rank 0; its RNG keeps the seeded state"),
        (logging.WARNING, f"checkpoint {path} has no state for hook(s) counter; they start fresh"),
    ]


def test_under_a_process_group_dcp_reads_as_one_collective_load(tmp_path, group_of_one, monkeypatch):
    """Alone, DCP reads without collectives; in a job every rank takes part in one load (a rank's failure
    reaches all of them). In one process the load itself runs alone."""
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    modes = []
    real_load = restorer_module.dcp.load

    def dcp_load(state, *, storage_reader, planner=None, no_dist=False):
        modes.append(bool(no_dist))
        return real_load(state, storage_reader=storage_reader, planner=planner, no_dist=True)

    monkeypatch.setattr(restorer_module.dcp, "load", dcp_load)
    restore(path, toy.components(), verified=True)
    assert modes == [False]


def test_a_pickled_object_where_a_tensor_belongs_is_refused_without_running_it(tmp_path):
    """DCP would unpickle a byte entry with plain pickle; a crafted checkpoint must not run code on restore."""
    ran = []

    class Payload:
        def __reduce__(self):
            return (ran.append, ("code from the checkpoint",))

    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    crafted = toy.weights(toy.components())
    crafted["hidden.bias"] = Payload()
    for data in path.glob("*.distcp"):
        data.unlink()
    with warnings.catch_warnings():  # DCP's notes on writing alone over an existing checkpoint
        warnings.simplefilter("ignore")
        dcp.save({f"model.{k}": v for k, v in crafted.items()}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    with pytest.raises(CheckpointException) as raised:
        restore(path, toy.components(optimizer=False), verified=True)
    ((refused, _),) = raised.value.failures.values()  # rank 0's error
    assert isinstance(refused, pickle.UnpicklingError) and ran == []


def test_under_a_process_group_a_root_named_by_path_leaves_its_damage_in_place(
    tmp_path, group_of_one, monkeypatch, caplog
):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    toy.two_checkpoints(root)
    truncate_data(step_dir(root, 4))
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert resolve_source(root) == step_dir(root, 2)
    assert step_dir(root, 4).is_dir() and (root / LATEST).read_text() == "step_4\n"
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]  # no pointer written anywhere else
    (message,) = (m for _, m in restorer_logs(caplog))
    assert message.endswith("(trying step_2)") and "moved aside" not in message


def test_under_a_process_group_rank_zeros_error_is_its_own_and_sent_to_the_others(tmp_path, group_of_one):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as raised:
        resolve_source(missing, tmp_path)
    assert str(raised.value) == f"checkpoint {str(missing)!r} does not exist"
    assert group_of_one == [f"error:checkpoint {str(missing)!r} does not exist"]


class _Counted(toy.Toy):
    """A model with extra state (what `get_extra_state` returns travels in the state dict, not as a tensor)."""

    def __init__(self, seen: int):
        super().__init__()
        self.seen = seen

    def get_extra_state(self):
        return {"seen": self.seen}

    def set_extra_state(self, state):
        self.seen = state["seen"]


def test_a_models_extra_state_is_restored_with_its_optimizer(tmp_path):
    def parts(seen):
        torch.manual_seed(0)
        model = _Counted(seen)
        return toy.Components(model, None, (torch.optim.AdamW(model.parameters(), lr=1e-2),))

    path = save(SaveTarget(tmp_path, parts(7)), TrainState(0, 1, 1))
    fresh = parts(0)
    restore(path, fresh)
    assert fresh.model.seen == 7
