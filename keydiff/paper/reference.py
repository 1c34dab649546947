"""The paper's published value for one grid point, read from results/paper/*.csv (written by the tables work).

Each run's W&B summary gets `paper/<key>` beside our `<key>`, where the paper reports one.
Design: docs/design/reports.md#against-the-paper-reportagainst_paper
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from keydiff.paper.registry import table_numbers  # noqa: F401  (which tables an experiment is logged against)

AVERAGE = "avg"  # the average column, whatever the paper printed (Avg., average)


def read_tables(paper_dir: str | Path, tables: tuple[str, ...]) -> list[dict[str, str]]:
    """Rows with a value of results/paper/table<N>.csv for each N ([] for files that do not exist)."""
    rows = []
    for table in tables:
        path = Path(paper_dir) / f"table{table}.csv"
        if path.exists():
            with open(path, newline="", encoding="utf-8") as handle:
                rows += [row for row in csv.DictReader(handle) if (row.get("value") or "").strip()]
    return rows


def _matches(field: str | None, *ours: Any) -> bool:
    field = (field or "").strip().lower()
    return field == "" or field in {str(value).lower() for value in ours if value is not None}


def paper_values(rows: list[dict[str, str]], *, model: str, policy: str, budget_label: str | None,
                 block_size: Any, experiment_name: str, primary: str, policy_name: str | None = None) -> dict[str, float]:
    """Our summary key -> the paper's value, for the cells of `rows` that describe this grid point.
    The policy matches by label, else by name (Table 4's "KeyDiff" is our keydiff_w20). The "avg" column or the
    `primary` metric becomes `score`, a LongBench dataset `metrics/datasets/<dataset>`; setting columns (Table 4's
    4K/8K/32K) match through the experiment name; anything still ambiguous is left out."""
    block = "inf" if block_size in (None, "inf") else str(block_size)
    cell = [row for row in rows if _matches(row.get("model"), model) and _matches(row.get("budget"), budget_label)
            and _matches(row.get("block_size"), block)]
    mine = [row for row in cell if (row.get("policy") or "").strip().lower() == policy.lower()]
    if not mine and policy_name:
        mine = [row for row in cell if (row.get("policy") or "").strip().lower() == policy_name.lower()]
    out: dict[str, float] = {}
    for row in mine:
        column, metric = (row.get("column") or "").strip(), (row.get("metric") or "").strip()
        value = float(row["value"])
        if column == AVERAGE:
            out["score"] = value
        elif metric == primary and column and column.lower() in experiment_name.lower():
            out["score"] = value  # a setting column named in the experiment (4K in table4_gen4k)
        elif metric == "score" and column:
            out[f"metrics/datasets/{column}"] = value
    return out
