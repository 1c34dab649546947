"""The package's shape: no import circle in keydiff (an import counts wherever it is in a file, a relative one as the
module it names), the decoding core imports nothing above it, and ownership of buffers is recorded state, never a
comparison of data pointers (a data_ptr counts wherever it is: a module-level lambda, a getattr by name)."""

from __future__ import annotations

import ast

import pytest

from tests.test_registry import PACKAGE, ROOT, imports, module_name

pytestmark = [pytest.mark.unit, pytest.mark.extended]

# Each part of the decoding path, and the parts above it that it must never import (run.py -> runner -> engine ->
# decode -> cache -> policies / attention -> kernels).
ABOVE = {
    "keydiff.engine": ("keydiff.run",),
    "keydiff.decode": ("keydiff.engine", "keydiff.run"),
    "keydiff.cache": ("keydiff.decode", "keydiff.engine", "keydiff.run"),
    "keydiff.policies": ("keydiff.cache", "keydiff.decode", "keydiff.engine", "keydiff.run"),
    "keydiff.attention": ("keydiff.cache", "keydiff.decode", "keydiff.engine", "keydiff.run"),
    "keydiff.paper": ("keydiff.report", "keydiff.run", "keydiff.bench"),
    "keydiff.kernels": ("keydiff.attention", "keydiff.policies", "keydiff.cache", "keydiff.decode", "keydiff.engine",
                        "keydiff.run"),
}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path, set(files)) - {name} for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other through imports (more than one module each)."""
    reach = {}
    for root in graph:
        seen, todo = set(), [root]
        while todo:
            for target in graph.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        reach[root] = seen
    groups = {tuple(sorted(m for m in graph if m in reach[n] and n in reach[m])) for n in graph if n in reach[n]}
    return sorted(list(group) for group in groups if len(group) > 1)


def test_no_module_of_keydiff_is_in_an_import_circle():
    graph = import_graph()
    assert "keydiff.decode.scheduler" in graph and "keydiff.run.runner" in graph
    assert circles(graph) == []
    # the check sees a circle when there is one
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_decoding_core_imports_nothing_above_it():
    graph = import_graph()
    upward = sorted((name, target) for name, targets in graph.items() for part, above in ABOVE.items()
                    if name == part or name.startswith(part + ".")
                    for target in targets if any(target == a or target.startswith(a + ".") for a in above))
    assert upward == []


def test_ownership_is_never_decided_by_comparing_data_pointers():
    # the one data_ptr left counts each allocation's bytes once for kv_cache_bytes, and decides nothing
    uses = []

    def visit(node: ast.AST, path: str, where: str) -> None:  # where: the innermost function, or the module's body
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, path, child.name)
                continue
            if (isinstance(child, ast.Attribute) and child.attr == "data_ptr") or (
                    isinstance(child, ast.Constant) and child.value == "data_ptr"):  # getattr(t, "data_ptr")
                uses.append((path, where))
            visit(child, path, where)

    for path in PACKAGE.rglob("*.py"):
        visit(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(ROOT)), "<module>")
    assert sorted(set(uses)) == [("keydiff/cache/arena.py", "allocation_bytes")]
