"""What the tables and figures say beside a score: collapsed outputs, runs that evicted nothing, runs of other
generation settings, one colour per policy, subset runs on heatmaps, and run directories written under the old
field names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from keydiff.report import collect as collect_results
from keydiff.report import figures as make_figures
from keydiff.report import tables as make_tables
from keydiff.run.results import RENAMED_ROW_FIELDS, RENAMED_STATISTICS
from keydiff.tasks.degenerate import is_degenerate
from tests.test_tables import drawn_figures, md_cell, md_rows, niah_rows, write_run

pytestmark = pytest.mark.unit

GOLDEN_RUNS = Path(__file__).resolve().parent / "golden" / "runs"
SMOL = "smollm2-135m"


@pytest.mark.parametrize("tokens, expected", [
    ([464] * 50, True),                                  # TheTheThe...: one token, the whole output
    ([1, 2] * 10, True),                                 # a bigram repeated
    ([5, 6, 7, 8] * 3 + list(range(100, 112)), True),    # a 4-gram 3 times: 12 of 24 tokens, exactly half
    ([5, 6, 7, 8] * 3 + list(range(100, 113)), False),   # 12 of 25: under half
    ([5, 6, 7, 8, 9] * 6, False),                        # a 5-gram: longer than MAX_N
    ([1, 2] + [3] * 2 + list(range(10, 20)), False),     # short repeats, most of it varied
    ([7] * 7, False),                                    # shorter than MIN_TOKENS
    ([1, 2, 1, 3, 1, 4, 1, 5, 1, 6], False),             # a frequent token, never back to back
])
def test_degenerate_outputs_are_a_repeated_ngram_over_half_the_tokens(tokens, expected):
    assert is_degenerate(tokens) is expected


def test_a_real_answer_and_a_collapse_tokenized(builtin_tokenizer):
    tokenizer = builtin_tokenizer
    answer = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    assert not is_degenerate(tokenizer(answer)["input_ids"])
    assert is_degenerate(tokenizer("The" * 50)["input_ids"])  # what h2o at 1k generates on the default task


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
    rows = [row | {"degenerate": flag} for row, flag in zip(niah_rows([0.0, 0.0, 1.0, 0.0]), [True, True, False, False])]
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
    write_run(**niah_point(runs, budget_label="4k"), metrics={"needle_recall": 1.0}, rows=niah_rows([1, 1]), extra=nothing)
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
def test_runs_of_other_generation_settings_are_told_apart_and_keep_their_policys_colour(tmp_path, monkeypatch):
    """Each setting its own row and line (never averaged as seeds), in its policy's colour, told apart by marker."""
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
    plotted = drawn_figures(monkeypatch, tmp_path / "summary.csv", runs, tmp_path / "figures")
    legend = plotted[f"adhoc__niah_small__{SMOL}__bs128"]
    assert sum(t.startswith("KeyDiff [max_new_tokens=20]") for t in legend) == 1, legend
    assert sum(t.startswith("KeyDiff [max_new_tokens=50]") for t in legend) == 1, legend
    assert sum(t.startswith("H2O [max_new_tokens=50]") for t in legend) == 1, legend
    lines = {c.get_label(): c.lines[0] for _, c in plotted[f"adhoc__niah_small__{SMOL}__bs128/containers"]}
    keydiff = [line for label, line in lines.items() if "max_new_tokens" in label and "h2o" not in label.lower()]
    h2o = [line for label, line in lines.items() if "h2o" in label.lower()]
    assert len(keydiff) == 2 and len(h2o) == 1, list(lines)
    assert {line.get_color() for line in keydiff} == {make_figures.policy_color("keydiff")}
    assert h2o[0].get_color() == make_figures.policy_color("h2o")
    first, second = keydiff
    assert first.get_marker() != second.get_marker() or first.get_linestyle() != second.get_linestyle()


@pytest.mark.extended
def test_each_policy_keeps_its_colour_whatever_else_is_drawn(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    for label in ("keydiff", "tova"):
        write_run(**niah_point(runs, label=label, experiment="smoke"), metrics={"needle_recall": 1.0}, rows=niah_rows([1.0]))
    for label in ("h2o", "keydiff", "snapkv"):  # keydiff is not the first policy here
        write_run(**niah_point(runs, label=label), metrics={"needle_recall": 0.5}, rows=niah_rows([1.0, 0.0]))
    collect_results.collect(runs, tmp_path / "summary.csv")
    plotted = drawn_figures(monkeypatch, tmp_path / "summary.csv", runs, tmp_path / "figures")

    def colours(name):
        return {c.get_label().split(" ")[0]: c.lines[0].get_color() for _, c in plotted[name + "/containers"]}

    smoke, adhoc = colours(f"smoke__niah_small__{SMOL}__bs128"), colours(f"adhoc__niah_small__{SMOL}__bs128")
    assert smoke["KeyDiff"] == adhoc["KeyDiff"] == make_figures.policy_color("keydiff")
    assert len(set(adhoc.values())) == 3  # three policies, three colours
    assert make_figures.policy_color("my_policy") == make_figures.policy_color("my_policy")  # any label: stable


@pytest.mark.extended
def test_a_subset_run_is_drawn_on_the_heatmap_of_any_experiment(tmp_path, monkeypatch):
    """The adhoc heatmap shows a subset run (marked §) where its configuration has no whole-task run."""
    runs = tmp_path / "runs"
    cells = {"3000": {"0": 1.0, "50": 0.5}}
    write_run(**niah_point(runs), metrics={"needle_recall": 0.75, "needle_recall_by_cell": cells}, rows=niah_rows([1, 0.5]))
    write_run(**niah_point(runs, label="h2o"), metrics={"needle_recall": 0.0, "needle_recall_by_cell": {"3000": {"0": 0.0}}},
              rows=niah_rows([0.0]), limit=1)
    collect_results.collect(runs, tmp_path / "summary.csv")
    plotted = drawn_figures(monkeypatch, tmp_path / "summary.csv", runs, tmp_path / "figures")
    titles = plotted[f"niah_small_adhoc_{SMOL}_2k_bs128/titles"]
    assert any(t.startswith("H2O §") for t in titles) and any(t.startswith("KeyDiff (") for t in titles)
    assert "§ subset run (task.limit)" in titles[-1]


def rewrite_with_current_names(source: Path, target: Path) -> None:
    """`source`'s run directories with every renamed field under its current name (what this version writes)."""
    shutil.copytree(source, target)
    for path in target.rglob("predictions.jsonl"):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        path.write_text("".join(json.dumps({RENAMED_ROW_FIELDS.get(k, k): v for k, v in row.items()}) + "\n"
                                for row in rows), encoding="utf-8")
    for path in target.rglob("summary.json"):
        summary = json.loads(path.read_text(encoding="utf-8"))
        stats = summary.get("statistics") or {}
        summary["statistics"] = {RENAMED_STATISTICS.get(k, k): v for k, v in stats.items()}
        path.write_text(json.dumps(summary), encoding="utf-8")


@pytest.mark.extended
def test_runs_written_with_the_old_field_names_give_the_same_tables(tmp_path):
    old_names = b"".join(p.read_bytes() for p in GOLDEN_RUNS.rglob("*.json*"))
    assert b'"compression_ratio"' in old_names and b'"mean_compression_ratio"' in old_names  # the old names
    rewrite_with_current_names(GOLDEN_RUNS, tmp_path / "new")
    new_names = b"".join(p.read_bytes() for p in (tmp_path / "new").rglob("*.json*"))
    assert b'"compression_ratio"' not in new_names and b'"kept_ratio"' in new_names
    old = collect_results.collect(GOLDEN_RUNS, tmp_path / "old.csv")
    new = collect_results.collect(tmp_path / "new", tmp_path / "new.csv")
    pd.testing.assert_frame_equal(old, new)
    assert old["mean_kept_ratio"].notna().all() and old["se/mean_kept_ratio"].notna().any()
    for name in ("old", "new"):
        make_tables.main(tmp_path / f"{name}.csv", tmp_path / f"tables_{name}")
    for path in (tmp_path / "tables_old").rglob("*.md"):
        assert path.read_bytes() == (tmp_path / "tables_new" / path.relative_to(tmp_path / "tables_old")).read_bytes()


@pytest.mark.extended
def test_a_summary_csv_collected_before_the_renames_is_read_under_the_new_names(tmp_path):
    frame = collect_results.collect(GOLDEN_RUNS, tmp_path / "summary.csv")
    renamed = {"mean_kept_ratio": "mean_compression_ratio", "se/mean_kept_ratio": "se/mean_compression_ratio"}
    frame.drop(columns=["max_new_tokens", "nothing_evicted", "degenerate"]).rename(columns=renamed).to_csv(
        tmp_path / "old.csv", index=False)
    make_tables.main(tmp_path / "old.csv", tmp_path / "tables")
    rows = md_rows(tmp_path / "tables" / "generic" / "adhoc__niah_small.md", 1)
    kept = rows[0].index("kept N/L")
    assert rows[1][kept].startswith("0.622")
