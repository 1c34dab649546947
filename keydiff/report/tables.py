"""Every paper table that results/summary.csv can fill, as LaTeX (.tex) and Markdown (.md) in results/tables/.

Also writes the comparisons with the paper, generic/, the leaderboard, the protocol comparison and the index.

    python -m keydiff.report.tables [--summary results/summary.csv] [--out results/tables]
                                    [--runs results/runs] [--collect] [--paper results/paper]

Design: docs/design/reports.md#paper-tables-reporttables-and-the-registry-paperregistry
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from keydiff.report import against_paper as compare
from keydiff.paper.registry import GEN_LENGTH, LONGBENCH, PROMPT_BINS, SUITE, TABLES, PaperTable, display_name
from keydiff.report import generic, leaderboard, protocol
from keydiff.report import index as results_index
from keydiff.report.collect import add_results_arguments, ensure_summary
from keydiff.report.selection import load, select
from keydiff.report.render import (INTERVAL_NOTE, NA, best_mask, budget_tokens, combined_se, format_estimate,
                                   marks, metric_range, plural, with_intervals, write_table)
from keydiff.cli import ArgumentParser

UNIT, PERCENT = (0.0, 1.0), (0.0, 100.0)  # the range of a score: 0-1, or LongBench's 0-100

PAPER_DIR = compare.PAPER_DIR


def longbench(df, out, table: PaperTable) -> bool:
    """Rows (model, [B,] method, budget), one column per dataset + their average. Written only when a
    run of a policy in `needs` (default: any policy but full) has scores for these datasets."""
    policies, datasets, block_sizes = table.policies, table.datasets, table.block_sizes
    runs = select(df, table, policies=["full", *policies])
    lb = [f"lb/{d}" for d in datasets]
    runs = runs.reindex(columns=list(runs.columns) + [c for c in lb if c not in runs.columns])
    if runs[runs["policy"].isin(table.needs or policies)][lb].isna().all().all():
        return False
    by_block = len(block_sizes) > 1
    rows, errors, counts = [], [], []
    for model in table.models:
        for block, policy in [(NA, "full")] + [(b, p) for b in block_sizes for p in policies]:
            sel = runs[(runs["model"] == model) & (runs["policy"] == policy) & (runs["block_size"] == block)]
            for _, run in sorted(sel.iterrows(), key=lambda r: budget_tokens(r[1]["budget_label"])):
                scores = [run[c] for c in lb]
                avg = float(np.mean(scores)) if not np.isnan(scores).any() else np.nan  # over all columns or none
                index = (model, *((block,) if by_block else ()), display_name(policy), run["budget_label"].upper())
                rows.append((index, scores + [avg]))
                ses = [run.get(f"se/lb/{d}", np.nan) for d in datasets]
                errors.append(ses + [combined_se(ses)])
                ns = [run.get(f"metrics/num_samples/{d}", np.nan) for d in datasets]
                counts.append(ns + [float(np.sum(ns)) if not np.isnan(ns).any() else np.nan])
    levels = ["Model", *(["B"] if by_block else []), "Method", "Budget"]
    index = pd.MultiIndex.from_tuples([i for i, _ in rows], names=levels)
    columns = [LONGBENCH[d] for d in datasets] + ["Avg."]
    frame = pd.DataFrame([v for _, v in rows], index=index, columns=columns)
    groups = ["Model", *(["B"] if by_block else []), "Budget"]
    write_table(frame, best_mask(frame, groups, frame.columns), out, table.name, table.caption,
                se=pd.DataFrame(errors, index=index, columns=columns), n=pd.DataFrame(counts, index=index, columns=columns),
                bounds=PERCENT)
    return True


def ablation(df, out, table: PaperTable) -> bool:
    """Tables 15/16: full-suite LongBench average, policies x budgets, Llama-3.2-3B."""
    policies = table.policies
    runs = select(df, table)
    lb = [f"lb/{d}" for d in table.datasets]
    if not set(policies[1:]) & set(runs["policy"]) or not set(lb) <= set(runs.columns):
        return False  # the KeyDiff row alone (from table11) is not the ablation
    se_lb = runs.reindex(columns=[f"se/{c}" for c in lb])
    runs = runs.assign(avg=runs[lb].mean(axis=1, skipna=False), avg_se=[combined_se(r) for r in se_lb.to_numpy()])
    shaped = {}
    for values in ("avg", "avg_se", "samples"):
        frame = runs.pivot_table(index="policy", columns="budget_label", values=values, dropna=False)
        frame = frame.reindex(index=[p for p in policies if p in frame.index],
                              columns=[b for b in table.budgets if b in frame.columns])
        frame.index = pd.Index([display_name(p) for p in frame.index], name="Method")
        frame.columns = [c.upper() for c in frame.columns]
        shaped[values] = frame
    frame = shaped["avg"]
    write_table(frame, best_mask(frame, None, frame.columns), out, table.name, table.caption, se=shaped["avg_se"],
                n=shaped["samples"], bounds=PERCENT)
    return True


def preferred_model(runs: pd.DataFrame, table: PaperTable) -> str:
    """The first of the table's models that ran, else any model that did (the offline default)."""
    return next((m for m in table.models if m in set(runs["model"])), runs["model"].iloc[0])


def compression(df, out, table: PaperTable) -> bool:
    """Table 9: mean compression ratio per LongBench dataset and budget (prompt lengths of one model); the
    Average row is over prompts (datasets weighted by their prompt counts), as the paper's."""
    runs = select(df, table, models=False)
    runs = runs[runs["policy"] != "full"]
    if runs.empty or not any(c.startswith("cr/") for c in runs.columns):
        return False
    model = preferred_model(runs, table)
    cr = [c for c in (f"cr/{d}" for d in SUITE) if c in runs.columns]
    mine = runs[runs["model"] == model].reindex(columns=list(runs.columns) + [
        c for c in [f"se/{c}" for c in cr] + [f"metrics/num_samples/{c[3:]}" for c in cr] if c not in runs.columns])

    def per_dataset(prefix: str) -> pd.DataFrame:  # equal across policies (the same prompts): their mean
        frame = mine.groupby("budget_label")[[f"{prefix}{c[3:]}" for c in cr]].mean().T
        frame.index = pd.Index([c[len(prefix):] for c in frame.index])
        return frame.reindex(columns=[b for b in table.budgets if b in frame.columns])

    frame = per_dataset("cr/").dropna(how="all")
    se, n = per_dataset("se/cr/").reindex(frame.index), per_dataset("metrics/num_samples/").reindex(frame.index)
    # The paper's average is over prompts (§F.3: "0.31 ... indicates 69% of input prompts are compressed"), as
    # in keydiff.report.against_paper: datasets weighted by their prompts, the SE sqrt(sum (n_d / n * SE_d)^2).
    total = n.sum(axis=0, min_count=len(n))
    frame.loc["Average"] = (frame * n).sum(axis=0, min_count=len(n)) / total
    se.loc["Average"] = np.sqrt(((n / total * se) ** 2).sum(axis=0, min_count=len(n)))
    n.loc["Average"] = total
    for part in (frame, se, n):
        part.index = pd.Index([LONGBENCH.get(d, d) for d in part.index], name="Dataset")
        part.columns = [c.upper() for c in part.columns]
    write_table(frame, None, out, table.name, f"{table.caption} ({model} prompts): "
                "the fraction of the prompt the cache keeps (kept N/L).", se=se, n=n, bounds=UNIT, measure=True)
    return True


def prompt_lengths(df, out, table: PaperTable) -> bool:
    """Table 8: how many prompts of each LongBench dataset fall in each token-length bin (one model's tokenizer),
    from any complete LongBench run of the model (lengths do not depend on the policy), full-cache runs first."""
    runs = select(df, table, models=False)
    columns = [c for c in runs.columns if c.startswith("metrics/prompt_length_bins/")]
    if runs.empty or not columns:
        return False
    runs = runs[runs[columns].notna().any(axis=1)]  # runs written before the bins existed have none
    if runs.empty:
        return False
    model = preferred_model(runs, table)
    mine = runs[runs["model"] == model]
    first = mine[mine["policy"] == "full"].iloc[0] if (mine["policy"] == "full").any() else mine.iloc[0]
    bins = PROMPT_BINS
    rows = {}
    for dataset in SUITE:
        counts = [first.get(f"metrics/prompt_length_bins/{dataset}/{b}") for b in bins]
        if all(pd.notna(c) for c in counts):
            rows[LONGBENCH[dataset]] = [int(c) for c in counts] + [int(sum(counts))]
    if not rows:
        return False
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=bins + ["Total"])
    frame.index.name = "Dataset"
    write_table(frame, None, out, table.name, f"{table.caption} ({model} tokenizer, K = 1024).")
    return True


def math500(df, out, table: PaperTable) -> bool:
    runs = select(df, table, by_task=True)
    if not (runs["policy"] != "full").any():
        return False
    rows = []
    for task, gen in GEN_LENGTH.items():
        for policy in table.policies:
            sel = runs[(runs["task"] == task) & (runs["policy"] == policy)]
            for _, run in sorted(sel.iterrows(), key=lambda r: budget_tokens(r[1]["budget_label"])):
                budget = NA if policy == "full" else str(int(run["budget"]))
                metrics = ["metrics/flex", "metrics/exact", "metrics/avg_new_tokens"]
                rows.append(((gen, budget, display_name(policy)), [run.get(m) for m in metrics],
                             [run.get(f"se/{m}", np.nan) for m in metrics], [run["samples"]] * 3))
    index = pd.MultiIndex.from_tuples([i for i, *_ in rows], names=["Max Gen. Length", "Budget", "Method"])
    columns = ["Flex Match", "Exact Match", "Avg. Gen. Length"]
    frame = pd.DataFrame([v for _, v, *_ in rows], index=index, columns=columns).astype(float)
    se = pd.DataFrame([e for *_, e, _ in rows], index=index, columns=columns).astype(float)
    se["Avg. Gen. Length"] = np.nan  # lengths are printed as whole tokens, their SE in summary.csv
    frame["Avg. Gen. Length"] = frame["Avg. Gen. Length"].round()
    mask = best_mask(frame, ["Max Gen. Length", "Budget"], ["Flex Match", "Exact Match"])
    text = with_intervals(frame[columns[:2]], se[columns[:2]], pd.DataFrame([c for *_, c in rows], index=index,
                                                                           columns=columns)[columns[:2]], 3, UNIT)
    text["Avg. Gen. Length"] = frame["Avg. Gen. Length"].map(lambda v: NA if pd.isna(v) else str(int(v)))
    write_table(text, mask, out, table.name, f"{table.caption} {INTERVAL_NOTE}", 3)
    return True


def math500_subsets(df, out, table: PaperTable) -> bool:
    runs = select(df, table, by_task=True)
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
            for policy in table.policies:
                for _, run in at[at["policy"] == policy].iterrows():
                    rows.append(((gen, subset, display_name(policy)), [run["subset/flex"], run["subset/exact"]],
                                 [run.get(f"se/subset/{m}", np.nan) for m in ("flex", "exact")], run["subset/n_samples"]))
    if not rows:
        return False
    index = pd.MultiIndex.from_tuples([r[0] for r in rows], names=["Max Gen. Length", "Subset", "Method"])
    frame = pd.DataFrame([r[1] for r in rows], index=index, columns=["Flex", "Exact"]).astype(float)
    se = pd.DataFrame([r[2] for r in rows], index=index, columns=frame.columns).astype(float)
    n = pd.DataFrame([[r[3]] * 2 for r in rows], index=index, columns=frame.columns)
    write_table(frame, best_mask(frame, ["Max Gen. Length", "Subset"], frame.columns), out, table.name,
                table.caption, 3, se=se, n=n, bounds=UNIT)
    return True


def phonebook(df, out, table: PaperTable) -> bool:
    runs = select(df, table, by_task=True)
    sizes = sorted((c.split("/")[2] for c in runs.columns if c.startswith("metrics/by_size/") and c.endswith("/exact")), key=int)
    if runs.empty or not sizes:
        return False

    def shaped(pattern):
        frame = runs.set_index("policy").reindex(columns=[pattern.format(s) for s in sizes])
        frame = frame.reindex([p for p in table.policies if p in frame.index]).astype(float)
        frame.index = pd.Index(["Dense" if p == "full" else display_name(p) for p in frame.index], name="Method")
        frame.columns = sizes
        return frame

    frame = shaped("metrics/by_size/{}/exact")
    write_table(frame, best_mask(frame, None, frame.columns), out, table.name, table.caption, 1,
                se=shaped("se/metrics/by_size/{}/exact"), n=shaped("metrics/by_size/{}/n"), bounds=UNIT)
    return True


def niah_difference(df, out, table: PaperTable) -> bool:
    runs = select(df, table, by_task=True)
    cells = [c for c in runs.columns if c.startswith("metrics/needle_recall_by_cell/")]
    if set(runs["policy"]) != set(table.policies) or not cells:
        return False
    diff = runs.set_index("policy").loc["keydiff", cells] - runs.set_index("policy").loc["full", cells]
    parts = [c.split("/")[2:] for c in cells]
    frame = pd.Series(diff.to_numpy(dtype=float), index=pd.MultiIndex.from_tuples(parts)).unstack(0)
    frame = frame.dropna(how="all").dropna(axis=1, how="all")  # cells of other NIAH grids in the CSV
    frame = frame.loc[sorted(frame.index, key=float), sorted(frame.columns, key=float)]
    frame.index.name = "Depth"
    write_table(frame, None, out, table.name, table.caption)
    return True


def smoke(df, out, table: PaperTable) -> bool:
    runs = select(df, table, by_task=True, limited=True)
    if runs.empty:
        return False
    metric = " / ".join(sorted({generic.primary_metric(t) for t in runs["task"]}))
    cols = {"score": f"Score ({metric})", "mean_kept_ratio": "Kept N/L", "mean_ttft_s": "TTFT (s)"}
    runs = runs.reindex(columns=list(runs.columns) + [c for c in ("se/score", "limit") if c not in runs.columns])
    frame = runs.set_index(["task", "model", "policy", "budget_label", "block_size"])[list(cols)].rename(columns=cols)
    frame.index.names = ["Task", "Model", "Method", "Budget", "B"]
    mask = best_mask(frame, None, [cols["score"]], exclude_full=False)
    subset = [marks(pd.notna(limit), 0, False) for limit in runs["limit"]]
    frame[cols["score"]] = [format_estimate(v, e, n, 3, metric_range("score", task)) + m
                            for v, e, n, m, task in zip(runs["score"], runs["se/score"], runs["samples"], subset, runs["task"])]
    write_table(frame, mask, out, table.name, f"{table.caption} (§: task.limit applies: not paper numbers). "
                f"{INTERVAL_NOTE} Kept N/L: mean fraction of the prompt kept, min(N / L, 1) (the paper's compression ratio).", 3)
    return True


BUILDERS = {"longbench": longbench, "ablation": ablation, "compression": compression, "prompt_lengths": prompt_lengths,
            "math500": math500, "math500_subsets": math500_subsets, "phonebook": phonebook,
            "niah_difference": niah_difference, "smoke": smoke,
            "leaderboard": leaderboard.write, "protocol": protocol.write}  # the registry's layout kinds


def placeholder(out: Path, name: str, experiments: list[str]) -> None:
    """A table with no runs yet still gets its files, saying what to run (so every file always exists)."""
    commands = [f"python run.py experiment={e}" for e in experiments]
    (out / f"{name}.md").write_text(f"**{name}**: no results yet. Run:\n\n" + "".join(f"    {c}\n" for c in commands),
                                    encoding="utf-8")
    (out / f"{name}.tex").write_text(f"% {name}: no results yet. Run: " + "; ".join(commands) + "\n", encoding="utf-8")


def skipped_line(empty: list[str], uncompared: list[str]) -> str:
    """What had nothing to show, in one line (each placeholder file says what to run)."""
    if not empty and not uncompared:
        return "every paper table has results"
    parts = [f"no results yet for {plural(len(empty), 'paper table')} ({', '.join(empty)})"] if empty else []
    parts += [f"no paper cell compared in {plural(len(uncompared), 'comparison')}"] if uncompared else []
    return "; ".join(parts) + " (each table's .md says what to run)"


def main(summary: Path, out: Path, paper: Path = PAPER_DIR, index: Path | None = None) -> list[str]:
    """Paper tables, ours-vs-paper comparisons and generic per-experiment tables; then results/README.md
    (`index`, default: the README beside `out`) is regenerated. Returns the names of the tables with data."""
    df = load(summary)
    out.mkdir(parents=True, exist_ok=True)
    written, entries, empty, uncompared = [], [], [], []
    for name, table in TABLES.items():
        experiments = list(table.run)
        if not df.empty and BUILDERS[table.kind](df, out, table):
            written.append(name)
            print(f"{name}: {out / name}.tex, .md")
        else:
            placeholder(out, name, experiments)
            empty.append(name)
        entries.append({"kind": "paper", "name": name, "path": f"tables/{name}.md", "experiments": experiments,
                        "status": "written" if name in written else "no data yet"})
    for item in compare.write_all(df, out, paper):
        entries.append({"kind": "vs_paper", "name": item["name"], "path": f"tables/{item['name']}.md",
                        "experiments": item["experiments"], "status": item["summary"]})
        if item["cells"]:
            print(f"{item['name']}: {item['cells']} of {plural(item['paper_cells'], 'paper cell')} compared")
        else:
            uncompared.append(item["name"])
    print(skipped_line(empty, uncompared))
    for item in generic.write_generic(df, out / "generic"):
        written.append(f"generic/{item['name']}")
        entries.append({"kind": "generic", "name": item["name"], "path": f"tables/{item['path']}",
                        "experiments": [item["experiment"]], "status": item["status"]})
        print(f"generic/{item['name']}: {item['status']}")
    if not any(e["kind"] == "generic" for e in entries):
        print("no runs in the summary yet: no generic tables (run anything, e.g. python run.py, then make tables)")
    results_index.write_part(out.parent if index is None else index.parent, "tables", entries)
    results_index.write(out.parent if index is None else index.parent, summary)
    return written


def cli(argv: list[str] | None = None) -> list[str]:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_results_arguments(parser, "results/tables")
    parser.add_argument("--paper", type=Path, default=PAPER_DIR, help="the paper's numbers (results/paper)")
    args = parser.parse_args(argv)
    ensure_summary(args.summary, args.runs, args.collect)
    return main(args.summary, args.out, args.paper)


if __name__ == "__main__":
    cli()
