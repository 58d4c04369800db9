"""Checkpoints over torch.distributed.checkpoint: save, restore, find the latest, export [S36].

    target = SaveTarget(root, components, hooks=hooks)   # what a run's checkpoints hold, and where
    path = save(target, state)                             # <root>/step_<N>/, complete on return
    pending = save_async(target, state, SaveOptions(keep_last=2))  # staged; the write goes on in a thread
    pending.result()                                            # complete (or raises); settle before the next
    state = restore("latest", components, root=root, hooks=hooks)  # "none" | "auto" | "latest" | a path
    export_safetensors(model, run_dir / "model.safetensors")
    damage(path)                                                # None, or the damaged file and why
    close_async_saves()                                         # join the async saves' threads

A save that fails (a full disk, a quota, an I/O error) raises `CheckpointSaveError` on every rank: one
line naming the checkpoint, the OS error, bytes needed and free and the newest good checkpoint; its
partial directory is removed (`fntrain.checkpoint.space`).

Every checkpoint carries a manifest (each file's size and CRC-32); restore verifies it first and skips
damaged checkpoints ("latest"/"auto") or refuses them (a path) with a `CheckpointDamagedError`.

The checkpoint hook (`fntrain.hooks.checkpoint`) decides when to save; this package does the saving.
"""

from fntrain.checkpoint.async_save import PendingSave, close_async_saves, make_stager, save_async
from fntrain.checkpoint.export import export_safetensors
from fntrain.checkpoint.layout import (
    candidates,
    clean_partial,
    find_latest,
    is_complete,
    is_temporary,
    list_checkpoints,
    move_aside,
    step_dir,
)
from fntrain.checkpoint.matching import MissingKeysError
from fntrain.checkpoint.restorer import read_meta, resolve_source, restore
from fntrain.checkpoint.retention import remove_superseded_temporary, retain
from fntrain.checkpoint.rng import rng_state, set_rng_state
from fntrain.checkpoint.saver import CheckpointSaveError, SaveOptions, SaveTarget, app_state, save
from fntrain.checkpoint.verify import CheckpointDamagedError, Damage, damage, verified, write_manifest

__all__ = [
    "SaveTarget",
    "SaveOptions",
    "save",
    "save_async",
    "PendingSave",
    "CheckpointSaveError",
    "make_stager",
    "close_async_saves",
    "restore",
    "resolve_source",
    "read_meta",
    "MissingKeysError",
    "CheckpointDamagedError",
    "Damage",
    "damage",
    "verified",
    "write_manifest",
    "find_latest",
    "candidates",
    "move_aside",
    "list_checkpoints",
    "is_complete",
    "is_temporary",
    "remove_superseded_temporary",
    "step_dir",
    "retain",
    "clean_partial",
    "rng_state",
    "set_rng_state",
    "app_state",
    "export_safetensors",
]
