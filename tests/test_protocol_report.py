"""The protocol comparison's table and figure (keydiff.report.protocol, figures.protocol) on synthetic summary rows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from keydiff.paper import registry
from keydiff.report import figures, protocol

pytestmark = pytest.mark.unit

TABLE = registry.TABLES["protocol"]
COLUMNS = ["question in prompt", "query-agnostic", "multi-request k=2", "multi-request k=8", "multi-turn k=2",
           "multi-turn k=8"]


def run(policy, budget, k, mode, query_aware, score, se=0.05, samples=40, experiment="protocol", limit=np.nan,
        complete=True):
    full = policy == "full"
    return {"experiment": experiment, "task": f"shared_ruler_4k-k{k}-{mode}", "model": "m", "policy": policy,
            "policy_name": policy, "budget_label": "unbounded" if full else budget, "block_size": "128", "seed": 0,
            "limit": limit, "complete": complete, "samples": samples, "num_failed": 0, "score": score, "se/score": se,
            "query_aware": query_aware, "decode_eviction": True}


GRID = [(1, "independent", True), (1, "independent", False), (2, "multi_request", False), (8, "multi_request", False),
        (2, "multi_turn", False), (8, "multi_turn", False)]


@pytest.fixture
def summary():
    rows = []
    for policy, base in (("keydiff", 0.6), ("snapkv", 0.7)):
        for budget, shift in (("1k", 0.0), ("512", -0.2)):
            for i, (k, mode, aware) in enumerate(reversed(GRID)):  # written out of column order
                drop = 0.05 * (len(GRID) - 1 - i) * (2 if policy == "snapkv" else 1)
                rows.append(run(policy, budget, k, mode, aware, round(base + shift - drop, 4),
                                experiment="protocol" if k == 1 else "protocol_shared"))
    rows += [run("full", None, k, mode, aware, 0.9, experiment="protocol_full" if k == 1 else "protocol_shared_full")
             for k, mode, aware in GRID]
    rows += [run("keydiff", "1k", 4, "multi_turn", False, 0.5, samples=2, limit=1.0, experiment="protocol_shared"),
             run("keydiff", "1k", 1, "independent", False, 0.1, experiment="leaderboard"),  # another experiment
             {**run("keydiff", "1k", 1, "independent", False, 0.1), "task": "ruler_4k"}]    # another task
    return pd.DataFrame(rows)


@pytest.mark.extended
def test_table_orders_the_protocol_columns_puts_full_first_and_shows_intervals(summary, tmp_path):
    assert protocol.write(summary, tmp_path, TABLE)
    scores, text = protocol.layout(protocol.runs(summary, TABLE))
    assert list(scores.columns) == COLUMNS[:4] + ["multi-turn k=2", "multi-turn k=4", "multi-turn k=8"]
    assert list(scores.index) == [("m", "Full", "--"), ("m", "KeyDiff", "512"), ("m", "KeyDiff", "1K"),
                                  ("m", "SnapKV", "512"), ("m", "SnapKV", "1K")]
    assert scores.loc[("m", "Full", "--")].dropna().tolist() == [90.0] * 6  # each column's own full run
    assert scores.loc[("m", "KeyDiff", "1K"), COLUMNS].tolist() == pytest.approx([60.0, 55.0, 50.0, 45.0, 40.0, 35.0])
    assert scores.loc[("m", "SnapKV", "1K"), COLUMNS].tolist() == pytest.approx([70.0, 60.0, 50.0, 40.0, 30.0, 20.0])
    cell = text.loc[("m", "KeyDiff", "1K"), "question in prompt"]
    assert cell.startswith("60.0 [") and cell.endswith("] (n=40)")
    low, high = (float(v) for v in cell.split("[")[1].split("]")[0].split(", "))
    assert 0 <= low < 60 < high <= 100  # the Wilson interval at n_eff from the SE, around the score
    assert text.loc[("m", "KeyDiff", "1K"), "multi-turn k=4"] == "50.0 [n too small] (n=2)§"  # a subset run, marked
    md = (tmp_path / "protocol.md").read_text()
    assert "**70.0 [" in md and "**90.0" not in md  # best method per column and budget; the full cache never bold
    assert "query-agnostic" in md and "multi-turn k" in md
    csv = pd.read_csv(tmp_path / "protocol.csv")
    assert len(csv) == 6 + 2 * 2 * 6 + 1 and set(csv["mode"]) == {"independent", "multi_request", "multi_turn"}
    scored = csv[csv["samples"] >= 5]
    assert ((scored["ci95_low"] <= scored["score"]) & (scored["score"] <= scored["ci95_high"])).all()
    assert csv.loc[csv["samples"] < 5, "ci95_low"].isna().all()


def test_columns_name_every_mode_and_k():
    assert protocol.column_of("shared_ruler_4k-k1-independent", True)[2] == "question in prompt"
    assert protocol.column_of("shared_ruler_4k-k4-independent", False)[2] == "query-agnostic k=4"
    assert protocol.column_of("shared_ruler_8k-k8-multi_turn", False)[2] == "multi-turn k=8"
    assert protocol.column_of("ruler_4k", False) is None


@pytest.mark.extended
def test_figure_one_panel_per_budget_one_line_per_method_full_dashed(summary, tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.append((fig, name)) or [out / f"{name}.png"])
    assert figures.protocol(summary, tmp_path) == [tmp_path / "protocol.png"]
    fig, name = drawn[0]
    assert name == "protocol" and len(fig.axes) == 2
    ax = fig.axes[1]  # N = 1K
    assert "N=1K" in ax.get_title()
    bars = {c.get_label(): c for c in ax.containers}
    assert sorted(bars) == ["KeyDiff", "SnapKV"]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == COLUMNS[:4] + ["multi-turn k=2", "multi-turn k=4", "multi-turn k=8"]
    x, y = (np.asarray(v, dtype=float) for v in bars["SnapKV"].lines[0].get_data())
    assert list(x) == [0, 1, 2, 3, 4, 6] and list(y) == pytest.approx([70.0, 60.0, 50.0, 40.0, 30.0, 20.0])
    segments = bars["SnapKV"].lines[2][0].get_segments()
    assert all(0 <= s[0][1] <= v <= s[1][1] <= 100 for s, v in zip(segments, y))
    full = [line for line in ax.get_lines() if line.get_label() == "Full"]
    assert len(full) == 1 and list(full[0].get_ydata()) == [90.0] * 6
