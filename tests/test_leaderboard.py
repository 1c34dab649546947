"""The leaderboard table and figure (keydiff.report.leaderboard, figures.leaderboard) on synthetic summary rows, and
the qwen3-8b config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from keydiff.paper import registry
from keydiff.report import figures, leaderboard
from keydiff.report.ruler import TASKS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
RATIOS = ["r0.125", "r0.25", "r0.5", "r0.75"]


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import keydiff  # noqa: F401  resolvers
    from tests.test_runner import OUTSIDE_RESULTS

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=[OUTSIDE_RESULTS, *overrides], return_hydra_config=True)


@pytest.mark.extended
def test_qwen3_8b_config_is_the_kvpress_leaderboard_model():
    from keydiff.models import ModelConfig

    model = ModelConfig.from_dict(compose(["model=qwen3-8b"]).model)  # every key is a ModelConfig field
    assert (model.name, model.path, model.dtype, model.attn_implementation) == (
        "qwen3-8b", "Qwen/Qwen3-8B", "bfloat16", "sdpa")
    assert model.is_hub_id and not model.trust_remote_code and model.max_length <= 32768


def run(policy, budget, score, se, experiment="leaderboard", samples=5, limit=np.nan, tasks=len(TASKS), model="m",
        block="128", task="ruler_4k", complete=True, query_aware=False, decode_eviction=True):
    row = {"experiment": experiment, "task": task, "model": model, "policy": policy,
           "policy_name": "full" if policy == "full" else policy,
           "budget_label": "unbounded" if policy == "full" else budget,
           "block_size": block, "seed": 0, "limit": limit, "complete": complete, "samples": samples * tasks,
           "num_failed": 0, "score": score, "se/score": se, "query_aware": query_aware,
           "decode_eviction": decode_eviction}  # samples: rows scored over all tasks, as collect's
    row.update({f"metrics/tasks/{t}": score if i < tasks else np.nan for i, t in enumerate(TASKS)})
    row.update({f"metrics/n/{t}": samples if i < tasks else np.nan for i, t in enumerate(TASKS)})
    return row


BOUNDED = "bounded (B=128, decode eviction)"
SCORES = {"keydiff": [40.0, 55.0, 70.0, 80.0], "tova": [30.0, 60.0, 65.0, 85.0]}  # kept 0.125, 0.25, 0.5, 0.75


@pytest.fixture
def summary():
    rows = [run(p, b, s, 1.0 + i) for p, scores in SCORES.items() for i, (b, s) in
            enumerate(zip(RATIOS[::-1], scores[::-1]))]  # written in reverse ratio order
    rows = [dict(r, score=SCORES[r["policy"]][RATIOS.index(r["budget_label"])],
                 **{"se/score": 1.0 + RATIOS.index(r["budget_label"])}) for r in rows]
    rows += [run("sink", "r0.5", 50.0, 2.0, tasks=11),          # one ratio only: no average, ranked last
             run("full", None, 90.0, 0.5, experiment="leaderboard_full"),
             run("keydiff", "2k", 99.0, 0.1),                  # a token budget: not on the leaderboard
             run("keydiff", "r0.5", 1.0, 0.1, experiment="ruler"),  # another experiment
             run("snapkv", "r0.5", 45.0, 3.0, limit=1, samples=1)]  # a subset run, marked
    frame = pd.DataFrame(rows)
    frame["se/score"] = frame["se/score"].where(frame["metrics/n/vt"] > 1)  # one sample per task: no interval
    return frame


def test_leaderboard_table_waits_for_runs(tmp_path):
    other = pd.DataFrame([run("keydiff", "r0.5", 50.0, 1.0, experiment="ruler")])
    assert not leaderboard.write(other, tmp_path, registry.TABLES["leaderboard"])
    assert not (tmp_path / "leaderboard.md").exists()


@pytest.fixture
def drawn(monkeypatch):
    """The figures figures.save is given, in order."""
    saved = []
    monkeypatch.setattr(figures, "save", lambda fig, out, name: saved.append(fig) or [out / f"{name}.png"])
    return saved


@pytest.mark.extended
def test_leaderboard_figure_marks_a_full_cache_over_fewer_tasks(summary, tmp_path, drawn):
    summary = summary.copy()
    full = summary["policy"] == "full"
    for i, t in enumerate(TASKS):
        if i >= 2:
            summary.loc[full, [f"metrics/tasks/{t}", f"metrics/n/{t}"]] = np.nan
    figures.leaderboard(summary, tmp_path)
    ax = drawn[0].axes[0]
    line = next(line for line in ax.get_lines() if line.get_label().startswith("Full"))
    assert "2/13 tasks" in line.get_label() and line.get_linestyle() == ":"  # not a dashed line beside 13-task points
    assert "full cache: 2/13 tasks" in [t.get_text() for t in ax.texts]


@pytest.mark.extended
def test_leaderboard_says_which_protocol_and_marks_query_aware_rows(summary, tmp_path, drawn):
    """Protocols are separate groups and panels; a query-aware run is its own "(query-aware)" row, never averaged."""
    more = pd.DataFrame([run("keydiff", "r0.5", 20.0, 1.0, block="inf", decode_eviction=False),
                         run("snapkv", "r0.5", 33.0, 1.0, experiment="leaderboard_query_aware", query_aware=True),
                         run("snapkv", "r0.5", 11.0, 1.0)])
    frame = pd.concat([summary, more], ignore_index=True)
    table = registry.TABLES["leaderboard"]
    scores, _ = leaderboard.layout(leaderboard.runs(frame, table))
    kvpress = "kvpress's protocol (one pass, no decode eviction)"
    assert set(scores.index.get_level_values("Protocol")) == {BOUNDED, kvpress}
    assert scores.loc[("ruler_4k", "m", kvpress, "KeyDiff"), "0.5 (r=0.5)"] == 20.0
    assert scores.loc[("ruler_4k", "m", BOUNDED, "KeyDiff"), "0.5 (r=0.5)"] == 70.0
    assert scores.loc[("ruler_4k", "m", BOUNDED, "SnapKV (query-aware)"), "0.5 (r=0.5)"] == 33.0
    assert scores.loc[("ruler_4k", "m", BOUNDED, "SnapKV"), "0.5 (r=0.5)"] == 11.0
    assert leaderboard.write(frame, tmp_path, table)
    csv = pd.read_csv(tmp_path / "leaderboard.csv")
    assert set(csv["protocol"]) >= {BOUNDED, kvpress}
    figures.leaderboard(frame, tmp_path)
    titles = [ax.get_title() for ax in drawn[0].axes if ax.get_title()]
    assert any(kvpress in t for t in titles) and any(BOUNDED in t for t in titles)
