"""Which recipe wrote a checkpoint, and whether it is the one a command was given [issue 48]: a checkpoint
of another recipe is refused in one line naming the recipe that wrote it, before any model work (its
config would not read back into this recipe's, its weights would not fit this recipe's model).

    recipe_label(reference)               "fntrain_recipes.dpo" -> "dpo"; a module or file path as it is
    label_of(config_class)                the label of the recipe whose config class is `config_class`
    other_recipe(recorded, config_class)  the recorded recipe's label when it is not `config_class`'s

A checkpoint records its recipe in meta.json (`fntrain.run.resolved.recipe_reference`); a run directory
without one, in the command line of its run_metadata.json (`fntrain.models.sources.recorded_recipe`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fntrain.run.resolved import recipe_reference

__all__ = ["recipe_label", "label_of", "other_recipe"]

# The packages a built-in recipe is imported from: installed, and a source checkout's `recipes/`.
_BUILT_IN_PACKAGES = ("fntrain_recipes.", "recipes.")


def recipe_label(reference: str) -> str:
    """How a user names the recipe `reference` records: a built-in one by its name, any other (a dotted
    module path, a .py file) as recorded."""
    for prefix in _BUILT_IN_PACKAGES:
        name = reference[len(prefix) :]
        if reference.startswith(prefix) and name and "." not in name:
            return name
    return reference


def label_of(config_class: type) -> str:
    """The label of the recipe whose config class is `config_class` (its `recipe_reference`)."""
    return recipe_label(recipe_reference(config_class))


def _same(recorded: str, reference: str) -> bool:
    if recorded.endswith(".py") or reference.endswith(".py"):
        return Path(recorded).expanduser().resolve() == Path(reference).expanduser().resolve()
    return recipe_label(recorded).replace("-", "_") == recipe_label(reference).replace("-", "_")


def other_recipe(recorded: Any, config_class: type) -> str | None:
    """The label of the recipe a checkpoint records (`recorded`) when it is not the recipe whose config
    class is `config_class`; None when it is, when the checkpoint records none (saved before recipes
    were recorded), or a recipe file that is no longer there (moved: the recipe given is its new place)."""
    if not isinstance(recorded, str) or not recorded:
        return None
    if recorded.endswith(".py") and not Path(recorded).expanduser().is_file():
        return None
    return None if _same(recorded, recipe_reference(config_class)) else recipe_label(recorded)
