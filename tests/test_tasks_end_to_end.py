"""Every task through runner.run with the real offline default model against the project's fixtures.

Small limits keep this to a few minutes on a 2-core CPU; the point is that prompts build, decoding
follows each task's protocol, scores land in the result files and the summaries aggregate them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keydiff.run import runner
from tests.test_cluster import rows_of
from tests.test_runner import make_cfg

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def test_longbench_on_the_fixture(tmp_path):
    cfg = make_cfg(
        "task=longbench", f"task.data_dir={ROOT / 'tasks/fixtures/longbench'}", "task.limit=1",
        "task.datasets=[hotpotqa,trec,samsum,passage_count,lcc]", "model.max_length=1200",
        "policy=snapkv", "budget.tokens=256", "block_size=64",
    )
    summary = runner.run(cfg, tmp_path / "lb")
    rows = rows_of(tmp_path / "lb")
    assert [r["sample_id"] for r in rows] == ["hotpotqa/0", "trec/0", "samsum/0", "passage_count/0", "lcc/0"]
    assert all(0.0 <= r["scores"]["score"] <= 1.0 for r in rows)
    assert all(r["prompt_tokens"] <= 1200 + 64 for r in rows)  # truncated template + chat wrapper
    assert set(summary["metrics"]["datasets"]) == {"hotpotqa", "trec", "samsum", "passage_count", "lcc"}
    assert summary["statistics"]["cache_bound_held"] is True
    assert any(key.startswith("longbench/data/") for key in summary["data"])


def test_math500_on_the_fixture(tmp_path):
    cfg = make_cfg(
        "task=math500", f"task.data_dir={ROOT / 'tasks/fixtures/math500'}", "task.limit=1", "task.num_samples=2",
        "task.max_new_tokens=48", "policy=keydiff_window20", "budget.tokens=64", "block_size=32",
    )
    summary = runner.run(cfg, tmp_path / "math")
    rows = rows_of(tmp_path / "math")
    assert len(rows) == 2 and rows[0]["sample_id"].endswith("#0") and rows[1]["sample_id"].endswith("#1")
    assert rows[0]["sampling_seed"] is not None and rows[0]["sampling_seed"] != rows[1]["sampling_seed"]  # sampled decoding, seeded
    assert all(set(r["scores"]) >= {"exact", "flex", "has_answer"} for r in rows)
    assert 0.0 <= summary["metrics"]["exact"] <= 1.0


def test_phonebook_generated(tmp_path):
    cfg = make_cfg("task=phonebook", "task.sizes=[30]", "task.books_per_size=2", "policy=tova", "budget.tokens=128")
    summary = runner.run(cfg, tmp_path / "pb")
    rows = rows_of(tmp_path / "pb")
    assert [r["sample_id"] for r in rows] == ["n30/b0/q0", "n30/b1/q0"]
    assert summary["metrics"]["by_size"]["30"]["n"] == 2
    assert all(r["max_cache_entries"] <= 128 + 128 for r in rows)
