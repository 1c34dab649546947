"""The protocol comparison: one score per method and budget under each way of asking about a compressed context.

Written by `python -m keydiff.report.tables`; keydiff.report.figures draws the same selection.
Design: docs/design/reports.md#leaderboard-and-protocol-comparison-reportleaderboard-reportprotocol
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from keydiff.paper.registry import PaperTable, display_name
from keydiff.report.render import (INTERVAL_NOTE, NA, best_mask, budget_tokens, format_estimate, interval, marks,
                                   write_table)
from keydiff.report.selection import select

TASK = re.compile(r"^(?P<base>shared_ruler_\w+?)-k(?P<k>\d+)-(?P<mode>independent|multi_request|multi_turn)$")
PERCENT = (0.0, 100.0)  # cells show the 0-1 score x100
MODE_ORDER = {"question in prompt": 0, "query-agnostic": 1, "multi-request": 2, "multi-turn": 3}


def column_of(task: str, query_aware) -> tuple[int, int, str] | None:
    """(sort key, sort key, header) of a run's column from its task name and protocol; None: not this task."""
    match = TASK.match(str(task))
    if match is None:
        return None
    k, mode = int(match["k"]), match["mode"]
    if mode == "independent":
        name = "question in prompt" if bool(query_aware) else "query-agnostic"
        return MODE_ORDER[name], k, name + ("" if k == 1 else f" k={k}")
    name = mode.replace("_", "-")
    return MODE_ORDER[name], k, f"{name} k={k}"


def runs(df: pd.DataFrame, table: PaperTable) -> pd.DataFrame:
    """The table's runs (its experiments, task shared_ruler_*), one per configuration (seeds averaged, subset runs only
    where no whole run exists: keydiff.report.selection.pick), with `column`, `order`, `k`, `percent`, `se_percent`,
    `subset`, `incomplete`, `num_failed`."""
    picked = df[df["task"].astype(str).str.match(TASK.pattern)] if len(df) else df
    if picked.empty:
        return pd.DataFrame()
    picked = select(picked, table, by_task=True, limited=True, models=False, budgets=False, block_sizes=False)
    if picked.empty:
        return picked
    columns = [column_of(t, q) for t, q in zip(picked["task"], picked["query_aware"])]
    se = pd.to_numeric(picked["se/score"], errors="coerce") if "se/score" in picked else pd.Series(np.nan, picked.index)
    complete = (pd.to_numeric(picked["complete"], errors="coerce") if "complete" in picked
                else pd.Series(1.0, picked.index))
    return picked.assign(
        order=[(c[0], c[1]) for c in columns], k=[c[1] for c in columns], column=[c[2] for c in columns],
        percent=100 * pd.to_numeric(picked["score"], errors="coerce"), se_percent=100 * se,
        subset=picked["limit"].notna() if "limit" in picked else False, incomplete=complete.fillna(0) < 1,
        num_failed=pd.to_numeric(picked.get("num_failed", 0), errors="coerce").fillna(0))


def headers(selected: pd.DataFrame) -> list[str]:
    """The columns present, in protocol order (question in prompt, query-agnostic, multi-request, multi-turn; k up)."""
    return [name for _, name in sorted({(tuple(o), c) for o, c in zip(selected["order"], selected["column"])})]


def cell(run) -> str:
    return format_estimate(float(run["percent"]), float(run["se_percent"]), run["samples"], precision=1,
                           bounds=PERCENT) + marks(run["subset"], run["num_failed"], run["incomplete"])


def layout(selected: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(scores x100, cell texts): rows (Model, Method, Budget), the full cache first, then methods by name and
    budget; columns `headers`."""
    columns = headers(selected)
    rows, values, texts = [], [], []
    for model, mine in selected.groupby("model", sort=True):
        order = sorted({(p != "full", budget_tokens(b), display_name(p), p, b)
                        for p, b in zip(mine["policy"], mine["budget_label"])}, key=lambda r: (r[0], r[2], r[1]))
        for _, _, name, policy, budget in order:
            line = mine[(mine["policy"] == policy) & (mine["budget_label"] == budget)]
            by_column = {run["column"]: run for _, run in line.iterrows()}
            rows.append((model, name, str(budget).upper() if budget != NA else NA))
            values.append([by_column[c]["percent"] if c in by_column else np.nan for c in columns])
            texts.append([cell(by_column[c]) if c in by_column else NA for c in columns])
    index = pd.MultiIndex.from_tuples(rows, names=["Model", "Method", "Budget"])
    return (pd.DataFrame(values, index=index, columns=columns, dtype=float),
            pd.DataFrame(texts, index=index, columns=columns))


def legend() -> str:
    return ("Columns: how the questions meet the compressed context (docs/experiments.md, \"Protocol comparison\"): "
            "question in prompt = compressed with the context (query_aware=true); query-agnostic = the context "
            "compressed, the question held after it (query_aware=false; with one question this is also multi-request "
            "and multi-turn); multi-request k = one compression, k questions each answered from a copy of it; "
            "multi-turn k = one conversation, earlier questions and answers in the same bounded cache. k = needles "
            "(and questions) per context. Cells: string-match score x100 over the questions, n = questions; the full "
            "cache row is each column's own run. § subset run (task.limit), †k failed questions, ~ run not "
            "complete.")


def tidy(selected: pd.DataFrame) -> pd.DataFrame:
    """protocol.csv: one row per run, the numbers behind each cell (score 0-1 as the runs record it)."""
    bounds = [interval(float(v), float(e), n, PERCENT) if pd.notna(v) else None
              for v, e, n in zip(selected["percent"], selected["se_percent"], selected["samples"])]
    mode = [TASK.match(t)["mode"] for t in selected["task"]]
    frame = pd.DataFrame({
        "model": selected["model"], "policy": selected["policy"], "method": selected["policy"].map(display_name),
        "budget": selected["budget_label"], "column": selected["column"], "mode": mode, "questions": selected["k"],
        "query_aware": selected["query_aware"], "block_size": selected["block_size"],
        "decode_eviction": selected["decode_eviction"], "score": selected["score"],
        "se": pd.to_numeric(selected.get("se/score"), errors="coerce") if "se/score" in selected else math.nan,
        "ci95_low": [b[0] / 100 if b else np.nan for b in bounds],
        "ci95_high": [b[1] / 100 if b else np.nan for b in bounds],
        "samples": selected["samples"], "subset": selected["subset"], "failed": selected["num_failed"].astype(int),
        "incomplete": selected["incomplete"], "task": selected["task"],
    })
    key = frame["budget"].map(budget_tokens)
    return frame.assign(_b=key, _o=[tuple(o) for o in selected["order"]]).sort_values(
        ["model", "policy", "_b", "_o"], kind="stable").drop(columns=["_b", "_o"])


def write(df: pd.DataFrame, out: Path, table: PaperTable) -> bool:
    """results/tables/protocol.{md,tex,csv}; False (nothing written) without a run of shared_ruler_*."""
    selected = runs(df, table)
    if selected.empty:
        return False
    scores, text = layout(selected)
    mask = best_mask(scores, ["Model", "Budget"], list(scores.columns))
    write_table(text, mask, out, table.name, f"{table.caption} {legend()} {INTERVAL_NOTE}")
    tidy(selected).to_csv(out / f"{table.name}.csv", index=False, float_format="%.10g", lineterminator="\n")
    return True
