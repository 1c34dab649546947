"""Paper figures from results/summary.csv (prompt lengths: from the runs' predictions.jsonl) into results/figures/.

    python -m keydiff.report.figures [--summary results/summary.csv] [--out results/figures]
                                     [--runs results/runs] [--collect]

Which experiments feed each: keydiff/paper/registry.py FIGURES.
Design: docs/design/reports.md#figures-reportfigures-analysisfigures
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from keydiff.paper import registry  # noqa: E402
from keydiff.paper.registry import FIGURES, LONGBENCH  # noqa: E402
from keydiff.paper.registry import display_name as registry_name  # noqa: E402
from keydiff.report import generic  # noqa: E402
from keydiff.report import leaderboard as board  # noqa: E402
from keydiff.report import protocol as protocols  # noqa: E402
from keydiff.report import index as results_index  # noqa: E402
from keydiff.report.collect import add_results_arguments, ensure_summary, longbench_dataset, read_predictions, task_family  # noqa: E402
from keydiff.report.render import NA, NOTHING_EVICTED, SUBSET, budget_ratio, budget_tokens, interval, metric_range  # noqa: E402
from keydiff.report.selection import load, pick  # noqa: E402
from keydiff.cli import ArgumentParser

STYLE = {"svg.hashsalt": "keydiff", "font.size": 8, "axes.titlesize": 9, "figure.dpi": 100, "savefig.dpi": 150}


def save(fig, out: Path, name: str) -> list[Path]:
    """PNG and PDF without the timestamps and version strings matplotlib would embed."""
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], metadata={"Software": None})
    fig.savefig(paths[1], metadata={"Creator": None, "Producer": None, "CreationDate": None})
    plt.close(fig)
    return paths


MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]  # with the colour and dash: overlapping series stay visible
LINESTYLES = ["-", (0, (5, 2)), (0, (1, 1.5)), (0, (5, 2, 1, 2)), (0, (8, 2, 1, 2, 1, 2))]
# One colour per policy label in every figure: the common policies by hand, any other label by a hash of its name
# into the rest of the palette (stable across figures and runs).
POLICY_COLORS = {"keydiff": "#1f77b4", "snapkv": "#ff7f0e", "tova": "#2ca02c", "h2o": "#d62728", "sink": "#9467bd",
                 "knorm": "#8c564b", "h2o_recent": "#e377c2", "random": "#7f7f7f", "recent": "#bcbd22",
                 "expected_attention": "#17becf", "full": "#000000"}
SPARE_COLORS = ["#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
                "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1"]


def _stable_index(name: str, size: int) -> int:
    return int(hashlib.sha256(str(name).encode()).hexdigest(), 16) % size


def base_label(policy: str) -> str:
    """The policy label without the setting a table adds to it ("keydiff [max_new_tokens=20]" -> "keydiff")."""
    return str(policy).split(" [", 1)[0]


def display_name(policy: str) -> str:
    """The printed name of a policy label ("keydiff" -> "KeyDiff"), the setting a table adds to it kept after it."""
    base = base_label(policy)
    return registry_name(base) + str(policy)[len(base):]


def policy_color(policy: str) -> str:
    """The colour of a policy label, the same in every figure (not the order in which policies appear), also
    where the label carries a generation setting (keydiff.report.generic.label_generation)."""
    policy = base_label(policy)
    return POLICY_COLORS.get(policy) or SPARE_COLORS[_stable_index(policy, len(SPARE_COLORS))]


def style(policy: str) -> dict:
    """Colour, marker and line style of a policy's series: keyed by its label, so the same in every figure; the
    settings of one policy (its label with " [max_new_tokens=...]") share its colour and differ in marker and dash."""
    known, base = list(POLICY_COLORS), base_label(policy)
    i = known.index(base) if base in known else _stable_index(base, len(MARKERS) * len(LINESTYLES))
    if policy != base:
        i += 1 + _stable_index(policy, len(MARKERS) * len(LINESTYLES) - 1)
    return {"color": policy_color(policy), "marker": MARKERS[i % len(MARKERS)],
            "linestyle": LINESTYLES[i % len(LINESTYLES)]}


def bounds_of(runs: pd.DataFrame, column: str, bounds) -> list[tuple[float, float] | None]:
    """The 95 % interval of `column` per run (render.interval: Wilson inside `bounds`, the metric's range;
    None: no interval, fewer than 5 samples or no SE)."""
    se = runs[f"se/{column}"] if f"se/{column}" in runs.columns else pd.Series(np.nan, index=runs.index)
    samples = runs["samples"] if "samples" in runs.columns else pd.Series(np.nan, index=runs.index)
    return [interval(float(v), float(e), n, bounds) if pd.notna(v) else None
            for v, e, n in zip(runs[column], se, samples)]


def errors(runs: pd.DataFrame, column: str, bounds=None) -> np.ndarray:
    """Error bars [2, k] (below, above) of the 95 % intervals of `column`; NaN where a run has none."""
    spans = bounds_of(runs, column, bounds)
    below = [v - s[0] if s else np.nan for v, s in zip(runs[column], spans)]
    above = [s[1] - v if s else np.nan for v, s in zip(runs[column], spans)]
    return np.asarray([below, above], dtype=float).reshape(2, len(runs))


def subset_mark(run) -> str:
    """"§" for a subset run (task.limit set; after averaging, any of its seeds)."""
    subset = run.get("subset") if "subset" in run else pd.notna(run.get("limit"))
    return SUBSET if bool(subset) and pd.notna(subset) else ""


def count(run) -> int:
    return int(run["samples"]) if pd.notna(run.get("samples")) else 0


def per_cell(run, cells: int) -> str:
    """Samples behind each heatmap cell: "n=1 per cell" (the run's n spread over its length x depth cells)."""
    total = count(run)
    return f"n={total // cells} per cell" if cells and total % cells == 0 else f"n={total} over {cells} cells"


def usable(df, experiment):
    """An experiment's configurations as the generic tables show them: the whole-task run, else its subset run
    (marked § in the figure)."""
    return pick(df, [experiment], limited=True)


def niah_heatmaps(df, out: Path) -> list[Path]:
    paths = []
    for experiment in sorted(set(df.loc[df["task"].map(task_family) == "niah", "experiment"])):
        runs = usable(df, experiment)
        cells = [c for c in runs.columns if c.startswith("metrics/needle_recall_by_cell/")]
        runs = runs[(runs["task"].map(task_family) == "niah") & runs.reindex(columns=cells).notna().any(axis=1)]
        for (task, model), mine in runs.groupby(["task", "model"]):
            full = mine[mine["budget_label"] == NA]
            for (budget, block), group in mine[mine["budget_label"] != NA].groupby(["budget_label", "block_size"]):
                panels = [*full.iterrows(), *group.iterrows()]
                fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels) + 0.8, 2.8), squeeze=False,
                                         layout="constrained")
                for ax, (_, run) in zip(axes[0], panels):
                    cells = {tuple(c.split("/")[2:]): run[c] for c in run.index
                             if c.startswith("metrics/needle_recall_by_cell/") and run[c] == run[c]}
                    lengths = sorted({int(k[0]) for k in cells})
                    depths = sorted({int(k[1]) for k in cells})
                    grid = np.array([[cells.get((str(l), str(d)), np.nan) for l in lengths] for d in depths])
                    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
                    for (row, col), value in np.ndenumerate(grid):  # the number, not only a colour
                        if value == value:
                            ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=6,
                                    color="black" if 0.25 < value < 0.85 else "white")
                    ax.set_xticks(range(len(lengths)), [f"{l / 1000:g}k" for l in lengths], rotation=90)
                    ax.set_yticks(range(len(depths)), [str(d) for d in depths])
                    mark = subset_mark(run)
                    ax.set_title(f"{display_name(run['policy'])}{' ' + mark if mark else ''} ({per_cell(run, len(cells))})")
                    ax.set_xlabel("context length (tokens)")
                axes[0][0].set_ylabel("needle depth (%)")
                fig.colorbar(image, ax=list(axes[0]), label="needle recall")
                note = "\n§ subset run (task.limit)" if any(subset_mark(r) for _, r in panels) else ""
                fig.suptitle(f"{model}, budget {budget.upper()}, B = {block}{note}")
                paths += save(fig, out, f"{task}_{experiment}_{model}_{budget}_bs{block}")
    return paths


def ttft(df, out: Path) -> list[Path]:
    paths = []
    for experiment in sorted(e for e in set(df["experiment"]) if "ttft" in e):
        runs = usable(df, experiment)
        runs = runs[runs["budget_label"] != NA]
        for model in sorted(set(runs["model"])):
            mine = runs[runs["model"] == model]
            blocks = sorted(set(mine["block_size"]), key=lambda b: float(b))
            fig, axes = plt.subplots(1, len(blocks), figsize=(3 * len(blocks), 2.6), sharey=True, squeeze=False,
                                     layout="constrained")
            for ax, block in zip(axes[0], blocks):
                for policy, line in mine[mine["block_size"] == block].groupby("policy"):
                    line = line.sort_values("budget")
                    ax.errorbar(line["budget"], line["mean_ttft_s"], yerr=errors(line, "mean_ttft_s"), capsize=2,
                                **style(policy), label=f"{display_name(policy)}"
                                + ("".join(sorted({subset_mark(r) for _, r in line.iterrows()}))))
                ax.set_title(f"B = {block}")
                ax.set_xlabel("KV cache budget (tokens)")
                ax.grid(alpha=0.3)
            axes[0][0].set_ylabel("mean TTFT (s), 95 % CI")
            axes[0][-1].legend()
            fig.suptitle(f"{experiment}: {model}")
            paths += save(fig, out, f"ttft_{experiment}_{model}")
    return paths


def prompt_lengths(df, runs_root: Path, out: Path) -> list[Path]:
    """Prompt lengths do not depend on the policy: one run per model (a full run if there is one)."""
    paths = []
    runs = df[(df["task"].map(task_family) == "longbench") & df["complete"].astype(bool) & df["limit"].isna()]
    for model in sorted(set(runs["model"])):
        mine = runs[runs["model"] == model]
        mine = mine.assign(evicts=mine["policy_name"] != "full").sort_values(["evicts", "run_dir"])
        rows = next((r for r in (read_predictions(runs_root / d) for d in mine["run_dir"]) if r), [])
        if not rows:
            print(f"prompt lengths of {model}: no predictions.jsonl under {runs_root}; skipped")
            continue
        lengths = {}
        for row in rows:
            lengths.setdefault(longbench_dataset(row), []).append(row["prompt_tokens"])
        datasets = [d for d in LONGBENCH if d in lengths] + sorted(set(lengths) - set(LONGBENCH))
        cols = min(5, len(datasets))
        nrows = -(-len(datasets) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(2.4 * cols, 1.9 * nrows), squeeze=False, layout="constrained")
        for ax, dataset in zip(axes.flat, datasets):
            ax.hist(lengths[dataset], bins=20, color="tab:blue")
            ax.set_title(LONGBENCH.get(dataset, dataset))
        for ax in list(axes.flat)[len(datasets):]:
            ax.axis("off")
        fig.supxlabel(f"prompt tokens ({model} tokenizer)")
        paths += save(fig, out, f"prompt_lengths_{model}")
    return paths


def score_vs_budget(df, out: Path) -> list[Path]:
    """Score vs budget per policy for whatever ran (the generic tables' configurations), with 95 % error bars. Ratio
    budgets ("r0.25") get a figure of their own ("...__ratio"); the full cache's line is in both."""
    paths = []
    (out / "generic").mkdir(parents=True, exist_ok=True)
    runs = generic.runs_of(df)
    for (experiment, task, model, block), group in runs.groupby(["experiment", "task", "model", "block_size"], sort=True):
        is_ratio = group["budget_label"].map(lambda b: budget_ratio(b) is not None)
        full = group["budget_label"] == NA
        if is_ratio.any():
            name = f"{experiment}__{task}__{model}__bs{block}__ratio"
            paths += score_figure(group[is_ratio | full], budget_ratio, "KV cache budget (fraction of the prompt kept)",
                                  out, name, (experiment, task, model, block))
        if not is_ratio.any() or (~is_ratio & ~full).any():  # token budgets (or only the full cache) ran
            paths += score_figure(group[~is_ratio], budget_tokens, "KV cache budget (tokens)", out,
                                  f"{experiment}__{task}__{model}__bs{block}", (experiment, task, model, block))
    return paths


def score_figure(group, position, xlabel: str, out: Path, name: str, key) -> list[Path]:
    """One score-vs-budget figure: `position` maps a budget label to its x (tokens, or the kept fraction)."""
    experiment, task, model, block = key
    bounds = metric_range("score", task)
    fig, ax = plt.subplots(figsize=(4.2, 2.8), layout="constrained")  # constrained: no label is cut off
    budgets = sorted({b for b in group["budget_label"] if b != NA}, key=budget_tokens)
    ticks = [position(b) for b in budgets]
    span = (max(ticks) - min(ticks)) if len(ticks) > 1 else max(ticks, default=1.0)
    lines = list(group[group["budget_label"] != NA].groupby("policy"))
    for policy, line in lines:
        line = line.assign(tokens=line["budget_label"].map(position)).sort_values("tokens")
        n = sorted({int(v) for v in line["samples"].fillna(0)})
        marks = "".join(sorted({subset_mark(r) for _, r in line.iterrows()}))
        drawn = ax.errorbar(line["tokens"], line["score"], yerr=errors(line, "score", bounds), capsize=2,
                            linewidth=1, **style(policy),
                            label=f"{display_name(policy)}{' ' + marks if marks else ''} "
                                  f"(n={n[0]}{f'-{n[-1]}' if len(n) > 1 else ''} per budget)")
        partial = line[line["subset"] | line["incomplete"]]  # hollow markers: subset or unfinished points
        ax.plot(partial["tokens"], partial["score"], linestyle="none", marker=style(policy)["marker"],
                color=drawn.lines[0].get_color(), markerfacecolor="white", zorder=3)
        for _, point in line[line["nothing_evicted"]].iterrows():  # the budget held every prompt: the full cache
            ax.annotate(NOTHING_EVICTED, (point["tokens"], point["score"]), xytext=(4, -8), textcoords="offset points",
                        fontsize=7, color=drawn.lines[0].get_color())
    for _, full in group[group["budget_label"] == NA].iterrows():
        ax.axhline(full["score"], color="black", linestyle="--", linewidth=0.8,
                   label=f"{display_name(full['policy'])}{subset_mark(full)} (n={count(full)})")
        band = bounds_of(pd.DataFrame([full]), "score", bounds)[0]
        if band is not None:
            ax.axhspan(band[0], band[1], color="black", alpha=0.08, linewidth=0)
    ax.set_xticks(ticks, budgets)
    if len(ticks) == 1:  # one budget: a fixed window around it
        ax.set_xlim(ticks[0] - 0.25 * span, ticks[0] + 0.25 * span)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{generic.primary_metric(task)} (95 % CI)")
    low = min(0.0, float(np.nanmin(group["score"])) if group["score"].notna().any() else 0.0)
    ax.set_ylim(bottom=low, top=bounds[1] * 1.02 if bounds else None)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    mark = " (§ subset run: task.limit)" if group["subset"].any() else ""
    if group["nothing_evicted"].any():
        mark += f"\n{NOTHING_EVICTED} nothing evicted: budget >= every prompt (= the full cache)"
    ax.set_title(f"{experiment} / {task}: {model}, B = {block}{mark}", fontsize=7)
    return save(fig, out / "generic", name)


def leaderboard(df, out: Path) -> list[Path]:
    """leaderboard.png/.pdf: average RULER score vs fraction of the prompt kept, one line per method with 95 % error
    bars; one panel per (task, model, protocol). Hollow markers: subset or unfinished runs, or fewer RULER tasks."""
    selected = board.runs(df, registry.TABLES["leaderboard"])
    if selected.empty:
        return []
    total = len(board.TASKS)
    panels = []
    for (task, model), mine in selected.groupby(["task", "model"], sort=True):
        evicting, full = mine[mine["budget_label"] != NA], mine[mine["budget_label"] == NA]
        panels += [(task, model, block, evicting[evicting["protocol"] == block], full)
                   for block in sorted(set(evicting["protocol"]), key=str) or [NA]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 3.6), squeeze=False, layout="constrained")
    for ax, (task, model, block, evicting, full) in zip(axes[0], panels):
        ratios = sorted({float(r) for r in evicting["ratio"]})
        gap = min(np.diff(ratios), default=0.25)
        most = int(max([*evicting["tasks_scored"], *full["tasks_scored"]], default=0))
        lines = sorted(evicting.groupby("policy"), key=lambda item: display_name(item[0]))
        for policy, line in lines:
            line = line.sort_values("ratio")
            n = sorted({int(v) for v in line["per_task"].fillna(0)})  # samples per RULER task
            fewer = line["tasks_scored"] < most
            partial = line["subset"] | line["incomplete"] | fewer
            tasks = f", {int(line['tasks_scored'].min())}/{total} tasks" if fewer.any() else ""
            drawn = ax.errorbar(line["ratio"], line["score"], yerr=errors(line, "score", board.PERCENT), capsize=2,
                                linewidth=1, markersize=4, **style(policy),
                                label=f"{display_name(policy)}{' ' + SUBSET if (line['subset'] | line['incomplete']).any() else ''} "
                                      f"(n={n[0]}{f'-{n[-1]}' if len(n) > 1 else ''}{tasks})")
            ax.plot(line.loc[partial, "ratio"], line.loc[partial, "score"], linestyle="none", markersize=4,
                    marker=style(policy)["marker"], color=drawn.lines[0].get_color(), markerfacecolor="white", zorder=3)
            for _, point in line[fewer].iterrows():
                ax.annotate(f"{int(point['tasks_scored'])}/{total}", (point["ratio"], point["score"]), fontsize=5,
                            xytext=(3, 3), textcoords="offset points", color=drawn.lines[0].get_color())
        for _, run in full.iterrows():
            mark = subset_mark(run)
            scored = int(run["tasks_scored"])
            tasks = f", {scored}/{total} tasks" if scored < total else ""
            ax.axhline(run["score"], color="black", linestyle=":" if scored < most else "--", linewidth=0.8,
                       label=f"{display_name(run['policy'])}{' ' + mark if mark else ''} (n={int(run['per_task'])}{tasks})")
            band = bounds_of(pd.DataFrame([run]), "score", board.PERCENT)[0]
            if band is not None:
                ax.axhspan(band[0], band[1], color="black", alpha=0.08, linewidth=0)
            if scored < most:
                ax.annotate(f"full cache: {scored}/{total} tasks", (1.0, run["score"]), xycoords=("axes fraction", "data"),
                            ha="right", va="bottom", fontsize=6)
        if ratios:
            ax.set_xticks(ratios, [f"{r:g}" for r in ratios])
            ax.set_xlim(ratios[0] - 0.5 * gap, ratios[-1] + 0.5 * gap)
            top = ax.secondary_xaxis("top", functions=(lambda x: 1 - x, lambda x: 1 - x))
            top.set_xticks([1 - r for r in ratios], [f"{1 - r:g}" for r in ratios])
            top.set_xlabel("kvpress compression ratio (1 - kept)")
        ax.set_xlabel("fraction of the prompt kept (budget.ratio)")
        ax.set_ylabel("average RULER score (95 % CI; n per task)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
        mark = " (§ subset run: task.limit)" if (evicting["subset"].any() or full["subset"].any()) else ""
        ax.set_title(f"{task}: {model}, {block}{mark}", fontsize=8)
    return save(fig, out, "leaderboard")


def protocol(df, out: Path) -> list[Path]:
    """protocol.png/.pdf: per model, one panel per budget; x the protocol table's columns, y the score x100 with 95 %
    error bars, one line per method, the full cache dashed black; the runs of keydiff.report.protocol.runs."""
    selected = protocols.runs(df, registry.TABLES["protocol"])
    if selected.empty:
        return []
    columns = protocols.headers(selected)
    position = {c: i for i, c in enumerate(columns)}
    panels = [(model, budget, mine[mine["budget_label"] == budget], mine[mine["budget_label"] == NA])
              for model, mine in selected.groupby("model", sort=True)
              for budget in sorted(set(mine["budget_label"]) - {NA}, key=budget_tokens) or [NA]]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(3.2, 0.55 * len(columns) + 1.2) * len(panels) + 1.6, 3.6),
                             squeeze=False, layout="constrained")
    for ax, (model, budget, evicting, full) in zip(axes[0], panels):
        for policy, line in sorted(evicting.groupby("policy"), key=lambda item: display_name(item[0])):
            line = line.assign(x=line["column"].map(position)).sort_values("x")
            spans = bounds_of(line.assign(value=line["percent"], **{"se/value": line["se_percent"]}), "value",
                              protocols.PERCENT)
            yerr = np.asarray([[v - s[0] if s else np.nan for v, s in zip(line["percent"], spans)],
                               [s[1] - v if s else np.nan for v, s in zip(line["percent"], spans)]], dtype=float)
            drawn = ax.errorbar(line["x"], line["percent"], yerr=yerr.reshape(2, len(line)), capsize=2, linewidth=1,
                                markersize=4, label=display_name(policy), **style(policy))
            partial = line["subset"] | line["incomplete"]
            ax.plot(line.loc[partial, "x"], line.loc[partial, "percent"], linestyle="none", markersize=4,
                    marker=style(policy)["marker"], color=drawn.lines[0].get_color(), markerfacecolor="white", zorder=3)
        if len(full):
            full = full.assign(x=full["column"].map(position)).sort_values("x")
            ax.plot(full["x"], full["percent"], color="black", linestyle="--", linewidth=0.8, marker="_",
                    label=display_name("full"))
        ax.set_xticks(range(len(columns)), columns, rotation=35, ha="right")
        ax.set_ylim(0, 100)
        ax.set_ylabel("score x100 (95 % CI over questions)")
        ax.grid(alpha=0.3)
        n = sorted({int(v) for v in pd.concat([evicting["samples"], full["samples"]]).dropna()})
        mark = " (§ subset run)" if (evicting["subset"].any() or full["subset"].any()) else ""
        ax.set_title(f"{model}, N={str(budget).upper()}: n={'-'.join(map(str, n[:1] + n[-1:] if len(n) > 1 else n))} "
                     f"questions{mark}", fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return save(fig, out, "protocol")


def index_entries(paths: list[Path], out: Path) -> list[dict]:
    names = sorted({p.relative_to(out).with_suffix("").as_posix() for p in paths})
    entries = []
    for figure in registry.FIGURES:
        title, prefix, experiments = figure.title, figure.prefix, list(figure.run)
        mine = [n for n in names if n.startswith(prefix)]
        files = [f"figures/{n}.png" for n in mine]
        status = f"{len(mine)} figures: " + ", ".join(f"[{n}](figures/{n}.png)" for n in mine) if mine else \
            "no data yet (run: " + "; ".join(f"python run.py experiment={e}" for e in experiments) + ")"
        entries.append({"kind": "figure", "name": title, "path": files[0] if files else "figures/",
                        "experiments": experiments, "status": status, "files": files + [f[:-4] + ".pdf" for f in files]})
    for name in (n for n in names if n.startswith("generic/")):
        experiment = name.split("/", 1)[1].split("__")[0]
        entries.append({"kind": "generic_figure", "name": name, "path": f"figures/{name}.png", "experiments": [experiment],
                        "status": "written", "files": [f"figures/{name}.pdf"]})
    return entries


def main(summary: Path, runs_root: Path, out: Path) -> list[Path]:
    plt.rcdefaults()
    plt.rcParams.update(STYLE)
    df = load(summary) if summary.exists() else pd.DataFrame()
    out.mkdir(parents=True, exist_ok=True)
    paths = [] if df.empty else (niah_heatmaps(df, out) + ttft(df, out) + prompt_lengths(df, runs_root, out)
                                 + score_vs_budget(df, out) + leaderboard(df, out) + protocol(df, out))
    for path in paths:
        print(path)
    if not paths:
        experiments = "; ".join(f"experiment={e}" for figure in FIGURES for e in figure.run)
        print(f"no figures yet (run: python run.py {experiments})")
    results_index.write_part(out.parent, "figures", index_entries(paths, out))
    results_index.write(out.parent, summary)
    return paths


def cli(argv: list[str] | None = None) -> list[Path]:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_results_arguments(parser, "results/figures")
    args = parser.parse_args(argv)
    ensure_summary(args.summary, args.runs, args.collect)
    return main(args.summary, args.runs, args.out)


if __name__ == "__main__":
    cli()
