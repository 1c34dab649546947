"""keydiff.cache.evict is the one place that asks a policy what to drop (dense rows and head-adaptive pools)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

KEYDIFF = Path(__file__).resolve().parents[1] / "keydiff"
WRAPPERS = ("policies", "testing.py", "capture.py", "bench")


def choice_calls(names: tuple[str, ...]) -> list[str]:
    calls = []
    for path in sorted(KEYDIFF.rglob("*.py")):
        relative = path.relative_to(KEYDIFF)
        if relative.parts[0] in WRAPPERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
                calls.append(f"{relative.as_posix()}:{node.lineno} {node.func.attr}")
    return calls


def test_the_eviction_asks_a_policy_what_to_drop_in_two_places_only():
    """`evict` for dense rows, `drop_segments` for head-adaptive pools (outside policies and tools that wrap them)."""
    calls = choice_calls(("evict_indices", "keep_heads", "drop_segments"))
    assert [call.split(":")[0] for call in calls] == ["cache/evict.py"] * 2, calls
    assert sorted(call.split()[-1] for call in calls) == ["drop_segments", "evict_indices"], calls

