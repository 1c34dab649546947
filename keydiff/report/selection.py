"""Which runs of results/summary.csv a table shows: the one reader of the CSV (`load`), the selection of a
table's runs (`pick`, `select`: the registry's experiments, tasks, models, policies, budgets and block
sizes) and the merging of a configuration's runs (`whole_runs_first`, `average_seeds`).

Why its own module: the paper tables, the comparisons with the paper, the generic tables and the figures
all select runs the same way, and none of them has to import another to do it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from keydiff.paper.registry import PaperTable
from keydiff.report.render import NA


def whole_runs_first(df: pd.DataFrame, key: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(kept, superseded): per configuration `key`, its whole-task runs (no task.limit) when it has one,
    else the runs of its largest task.limit. A subset run reuses the first samples of the whole run, so
    averaging the two would count those samples twice and mix two different sample sets."""
    if df.empty:
        return df, df
    rank = pd.to_numeric(df["limit"], errors="coerce").fillna(np.inf)
    best = rank.groupby([df[k].astype(str) for k in key]).transform("max")
    return df[rank == best], df[rank != best]


def average_seeds(df: pd.DataFrame, key: list[str], sums=("num_failed", "seeds")) -> pd.DataFrame:
    """One row per `key`: numeric columns averaged over the seeds, `sums` added. Seeds are repeated measures
    of the same samples, not new samples: `samples` is the largest per-seed n (`samples_min` the smallest) and
    each standard error (se/...) the mean of the seeds' SEs (keydiff.report.render.seeds_se)."""
    numeric = [c for c in df.columns if c not in key and pd.api.types.is_numeric_dtype(df[c])]
    errors = [c for c in numeric if c.startswith("se/")]
    added = [c for c in numeric if c in sums]
    counted = [c for c in numeric if c == "samples"]
    means = [c for c in numeric if c not in errors and c not in added and c not in counted]
    groups = [df[k] for k in key]
    parts = [df[means].groupby(groups, sort=False, dropna=False).mean(),
             df[added].groupby(groups, sort=False, dropna=False).sum(),
             df[counted].groupby(groups, sort=False, dropna=False).max()]
    if errors:  # seeds_se, vectorised: the mean of the seeds' SEs, NaN when any seed has none
        ses = df[errors].astype(float)
        missing = ses.isna().groupby(groups, sort=False, dropna=False).any()
        parts.append(ses.groupby(groups, sort=False, dropna=False).mean().mask(missing))
    out = pd.concat(parts, axis=1)[numeric]
    if counted:
        out["samples_min"] = df["samples"].groupby(groups, sort=False, dropna=False).min()
    return out.reset_index()


# summary.csv columns renamed so that each says what it is (old -> current): a CSV collected before is read under
# the current names.
RENAMED_COLUMNS = {"mean_compression_ratio": "mean_kept_ratio", "se/mean_compression_ratio": "se/mean_kept_ratio"}


def load(summary: Path) -> pd.DataFrame:
    # .copy() de-fragments the wide frame (hundreds of metric columns) once, up front.
    frame = pd.read_csv(summary, dtype={"block_size": str, "budget_label": str, "policy": str, "model": str})
    return frame.rename(columns={k: v for k, v in RENAMED_COLUMNS.items() if v not in frame}).copy()


def pick(df, experiments, tasks=None, models=None, policies=None, budgets=None, block_sizes=None,
         by_task=True, limited=False):
    """One row per (model, policy, budget, block size[, task]), seeds averaged (average_seeds), from the first listed
    experiment (then task) that has it. `limited`: subset runs count only without a whole-task run. `full` ignores
    budget and block size; by_task=False merges views of one benchmark (longbench = longbench_full's English)."""
    runs = df[df["experiment"].isin(experiments)].copy()  # a compact copy: the CSV has hundreds of columns
    runs = runs if tasks is None else runs[runs["task"].isin(tasks)]
    runs = runs if limited else runs[runs["complete"].astype(str).eq("True") & runs["limit"].isna()]
    if models is not None:
        runs = runs[runs["model"].isin(models)]
    if policies is not None:
        runs = runs[runs["policy"].isin(policies)]
    full = runs["policy_name"] == "full"
    if budgets is not None:
        runs = runs[full | runs["budget_label"].isin(budgets)]
        full = runs["policy_name"] == "full"
    if block_sizes is not None:
        runs = runs[full | runs["block_size"].isin(block_sizes)]
        full = runs["policy_name"] == "full"
    task_rank = runs["task"].map(list(tasks).index) if tasks is not None and not by_task else 0
    runs = runs.assign(budget_label=runs["budget_label"].where(~full, NA), block_size=runs["block_size"].where(~full, NA),
                       rank=runs["experiment"].map(experiments.index) * 100 + task_rank)
    # the protocol (query_aware, decode_eviction: summaries before them were query-aware and evicted) is part of
    # a configuration: never averaged across
    runs = runs.assign(**{k: runs[k].fillna(True).astype(bool) if k in runs else True
                          for k in ("query_aware", "decode_eviction")})
    key = ["model", "policy", "budget_label", "block_size", "query_aware", "decode_eviction"] + (["task"] if by_task else [])
    runs = runs[runs["rank"] == runs.groupby(key)["rank"].transform("min")]  # never mix experiments or tasks
    runs = whole_runs_first(runs, key)[0]  # never average a subset run with its whole run
    runs = runs.assign(samples=pd.to_numeric(runs["samples"], errors="coerce"))
    return average_seeds(runs, key, sums=())


def select(df, table: PaperTable, by_task=False, limited=False, models=True, policies=None, budgets=True,
           block_sizes=True):
    """`pick` over the runs the registry declares for `table` (its experiments, tasks and, unless turned
    off, its models, budgets and block sizes; `policies` replaces the table's own list)."""
    return pick(df, list(table.reads), None if table.tasks is None else list(table.tasks),
                table.models if models else None, table.policies if policies is None else policies,
                table.budgets if budgets else None,
                list(table.block_sizes) if block_sizes and table.block_sizes else None, by_task, limited)
