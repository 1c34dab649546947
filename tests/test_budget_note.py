"""run.py's line for a budget that evicted nothing (`budget=8k` on the default task: every prompt fits), on real
runs of a tiny checkpoint, and its absence wherever something was evicted."""

from __future__ import annotations

import logging
import runpy
import sys
from pathlib import Path

import pytest

import run
from keydiff.run import runner
from tests.conftest import char_tokenizer, tiny_llama
from tests.test_runner import make_cfg

pytestmark = [pytest.mark.integration, pytest.mark.extended]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-checkpoint")
    tiny_llama("sdpa").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def arguments(checkpoint: Path, root: Path, *more: str) -> list[str]:
    return ["model=custom", f"model.path={checkpoint}", "model.dtype=float32", "model.device=cpu",
            "model.max_length=4096", "task=niah_small", "task.context_lengths=[300]", "task.depths=[0,100]",
            f"results_root={root}", *more]


def summary_of(checkpoint: Path, tmp_path: Path, *more: str) -> dict:
    cfg = make_cfg(*arguments(checkpoint, tmp_path / "runs", *more))
    return runner.run(cfg, tmp_path / "run")


def test_a_budget_above_every_prompt_says_nothing_was_evicted(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "_LOADED", {})
    summary = summary_of(checkpoint, tmp_path, "budget.tokens=4096")
    longest = summary["statistics"]["max_prompt_tokens"]
    assert 300 <= longest < 4096 and summary["statistics"]["mean_kept_ratio"] == 1.0
    assert run.budget_note(summary) == (
        f"budget.tokens=4096 >= every prompt (longest {longest:,} tokens): nothing was evicted "
        "(every prompt kept whole), so this run scores as the full cache; a smaller budget or longer prompts compare "
        "policies")
    assert summary["nothing_evicted"] is True  # what the report marks


@pytest.mark.parametrize("more", [("budget.tokens=128",), ("policy=full",)])
def test_no_line_where_something_was_evicted_or_no_budget_applies(checkpoint, tmp_path, monkeypatch, more):
    monkeypatch.setattr(runner, "_LOADED", {})
    summary = summary_of(checkpoint, tmp_path, *more)
    assert run.budget_note(summary) is None
    assert summary["nothing_evicted"] is (None if more == ("policy=full",) else False)


def test_decoding_past_the_budget_is_eviction(checkpoint, tmp_path, monkeypatch):
    """Every prompt fits, but the answer pushes the cache over N while decoding evicts: something was evicted."""
    monkeypatch.setattr(runner, "_LOADED", {})
    summary = summary_of(checkpoint, tmp_path, "budget.tokens=352", "task.max_new_tokens=64")
    statistics = summary["statistics"]
    assert statistics["max_prompt_tokens"] <= 352 < statistics["max_cache_entries"]
    assert statistics["mean_kept_ratio"] == 1.0 and run.budget_note(summary) is None
    # without eviction while decoding, the same budget never evicted anything
    assert run.budget_note({**summary, "decode_eviction": False}) is not None


def test_run_py_logs_the_line_once_at_the_end(checkpoint, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runner, "_LOADED", {})
    monkeypatch.setattr(sys, "argv", ["run.py", *arguments(checkpoint, tmp_path / "runs", "budget=8k"),
                                      "hydra/hydra_logging=none", "hydra/job_logging=none"])
    with caplog.at_level(logging.INFO, logger="keydiff"):
        runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
    notes = [r for r in caplog.records if "nothing was evicted" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert notes[0].getMessage().startswith("budget.tokens=8192 >= every prompt")
    messages = [r.getMessage() for r in caplog.records if r.name == "keydiff"]
    assert messages.index(notes[0].getMessage()) < next(i for i, m in enumerate(messages) if m.startswith("results:"))
