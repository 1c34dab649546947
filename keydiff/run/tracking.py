"""Weights & Biases mirror of one run: live per-sample rows, a consistently named summary, and exactly one
W&B run per run directory, however often the run is resumed. The run directory's files stay the record.
Design: docs/design/runs.md#weights--biases
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from keydiff.extras import require
from keydiff.paper.reference import paper_values, read_tables, table_numbers
from keydiff.run.results import RENAMED_STATISTICS, atomic_write_json, current_names

MODES = ("online", "offline", "disabled")
MARKER = "wandb_run.json"  # in the run directory: W&B run id, rows logged so far, whether finish() ran
TABLE_EVERY = 10  # rows per increment of the `samples` table (every row would make one artifact entry each)
# The headline metric of each task family: (per-sample score name, run metric name). The one home of this
# choice: keydiff/report/collect.py derives the `score` column of results/summary.csv from it.
HEADLINE = {"longbench": ("score", "average"), "niah": ("needle_recall", "needle_recall"),
            "math500": ("flex", "flex"), "phonebook": ("exact", "exact"), "ruler": ("score", "average")}
ROW_NUMBERS = ("prompt_tokens", "kept_tokens", "kept_ratio", "ttft_s", "decode_s", "new_tokens",
               "max_cache_entries", "kv_cache_allocated_bytes", "peak_memory_bytes")
TABLE_COLUMNS = ["index", "sample_id", "status", "score", "prompt_tokens", "kept_ratio", "ttft_s",
                 "new_tokens", "prediction"]


class WandbCredentialsError(ValueError):
    """logger.mode=online without a W&B API key: raised before any work starts."""


def headline(task_name: str) -> tuple[str, str]:
    """(per-sample score name, run metric name) of a task: math500_8k -> math500's; unknown tasks -> "score"."""
    family = next((name for name in HEADLINE if str(task_name).startswith(name)), None)
    return HEADLINE.get(family, ("score", "score"))


def logger_settings(cfg: DictConfig) -> dict[str, Any]:
    logger = cfg.get("logger") or {}
    return OmegaConf.to_container(logger, resolve=True) if isinstance(logger, DictConfig) else dict(logger)


def effective_mode(settings: dict[str, Any]) -> str:
    """WANDB_MODE in the environment wins over logger.mode, as it does inside wandb itself."""
    mode = os.environ.get("WANDB_MODE") or settings.get("mode") or "online"
    return "offline" if mode == "dryrun" else str(mode)


def check(cfg: DictConfig) -> None:
    """Fail before any work when W&B logging cannot work: bad mode, wandb not installed, or online mode
    without credentials (checked locally: WANDB_API_KEY, ~/.netrc or wandb settings; no network)."""
    settings = logger_settings(cfg)
    if not settings.get("wandb", False):
        return
    mode = effective_mode(settings)
    if mode not in MODES:
        raise ValueError(f"logger.mode {mode!r} is not valid; valid: {', '.join(MODES)}")
    wandb = require("wandb", "wandb", "logger=wandb")  # MissingExtra, a ValueError: one line before the run
    if mode == "online" and not wandb.login(prompt=False, verify=False):
        raise WandbCredentialsError(
            "logger=wandb with logger.mode=online needs W&B credentials and none were found "
            "(WANDB_API_KEY, ~/.netrc or wandb settings). Fix: run `wandb login`, or set WANDB_API_KEY, "
            "or log locally with logger.mode=offline (later `make wandb-sync`), or logger=none."
        )


def run_id(cfg: DictConfig, run_dir: str | Path) -> str:
    """A W&B run id that only depends on where the run lives: sha256 of the run directory relative to
    results_root (absolute when it lies elsewhere), with `-g<n>` after n `overwrite=true` generations."""
    path = Path(run_dir).resolve()
    try:
        key = path.relative_to(Path(str(cfg.get("results_root", "results/runs"))).resolve()).as_posix()
    except ValueError:
        key = path.as_posix()
    generations = len(list(path.parent.glob(f"{path.name}.old-*")))  # keydiff.run.results moves old runs there
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return f"kd-{digest}" + (f"-g{generations}" if generations else "")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flatten(data: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts as {"a/b/c": value}; bools, strings and None are left out."""
    out: dict[str, float] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    elif _number(data):
        out[prefix] = data
    return out


def summary_scalars(summary: dict[str, Any], task_name: str, paper: dict[str, float]) -> dict[str, Any]:
    """The W&B summary of a run, named as documented at the top of this module."""
    metrics = summary.get("metrics") or {}
    statistics = current_names(summary.get("statistics") or {}, RENAMED_STATISTICS)
    top = metrics.get(headline(task_name)[1])
    scalars: dict[str, Any] = {
        **({"score": top} if _number(top) else {}),
        **{f"metrics/{key}": value for key, value in flatten(metrics).items()},
        **{f"statistics/{key}": value for key, value in flatten(statistics).items()},
        **{f"paper/{key}": value for key, value in paper.items()},
        "samples": statistics.get("samples", 0),
        "complete": bool(summary.get("complete")),
    }
    limit = (summary.get("config") or {}).get("task", {}).get("limit")
    scalars["limit"] = limit if limit is not None else 0  # 0 = the whole task
    return scalars


class NoTracking:
    """logger=none: every call does nothing."""

    run_id = None

    def log_row(self, row: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


class WandbTracker:
    """One W&B run per run directory, opened only when there is something new to log."""

    def __init__(self, init_kwargs: dict[str, Any], run_dir: Path, rows: list[dict[str, Any]],
                 task_name: str, paper: dict[str, float]):
        self.init_kwargs = init_kwargs
        self.run_id = init_kwargs["id"]
        self.marker = run_dir / MARKER
        self.task_name, self.paper = task_name, paper
        state = json.loads(self.marker.read_text(encoding="utf-8")) if self.marker.exists() else {}
        if state.get("id") != self.run_id:
            state = {}  # another generation (overwrite=true) or a copied directory: log everything again
        self.logged = min(int(state.get("logged_rows", 0)), len(rows))
        self.finished, self.digest = bool(state.get("finished")), state.get("summary_digest")
        self.run = self.table = None
        self.totals = {"score": [0.0, 0], "ttft_s": [0.0, 0]}
        for row in rows[: self.logged]:
            self._accumulate(row)
        pending = list(rows[self.logged:])
        if pending:
            self.finished = False
        for row in pending:  # rows written while W&B was off or before a crash: catch up, in order
            self.log_row(row)

    def _open(self) -> None:
        import wandb

        self.run = wandb.init(**self.init_kwargs)
        self.run.define_metric("sample/*", summary="none")
        self.run.define_metric("running/*", summary="last")
        self.table = wandb.Table(columns=TABLE_COLUMNS, log_mode="INCREMENTAL")
        self._save(finished=False)

    def _save(self, finished: bool) -> None:
        if self.init_kwargs.get("mode") == "disabled":
            return  # nothing was logged anywhere
        self.finished = finished
        atomic_write_json(self.marker, {"id": self.run_id, "project": self.init_kwargs.get("project"),
                                        "logged_rows": self.logged, "finished": finished,
                                        "summary_digest": self.digest})

    def _accumulate(self, row: dict[str, Any]) -> float | None:
        score = (row.get("scores") or {}).get(headline(self.task_name)[0])
        for key, value in (("score", score), ("ttft_s", row.get("ttft_s"))):
            if _number(value):
                self.totals[key][0] += value
                self.totals[key][1] += 1
        return score if _number(score) else None

    def log_row(self, row: dict[str, Any]) -> None:
        """History step `index` (the row's position in predictions.jsonl) and, every TABLE_EVERY rows, the table."""
        if self.run is None:
            self._open()
        row = current_names(row)  # a resumed run's rows of an older version under the current names
        index = self.logged
        score = self._accumulate(row)
        data: dict[str, Any] = {"sample/index": index, "sample/failed": int(row.get("status", "ok") != "ok")}
        data.update({f"sample/{key}": row[key] for key in ROW_NUMBERS if _number(row.get(key))})
        data.update({f"sample/{key}": value for key, value in (row.get("scores") or {}).items() if _number(value)})
        data.update({f"running/{key}": total / n for key, (total, n) in self.totals.items() if n})
        self.table.add_data(index, str(row.get("sample_id")), row.get("status", "ok"), score,
                            row.get("prompt_tokens"), row.get("kept_ratio"), row.get("ttft_s"),
                            row.get("new_tokens"), str(row.get("prediction", ""))[:2000])
        if len(self.table.data) % TABLE_EVERY == 0:
            data["samples"] = self.table
        self.run.log(data, step=index)
        self.logged = index + 1
        self._save(finished=False)

    def finish(self, summary: dict[str, Any]) -> None:
        """Summary, the table's last rows, and the W&B run closed; nothing at all for a no-op re-run."""
        scalars = summary_scalars(summary, self.task_name, self.paper)
        digest = hashlib.sha256(json.dumps(scalars, sort_keys=True, default=str).encode()).hexdigest()[:16]
        if self.run is None:
            if self.finished and digest == self.digest:
                return  # a re-run of a finished run: W&B already holds all of it
            self._open()
        elif self.table.data and len(self.table.data) % TABLE_EVERY:
            self.run.log({"samples": self.table}, step=self.logged - 1)  # the same step as the last row
        self.run.summary.update(scalars)
        self.digest = digest
        self.run.finish()
        self._save(finished=True)
        self.run = None


def start(cfg: DictConfig, run_dir: str | Path, rows: list[dict[str, Any]]) -> NoTracking | WandbTracker:
    """The tracker of one run (NoTracking unless logger=wandb). Call `check(cfg)` first."""
    settings = logger_settings(cfg)
    if not settings.get("wandb", False):
        return NoTracking()
    run_dir = Path(run_dir)
    container = OmegaConf.to_container(cfg, resolve=True)
    task_name = str(cfg.task.name)
    paper = {}
    if settings.get("paper_dir"):
        published = read_tables(settings["paper_dir"], table_numbers(cfg.get("experiment_name", "")))
        paper = paper_values(published, model=str(cfg.model.name), policy=str(cfg.policy.label),
                             policy_name=str(cfg.policy.name), budget_label=str(cfg.budget.label),
                             block_size=cfg.block_size, experiment_name=str(cfg.experiment_name),
                             primary=headline(task_name)[1])
    init_kwargs = {
        "project": settings.get("project", "keydiff-bench"),
        "entity": settings.get("entity"),
        "mode": effective_mode(settings),
        "id": run_id(cfg, run_dir),
        "resume": "allow",
        "group": str(cfg.get("experiment_name", "adhoc")),
        "job_type": task_name,
        "name": str(cfg.get("run_subdir", run_dir.name)),
        "tags": [str(cfg.policy.label), str(cfg.budget.label), str(cfg.model.name), f"bs{cfg.block_size}"]
                + (["subset"] if cfg.task.get("limit") is not None else []),
        "config": {**container, "run_dir": run_dir.as_posix()},
        "dir": str(run_dir),
        "reinit": "finish_previous",  # a sweep in one process: never log into the previous grid point's run
    }
    return WandbTracker(init_kwargs, run_dir, rows, task_name, paper)
