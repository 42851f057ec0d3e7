"""Scripts outside the package (benchmarks, examples, test support) name what they import from bigbatch by
module path: every such name must exist, so a move or rename inside the package cannot strand a script that no
test runs end to end."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py"), *ROOT.glob("tests/support/*.py")])


def bigbatch_imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from bigbatch... import name`` in ``path``, top level or in a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("bigbatch"):
            found.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "") for alias in node.names if alias.name.startswith("bigbatch"))
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_name_a_script_imports_from_bigbatch_exists(script: Path) -> None:
    missing = []
    for module_name, name in bigbatch_imports(script):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        if name and not hasattr(module, name):
            try:  # a submodule: from bigbatch.run.checkpoints import checkpoint
                importlib.import_module(f"{module_name}.{name}")
            except ImportError:
                missing.append(f"{module_name}.{name}")
    assert missing == [], f"{script.name} imports what bigbatch does not have: {missing}"


def test_the_scripts_are_found() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"packing.py", "engine_in_your_loop.py", "fuzz_worker.py"} <= names
