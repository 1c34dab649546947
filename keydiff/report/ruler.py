"""RULER results table: one row per run, one column per task (string match x100) and their average.

Reads every RULER summary.json under the runs folder and writes ruler.md and ruler.csv. Each score reads
"value [low, high]" (95 % Wilson interval, keydiff/report/render.py). Marks: § subset run, †k failed samples,
↓k samples whose prompt filled under 95 % of the length (left out), ‡ an average not comparable to published
RULER numbers, (k/13) tasks scored; `haystack` and `qa` name the data used.

    python -m keydiff.report.ruler [--runs results/runs] [--out results/tables]

Design: docs/design/reports.md#leaderboard-and-protocol-comparison-reportleaderboard-reportprotocol
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from keydiff.report.collect import read_predictions, standard_errors
from keydiff.run.shard_merge import grid_point_summaries, stale_points
from keydiff.report.render import budget_tokens, format_estimate, marks, missing
from keydiff.cli import ArgumentParser

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
         "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")


def is_ruler(summary: dict) -> bool:
    task = (summary.get("config") or {}).get("task") or {}
    return str(task.get("_target_", "")).endswith("ruler.Ruler") and isinstance(summary.get("metrics", {}).get("tasks"), dict)


def ruler_rows(runs: Path) -> pd.DataFrame:
    """One row per RULER run: identity columns, per-task scores, average and marks."""
    rows = []
    for path in grid_point_summaries(runs, stale_points(runs)):  # shards are parts; moved-aside runs never
        summary = json.loads(path.read_text(encoding="utf-8"))
        if not is_ruler(summary):
            continue
        cfg, metrics = summary["config"], summary["metrics"]
        scores = metrics["tasks"]
        limit = cfg["task"].get("limit")
        failed = int(summary.get("num_failed", 0) or 0)
        counts = sorted(set((metrics.get("n") or {}).values()))
        short = {t: int(k) for t, k in (metrics.get("short") or {}).items() if k}
        haystacks = metrics.get("haystack") or {}
        essay = sorted({h.split(":", 1)[1] for h in haystacks.values() if h.startswith("essay:")})
        qa = sorted({h.split(":", 1)[1] for t, h in haystacks.items() if t.startswith("qa_")})
        comparable = metrics.get("comparable_to_published")  # None: a run from before it was recorded
        se = standard_errors("ruler", read_predictions(path.parent), metrics)  # as keydiff.report.collect stores them
        rows.append({
            "experiment": cfg.get("experiment_name"),
            "model": cfg["model"]["name"],
            "policy": cfg["policy"]["label"],
            "budget": cfg["budget"]["label"],
            "block_size": summary.get("block_size") or "inf",  # None: the whole prompt (context) as one block
            "query_aware": summary.get("query_aware", True),  # runs before the switch were all query-aware
            "length": cfg["task"]["length"],
            "n": "/".join(map(str, counts)),
            **{f"n/{task}": (metrics.get("n") or {}).get(task) for task in TASKS},
            "samples": sum((metrics.get("n") or {}).values()),
            **{task: scores.get(task) for task in TASKS},
            "avg": metrics.get("average"),
            **{f"se/{task}": se.get(f"se/metrics/tasks/{task}") for task in TASKS},
            "se/avg": se.get("se/score"),
            "tasks_run": len(scores),
            "subset": limit is not None,
            "failed": failed,
            "haystack": "/".join(essay) if essay else ("unrecorded" if not haystacks else "–"),
            "qa": "/".join(qa) if qa else ("unrecorded" if not haystacks else "–"),
            "short": sum(short.values()),
            "short_by_task": json.dumps(short, sort_keys=True),
            "comparable": comparable,
            "not_comparable": "; ".join(metrics.get("not_comparable") or
                                        ([] if comparable is not None else ["haystack and QA data not recorded"])),
            "run_dir": str(path.parent),
        })
    return pd.DataFrame(rows)


def to_markdown(df: pd.DataFrame) -> str:
    if df.empty:
        return "No RULER runs found (run e.g. `python run.py experiment=ruler task.data_dir=...`).\n"
    df = df.assign(_b=df["budget"].map(budget_tokens)).sort_values(["length", "model", "_b", "policy"])  # full last
    columns = ["model", "policy", "budget", "length", "haystack", "qa", "n", *TASKS, "avg"]
    if "query_aware" in df and df["query_aware"].nunique(dropna=False) > 1:  # a table that mixes both protocols says which
        columns.insert(3, "query_aware")
    if df["block_size"].nunique(dropna=False) > 1:  # e.g. the leaderboard's two protocols (one pass / B = 128)
        columns.insert(3, "block_size")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    reasons: list[str] = []
    for _, row in df.iterrows():
        short = json.loads(row["short_by_task"])
        cells = []
        for column in columns:
            value = row[column]
            if column in TASKS or column == "avg":
                error = row[f"se/{column}"]
                n = row["samples"] if column == "avg" else row[f"n/{column}"]
                text = "–" if missing(value) else format_estimate(
                    value, float("nan") if error is None or pd.isna(error) else float(error), n, 2, (0.0, 100.0),
                    shown_n=None)
                if column in TASKS and short.get(column):
                    text += f"↓{short[column]}"
                if column == "avg" and text != "–":
                    text += marks(row["subset"], row["failed"], False)
                    text += f"↓{row['short']}" if row["short"] else ""
                    text += "‡" if row["comparable"] is not True else ""
                    text += "" if row["tasks_run"] == len(TASKS) else f" ({row['tasks_run']}/13)"
                cells.append(text)
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
        if row["not_comparable"] and row["not_comparable"] not in reasons:
            reasons.append(row["not_comparable"])
    notes = ("\nScores: RULER string_match_all (qa: string_match_part) x100 per task; avg = mean over the tasks scored; "
             "[95 % confidence interval] (Wilson inside 0-100; avg: from the tasks' combined standard errors; "
             "\"n too small\": fewer than 5 samples). § subset run (task.limit; n = samples per task), †k failed samples, ↓k samples below 95 % of the length "
             "(left out of the score), ‡ not comparable to published RULER numbers, (k/13) tasks scored.\n")
    if reasons:
        notes += "‡: " + " | ".join(reasons) + "\n"
    return "\n".join(lines) + "\n" + notes


def main(runs: Path, out: Path) -> pd.DataFrame:
    df = ruler_rows(runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ruler.md").write_text(to_markdown(df), encoding="utf-8")
    df.to_csv(out / "ruler.csv", index=False)
    return df


def cli(argv: list[str] | None = None) -> pd.DataFrame:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[2]
    parser.add_argument("--runs", type=Path, default=root / "results/runs")
    parser.add_argument("--out", type=Path, default=root / "results/tables")
    args = parser.parse_args(argv)
    table = main(args.runs, args.out)
    print((args.out / "ruler.md").read_text(encoding="utf-8"))
    return table


if __name__ == "__main__":
    cli()
