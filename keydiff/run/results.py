"""Result files of one run (run_config.json, predictions.jsonl, summary.json), written so that nothing is ever
lost or silently overwritten. Every reader of predictions.jsonl goes through `read_rows` / `successful_rows`.

Design: docs/design/runs.md#run-directories-and-resume
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
PREDICTIONS = "predictions.jsonl"
MOVED_ASIDE = re.compile(r".+\.old-\d{8}-\d{6}(-\d+)?")  # `<run dir>.old-<time>`: overwrite=true's history
OK, FAILED = "ok", "failed"  # a row's "status" (rows of old runs have none: they are successes)


def run_dir_of(cfg: Any) -> Path:
    """Where a run's files go: `<results_root>/<experiment_name>/<run_subdir>` (conf/config.yaml's
    hydra.run.dir and hydra.sweep.dir/subdir say the same, so Hydra's job directory is this one)."""
    return Path(str(cfg.results_root)) / str(cfg.experiment_name) / str(cfg.run_subdir)


class ConfigMismatchError(RuntimeError):
    """The run directory holds results produced by a different configuration."""


class ResultWriteError(OSError):
    """Writing a result file failed (full disk, quota, permissions); what was written before is intact."""


def atomic_write_json(path: Path, data: Any) -> None:
    """Temp file + fsync + rename: the old file stays whole unless the new one was written completely."""
    atomic_write_bytes(path, json.dumps(data, indent=2, ensure_ascii=False, default=str).encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`data` to `path` by temp file + fsync + rename (see atomic_write_json)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise ResultWriteError(error.errno, f"could not write {path} ({error.strerror}); the previous version is intact") from error


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for key in sorted(set(old) | set(new)):
            lines += _diff(old.get(key, "<missing>"), new.get(key, "<missing>"), f"{prefix}{key}.")
        return lines
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def _without_limit(config: dict[str, Any]) -> dict[str, Any]:
    task = {k: v for k, v in config.get("task", {}).items() if k != "limit"}
    return {**config, "task": task} if "task" in config else config


def holds_a_run(run_dir: str | os.PathLike) -> bool:
    """`run_dir` holds results (rows or the configuration that produced them): what overwrite=true moves aside."""
    run_dir = Path(run_dir)
    return (run_dir / PREDICTIONS).exists() or (run_dir / "run_config.json").exists()


def move_aside(run_dir: str | os.PathLike, keep_hydra: str | None = None) -> Path:
    """overwrite=true: move every file of `run_dir` into the sibling `<run dir>.old-<time>` (nothing deleted), but
    the lock and this invocation's Hydra folder (`keep_hydra`; None keeps all of .hydra). Returns the folder."""
    run_dir = Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    suffix = 1
    while backup.exists():  # two overwrites within one second
        backup, suffix = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{suffix}"), suffix + 1
    backup.mkdir(parents=True)
    for path in list(run_dir.iterdir()):
        if path.name == ".lock" or (path.name == ".hydra" and keep_hydra is None):
            continue
        if path.name == ".hydra" and path.is_dir():  # earlier invocations' Hydra files go with their rows
            for inner in list(path.iterdir()):
                if (run_dir / keep_hydra).resolve() != inner.resolve():
                    (backup / ".hydra").mkdir(exist_ok=True)
                    inner.rename(backup / ".hydra" / inner.name)
            continue
        path.rename(backup / path.name)
    log.warning("overwrite=true: the old run was moved to %s (kept as history: never collected, averaged or "
                "listed in tables)", backup)
    return backup


class ResultStore:
    """Append-only per-sample rows plus an atomic summary, in one run directory."""

    def __init__(self, run_dir: str | os.PathLike, run_config: dict[str, Any], overwrite: bool = False):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.predictions = self.dir / PREDICTIONS
        self.config_path = self.dir / "run_config.json"
        if overwrite and holds_a_run(self.dir):
            self._move_aside()
        if self.config_path.exists():
            previous = json.loads(self.config_path.read_text(encoding="utf-8"))
            differences = _diff(_without_limit(previous), _without_limit(run_config))
            if differences:
                raise ConfigMismatchError(
                    f"{self.dir} holds results of a different configuration:\n  " + "\n  ".join(differences)
                    + "\nUse another experiment_name / policy.label, or overwrite=true to move the old run aside."
                    + ("\nA run written before the pinned haystack read this Python's: "
                       "task.haystack_source=interpreter resumes it." if any(d.startswith("task.haystack_source: '<missing>'") for d in differences)
                       else "")
                )
            self._check_limit(previous, run_config)
        else:
            atomic_write_json(self.config_path, run_config)
        self.rows = self._load_rows()

    def _check_limit(self, previous: dict[str, Any], run_config: dict[str, Any]) -> None:
        """task.limit may grow (the run is extended, its rows kept) but never shrink: a subset run would
        rewrite the summary of a larger run. The recorded limit follows the largest run."""
        old_task, new_task = previous.get("task", {}), run_config.get("task", {})
        if "limit" not in new_task or old_task.get("limit") == new_task["limit"]:
            return
        old, new = old_task.get("limit", "unrecorded"), new_task["limit"]
        if old == "unrecorded" or new is None or (old is not None and new > old):
            atomic_write_json(self.config_path, run_config)
            return
        raise ConfigMismatchError(
            f"{self.dir} holds a run with task.limit={old} ({'every sample' if old is None else f'first {old}'}); "
            f"a run with task.limit={new} would replace its summary with a subset. Run.py gives each limit its "
            "own directory; pass another directory here."
        )

    def _move_aside(self) -> None:
        """overwrite=true never deletes: the old files move into a timestamped sibling folder."""
        move_aside(self.dir)

    def _load_rows(self) -> list[dict[str, Any]]:
        """The complete rows; a partial last line (a crash mid-write) is cut off the file here."""
        rows, good_bytes = complete_rows(self.predictions)
        if self.predictions.exists() and good_bytes != self.predictions.stat().st_size:
            with open(self.predictions, "rb+") as handle:
                handle.truncate(good_bytes)
        return rows

    @property
    def done_ids(self) -> set[str]:
        """Samples with a row, successful or failed."""
        return {row["sample_id"] for row in self.rows}

    @property
    def failed_ids(self) -> set[str]:
        """Samples whose latest row records a failure (rows without "status" are old successful rows)."""
        return {sid for sid, row in self.latest_rows().items() if is_failed(row)}

    def latest_rows(self) -> dict[str, dict[str, Any]]:
        """The last row of every sample: a retried failure is superseded, never deleted."""
        return latest_rows(self.rows)

    def append(self, row: dict[str, Any]) -> None:
        """Append one whole line (a single write) and fsync it; undo a partial write and raise on failure."""
        line = (json.dumps(row, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        fd = os.open(self.predictions, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(28, "short write")
                os.fsync(fd)
            except OSError as error:
                os.ftruncate(fd, size)  # cut back to the last complete line
                raise ResultWriteError(
                    error.errno, f"could not append to {self.predictions} ({error.strerror}); "
                    f"the {len(self.rows)} rows written before are intact, sample {row.get('sample_id')!r} was not saved"
                ) from error
        finally:
            os.close(fd)
        self.rows.append(row)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.dir / "summary.json"
        atomic_write_json(path, summary)
        return path

    def read_summary(self) -> dict[str, Any] | None:
        """The summary.json an earlier invocation wrote, or None (none yet, or not readable JSON)."""
        try:
            summary = json.loads((self.dir / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return summary if isinstance(summary, dict) else None


# The runner (resume), the sweep (only_missing, `python -m keydiff.run.status`) and the report (collect) read
# predictions.jsonl through these functions, so all of them agree on which rows count.


def complete_rows(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """The rows of a predictions file up to its first incomplete line (no newline: a crash mid-write; or not
    JSON), and how many bytes those rows take. A missing file has no rows."""
    path = Path(path)
    if not path.exists():
        return [], 0
    rows, good_bytes = [], 0
    with open(path, "rb") as handle:
        for raw in handle:  # bytes split at b"\n" only: a prediction may hold U+2028 and the like
            if not raw.endswith(b"\n"):
                break
            try:
                rows.append(json.loads(raw))
            except json.JSONDecodeError:
                break
            good_bytes += len(raw)
    return rows, good_bytes


def is_moved_aside(path: str | os.PathLike, root: str | os.PathLike | None = None) -> bool:
    """`path` is, or lies inside, a run moved aside by overwrite=true (`<run dir>.old-<time>`, below `root`
    when given): history, not a result."""
    path = Path(path)
    parts = path.relative_to(root).parts if root is not None else path.parts
    return any(MOVED_ASIDE.fullmatch(part) for part in parts)


def run_summaries(root: str | os.PathLike, include_old: bool = False) -> list[Path]:
    """Every run's summary.json below `root`, sorted: what the report collects. Runs moved aside by
    overwrite=true and hidden folders (.submitit, .hydra) are left out unless `include_old` (history only)."""
    root = Path(root)
    paths = sorted(root.glob("**/summary.json")) if root.is_dir() else []
    return [p for p in paths if not any(part.startswith(".") for part in p.relative_to(root).parts)
            and (include_old or not is_moved_aside(p.parent, root))]


def read_rows(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete row of `<run_dir>/predictions.jsonl`, in the order written (retries included)."""
    return complete_rows(Path(run_dir) / PREDICTIONS)[0]


def is_failed(row: dict[str, Any]) -> bool:
    """The row records a sample that could not run (out of memory, prompt cap): no scores."""
    return row.get("status", OK) == FAILED


def succeeded(row: dict[str, Any]) -> bool:
    """The row holds a prediction and its scores."""
    return row.get("status", OK) == OK


def latest_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The last row of every sample, keyed by sample id in the order samples first appear."""
    return {row["sample_id"]: row for row in rows}


def successful_rows(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The latest row of every sample whose latest row succeeded: what a run's metrics are computed from
    (fields under their current names: `current_names`)."""
    return [current_names(row) for row in latest_rows(read_rows(run_dir)).values() if succeeded(row)]


# Fields renamed so that each says what it is (old name -> name written now). Files written before keep the old
# names on disk (predictions.jsonl is never rewritten); their readers see the current names.
RENAMED_ROW_FIELDS = {
    "compression_ratio": "kept_ratio",                   # the share of the prompt kept, min(N / L, 1)
    "kv_cache_bytes": "kv_cache_allocated_bytes",        # the cache's buffers as allocated
    "kv_cache_peak_bytes": "kv_cache_held_peak_bytes",   # the entries held at once, at most
    "seed": "sampling_seed",                             # the seed of sampled decoding; null when greedy
}
RENAMED_STATISTICS = {
    "mean_compression_ratio": "mean_kept_ratio",
    "max_kv_cache_bytes": "max_kv_cache_allocated_bytes",
    "max_kv_cache_peak_bytes": "max_kv_cache_held_peak_bytes",
}


def current_names(record: dict[str, Any], renamed: dict[str, str] = RENAMED_ROW_FIELDS) -> dict[str, Any]:
    """`record` (a row, or summary.json's statistics with RENAMED_STATISTICS) with old field names replaced by
    the current ones, in place in the key order; a record already written with current names is returned as is."""
    if not any(key in renamed for key in record):
        return record
    return {renamed.get(key, key) if renamed.get(key) not in record else key: value for key, value in record.items()}
