"""keydiff.run.runner in this process: config checks before the model loads, the real model end to end."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from keydiff.run import runner
from keydiff.run.plan import plan_run

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# runs go where each test says; results_root is only checked for writability and names W&B runs: never created
OUTSIDE_RESULTS = f"results_root={Path(tempfile.gettempdir()) / 'keydiff-tests' / 'runs'}"


def make_cfg(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[OUTSIDE_RESULTS, *overrides])


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(runner, "load_model", fail)


@pytest.mark.extended
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["block_size=0"], "block_size must be a positive integer"),
        (["policy=keydiff_window20", "policy.params.window_fraction=1.0"], r"window_fraction must be in \[0, 1\)"),
        (["policy=sink", "budget.tokens=4"], "sink count .4. must be smaller than the budget"),
        (["policy=snapkv", "budget.tokens=16"], "smaller than the budget"),
        (["+policy.params.bogus=1"], "valid: anchor, metric, window_fraction"),
        (["model.dtype=float8"], "model.dtype"),
        (["task.depths=[150]"], "depths"),
        (["task=niah"], r"exceed the model's max_length \(8192\)"),
    ],
)
def test_bad_values_fail_before_the_model_loads(tmp_path, no_model_load, overrides, message):
    with pytest.raises(ValueError, match=message):
        runner.run(make_cfg(*overrides), tmp_path / "run")


@pytest.mark.extended
def test_block_size_inf_is_accepted(no_model_load):
    assert plan_run(make_cfg("block_size=inf")).block_size is None


def niah_cfg(*extra: str):
    return make_cfg("task=niah_small", "task.context_lengths=[700,900]", "task.depths=[50]", *extra)


@pytest.mark.real_model
def test_full_policy_retrieves_the_needle_end_to_end(tmp_path):
    summary = runner.run(niah_cfg("policy=full", "task.limit=1"), tmp_path / "full")
    rows = [json.loads(line) for line in (tmp_path / "full" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["scores"]["needle_recall"] == 1.0, rows[0]["prediction"]
    assert summary["complete"] is True  # complete with respect to the configured limit
    assert summary["statistics"]["mean_kept_ratio"] == 1.0
    assert summary["model"] and summary["data"]  # provenance: model source/hash and haystack sha256


@pytest.mark.extended
def test_budget_label_follows_the_tokens():
    assert make_cfg("budget=6k").budget.label == "6k"
    cfg = make_cfg("budget=2k", "budget.tokens=3000")
    assert cfg.budget.label == "3000" and "/3000/bs128/" in cfg.run_subdir


# One value each rule of keydiff.run.checks.VALUES refuses, in the table's order.
REFUSED_VALUES = ["block_size=abc", "attention_statistics=weights", "seed=1.5", "decode_eviction=1",
                  "query_aware=maybe", "batch_invariant=null", "overwrite=yes", "retry_failed=0", "dry_run=maybe",
                  "threads=0", "max_prompt_tokens=-1", "batch_size=2.0", "lock_wait=-1", "task.limit=0",
                  "budget.tokens=0", "budget=r0.25 budget.ratio=2"]


def test_every_value_rule_is_exercised():
    from keydiff.run.checks import VALUES

    assert [override.split()[-1].split("=")[0] for override in REFUSED_VALUES] == list(VALUES)


@pytest.mark.parametrize("override", REFUSED_VALUES)
def test_a_refused_value_is_one_line_naming_the_valid_values(override):
    from keydiff.run.checks import ConfigError, check_run_config

    with pytest.raises(ConfigError) as error:
        check_run_config(make_cfg(*override.split()))
    line = str(error.value)
    assert "\n" not in line and line.startswith(override.split()[-1].split("=")[0]), line
    assert "valid: " in line or " must be " in line, line  # what is valid


@pytest.mark.extended
def test_sequential_runs_reuse_the_loaded_model(monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "load_model", lambda cfg: calls.append(cfg) or ("model", "tokenizer"))
    monkeypatch.setattr(runner, "_LOADED", {})
    plan = plan_run(make_cfg())
    assert runner.load_model_once(plan.model_cfg) == ("model", "tokenizer")
    runner.load_model_once(plan_run(make_cfg("policy=tova")).model_cfg)
    assert len(calls) == 1
    runner.load_model_once(plan_run(make_cfg("model.dtype=bfloat16")).model_cfg)
    assert len(calls) == 2


def test_the_statistics_log_line_summarises_per_layer_lists():
    import run

    statistics = {"samples": 6, "cache_bound": 2176, "layer_budgets": [2048] * 30,
                  "layer_max_cache_entries": [2176] * 29 + [2100], "layer_cache_bounds": [None] * 2 + [2176] * 28,
                  "short": [1, 2]}
    assert run.summarize_lists(statistics) == {
        "samples": 6, "cache_bound": 2176, "layer_budgets": "2048 x30",
        "layer_max_cache_entries": "2100..2176 over 30 layers",
        "layer_cache_bounds": "2176..2176 over 30 layers (2 unbounded)", "short": [1, 2]}


@pytest.mark.integration
@pytest.mark.extended
@pytest.mark.parametrize("sweep", [False, True])
def test_run_py_checks_the_config_once_and_takes_the_lock_once_per_run(tmp_path, monkeypatch, sweep):
    """Hydra on a tiny checkpoint: one config check per run (a sweep: all before the first job), one lock per run."""
    import runpy

    from hydra_plugins.keydiff_sweeper import keydiff_sweeper
    from keydiff.run import checks
    from keydiff.run.lock import RunLock
    from tests.conftest import char_tokenizer, tiny_llama

    model_dir = tmp_path / "tiny-checkpoint"
    tiny_llama("sdpa").save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    events = []
    real_check, real_acquire = checks.check_run_config, RunLock.acquire

    def check(cfg, **kwargs):
        events.append(("check", str(cfg.policy.label)))
        real_check(cfg, **kwargs)

    def acquire(lock):
        events.append(("lock", lock.path.parent.parts[-4]))  # .../<policy label>/<budget>/bs<B>/seed<s>
        real_acquire(lock)

    for module in (checks, runner, keydiff_sweeper):
        monkeypatch.setattr(module, "check_run_config", check)
    monkeypatch.setattr(RunLock, "acquire", acquire)
    monkeypatch.setattr(runner, "_LOADED", {})
    arguments = ["model=custom", f"model.path={model_dir}", "model.dtype=float32", "model.device=cpu",
                 "model.max_length=4096", "task=niah_small", "task.context_lengths=[300]", "task.depths=[50]",
                 f"results_root={tmp_path / 'runs'}", "hydra/hydra_logging=none", "hydra/job_logging=none"]
    monkeypatch.setattr(sys, "argv", ["run.py", *(["-m", "policy=keydiff,tova"] if sweep else []), *arguments])
    runpy.run_path(str(ROOT / "run.py"), run_name="__main__")  # as `python run.py ...`, in this process
    if sweep:
        assert events == [("check", "keydiff"), ("check", "tova"), ("lock", "keydiff"), ("lock", "tova")]
    else:
        assert events == [("check", "keydiff"), ("lock", "keydiff")]
    assert len(list((tmp_path / "runs").rglob("summary.json"))) == (2 if sweep else 1)
