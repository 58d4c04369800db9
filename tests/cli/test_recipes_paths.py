"""`fntrain.cli.recipes` where the environment misbehaves: broken entry-point metadata, an entry point
naming something other than a module, a recipe whose own import fails (the error reaches the user),
module names find_spec cannot take, a missing recipe file, a recipe's source module name."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest

from fntrain.cli import recipes


def test_broken_entry_point_metadata_lists_the_built_ins(monkeypatch):
    def broken(**_kwargs):
        raise RuntimeError("corrupt METADATA")

    monkeypatch.setattr(importlib.metadata, "entry_points", broken)
    assert recipes._entry_points() == {}
    assert "tiny_gpt" in recipes.available_recipes()  # found as a package module instead


def test_an_entry_point_must_name_a_module(monkeypatch):
    entry = importlib.metadata.EntryPoint("odd", "os:getcwd", recipes.ENTRY_POINT_GROUP)
    monkeypatch.setattr(recipes, "_entry_points", lambda: {"odd": entry})
    with pytest.raises(TypeError, match=r"entry point fntrain.recipes:odd must name a module, got <built-in"):
        recipes.load_recipe("odd")


def test_a_recipes_own_failing_import_reaches_the_user(monkeypatch, tmp_path):
    package = tmp_path / "my_recipes_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "needs_extra.py").write_text("import a_missing_extra_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="a_missing_extra_package"):
        recipes.load_recipe("my_recipes_pkg.needs_extra")
    sys.modules.pop("my_recipes_pkg", None)
    assert not recipes._module_exists(".relative")  # find_spec refuses: not found, not an error


def test_missing_and_non_recipe_modules_are_named(tmp_path, monkeypatch):
    with pytest.raises(recipes.RecipeNotFound, match=r"recipe file '.*nowhere.py' does not exist"):
        recipes.load_recipe(str(tmp_path / "nowhere.py"))
    monkeypatch.setitem(sys.modules, "fake_pkg.plain", types.ModuleType("fake_pkg.plain"))
    with pytest.raises(recipes.RecipeNotFound, match=r"fake_pkg.plain is not a recipe: it must define `spec"):
        recipes.load_recipe("fake_pkg.plain")
