"""The grid of a sweep and where each of its points stands, computed without torch or any model.

Used by the sweeper (hydra_plugins/keydiff_sweeper: checks every point before launching, dry_run,
only_missing) and by `python -m keydiff.run.status` (`make status EXP=table1`). A grid point is the list of
overrides one job gets, the same grid in the same order as Hydra's BasicSweeper (`grid_points`, built on
Hydra's public override parser); its run directory is `<results_root>/<experiment_name>/<run_subdir>`,
exactly where run.py writes it. A point's progress is read with keydiff.run.results' predictions reader.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import DictConfig

from keydiff.run.checks import hub_unreachable
from keydiff.run.results import is_failed, latest_rows, read_rows

NOT_STARTED, PARTIAL, FAILED, COMPLETE = "not started", "partial", "failed samples", "complete"


def grid_points(params: dict[str, str] | None, arguments: Iterable[str], config_loader=None) -> list[list[str]]:
    """Every job's overrides: `hydra.sweeper.params` (an experiment's axes) combined with the command line."""
    combined = [f"{key}={value}" for key, value in (params or {}).items()] + list(arguments)
    overrides = OverridesParser.create(config_loader=config_loader).parse_overrides(combined)
    axes: dict[str, list[str]] = {}  # a key given twice keeps its first place and its last values
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            axes[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            axes[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise HydraException(f"the keydiff sweeper does not support the sweep {override.input_line!r} "
                                 f"({override.value_type.name}); list the values: key=a,b,c or key=range(...)")
    return [list(point) for point in itertools.product(*axes.values())]


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


def point_status(run_dir: Path, sample_ids: set[str] | None) -> PointStatus:
    latest = latest_rows(read_rows(run_dir))
    if sample_ids is not None:
        latest = {sid: row for sid, row in latest.items() if sid in sample_ids}
    failed = sum(1 for row in latest.values() if is_failed(row))
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
