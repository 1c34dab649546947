"""Two runs of one grid point side by side (e.g. batch_size=1 against 8): wall-time ratio and identical predictions?

    python -m keydiff.report.compare_runs RUN_DIR_A RUN_DIR_B [--tokenizer smollm2-135m]

Wall time is the runs' sample loops, summed over the invocations that computed rows; no ratio (with the reason)
where rows came from different batch sizes or threads. A differing sample is listed with the offset of its first
difference (with --tokenizer, the first differing token).

Design: docs/design/reports.md#comparing-two-runs-reportcompare_runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from keydiff.run import invocations


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The summary and the latest row of each sample (by sample_id) of a run directory."""
    folder = Path(run_dir)
    summary_path, rows_path = folder / "summary.json", folder / "predictions.jsonl"
    if not summary_path.is_file() or not rows_path.is_file():
        raise FileNotFoundError(f"{folder}: no summary.json and predictions.jsonl (not a finished run directory)")
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    rows = {}
    for line in rows_path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["sample_id"]] = row
    return summary, rows


def first_difference(a: str, b: str) -> int:
    """Offset of the first character where `a` and `b` differ (the shorter length if one extends the other)."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def first_token_difference(tokenizer, a: str, b: str) -> int:
    ids_a, ids_b = tokenizer.encode(a, add_special_tokens=False), tokenizer.encode(b, add_special_tokens=False)
    return first_difference(ids_a, ids_b)


def compare(dir_a: str | Path, dir_b: str | Path, tokenizer=None) -> dict[str, Any]:
    """The comparison as a record: batch sizes, wall times and their ratio (b / a), samples in both, and the
    differing ones (sample_id, char offset, token position when a tokenizer is given, both texts from there)."""
    summary_a, rows_a = load_run(dir_a)
    summary_b, rows_b = load_run(dir_b)
    side_a, side_b = run_side(dir_a, summary_a), run_side(dir_b, summary_b)
    wall_a, wall_b = side_a["samples_wall_s"], side_b["samples_wall_s"]
    shared = [sid for sid in rows_a if sid in rows_b]
    differing = []
    for sid in shared:
        text_a, text_b = str(rows_a[sid].get("prediction")), str(rows_b[sid].get("prediction"))
        if text_a != text_b or rows_a[sid].get("status") != rows_b[sid].get("status"):
            offset = first_difference(text_a, text_b)
            entry = {"sample_id": sid, "char": offset, "a": text_a[offset:offset + 40], "b": text_b[offset:offset + 40]}
            if tokenizer is not None:
                entry["token"] = first_token_difference(tokenizer, text_a, text_b)
            differing.append(entry)
    return {"a": side_a, "b": side_b,
            "wall_ratio": wall_b / wall_a if wall_a and wall_b is not None else None,
            "samples": len(shared), "only_in_a": len(set(rows_a) - set(rows_b)),
            "only_in_b": len(set(rows_b) - set(rows_a)), "differing": differing}


def run_side(run_dir: str | Path, summary: dict[str, Any]) -> dict[str, Any]:
    """One run's side of the comparison: batch size ("mixed: 1, 8" when its invocations differ), its sample loops'
    wall time (None, and `wall_note` saying why, where no sum would time one setting) and its invocations."""
    wall, note = invocations.wall_time(summary)
    return {"run_dir": str(run_dir), "batch_size": invocations.batch_size(summary), "samples_wall_s": wall,
            "wall_note": note, "invocations": invocations.recorded(summary)}


def describe_invocation(entry: dict[str, Any]) -> str:
    """'batch 8, threads 2, 3 rows, 4.12 s, started 2026-11-24T10:45:48+0000' (what the text output lists)."""
    wall = entry.get("samples_wall_s")
    rows = "? rows" if entry.get("rows") is None else f"{entry['rows']} rows"
    return (f"batch {entry.get('batch_size')}, threads {entry.get('threads')}, {rows}, "
            f"{'no wall time' if wall is None else f'{wall:.2f} s'}, started {entry.get('started_at')}"
            + (f", {entry['source']}" if entry.get("source") != invocations.ITSELF else ""))


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    from keydiff.models import BUILTIN_MODELS, ensure_builtin_model

    return AutoTokenizer.from_pretrained(str(ensure_builtin_model(name)) if name in BUILTIN_MODELS else name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", help="run directory (e.g. the batch_size=1 run)")
    parser.add_argument("run_b", help="run directory (e.g. the batch_size=8 run)")
    parser.add_argument("--tokenizer", default=None, help="also give the first differing token's position "
                        "(smollm2-135m or a hub id/path)")
    parser.add_argument("--json", action="store_true", help="print the record as JSON instead of text")
    args = parser.parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        record = compare(args.run_a, args.run_b, tokenizer)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    for side in ("a", "b"):
        run = record[side]
        print(f"{side}: batch_size={run['batch_size']} samples_wall_s={run['samples_wall_s']} {run['run_dir']}")
        if len(run["invocations"]) > 1:
            for index, entry in enumerate(run["invocations"], 1):
                print(f"  invocation {index}: {describe_invocation(entry)}")
    ratio = record["wall_ratio"]
    why = "; ".join(f"{side}: {record[side]['wall_note']}" for side in ("a", "b") if record[side]["wall_note"])
    shown = "-" if ratio is None else f"{ratio:.3f}"
    print(f"wall time b / a: {shown}" + (f" ({why})" if ratio is None and why else ""))
    print(f"samples in both: {record['samples']} (only in a: {record['only_in_a']}, only in b: {record['only_in_b']})")
    if not record["differing"]:
        print("predictions: all identical")
    else:
        print(f"predictions: {len(record['differing'])} differ (the logit gap at the first differing token needs the "
              "model: teacher-force the prompt and common prefix at batch 1)")
        for entry in record["differing"]:
            token = f" token {entry['token']}" if "token" in entry else ""
            print(f"  {entry['sample_id']}: char {entry['char']}{token}: a={entry['a']!r} b={entry['b']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
