"""Finding recipes by name: installed entry points first, then the built-in package, then a checkout.

A recipe is a module that exposes

- `Config`: its frozen config dataclass (the CLI is built from it),
- `run(config)`: validate, build, train,
- optionally `plan(config, world_size=1) -> dict`: the resolved run plan, computed without building the
  model or touching a device (what `fntrain plan` prints).

Names resolve in this order: an entry point in the group `fntrain.recipes` (how the wheel ships the
built-in recipes, under the package `fntrain_recipes` so that no other project's top-level `recipes`
package can shadow them, and how other projects register theirs); `fntrain_recipes.<name>`;
`recipes.<name>` from a source checkout; finally a dotted module path (`my_project.recipes.sft`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "Recipe", "RecipeNotFound", "available_recipes", "load_recipe"]

ENTRY_POINT_GROUP = "fntrain.recipes"
_PACKAGES = ("fntrain_recipes", "recipes")  # installed name first; the checkout's `recipes/` second
_BUILT_IN = ("tiny_gpt", "hf_causal_lm")


class RecipeNotFound(LookupError):
    """No recipe of that name (the message lists the ones that exist)."""


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe module and the parts the `fntrain` command uses."""

    name: str
    module: ModuleType
    config_cls: type
    run: Callable[[Any], Any]
    plan: Callable[..., dict[str, Any]] | None
    description: str

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
        for name in _BUILT_IN:
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


def _config_class(module: ModuleType) -> type:
    config_cls = getattr(module, "Config", None)
    if config_cls is None:  # fall back to the annotation of run's first parameter
        run = getattr(module, "run", None)
        if run is not None:
            params = list(inspect.signature(run).parameters)
            hints = typing.get_type_hints(run) if params else {}
            config_cls = hints.get(params[0]) if params else None
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise TypeError(
            f"recipe module {module.__name__} must expose `Config`, its config dataclass "
            "(or annotate run's first parameter with it)"
        )
    return config_cls


def load_recipe(name: str) -> Recipe:
    """Import the recipe `name` and check it has what the command needs."""
    module = _import_by_name(name)
    run = getattr(module, "run", None)
    if not callable(run):
        raise TypeError(f"recipe module {module.__name__} must define run(config)")
    plan = getattr(module, "plan", None)
    doc = (module.__doc__ or "").strip()
    return Recipe(
        name=_normalize(name) if "." not in name else module.__name__,
        module=module,
        config_cls=_config_class(module),
        run=run,
        plan=plan if callable(plan) else None,
        description=doc,
    )
