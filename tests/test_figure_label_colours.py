"""A policy keeps its colour in every figure even where its label carries a setting: where a figure mixes runs of
different task.max_new_tokens, each line is labelled "keydiff [max_new_tokens=20]" (keydiff.report.generic), and
that line is still KeyDiff's colour and name; the two settings of one policy differ by marker and dash."""

from __future__ import annotations

import pytest

from keydiff.report import collect as collect_results
from keydiff.report import figures as make_figures
from tests.test_report_marks import SMOL, niah_point
from tests.test_tables import drawn_figures, niah_rows, write_run

pytestmark = pytest.mark.unit


def test_a_policy_labelled_with_its_generation_setting_keeps_its_colour(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    for label, new_tokens, seed in [("keydiff", 20, 0), ("keydiff", 50, 1), ("h2o", 50, 0)]:
        write_run(**niah_point(runs, label=label), metrics={"needle_recall": 0.5}, rows=niah_rows([1.0, 0.0]),
                  seed=seed,
                  extra={"config": {"experiment_name": "adhoc", "seed": seed, "block_size": 128,
                                    "task": {"name": "niah_small", "limit": None, "max_new_tokens": new_tokens},
                                    "model": {"name": SMOL}, "policy": {"name": label, "label": label},
                                    "budget": {"tokens": 2048, "label": "2k"}}})
    collect_results.collect(runs, tmp_path / "summary.csv")
    plotted = drawn_figures(monkeypatch, tmp_path / "summary.csv", runs, tmp_path / "figures")
    lines = {c.get_label(): c.lines[0] for _, c in plotted[f"adhoc__niah_small__{SMOL}__bs128/containers"]}
    keydiff = [line for label, line in lines.items() if "max_new_tokens" in label and "h2o" not in label.lower()]
    h2o = [line for label, line in lines.items() if "h2o" in label.lower()]
    assert len(keydiff) == 2 and len(h2o) == 1, list(lines)
    assert {line.get_color() for line in keydiff} == {make_figures.policy_color("keydiff")}
    assert h2o[0].get_color() == make_figures.policy_color("h2o")
    first, second = keydiff
    assert first.get_marker() != second.get_marker() or first.get_linestyle() != second.get_linestyle()
    # and its printed name, as in every other figure
    legend = plotted[f"adhoc__niah_small__{SMOL}__bs128"]
    assert sum(t.startswith("KeyDiff [max_new_tokens=") for t in legend) == 2, legend
    assert sum(t.startswith("H2O [max_new_tokens=50]") for t in legend) == 1, legend
