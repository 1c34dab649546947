"""The grid of a sweep and where each of its points stands, computed without torch or any model.

Used by the sweeper (hydra_plugins/keydiff_sweeper: checks every point before launching, dry_run,
only_missing) and by scripts/sweep_status.py (`make status EXP=table1`). A grid point is the list of
overrides Hydra's BasicSweeper gives one job; its run directory is
`<results_root>/<experiment_name>/<run_subdir>`, exactly where run.py writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import DictConfig

from keydiff.checks import hub_unreachable

NOT_STARTED, PARTIAL, FAILED, COMPLETE = "not started", "partial", "failed samples", "complete"


def grid_points(params: dict[str, str] | None, arguments: Iterable[str], config_loader=None) -> list[list[str]]:
    """Every job's overrides: `hydra.sweeper.params` (an experiment's axes) combined with the command line."""
    combined = [f"{key}={value}" for key, value in (params or {}).items()] + list(arguments)
    overrides = OverridesParser.create(config_loader=config_loader).parse_overrides(combined)
    return BasicSweeper.split_arguments(overrides, None)[0]


def run_dir_of(cfg: DictConfig) -> Path:
    return Path(str(cfg.results_root)) / str(cfg.experiment_name) / str(cfg.run_subdir)


@dataclass
class PointStatus:
    state: str
    done: int  # samples with a successful latest row
    failed: int  # samples whose latest row records a failure
    total: int | None  # samples the run should have (None: the task's data could not be listed)

    def describe(self) -> str:
        total = "?" if self.total is None else self.total
        if self.state == PARTIAL:
            text = f"{PARTIAL} ({self.done + self.failed} of {total})"
        elif self.state == NOT_STARTED:
            text = NOT_STARTED
        else:
            text = f"{self.state} ({self.done} of {total})"
        return text + (f", {self.failed} failed" if self.failed and self.state != FAILED else "")

    def needs_run(self, retry_failed: bool = False) -> bool:
        return self.state in (NOT_STARTED, PARTIAL) or (retry_failed and self.state == FAILED)


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Complete lines of predictions.jsonl (a partial last line from a crash is ignored)."""
    path = run_dir / "predictions.jsonl"
    if not path.exists():
        return []
    rows = []
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                break
            rows.append(json.loads(raw))
    return rows


def point_status(run_dir: Path, sample_ids: set[str] | None) -> PointStatus:
    latest = {row["sample_id"]: row for row in read_rows(run_dir)}
    if sample_ids is not None:
        latest = {sid: row for sid, row in latest.items() if sid in sample_ids}
    failed = sum(1 for row in latest.values() if row.get("status") == "failed")
    done = len(latest) - failed
    total = None if sample_ids is None else len(sample_ids)
    if not latest:
        state = NOT_STARTED
    elif total is None or len(latest) < total:
        state = PARTIAL
    else:
        state = FAILED if failed else COMPLETE
    return PointStatus(state, done, failed, total)


_SAMPLE_IDS: dict[str, set[str] | None] = {}


def sample_ids(cfg: DictConfig) -> set[str] | None:
    """The ids a run of this task config covers (task.limit applied); None if its data is not available here
    (not downloaded and the Hub unreachable, no network, ...)."""
    key = repr(cfg.task)
    if key not in _SAMPLE_IDS:
        try:
            task = instantiate(cfg.task, _convert_="all")
            if task.hub_downloads() and hub_unreachable():  # listing would mean a minute of download retries
                _SAMPLE_IDS[key] = None
                return None
            _SAMPLE_IDS[key] = {sample.id for sample in task.samples()}
        except (OSError, ValueError, ImportError, RuntimeError):  # data not here (e.g. no network)
            _SAMPLE_IDS[key] = None
    return _SAMPLE_IDS[key]
