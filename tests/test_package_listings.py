"""Each package's `__init__` docstring lists its modules: the first place a reader looks, kept true by this test
(keydiff/policies lists those that are not one policy each: a policy module is named by its conf/policy file)."""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "keydiff"
PACKAGES = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))

POLICY_MODULES = "Every other module is one policy, named by its conf/policy file"


def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""


def policy_modules() -> set[str]:
    """The modules of keydiff/policies that define a built-in policy (registered by its config name)."""
    from keydiff.policies import POLICIES

    return {cls.__module__.rpartition(".")[2] for cls in POLICIES.values()}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_the_package_docstring_names_every_module(package):
    doc = docstring(package)
    modules = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    modules += [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
    if package.name == "policies" and POLICY_MODULES in " ".join(doc.split()):
        modules = [m for m in modules if m not in policy_modules()]
    missing = sorted(m for m in modules if not re.search(rf"(?<![\w.]){re.escape(m)}(\.py|/)?(?![\w])", doc))
    assert not missing, f"keydiff/{package.name}/__init__.py's docstring does not list {missing}"


def test_every_built_in_policy_is_named_by_its_conf_policy_file():
    """The convention keydiff/policies' docstring states: each built-in has its conf/policy file; other modules none."""
    from keydiff.policies import POLICIES

    assert POLICY_MODULES in " ".join(docstring(PACKAGE / "policies").split())
    presets = {p.stem for p in (PACKAGE.parent / "conf" / "policy").glob("*.yaml")}
    assert {"keydiff", "knorm", "kvzip"} <= set(POLICIES) <= presets, sorted(set(POLICIES) - presets)
    assert {"keydiff", "knorm", "kvzip"} <= policy_modules() and not {"base", "wrappers", "adakv"} & policy_modules()


def test_a_built_in_registers_itself_once_by_its_name():
    """A second built-in claiming a config name is refused, naming both; a class of your own registers nothing."""
    from keydiff.policies import POLICIES, Policy
    from keydiff.policies.base import BUILT_IN

    with pytest.raises(TypeError, match=r"^keydiff.policies.other.Other.name 'knorm' is already "
                                        r"keydiff.policies.knorm.KNorm's; a built-in policy's config name is its own$"):
        type("Other", (Policy,), {"name": "knorm", "__module__": "keydiff.policies.other", "__qualname__": "Other"})
    type("Mine", (Policy,), {"name": "mine", "__module__": "my_policies", "__qualname__": "Mine"})
    assert BUILT_IN == POLICIES and "mine" not in BUILT_IN
