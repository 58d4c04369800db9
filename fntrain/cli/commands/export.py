"""`fntrain export CKPT --format hf|dcp OUT [options]`: a DCP checkpoint -> a Hugging Face directory, or
back; the recipe's `hf_conversion` renames the weights on the way out."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fntrain.cli.errors import CommandError
from fntrain.cli.parse import parse
from fntrain.cli.recipes import RecipeNotFound, load_recipe
from fntrain.run.recipe_of import other_recipe

__all__ = ["command"]


_EXPORT_CKPT_HELP = (
    "hf: an fntrain checkpoint (step_<N>/, or a checkpoint root: its latest); dcp: a Hugging Face directory"
)
_EXPORT_OUT_HELP = "hf: the Hugging Face directory to write; dcp: the checkpoint root to write"


def command(args: list[str]) -> Any:
    """`fntrain export`: the written path; a bad source or an occupied output is a `CommandError`."""
    import tyro

    from fntrain.checkpoint import export_options, hf_export

    positional = tyro.conf.Positional
    command_cls = dataclasses.make_dataclass(
        "Export",
        [
            ("checkpoint", Annotated[str, positional, tyro.conf.arg(metavar="CKPT", help=_EXPORT_CKPT_HELP)]),
            ("out", Annotated[str, positional, tyro.conf.arg(metavar="OUT", help=_EXPORT_OUT_HELP)]),
            (
                "options",
                Annotated[export_options.ExportOptions, tyro.conf.arg(name="")],
                dataclasses.field(default=export_options.ExportOptions()),
            ),
        ],
        frozen=True,
    )
    summary = "\n\n".join((hf_export.__doc__ or "").split("\n\n")[:2])
    parsed = parse(command_cls, args, prog="fntrain export", description=summary)
    try:
        convert, tokenizer = _hf_conversion(parsed.checkpoint, parsed.out, parsed.options)
        path = export_options.export_checkpoint(parsed.checkpoint, parsed.out, parsed.options, convert, tokenizer)
    except (ValueError, OSError, KeyError) as error:  # a bad source, an occupied output: no traceback
        raise CommandError(str(error)) from error
    print(path)
    return path


def _hf_conversion(checkpoint: str, out: str | None, options: Any) -> tuple[Any, Any]:
    """(conversion, tokenizer) of `--format hf` for `checkpoint`: the `hf_conversion`'s model and tokenizer
    of `options.recipe`, else of the recipe its meta.json records, bound to the run config it saved;
    None for a recipe without one, an old checkpoint that records none, `--recipe none`, or another
    format (and a tokenizer its run's files no longer lead to)."""
    from fntrain.checkpoint import hf_export
    from fntrain.checkpoint.restorer import read_meta
    from fntrain.cli.config_file import config_from_dict

    if options.format != "hf" or options.recipe == "none":
        return None, None
    meta = read_meta(hf_export.export_source(checkpoint, out, options.overwrite))
    name = options.recipe or meta.get("recipe")
    if not name:
        return None, None
    try:
        recipe = load_recipe(name)
    except RecipeNotFound as error:
        flag = "--recipe" if options.recipe else "the checkpoint's recipe"
        hint = "--recipe none exports the model's own names"
        raise CommandError(f"{flag} {name!r}: {error} ({hint})") from None
    other = other_recipe(meta.get("recipe"), recipe.config_cls) if options.recipe else None
    if other is not None:  # its config and weights are another recipe's
        raise CommandError(f"--recipe {name!r}: {checkpoint!r} was written by the {other} recipe; leave --recipe "
                           "out to use it")  # fmt: skip
    spec = recipe.spec
    if spec.hf_conversion is None:
        return None, None
    config = config_from_dict(recipe.config_cls, meta.get("config") or {})
    conversion = spec.hf_conversion
    tokenizer = conversion.tokenizer(config) if conversion.tokenizer is not None else None
    return (lambda state: conversion.model(config, state)), tokenizer
