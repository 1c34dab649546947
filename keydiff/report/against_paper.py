"""Our numbers next to the paper's, cell by cell: results/tables/<table>_vs_paper.md / .tex.

One line per cell and a summary line per table; written by `python -m keydiff.report.tables` (no command line of
its own). Tolerances and what feeds each table: keydiff/paper/registry.py.
Design: docs/design/reports.md#against-the-paper-reportagainst_paper
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from keydiff.paper.registry import (COUNT_TOLERANCE, COUNTS, GEN_LENGTH, LLAMA_3B, PROMPT_BINS, RELATIVE_TOLERANCES,
                                    SUITE, TABLES, TOLERANCES, PaperTable, config_name)
from keydiff.report.selection import select
from keydiff.report.render import (MARKS_LEGEND, MIN_INTERVAL_N, NA, TOO_FEW, budget_tokens, combined_se, interval, marks, plural,
                                   tex_escape, trimmed)

PAPER_DIR = Path(__file__).resolve().parents[2] / "results" / "paper"
KEY = ["model", "policy", "budget", "block_size", "row", "column", "metric"]


def tolerance(metric: str, paper: float) -> float:
    if metric in COUNTS:
        return COUNT_TOLERANCE
    if metric in RELATIVE_TOLERANCES:
        return RELATIVE_TOLERANCES[metric] * abs(paper)
    return TOLERANCES.get(metric, 0.0)


def load_paper(table: int, paper_dir: Path = PAPER_DIR) -> pd.DataFrame:
    path = paper_dir / f"table{table}.csv"
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    frame["value"] = pd.to_numeric(frame["value"].replace("", np.nan))
    return frame


def paper_caption(table: int, paper_dir: Path = PAPER_DIR) -> str:
    captions = pd.read_csv(paper_dir / "captions.csv")
    return str(captions.set_index("table").loc[table, "caption"])


def selected(df, table: PaperTable, by_task=False, policies=None, budgets=False):
    """The runs the registry declares for `table` (keydiff.report.selection.select, any model: other models
    are shown for reference), every run (subset and incomplete included, then marked), with the marks kept."""
    df = df.assign(is_subset=df["limit"].notna().astype(float),
                   is_incomplete=(~df["complete"].astype(str).eq("True")).astype(float),
                   num_failed=pd.to_numeric(df.get("num_failed", 0), errors="coerce").fillna(0))
    return select(df, table, by_task=by_task, limited=True, models=False, policies=policies, budgets=budgets)


def cell(run, policy, budget, column, metric, value, n=None, row="", block="", se=np.nan):
    """One of our cells; `se`: the standard error of `value` over samples (NaN: none, e.g. a count)."""
    return {"model": run["model"], "policy": policy, "budget": budget, "block_size": block, "row": row,
            "column": column, "metric": metric, "value": value, "se": se,
            "n": run["samples"] if n is None else n, "failed": run.get("num_failed", 0),
            "subset": run.get("is_subset", 0) > 0, "incomplete": run.get("is_incomplete", 0) > 0}


def budget_of(run) -> str:
    return "" if run["policy"] == "full" else str(run["budget_label"])


def paper_label(table: PaperTable, label: str) -> str:
    """The paper's name of our policy in this table (keydiff_w20 is the "KeyDiff" of Tables 4-7)."""
    return table.paper_labels.get(label, label)


def longbench_cells(df, table: PaperTable, avg=True):
    """Per-dataset scores and their average; Table 13 (several block sizes) keys the cells by block size."""
    runs = selected(df, table, policies=["full", *table.policies])
    block_key = len(table.block_sizes) > 1
    cells = []
    for _, run in runs.iterrows():
        block = str(run["block_size"]) if block_key and run["policy"] != "full" else ""
        scores = {d: run.get(f"lb/{d}") for d in table.datasets}
        for d, value in scores.items():
            if pd.notna(value):
                n = run.get(f"metrics/num_samples/{d}")
                cells.append(cell(run, run["policy"], budget_of(run), d, "score", value,
                                  n if pd.notna(n) else run["samples"], block=block, se=run.get(f"se/lb/{d}", np.nan)))
        if avg and all(pd.notna(v) for v in scores.values()):
            cells.append(cell(run, run["policy"], budget_of(run), "avg", "score", float(np.mean(list(scores.values()))),
                              block=block, se=combined_se(run.get(f"se/lb/{d}", np.nan) for d in table.datasets)))
    return cells


def ablation_cells(df, table: PaperTable):
    runs = selected(df, table)
    cells = []
    for _, run in runs.iterrows():
        scores = [run.get(f"lb/{d}") for d in table.datasets]
        if all(pd.notna(s) for s in scores):
            cells.append(cell(run, run["policy"], budget_of(run), "avg", "longbench_avg", float(np.mean(scores)),
                              se=combined_se(run.get(f"se/lb/{d}", np.nan) for d in table.datasets)))
    return cells


def math_cells(df, table: PaperTable):
    runs = selected(df, table, by_task=True)
    cells = []
    for _, run in runs.iterrows():
        policy = paper_label(table, run["policy"])
        budget = "" if policy == "full" else f"{int(run['budget']) // 1024}k"
        for metric, column in [("flex", "metrics/flex"), ("exact", "metrics/exact"), ("avg_gen_length", "metrics/avg_new_tokens")]:
            if pd.notna(run.get(column)):
                cells.append(cell(run, policy, budget, GEN_LENGTH[run["task"]], metric, run[column],
                                  se=run.get(f"se/{column}", np.nan)))
    return cells


def math_subset_cells(df, table: PaperTable):
    """Tables 5/7: row = the subset "num_tokens>XK"; the Full cells come from the evicting run's subset."""
    runs = selected(df, table, by_task=True)
    cells = []
    for _, run in runs.iterrows():
        if pd.isna(run.get("subset/flex")):
            continue
        budget = f"{int(run['budget']) // 1024}k"
        row = f"num_tokens>{budget.upper()}"
        n = run.get("subset/n_samples")
        policy = paper_label(table, run["policy"])
        for metric in ("flex", "exact"):
            cells.append(cell(run, policy, budget, GEN_LENGTH[run["task"]], metric, run[f"subset/{metric}"], n, row,
                              se=run.get(f"se/subset/{metric}", np.nan)))
            cells.append(cell(run, "full", "", GEN_LENGTH[run["task"]], metric, run[f"subset/full_{metric}"], n, row,
                              se=run.get(f"se/subset/full_{metric}", np.nan)))
    return cells


def prompt_length_cells(df, table: PaperTable):
    runs = selected(df, table)
    cells = []
    for model, mine in runs.groupby("model"):
        run = mine.sort_values("policy", key=lambda p: p != "full").iloc[0]
        for dataset in SUITE:
            counts = {b: run.get(f"metrics/prompt_length_bins/{dataset}/{b}") for b in PROMPT_BINS}
            if all(pd.notna(c) for c in counts.values()):
                for b, c in counts.items():
                    cells.append(cell(run, "", "", dataset, ">=8K" if b == ">8K" else b, float(c)))
                cells.append(cell(run, "", "", dataset, "total", float(sum(counts.values()))))
    return cells


def compression_cells(df, table: PaperTable):
    runs = selected(df, table)
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


def phonebook_cells(df, table: PaperTable):
    runs = selected(df, table, by_task=True, budgets=True)
    cells = []
    for _, run in runs.iterrows():
        for column in run.index:
            if column.startswith("metrics/by_size/") and column.endswith("/exact") and pd.notna(run[column]):
                cells.append(cell(run, run["policy"], table.budgets[0], column.split("/")[2], "accuracy", run[column],
                                  se=run.get(f"se/{column}", np.nan)))  # the paper keys Dense by the budget too
    return cells


def niah_cells(df, table: PaperTable):
    runs = selected(df, table, by_task=True, budgets=True)
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


CELLS = {"longbench": longbench_cells, "ablation": ablation_cells, "math500": math_cells,
         "math500_subsets": math_subset_cells, "prompt_lengths": prompt_length_cells,
         "compression": compression_cells, "phonebook": phonebook_cells, "niah_difference": niah_cells}


def comparisons():
    """name -> (paper table, our cells, experiments: (for evicting runs, for full runs), key columns): every
    table of the registry that the paper has. Table 9's paper model is not named (any of ours matches);
    Table 13's cells are keyed by block size."""
    out = {}
    for name, table in TABLES.items():
        if table.paper is None:
            continue
        keys = [k for k in KEY if k != "block_size" or len(table.block_sizes) > 1]
        keys = [k for k in keys if k != "model"] if table.kind == "compression" else keys
        out[name] = (table.paper, lambda df, table=table: CELLS[table.kind](df, table), table.fill, keys)
    return out


def command(name: str, experiments, run: pd.Series) -> str:
    """The run.py line that fills the paper cells of one missing run (`experiments`: the registry's `fill`;
    "table4_gen" + the cell's generation length names the experiment)."""
    table = TABLES.get(name)
    main, full = experiments
    if table is not None and main not in table.reads:
        main = next((e for e in table.reads if e == f"{main}{str(run['column']).lower()}"), table.reads[0])
    parts = ["python run.py", f"experiment={full if run['policy'] == 'full' else main}"]
    if run.get("model") and run["model"] != "llama2-tokenizer":
        parts.append(f"model={run['model']}")
    if run["policy"] not in ("", "full", "keydiff-full"):
        ours = {paper: label for label, paper in table.paper_labels.items()} if table is not None else {}
        parts.append(f"policy={config_name(ours.get(run['policy'], run['policy']))}")
    per_budget = table is None or table.kind not in ("prompt_lengths", "compression")
    if run["budget"] and run["policy"] not in ("full", "keydiff-full") and per_budget:
        parts.append(f"budget={run['budget']}")
    if table is not None and len(table.block_sizes) > 1 and run.get("block_size"):
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
            ref_model = next((m for m in [LLAMA_3B, *paper_models] if m in paper_models))
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


def cell_marks(row) -> str:
    return marks(row["subset"], row["failed"], row["incomplete"])


# The range of each compared metric's per-sample values (keydiff/report/render.py: Wilson inside a range);
# the others (lengths, latencies, a rank correlation) get mean ± 1.96 SE where they have an SE.
RANGES = {"score": (0.0, 100.0), "longbench_avg": (0.0, 100.0), "flex": (0.0, 1.0), "exact": (0.0, 1.0),
          "compression_ratio": (0.0, 1.0), "accuracy": (0.0, 1.0), "recall_difference": (-1.0, 1.0)}


def ours_text(row) -> str:
    """Our value, its 95 % interval where it has one, and the marks: "10.5 [2.1, 30.3]§"; "[n too small]"
    below 5 samples."""
    se, n = row.get("se", np.nan), row.get("n", np.nan)
    bounds = RANGES.get(row["metric"])
    if (se is None or pd.isna(se)) and (bounds is None or n is None or pd.isna(n)):
        return num(row["value"]) + cell_marks(row)
    span = interval(float(row["value"]), se, n, bounds)
    if span is None:
        spread = f" [{TOO_FEW}]" if not pd.isna(n) and float(n) < MIN_INTERVAL_N else ""
    elif bounds is not None and not pd.isna(n) and bounds[0] <= row["value"] <= bounds[1]:
        spread = f" [{num(span[0])}, {num(span[1])}]"
    else:
        spread = f" ± {num((span[1] - span[0]) / 2)}"
    return num(row["value"]) + spread + cell_marks(row)


num = trimmed  # our cells and the paper's: up to 3 decimals, trailing zeros dropped


def summary_line(name, stats, experiments) -> str:
    parts = [f"{stats['cells']} of {plural(stats['paper_cells'], 'paper cell')} compared (same model, complete whole-task runs)"]
    if stats["cells"]:
        parts.append("mean abs. difference " + ", ".join(f"{m} {v:.3g}" for m, v in stats["mean_abs_diff"].items()))
        parts.append(f"{stats['outside']} outside tolerance")
    if stats["reference"]:
        parts.append(f"{plural(stats['reference'], 'cell')} of our models {', '.join(m for m in stats['our_models'] if m not in stats['paper_models'])} "
                     f"shown next to the paper's values for another model, {', '.join(stats['reference_models']) or 'values'}, "
                     "for reference only (different model: no difference)")
    if pd.notna(stats["n_min"]):
        parts.append(f"samples per our cell: {num(stats['n_min'], 0)}-{num(stats['n_max'], 0)}")
    if stats["unmatched"]:
        parts.append(f"{stats['unmatched']} of our cells have no paper value" if stats["unmatched"] != 1
                     else "1 of our cells has no paper value")
    if stats["failed_cells"]:
        parts.append(f"† {plural(stats['failed_cells'], 'cell')} with failed samples (up to {int(stats['failed'])})")
    if stats["subset_cells"]:
        parts.append(f"§ {plural(stats['subset_cells'], 'cell')} from subset runs (task.limit), shown but not counted")
    if stats["incomplete_cells"]:
        parts.append(f"~ {plural(stats['incomplete_cells'], 'cell')} from runs not complete, shown but not counted")
    if stats["garbled"]:
        parts.append(f"{plural(stats['garbled'], 'paper cell')} garbled in the extracted text (results/paper/README.md)")
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
    merged = merged.assign(_full=merged["policy"] != "full", _budget=merged["budget"].replace("", NA).map(budget_tokens)).sort_values(["model", "_full", "policy", "_budget"])
    cells = merged.assign(cell=[f"{ours_text(r)} / {num(p) if pd.notna(p) else '--'}"
                                for p, (_, r) in zip(merged["paper"], merged.iterrows())])
    wide = cells.pivot_table(index=rows, columns="column", values="cell", aggfunc="first", sort=False)
    return wide.fillna("")


def write_comparison(name: str, table: int, merged: pd.DataFrame, stats: dict, experiments, out: Path,
                     paper_dir: Path = PAPER_DIR) -> dict:
    caption = paper_caption(table, paper_dir)
    head = [f"**{name}_vs_paper**: ours next to the paper's Table {table} ({caption[:140]}{'...' if len(caption) > 140 else ''})",
            "", "Summary: " + summary_line(name, stats, experiments), "",
            f"Marks: {MARKS_LEGEND}; n = samples behind our cell; "
            "[low, high] = our 95 % confidence interval over samples (Wilson inside the score's range; ± half-width "
            "for unbounded numbers; \"n too small\" below 5 samples; docs/experiments.md, \"Uncertainty\"); "
            "Δ = ours - paper; ! = outside the tolerance (keydiff/paper/registry.py).", ""]
    table_rows = []
    for _, row in merged.sort_values(["model", "policy", "budget", "block_size", "row", "column", "metric"]).iterrows():
        table_rows.append({"Model": row["model"], "Paper model": row["paper_model"], "Policy": row["policy"],
                           "Budget": row["budget"] or NA, "B": row["block_size"] or "", "Row": row["row"],
                           "Column": row["column"], "Metric": row["metric"], "Ours": ours_text(row),
                           "Paper": num(row["paper"]) if pd.notna(row["paper"]) else ("garbled" if str(row.get("note", "")).startswith("garbled") else NA),
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
        lines += ["", f"To fill the {plural(len(stats['missing']), 'paper cell')} without a run of the same model:", ""]
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
