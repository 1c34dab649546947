"""Every paper table that results/summary.csv can fill, as LaTeX (.tex) and Markdown (.md) in results/tables/.

Why this shape: the CSV is the only input (see collect_results.py), every number in a table is a number
from a run, and a table with no runs says so (its .md/.tex name the experiments to run) instead of
printing anything. Only complete runs of the whole task (no task.limit) count, except in the smoke table. A table reads its own experiment first and
then the experiments listed with it (Table 1 is a column subset of Table 11, the full rows come from
the *_full experiments, ...); seeds of the same configuration are averaged. Best eviction method per
column (within a model / budget group) is bold; the eviction-free rows are references, never bold.
Every cell that averages samples reads "value ± half-width (n=...)": the 95 % interval over samples
(keydiff/uncertainty.py, from the se/<column> standard errors of summary.csv; LongBench cells are
per-dataset, their average combines the datasets' errors). Table 18 and the heatmaps hold one sample per
cell, Table 8 counts prompts: no interval there.

Beside them: <table>_vs_paper (ours next to results/paper/, scripts/paper_compare.py), generic/ (every
experiment and task, whatever ran: scripts/generic_tables.py) and the index results/README.md
(scripts/results_index.py).

    python scripts/make_tables.py [--summary results/summary.csv] [--out results/tables]
                                  [--runs results/runs] [--collect] [--paper results/paper]
The CSV is (re)collected from --runs first when --collect is given, when it is missing, or when a run
finished after it was written. The .tex files need \\usepackage{booktabs,multirow}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collect_results import LONGBENCH, collect  # noqa: E402
import generic_tables  # noqa: E402
import paper_compare  # noqa: E402
import results_index  # noqa: E402
from paper_compare import PAPER_DIR  # noqa: E402

from keydiff.uncertainty import combined_se, format_estimate  # noqa: E402

SUITE = list(LONGBENCH)
ENGLISH = [d for d in SUITE if d not in ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")]
LLAMAS = ["llama-3.1-8b-instruct", "llama-3.2-3b-instruct"]
BASELINES = ["h2o", "tova", "sink", "snapkv", "keydiff"]
BUDGETS = ["1k", "2k", "4k", "6k", "8k"]
NAMES = {"full": "Full", "h2o": "H2O", "tova": "TOVA", "sink": "Sink", "snapkv": "SnapKV", "keydiff": "KeyDiff",
         "knorm": "L2-norm", "keydiff_w10": "KeyDiff + 10%", "keydiff_w20": "KeyDiff + 20%",
         "keydiff_pairwise": "Pairwise", "keydiff_median": "Median", "keydiff_dot": "DotProd",
         "keydiff_euclidean": "Euclidean"}
LONGBENCH_TASKS = ["longbench_full", "longbench"]  # not longbench_e: other samples
GEN_LENGTH = {"math500": "4K", "math500_8k": "8K", "math500_32k": "32K"}
NA = "--"


# ----------------------------------------------------------------------------- selecting runs
def load(summary: Path) -> pd.DataFrame:
    # .copy() de-fragments the wide frame (hundreds of metric columns) once, up front.
    return pd.read_csv(summary, dtype={"block_size": str, "budget_label": str, "policy": str, "model": str}).copy()


def pick(df, experiments, tasks=None, models=None, policies=None, budgets=None, block_sizes=None,
         by_task=True, limited=False):
    """One row per (model, policy, budget, block size[, task]), seeds averaged (samples summed, standard
    errors combined), from the first listed experiment (then the first listed task) that has it. With
    `limited`, a configuration's subset runs count only when it has no whole-task run. `full` ignores budget and block size (it
    evicts nothing). by_task=False merges tasks that are views of one benchmark (longbench = the English
    columns of longbench_full)."""
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
    if block_sizes is not None:
        runs = runs[full | runs["block_size"].isin(block_sizes)]
    task_rank = runs["task"].map(list(tasks).index) if tasks is not None and not by_task else 0
    runs = runs.assign(budget_label=runs["budget_label"].where(~full, NA), block_size=runs["block_size"].where(~full, NA),
                       rank=runs["experiment"].map(experiments.index) * 100 + task_rank)
    key = ["model", "policy", "budget_label", "block_size"] + (["task"] if by_task else [])
    runs = runs[runs["rank"] == runs.groupby(key)["rank"].transform("min")]  # never mix experiments or tasks
    runs = generic_tables.whole_runs_first(runs, key)[0]  # never average a subset run with its whole run
    runs = runs.assign(samples=pd.to_numeric(runs["samples"], errors="coerce"))
    return generic_tables.average_seeds(runs, key, sums=("samples",))


def budget_key(label: str) -> int:
    return -1 if label == NA else BUDGETS.index(label)


# ----------------------------------------------------------------------------- writing tables
def best_mask(table: pd.DataFrame, groups: list[str] | None, columns, exclude_full=True) -> pd.DataFrame:
    """True where a cell holds the maximum of its column within its group of rows (ties all bold)."""
    mask = pd.DataFrame(False, index=table.index, columns=table.columns)
    frame = table.reset_index()
    eligible = ~frame["Method"].isin(["Full", "Dense"]) if exclude_full and "Method" in frame else frame.index >= 0
    keys = [frame[g] for g in groups] if groups else [pd.Series(0, index=frame.index)]
    for column in columns:
        values = frame[column].where(eligible)
        best = values.groupby(keys).transform("max")
        mask[column] = ((values == best) & values.notna()).to_numpy()
    return mask


def fmt(value, precision: int) -> str:
    return NA if pd.isna(value) else f"{value:.{precision}f}" if isinstance(value, (float, np.floating)) else str(value)


INTERVAL_NOTE = ("Cells: value ± half-width of the 95 % confidence interval over samples (1.96 standard errors; "
                 "averages over datasets combine the datasets' errors; README \"Results\"), n = samples.")


def with_intervals(table: pd.DataFrame, se: pd.DataFrame, n: pd.DataFrame, precision: int) -> pd.DataFrame:
    """The cells as text "value ± half-width (n=...)" (keydiff.uncertainty.format_estimate); `se` and `n`
    have the table's shape (NaN where unknown)."""
    text = table.astype(object).copy()
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            value = table.iat[i, j]
            text.iat[i, j] = NA if pd.isna(value) else format_estimate(float(value), float(se.iat[i, j]), n.iat[i, j], precision)
    return text


def write_table(table: pd.DataFrame, mask: pd.DataFrame | None, out: Path, name: str, caption: str, precision=2,
                se: pd.DataFrame | None = None, n: pd.DataFrame | None = None):
    """`name`.tex (booktabs, \\textbf on the mask) and `name`.md (**bold**), same numbers in both. With `se`
    (and `n`), every cell shows its 95 % interval and sample count."""
    mask = mask if mask is not None else pd.DataFrame(False, index=table.index, columns=table.columns)
    if se is not None:
        n = n if n is not None else pd.DataFrame(np.nan, index=table.index, columns=table.columns)
        table = with_intervals(table, se, n, precision)
        caption = f"{caption} {INTERVAL_NOTE}"
    css = pd.DataFrame(np.where(mask, "textbf:--rwrap;", ""), index=table.index, columns=table.columns)
    styler = table.style.format(precision=precision, na_rep=NA, escape="latex").format_index(escape="latex", axis=0)
    styler = styler.format_index(escape="latex", axis=1).apply(lambda _: css, axis=None)
    tex = styler.to_latex(hrules=True, caption=caption, label=f"tab:{name}", position_float="centering",
                          multirow_align="t").replace("±", r"$\pm$")
    (out / f"{name}.tex").write_text(tex, encoding="utf-8")
    flat, flat_mask = table.reset_index(), mask.reset_index(drop=True)
    lines = [f"**{name}**: {caption}", "", "| " + " | ".join(map(str, flat.columns)) + " |",
             "|" + "---|" * len(flat.columns)]
    for i, row in flat.iterrows():
        cells = [fmt(row[c], precision) for c in flat.columns]
        cells = [f"**{v}**" if c in flat_mask and flat_mask.at[i, c] else v for c, v in zip(flat.columns, cells)]
        lines.append("| " + " | ".join(cells) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- the tables
def longbench(df, out, name, caption, experiments, models, policies, datasets, block_sizes=("128",), needs=None,
              tasks=("longbench_full", "longbench")):
    """Rows (model, [B,] method, budget), one column per dataset + their average. Written only when a
    run of a policy in `needs` (default: any policy but full) has scores for these datasets."""
    runs = pick(df, experiments, tasks, models, ["full", *policies], BUDGETS, list(block_sizes), by_task=False)
    lb = [f"lb/{d}" for d in datasets]
    runs = runs.reindex(columns=list(runs.columns) + [c for c in lb if c not in runs.columns])
    if runs[runs["policy"].isin(needs or policies)][lb].isna().all().all():
        return False
    by_block = len(block_sizes) > 1
    rows, errors, counts = [], [], []
    for model in models:
        for block, policy in [(NA, "full")] + [(b, p) for b in block_sizes for p in policies]:
            sel = runs[(runs["model"] == model) & (runs["policy"] == policy) & (runs["block_size"] == block)]
            for _, run in sorted(sel.iterrows(), key=lambda r: budget_key(r[1]["budget_label"])):
                scores = [run[c] for c in lb]
                avg = float(np.mean(scores)) if not np.isnan(scores).any() else np.nan  # over all columns or none
                index = (model, *((block,) if by_block else ()), NAMES.get(policy, policy), run["budget_label"].upper())
                rows.append((index, scores + [avg]))
                ses = [run.get(f"se/lb/{d}", np.nan) for d in datasets]
                errors.append(ses + [combined_se(ses)])
                ns = [run.get(f"metrics/num_samples/{d}", np.nan) for d in datasets]
                counts.append(ns + [float(np.sum(ns)) if not np.isnan(ns).any() else np.nan])
    levels = ["Model", *(["B"] if by_block else []), "Method", "Budget"]
    index = pd.MultiIndex.from_tuples([i for i, _ in rows], names=levels)
    columns = [LONGBENCH[d] for d in datasets] + ["Avg."]
    table = pd.DataFrame([v for _, v in rows], index=index, columns=columns)
    groups = ["Model", *(["B"] if by_block else []), "Budget"]
    write_table(table, best_mask(table, groups, table.columns), out, name, caption,
                se=pd.DataFrame(errors, index=index, columns=columns), n=pd.DataFrame(counts, index=index, columns=columns))
    return True


def ablation(df, out, name, caption, experiments, policies):
    """Tables 15/16: full-suite LongBench average, policies x budgets, Llama-3.2-3B."""
    runs = pick(df, experiments, LONGBENCH_TASKS, ["llama-3.2-3b-instruct"], policies, BUDGETS, ["128"], by_task=False)
    lb = [f"lb/{d}" for d in SUITE]
    if not set(policies[1:]) & set(runs["policy"]) or not set(lb) <= set(runs.columns):
        return False  # the KeyDiff row alone (from table11) is not the ablation
    se_lb = runs.reindex(columns=[f"se/{c}" for c in lb])
    runs = runs.assign(avg=runs[lb].mean(axis=1, skipna=False), avg_se=[combined_se(r) for r in se_lb.to_numpy()])
    shaped = {}
    for values in ("avg", "avg_se", "samples"):
        frame = runs.pivot_table(index="policy", columns="budget_label", values=values, dropna=False)
        frame = frame.reindex(index=[p for p in policies if p in frame.index],
                              columns=[b for b in BUDGETS if b in frame.columns])
        frame.index = pd.Index([NAMES.get(p, p) for p in frame.index], name="Method")
        frame.columns = [c.upper() for c in frame.columns]
        shaped[values] = frame
    table = shaped["avg"]
    write_table(table, best_mask(table, None, table.columns), out, name, caption, se=shaped["avg_se"],
                n=shaped["samples"])
    return True


def compression(df, out):
    """Table 9: mean compression ratio per LongBench dataset and budget (prompt lengths of one model)."""
    runs = pick(df, ["table11", "table1", "table12", "table13", "table14"], LONGBENCH_TASKS, budgets=BUDGETS[1:],
                block_sizes=["128"], by_task=False)
    runs = runs[runs["policy"] != "full"]
    if runs.empty or not any(c.startswith("cr/") for c in runs.columns):
        return False
    model = next((m for m in LLAMAS if m in set(runs["model"])), runs["model"].iloc[0])
    cr = [c for c in (f"cr/{d}" for d in SUITE) if c in runs.columns]
    mine = runs[runs["model"] == model].reindex(columns=list(runs.columns) + [
        c for c in [f"se/{c}" for c in cr] + [f"metrics/num_samples/{c[3:]}" for c in cr] if c not in runs.columns])

    def per_dataset(prefix: str) -> pd.DataFrame:  # equal across policies (the same prompts): their mean
        frame = mine.groupby("budget_label")[[f"{prefix}{c[3:]}" for c in cr]].mean().T
        frame.index = pd.Index([c[len(prefix):] for c in frame.index])
        return frame.reindex(columns=[b for b in BUDGETS if b in frame.columns])

    table = per_dataset("cr/").dropna(how="all")
    se, n = per_dataset("se/cr/").reindex(table.index), per_dataset("metrics/num_samples/").reindex(table.index)
    table.loc["Average"] = table.mean(axis=0, skipna=False)
    se.loc["Average"] = [combined_se(se[c]) for c in se.columns]
    n.loc["Average"] = n.sum(axis=0, min_count=len(n))
    for frame in (table, se, n):
        frame.index = pd.Index([LONGBENCH.get(d, d) for d in frame.index], name="Dataset")
        frame.columns = [c.upper() for c in frame.columns]
    write_table(table, None, out, "table9", f"Average compression ratio min(N / L, 1) per budget ({model} prompts): "
                "the fraction of the prompt the cache keeps (kept N/L).", se=se, n=n)
    return True


def prompt_lengths(df, out):
    """Table 8: how many prompts of each LongBench dataset fall in each token-length bin (one model's tokenizer).

    Prompt lengths do not depend on the policy or budget, so any complete LongBench run of the model counts;
    the full-cache runs are preferred.
    """
    runs = pick(df, ["table11_full", "table11", "table1_full", "table1"], LONGBENCH_TASKS, by_task=False)
    columns = [c for c in runs.columns if c.startswith("metrics/prompt_length_bins/")]
    if runs.empty or not columns:
        return False
    runs = runs[runs[columns].notna().any(axis=1)]  # runs written before the bins existed have none
    if runs.empty:
        return False
    model = next((m for m in LLAMAS if m in set(runs["model"])), runs["model"].iloc[0])
    mine = runs[runs["model"] == model]
    first = mine[mine["policy"] == "full"].iloc[0] if (mine["policy"] == "full").any() else mine.iloc[0]
    bins = ["<=2K", "2K-4K", "4K-6K", "6K-8K", ">8K"]
    rows = {}
    for dataset in SUITE:
        counts = [first.get(f"metrics/prompt_length_bins/{dataset}/{b}") for b in bins]
        if all(pd.notna(c) for c in counts):
            rows[LONGBENCH[dataset]] = [int(c) for c in counts] + [int(sum(counts))]
    if not rows:
        return False
    table = pd.DataFrame.from_dict(rows, orient="index", columns=bins + ["Total"])
    table.index.name = "Dataset"
    write_table(table, None, out, "table8", f"LongBench prompt lengths in tokens ({model} tokenizer, K = 1024).")
    return True


def math500(df, out, name, model, caption):
    runs = pick(df, MATH, list(GEN_LENGTH), [model], ["full", "keydiff_w20", "snapkv"])
    if not (runs["policy"] != "full").any():
        return False
    rows = []
    for task, gen in GEN_LENGTH.items():
        for policy in ["full", "keydiff_w20", "snapkv"]:
            sel = runs[(runs["task"] == task) & (runs["policy"] == policy)]
            for _, run in sorted(sel.iterrows(), key=lambda r: budget_key(r[1]["budget_label"])):
                budget = NA if policy == "full" else str(int(run["budget"]))
                metrics = ["metrics/flex", "metrics/exact", "metrics/avg_new_tokens"]
                rows.append(((gen, budget, NAMES[policy]), [run.get(m) for m in metrics],
                             [run.get(f"se/{m}", np.nan) for m in metrics], [run["samples"]] * 3))
    index = pd.MultiIndex.from_tuples([i for i, *_ in rows], names=["Max Gen. Length", "Budget", "Method"])
    columns = ["Flex Match", "Exact Match", "Avg. Gen. Length"]
    table = pd.DataFrame([v for _, v, *_ in rows], index=index, columns=columns).astype(float)
    se = pd.DataFrame([e for *_, e, _ in rows], index=index, columns=columns).astype(float)
    se["Avg. Gen. Length"] = np.nan  # lengths are printed as whole tokens, their SE in summary.csv
    table["Avg. Gen. Length"] = table["Avg. Gen. Length"].round()
    mask = best_mask(table, ["Max Gen. Length", "Budget"], ["Flex Match", "Exact Match"])
    text = with_intervals(table[columns[:2]], se[columns[:2]], pd.DataFrame([c for *_, c in rows], index=index,
                                                                           columns=columns)[columns[:2]], 3)
    text["Avg. Gen. Length"] = table["Avg. Gen. Length"].map(lambda v: NA if pd.isna(v) else str(int(v)))
    write_table(text, mask, out, name, f"{caption} {INTERVAL_NOTE}", 3)
    return True


def math500_subsets(df, out, name, model, caption):
    runs = pick(df, MATH, list(GEN_LENGTH), [model], ["keydiff_w20", "snapkv"])
    if runs.empty or "subset/flex" not in runs:
        return False
    rows = []
    for task, gen in GEN_LENGTH.items():
        sel = runs[(runs["task"] == task) & runs["subset/flex"].notna()]
        for budget in sorted(sel["budget"].unique()):
            at = sel[sel["budget"] == budget]
            first = at.iloc[0]
            subset = f"Num Tokens > {int(budget)} ({int(first['subset/n_problems'])}/{int(first['subset/total_problems'])})"
            n = first["subset/n_samples"]
            rows.append(((gen, subset, "Full"), [first["subset/full_flex"], first["subset/full_exact"]],
                         [first.get(f"se/subset/full_{m}", np.nan) for m in ("flex", "exact")], n))
            for policy in ["keydiff_w20", "snapkv"]:
                for _, run in at[at["policy"] == policy].iterrows():
                    rows.append(((gen, subset, NAMES[policy]), [run["subset/flex"], run["subset/exact"]],
                                 [run.get(f"se/subset/{m}", np.nan) for m in ("flex", "exact")], run["subset/n_samples"]))
    if not rows:
        return False
    index = pd.MultiIndex.from_tuples([r[0] for r in rows], names=["Max Gen. Length", "Subset", "Method"])
    table = pd.DataFrame([r[1] for r in rows], index=index, columns=["Flex", "Exact"]).astype(float)
    se = pd.DataFrame([r[2] for r in rows], index=index, columns=table.columns).astype(float)
    n = pd.DataFrame([[r[3]] * 2 for r in rows], index=index, columns=table.columns)
    write_table(table, best_mask(table, ["Max Gen. Length", "Subset"], table.columns), out, name, caption, 3, se=se, n=n)
    return True


def phonebook(df, out):
    runs = pick(df, ["table17"], ["phonebook"], ["llama-3.2-3b-instruct"], ["full", "keydiff", "tova"], ["6k"], ["128"])
    sizes = sorted((c.split("/")[2] for c in runs.columns if c.startswith("metrics/by_size/") and c.endswith("/exact")), key=int)
    if runs.empty or not sizes:
        return False
    def shaped(pattern):
        frame = runs.set_index("policy").reindex(columns=[pattern.format(s) for s in sizes])
        frame = frame.reindex([p for p in ["full", "keydiff", "tova"] if p in frame.index]).astype(float)
        frame.index = pd.Index(["Dense" if p == "full" else NAMES[p] for p in frame.index], name="Method")
        frame.columns = sizes
        return frame

    table = shaped("metrics/by_size/{}/exact")
    write_table(table, best_mask(table, None, table.columns), out, "table17",
                "Phonebook lookup accuracy by book size, Llama-3.2-3B-Instruct, 6K budget, B = 128.", 1,
                se=shaped("se/metrics/by_size/{}/exact"), n=shaped("metrics/by_size/{}/n"))
    return True


def niah_difference(df, out):
    runs = pick(df, ["fig6_niah"], ["niah"], ["llama-3.2-3b-instruct"], ["full", "keydiff"], ["6k"], ["128"])
    cells = [c for c in runs.columns if c.startswith("metrics/needle_recall_by_cell/")]
    if set(runs["policy"]) != {"full", "keydiff"} or not cells:
        return False
    diff = runs.set_index("policy").loc["keydiff", cells] - runs.set_index("policy").loc["full", cells]
    parts = [c.split("/")[2:] for c in cells]
    table = pd.Series(diff.to_numpy(dtype=float), index=pd.MultiIndex.from_tuples(parts)).unstack(0)
    table = table.dropna(how="all").dropna(axis=1, how="all")  # cells of other NIAH grids in the CSV
    table = table.loc[sorted(table.index, key=float), sorted(table.columns, key=float)]
    table.index.name = "Depth"
    write_table(table, None, out, "table18", "Needle recall difference (KeyDiff - Full), Llama-3.2-3B-Instruct, 6K, B = 128.")
    return True


def smoke(df, out):
    runs = pick(df, ["smoke"], limited=True)
    if runs.empty:
        return False
    metric = " / ".join(sorted({generic_tables.primary_metric(t) for t in runs["task"]}))
    cols = {"score": f"Score ({metric})", "mean_compression_ratio": "Kept N/L", "mean_ttft_s": "TTFT (s)"}
    runs = runs.reindex(columns=list(runs.columns) + [c for c in ("se/score", "limit") if c not in runs.columns])
    table = runs.set_index(["task", "model", "policy", "budget_label", "block_size"])[list(cols)].rename(columns=cols)
    table.index.names = ["Task", "Model", "Method", "Budget", "B"]
    mask = best_mask(table, None, [cols["score"]], exclude_full=False)
    marks = ["§" if pd.notna(limit) else "" for limit in runs["limit"]]
    table[cols["score"]] = [format_estimate(v, e, n, 3) + m
                            for v, e, n, m in zip(runs["score"], runs["se/score"], runs["samples"], marks)]
    write_table(table, mask, out, "smoke", "Smoke sweep (§: task.limit applies: not paper numbers). "
                f"{INTERVAL_NOTE} Kept N/L: mean fraction of the prompt kept, min(N / L, 1) (the paper's compression ratio).", 3)
    return True


MATH = ["table4_gen4k", "table4_gen8k", "table4_gen32k", "table4_full"]
LLAMA_R1, QWEN_R1 = "deepseek-r1-distill-llama-8b", "deepseek-r1-distill-qwen-7b"
SUBSET = "Math-500 on the samples whose full-cache context exceeds the budget"
TABLES = {  # name -> (builder, the experiments to run for it)
    "table1": (lambda df, out: longbench(df, out, "table1", "LongBench English subset, B = 128.",
                                         ["table1", "table11", "table1_full", "table11_full"], LLAMAS, BASELINES, ENGLISH,
                                         tasks=("longbench", "longbench_full")),
               ["table1", "table1_full"]),
    "table4": (lambda df, out: math500(df, out, "table4", LLAMA_R1, "Math-500, DeepSeek-R1-Distill-Llama-8B."), MATH),
    "table5": (lambda df, out: math500_subsets(df, out, "table5", LLAMA_R1, f"{SUBSET}, DeepSeek-R1-Distill-Llama-8B."), MATH),
    "table6": (lambda df, out: math500(df, out, "table6", QWEN_R1, "Math-500, DeepSeek-R1-Distill-Qwen-7B."), MATH),
    "table7": (lambda df, out: math500_subsets(df, out, "table7", QWEN_R1, f"{SUBSET}, DeepSeek-R1-Distill-Qwen-7B."), MATH),
    "table8": (prompt_lengths, ["table11_full"]),
    "table9": (compression, ["table11"]),
    "table10": (lambda df, out: longbench(df, out, "table10", "LongBench with B = inf (no NarrativeQA).",
                                          ["table10", "table11_full", "table1_full"], LLAMAS, BASELINES, SUITE[1:], ("inf",)),
                ["table10", "table11_full"]),
    "table11": (lambda df, out: longbench(df, out, "table11", "Full LongBench suite, B = 128.", ["table11", "table11_full"],
                                          LLAMAS, BASELINES + ["knorm"], SUITE), ["table11", "table11_full"]),
    "table12": (lambda df, out: longbench(df, out, "table12", "Full LongBench suite, Qwen-2.5, B = 128.",
                                          ["table12", "table12_full"], ["qwen2.5-7b-instruct", "qwen2.5-3b-instruct"],
                                          BASELINES, SUITE), ["table12", "table12_full"]),
    "table13": (lambda df, out: longbench(df, out, "table13", "Llama-3.2-3B-Instruct, block sizes B = 64 and 256.",
                                          ["table13", "table11_full"], ["llama-3.2-3b-instruct"], BASELINES, SUITE,
                                          ("64", "256")), ["table13", "table11_full"]),
    "table14": (lambda df, out: longbench(df, out, "table14", "KeyDiff + recent tokens, B = 128.",
                                          ["table14", "table11", "table11_full"], LLAMAS,
                                          ["sink", "snapkv", "keydiff_w10", "keydiff_w20", "keydiff"], SUITE,
                                          needs=["keydiff_w10", "keydiff_w20"]),
                ["table14", "table11", "table11_full"]),
    "table15": (lambda df, out: ablation(df, out, "table15", "Anchor ablation: full LongBench average, Llama-3.2-3B-Instruct.",
                                         ["table15", "table11"], ["keydiff", "keydiff_pairwise", "keydiff_median"]), ["table15"]),
    "table16": (lambda df, out: ablation(df, out, "table16", "Similarity ablation: full LongBench average, Llama-3.2-3B-Instruct.",
                                         ["table16", "table11"], ["keydiff", "keydiff_dot", "keydiff_euclidean"]), ["table16"]),
    "table17": (phonebook, ["table17"]),
    "table18": (niah_difference, ["fig6_niah"]),
    "smoke": (smoke, ["smoke"]),
}


def ensure_summary(summary: Path, runs: Path, force: bool = False) -> None:
    """(Re)collect when asked, when the CSV is missing, or when a run finished after it was written."""
    newest = max((p.stat().st_mtime for p in runs.glob("**/summary.json")), default=0) if runs.is_dir() else 0
    if force or not summary.exists() or newest > summary.stat().st_mtime:
        frame = collect(runs, summary)
        print(f"collected {len(frame)} runs from {runs} -> {summary}")


def placeholder(out: Path, name: str, experiments: list[str]) -> None:
    """A table with no runs yet still gets its files, saying what to run (so every file always exists)."""
    commands = [f"python run.py experiment={e}" for e in experiments]
    (out / f"{name}.md").write_text(f"**{name}**: no results yet. Run:\n\n" + "".join(f"    {c}\n" for c in commands),
                                    encoding="utf-8")
    (out / f"{name}.tex").write_text(f"% {name}: no results yet. Run: " + "; ".join(commands) + "\n", encoding="utf-8")


def main(summary: Path, out: Path, paper: Path = PAPER_DIR, index: Path | None = None) -> list[str]:
    """Paper tables, ours-vs-paper comparisons and generic per-experiment tables; then results/README.md
    (`index`, default: the README beside `out`) is regenerated. Returns the names of the tables with data."""
    df = load(summary)
    out.mkdir(parents=True, exist_ok=True)
    written, entries = [], []
    for name, (build, experiments) in TABLES.items():
        if not df.empty and build(df, out):
            written.append(name)
            print(f"{name}: {out / name}.tex, .md")
        else:
            placeholder(out, name, experiments)
            print(f"no results for {name} (run: " + "; ".join(f"python run.py experiment={e}" for e in experiments) + ")")
        entries.append({"kind": "paper", "name": name, "path": f"tables/{name}.md", "experiments": experiments,
                        "status": "written" if name in written else "no data yet"})
    for item in paper_compare.write_all(df, out, paper):
        entries.append({"kind": "vs_paper", "name": item["name"], "path": f"tables/{item['name']}.md",
                        "experiments": item["experiments"], "status": item["summary"]})
        print(f"{item['name']}: {item['cells']} of {item['paper_cells']} paper cells compared")
    for item in generic_tables.write_generic(df, out / "generic"):
        written.append(f"generic/{item['name']}")
        entries.append({"kind": "generic", "name": item["name"], "path": f"tables/{item['path']}",
                        "experiments": [item["experiment"]], "status": item["status"]})
        print(f"generic/{item['name']}: {item['status']}")
    if not any(e["kind"] == "generic" for e in entries):
        print("no runs in the summary yet: no generic tables (run anything, e.g. python run.py, then make tables)")
    results_index.write_part(out.parent if index is None else index.parent, "tables", entries)
    results_index.write(out.parent if index is None else index.parent, summary)
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--summary", type=Path, default=Path("results/summary.csv"))
    parser.add_argument("--out", type=Path, default=Path("results/tables"))
    parser.add_argument("--runs", "--results", type=Path, default=Path("results/runs"), help="run directories")
    parser.add_argument("--collect", action="store_true", help="re-collect --runs into --summary first")
    parser.add_argument("--paper", type=Path, default=PAPER_DIR, help="the paper's numbers (results/paper)")
    args = parser.parse_args()
    ensure_summary(args.summary, args.runs, args.collect)
    main(args.summary, args.out, args.paper)
