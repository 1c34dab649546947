"""No class in keydiff has more than `MAX_METHODS` methods (the `def`s directly in its body): a class that answers
every question of every caller is split by concern instead."""

from __future__ import annotations

import ast

import pytest

from tests.test_registry import PACKAGE, ROOT

pytestmark = pytest.mark.unit

MAX_METHODS = 30


def class_sizes() -> dict[str, int]:
    """`path:Class` -> the number of functions defined directly in the class body, for every class in keydiff."""
    sizes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                methods = [item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
                sizes[f"{path.relative_to(ROOT)}:{node.name}"] = len(methods)
    return sizes


def test_no_class_has_more_than_30_methods():
    sizes = class_sizes()
    assert "keydiff/cache/cache.py:EvictingCache" in sizes and len(sizes) > 50  # the scan sees the package
    large = {name: count for name, count in sizes.items() if count > MAX_METHODS}
    assert not large, f"classes with more than {MAX_METHODS} methods (split them by concern): {large}"
