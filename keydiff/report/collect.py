"""Collect every run under results/runs into one tidy file, results/summary.csv (one row per run).

    python -m keydiff.report.collect [--runs results/runs] [--out results/summary.csv] [--include-old]

Columns and merging of shards: docs/design/reports.md#one-csv-reportcollect
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from keydiff.paper.registry import LONGBENCH, baseline_experiment
from keydiff.report.render import grouped_mean_se, standard_error
from keydiff.cli import ArgumentParser
from keydiff.run import eviction, invocations
from keydiff.run.results import RENAMED_STATISTICS, current_names, is_moved_aside, run_summaries, successful_rows
from keydiff.run.shard_merge import UP_TO_DATE, grid_point_summaries, merge_all
from keydiff.run.tracking import HEADLINE, flatten

PRIMARY = {family: (metric,) for family, (_, metric) in HEADLINE.items()}  # the `score` column per task family
ID_COLUMNS = ["experiment", "task", "model", "policy", "policy_name", "budget", "budget_label", "block_size", "seed",
              "attention_statistics", "attn_implementation", "batch_size", "invocations", "limit", "complete", "samples",
              "num_failed", "max_new_tokens", "nothing_evicted", "degenerate",
              "mean_kept_ratio", "mean_ttft_s", "mean_prompt_tokens", "cache_bound_held", "score", "run_dir"]


def task_family(task: str) -> str:
    """math500_8k -> math500, niah_small -> niah: presets share their family's metrics."""
    return next((family for family in PRIMARY if task.startswith(family)), task)


def read_predictions(run_dir: Path) -> list[dict]:
    """The latest successful row per sample: keydiff.run.results.successful_rows, the runs' own reader
    (complete lines only; a retried sample's last row counts, failed samples have no scores)."""
    return successful_rows(run_dir)


def longbench_dataset(row: dict) -> str:
    return (row.get("info") or {}).get("dataset") or row["sample_id"].split("/")[0]


def longbench_scores(metrics: dict) -> dict[str, float]:
    """dataset -> official score: keydiff.tasks.longbench puts them under "datasets" (older or foreign
    summaries may have them at the top level)."""
    scores = metrics.get("datasets") if isinstance(metrics.get("datasets"), dict) else metrics
    return {d: float(scores[d]) for d in LONGBENCH if isinstance(scores.get(d), (int, float))}


def block_label(block_size) -> str:
    return "inf" if block_size is None or (isinstance(block_size, float) and math.isinf(block_size)) else str(int(block_size))


def standard_errors(family: str, rows: list[dict], metrics: dict) -> dict[str, float]:
    """`se/<column>` for the columns that average this run's samples, from their per-sample values: LongBench and
    RULER scores grouped per dataset / task (render.grouped_mean_se), RULER's `info.short` samples left out."""
    scored = [r for r in rows if isinstance(r.get("scores"), dict)]
    out: dict[str, float] = {}
    pairs = [("mean_ttft_s", "ttft_s"), ("mean_kept_ratio", "kept_ratio")]
    pairs += [("metrics/avg_new_tokens", "new_tokens")] if family == "math500" else []
    for column, key in pairs:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            out[f"se/{column}"] = standard_error(values)
    if not scored:
        return out
    if family in ("longbench", "ruler"):
        groups: dict[str, list[float]] = {}
        for r in scored:
            if family == "ruler" and (r.get("info") or {}).get("short"):
                continue  # kept out of RULER's task scores and average (Ruler.summarize): out of their SE too
            group = longbench_dataset(r) if family == "longbench" else str(r["sample_id"]).split("/")[0]
            groups.setdefault(group, []).append(float(r["scores"]["score"]))
        prefix = "lb" if family == "longbench" else "metrics/tasks"
        out.update({f"se/{prefix}/{g}": 100 * standard_error(v) for g, v in groups.items()})
        if family == "longbench":  # cr/<dataset>: Table 9's compression ratios
            ratios: dict[str, list[float]] = {}
            for r in rows:
                if isinstance(r.get("kept_ratio"), (int, float)):
                    ratios.setdefault(longbench_dataset(r), []).append(float(r["kept_ratio"]))
            out.update({f"se/cr/{g}": standard_error(v) for g, v in ratios.items()})
        out["se/score"] = grouped_mean_se(list(groups.values()), scale=100)[1]
        return out
    keys = {k for r in scored for k, v in r["scores"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for key in sorted(keys):
        if isinstance(metrics.get(key), (int, float)):  # a plain mean of the per-sample score
            out[f"se/metrics/{key}"] = standard_error([float(r["scores"][key]) for r in scored if key in r["scores"]])
    primary = next((k for k in PRIMARY.get(family, ("score",)) if f"se/metrics/{k}" in out), None)
    if primary is not None:
        out["se/score"] = out[f"se/metrics/{primary}"]
    if family == "phonebook":  # by_size/<size>/exact: accuracy over the queries of books of that size
        sizes: dict[str, list[float]] = {}
        for r in scored:
            sizes.setdefault(str(r["sample_id"]).split("/")[0].lstrip("n"), []).append(float(r["scores"]["exact"]))
        out.update({f"se/metrics/by_size/{size}/exact": standard_error(v) for size, v in sizes.items()})
    return out


def nothing_evicted(summary: dict) -> bool:
    """An evicting policy whose budget never bound (the run scores as the full cache would): summary.json's
    `nothing_evicted`, or for summaries written before it, the runner's rule (keydiff.run.eviction)."""
    recorded = summary.get("nothing_evicted")
    return bool(recorded if recorded is not None else eviction.nothing_evicted(summary))


def run_record(summary_path: Path, runs: Path) -> dict:
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    cfg, metrics = summary.get("config", {}), summary.get("metrics", {}) or {}
    stats = current_names(summary.get("statistics") or {}, RENAMED_STATISTICS)  # older runs: the old names
    run_dir = summary_path.parent
    task = cfg.get("task", {}).get("name") or run_dir.relative_to(runs).parts[1]
    family = task_family(task)
    record = {
        "experiment": cfg.get("experiment_name") or run_dir.relative_to(runs).parts[0],
        "task": task,
        "model": cfg.get("model", {}).get("name"),
        "policy": cfg.get("policy", {}).get("label"),
        "policy_name": cfg.get("policy", {}).get("name"),
        "budget": summary.get("budget"),
        "budget_label": cfg.get("budget", {}).get("label"),
        "block_size": block_label(summary.get("block_size")),
        "query_aware": summary.get("query_aware", True),  # runs before the switch were all query-aware
        "decode_eviction": summary.get("decode_eviction", True),
        "seed": cfg.get("seed"),
        "attention_statistics": summary.get("attention_statistics"),
        "attn_implementation": cfg.get("model", {}).get("attn_implementation"),
        "batch_size": invocations.batch_size(summary),
        "invocations": len(summary["invocations"]) if summary.get("invocations") is not None else None,
        "limit": summary.get("limit", cfg.get("task", {}).get("limit")),
        "complete": summary.get("complete"),
        "samples": summary.get("num_samples", stats.get("samples")),  # rows scored (failed ones excluded)
        "num_failed": summary.get("num_failed") or 0,
        "max_new_tokens": cfg.get("task", {}).get("max_new_tokens"),
        "nothing_evicted": nothing_evicted(summary),
        "degenerate": None,  # from the rows, below
        "mean_kept_ratio": stats.get("mean_kept_ratio"),
        "mean_ttft_s": stats.get("mean_ttft_s"),
        "mean_prompt_tokens": stats.get("mean_prompt_tokens"),
        "cache_bound_held": stats.get("cache_bound_held"),
        "score": next((metrics[k] for k in PRIMARY.get(family, ("score",)) if isinstance(metrics.get(k), (int, float))), None),
        "run_dir": run_dir.relative_to(runs).as_posix(),
    }
    # floats, so that a column's type does not depend on whether every run's value happened to be an integer
    record.update({f"metrics/{k}": float(v) for k, v in flatten(metrics).items()})
    record.update({f"failures/{k}": float(v) for k, v in flatten(summary.get("failures") or {}).items()})
    rows = read_predictions(run_dir)
    flags = [bool(row["degenerate"]) for row in rows if "degenerate" in row]
    record["degenerate"] = sum(flags) if flags else None  # None: rows written before the flag existed
    record.update(standard_errors(family, rows, metrics))
    if family == "longbench":
        record.update({f"lb/{k}": v for k, v in longbench_scores(metrics).items()})
        ratios = {}
        for row in rows:
            ratios.setdefault(longbench_dataset(row), []).append(row["kept_ratio"])
        record.update({f"cr/{k}": sum(v) / len(v) for k, v in ratios.items()})
    return record


def add_math500_subsets(records: list[dict], runs: Path) -> None:
    """Tables 5/7: score each evicting Math-500 run, and its full-cache baseline, on the samples whose
    full-cache context (prompt + generation) exceeds the run's budget. Needs the full run's predictions."""
    math_runs = [r for r in records if task_family(r["task"]) == "math500"]
    if not math_runs:
        return
    from keydiff.tasks.math500 import aggregate, ids_exceeding, subset_by_ids  # imports torch: only when needed

    def key(r: dict, experiment: str) -> tuple:
        return experiment, r["task"], r["model"], r["seed"]

    fulls = {}
    # Whole-task runs first (a subset run's few samples are no baseline while the whole run exists), then
    # complete ones; only from the run's baseline experiment (registry.baseline_experiment: table4_full for table4_gen*)
    # (an adhoc full-cache run, possibly with other settings, never becomes a paper table's baseline).
    for r in sorted(math_runs, key=lambda r: (r["limit"] is not None, not r["complete"])):
        if r["policy_name"] == "full":
            fulls.setdefault(key(r, r["experiment"]), r)
    for r in math_runs:
        full = fulls.get(key(r, baseline_experiment(str(r["experiment"]))))
        if r["policy_name"] == "full" or full is None or r["budget"] is None:
            continue
        full_rows = read_predictions(runs / full["run_dir"])
        ids = ids_exceeding(full_rows, int(r["budget"]))
        mine_rows, base_rows = subset_by_ids(read_predictions(runs / r["run_dir"]), ids), subset_by_ids(full_rows, ids)
        mine, base = aggregate(mine_rows), aggregate(base_rows)
        for prefix, rows in (("", mine_rows), ("full_", base_rows)):
            for metric in ("flex", "exact"):
                r[f"se/subset/{prefix}{metric}"] = standard_error([float(row["scores"][metric]) for row in rows])
        r.update({"subset/n_problems": base["n_problems"], "subset/total_problems": aggregate(full_rows)["n_problems"],
                  "subset/n_samples": base["n_samples"], "subset/flex": mine["flex"], "subset/exact": mine["exact"],
                  "subset/full_flex": base["flex"], "subset/full_exact": base["exact"]})


def collect(runs: Path, out: Path) -> pd.DataFrame:
    """Every grid point's result under `runs` into `out`, one row per run (never a run moved aside by
    overwrite=true: keydiff.run.shard_merge.grid_point_summaries)."""
    runs = Path(runs)
    left_out = merge_shards(runs)
    records = [run_record(p, runs) for p in grid_point_summaries(runs, left_out)]
    add_math500_subsets(records, runs)
    frame = pd.DataFrame(records, columns=ID_COLUMNS) if not records else pd.DataFrame(records)
    extra = sorted(c for c in frame.columns if c not in ID_COLUMNS)
    frame = frame[ID_COLUMNS + extra]
    frame = frame.sort_values(["experiment", "task", "model", "policy", "budget", "block_size", "seed"],
                              na_position="first", kind="stable").reset_index(drop=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out, index=False, float_format="%.10g", lineterminator="\n")
    return frame


def merge_shards(runs: Path) -> set[Path]:
    """Merge every sharded grid point whose shards are all complete into its result (keydiff.run.shard_merge),
    saying what was merged or why not; returns the points whose merged result is stale (left out)."""
    outcomes = merge_all(runs)
    for outcome in outcomes:
        if outcome.state != UP_TO_DATE:
            print(f"shards {outcome.state}: {outcome.message}")
    return {outcome.point for outcome in outcomes if outcome.stale}


def add_results_arguments(parser, out: str) -> None:
    """The arguments every results-reading entry point takes (tables, figures): where the summary, the runs
    and the output are, and whether to collect first."""
    parser.add_argument("--summary", type=Path, default=Path("results/summary.csv"))
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--runs", "--results", type=Path, default=Path("results/runs"), help="run directories")
    parser.add_argument("--collect", action="store_true", help="re-collect --runs into --summary first")


def lists_moved_aside(summary: Path) -> bool:
    """The CSV holds a run moved aside by overwrite=true (collected by a version that did not leave them out)."""
    try:
        run_dirs = pd.read_csv(summary, usecols=["run_dir"], dtype=str)["run_dir"].dropna()
    except (ValueError, OSError, pd.errors.EmptyDataError):
        return False
    return any(is_moved_aside(run_dir) for run_dir in run_dirs)


def ensure_summary(summary: Path, runs: Path, force: bool = False) -> None:
    """(Re)collect when asked, when the CSV is missing, when a run finished after it was written, or when it
    lists a run moved aside by overwrite=true (history is never tabled)."""
    newest = max((p.stat().st_mtime for p in run_summaries(runs)), default=0)
    if force or not summary.exists() or newest > summary.stat().st_mtime or (
            runs.is_dir() and lists_moved_aside(summary)):
        frame = collect(runs, summary)
        print(f"collected {len(frame)} runs from {runs} -> {summary}")


def moved_aside(runs: Path) -> list[str]:
    """The runs overwrite=true moved aside (history, never collected): "<run dir>  <task> score=<score>"."""
    current = set(run_summaries(runs))
    lines = []
    for path in run_summaries(runs, include_old=True):
        if path not in current:
            record = run_record(path, runs)
            lines.append(f"{record['run_dir']}  {record['task']} score={record['score']}")
    return lines


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("results/runs"), help="root of the run directories")
    parser.add_argument("--out", type=Path, default=Path("results/summary.csv"))
    parser.add_argument("--include-old", action="store_true",
                        help="also list the runs overwrite=true moved aside (`<run dir>.old-<time>`; never collected)")
    args = parser.parse_args(argv)
    frame = collect(args.runs, args.out)
    incomplete = int((~frame["complete"].astype(bool)).sum()) if len(frame) else 0
    old = moved_aside(args.runs)
    hint = "" if not old or args.include_old else f"; {len(old)} moved-aside run(s) left out (--include-old lists them)"
    print(f"{len(frame)} runs ({incomplete} incomplete) from {args.runs} -> {args.out}{hint}")
    if args.include_old:
        print(f"moved aside by overwrite=true (history, not collected): {len(old)}")
        for line in old:
            print(f"  {line}")
    return frame


if __name__ == "__main__":
    main()
