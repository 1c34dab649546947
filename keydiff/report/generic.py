"""Generic tables for the ordinary research loop: whatever ran, per experiment (``adhoc`` included) and task.

Every run in results/summary.csv counts and says what it is: results/tables/generic/<experiment>__<task>.md / .tex.
Design: docs/design/reports.md#generic-tables-reportgeneric
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from keydiff.report.collect import PRIMARY, task_family
from keydiff.report.render import (NA, NOTHING_EVICTED, budget_tokens, count, decimals, format_estimate, latex,
                                   markdown_rows, marks, metric_range, plural)
from keydiff.report.selection import average_seeds, whole_runs_first

FIXED = {"Model", "B", "Policy", "Budget", "n", "failed", "limit", "seeds", "marks", "collapsed", "kept N/L", "TTFT (s)"}
ID = ["experiment", "task", "model", "block_size", "policy", "budget_label", "max_new_tokens"]
LEGEND = ("value [95 % confidence interval] (Wilson score interval inside the score's range; ± half-width, 1.96 "
          "standard errors, for times; \"n too small\": fewer than 5 samples; \"constant\": kept N/L or a time that is "
          "the same for every sample, e.g. kept N/L 1.000 where the budget holds every prompt) (n = samples scored, "
          "per seed: seeds repeat the same samples); "
          "§ subset run (task.limit), shown only where no whole-task run of the "
          "same configuration exists; †k: k samples failed; ~ run not complete; ∅ nothing evicted (the budget held every "
          "prompt: scores as the full cache); -- budget = full cache (no eviction).")
COUNT_METRICS = re.compile(r"^(n|n_.*|num_.*|.*_count|length)$")  # counts and lengths: printed as integers


def block_cells(df: pd.DataFrame) -> pd.Series:
    """The "B" of a configuration: the block size, "-query-agnostic" added for query_aware=false runs (as their
    directories), so that the two protocols are never averaged together and a table or figure that mixes them
    says which row is which (runs before the switch, and query-aware ones, keep the plain block size)."""
    block = df["block_size"].fillna(NA)
    if "query_aware" not in df:
        return block
    agnostic = df["query_aware"].astype(str).str.lower().eq("false")
    return block.where(~agnostic, block.astype(str) + "-query-agnostic")


def runs_of(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration, seeds averaged (n per seed), with the marks of the runs behind it. Subset
    runs of a configuration that has a whole-task run are left out (`superseded` counts them). Only the
    columns the generic tables show are kept (top-level task metrics, LongBench per-dataset scores)."""
    shown = [c for c in df.columns if (c.startswith("metrics/") and c.count("/") == 1) or c.startswith("lb/")]
    base = ["score", "mean_kept_ratio", "mean_ttft_s", "budget"]
    values = [c for c in base + shown if c in df.columns]
    ses = [f"se/{c}" for c in values if f"se/{c}" in df.columns]
    if "max_new_tokens" not in df:  # a summary.csv collected before the column existed
        df = df.assign(max_new_tokens=np.nan)
    flags = {k: df[k].astype(str).eq("True").astype(float) if k in df else 0.0 for k in ("nothing_evicted",)}
    collapsed = pd.to_numeric(df["degenerate"], errors="coerce") if "degenerate" in df else np.nan
    df = df[[c for c in ID + values + ses if c in df.columns]].assign(
        **flags, degenerate=collapsed,
        max_new_tokens=pd.to_numeric(df["max_new_tokens"], errors="coerce").fillna(-1),  # -1: none (groupable)
        budget_label=df["budget_label"].where(df["policy_name"] != "full", NA).fillna(NA),
        block_size=block_cells(df), subset=df["limit"].notna().astype(float), limit=df["limit"],
        incomplete=(~df["complete"].astype(str).eq("True")).astype(float),
        samples=pd.to_numeric(df["samples"], errors="coerce"),
        num_failed=pd.to_numeric(df["num_failed"], errors="coerce").fillna(0) if "num_failed" in df else 0.0, seeds=1)
    kept, superseded = whole_runs_first(df, ID)
    runs = average_seeds(kept.assign(limit=pd.to_numeric(kept["limit"], errors="coerce")), ID)
    runs = runs.assign(subset=runs["subset"] > 0, incomplete=runs["incomplete"] > 0,
                       nothing_evicted=runs["nothing_evicted"] > 0)
    hidden = superseded.groupby(ID, dropna=False).size().rename("superseded").reset_index()
    runs = runs.merge(hidden, on=ID, how="left") if len(hidden) else runs.assign(superseded=0)
    runs = runs.assign(superseded=runs["superseded"].fillna(0).astype(int))
    return label_generation(runs)


def label_generation(runs: pd.DataFrame) -> pd.DataFrame:
    """Where one (experiment, task) holds runs of different task.max_new_tokens, each policy label names its own
    ("keydiff [max_new_tokens=20]"), so that a table row or a figure line never stands for two generation settings;
    `generation_settings` lists the values (empty where they agree)."""
    def label(group: pd.DataFrame) -> pd.DataFrame:
        values = sorted(set(group["max_new_tokens"]))
        if len(values) < 2:
            return group.assign(generation_settings="")
        named = group["max_new_tokens"].map(lambda v: "none" if v < 0 else str(int(v)))
        return group.assign(policy=group["policy"] + " [max_new_tokens=" + named + "]",
                            generation_settings=", ".join("none" if v < 0 else str(int(v)) for v in values))
    if runs.empty:
        return runs.assign(generation_settings="")
    parts = [label(group) for _, group in runs.groupby(["experiment", "task"], sort=False)]
    return pd.concat(parts).loc[runs.index]


def primary_metric(task: str) -> str:
    """The name of the task's primary score (needle_recall, average, flex, exact)."""
    return PRIMARY.get(task_family(str(task)), ("score",))[0]


def estimate(run, column: str = "score", measure: bool = False) -> str:
    """`column` of a run as "value [interval] (n)"; `measure`: a measure of the configuration (kept N/L, TTFT), not
    a score, so no interval where it is the same for every sample (render.format_estimate)."""
    se = run.get(f"se/{column}", np.nan)
    return format_estimate(run[column], np.nan if se is None else float(se), run["samples"] if pd.notna(run["samples"]) else 0,
                           bounds=metric_range(column, run["task"]), measure=measure)


def run_marks(run) -> str:
    return marks(run["subset"], run["num_failed"], run["incomplete"], bool(run.get("nothing_evicted", False)))


def collapsed(run) -> str:
    """"k/n": outputs that degenerated into one repeated n-gram, of the samples scored; "--": not recorded."""
    if pd.isna(run.get("degenerate", np.nan)):
        return NA
    return f"{int(round(run['degenerate']))}/{int(run['samples']) if pd.notna(run['samples']) else 0}"


def sample_count(run) -> str:
    """n per seed; "5–6" when the seeds of a configuration scored different numbers of samples."""
    high = int(run["samples"]) if pd.notna(run["samples"]) else 0
    low = int(run["samples_min"]) if pd.notna(run.get("samples_min", np.nan)) else high
    return str(high) if low == high else f"{low}–{high}"


def sample_counts(runs: pd.DataFrame) -> pd.Series:
    """The n column: integers, or text ("5–6") when some configuration's seeds scored different numbers."""
    counts = runs.apply(sample_count, axis=1)
    return counts if len(runs) and counts.str.contains("–").any() else runs["samples"].fillna(0).astype(int)


def metric_columns(runs: pd.DataFrame) -> list[str]:
    """Top-level task metrics (metrics/<name>, no deeper path) that hold a number in some run, then the
    LongBench per-dataset scores. The primary score has its own column and is not repeated."""
    primary = {f"metrics/{primary_metric(t)}" for t in runs["task"]}
    top = [c for c in runs.columns if c.startswith("metrics/") and c.count("/") == 1 and runs[c].notna().any()
           and c not in primary]
    return top + [c for c in runs.columns if c.startswith("lb/") and runs[c].notna().any()]


def score_matrix(runs: pd.DataFrame) -> pd.DataFrame:
    budgets = sorted(set(runs["budget_label"]), key=budget_tokens)
    rows = {}
    for _, run in runs.iterrows():
        key = (run["model"], run["block_size"], run["policy"])
        cell = estimate(run) + run_marks(run)
        rows.setdefault(key, {})[run["budget_label"]] = cell
    table = pd.DataFrame.from_dict(rows, orient="index").reindex(columns=budgets)
    table.index = pd.MultiIndex.from_tuples(table.index, names=["Model", "B", "Policy"])
    return table.sort_index(level=[0, 1], sort_remaining=False).fillna("")


def metric_cells(runs: pd.DataFrame, column: str) -> pd.Series:
    name = column.split("/", 1)[1]
    if column.startswith("metrics/") and COUNT_METRICS.match(name):  # not lb/passage_count: a score
        return runs[column].map(count)
    return sample_means(runs, column)


def sample_means(runs: pd.DataFrame, column: str, measure: bool = False) -> pd.Series:
    """A column that averages samples (a metric, kept N/L, TTFT) with its interval where se/<column> was collected
    (`measure`: kept N/L, TTFT, whose constant values get none)."""
    if f"se/{column}" not in runs.columns:
        return runs[column].map(decimals)
    return runs.apply(lambda run: estimate(run, column, measure) if pd.notna(run[column]) else NA, axis=1)


def run_rows(runs: pd.DataFrame) -> pd.DataFrame:
    """Every configuration with each metric. The primary score's column names its metric; "kept N/L" is the
    mean fraction of the prompt the cache keeps, min(N / L, 1): the paper's "compression ratio"."""
    columns = metric_columns(runs)
    primary = sorted({primary_metric(t) for t in runs["task"]})
    table = pd.DataFrame({
        "Model": runs["model"], "B": runs["block_size"], "Policy": runs["policy"], "Budget": runs["budget_label"],
        "n": sample_counts(runs), "failed": runs["num_failed"].astype(int),
        "limit": runs["limit"].map(lambda v: NA if pd.isna(v) else str(int(v))),
        "seeds": runs["seeds"].astype(int), "marks": runs.apply(run_marks, axis=1),
        "collapsed": runs.apply(collapsed, axis=1),
        f"{' / '.join(primary)} (primary)": runs.apply(estimate, axis=1),
        **{(c.split("/", 1)[1] if c.split("/", 1)[1] not in FIXED else f"{c.split('/', 1)[1]} (metric)"):
           metric_cells(runs, c) for c in columns},
        "kept N/L": sample_means(runs, "mean_kept_ratio", measure=True),
        "TTFT (s)": sample_means(runs, "mean_ttft_s", measure=True),
    })
    order = np.lexsort([runs["budget_label"].map(budget_tokens), runs["policy"], runs["block_size"].astype(str),
                        runs["model"]])
    return table.iloc[order].set_index(["Model", "B", "Policy", "Budget"])


def markdown(table: pd.DataFrame) -> list[str]:
    return markdown_rows(table.reset_index())


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
        n_hidden = int(group["superseded"].sum())
        status = (f"{plural(len(group), 'configuration')}, {plural(group['samples'].fillna(0).sum(), 'sample')} scored"
                  + (f", {plural(n_subset, 'subset run')} (§)" if n_subset else "")
                  + (f", {plural(n_failed, 'failed sample')} (†)" if n_failed else "")
                  + (f", {int(group['incomplete'].sum())} not complete (~)" if group["incomplete"].any() else "")
                  + (f", {plural(n_hidden, 'subset run')} not shown (their configuration has a whole-task run)" if n_hidden else "")
                  + (f", {plural(int(group['nothing_evicted'].sum()), 'run')} evicted nothing ({NOTHING_EVICTED})"
                     if group["nothing_evicted"].any() else "")
                  + (f", {int(round(group['degenerate'].sum()))} of {int(group.loc[group['degenerate'].notna(), 'samples'].sum())} "
                     "outputs collapsed into a repeated n-gram" if group["degenerate"].fillna(0).sum() > 0 else "")
                  + (f", generation settings differ (task.max_new_tokens {group['generation_settings'].iloc[0]}: "
                     "each policy labelled with its own)" if group["generation_settings"].ne("").any() else ""))
        title = f"Experiment `{experiment}`, task `{task}`"
        metric = primary_metric(task)
        lines = [f"**{name}**: {title}: {status}.", "",
                 f"Primary score `{metric}` (policy x budget): {LEGEND} Kept N/L: mean fraction of the prompt "
                 "the cache keeps, min(N / L, 1) (the paper's \"compression ratio\").", ""]
        lines += markdown(matrix) + ["", "Every configuration and metric:", ""] + markdown(every)
        (out / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        caption = f"{experiment} / {task}: {metric} per policy and budget. {LEGEND}"
        tex = latex(matrix, caption, f"tab:{name}-score") + "\n" + latex(every, f"{experiment} / {task}: every run.",
                                                                        f"tab:{name}-runs")
        (out / f"{name}.tex").write_text(tex, encoding="utf-8")
        written.append({"name": name, "experiment": experiment, "task": task, "status": status,
                        "subset": n_subset > 0, "path": f"generic/{name}.md"})
    return written
