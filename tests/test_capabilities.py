"""A policy's needs (keydiff.policies.base.Needs) declared right, and keydiff/policies/capabilities.json, the presets'
needs for torch-free readers: fresh, and computed on demand for a preset it lacks."""

from __future__ import annotations

import json

import pytest

from keydiff.policies import Needs, Policy
from keydiff.policies import capabilities

pytestmark = pytest.mark.unit


@pytest.mark.extended  # seconds: composes every preset / runs a whole benchmark; make test runs it
def test_every_row_of_capabilities_json_is_fresh():
    """After a policy's needs change: `python -m keydiff.policies.capabilities --write`."""
    text = capabilities.PATH.read_text(encoding="utf-8")
    assert capabilities.render(capabilities.capabilities(list(json.loads(text)))) == text


@pytest.fixture
def a_file_lacking(tmp_path, monkeypatch):
    """capabilities.json less some rows, as both torch-free readers read it."""
    from keydiff.report import gpu_hours
    from keydiff.run import checks

    def lacking(*presets: str) -> dict:
        table = json.loads(capabilities.PATH.read_text(encoding="utf-8"))
        path = tmp_path / "capabilities.json"
        path.write_text(json.dumps({p: row for p, row in table.items() if p not in presets}), encoding="utf-8")
        for module in (gpu_hours, checks):
            monkeypatch.setattr(module, "CAPABILITIES", path)
        for cached in (gpu_hours.file_needs, gpu_hours.preset_needs, checks.batch_invariant_policies):
            cached.cache_clear()
        return table

    yield lacking
    monkeypatch.undo()
    for cached in (gpu_hours.file_needs, gpu_hours.preset_needs, checks.batch_invariant_policies):
        cached.cache_clear()


def test_a_preset_the_file_lacks_is_computed_on_demand(a_file_lacking):
    from keydiff.report.gpu_hours import pooled, preset_needs
    from keydiff.run.checks import batch_invariant_policies

    table = a_file_lacking("knorm", "tova")
    assert {preset: preset_needs(preset) for preset in table} == table and pooled("knorm") and not pooled("tova")
    assert {"knorm", "tova"} <= set(batch_invariant_policies())


@pytest.mark.parametrize("legacy, field", [
    ("layers_batchable", "rows_alike"), ("attention_rows", "attention_rows"), ("state_names", "state"),
    ("capturable", "host_reads=False"), ("observes_every_step", "every_pass")])
def test_a_capability_stated_the_old_way_is_refused_in_one_line(legacy, field):
    """A custom policy written before `needs` would otherwise run with its flags silently ignored."""
    with pytest.raises(TypeError) as error:
        type("OldStyle", (Policy,), {legacy: True, "__qualname__": "OldStyle"})
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"OldStyle.{legacy}: ")
    assert "declare needs = Needs(...)" in message and f"is Needs.{field})" in message
    assert "valid fields: attention_rows, attention_reduction, every_pass," in message


def test_needs_must_be_a_needs_and_its_values_valid():
    with pytest.raises(TypeError, match="Bad.needs must be a keydiff.policies.Needs"):
        type("Bad", (Policy,), {"needs": {"rows_alike": True}, "__qualname__": "Bad"})
    with pytest.raises(ValueError, match="attention_reduction 'mean' is not valid; valid: sum, max"):
        Needs(attention_reduction="mean")
    with pytest.raises(ValueError, match="attention_rows must be None"):
        Needs(attention_rows=-1)
    assert Needs(state=["a"]).state == ("a",)  # a list is kept as a tuple: Needs stays hashable

