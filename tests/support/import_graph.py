"""Import graphs read with ``ast``: a check that one has no cycle, shared by the layout and data-import tests."""

from __future__ import annotations


def assert_acyclic(edges: dict[str, set[str]]) -> None:
    """Fail naming the first cycle found among ``edges`` (module -> the modules it imports)."""
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import cycle: " + " -> ".join((*path[path.index(module) :], module))
        if module in done:
            return
        for target in sorted(edges.get(module, ())):
            visit(target, (*path, module))
        done.add(module)

    for module in sorted(edges):
        visit(module, ())
