"""Checkpoints over torch.distributed.checkpoint: save, restore, find the latest, export [S36].

    path = save(root, state, components, hooks=hooks)           # <root>/step_<N>/, complete on return
    pending = save_async(root, state, components, hooks=hooks)  # staged; the write goes on in a thread
    pending.result()                                            # complete (or raises); settle before the next
    state = restore("latest", components, root=root, hooks=hooks)  # "none" | "auto" | "latest" | a path
    export_safetensors(model, run_dir / "model.safetensors")

The checkpoint hook (`fntrain.hooks.checkpoint`) decides when to save; this package does the saving.
"""

from fntrain.checkpoint.export import export_safetensors
from fntrain.checkpoint.layout import (
    clean_partial,
    find_latest,
    is_complete,
    is_temporary,
    list_checkpoints,
    remove_superseded_temporary,
    retain,
    step_dir,
)
from fntrain.checkpoint.restorer import MissingKeysError, read_meta, resolve_source, restore
from fntrain.checkpoint.rng import rng_state, set_rng_state
from fntrain.checkpoint.saver import PendingSave, app_state, make_stager, save, save_async

__all__ = [
    "save",
    "save_async",
    "PendingSave",
    "make_stager",
    "restore",
    "resolve_source",
    "read_meta",
    "MissingKeysError",
    "find_latest",
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
