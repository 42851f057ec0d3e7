"""The import graph of ``bigbatch.data``: no cycle inside it, and no arrow to the engine, model or trainer."""

from __future__ import annotations

import ast
from pathlib import Path

import bigbatch.data

DATA = Path(bigbatch.data.__file__).parent
FORBIDDEN = ("bigbatch.accumulate", "bigbatch.engine", "bigbatch.model", "bigbatch.trainer")


def imports_of(path: Path) -> set[str]:
    """Every ``bigbatch`` module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "bigbatch" or name.startswith("bigbatch.")}


def graph() -> dict[str, set[str]]:
    modules = {f"bigbatch.data.{p.stem}": p for p in DATA.glob("*.py") if p.stem != "__init__"}
    return {name: imports_of(path) & modules.keys() for name, path in modules.items()}


def test_data_imports_nothing_of_the_engine_model_or_trainer() -> None:
    offending = {
        p.name: sorted(i for i in imports_of(p) if any(i == f or i.startswith(f"{f}.") for f in FORBIDDEN))
        for p in DATA.glob("*.py")
    }
    assert {name: found for name, found in offending.items() if found} == {}


def test_no_import_cycle_inside_data() -> None:
    edges = graph()
    assert edges["bigbatch.data.encode"] and edges["bigbatch.data.cache"]  # the walk sees the imports
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for target in sorted(edges[module]):
            visit(target, (*path, module))
        done.add(module)

    for module in sorted(edges):
        visit(module, ())
