"""`fntrain generate SOURCE [options]`: text from a trained model, streamed as it is written.

SOURCE is a run directory (its latest verified checkpoint, else its export), a checkpoint step_<N>/ (or
a checkpoint root), a model.safetensors export, or a Hugging Face model directory
(`fntrain.models.sources`). Every bad input is one line and exit status 2 before the model is loaded
(the options, the source, the recipe, the tokenizer); nothing is written but the samples to stdout.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fntrain.cli.errors import CommandError
from fntrain.cli.parse import parse
from fntrain.cli.recipes import RecipeNotFound, load_recipe
from fntrain.config import first_line
from fntrain.run.recipe_of import other_recipe

__all__ = ["command"]

_SOURCE_HELP = (
    "a run directory, a checkpoint step_<N>/, a model.safetensors export or a Hugging Face model directory"
)


def command(args: list[str]) -> Any:
    """`fntrain generate`: the `Sample` records printed; bad input is a `CommandError`."""
    import tyro

    from fntrain.models import generate as generation

    positional = tyro.conf.Positional
    command_cls = dataclasses.make_dataclass(
        "Generate",
        [
            ("source", Annotated[str, positional, tyro.conf.arg(metavar="SOURCE", help=_SOURCE_HELP)]),
            (
                "options",
                Annotated[generation.GenerateOptions, tyro.conf.arg(name="")],
                dataclasses.field(default=generation.GenerateOptions()),
            ),
        ],
        frozen=True,
    )
    summary = (__doc__ or "").split("\n\n")[0].split(": ", 1)[-1]
    parsed = parse(command_cls, args, prog="fntrain generate", description=summary,
                   config=(tyro.conf.UseAppendAction,))  # fmt: skip  (--prompt A --prompt B)
    options = parsed.options
    try:
        options.validate()
        device = _device(options.device)
        model, assets = _load(parsed.source, options, device)
    except (ValueError, OSError, TypeError) as error:  # bad input: one line, no traceback
        raise CommandError(first_line(error)) from error
    try:
        return generation.generate(model, assets, options)
    except (ValueError, OSError) as error:  # a prompt file, an image, a context too short
        raise CommandError(first_line(error)) from error


def _device(name: str) -> Any:
    """The torch device `--device` names (auto: the best available), checked to be usable."""
    import torch

    from fntrain.runtime.device import resolve_device_type

    kind, _, index = name.partition(":")
    try:
        resolved = resolve_device_type(kind)
    except ValueError:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:N, npu, auto)") from None
    except RuntimeError as error:  # a device this machine does not have
        raise ValueError(f"--device {name!r}: this machine has none ({first_line(error)})") from None
    if index and (not index.isdigit() or resolved == "cpu"):
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:N, npu, auto)")
    return torch.device(resolved, int(index)) if index else torch.device(resolved)


def _load(source_text: str, options: Any, device: Any) -> tuple[Any, Any]:
    """(model, its TextAssets): the source resolved and checked, the recipe and tokenizer loaded and
    `--image` checked against them, then the model."""
    from fntrain.models.load import load_model, load_text_assets
    from fntrain.models.sources import resolve_model_source

    source = resolve_model_source(source_text)
    spec = config = None
    if source.kind != "hf":
        spec, config = _recipe_config(source, options.recipe)
    assets = load_text_assets(source, spec, config)
    if options.image is not None and not assets.takes_images:
        raise ValueError(f"--image {options.image!r}: {source_text!r} is a text model; it takes no image")
    return load_model(source, spec, config, device), assets


def _recipe_config(source: Any, recipe_flag: str | None) -> tuple[Any, Any]:
    """(the spec, the run's config) of a checkpoint or model.safetensors: `--recipe`, else the recipe
    the run recorded, its config rebuilt from the recorded dict."""
    from fntrain.cli.config_file import config_from_dict

    name = recipe_flag or source.recipe
    if not name:
        raise ValueError(
            f"{str(source.path)!r} does not record its recipe: name it with --recipe (e.g. tiny_gpt)"
        )
    try:
        recipe = load_recipe(name)
    except RecipeNotFound as error:
        where = "--recipe" if recipe_flag else f"the recipe {str(source.path)!r} records,"
        raise ValueError(f"{where} {name!r}: {error}") from None
    other = other_recipe(source.recipe, recipe.config_cls) if recipe_flag else None
    if other is not None:  # its config and weights are another recipe's
        raise ValueError(f"--recipe {name!r}: {str(source.path)!r} was written by the {other} recipe; leave "
                         "--recipe out to use it")  # fmt: skip
    return recipe.spec, config_from_dict(recipe.config_cls, source.run_config or {})
