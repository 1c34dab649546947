"""docs/experiments.md's table of fields lists every field a real run writes (a tiny model, two samples), and
names no field that is not written or documented as optional."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_guards import read_rows, runner_cfg, tiny_runner  # noqa: F401 (tiny_runner: a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.extended]

DOC = Path(__file__).resolve().parents[1] / "docs" / "experiments.md"


def documented() -> dict[str, set[str]]:
    """{"row": names, "summary": names, "statistics": names} from the table's first two columns."""
    text = DOC.read_text(encoding="utf-8").split("### Fields of predictions.jsonl and summary.json", 1)[1]
    table = text.split("\n### ", 1)[0]
    out: dict[str, set[str]] = {"row": set(), "summary": set(), "statistics": set()}
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        names_cell, file_cell = (c.strip() for c in line.strip("|").split("|")[:2])
        for name in re.findall(r"`([^`]+)`", names_cell):
            if name.startswith("statistics."):
                out["statistics"].add(name.split(".", 1)[1])
            else:
                out["row" if file_cell.startswith("row") else "summary"].add(name)
    return out


def test_the_field_table_lists_every_field_a_run_writes(tmp_path, tiny_runner):
    runner, model_dir, _ = tiny_runner
    summary = runner.run(runner_cfg(model_dir, "policy=keydiff", "budget.tokens=48", "block_size=16"), tmp_path / "run")
    rows = read_rows(tmp_path / "run")
    table = documented()
    written = {"row": {k for row in rows for k in row}, "summary": set(summary),
               "statistics": set(summary["statistics"])}
    for kind, names in written.items():
        assert names <= table[kind], f"{kind} fields missing from docs/experiments.md: {sorted(names - table[kind])}"
    # the renamed fields under their new names only
    assert {"kept_ratio", "kv_cache_allocated_bytes", "kv_cache_held_peak_bytes", "sampling_seed"} <= written["row"]
    assert not {"compression_ratio", "kv_cache_bytes", "kv_cache_peak_bytes", "seed"} & written["row"]
    assert {"mean_kept_ratio", "max_kv_cache_allocated_bytes", "max_kv_cache_held_peak_bytes"} <= written["statistics"]
    optional = {"row": {"failure_reason", "error", "context_tokens", "held_tokens", "max_scratch_entries",
                        "decode_batch_size", "decode_s_per_token", "prefill_shared", "context_prefill_s",
                        "shared_prefill_s", "context_mode", "capture_s"},
                "summary": {"last_checked_at"}, "statistics": {"max_scratch_entries"}}
    for kind in table:
        assert table[kind] - written[kind] <= optional[kind], f"{kind}: documented, never written: " \
            f"{sorted(table[kind] - written[kind] - optional[kind])}"
