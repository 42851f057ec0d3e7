"""No test or support module reaches outside the repository: a test must behave the same on a fresh clone.

A file beside the clone (CI's ``../shared``, a developer's home) makes a test pass or fail by where it runs. Each
Python file under tests/ is read with ``ast`` and these are refused:

* a path computed from ``__file__`` that climbs above the repository root (``Path(__file__).parents[3]``,
  ``.parent`` chains, ``os.path.dirname``, names bound to such paths, ``/ "..."`` joins), tracked symbolically;
* a string holding a ``..`` path component (``"../shared"``, ``Path("..")``);
* an absolute path literal outside the system's own directories (``"/work/..."``, ``"/home/..."``);
* the user's home: ``Path.home()``, ``expanduser``.

Strings a test compares with or writes into a file (``json.dumps``, ``write_text``) are data, not paths, and pass:
e.g. a shard index naming ``"../elsewhere"`` that the code under test must refuse. A file that truly needs to reach
outside goes in ``ALLOWED``, with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
WRITES = (".dumps", ".dump", ".write_text", ".write_bytes", ".write")  # calls whose arguments are a file's content
SYSTEM_DIRS = {"proc", "dev", "sys", "usr", "bin", "etc"}  # the OS's, the same on every Linux machine
ALLOWED: dict[str, str] = {}  # "tests/path.py": why; empty: nothing needs to reach outside


class _Above:
    """A path above the repository root."""


ABOVE = _Above()
PathValue = tuple[str, ...] | _Above | None  # parts relative to the root; above it; or not a path we can follow


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        inner = func.value
        prefix = f"{inner.value.id}." if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) else ""
        base = inner.attr if isinstance(inner, ast.Attribute) else inner.id if isinstance(inner, ast.Name) else ""
        return f"{prefix}{base}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


class _Scanner(ast.NodeVisitor):
    def __init__(self, rel: tuple[str, ...]) -> None:
        self.file = rel  # this file's parts relative to the root
        self.names: dict[str, PathValue] = {}  # names bound to paths, in source order (good enough for constants)
        self.problems: list[str] = []
        self.data: set[int] = set()  # strings compared with or written into a file: data, not a path to go to
        self.not_leading: set[int] = set()  # literal parts of an f-string after a value: not the start of a path

    def _up(self, value: PathValue, levels: int) -> PathValue:
        if isinstance(value, tuple):
            return value[:-levels] if levels <= len(value) else ABOVE
        return value

    def _join(self, value: PathValue, node: ast.expr) -> PathValue:
        if not isinstance(value, tuple):
            return value
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            return None  # an unknown part: where it ends up is unknown
        parts = list(value)
        for part in node.value.split("/"):
            if part == "..":
                if not parts:
                    return ABOVE
                parts.pop()
            elif part not in ("", "."):
                parts.append(part)
        return tuple(parts)

    def path_of(self, node: ast.expr) -> PathValue:
        """Where ``node`` points, when it is a path derived from ``__file__``."""
        if isinstance(node, ast.Name):
            return self.file if node.id == "__file__" else self.names.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            return self._up(self.path_of(node.value), 1)
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "parents"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int)
        ):
            return self._up(self.path_of(node.value.value), node.slice.value + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return self._join(self.path_of(node.left), node.right)
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name.endswith((".resolve", ".absolute")) and isinstance(node.func, ast.Attribute):
                return self.path_of(node.func.value)
            if name in ("Path", "pathlib.Path", "os.path.abspath", "os.path.realpath", "path.abspath") and node.args:
                value = self.path_of(node.args[0])
                for arg in node.args[1:]:
                    value = self._join(value, arg)
                return value
            if name in ("os.path.dirname", "path.dirname") and node.args:
                return self._up(self.path_of(node.args[0]), 1)
            if name in ("os.path.join", "path.join") and node.args:
                value = self.path_of(node.args[0])
                for arg in node.args[1:]:
                    value = self._join(value, arg)
                return value
        return None

    def _refuse(self, node: ast.AST, what: str) -> None:
        self.problems.append(f"{'/'.join(self.file)}:{getattr(node, 'lineno', '?')}: {what}")

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.expr) and self.path_of(node) is ABOVE:
            self._refuse(node, f"a path above the repository root: {ast.unparse(node)}")
            return  # one report per expression, not one per enclosing expression
        if isinstance(node, ast.Compare):  # `part == ".."` inspects a path, it does not go anywhere
            self.data.update(id(operand) for operand in [node.left, *node.comparators])
        if isinstance(node, ast.Call) and _call_name(node).endswith(WRITES):  # the content of a file
            self.data.update(id(n) for arg in [*node.args, *node.keywords] for n in ast.walk(arg))
        if isinstance(node, ast.JoinedStr):  # f"{tmp_path}/data": only a leading literal can start a path
            self.not_leading.update(id(value) for value in node.values[1:])
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in self.data:
            text, top = node.value, node.value.split("/")[1] if node.value.startswith("/") else ""
            if ".." in text.replace("\\", "/").split("/"):
                self._refuse(node, f"a '..' path component: {text!r}")
            elif top and top not in SYSTEM_DIRS and id(node) not in self.not_leading:
                self._refuse(node, f"an absolute path: {text!r}")
        if isinstance(node, ast.Call) and _call_name(node).endswith((".home", ".expanduser", "path.expanduser")):
            self._refuse(node, f"the user's home: {ast.unparse(node)}")
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            self.visit(node.value)
            value = self.path_of(node.value)
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                self.visit(target)
                if isinstance(target, ast.Name):
                    self.names[target.id] = value
            return
        super().generic_visit(node)


def problems_in(source: str, rel: tuple[str, ...]) -> list[str]:
    scanner = _Scanner(rel)
    scanner.visit(ast.parse(source))
    return scanner.problems


def test_no_test_reaches_outside_the_repository() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50 and TESTS / "support" / "helpers.py" in files  # the scan sees the suite
    problems = [
        problem
        for path in files
        if str(path.relative_to(ROOT)) not in ALLOWED
        for problem in problems_in(path.read_text(encoding="utf-8"), path.relative_to(ROOT).parts)
    ]
    assert not problems, "tests must use only files inside the repository:\n" + "\n".join(problems)


IN_TESTS_UNIT = ("tests", "unit", "test_x.py")


@pytest.mark.parametrize(
    "source",
    [
        'X = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"',
        "X = Path(__file__).parent.parent.parent.parent",
        'ROOT = Path(__file__).resolve().parents[2]\nX = ROOT.parent / "shared"',
        'ROOT = Path(__file__).parents[2] / "src"\nX = ROOT.parent.parent',
        "X = Path(__file__).parent / '..' / '..' / '..' / 'elsewhere'",
        "X = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))",
        'X = open("../shared/data/tinyshakespeare.txt")',
        'X = os.path.join(HERE, "..", "x")',
        'X = f"{HERE}/..{os.sep}x"',
        'X = Path("/work/shared/data")',
        'X = f"/home/{user}/corpus.txt"',
        'X = Path.home() / ".cache"',
        'X = os.path.expanduser("~/data")',
    ],
)
def test_the_scan_catches_each_way_out(source: str) -> None:
    assert problems_in(source, IN_TESTS_UNIT), source


@pytest.mark.parametrize(
    "source",
    [
        'X = Path(__file__).resolve().parents[2] / "src"',  # the root itself
        'SRC = Path(__file__).resolve().parents[2] / "src"\nX = SRC.parent / "README.md"',
        "X = Path(__file__).parent.parent.parent",
        'X = tmp_path.parent.parent / "cache"',  # not derived from __file__: pytest's own directories
        'X = Path("/proc/self/fd/0")',
        'X = "loading..."',
        'X = f"{tmp_path}/data/*.bin"',
        'X = [p for p in parts if p != ".."]',
        'index.write_text(json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}))',
        "X = data[1:2]",
    ],
)
def test_the_scan_lets_paths_inside_the_repository_pass(source: str) -> None:
    assert problems_in(source, IN_TESTS_UNIT) == []
