"""Ratio budgets (issue #16, section 3): `budget=r0.5` keeps N = ceil(0.5 x prompt tokens) per sample, in its
own results directory ("r0.5"), with bad input refused before torch, and generic tables/figures that order
ratio runs after token runs."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from keydiff.config import budget_label, ratio_label
from keydiff.report import figures, generic
from keydiff.report.render import budget_ratio, budget_tokens
from keydiff.run.checks import ConfigError, check_budget_config
from tests.test_guards import hand_peak_entries, read_rows, runner_cfg, tiny_runner  # noqa: F401 (fixture)
from tests.test_inputs import ROOT, assert_one_line_error, run_py


def compose_budget(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# ------------------------------------------------------------------------------------------ labels, config
def test_ratio_labels_differ_from_token_labels():
    assert ratio_label(0.25) == "r0.25" and ratio_label(1) == "r1" and ratio_label(0.5) == "r0.5"
    assert budget_label(None, 0.25) == "r0.25" and budget_label(2048) == "2k" and budget_label(256, None) == "256"
    assert budget_ratio("r0.25") == 0.25 and budget_ratio("2k") is None and budget_ratio("--") is None


def test_ratio_config_sets_label_and_run_directory():
    cfg = compose_budget("budget=r0.25")
    assert cfg.budget.tokens is None and cfg.budget.ratio == 0.25 and cfg.budget.label == "r0.25"
    assert "/r0.25/bs128/" in cfg.run_subdir
    cfg = compose_budget("budget=r0.25", "budget.ratio=0.3")  # an override relabels: never r0.25's directory
    assert cfg.budget.label == "r0.3"
    check_budget_config(compose_budget("budget=r0.25", "budget.ratio=1").budget)
    assert compose_budget("budget=2k").budget.get("ratio") is None  # token budgets are unchanged


@pytest.mark.parametrize("overrides, message", [
    (["budget.ratio=0"], "budget.ratio=0 is not valid"),
    (["budget.ratio=1.5"], "0 < ratio <= 1"),
    (["budget.ratio=-0.2"], "0 < ratio <= 1"),
    (["budget.ratio=half"], "budget.ratio='half' is not valid"),
    (["budget.ratio=true"], "budget.ratio=True is not valid"),
    (["budget.tokens=512"], "are both set"),
])
def test_bad_ratio_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_budget_config(compose_budget("budget=r0.25", *overrides).budget)


@pytest.mark.parametrize("args, expected", [
    (["budget=r0.25", "budget.ratio=0"], "budget.ratio=0 is not valid; valid: a number with 0 < ratio <= 1"),
    (["budget=r0.25", "budget.ratio=2"], "budget.ratio=2 is not valid"),
    (["budget=r0.25", "budget.ratio=abc"], "budget.ratio='abc' is not valid"),
    (["budget=r0.25", "budget.tokens=100"], "budget.tokens=100 and budget.ratio=0.25 are both set"),
])
def test_bad_ratio_on_the_command_line(tmp_path, args, expected):
    result, _ = run_py(tmp_path, *args)
    line = assert_one_line_error(result, tmp_path)
    assert expected in line, line
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------ runner
def test_runner_sets_budget_per_sample_and_holds_bound(tmp_path, tiny_runner):
    """Prompts of 30 and 100 tokens at ratio 0.5: N = 15 and 50, recorded per row, cache within N + B."""
    runner, model_dir, _ = tiny_runner
    block, new_tokens = 16, 4
    cfg = runner_cfg(model_dir, "policy=keydiff", "budget=r0.5", f"block_size={block}")
    summary = runner.run(cfg, tmp_path / "run")
    rows = {row["sample_id"]: row for row in read_rows(tmp_path / "run")}
    for length, budget in ((30, 15), (100, 50)):
        row = rows[f"len{length}"]
        assert row["status"] == "ok" and row["budget"] == budget
        assert row["kept_tokens"] == budget
        assert row["compression_ratio"] == pytest.approx(budget / length)
        assert row["max_cache_entries"] == hand_peak_entries(length, budget, block, new_tokens - 1)
        assert row["max_cache_entries"] <= budget + block
        assert set(row["layer_budgets"]) == {budget}
    stats = summary["statistics"]
    assert stats["cache_bound"] == 50 + block and stats["cache_bound_held"] is True
    assert summary["budget"] is None and summary["budget_ratio"] == 0.5


def test_runner_odd_lengths_round_up(tmp_path, tiny_runner):
    runner, model_dir, _ = tiny_runner
    cfg = runner_cfg(model_dir, "policy=tova", "budget=r0.25", "block_size=8", task={"lengths": [31, 9]})
    runner.run(cfg, tmp_path / "run")
    rows = {row["sample_id"]: row for row in read_rows(tmp_path / "run")}
    assert rows["len31"]["budget"] == math.ceil(0.25 * 31) == 8
    assert rows["len9"]["budget"] == 3


def test_sample_whose_n_the_policy_refuses_is_recorded_as_failed(tmp_path, tiny_runner):
    """StreamingLLM with 8 sink tokens cannot keep N = 3 (a 10-token prompt at 0.25): that sample fails
    clearly ("budget_too_small"), the long one runs."""
    runner, model_dir, _ = tiny_runner
    cfg = runner_cfg(model_dir, "policy=sink", "policy.params.sinks=8", "budget=r0.25", "block_size=8",
                     task={"lengths": [10, 100]})
    summary = runner.run(cfg, tmp_path / "run")
    rows = {row["sample_id"]: row for row in read_rows(tmp_path / "run")}
    assert rows["len10"]["status"] == "failed" and rows["len10"]["failure_reason"] == "budget_too_small"
    assert rows["len10"]["budget"] == 3 and "N=3" in rows["len10"]["error"]
    assert rows["len100"]["status"] == "ok" and rows["len100"]["budget"] == 25
    assert summary["failures"] == {"budget_too_small": 1}


# ------------------------------------------------------------------------------------------ reports
def test_budget_order_puts_ratios_after_tokens():
    labels = ["r0.5", "2k", "--", "unbounded", "r0.25", "512", "r1"]
    assert sorted(labels, key=budget_tokens) == ["--", "512", "2k", "r0.25", "r0.5", "r1", "unbounded"]
