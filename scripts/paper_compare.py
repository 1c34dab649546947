"""Our numbers next to the paper's, cell by cell: results/tables/<table>_vs_paper.md / .tex.

Why a long (one line per cell) layout: the same code then serves every table, whatever its shape, and each
line carries what a reviewer needs to judge it: ours, the paper's value (results/paper/*.csv), the
difference, how many samples stand behind our cell and marks for failed samples (†k), subset runs
(§, task.limit) and runs that are not complete (~). A summary line per table gives the mean absolute
difference, the cells outside the tolerance below, the sample counts, and the paper cells we have no run
for, with the `python run.py experiment=...` commands that fill them.

Only the same model is compared. When our runs use another model (the offline default SmolLM2 is none
of the paper's), the paper's values are shown beside ours for reference, with no difference, and the
summary says so. Tables whose paper model is not named (Table 9) match any model; Table 8's counts use
the Llama-2 tokenizer, so they are always reference-only.

Tolerances (|ours - paper| above them is "outside"), chosen from what legitimately moves a cell between
two faithful implementations (bf16 kernels, generation ties, data revisions, sampling):
  LongBench dataset score / row average (0-100)   2.0 points
  LongBench full-suite average (Tables 15, 16)    1.0 point
  Math-500 flex / exact (5 samples x 500)         0.03 (about 3 standard errors)
  Math-500 average generation length              10 % of the paper's value
  compression ratio (Table 9)                     0.03
  prompt-length bin counts (Table 8)              10 prompts
  phonebook accuracy (Table 17)                   0.2 (one book of five)
  NIAH recall difference (Table 18)               0.1
  Spearman rho (Table 3), relative latency (19)   0.05, 50 % (for the analysis scripts)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from collect_results import LONGBENCH
from generic_tables import budget_order, tex_escape
from keydiff.uncertainty import combined_se, half_width

PAPER_DIR = Path(__file__).resolve().parent.parent / "results" / "paper"
KEY = ["model", "policy", "budget", "block_size", "row", "column", "metric"]
ABSOLUTE = {"score": 2.0, "longbench_avg": 1.0, "flex": 0.03, "exact": 0.03, "compression_ratio": 0.03,
            "accuracy": 0.2, "recall_difference": 0.1, "spearman_rho": 0.05}
RELATIVE = {"avg_gen_length": 0.10, "relative_latency": 0.5}
COUNTS = ("<=2K", "2K-4K", "4K-6K", "6K-8K", ">=8K", "total")
SUITE = list(LONGBENCH)
ENGLISH = [d for d in SUITE if d not in ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")]
LLAMAS = ["llama-3.1-8b-instruct", "llama-3.2-3b-instruct"]
POLICY_CONF = {"keydiff_w20": "keydiff_window20", "keydiff_w10": "keydiff_window10"}
GEN = {"math500": "4K", "math500_8k": "8K", "math500_32k": "32K"}


def tolerance(metric: str, paper: float) -> float:
    if metric in COUNTS:
        return 10.0
    if metric in RELATIVE:
        return RELATIVE[metric] * abs(paper)
    return ABSOLUTE.get(metric, 0.0)


def load_paper(table: int, paper_dir: Path = PAPER_DIR) -> pd.DataFrame:
    path = paper_dir / f"table{table}.csv"
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    frame["value"] = pd.to_numeric(frame["value"].replace("", np.nan))
    return frame


def paper_caption(table: int, paper_dir: Path = PAPER_DIR) -> str:
    captions = pd.read_csv(paper_dir / "captions.csv")
    return str(captions.set_index("table").loc[table, "caption"])


# ----------------------------------------------------------------------------- our cells, in the paper's schema
def selected(df, experiments, tasks=None, **kwargs):
    """make_tables.pick over every run (subset and incomplete included, then marked), with the marks kept."""
    from make_tables import pick  # make_tables imports this module

    df = df.assign(is_subset=df["limit"].notna().astype(float),
                   is_incomplete=(~df["complete"].astype(str).eq("True")).astype(float),
                   num_failed=pd.to_numeric(df.get("num_failed", 0), errors="coerce").fillna(0))
    return pick(df, experiments, tasks, limited=True, **kwargs)


def cell(run, policy, budget, column, metric, value, n=None, row="", block="", se=np.nan):
    """One of our cells; `se`: the standard error of `value` over samples (NaN: none, e.g. a count)."""
    return {"model": run["model"], "policy": policy, "budget": budget, "block_size": block, "row": row,
            "column": column, "metric": metric, "value": value, "se": se,
            "n": run["samples"] if n is None else n, "failed": run.get("num_failed", 0),
            "subset": run.get("is_subset", 0) > 0, "incomplete": run.get("is_incomplete", 0) > 0}


def budget_of(run) -> str:
    return "" if run["policy"] == "full" else str(run["budget_label"])


def longbench_cells(df, experiments, datasets, blocks=("128",), block_key=False, avg=True, policies=None):
    runs = selected(df, experiments, ["longbench_full", "longbench"], block_sizes=list(blocks), by_task=False,
                    policies=None if policies is None else ["full", *policies])
    cells = []
    for _, run in runs.iterrows():
        block = str(run["block_size"]) if block_key and run["policy"] != "full" else ""
        scores = {d: run.get(f"lb/{d}") for d in datasets}
        for d, value in scores.items():
            if pd.notna(value):
                n = run.get(f"metrics/num_samples/{d}")
                cells.append(cell(run, run["policy"], budget_of(run), d, "score", value,
                                  n if pd.notna(n) else run["samples"], block=block, se=run.get(f"se/lb/{d}", np.nan)))
        if avg and all(pd.notna(v) for v in scores.values()):
            cells.append(cell(run, run["policy"], budget_of(run), "avg", "score", float(np.mean(list(scores.values()))),
                              block=block, se=combined_se(run.get(f"se/lb/{d}", np.nan) for d in datasets)))
    return cells


def ablation_cells(df, experiments, policies):
    runs = selected(df, experiments, ["longbench_full", "longbench"], policies=policies, block_sizes=["128"], by_task=False)
    cells = []
    for _, run in runs.iterrows():
        scores = [run.get(f"lb/{d}") for d in SUITE]
        if all(pd.notna(s) for s in scores):
            cells.append(cell(run, run["policy"], budget_of(run), "avg", "longbench_avg", float(np.mean(scores)),
                              se=combined_se(run.get(f"se/lb/{d}", np.nan) for d in SUITE)))
    return cells


def math_cells(df, experiments):
    runs = selected(df, experiments, list(GEN), policies=["full", "keydiff_w20", "snapkv"])
    cells = []
    for _, run in runs.iterrows():
        policy = "keydiff" if run["policy"] == "keydiff_w20" else run["policy"]  # the paper's "KeyDiff", App. E
        budget = "" if policy == "full" else f"{int(run['budget']) // 1024}k"
        for metric, column in [("flex", "metrics/flex"), ("exact", "metrics/exact"), ("avg_gen_length", "metrics/avg_new_tokens")]:
            if pd.notna(run.get(column)):
                cells.append(cell(run, policy, budget, GEN[run["task"]], metric, run[column], se=run.get(f"se/{column}", np.nan)))
    return cells


def math_subset_cells(df, experiments):
    """Tables 5/7: row = the subset "num_tokens>XK"; the Full cells come from the evicting run's subset."""
    runs = selected(df, experiments, list(GEN), policies=["keydiff_w20", "snapkv"])
    cells = []
    for _, run in runs.iterrows():
        if pd.isna(run.get("subset/flex")):
            continue
        budget = f"{int(run['budget']) // 1024}k"
        row = f"num_tokens>{budget.upper()}"
        n = run.get("subset/n_samples")
        policy = "keydiff" if run["policy"] == "keydiff_w20" else run["policy"]
        for metric in ("flex", "exact"):
            cells.append(cell(run, policy, budget, GEN[run["task"]], metric, run[f"subset/{metric}"], n, row,
                              se=run.get(f"se/subset/{metric}", np.nan)))
            cells.append(cell(run, "full", "", GEN[run["task"]], metric, run[f"subset/full_{metric}"], n, row,
                              se=run.get(f"se/subset/full_{metric}", np.nan)))
    return cells


def prompt_length_cells(df):
    runs = selected(df, ["table11_full", "table11", "table1_full", "table1"], ["longbench_full", "longbench"], by_task=False)
    cells = []
    for model, mine in runs.groupby("model"):
        run = mine.sort_values("policy", key=lambda p: p != "full").iloc[0]
        for dataset in SUITE:
            counts = {b: run.get(f"metrics/prompt_length_bins/{dataset}/{b}") for b in ("<=2K", "2K-4K", "4K-6K", "6K-8K", ">8K")}
            if all(pd.notna(c) for c in counts.values()):
                for b, c in counts.items():
                    cells.append(cell(run, "", "", dataset, ">=8K" if b == ">8K" else b, float(c)))
                cells.append(cell(run, "", "", dataset, "total", float(sum(counts.values()))))
    return cells


def compression_cells(df):
    runs = selected(df, ["table11", "table1", "table12", "table13", "table14"], ["longbench_full", "longbench"],
                    block_sizes=["128"], by_task=False)
    runs = runs[runs["policy"] != "full"]
    cells = []
    ratios = [f"cr/{d}" for d in SUITE if f"cr/{d}" in runs.columns]
    for (model, budget), mine in runs.groupby(["model", "budget_label"]):
        # Prompt lengths (hence ratios) do not depend on the policy: the run with the most datasets.
        run = mine.loc[mine[ratios].notna().sum(axis=1).idxmax()] if ratios else mine.iloc[0]
        weights = {}
        for dataset in SUITE:
            value = run.get(f"cr/{dataset}")
            if pd.notna(value):
                n = run.get(f"metrics/num_samples/{dataset}")
                weights[dataset] = (value, n if pd.notna(n) else np.nan)
                cells.append(cell(run, "", budget, dataset, "compression_ratio", value, n if pd.notna(n) else None,
                                  se=run.get(f"se/cr/{dataset}", np.nan)))
        if weights and not any(np.isnan(n) for _, n in weights.values()):  # the paper's average is over prompts
            total = sum(n for _, n in weights.values())
            se = np.sqrt(sum((n / total * run.get(f"se/cr/{d}", np.nan)) ** 2 for d, (_, n) in weights.items()))
            cells.append(cell(run, "", budget, "avg", "compression_ratio",
                              sum(v * n for v, n in weights.values()) / total, total, se=se))
    return cells


def phonebook_cells(df):
    runs = selected(df, ["table17"], ["phonebook"], policies=["full", "keydiff", "tova"], budgets=["6k"], block_sizes=["128"])
    cells = []
    for _, run in runs.iterrows():
        for column in run.index:
            if column.startswith("metrics/by_size/") and column.endswith("/exact") and pd.notna(run[column]):
                cells.append(cell(run, run["policy"], "6k", column.split("/")[2], "accuracy", run[column],
                                  se=run.get(f"se/{column}", np.nan)))
    return cells


def niah_cells(df):
    runs = selected(df, ["fig6_niah"], ["niah"], policies=["full", "keydiff"], budgets=["6k"], block_sizes=["128"])
    cells = []
    for model, mine in runs.groupby("model"):
        if set(mine["policy"]) != {"full", "keydiff"}:
            continue
        full, kd = mine.set_index("policy").loc["full"], mine.set_index("policy").loc["keydiff"]
        for column in kd.index:
            if column.startswith("metrics/needle_recall_by_cell/") and pd.notna(kd[column]) and pd.notna(full.get(column)):
                length, depth = column.split("/")[2:4]
                cells.append(cell(kd, "keydiff-full", "", length, "recall_difference", kd[column] - full[column],
                                  row=f"depth={float(depth):.1f}"))
    return cells


def table11_paper(paper_dir: Path = PAPER_DIR) -> pd.DataFrame:
    """Table 11 has no numbers in the extracted text; the paper prints its cells elsewhere: the English
    columns of every row in Table 1 (not Table 1's average, which is over 16 columns), and the Sink, SnapKV,
    KeyDiff and full rows in Table 14."""
    t1 = load_paper(1, paper_dir)
    t14 = load_paper(14, paper_dir)
    t14 = t14[t14["policy"].isin(["full", "sink", "snapkv", "keydiff"])]
    merged = pd.concat([t14, t1[t1["column"] != "avg"]])
    merged = merged.sort_values("value", na_position="last").drop_duplicates(KEY)  # a number beats a garbled cell
    return merged.assign(table="11", block_size="128")


# name -> (paper table, our cells, experiments: (for evicting runs, for full runs), key columns)
def comparisons():
    lb_block = [k for k in KEY if k != "block_size"]
    return {
        "table1": (1, lambda df: longbench_cells(df, ["table1", "table11", "table1_full", "table11_full"], ENGLISH,
                                                 policies=["h2o", "tova", "sink", "snapkv", "keydiff"]),
                   ("table1", "table1_full"), lb_block),
        "table4": (4, lambda df: math_cells(df, ["table4_gen4k", "table4_gen8k", "table4_gen32k", "table4_full"]),
                   ("table4_gen", "table4_full"), lb_block),
        "table5": (5, lambda df: math_subset_cells(df, ["table4_gen4k", "table4_gen8k", "table4_gen32k", "table4_full"]),
                   ("table4_gen", "table4_full"), lb_block),
        "table6": (6, lambda df: math_cells(df, ["table4_gen4k", "table4_gen8k", "table4_gen32k", "table4_full"]),
                   ("table4_gen", "table4_full"), lb_block),
        "table7": (7, lambda df: math_subset_cells(df, ["table4_gen4k", "table4_gen8k", "table4_gen32k", "table4_full"]),
                   ("table4_gen", "table4_full"), lb_block),
        "table8": (8, prompt_length_cells, ("table11_full", "table11_full"), lb_block),
        "table9": (9, compression_cells, ("table11", "table11"), [k for k in lb_block if k != "model"]),
        "table10": (10, lambda df: longbench_cells(df, ["table10", "table11_full", "table1_full"], SUITE[1:], ("inf",)),
                    ("table10", "table11_full"), lb_block),
        "table11": (11, lambda df: longbench_cells(df, ["table11", "table11_full"], SUITE), ("table11", "table11_full"),
                    lb_block),
        "table12": (12, lambda df: longbench_cells(df, ["table12", "table12_full"], SUITE), ("table12", "table12_full"),
                    lb_block),
        "table13": (13, lambda df: longbench_cells(df, ["table13", "table11_full"], SUITE, ("64", "256"), block_key=True),
                    ("table13", "table11_full"), KEY),
        "table14": (14, lambda df: longbench_cells(df, ["table14", "table11", "table11_full"], SUITE,
                                                   policies=["sink", "snapkv", "keydiff_w10", "keydiff_w20", "keydiff"]),
                    ("table14", "table11_full"), lb_block),
        "table15": (15, lambda df: ablation_cells(df, ["table15", "table11"], ["keydiff", "keydiff_pairwise", "keydiff_median"]),
                    ("table15", "table15"), lb_block),
        "table16": (16, lambda df: ablation_cells(df, ["table16", "table11"], ["keydiff", "keydiff_dot", "keydiff_euclidean"]),
                    ("table16", "table16"), lb_block),
        "table17": (17, phonebook_cells, ("table17", "table17"), lb_block),
        "table18": (18, niah_cells, ("fig6_niah", "fig6_niah"), lb_block),
    }


# ----------------------------------------------------------------------------- merging and writing
def command(name: str, experiments, run: pd.Series) -> str:
    """The run.py line that fills the paper cells of one missing run."""
    main, full = experiments
    if main == "table4_gen":
        main = {"4K": "table4_gen4k", "8K": "table4_gen8k", "32K": "table4_gen32k"}.get(run["column"], "table4_gen4k")
    parts = ["python run.py", f"experiment={full if run['policy'] == 'full' else main}"]
    if run.get("model") and run["model"] != "llama2-tokenizer":
        parts.append(f"model={run['model']}")
    if run["policy"] not in ("", "full", "keydiff-full"):
        policy = "keydiff_window20" if name in ("table4", "table5", "table6", "table7") and run["policy"] == "keydiff" \
            else POLICY_CONF.get(run["policy"], run["policy"])
        parts.append(f"policy={policy}")
    if run["budget"] and run["policy"] not in ("full", "keydiff-full") and name not in ("table8", "table9"):
        parts.append(f"budget={run['budget']}")
    if name == "table13" and run.get("block_size"):
        parts.append(f"block_size={run['block_size']}")
    return " ".join(parts)


def compare(name: str, paper: pd.DataFrame, ours: pd.DataFrame, keys: list[str]) -> tuple[pd.DataFrame, dict]:
    """Rows: every our cell (same model: ours, paper, diff; other model: paper value for reference), plus
    stats for the summary line, including the paper cells no run of the same model fills."""
    paper = paper[~paper["row"].str.startswith("line ")]  # unattributed text lines have no key
    paper = paper.assign(row=paper["row"].str.replace(r" \(.*\)$", "", regex=True),  # "(497/500)": paper's own n
                         block_size=paper["block_size"].where(paper["policy"] != "full", ""))
    if ours.empty:
        ours = pd.DataFrame(columns=KEY + ["value", "se", "n", "failed", "subset", "incomplete"])
    ours = ours if "se" in ours.columns else ours.assign(se=np.nan)  # cells of callers that have no SE
    ours = ours.astype({k: str for k in KEY}).fillna({"block_size": ""})
    if "model" not in keys:  # paper model not named: any of ours matches
        paper = paper.drop(columns=["model"]).drop_duplicates(keys)
    merged = ours.merge(paper[keys + ["value", "note"]].rename(columns={"value": "paper"}), on=keys, how="left")
    same = merged["paper"].notna() | merged["note"].fillna("").str.startswith("garbled")
    paper_models = sorted(set(paper.get("model", pd.Series(dtype=str))) - {""})
    reference = pd.DataFrame(columns=list(merged.columns))
    if "model" in keys and paper_models:
        other = merged[~same & ~merged["model"].isin(paper_models)]
        if not other.empty:
            ref_model = next((m for m in ["llama-3.2-3b-instruct", *paper_models] if m in paper_models))
            ref = paper[paper["model"] == ref_model].drop(columns=["model"])
            rest = [k for k in keys if k != "model"]
            reference = other.drop(columns=["paper", "note"]).merge(
                ref[rest + ["value", "note"]].rename(columns={"value": "paper"}), on=rest, how="left")
            reference["paper_model"] = ref_model
            merged = merged[same | merged["model"].isin(paper_models)]
    merged["paper_model"] = merged["model"] if "model" in keys else "(not named)"
    merged["diff"] = np.where(merged["paper"].notna(), merged["value"] - merged["paper"], np.nan)
    merged["tolerance"] = [tolerance(m, p) if pd.notna(p) else np.nan for m, p in zip(merged["metric"], merged["paper"])]
    merged["outside"] = merged["diff"].abs() > merged["tolerance"] + 1e-9
    if not reference.empty:
        reference["diff"], reference["outside"] = np.nan, False
        merged = pd.concat([merged, reference], ignore_index=True)
    # Only complete whole-task runs count in the statistics; subset (§) and unfinished (~) cells are shown
    # with their difference but leave the paper cell "missing" (its command resumes the run to the end).
    compared = merged[merged["diff"].notna() & ~merged["subset"].astype(bool) & ~merged["incomplete"].astype(bool)]
    wanted = paper[paper["value"].notna()]
    missing = wanted.merge(compared[keys].drop_duplicates(), on=keys, how="left", indicator=True)
    missing = missing[missing["_merge"] == "left_only"]
    stats = {
        "cells": len(compared), "mean_abs_diff": compared.assign(a=compared["diff"].abs()).groupby("metric")["a"].mean().to_dict(),
        "outside": int(compared["outside"].sum()), "reference": int((merged["paper_model"] != merged["model"]).sum())
        if "model" in keys else 0, "unmatched": int((merged["paper"].isna() & (merged["paper_model"] == merged["model"])).sum()),
        "n_min": merged["n"].min() if len(merged) else np.nan, "n_max": merged["n"].max() if len(merged) else np.nan,
        "failed_cells": int((pd.to_numeric(merged["failed"]) > 0).sum()), "failed": float(pd.to_numeric(merged["failed"]).max() if len(merged) else 0),
        "subset_cells": int(merged["subset"].astype(bool).sum()), "incomplete_cells": int(merged["incomplete"].astype(bool).sum()),
        "paper_cells": int(len(wanted)), "missing": missing, "garbled": int(paper["note"].str.startswith("garbled").sum()),
        "our_models": sorted(set(merged["model"])), "paper_models": paper_models,
        "reference_models": sorted(set(merged.loc[merged["paper_model"] != merged["model"], "paper_model"]))
        if "model" in keys and len(merged) else [],
    }
    return merged, stats


def marks(row) -> str:
    out = "§" if row["subset"] else ""
    out += f"†{int(row['failed'])}" if pd.notna(row["failed"]) and row["failed"] else ""
    return out + ("~" if row["incomplete"] else "")


def ours_text(row) -> str:
    """Our value, its 95 % half-width where it has a standard error, and the marks: "10.5 ± 19.6§"."""
    se = row.get("se", np.nan)
    spread = f" ± {num(half_width(float(se)))}" if se is not None and pd.notna(se) else ""
    return num(row["value"]) + spread + marks(row)


def num(value, digits=3) -> str:
    """Up to `digits` decimals, trailing zeros dropped (10 stays 10, 0.500 becomes 0.5)."""
    if value is None or pd.isna(value):
        return "--"
    text = f"{value:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def summary_line(name, stats, experiments) -> str:
    parts = [f"{stats['cells']} of {stats['paper_cells']} paper cells compared (same model, complete whole-task runs)"]
    if stats["cells"]:
        parts.append("mean abs. difference " + ", ".join(f"{m} {v:.3g}" for m, v in stats["mean_abs_diff"].items()))
        parts.append(f"{stats['outside']} outside tolerance")
    if stats["reference"]:
        parts.append(f"{stats['reference']} cells of our models {', '.join(m for m in stats['our_models'] if m not in stats['paper_models'])} "
                     f"shown next to the paper's values for another model, {', '.join(stats['reference_models']) or 'values'}, "
                     "for reference only (different model: no difference)")
    if pd.notna(stats["n_min"]):
        parts.append(f"samples per our cell: {num(stats['n_min'], 0)}-{num(stats['n_max'], 0)}")
    if stats["unmatched"]:
        parts.append(f"{stats['unmatched']} of our cells have no paper value")
    if stats["failed_cells"]:
        parts.append(f"† {stats['failed_cells']} cells with failed samples (up to {int(stats['failed'])})")
    if stats["subset_cells"]:
        parts.append(f"§ {stats['subset_cells']} cells from subset runs (task.limit), shown but not counted")
    if stats["incomplete_cells"]:
        parts.append(f"~ {stats['incomplete_cells']} cells from runs not complete, shown but not counted")
    if stats["garbled"]:
        parts.append(f"{stats['garbled']} paper cells garbled in the extracted text (results/paper/README.md)")
    return "; ".join(parts) + "."


def side_by_side(merged: pd.DataFrame) -> pd.DataFrame | None:
    """The paper's layout: one line per (model, policy, budget, ...), one column per paper column, each cell
    "ours / paper". None when there is nothing to show."""
    if merged.empty:
        return None
    rows = ["model", "paper_model", "policy", "budget", "block_size", "row", "metric"]
    rows = [r for r in rows if merged[r].astype(str).ne("").any()]
    if (merged["paper_model"] == merged["model"]).all():
        rows.remove("paper_model")  # every paper value is of our own model
    merged = merged.assign(_full=merged["policy"] != "full", _budget=merged["budget"].replace("", "--").map(budget_order)).sort_values(["model", "_full", "policy", "_budget"])
    cells = merged.assign(cell=[f"{ours_text(r)} / {num(p) if pd.notna(p) else '--'}"
                                for p, (_, r) in zip(merged["paper"], merged.iterrows())])
    wide = cells.pivot_table(index=rows, columns="column", values="cell", aggfunc="first", sort=False)
    return wide.fillna("")


def write_comparison(name: str, table: int, merged: pd.DataFrame, stats: dict, experiments, out: Path,
                     paper_dir: Path = PAPER_DIR) -> dict:
    caption = paper_caption(table, paper_dir)
    head = [f"**{name}_vs_paper**: ours next to the paper's Table {table} ({caption[:140]}{'...' if len(caption) > 140 else ''})",
            "", "Summary: " + summary_line(name, stats, experiments), "",
            "Marks: § subset run (task.limit), †k k samples failed, ~ run not complete; n = samples behind our cell; "
            "± = half-width of our 95 % confidence interval over samples (README \"Results\"); "
            "Δ = ours - paper; ! = outside the tolerance (scripts/paper_compare.py).", ""]
    table_rows = []
    for _, row in merged.sort_values(["model", "policy", "budget", "block_size", "row", "column", "metric"]).iterrows():
        table_rows.append({"Model": row["model"], "Paper model": row["paper_model"], "Policy": row["policy"],
                           "Budget": row["budget"] or "--", "B": row["block_size"] or "", "Row": row["row"],
                           "Column": row["column"], "Metric": row["metric"], "Ours": ours_text(row),
                           "Paper": num(row["paper"]) if pd.notna(row["paper"]) else ("garbled" if str(row.get("note", "")).startswith("garbled") else "--"),
                           "Δ": (num(row["diff"]) + ("!" if row["outside"] else "")) if pd.notna(row["diff"]) else
                           ("other model" if row["paper_model"] != row["model"] and pd.notna(row["paper"]) else ""),
                           "n": num(row["n"], 0)})
    frame = pd.DataFrame(table_rows, columns=["Model", "Paper model", "Policy", "Budget", "B", "Row", "Column", "Metric",
                                              "Ours", "Paper", "Δ", "n"])
    frame = frame.loc[:, [c for c in frame.columns if c not in ("B", "Row") or frame[c].astype(bool).any()]]
    lines = head
    if frame.empty:
        lines += [f"No run of ours fills a cell of this table yet; the paper's numbers are in results/paper/table{table}.csv."]
    else:
        lines += ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
        lines += ["| " + " | ".join(map(str, r)) + " |" for r in frame.itertuples(index=False)]
    wide = side_by_side(merged)
    if wide is not None:
        other = (merged["paper_model"] != merged["model"]).any()
        lines += ["", "Side by side (ours / paper, † § ~ as above" + ("; where `paper_model` is not our model, the "
                  "paper's number is of that other model, shown for reference only" if other else "") + "):", "",
                  "| " + " | ".join(wide.reset_index().columns) + " |", "|" + "---|" * len(wide.reset_index().columns)]
        lines += ["| " + " | ".join(map(str, r)) + " |" for r in wide.reset_index().itertuples(index=False)]
    commands = sorted({command(name, experiments, r) for _, r in stats["missing"].iterrows()})
    if commands:
        lines += ["", f"To fill the {len(stats['missing'])} paper cells without a run of the same model:", ""]
        lines += [f"    {c}" for c in commands[:60]] + ([f"    ... and {len(commands) - 60} more"] if len(commands) > 60 else [])
    (out / f"{name}_vs_paper.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tex_caption = f"Ours vs the paper's Table {table}. " + summary_line(name, stats, experiments)
    body = frame.rename(columns={"Δ": "diff"}) if not frame.empty else pd.DataFrame({"": ["no run yet"]})
    tex = body.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1).to_latex(
        hrules=True, caption=tex_escape(tex_caption), label=f"tab:{name}-vs-paper", position_float="centering")
    (out / f"{name}_vs_paper.tex").write_text(tex, encoding="utf-8")
    return {"name": f"{name}_vs_paper", "cells": stats["cells"], "paper_cells": stats["paper_cells"],
            "reference": stats["reference"], "experiments": sorted(set(experiments)), "summary": summary_line(name, stats, experiments)}


def write_one(name: str, table: int, cells: list[dict], experiments: tuple[str, str], out: Path,
              keys: list[str] = None, paper_dir: Path = PAPER_DIR) -> dict:
    """One comparison from our cells in the paper's schema (dicts with the KEY fields, value, n, failed,
    subset, incomplete; see `cell`). Other scripts (the analysis tables 3 and 19) call this too."""
    paper = table11_paper(paper_dir) if table == 11 else load_paper(table, paper_dir)
    keys = keys or [k for k in KEY if k != "block_size"]
    merged, stats = compare(name, paper, pd.DataFrame(cells), keys)
    return write_comparison(name, table, merged, stats, experiments, out, paper_dir)


def write_all(df: pd.DataFrame, out: Path, paper_dir: Path = PAPER_DIR) -> list[dict]:
    """Every comparison, also when nothing has run (the file then lists the commands)."""
    out.mkdir(parents=True, exist_ok=True)
    return [write_one(name, table, ours_of(df) if not df.empty else [], experiments, out, keys, paper_dir)
            for name, (table, ours_of, experiments, keys) in comparisons().items()]
