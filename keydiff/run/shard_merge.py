"""A sharded grid point's result, merged from its shards once every one of them is complete.

    python -m keydiff.run.shard_merge [--runs results/runs]     # `make collect` does this first

Written exactly as one unsharded run writes it. Design: docs/design/runs.md#merging-shards
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keydiff.run import invocations
from keydiff.run.lock import RunLock, RunLockedError
from keydiff.run.provenance import timestamp
from keydiff.run.results import (PREDICTIONS, ConfigMismatchError, ResultStore, ResultWriteError, atomic_write_bytes,
                                 atomic_write_json, is_moved_aside, run_summaries)
from keydiff.run.shards import (MERGE_RECORD, SHARDS, ShardState, describe_shards, is_shard_dir, merge_record,
                                 shard_dirs, shard_states)

SUMMARY, RUN_CONFIG = "summary.json", "run_config.json"
MERGED, UP_TO_DATE, WAITING, REFUSED, BUSY = "merged", "up to date", "waiting", "refused", "busy"


@dataclass
class Inspection:
    """What a grid point's shards give now, and what its own files hold (read only)."""

    point: Path
    states: list[ShardState] = field(default_factory=list)  # the shards of the count that is (or is closest to) complete
    rows: list[dict[str, Any]] | None = None  # the merged rows: every shard complete and consistent
    problem: str = ""  # why there are no merged rows
    owned: bool = False  # the point's own files were written by a merge
    foreign: bool = False  # the point holds a run of its own: never merged into
    current: bool = False  # the point's merged files are what the shards give now

    @property
    def stale(self) -> bool:
        """A merged result on disk that the shards no longer give: left out of the tables."""
        return self.owned and not self.current


@dataclass
class Outcome:
    point: Path
    state: str
    message: str
    stale: bool = False


def encode(rows: list[dict[str, Any]]) -> bytes:
    """predictions.jsonl's bytes, exactly as keydiff.run.results.ResultStore.append writes each row."""
    return b"".join((json.dumps(row, ensure_ascii=False, default=str) + "\n").encode("utf-8") for row in rows)


def file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def merged_rows(states: list[ShardState]) -> tuple[list[dict[str, Any]] | None, str]:
    """(rows in the grid point's sample order, "") when the shards agree and cover every sample once, else
    (None, why not)."""
    manifests = [state.manifest for state in states]
    first = manifests[0]
    if any((m["total_samples"], m["samples_sha256"]) != (first["total_samples"], first["samples_sha256"]) for m in manifests):
        return None, "the shards list different samples (the data or task.limit changed between them); re-run the odd ones with overwrite=true"
    configs = [read_json(state.path / RUN_CONFIG) for state in states]
    if any(config != configs[0] for config in configs):
        return None, "the shards were run with different configurations (compare their run_config.json)"
    summaries = [read_json(state.path / SUMMARY) for state in states]
    if any(summary is None for summary in summaries):
        missing = [state.shard.spec for state, summary in zip(states, summaries) if summary is None]
        return None, f"shard(s) {', '.join(missing)} have every row but no summary.json: re-run them (they finish at once)"
    hashes = [sorted(map(str, (summary.get("data") or {}).values())) for summary in summaries]  # paths may differ by node
    if any(h != hashes[0] for h in hashes):
        return None, "the shards read different data (their summaries' data hashes differ)"
    by_position: dict[int, dict[str, Any]] = {}
    for state in states:
        for position, sample_id in zip(state.manifest["positions"], state.manifest["sample_ids"]):
            if position in by_position:
                return None, f"sample position {position} is in two shards"
            by_position[position] = state.rows[sample_id]
    if sorted(by_position) != list(range(first["total_samples"])):
        return None, f"the shards cover {len(by_position)} of {first['total_samples']} samples"
    return [by_position[position] for position in sorted(by_position)], ""


def inspect(point: Path) -> Inspection:
    """Where a grid point with shards stands (nothing written)."""
    found = Inspection(point)
    candidates = [shard_states(point, count) for count in shard_dirs(point)]
    complete = [states for states in candidates if all(state.complete for state in states)]
    for states in complete:  # the first count whose shards agree (normally there is one count)
        rows, problem = merged_rows(states)
        if not found.states or rows is not None:
            found.states, found.rows, found.problem = states, rows, problem
        if rows is not None:
            break
    if not complete and candidates:
        found.states = max(candidates, key=lambda states: sum(len(state.rows) for state in states))
        found.problem = describe_shards(found.states)
    record = merge_record(point) or {}
    current = file_sha256(point / PREDICTIONS)
    summary = read_json(point / SUMMARY)
    known = {record.get("predictions_sha256"), record.get("replaces_sha256")} - {None}
    found.owned = bool(record) and (current in known or (current is None and summary is None))
    found.foreign = not found.owned and (current is not None or summary is not None)
    if found.owned and found.rows is not None:
        digest = hashlib.sha256(encode(found.rows)).hexdigest()
        found.current = (current == digest and (summary or {}).get("shards", {}).get("predictions_sha256") == digest)
    return found


class MergedStore(ResultStore):
    """The grid point's ResultStore whose summary also records what was merged."""

    def __init__(self, run_dir: Path, run_config: dict[str, Any], merge_record: dict[str, Any]):
        super().__init__(run_dir, run_config)
        self.merge_record = merge_record

    def write_summary(self, summary: dict[str, Any]) -> Path:
        return super().write_summary({**summary, "shards": self.merge_record})


def point_config(summary: dict[str, Any]) -> dict[str, Any]:
    """A shard's recorded configuration as the unsharded run of its grid point records it."""
    config = dict(summary["config"])
    run_subdir = str(config.get("run_subdir", ""))
    config["run_subdir"] = run_subdir.rsplit(f"/{SHARDS}/", 1)[0] if f"/{SHARDS}/" in run_subdir else run_subdir
    config["shard"] = None
    return config


def write_merge(point: Path, states: list[ShardState], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the grid point's predictions, configuration and summary from complete, consistent shards."""
    from omegaconf import OmegaConf

    from keydiff.run import plan as planning, runner  # import torch: only when there is something to merge
    from keydiff.tasks.base import Sample

    data = encode(rows)
    digest = hashlib.sha256(data).hexdigest()
    summaries = [read_json(state.path / SUMMARY) for state in states]
    first = summaries[0]
    record = {
        "count": len(states),
        "predictions_sha256": digest,
        "replaces_sha256": file_sha256(point / PREDICTIONS),
        "merged_at": timestamp(),
        "shards": [{"shard": state.shard.spec, "dir": state.path.relative_to(point).as_posix(),
                    "samples": len(state.rows), "code": summary.get("code"), "environment": summary.get("environment"),
                    "model": summary.get("model"), "written_at": summary.get("written_at")}
                   for state, summary in zip(states, summaries)],
    }
    cfg = OmegaConf.create(point_config(first))
    run_config = read_json(states[0].path / RUN_CONFIG)
    if planning.result_config(cfg) != run_config:
        raise ValueError(f"{states[0].path}: its summary's configuration does not give its run_config.json")
    plan = planning.plan_run(cfg)  # before anything is written: a policy or task that cannot be built here stops it
    atomic_write_json(point / SHARDS / MERGE_RECORD, record)  # first: the files below are known as the merge's
    atomic_write_bytes(point / PREDICTIONS, data)
    atomic_write_json(point / RUN_CONFIG, run_config)
    store = MergedStore(point, run_config, {key: record[key] for key in ("count", "predictions_sha256", "merged_at", "shards")})
    samples = [Sample(row["sample_id"], {}) for row in rows]
    taken = {key: first.get(key) for key in ("packages", "environment")}  # what provenance_record gives a run
    taken["code"] = {key: value for key, value in (first.get("code") or {}).items() if key != "row_commits"}
    # Every shard's invocations, each counting the rows it computed among the merged ones (a retried failure's
    # earlier row stays in its shard's file): the rows' "invocation" ids still name them.
    # A shard invocation's Hydra files (run.py's `hydra_files`) are named from the grid point, where they now sit.
    entries = [{**entry, "shard": state.shard.spec,
                **({"hydra_files": f"{state.path.relative_to(point).as_posix()}/{entry['hydra_files']}"}
                   if entry.get("hydra_files") else {})}
               for state, summary in zip(states, summaries)
               for entry in invocations.history(summary, list(state.rows.values()))]
    return runner.write_summary(cfg, plan, samples, store, taken, first.get("model"), entries, data=first.get("data"))


def merge_point(point: Path) -> Outcome:
    """Merge one grid point's shards when they are complete; never touch a point that holds a run of its own."""
    found = inspect(point)
    if found.foreign:
        return Outcome(point, REFUSED, f"{point} holds a run of its own (not merged from its shards): its shards "
                       "are not merged; move one or the other aside (overwrite=true moves the point's run)")
    if found.rows is None:
        label = WAITING if found.states and not all(s.complete for s in found.states) else REFUSED
        return Outcome(point, label, f"{point}: not merged, {found.problem}"
                       + ("; its earlier merged result is left out of the tables" if found.stale else ""), found.stale)
    if found.current:
        return Outcome(point, UP_TO_DATE, f"{point}: merged result is up to date")
    try:
        with RunLock(point, 0):
            write_merge(point, found.states, found.rows)
    except RunLockedError as error:
        return Outcome(point, BUSY, f"{point}: not merged now, {error}", found.stale)
    except (ValueError, ImportError, ConfigMismatchError, ResultWriteError) as error:
        return Outcome(point, REFUSED, f"{point}: not merged, {type(error).__name__}: {error}", found.owned)
    return Outcome(point, MERGED, f"{point}: merged {len(found.rows)} samples from {len(found.states)} shards")


def sharded_points(runs: Path) -> list[Path]:
    """Every grid point directory under `runs` with shards, except in moved-aside runs (`.old-<time>`) and hidden
    folders."""
    points = set()
    for folder in Path(runs).rglob(SHARDS):
        parts = folder.relative_to(runs).parts
        if folder.is_dir() and not any(part.startswith(".") for part in parts) and not is_moved_aside(folder, runs) \
                and shard_dirs(folder.parent):
            points.add(folder.parent)
    return sorted(points)


def merge_all(runs: Path) -> list[Outcome]:
    """merge_point for every sharded grid point under `runs` (what keydiff.report.collect does first)."""
    return [merge_point(point) for point in sharded_points(runs)] if Path(runs).is_dir() else []


def stale_points(runs: Path) -> set[Path]:
    """Grid points whose merged result the shards no longer give (read only): left out of every table."""
    return {point for point in sharded_points(runs) if inspect(point).stale} if Path(runs).is_dir() else set()


def grid_point_summaries(runs: Path, left_out: set[Path] = frozenset()) -> list[Path]:
    """Every summary.json under `runs` that is a grid point's result: not shards' own summaries, not the stale merges in
    `left_out`, not runs moved aside or hidden (keydiff.run.results.run_summaries)."""
    return [path for path in run_summaries(runs)  # never a run moved aside by overwrite=true (history)
            if not is_shard_dir(path.parent) and path.parent not in left_out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keydiff.run.shard_merge", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("results/runs"), help="root of the run directories")
    args = parser.parse_args(argv)
    outcomes = merge_all(args.runs)
    for outcome in outcomes:
        print(f"{outcome.state}: {outcome.message}")
    print(f"{len(outcomes)} sharded grid point(s) under {args.runs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
