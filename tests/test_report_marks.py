"""What the tables and figures say beside a score: collapsed outputs, runs that evicted nothing, runs of other
generation settings and subset runs on heatmaps."""

from __future__ import annotations

import pandas as pd
import pytest

from keydiff.report import collect as collect_results
from keydiff.report import figures as make_figures
from keydiff.report import tables as make_tables
from tests.test_tables import drawn_figures, md_cell, niah_rows, write_run

pytestmark = pytest.mark.unit

SMOL = "smollm2-135m"


def niah_point(runs, label="keydiff", budget_label="2k", experiment="adhoc", **kw):
    return dict(runs=runs, experiment=experiment, task="niah_small", model=SMOL, label=label,
                budget_label=budget_label, block=128, **kw)


def collected(tmp_path):
    runs = tmp_path / "runs"
    collect_results.collect(runs, tmp_path / "summary.csv")
    make_tables.main(tmp_path / "summary.csv", tmp_path / "tables")
    return tmp_path / "tables" / "generic" / "adhoc__niah_small.md"


@pytest.mark.extended
def test_collapsed_outputs_are_counted_per_run(tmp_path):
    flags = [True, True, False, False]
    rows = [row | {"degenerate": flag} for row, flag in zip(niah_rows([0.0, 0.0, 1.0, 0.0]), flags)]
    write_run(**niah_point(tmp_path / "runs"), metrics={"needle_recall": 0.25}, rows=rows)
    write_run(**niah_point(tmp_path / "runs", label="tova"), metrics={"needle_recall": 1.0}, rows=niah_rows([1.0]))
    md = collected(tmp_path)
    frame = pd.read_csv(tmp_path / "summary.csv")
    assert frame.set_index("policy")["degenerate"].to_dict()["keydiff"] == 2
    assert pd.isna(frame.set_index("policy")["degenerate"].to_dict()["tova"])  # rows without the flag: unknown
    assert md_cell(md, (SMOL, "128", "keydiff", "2k"), "collapsed", table=1) == "2/4"
    assert md_cell(md, (SMOL, "128", "tova", "2k"), "collapsed", table=1) == "--"
    assert "2 of 4 outputs collapsed into a repeated n-gram" in md.read_text().splitlines()[0]


@pytest.mark.extended
def test_a_run_that_evicted_nothing_is_marked_in_tables_and_figures(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    nothing = {"statistics": {"samples": 2, "mean_kept_ratio": 1.0, "mean_ttft_s": 0.5, "mean_prompt_tokens": 2869.0,
                              "max_prompt_tokens": 2870, "max_cache_entries": 2920, "layer_budgets": [4096] * 30,
                              "cache_bound_held": True}}
    evicted = {"statistics": {"samples": 2, "mean_kept_ratio": 0.71, "mean_ttft_s": 0.5, "mean_prompt_tokens": 2869.0,
                              "max_prompt_tokens": 2870, "max_cache_entries": 2176, "layer_budgets": [2048] * 30,
                              "cache_bound_held": True}}
    write_run(**niah_point(runs, budget_label="4k"), metrics={"needle_recall": 1.0}, rows=niah_rows([1, 1]),
              extra=nothing)
    write_run(**niah_point(runs), metrics={"needle_recall": 0.5}, rows=niah_rows([1, 0]), extra=evicted)
    md = collected(tmp_path)
    frame = pd.read_csv(tmp_path / "summary.csv").set_index("budget_label")
    assert bool(frame.loc["4k", "nothing_evicted"]) and not bool(frame.loc["2k", "nothing_evicted"])
    assert md_cell(md, (SMOL, "128", "keydiff"), "4k").endswith("∅")
    assert not md_cell(md, (SMOL, "128", "keydiff"), "2k").endswith("∅")
    assert md_cell(md, (SMOL, "128", "keydiff", "4k"), "marks", table=1) == "∅"
    assert "1 run evicted nothing (∅)" in md.read_text().splitlines()[0]
    plotted = drawn_figures(monkeypatch, tmp_path / "summary.csv", runs, tmp_path / "figures")
    name = f"adhoc__niah_small__{SMOL}__bs128"
    assert plotted[name + "/texts"][0] == ["∅"] and "nothing evicted" in plotted[name + "/title"]


@pytest.mark.extended
def test_runs_of_other_generation_settings_are_told_apart_and_keep_their_policys_colour(tmp_path):
    """Each setting its own row (never averaged as seeds); its line in its policy's colour, told apart by marker."""
    runs = tmp_path / "runs"
    for label, new_tokens, seed, recall in [("keydiff", 50, 0, 1.0), ("keydiff", 20, 1, 0.0), ("h2o", 50, 0, 0.0)]:
        write_run(**niah_point(runs, label=label), metrics={"needle_recall": recall}, rows=niah_rows([recall]),
                  seed=seed,  # seed: two directories of one configuration
                  extra={"config": {"experiment_name": "adhoc", "seed": seed, "block_size": 128,
                                    "task": {"name": "niah_small", "limit": None, "max_new_tokens": new_tokens},
                                    "model": {"name": SMOL}, "policy": {"name": label, "label": label},
                                    "budget": {"tokens": 2048, "label": "2k"}}})
    md = collected(tmp_path)
    assert md_cell(md, (SMOL, "128", "keydiff [max_new_tokens=20]"), "2k").startswith("0.000")
    assert md_cell(md, (SMOL, "128", "keydiff [max_new_tokens=50]"), "2k").startswith("1.000")
    assert "generation settings differ (task.max_new_tokens 20, 50" in md.read_text().splitlines()[0]
    first, second = (make_figures.style(f"keydiff [max_new_tokens={n}]") for n in (20, 50))
    assert first["color"] == second["color"] == make_figures.policy_color("keydiff")
    assert (first["marker"], first["linestyle"]) != (second["marker"], second["linestyle"])


@pytest.mark.extended
def test_a_subset_run_is_drawn_on_the_heatmap_of_any_experiment(tmp_path, monkeypatch):
    """The adhoc heatmap shows a subset run (marked §) where its configuration has no whole-task run."""
    runs = tmp_path / "runs"
    cells = {"3000": {"0": 1.0, "50": 0.5}}
    write_run(**niah_point(runs), metrics={"needle_recall": 0.75, "needle_recall_by_cell": cells},
              rows=niah_rows([1, 0.5]))
    write_run(**niah_point(runs, label="h2o"), rows=niah_rows([0.0]), limit=1,
              metrics={"needle_recall": 0.0, "needle_recall_by_cell": {"3000": {"0": 0.0}}})
    collect_results.collect(runs, tmp_path / "summary.csv")
    plotted = drawn_figures(monkeypatch, tmp_path / "summary.csv", runs, tmp_path / "figures")
    titles = plotted[f"niah_small_adhoc_{SMOL}_2k_bs128/titles"]
    assert any(t.startswith("H2O §") for t in titles) and any(t.startswith("KeyDiff (") for t in titles)
    assert "§ subset run (task.limit)" in titles[-1]
