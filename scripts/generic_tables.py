"""Generic tables for the ordinary research loop: whatever ran, per experiment (``adhoc`` included) and task.

Why: the paper tables only take complete runs of named paper experiments over whole tasks, so a sweep like
``python run.py -m policy=keydiff,sink budget=1k,2k task.limit=2`` appears in none of them. Here every run in
results/summary.csv counts, complete or not, subset or not, and says which it is:

  <experiment>__<task>.md / .tex  in results/tables/generic/
    1. the task's primary score as policy x budget (rows: model, block size, policy; one column per budget,
       "--" = no budget, the full cache), each cell "value (n)" with n the samples scored;
    2. every run as a row with each top-level task metric (and LongBench's per-dataset scores), the mean
       compression ratio and TTFT, n, failed samples, task.limit and seeds.

Marks (also in each file's legend): § subset run (task.limit set), †k k samples failed (out of memory,
prompt too long, ...: see failures/* in summary.csv), ~ run not complete (still running or stopped).
Seeds of one configuration are averaged; n is then their total.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

FIXED = {"Model", "B", "Policy", "Budget", "n", "failed", "limit", "seeds", "marks", "score", "compression", "TTFT (s)"}
ID = ["experiment", "task", "model", "block_size", "policy", "budget_label"]
LEGEND = ("§ subset run (task.limit); †k: k samples failed; ~ run not complete; n = samples scored; "
          "-- budget = full cache (no eviction).")


def runs_of(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration, seeds averaged (n summed), with the marks of the runs behind it. Only the
    columns the generic tables show are kept (top-level task metrics, LongBench per-dataset scores)."""
    shown = [c for c in df.columns if (c.startswith("metrics/") and c.count("/") == 1) or c.startswith("lb/")]
    base = ["score", "mean_compression_ratio", "mean_ttft_s", "budget"]
    df = df[[c for c in ID + base + shown if c in df.columns]].assign(
        budget_label=df["budget_label"].where(df["policy_name"] != "full", "--").fillna("--"),
        block_size=df["block_size"].fillna("--"), subset=df["limit"].notna(), limit=df["limit"],
        incomplete=~df["complete"].astype(str).eq("True"), samples=pd.to_numeric(df["samples"], errors="coerce"),
        num_failed=pd.to_numeric(df["num_failed"], errors="coerce").fillna(0) if "num_failed" in df else 0.0, seeds=1)
    means = [c for c in base + shown if c in df.columns]
    agg = {c: "mean" for c in means} | {"samples": "sum", "num_failed": "sum", "seeds": "sum", "subset": "any",
                                         "incomplete": "any", "limit": "max"}
    return df.groupby(ID, sort=False, dropna=False).agg(agg).reset_index()


def marks(run) -> str:
    out = "§" if run["subset"] else ""
    out += f"†{int(run['num_failed'])}" if run["num_failed"] else ""
    return out + ("~" if run["incomplete"] else "")


def budget_order(label: str) -> float:
    if label == "--":
        return -1.0
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([km]?)", str(label).lower())
    return float(match[1]) * {"": 1, "k": 1024, "m": 1024 ** 2}[match[2]] if match else float("inf")


def fmt(value, precision=3) -> str:
    return "--" if value is None or pd.isna(value) else f"{value:.{precision}f}"


def metric_columns(runs: pd.DataFrame) -> list[str]:
    """Top-level task metrics (metrics/<name>, no deeper path) that hold a number in some run, then the
    LongBench per-dataset scores."""
    top = [c for c in runs.columns if c.startswith("metrics/") and c.count("/") == 1 and runs[c].notna().any()]
    return top + [c for c in runs.columns if c.startswith("lb/") and runs[c].notna().any()]


def score_matrix(runs: pd.DataFrame) -> pd.DataFrame:
    budgets = sorted(set(runs["budget_label"]), key=budget_order)
    rows = {}
    for _, run in runs.iterrows():
        key = (run["model"], run["block_size"], run["policy"])
        cell = f"{fmt(run['score'])} (n={int(run['samples']) if pd.notna(run['samples']) else 0}){marks(run)}"
        rows.setdefault(key, {})[run["budget_label"]] = cell
    table = pd.DataFrame.from_dict(rows, orient="index").reindex(columns=budgets)
    table.index = pd.MultiIndex.from_tuples(table.index, names=["Model", "B", "Policy"])
    return table.sort_index(level=[0, 1], sort_remaining=False).fillna("")


def run_rows(runs: pd.DataFrame) -> pd.DataFrame:
    columns = metric_columns(runs)
    table = pd.DataFrame({
        "Model": runs["model"], "B": runs["block_size"], "Policy": runs["policy"], "Budget": runs["budget_label"],
        "n": runs["samples"].fillna(0).astype(int), "failed": runs["num_failed"].astype(int),
        "limit": runs["limit"].map(lambda v: "--" if pd.isna(v) else str(int(v))),
        "seeds": runs["seeds"].astype(int), "marks": runs.apply(marks, axis=1),
        "score": runs["score"].map(fmt),
        **{(c.split("/", 1)[1] if c.split("/", 1)[1] not in FIXED else f"{c.split('/', 1)[1]} (metric)"): runs[c].map(fmt)
           for c in columns},
        "compression": runs["mean_compression_ratio"].map(fmt), "TTFT (s)": runs["mean_ttft_s"].map(fmt),
    })
    order = np.lexsort([runs["budget_label"].map(budget_order), runs["policy"], runs["block_size"].astype(str),
                        runs["model"]])
    return table.iloc[order].set_index(["Model", "B", "Policy", "Budget"])


def markdown(table: pd.DataFrame) -> list[str]:
    flat = table.reset_index()
    lines = ["| " + " | ".join(map(str, flat.columns)) + " |", "|" + "---|" * len(flat.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in flat.itertuples(index=False)]
    return lines


TEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
               "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(text: str) -> str:
    """Plain text (captions) for LaTeX; table cells are escaped by pandas' Styler."""
    return "".join(TEX_SPECIAL.get(ch, ch) for ch in str(text))


def latex(table: pd.DataFrame, caption: str, label: str) -> str:
    caption = tex_escape(caption)
    return table.style.format(escape="latex").format_index(escape="latex", axis=0).format_index(
        escape="latex", axis=1).to_latex(hrules=True, caption=caption, label=label, position_float="centering")


def write_generic(df: pd.DataFrame, out: Path) -> list[dict]:
    """One .md/.tex pair per (experiment, task); returns what was written, for the results index."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if df.empty:
        return written
    for (experiment, task), group in runs_of(df).groupby(["experiment", "task"], sort=True):
        name = f"{experiment}__{task}"
        matrix, every = score_matrix(group), run_rows(group)
        n_subset, n_failed = int(group["subset"].sum()), int(group["num_failed"].sum())
        status = (f"{len(group)} configurations, {int(group['samples'].fillna(0).sum())} samples scored"
                  + (f", {n_subset} subset runs (§)" if n_subset else "") + (f", {n_failed} failed samples (†)" if n_failed else "")
                  + (f", {int(group['incomplete'].sum())} not complete (~)" if group["incomplete"].any() else ""))
        title = f"Experiment `{experiment}`, task `{task}`"
        lines = [f"**{name}**: {title}: {status}.", "", f"Primary score (policy x budget): {LEGEND}", ""]
        lines += markdown(matrix) + ["", "Every configuration and metric:", ""] + markdown(every)
        (out / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        caption = f"{experiment} / {task}: primary score per policy and budget (n samples). {LEGEND}"
        tex = latex(matrix, caption, f"tab:{name}-score") + "\n" + latex(every, f"{experiment} / {task}: every run.",
                                                                        f"tab:{name}-runs")
        (out / f"{name}.tex").write_text(tex, encoding="utf-8")
        written.append({"name": name, "experiment": experiment, "task": task, "status": status,
                        "subset": n_subset > 0, "path": f"generic/{name}.md"})
    return written
