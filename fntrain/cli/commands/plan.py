"""`fntrain plan RECIPE [--world-size N] [--json] [--config FILE] [overrides]`: the resolved run plan,
without a model or a device."""

from __future__ import annotations

import json
from typing import Any

from fntrain.cli.errors import setting_error
from fntrain.cli.recipe_args import (
    command_with_options,
    load_defaults,
    parse_recipe_command,
    split_config,
    split_recipe,
)
from fntrain.cli.recipes import Recipe, load_recipe
from fntrain.config import as_flags

__all__ = ["command", "plan_report"]


def plan_report(recipe: Recipe, config: Any, world_size: int = 1) -> dict[str, Any]:
    """The recipe's plan for `world_size` ranks (`fntrain.run.job.plan_job`), with the recipe's name."""
    from fntrain.run.config import config_fields
    from fntrain.run.job import plan_job

    try:
        report = {"recipe": recipe.name, **plan_job(config, recipe.spec, world_size)}
    except (TypeError, ValueError, OSError) as error:  # settings the job rejects, a bad data file
        raise setting_error(error, recipe.config_cls) from None
    fields = config_fields(recipe.config_cls)
    report["notes"] = [as_flags(note, fields) for note in report.get("notes", ())]  # fields as flags
    return report


def command(args: list[str]) -> dict[str, Any]:
    """`fntrain plan`: the plan printed as text (or JSON) and returned as its report dict."""
    name, rest = split_recipe("plan", args)
    recipe = load_recipe(name)
    paths, rest = split_config(rest)
    command_cls = command_with_options(
        recipe,
        load_defaults(recipe, paths),
        [
            ("world_size", int, 1, "Ranks the run would use (torchrun's WORLD_SIZE)."),
            ("json", bool, False, "Print the plan as JSON instead of text."),
        ],
    )
    parsed = parse_recipe_command(recipe, command_cls, rest, prog=f"fntrain plan {name}")
    report = plan_report(recipe, parsed.recipe_config, parsed.world_size)
    if parsed.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        from fntrain.plan.render import format_run_plan

        print(format_run_plan(report))
    return report
