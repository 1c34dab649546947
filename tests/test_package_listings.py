"""Each package's `__init__` docstring lists its modules: the first place a reader looks, kept true by this test."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "keydiff"
PACKAGES = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_the_package_docstring_names_every_module(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    modules = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    modules += [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
    missing = sorted(m for m in modules if not re.search(rf"(?<![\w.]){re.escape(m)}(\.py|/)?(?![\w])", doc))
    assert not missing, f"keydiff/{package.name}/__init__.py's docstring does not list {missing}"
