"""collect -> tables -> figures on small fake results trees (made-up numbers): what the golden reports do not reach."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

pytestmark = pytest.mark.unit

from keydiff.report import against_paper as paper_compare  # noqa: E402
from keydiff.report import collect as collect_results  # noqa: E402
from keydiff.report import figures as make_figures  # noqa: E402
from keydiff.report import tables as make_tables  # noqa: E402
from keydiff.paper import registry  # noqa: E402

SUITE = registry.SUITE
LLAMA3B = "llama-3.2-3b-instruct"


def write_run(runs, experiment, task, model, label, budget_label, block, metrics, rows=(), name=None,
              complete=True, limit=None, ttft=0.5, seed=0, extra=None):
    tokens = None if (name or label) == "full" else {"1k": 1024, "2k": 2048, "4k": 4096, "6k": 6144}[budget_label]
    suffix = f"-limit{limit}" if limit is not None else ""  # as run.py names a subset run's directory
    run_dir = runs / experiment / task / model / label / budget_label / f"bs{block}" / f"seed{seed}{suffix}"
    run_dir.mkdir(parents=True)
    with open(run_dir / "predictions.jsonl", "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    summary = {
        "complete": complete, "metrics": metrics, "budget": tokens, "limit": limit,
        "block_size": None if block == "inf" else block,
        "statistics": {"samples": max(len(rows), 1), "mean_compression_ratio": 0.5, "mean_ttft_s": ttft,
                       "mean_prompt_tokens": 1000.0, "cache_bound_held": True},
        "attention_statistics": "fast",
        "config": {"experiment_name": experiment, "seed": seed, "block_size": block,
                   "task": {"name": task, "limit": limit}, "model": {"name": model, "attn_implementation": "sdpa"},
                   "policy": {"name": name or label, "label": label},
                   "budget": {"tokens": tokens, "label": budget_label}},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary | (extra or {})))


def niah_rows(recalls):
    return [{"sample_id": f"niah/{i}", "scores": {"needle_recall": r}, "ttft_s": 0.5, "compression_ratio": 0.5}
            for i, r in enumerate(recalls)]


def longbench_scores(base, **changes):
    scores = {d: base + i for i, d in enumerate(SUITE)} | changes
    return {"datasets": scores, "average": sum(scores.values()) / len(scores), "num_samples": {d: 1 for d in SUITE}}


def md_rows(path, table=0):
    """The table-th Markdown table of a file -> list of cell lists (header first)."""
    blocks = [b for b in path.read_text().split("\n\n") if b.startswith("|")]
    lines = [l for l in blocks[table].splitlines() if l.startswith("|") and not l.startswith("|---")]
    return [[c.strip() for c in l.strip("|").split("|")] for l in lines]


def value(cell: str) -> str:
    """The value of a "value [low, high] (n=...)" or "value ± half-width (n=...)" cell (bold marker kept)."""
    return cell.split(" ±")[0].split(" [")[0]


def md_cell(path, row_start, column, table=0):
    rows = md_rows(path, table)
    col = rows[0].index(column)
    matches = [r for r in rows[1:] if r[: len(row_start)] == list(row_start)]
    assert len(matches) == 1, (row_start, matches)
    return matches[0][col]


def test_a_garbled_paper_cell_is_shown_never_compared(tmp_path):
    ours = {"model": LLAMA3B, "policy": "keydiff_w10", "budget": "2k", "block_size": "", "row": "",
            "column": "dureader", "metric": "score", "value": 20.0, "n": 1, "failed": 0, "subset": False,
            "incomplete": False}
    paper_compare.write_one("table14", 14, [ours], ("table14", "table11_full"), tmp_path)
    t14 = tmp_path / "table14_vs_paper.md"
    assert md_cell(t14, (LLAMA3B, LLAMA3B, "keydiff_w10", "2k", "dureader"), "Paper") == "garbled"
    assert md_cell(t14, (LLAMA3B, LLAMA3B, "keydiff_w10", "2k", "dureader"), "Δ") == ""
    assert "1 of our cells has no paper value" in t14.read_text()


@pytest.mark.extended
def test_nothing_run_yet_still_writes_every_file(tmp_path):
    frame = collect_results.collect(tmp_path / "runs", tmp_path / "summary.csv")
    assert frame.empty
    written = make_tables.main(tmp_path / "summary.csv", tmp_path / "tables")
    assert written == []
    for name in make_tables.TABLES:
        assert "no results yet" in (tmp_path / "tables" / f"{name}.md").read_text()
    assert "python run.py experiment=table1 model=llama-3.2-3b-instruct policy=keydiff budget=2k" in \
        (tmp_path / "tables" / "table1_vs_paper.md").read_text()
    assert make_figures.main(tmp_path / "summary.csv", tmp_path / "runs", tmp_path / "figures") == []
    assert "holds no runs yet" in (tmp_path / "README.md").read_text()


def drawn_figures(monkeypatch, summary, runs, out) -> dict:
    """make_figures.main, recording each figure's titles and texts before it is saved."""
    plotted, save = {}, make_figures.save

    def keep_axes(fig, where, name):
        plotted[name + "/title"] = fig.axes[0].get_title()
        plotted[name + "/titles"] = [a.get_title() for a in fig.axes] + [fig.get_suptitle()]
        plotted[name + "/texts"] = [[t.get_text() for t in a.texts] for a in fig.axes]
        return save(fig, where, name)

    monkeypatch.setattr(make_figures, "save", keep_axes)
    make_figures.main(summary, runs, out)
    return plotted


def test_interval_arithmetic():
    from keydiff.report.render import (combined_se, format_estimate, grouped_mean_se, interval, seeds_se,
                                       standard_error)

    assert standard_error([1.0, 0.0]) == pytest.approx(0.5) and standard_error([0.7]) != standard_error([0.7])  # NaN
    assert combined_se([0.3, 0.4]) == pytest.approx(0.25)  # the mean of two independent estimates
    assert seeds_se([0.3, 0.4]) == pytest.approx(0.35) and math.isnan(seeds_se([0.3, float("nan")]))  # same samples
    mean, se = grouped_mean_se([[1.0, 0.0], [1.0, 1.0, 1.0]], scale=100)  # datasets weigh equally, as averages do
    assert (mean, se) == (pytest.approx(75.0), pytest.approx(25.0))
    assert format_estimate(0.5, 0.25, 2) == "0.500 [n too small] (n=2)"
    assert format_estimate(0.5, float("nan")) == "0.500 ± n/a"
    assert format_estimate(9.0, 0.5, 6) == "9.000 ± 0.980 (n=6)"  # unbounded (a time): mean ± 1.96 SE
    assert interval(0.5, 0.0, 6, None, measure=True) is None  # a measure that never varied
    assert format_estimate(2.0, 0.0, 6, measure=True) == "2.000 [constant] (n=6)"
    # Seeds of one configuration repeat the same samples: values averaged, n per seed (not summed), the SE the
    # mean of the seeds' SEs (a bound for correlated estimates; not sqrt(2) narrower as for independent ones).
    from keydiff.report import generic as generic_tables
    from keydiff.report import selection

    seeds = pd.DataFrame({"policy": ["kd", "kd"], "score": [0.5, 0.7], "se/score": [0.3, 0.4], "samples": [6, 6]})
    row = selection.average_seeds(seeds, ["policy"]).iloc[0]
    assert (row["score"], row["se/score"], row["samples"]) == (pytest.approx(0.6), pytest.approx(0.35), 6)
    assert generic_tables.sample_count(row) == "6"
    row = selection.average_seeds(seeds.assign(samples=[5, 6]), ["policy"]).iloc[0]
    assert generic_tables.sample_count(row) == "5–6"  # seeds that scored different numbers say so


def test_the_summary_line_names_unmatched_failed_subset_and_incomplete_cells():
    stats = {"cells": 0, "paper_cells": 4, "reference": 0, "n_min": float("nan"), "unmatched": 1, "failed_cells": 1,
             "failed": 2, "subset_cells": 2, "incomplete_cells": 1, "garbled": 0}
    assert paper_compare.summary_line("table1", stats, []).split("; ") == [
        "0 of 4 paper cells compared (same model, complete whole-task runs)", "1 of our cells has no paper value",
        "† 1 cell with failed samples (up to 2)", "§ 2 cells from subset runs (task.limit), shown but not counted",
        "~ 1 cell from runs not complete, shown but not counted."]
