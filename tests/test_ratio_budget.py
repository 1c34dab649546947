"""Ratio budgets (`budget=r0.5`: N = ceil(0.5 x prompt tokens) per sample): bad input refused before torch, a
sample whose N the policy refuses, and generic tables and figures that order ratio runs after token runs."""

from __future__ import annotations

import json
import re

import pytest
from hydra import compose, initialize_config_dir

from keydiff.report import collect, figures, tables
from keydiff.run.checks import ConfigError, check_budget_config
from tests.test_guards import read_rows, runner_cfg, tiny_runner  # noqa: F401 (fixture)
from tests.test_inputs import ROOT
from tests.test_tables import LLAMA3B, md_cell, md_rows, value


pytestmark = pytest.mark.unit


def compose_budget(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.extended
@pytest.mark.parametrize("overrides, message", [
    (["budget=r0.25", "budget.ratio=0"], "budget.ratio=0 is not valid; valid: a number with 0 < ratio <= 1"),
    (["budget=r0.25", "budget.ratio=1.5"], "0 < ratio <= 1"),
    (["budget=r0.25", "budget.ratio=-0.2"], "0 < ratio <= 1"),
    (["budget=r0.25", "budget.ratio=half"], "budget.ratio='half' is not valid"),
    (["budget=r0.25", "budget.ratio=true"], "budget.ratio=True is not valid"),
    (["budget=r0.25", "budget.tokens=512"], "budget.tokens=512 and budget.ratio=0.25 are both set"),
    (["budget=2k", "budget.tokens=null", "+budget.ratio=0.3"], "budget.label='none' is not valid for budget.ratio=0.3"),
])
def test_bad_ratio_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_budget_config(compose_budget(*overrides).budget)


@pytest.mark.integration
@pytest.mark.extended
def test_sample_whose_n_the_policy_refuses_is_recorded_as_failed(tmp_path, tiny_runner):
    """Sink with 8 sinks cannot keep N = ceil(0.25 x 10) = 3: that sample fails as budget_too_small, the other runs."""
    runner, model_dir, _ = tiny_runner
    cfg = runner_cfg(model_dir, "policy=sink", "policy.params.sinks=8", "budget=r0.25", "block_size=8",
                     task={"lengths": [10, 100]})
    summary = runner.run(cfg, tmp_path / "run")
    rows = {row["sample_id"]: row for row in read_rows(tmp_path / "run")}
    assert rows["len10"]["status"] == "failed" and rows["len10"]["failure_reason"] == "budget_too_small"
    assert rows["len10"]["budget"] == 3 and "N=3" in rows["len10"]["error"]
    assert rows["len100"]["status"] == "ok" and rows["len100"]["budget"] == 25
    assert summary["failures"] == {"budget_too_small": 1}


def write_run(runs, experiment, task, policy, label, tokens, ratio, recalls, model="smollm2-135m"):
    """A finished run as run.py leaves it: predictions.jsonl (per-sample N) and summary.json."""
    run_dir = runs / experiment / task / model / policy / label / "bs128" / "seed0"
    run_dir.mkdir(parents=True)
    rows = [{"sample_id": f"s{i}", "scores": {"needle_recall": r, "exact": r}, "ttft_s": 0.5,
             "compression_ratio": ratio or 0.5, "budget": tokens or 10 * (i + 1)} for i, r in enumerate(recalls)]
    (run_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    score = sum(recalls) / len(recalls)
    metrics = {"needle_recall": score, "exact": score, "by_size": {"100": {"exact": score}}}
    summary = {"complete": True, "metrics": metrics, "budget": tokens,
               "budget_ratio": ratio, "limit": None, "block_size": 128, "attention_statistics": "fast",
               "statistics": {"samples": len(rows), "mean_compression_ratio": ratio or 0.5, "mean_ttft_s": 0.5,
                              "mean_prompt_tokens": 100.0, "cache_bound_held": True},
               "config": {"experiment_name": experiment, "seed": 0, "block_size": 128,
                          "task": {"name": task, "limit": None},
                          "model": {"name": model, "attn_implementation": "sdpa"},
                          "policy": {"name": policy, "label": policy},
                          "budget": {"tokens": tokens, "ratio": ratio, "label": label}}}
    (run_dir / "summary.json").write_text(json.dumps(summary))


@pytest.mark.extended
def test_generic_table_and_figure_with_ratio_runs_paper_tables_ignore_them(tmp_path):
    runs = tmp_path / "runs"
    for label, tokens, ratio, recalls in [("r0.5", None, 0.5, [1.0, 0.5]), ("2k", 2048, None, [1.0, 1.0]),
                                          ("r0.25", None, 0.25, [0.5, 0.0]), ("1k", 1024, None, [0.5, 1.0])]:
        write_run(runs, "adhoc", "niah_small", "keydiff", label, tokens, ratio, recalls)
    write_run(runs, "adhoc", "niah_small", "full", "none", None, None, [1.0, 1.0])
    write_run(runs, "table17", "phonebook", "keydiff", "6k", 6144, None, [1.0, 0.0], model=LLAMA3B)
    write_run(runs, "table17", "phonebook", "keydiff", "r0.5", None, 0.5, [0.0, 0.0], model=LLAMA3B)
    out = tmp_path / "out"
    collect.collect(runs, out / "summary.csv")
    written = tables.main(out / "summary.csv", out / "tables")
    drawn = figures.main(out / "summary.csv", runs, out / "figures")
    header, *rows = md_rows(out / "tables" / "generic" / "adhoc__niah_small.md")
    assert header[-5:] == ["--", "1k", "2k", "r0.25", "r0.5"]  # ratio columns after the token budgets, by ratio
    keydiff = next(r for r in rows if "keydiff" in r)
    assert [cell.split(" ")[0] for cell in keydiff[-4:]] == ["0.750", "1.000", "0.250", "0.750"]
    names = {p.relative_to(out / "figures").as_posix() for p in drawn}
    assert {"generic/adhoc__niah_small__smollm2-135m__bs128.png",
            "generic/adhoc__niah_small__smollm2-135m__bs128__ratio.png"} <= names
    assert "table17" in written  # the paper table is written from the 6k run; the ratio run is not in it
    assert value(md_cell(out / "tables" / "table17.md", ("KeyDiff",), "100")) in ("0.5", "**0.5")  # 6k's, not 0.0
    assert "r0.5" not in (out / "tables" / "table17.md").read_text()
