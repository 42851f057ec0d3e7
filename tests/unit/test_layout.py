"""The package's layout: rooms in layers, imports that only go down, no import cycle, no loose modules.

Every module under ``src/bigbatch`` is read with ``ast`` (nothing is imported: this test needs no torch). A module
may import modules of its own room and of lower rooms only; that holds for imports at the top of a module and for
those inside a function alike (a deferred import is still a dependency). The layers, low to high, are ``LAYERS``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from import_graph import assert_acyclic

import bigbatch

PACKAGE = Path(bigbatch.__file__).parent

LAYERS: list[set[str]] = [
    {"errors", "progress", "files", "settings"},
    {"parallel"},
    {"models"},
    {"engine"},
    {"data"},
    {"rewards"},
    {"sizing"},
    {"noise"},
    {"observe"},
    {"run"},
    {"artifacts"},
    {"critical_batch", "verify"},
    {"cli"},
]
"""The rooms, low to high; a room may import its own layer's rooms and lower ones."""

LEVEL = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}
TOP_LEVEL_MODULES = {"__init__", "__main__", "errors", "progress"}
"""The only modules directly in ``src/bigbatch``: everything else lives in a room."""
FACADES = {"bigbatch", "bigbatch.__main__"}
"""``import bigbatch``'s lazy public API and ``python -m bigbatch``: above every room, they may import any."""
ALWAYS_ALLOWED = {("bigbatch", "__version__")}
"""``from bigbatch import __version__``, anywhere."""

KNOWN_VIOLATIONS: set[tuple[str, str]] = set()
"""``(importer, imported)`` pairs that break the layering today, each with its reason; remove one as its fix lands
(an entry that no longer occurs fails :func:`test_known_violations_still_occur`)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def room_of(module: str) -> str:
    """``bigbatch.models.gpt.model`` -> ``models``; ``bigbatch.errors`` -> ``errors``."""
    return module.split(".")[1]


def _is_type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> set[tuple[str, str | None]]:
    """``(module, name)`` for each bigbatch module ``node`` imports: ``from a.b import c`` is module ``a.b.c`` when
    that is a module, else ``a.b`` (``name`` says which name, for :data:`ALWAYS_ALLOWED`)."""
    if isinstance(node, ast.Import):
        return {(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "bigbatch"}
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    if base.split(".")[0] != "bigbatch":
        return set()
    found = set()
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        found.add((candidate, None) if candidate in modules() else (base, alias.name))
    return found


def _import_nodes(node: ast.AST, deferred: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``node``, with whether it is deferred (inside a function or under
    ``if TYPE_CHECKING``: not run when the module is imported)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, deferred
        elif isinstance(child, ast.If) and _is_type_checking(child):
            yield from _import_nodes(ast.Module(body=child.body, type_ignores=[]), True)
            yield from _import_nodes(ast.Module(body=child.orelse, type_ignores=[]), deferred)
        else:
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _import_nodes(child, inner)


@cache
def imports() -> dict[str, tuple[frozenset[tuple[str, str | None]], frozenset[str]]]:
    """Each module's bigbatch imports: all of them (anywhere in the module), and those run when it is imported
    (not inside a function, not under ``if TYPE_CHECKING``)."""
    found = {}
    for module, path in modules().items():
        everywhere: set[tuple[str, str | None]] = set()
        at_import: set[str] = set()
        for node, deferred in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            targets = _imported(module, path, node)
            everywhere.update(targets)
            if not deferred:
                at_import.update(target for target, _ in targets)
        found[module] = (frozenset(everywhere), frozenset(at_import))
    return found


def violations() -> set[tuple[str, str]]:
    """``(importer, imported)`` pairs where a module imports from a higher room."""
    found = set()
    for module, (everywhere, _) in imports().items():
        if module in FACADES:
            continue
        for target, name in everywhere:
            if (target, name) in ALWAYS_ALLOWED:
                continue
            if target in FACADES or LEVEL[room_of(target)] > LEVEL[room_of(module)]:
                found.add((module, target))
    return found


def test_the_walk_sees_imports() -> None:
    everywhere, at_import = imports()["bigbatch.models.lm_output"]
    assert "bigbatch.models.head_loss" in at_import
    assert ("bigbatch.models.head_loss", "IGNORE_INDEX") in everywhere
    deferred = {target for target, _ in imports()["bigbatch.cli.train"][0]} - imports()["bigbatch.cli.train"][1]
    assert "bigbatch.run.loop.trainer" in deferred  # inside a function: a dependency, not run at import


def test_no_loose_modules_in_the_package_root() -> None:
    loose = {path.stem for path in PACKAGE.glob("*.py")} - TOP_LEVEL_MODULES
    assert loose == set(), f"modules directly in src/bigbatch belong in a room: {sorted(loose)}"


def test_every_room_is_in_a_layer() -> None:
    rooms = {room_of(module) for module in modules() if module not in FACADES}
    assert rooms - LEVEL.keys() == set(), "a new room needs its place in LAYERS"
    assert LEVEL.keys() - rooms == set(), "LAYERS names a room that no longer exists"


def test_imports_go_down_the_layers() -> None:
    unexpected = sorted(violations() - KNOWN_VIOLATIONS)
    assert unexpected == [], "imports from a higher room:\n" + "\n".join(f"{a} -> {b}" for a, b in unexpected)


def test_known_violations_still_occur() -> None:
    """A fixed violation leaves KNOWN_VIOLATIONS, so that it cannot come back unnoticed."""
    assert sorted(KNOWN_VIOLATIONS - violations()) == []


def test_no_import_cycle_at_import_time() -> None:
    edges = {module: {t for t in at_import if t in modules()} for module, (_, at_import) in imports().items()}
    assert_acyclic(edges)


def family_folders() -> list[Path]:
    """The model family folders: each directory under ``models/`` with a ``family.py``."""
    return sorted(path.parent for path in (PACKAGE / "models").glob("*/family.py"))


def family_classes() -> set[str]:
    """Every class a family folder defines (its model, config and their parts)."""
    names = set()
    for folder in family_folders():
        for path in folder.glob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            names.update(node.name for node in tree.body if isinstance(node, ast.ClassDef))
    return names


def family_knowledge_outside_models() -> list[str]:
    """``module:line what`` wherever a module outside ``models/`` (and the public facade) imports from a family
    folder or names one of a family's classes (an ``isinstance`` check, an annotation, an import)."""
    classes = family_classes()
    folders = {".".join(("bigbatch", "models", folder.name)) for folder in family_folders()}
    found = []
    for module, path in modules().items():
        if module in FACADES or room_of(module) == "models":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, _ in _imported(module, path, node):
                    if any(target == folder or target.startswith(folder + ".") for folder in folders):
                        found.append(f"{module}:{node.lineno} imports {target}")
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in classes:
                found.append(f"{module}:{node.lineno} names {name}")
            if isinstance(node, ast.alias) and node.name in classes:
                found.append(f"{module}:{getattr(node, 'lineno', 0)} imports {node.name}")
    return found


def test_the_family_walk_sees_every_family() -> None:
    assert {folder.name for folder in family_folders()} >= {"gpt", "llama", "hf"}
    assert {"GPT", "GPTConfig", "Llama", "LlamaConfig", "HFCausalLM", "HFConfig"} <= family_classes()


def test_no_module_outside_models_knows_a_family() -> None:
    """Families are reached through ``bigbatch.models.registry`` and the ``ModelFamily`` record only: adding one
    touches its folder and the registry's list."""
    found = family_knowledge_outside_models()
    assert found == [], "family classes or folders named outside models/:\n" + "\n".join(found)


MAX_FUNCTION_LINES = 80
"""The longest a function or method may be (``def`` to its last line, decorators not counted): a longer one is
split into named steps."""


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method under ``node``, nested ones too, with its qualified name (``Class.method``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{child.name}", child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``module:function lines`` for every function or method in the package longer than ``limit`` lines."""
    found = []
    for module, path in modules().items():
        for name, node in _functions(ast.parse(path.read_text(), filename=str(path))):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{module}:{name} {lines}")
    return found


def test_the_function_walk_sees_methods_and_nested_functions() -> None:
    names = {name for name, _ in _functions(ast.parse("class A:\n    def f(self):\n        def g(): pass\n"))}
    assert names == {"A.f", "A.f.g"}
    assert any(entry.startswith("bigbatch.run.loop.trainer:Trainer.") for entry in long_functions(limit=5))


def test_no_function_over_80_lines() -> None:
    found = long_functions()
    assert found == [], f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(found)
