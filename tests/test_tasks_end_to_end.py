"""LongBench through runner.run with the real offline default model on the project's fixture: the model's
max_length reaches the task's truncation and the official scores land in the result files and the summary."""

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
