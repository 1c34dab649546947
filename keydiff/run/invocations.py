"""Which invocation computed which rows of a run: summary.json's `invocations`, one entry per invocation that
wrote rows into the run directory. Standard library only: the report and `make status` read it.

Design: docs/design/runs.md#invocations
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any, Iterable

from keydiff.run.provenance import code_label

ROW_KEY = "invocation"  # the row's field naming the invocation that computed it
ITSELF, SUMMARY_FIELDS, ROWS = "invocation", "summary fields", "rows"  # an entry's `source`


def start(record: dict[str, Any], batch_size: int, threads: int | None) -> dict[str, Any]:
    """The entry of an invocation starting now (`record`: keydiff.run.provenance.provenance_record)."""
    return {"id": uuid.uuid4().hex[:12], "source": ITSELF, "started_at": record.get("time"), "finished_at": None,
            "argv": (record.get("environment") or {}).get("argv"), "batch_size": batch_size, "decode_widths": None,
            "decode_graphs": None, "threads": threads,
            "code": code_label(record.get("code") or {}), "samples_wall_s": None, "stopped_by": None, "rows": 0}


def recorded(summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The invocations a summary lists; an old summary (no list) as one entry made of its top-level fields."""
    if summary is None:
        return []
    listed = summary.get("invocations")
    if listed is not None:
        return [dict(entry) for entry in listed]
    code = summary.get("code") or {}
    return [{"id": None, "source": SUMMARY_FIELDS, "started_at": summary.get("started_at"),
             "finished_at": summary.get("written_at"), "argv": (summary.get("environment") or {}).get("argv"),
             "batch_size": summary.get("batch_size", 1),  # runs from before batching ran one sample at a time
             "threads": summary.get("threads"), "code": code_label(code) if isinstance(code, dict) else code,
             "samples_wall_s": summary.get("samples_wall_s"), "stopped_by": summary.get("stopped_by"), "rows": None}]


def history(summary: dict[str, Any] | None, rows: list[dict[str, Any]],
            current: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The invocations behind `rows` (in file order): those `summary` records, then any killed before their summary,
    then `current` if it wrote a row; each with its row count."""
    counts = Counter(row.get(ROW_KEY) for row in rows)
    entries = recorded(summary)
    known = {entry["id"] for entry in entries} | ({current["id"]} if current else set())
    for lost in dict.fromkeys(row.get(ROW_KEY) for row in rows):
        if lost not in known:
            entries.append(from_rows(lost, [row for row in rows if row.get(ROW_KEY) == lost]))
    if current is not None and counts[current["id"]]:
        entries.append(current)
    return [{**entry, "rows": counts[entry["id"]]} for entry in entries]


def from_rows(invocation_id: str | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The entry of an invocation known only from its rows (its process ended before it wrote summary.json)."""
    return {"id": invocation_id, "source": ROWS, "started_at": None, "finished_at": None, "argv": None,
            "batch_size": None, "threads": common(row.get("threads") for row in rows),
            "code": common(row.get("code") for row in rows), "samples_wall_s": None, "stopped_by": None,
            "rows": len(rows)}


def covers(summary: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    """The summary was written over exactly these rows (no row appended since, by a process killed before its
    summary). An old summary (no list) is checked by its sample counts."""
    if summary.get("invocations") is None:
        latest = {row.get("sample_id") for row in rows}
        return (summary.get("num_samples") or 0) + (summary.get("num_failed") or 0) == len(latest)
    return history(summary, rows) == summary["invocations"]


def no_effect(summary: dict[str, Any] | None, settings: dict[str, Any]) -> str | None:
    """One line for an invocation that found every sample done, naming its `settings` (how rows would be
    computed: batch_size, threads, max_prompt_tokens; None: not set) whose value differs from what the recorded
    invocations computed the rows with, and how to compare them; None when there is none."""
    entries = recorded(summary)
    if not entries:
        return None
    differ = []
    for key, value in settings.items():
        used = [(summary or {}).get(key)] if key == "max_prompt_tokens" else [entry.get(key) for entry in entries]
        if (value is not None or key == "max_prompt_tokens") and any(other != value for other in used):
            differ.append((key, value, describe(used)))
    if not differ:
        return None
    names = " and ".join(f"{key}={'null' if value is None else value}" for key, value, _ in differ)
    before = ", ".join(f"{key} {'null' if used is None else used}" for key, _, used in differ)
    return (f"every sample is already done, so {names} had no effect (the rows were computed with {before}); "
            "to compare, run the same command with another results_root=<folder>")


def common(values: Iterable[Any]) -> Any:
    """The one value every item has, else None (they differ, or there are none)."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def run_fields(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's top-level run fields from its invocations: batch_size and threads (null when they differ or
    one is unknown), samples_wall_s (their sum), started_at (the first's) and stopped_by (the last's)."""
    walls = [entry.get("samples_wall_s") for entry in entries]
    return {"batch_size": common(entry.get("batch_size") for entry in entries),
            "threads": common(entry.get("threads") for entry in entries),
            "samples_wall_s": sum(walls) if walls and None not in walls else None,
            "started_at": entries[0].get("started_at") if entries else None,
            "stopped_by": entries[-1].get("stopped_by") if entries else None}


def describe(values: Iterable[Any]) -> Any:
    """The one value of every invocation (None: none, or not recorded), or "mixed: a, b" when they differ ("?":
    one that was not recorded)."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) <= 1:
        return distinct[0] if distinct else None
    return "mixed: " + ", ".join("?" if value is None else str(value)
                                 for value in sorted(distinct, key=lambda v: (v is None, str(v))))


def batch_size(summary: dict[str, Any] | None) -> Any:
    """The batch size the run's rows were computed at: an int, "mixed: 1, 8", or None (no invocation)."""
    return describe(entry.get("batch_size") for entry in recorded(summary))


def wall_time(summary: dict[str, Any] | None) -> tuple[float | None, str]:
    """(seconds, "") the sample loops of a run took, summed over its invocations, or (None, why not): an
    invocation recorded none, or they ran at different batch sizes or threads (a sum would time neither)."""
    entries = recorded(summary)
    if not entries:
        return None, "no invocation computed rows"
    missing = [entry for entry in entries if entry.get("samples_wall_s") is None]
    if missing:
        return None, f"{len(missing)} of {len(entries)} invocations recorded no wall time ({missing[0]['source']})"
    for key in ("batch_size", "threads"):
        if len({entry.get(key) for entry in entries}) > 1:
            values = describe(entry.get(key) for entry in entries).removeprefix("mixed: ")
            return None, f"its rows were computed by {len(entries)} invocations with {key} {values}"
    return sum(entry["samples_wall_s"] for entry in entries), ""
