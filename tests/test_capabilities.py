"""A policy's needs (keydiff.policies.base.Needs), derived through wrappers, and keydiff/policies/capabilities.json,
the presets' needs for torch-free readers: fresh, complete for the experiments, computed on demand otherwise."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch

from keydiff.policies import LayerBudgets, LayerView, Needs, Policy, RecentWindow, build_policy
from keydiff.policies import capabilities

pytestmark = pytest.mark.unit


@pytest.mark.extended  # seconds: composes every preset / runs a whole benchmark; make test runs it
def test_every_row_of_capabilities_json_is_fresh():
    """After a policy's needs change: `python -m keydiff.policies.capabilities --write`."""
    text = capabilities.PATH.read_text(encoding="utf-8")
    assert capabilities.render(capabilities.capabilities(list(json.loads(text)))) == text


@pytest.mark.extended  # seconds: composes every preset / runs a whole benchmark; make test runs it
def test_capabilities_json_holds_every_preset_the_experiments_run():
    """Those the paper's experiments run are read from it without torch; others are computed on demand."""
    from tests.test_golden import experiment_presets

    table = json.loads(capabilities.PATH.read_text(encoding="utf-8"))
    assert {"keydiff", "snapkv", "adakv_criticalkv"} <= experiment_presets()
    assert not sorted(experiment_presets() - set(table)), "python -m keydiff.policies.capabilities --write"
    assert set(table) <= set(capabilities.preset_names())


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


@dataclass
class Alike(Policy):
    needs: ClassVar[Needs] = Needs(rows_alike=True, host_reads=False)

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.positions.float()


@dataclass
class NotAlike(Alike):
    needs: ClassVar[Needs] = replace(Alike.needs, rows_alike=False)


def test_a_subclass_replaces_its_parents_needs_and_wrappers_derive_theirs():
    assert NotAlike().needs == Needs(host_reads=False) and Alike().needs.groupable
    window = RecentWindow(Alike(), fraction=0.2)
    assert window.needs == Alike.needs  # a window is capturable when the wrapped policy is
    assert LayerBudgets(window, schedule=None).needs == replace(Alike.needs, host_reads=True)
    kvzip = LayerBudgets(build_policy("kvzip"), schedule=None)
    assert kvzip.needs.reconstruction and kvzip.needs.state == ("kvzip",) and not kvzip.needs.groupable
    rerotated = build_policy("keydiff", key_rerotation=True, critical=True)
    assert rerotated.needs.state == ("inv_norm", "wov_l1", "rotary_position") and not rerotated.needs.rows_alike
