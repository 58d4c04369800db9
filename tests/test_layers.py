"""The library's import graph, every import counted (those inside functions too): arrows only point
down the layers of DESIGN.md, there are no circles, and imports inside the run package's functions
each say why they are there."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Higher imports lower; a package imports within itself freely. Top-level modules are their own layer.
LAYERS = {
    "fntrain.state": 0, "fntrain.config": 0, "fntrain.mesh_layout": 0, "fntrain.stateful": 0, "fntrain.rewards": 0,
    "fntrain.loop": 1, "fntrain.runtime": 1, "fntrain.data": 1, "fntrain.sampling": 1, "fntrain": 2,
    "fntrain.step": 2, "fntrain.checkpoint": 3,
    "fntrain.models": 4,
    "fntrain.hooks": 5,
    "fntrain.plan": 6,
    "fntrain.run": 7,
    "fntrain.cli": 8, "fntrain.__main__": 9,
}  # fmt: skip


def _modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "fntrain").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, ast.stmt]]:
    """(imported library module, node) for every import in `path`, resolved to a module of ours."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.append((name, node))
    return found


def _layer(module: str) -> tuple[str, int]:
    key = ".".join(module.split(".")[:2])
    if key in LAYERS:
        return key, LAYERS[key]
    raise AssertionError(f"{module} has no layer in tests/test_layers.py")


def test_arrows_only_point_down():
    modules = _modules()
    upward = []
    for module, path in modules.items():
        here, rank = _layer(module)
        for imported, node in _imports(path, modules):
            there, other = _layer(imported)
            if there != here and other >= rank and not module.startswith(imported + "."):
                upward.append(f"{path.relative_to(ROOT)}:{node.lineno} ({here}) imports {imported} ({there})")
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    modules = _modules()
    graph = {m: {i for i, _ in _imports(p, modules) if i != m and not m.startswith(i + ".")} for m, p in modules.items()}
    done, on_path, circles = set(), [], []

    def visit(module: str) -> None:
        on_path.append(module)
        for imported in sorted(graph[module]):
            if imported in on_path:
                circles.append(on_path[on_path.index(imported):] + [imported])
            elif imported not in done:
                visit(imported)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles)


def test_imports_inside_run_functions_say_why():
    """In fntrain/run/, an import inside a function is for an optional dependency or import time, and a
    comment on its line or the line above says which."""
    unexplained = []
    for path in sorted((ROOT / "fntrain" / "run").glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    here, above = lines[inner.lineno - 1], lines[inner.lineno - 2]
                    if "#" not in here and not above.strip().startswith("#"):
                        unexplained.append(f"{path.relative_to(ROOT)}:{inner.lineno}: {here.strip()}")
    assert not unexplained, "\n".join(unexplained)
