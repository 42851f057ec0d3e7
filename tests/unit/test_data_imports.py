"""The import graph of ``bigbatch.data``: no cycle inside it, and no arrow to the engine, model or trainer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from import_graph import assert_acyclic

import bigbatch.data

DATA = Path(bigbatch.data.__file__).parent
# The data room may use the engine's batch types (engine/batch.py), never its loop, a model or the run.
FORBIDDEN = ("bigbatch.engine.accumulate", "bigbatch.engine.hooks", "bigbatch.models", "bigbatch.run")


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
    assert_acyclic(edges)  # imports inside functions count too: none is there to dodge a cycle


def test_preparing_data_does_not_import_torch() -> None:
    """Only the loader needs torch: the command line's parser (tokenizer names) and ``bigbatch prepare`` read the
    data package without it. ``bigbatch/__init__.py`` is bypassed here: it is not part of the data package."""
    code = (
        "import importlib.util, sys\n"
        f"package = importlib.util.spec_from_file_location('bigbatch', {str(DATA.parent / '__init__.py')!r},\n"
        f"    submodule_search_locations=[{str(DATA.parent)!r}])\n"
        "sys.modules['bigbatch'] = importlib.util.module_from_spec(package)\n"
        "import bigbatch.data.tokenizers, bigbatch.data.prepare, bigbatch.data.cache, bigbatch.data.dataset\n"
        "from bigbatch.data import prepare_dataset, ensure_prepared, get_tokenizer\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
