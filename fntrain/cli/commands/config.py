"""`fntrain config RECIPE [--format toml|json] [--config FILE] [overrides]`: the resolved config, ready
to be fed back as `--config`."""

from __future__ import annotations

import json
import sys
from typing import Literal

from fntrain.cli.recipe_args import (
    command_with_options,
    load_defaults,
    parse_recipe_command,
    split_config,
    split_recipe,
)
from fntrain.cli.recipes import load_recipe
from fntrain.run.resolved import class_defaults, config_to_dict, dump_toml

__all__ = ["command"]


def command(args: list[str]) -> str:
    """`fntrain config`: the config written to stdout and returned as text."""
    name, rest = split_recipe("config", args)
    recipe = load_recipe(name)
    paths, rest = split_config(rest)
    command_cls = command_with_options(
        recipe,
        load_defaults(recipe, paths),
        [("format", Literal["toml", "json"], "toml", "Output format (both read back with --config).")],
    )
    parsed = parse_recipe_command(recipe, command_cls, rest, prog=f"fntrain config {name}")
    data = config_to_dict(parsed.recipe_config)
    if parsed.format == "toml":
        text = dump_toml(data, class_defaults(parsed.recipe_config))
    else:
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    sys.stdout.write(text)
    return text
