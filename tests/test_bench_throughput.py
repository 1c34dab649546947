"""The throughput benchmark's cases and reports at tiny sizes (runs and counts, never timings), and the tool that
compares two runs of one grid point (batch 1 against batch 8)."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from keydiff.bench import common, throughput
from keydiff.report import compare_runs


pytestmark = pytest.mark.integration


@pytest.mark.extended
def test_continuous_batching_anchor_runs_on_cpu():
    """transformers' generate_batch runs on CPU with the sized cache; decode time = long run - 1-token run."""
    model = common.build_model("random-tiny", torch.float32, "sdpa", "cpu")
    args = types.SimpleNamespace(new_tokens=6, budget=16, block_size=16, repeats=1)
    result = throughput.continuous_batching_case(model, common.random_prompt(model, 40), 2, args, "cpu")()
    assert result["seconds_with_prefill"] > 0 and math.isfinite(result["seconds"])  # a difference: may be tiny
    assert throughput.continuous_batching_unavailable("cpu") is None


@pytest.mark.extended
def test_serving_counts_full_and_bounded_entries_and_records_the_caches_bytes(tmp_path):
    """full: L + new entries per sequence; bounded: N + 1 entries, N + B allocated; held = budget // bytes each."""
    out = tmp_path / "serving.json"
    length, budget, block, new = 128, 16, 16, 3
    memory_gb = 0.0002
    throughput.main(["--model", "random-tiny", "--serving", "--lengths", str(length), "--memory-gb", str(memory_gb),
                     "--budget", str(budget), "--block-size", str(block), "--new-tokens", str(new), "--repeats", "1",
                     "--max-batch", "3", "--policies", "full,keydiff", "--json", str(out)])
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    model = common.build_model("random-tiny", torch.float32, "sdpa", "cpu")
    per_entry = common.kv_cache_bytes(None, model, 1)
    full, bounded = rows["full"], rows["keydiff"]
    assert full["entries_per_sequence"] == length + new and bounded["entries_per_sequence"] == budget + 1
    assert full["bytes_per_sequence"] == per_entry * (length + new)
    assert bounded["bytes_per_sequence"] == per_entry * (budget + block)  # the bounded cache's real capacity
    budget_bytes = memory_gb * (1 << 30)
    for row in (full, bounded):
        assert row["sequences_held"] == int(budget_bytes // row["bytes_per_sequence"])
        assert row["measured_batch"] == min(row["sequences_held"], 3)
        assert row["kv_cache_mib"] * (1 << 20) == row["bytes_per_sequence"] * row["measured_batch"]
        assert row["within_budget"] is True
    assert bounded["sequences_vs_full"] == bounded["sequences_held"] / full["sequences_held"]


def write_run(folder, batch_size, wall, predictions):
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"batch_size": batch_size, "samples_wall_s": wall}))
    rows = [{"sample_id": sid, "status": "ok", "prediction": text, "decode_batch_size": float(batch_size),
             "decode_s_per_token": 0.5} for sid, text in predictions.items()]
    (folder / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.unit
def test_compare_runs_reports_the_wall_ratio_and_each_differing_sample(tmp_path, capsys):
    write_run(tmp_path / "b1", 1, 10.0, {"p#0": "x = 4", "p#1": "the answer is 7", "p#2": "same"})
    write_run(tmp_path / "b8", 8, 3.0, {"p#0": "x = 4", "p#1": "the answer is 9", "p#2": "same"})
    record = compare_runs.compare(tmp_path / "b1", tmp_path / "b8")
    assert record["wall_ratio"] == pytest.approx(0.3) and record["samples"] == 3
    assert [(d["sample_id"], d["char"], d["a"], d["b"]) for d in record["differing"]] == [("p#1", 14, "7", "9")]
    assert compare_runs.main([str(tmp_path / "b1"), str(tmp_path / "b8")]) == 0
    text = capsys.readouterr().out
    assert "wall time b / a: 0.300" in text and "1 differ" in text and "p#1: char 14" in text
    write_run(tmp_path / "c8", 8, 3.0, {"p#0": "x = 4", "p#1": "the answer is 7", "p#2": "same"})
    assert compare_runs.compare(tmp_path / "b1", tmp_path / "c8")["differing"] == []
    assert compare_runs.main([str(tmp_path / "b1"), str(tmp_path / "missing")]) == 2
