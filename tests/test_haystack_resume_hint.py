"""A run directory written before the pinned haystack (its run_config.json has no task.haystack_source) is refused
by the default command, since it read the interpreter's haystack; the refusal says how to resume it."""

from __future__ import annotations

import json

import pytest

from keydiff.run.results import ConfigMismatchError, ResultStore

pytestmark = pytest.mark.unit


def test_a_run_from_before_the_pinned_haystack_is_told_how_to_resume(tmp_path):
    old = {"task": {"name": "niah_small", "limit": 2}, "policy": {"name": "keydiff"}}
    (tmp_path / "run_config.json").write_text(json.dumps(old))
    new = {"task": {"name": "niah_small", "limit": 2, "haystack_source": "pinned"}, "policy": {"name": "keydiff"}}
    with pytest.raises(ConfigMismatchError) as refused:
        ResultStore(tmp_path, new)
    assert "task.haystack_source: '<missing>' -> 'pinned'" in str(refused.value)
    assert "task.haystack_source=interpreter" in str(refused.value)


def test_other_differences_get_no_haystack_hint(tmp_path):
    (tmp_path / "run_config.json").write_text(json.dumps({"task": {"name": "niah_small"}, "seed": 0}))
    with pytest.raises(ConfigMismatchError) as refused:
        ResultStore(tmp_path, {"task": {"name": "niah_small"}, "seed": 1})
    assert "haystack_source" not in str(refused.value)
