"""The kvpress-style leaderboard: average RULER score vs the fraction of the prompt kept, one line per method.

`runs` selects the runs (registry.TABLES["leaderboard"]); `write` lays out results/tables/leaderboard.{md,tex,csv}.
Written by `python -m keydiff.report.tables`; keydiff.report.figures draws the same selection.
Design: docs/design/reports.md#leaderboard-and-protocol-comparison-reportleaderboard-reportprotocol
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from keydiff.paper.registry import PaperTable, display_name
from keydiff.report.render import (INTERVAL_NOTE, NA, best_mask, budget_ratio, format_estimate, interval, marks,
                                   seeds_se, trimmed, write_table)
from keydiff.report.ruler import TASKS
from keydiff.report.selection import select

PERCENT = (0.0, 100.0)  # a RULER average x100: its interval stays inside
FULL_COLUMN = "1 (r=0)"  # the full cache keeps the whole prompt: kvpress's no_press, compression ratio 0
AVERAGE = "Avg."


def legend(selected: pd.DataFrame) -> str:
    """The caption's legend; its task count is the cells': 13 only when every run scored all 13 tasks."""
    scored = sorted({int(k) for k in selected["tasks_scored"]}) if len(selected) else [len(TASKS)]
    tasks = (f"{len(TASKS)} tasks" if scored == [len(TASKS)] else
             f"the tasks each run scored: {'/'.join(map(str, scored))} of {len(TASKS)}, marked (k/{len(TASKS)})")
    return ("Columns: fraction of the prompt kept (budget.ratio; r = kvpress's compression_ratio = 1 - kept). "
            f"Cells: RULER average x100 ({tasks}; string match); Avg. = mean over the kept ratios, shown only when "
            "every ratio ran completely on the same tasks and samples (its interval from the mean of their "
            "standard errors: the ratios score the same samples). § subset run (task.limit), †k failed samples, "
            f"~ run not complete, (k/{len(TASKS)}) tasks scored; n = samples per task. Protocol: kvpress's = the "
            "context compressed in one pass, nothing evicted while decoding (the numbers to lay beside kvpress's "
            "leaderboard); bounded = block-wise prefill and eviction after every generated token (a real memory "
            "bound). Methods compress the context only and get the question afterwards (kvpress's query_aware=false) "
            "unless marked \"(query-aware)\" (the question compressed with the context).")


QUERY_AWARE = " (query-aware)"  # kvpress's label of its query-aware loop's rows


def protocol_label(block_size, decode_eviction) -> str:
    """The protocol a run followed, as the table and figure name it (block_size as collect records it)."""
    one_pass = str(block_size) in ("inf", "None", "nan")
    evicts = bool(decode_eviction)
    if one_pass and not evicts:
        return "kvpress's protocol (one pass, no decode eviction)"
    if not one_pass and evicts:
        return f"bounded (B={block_size}, decode eviction)"
    return f"B={block_size}, decode eviction {'on' if evicts else 'off'}"


def ratio_header(ratio: float) -> str:
    """"0.25 (r=0.75)": the kept fraction and kvpress's compression ratio."""
    return f"{trimmed(ratio)} (r={trimmed(1 - ratio)})"


def runs(df: pd.DataFrame, table: PaperTable) -> pd.DataFrame:
    """The leaderboard's runs: one row per (task, model, policy, budget, B) of RULER runs in the table's
    experiments, seeds averaged, subset runs only where no whole-task run exists (keydiff.report.selection.pick),
    ratio budgets and the full cache (budget "--") only; with `ratio` (NaN for full), `tasks_scored`, `subset`,
    `incomplete` and `per_task` (samples scored per task: the most of any task, metrics/n/<task>)."""
    picked = df[df["task"].astype(str).str.startswith("ruler")] if len(df) else df
    if picked.empty:
        return pd.DataFrame()
    # query-aware rows are methods of their own (kvpress's "(query-aware)"), never averaged with query-agnostic ones
    aware = picked["query_aware"].fillna(True).astype(bool) if "query_aware" in picked else True
    full = picked["policy"] == "full"
    picked = picked.assign(policy=picked["policy"].where(~aware | full, picked["policy"] + QUERY_AWARE))
    picked = select(picked, table, by_task=True, limited=True, models=False, budgets=False, block_sizes=False)
    if picked.empty:
        return picked
    ratio = picked["budget_label"].map(budget_ratio).astype(float)  # NaN: the full cache (or a token budget)
    picked = picked[ratio.notna() | (picked["budget_label"] == NA)].assign(ratio=ratio)
    task_columns = [f"metrics/tasks/{t}" for t in TASKS if f"metrics/tasks/{t}" in picked.columns]
    counts = [f"metrics/n/{t}" for t in TASKS if f"metrics/n/{t}" in picked.columns]  # samples scored per task
    per_task = picked[counts].max(axis=1) if counts else pd.Series(np.nan, index=picked.index)
    complete = pd.to_numeric(picked["complete"], errors="coerce") if "complete" in picked else pd.Series(1.0, picked.index)
    decode = picked["decode_eviction"] if "decode_eviction" in picked else pd.Series(True, picked.index)
    protocols = [protocol_label(b, d) for b, d in zip(picked["block_size"], decode)]
    return picked.assign(protocol=protocols, tasks_scored=picked[task_columns].notna().sum(axis=1) if task_columns else 0,
                         per_task=per_task.fillna(picked["samples"]),
                         subset=picked["limit"].notna() if "limit" in picked else False,
                         incomplete=complete.fillna(0) < 1,
                         num_failed=pd.to_numeric(picked.get("num_failed", 0), errors="coerce").fillna(0))


def cell(run) -> str:
    """"61.54 [52.10, 70.20] (n=5)§ (11/13)": the score, its 95 % interval over all the samples behind the
    average, samples per task and the run's marks."""
    se = run.get("se/score", np.nan)
    text = format_estimate(float(run["score"]), float(se) if pd.notna(se) else math.nan, run["samples"], precision=2,
                           bounds=PERCENT, shown_n=run["per_task"])
    text += marks(run["subset"], run["num_failed"], run["incomplete"])
    return text + ("" if int(run["tasks_scored"]) == len(TASKS) else f" ({int(run['tasks_scored'])}/{len(TASKS)})")


def scored_tasks(run) -> frozenset:
    """The RULER tasks a run scored (metrics/tasks/<task> present)."""
    return frozenset(t for t in TASKS if pd.notna(run.get(f"metrics/tasks/{t}", np.nan)))


def averageable(by_ratio: dict, ratios: list[float]) -> bool:
    """Avg. needs every ratio to have run completely, on the same tasks with the same samples per task: a mean
    over a missing, partial or differently sized ratio would not be the method's average."""
    if not ratios or any(r not in by_ratio for r in ratios):
        return False
    runs = [by_ratio[r] for r in ratios]
    return (not any(bool(run["incomplete"]) for run in runs) and len({scored_tasks(run) for run in runs}) == 1
            and len({float(run["per_task"]) for run in runs}) == 1)


def layout(selected: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(scores, text): rows (Task, Model, Protocol, Method), full first then ranked by Avg.; columns the kept
    ratios ascending, Avg., and the full cache's "1 (r=0)"."""
    ratios = sorted({float(r) for r in selected["ratio"].dropna()})
    columns = [ratio_header(r) for r in ratios] + [AVERAGE, FULL_COLUMN]
    rows, values, texts = [], [], []
    for (task, model), mine in selected.groupby(["task", "model"], sort=True):
        evicting, full = mine[mine["budget_label"] != NA], mine[mine["budget_label"] == NA]
        for block in sorted(set(evicting["protocol"]), key=str) or [NA]:
            ranked = []
            for policy, line in evicting[evicting["protocol"] == block].groupby("policy"):
                by_ratio = {float(r["ratio"]): r for _, r in line.iterrows()}
                scores = [by_ratio[r]["score"] if r in by_ratio else np.nan for r in ratios]
                average = float(np.mean(scores)) if averageable(by_ratio, ratios) else np.nan
                ses = [by_ratio[r].get("se/score", np.nan) if r in by_ratio else np.nan for r in ratios]
                text = [cell(by_ratio[r]) if r in by_ratio else NA for r in ratios]
                samples = min(float(r["samples"]) for r in by_ratio.values()) if by_ratio else math.nan
                text.append(NA if np.isnan(average) else format_estimate(average, seeds_se(ses), samples, 2, PERCENT,
                                                                         shown_n=None)
                            + marks(any(bool(r["subset"]) for r in by_ratio.values()), 0, False))
                ranked.append((-average if not np.isnan(average) else math.inf, display_name(policy),
                               scores + [average, np.nan], text + [NA]))
            for _, run in full.iterrows():
                rows.append((task, model, block, display_name(run["policy"])))
                values.append([np.nan] * (len(ratios) + 1) + [run["score"]])
                texts.append([NA] * (len(ratios) + 1) + [cell(run)])
            for _, name, scores, text in sorted(ranked, key=lambda r: (r[0], r[1])):
                rows.append((task, model, block, name))
                values.append(scores)
                texts.append(text)
    index = pd.MultiIndex.from_tuples(rows, names=["Task", "Model", "Protocol", "Method"])
    return (pd.DataFrame(values, index=index, columns=columns, dtype=float),
            pd.DataFrame(texts, index=index, columns=columns))


def tidy(selected: pd.DataFrame) -> pd.DataFrame:
    """leaderboard.csv: one row per run, the numbers behind every cell (ratio 1 = the full cache)."""
    ratio = selected["ratio"].fillna(1.0)
    se = selected["se/score"] if "se/score" in selected else pd.Series(np.nan, index=selected.index)
    frame = pd.DataFrame({
        "task": selected["task"], "model": selected["model"], "protocol": selected["protocol"],
        "block_size": selected["block_size"],
        "policy": selected["policy"], "method": selected["policy"].map(display_name),
        "budget": selected["budget_label"], "kept_ratio": ratio, "kvpress_compression_ratio": 1 - ratio,
        "ruler_average": selected["score"], "se": se, **ci95(selected, se),
        "samples_per_task": selected["per_task"], "samples": selected["samples"], "tasks_scored": selected["tasks_scored"],
        "subset": selected["subset"], "failed": selected["num_failed"].astype(int), "incomplete": selected["incomplete"],
    })
    return frame.sort_values(["task", "model", "protocol", "policy", "kept_ratio"], kind="stable")


def ci95(selected: pd.DataFrame, se: pd.Series) -> dict[str, list[float]]:
    """The CSV's 95 % interval columns (render.interval: Wilson inside 0-100 over the run's samples; NaN below 5)."""
    bounds = [interval(float(v), float(e), n, PERCENT) for v, e, n in zip(selected["score"], se, selected["samples"])]
    return {"ci95_low": [b[0] if b else np.nan for b in bounds], "ci95_high": [b[1] if b else np.nan for b in bounds]}


def write(df: pd.DataFrame, out: Path, table: PaperTable) -> bool:
    """results/tables/leaderboard.{md,tex,csv}; False (nothing written) without a RULER run of its experiments."""
    selected = runs(df, table)
    if selected.empty:
        return False
    scores, text = layout(selected)
    mask = best_mask(scores, ["Task", "Model", "Protocol"], [c for c in scores.columns if c != FULL_COLUMN])
    write_table(text, mask, out, table.name, f"{table.caption} {legend(selected)} {INTERVAL_NOTE}")
    tidy(selected).to_csv(out / f"{table.name}.csv", index=False, float_format="%.10g", lineterminator="\n")
    return True
