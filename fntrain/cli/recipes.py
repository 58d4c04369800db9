"""Finding recipes by name or path: installed entry points, the built-in package, a checkout, a file.

A recipe is a module that exposes `spec`, a `fntrain.run.config.RecipeSpec` (its config class and its own
parts); `fntrain run`, `plan` and `config` run it through `fntrain.run.job`.

Names resolve in this order: an entry point in the group `fntrain.recipes` (how the wheel ships the
built-in recipes, under the package `fntrain_recipes` so that no other project's top-level `recipes`
package can shadow them, and how other projects register theirs); `fntrain_recipes.<name>`;
`recipes.<name>` from a source checkout; a dotted module path (`my_project.recipes.sft`); or the path of
a Python file (`./my_gpt.py`, e.g. one written by `fntrain cp`). What a run records to find its recipe
again is `fntrain.run.resolved.recipe_reference`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from fntrain.run.resolved import FILE_MODULE_PREFIX

__all__ = [
    "BUILT_IN", "ENTRY_POINT_GROUP", "Recipe", "RecipeNotFound", "available_recipes", "is_built_in", "load_recipe",
]  # fmt: skip

ENTRY_POINT_GROUP = "fntrain.recipes"
_PACKAGES = ("fntrain_recipes", "recipes")  # installed name first; the checkout's `recipes/` second
BUILT_IN = ("tiny_gpt", "hf_causal_lm", "vlm", "dpo", "kd", "grpo")


class RecipeNotFound(LookupError):
    """No recipe of that name (the message lists the ones that exist)."""


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe: its name, module and spec (`fntrain.run.config.RecipeSpec`)."""

    name: str
    module: ModuleType
    spec: Any
    description: str

    @property
    def config_cls(self) -> type:
        return self.spec.config

    @property
    def source(self) -> str:
        return self.module.__name__


def _normalize(name: str) -> str:
    return name.strip().replace("-", "_")


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    try:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken distribution's metadata must not break the command
        return {}
    return {_normalize(ep.name): ep for ep in found}


def _module_exists(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def available_recipes() -> dict[str, str]:
    """name -> module path, for every recipe that can be found by name (entry points and built-ins)."""
    names: dict[str, str] = {name: ep.value for name, ep in _entry_points().items()}
    for package in _PACKAGES:
        if not _module_exists(package):
            continue
        for name in BUILT_IN:
            if name not in names and _module_exists(f"{package}.{name}"):
                names[name] = f"{package}.{name}"
    return dict(sorted(names.items()))


def _try_import(module_name: str) -> ModuleType | None:
    """The module, or None when it (or a package above it) does not exist. A recipe whose own imports
    fail (a missing extra) raises: that error must reach the user."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            return None
        raise


def _import_by_name(name: str) -> ModuleType:
    key = _normalize(name)
    entry_point = _entry_points().get(key)
    if entry_point is not None:
        loaded = entry_point.load()
        if not isinstance(loaded, ModuleType):
            raise TypeError(
                f"entry point {ENTRY_POINT_GROUP}:{entry_point.name} must name a module, got {loaded!r}"
            )
        return loaded
    candidates = [f"{package}.{key}" for package in _PACKAGES]
    if "." in name:
        candidates.append(name)
    for module_name in candidates:
        module = _try_import(module_name)
        if module is not None:
            return module
    known = ", ".join(available_recipes()) or "none"
    raise RecipeNotFound(f"no recipe named {name!r} (known recipes: {known}; or give a dotted module path)")


def is_built_in(name: str, module: str) -> bool:
    """Whether `available_recipes()`'s `name -> module` is one fntrain ships (not another project's)."""
    return name in BUILT_IN and module in {f"{package}.{name}" for package in _PACKAGES}


def _import_file(path: Path) -> ModuleType:
    """The Python file at `path` imported as a module named after it (its directory goes first on
    sys.path, as for `python path`, so the file's own neighbours import)."""
    name = f"{FILE_MODULE_PREFIX}{path.stem}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise RecipeNotFound(f"{str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    loader_spec.loader.exec_module(module)
    return module


def _recipe_spec(module: ModuleType) -> Any:
    from fntrain.run.config import RecipeSpec  # import time: listing recipes imports no torch

    spec = getattr(module, "spec", None)
    if not isinstance(spec, RecipeSpec):
        raise RecipeNotFound(
            f"{module.__name__} is not a recipe: it must define `spec = fntrain.run.config.RecipeSpec(...)`"
        )
    return spec


def load_recipe(name: str) -> Recipe:
    """Import the recipe `name` (a name, a dotted module path or a .py file) and return its spec."""
    path = Path(name).expanduser()
    if name.endswith(".py"):
        if not path.is_file():
            raise RecipeNotFound(f"recipe file {name!r} does not exist")
        module = _import_file(path.resolve())
        label = str(path)
    else:
        module = _import_by_name(name)
        label = _normalize(name) if "." not in name else module.__name__
    return Recipe(
        name=label, module=module, spec=_recipe_spec(module), description=(module.__doc__ or "").strip()
    )
