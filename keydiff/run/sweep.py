"""The grid of a sweep and where each of its points stands, computed without torch or any model.

Used by the sweeper (hydra_plugins/keydiff_sweeper) and by `python -m keydiff.run.status`. The points are
keydiff.grids' (`grid_points`); a point's run directory is `<results_root>/<experiment_name>/<run_subdir>`, as
run.py writes it; `shard=all/n` expands into its n jobs. A sweep ends with `recap`: one line per job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig

from keydiff import grids
from keydiff.run import invocations, shards
from keydiff.run.checks import hub_unreachable
from keydiff.run.results import is_failed, latest_rows, read_rows, run_dir_of, succeeded

NOT_STARTED, PARTIAL, FAILED, COMPLETE = "not started", "partial", "failed samples", "complete"


def grid_points(params: dict[str, str] | None, arguments: Iterable[str], config_loader=None) -> list[list[str]]:
    """Every job's overrides: `hydra.sweeper.params` (an experiment's axes) combined with the command line, as
    keydiff.grids computes every grid (BasicSweeper's), `shard=all/n` expanded into its n jobs."""
    combined = [f"{key}={value}" for key, value in (params or {}).items()] + list(arguments)
    return grids.sweep_points(expand_shards(combined), config_loader)


def expand_shards(overrides: Iterable[str]) -> list[str]:
    """`shard=all/8` -> `shard=1/8,...,8/8`: one job per shard (keydiff.run.shards), each shard once."""
    expanded = []
    for text in overrides:
        if text.split("=", 1)[0] == "shard":
            override = OverridesParser.create().parse_override(text)
            values = (list(override.sweep_string_iterator()) if override.is_discrete_sweep()
                      else [override.get_value_element_as_str()])
            jobs = list(dict.fromkeys(each for value in values for each in shards.expand_all(value) or [value]))
            text = f"shard={','.join(jobs)}" if jobs != values else text
        expanded.append(text)
    return expanded


@dataclass
class PointStatus:
    state: str
    done: int  # samples with a successful latest row
    failed: int  # samples whose latest row records a failure
    total: int | None  # samples the run should have (None: the task's data could not be listed)
    shards: str = ""  # a grid point split into shards: which are complete, which missing (keydiff.run.shards)
    batch: str = ""  # a run that decoded several sequences at once: its batch_size and per-token time (batched_note)

    def describe(self) -> str:
        total = "?" if self.total is None else self.total
        if self.state == PARTIAL:
            text = f"{PARTIAL} ({self.done + self.failed} of {total})"
        elif self.state == NOT_STARTED:
            text = NOT_STARTED
        else:
            text = f"{self.state} ({self.done} of {total})"
        text += f", {self.failed} failed" if self.failed and self.state != FAILED else ""
        text += f"; {self.batch}" if self.batch else ""
        return text + (f"; {self.shards}" if self.shards else "")

    @property
    def sharded(self) -> bool:
        """The grid point is split into shards (described by them: keydiff.run.sweep.sharded_status)."""
        return bool(self.shards)

    def needs_run(self, retry_failed: bool = False) -> bool:
        return self.state in (NOT_STARTED, PARTIAL) or (retry_failed and self.state == FAILED)


def point_status(run_dir: Path, sample_ids: set[str] | None) -> PointStatus:
    """Where the run in `run_dir` stands against the samples it should have. A grid point whose shards are on
    disk is described by its shards (`sharded_status`), unless it holds a run of its own (not a merge)."""
    latest = latest_rows(read_rows(run_dir))
    if sample_ids is not None:
        latest = {sid: row for sid, row in latest.items() if sid in sample_ids}
    failed = sum(1 for row in latest.values() if is_failed(row))
    done = len(latest) - failed
    total = None if sample_ids is None else len(sample_ids)
    if total == 0:
        state = COMPLETE  # nothing to run (a shard of more shards than the task has sample groups)
    elif not latest:
        state = NOT_STARTED
    elif total is None or len(latest) < total:
        state = PARTIAL
    else:
        state = FAILED if failed else COMPLETE
    merged = shards.merge_record(run_dir) is not None
    if shards.shard_dirs(run_dir) and (merged or not latest):
        return sharded_status(run_dir, total, merged and state in (COMPLETE, FAILED))
    return PointStatus(state, done, failed, total, batch=batched_note(run_dir, latest.values()))


def batched_note(run_dir: Path, rows: Iterable[dict]) -> str:
    """'batch_size 8 (mean 5.0 per pass, 0.548 s/token)' for a run whose sequences decoded together (the batch size
    of its invocations, else the rows' largest mean batch); '' for a run at batch 1 or rows without those fields."""
    rows = [row for row in rows if succeeded(row) and "decode_batch_size" in row]
    sizes = [float(row["decode_batch_size"]) for row in rows]
    per_token = [float(row["decode_s_per_token"]) for row in rows if row.get("decode_s_per_token")]
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = None
    configured = invocations.batch_size(summary if isinstance(summary, dict) else None)
    largest = configured if configured is not None else (round(max(sizes)) if sizes else 1)
    if isinstance(largest, (int, float)) and int(largest) <= 1:
        return ""
    note = f"batch_size {largest if isinstance(largest, str) else int(largest)}"
    if sizes:
        note += f" (mean {sum(sizes) / len(sizes):.1f} per pass"
        note += f", {sum(per_token) / len(per_token):.3g} s/token)" if per_token else ")"
    return note


def sharded_status(run_dir: Path, total: int | None, merged: bool) -> PointStatus:
    """A grid point from its shards: complete when every shard of one count is (`merged`: `make collect` merged them),
    else partial, naming the missing shards; of several counts, the complete one, else the one with most rows."""
    candidates = [shards.shard_states(run_dir, count) for count in shards.shard_dirs(run_dir)]
    states = max(candidates, key=lambda states: (all(s.complete for s in states), sum(len(s.rows) for s in states)))
    rows = [row for state in states for row in state.rows.values()]
    failed, done = sum(1 for row in rows if is_failed(row)), sum(1 for row in rows if succeeded(row))
    note = shards.describe_shards(states)
    if len(candidates) > 1:
        note += f" (shards of {len(candidates)} counts on disk: {', '.join(map(str, shards.shard_dirs(run_dir)))})"
    if all(state.complete for state in states):
        state = FAILED if failed else COMPLETE
        note += ", merged" if merged else ", not merged yet (make collect)"
    else:
        state = PARTIAL if rows else NOT_STARTED
        note += "; the earlier merged result is out of the tables until then" if merged else ""
    return PointStatus(state, done, failed, total, shards=note)


@dataclass(frozen=True)
class Listed:
    """A sample as the sweep lists it: its id and its shard group (Task.shard_group)."""

    id: str
    group: str


_LISTINGS: dict[str, list[Listed] | None] = {}


def sample_ids(cfg: DictConfig) -> set[str] | None:
    """The ids a run of this config covers (task.limit applied; a shard's own, `shard=i/n`); None if the task's
    data is not available here (not downloaded and the Hub unreachable, no network, ...)."""
    key = repr(cfg.task)
    if key not in _LISTINGS:
        try:
            task = instantiate(cfg.task, _convert_="all")
            if task.hub_downloads() and hub_unreachable():  # listing would mean a minute of download retries
                _LISTINGS[key] = None
                return None
            _LISTINGS[key] = [Listed(sample.id, task.shard_group(sample)) for sample in task.samples()]
        except (OSError, ValueError, ImportError, RuntimeError):  # data not here (e.g. no network)
            _LISTINGS[key] = None
    listing = _LISTINGS[key]
    if listing is None:
        return None
    selection = shards.select(shards.parse_shard(cfg.get("shard")), listing, lambda listed: listed.group)
    return {listed.id for listed in selection.samples}


def headline_value(run_dir: Path, task_name: str) -> str:
    """'needle_recall 0.8333': the task's headline metric from the run's summary.json ('' where none)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    from keydiff.run.tracking import headline  # numpy, through the paper's tables: not at every start of run.py

    name = headline(task_name)[1]
    value = (summary.get("metrics") or {}).get(name) if isinstance(summary, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return ""
    return f"{name} {value:.4g}" + (" (nothing evicted)" if summary.get("nothing_evicted") else "")


ENDED: dict[str, object] = {}  # run directory -> the JobReturn of a job that ended in this process (RecordEnd)


class RecordEnd(Callback):
    """`hydra.callbacks.recap`: keeps each job's JobReturn as the job ends, so that a sweep stopped midway still
    knows each job's outcome (an in-process launcher returns none until all have run)."""

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        ENDED[str(run_dir_of(config))] = job_return


def job_status(result) -> str:
    """A launched job's outcome from its Hydra JobReturn (None: the sweep stopped before the job ended)."""
    if result is None:
        return "stopped"
    if getattr(result.status, "name", "") == "COMPLETED":
        return "ok"
    try:
        error = result.return_value  # re-raises the job's exception
    except BaseException as raised:  # noqa: BLE001  (any failure of the job is reported, not raised here)
        error = raised
    return f"failed: {' '.join(str(error).split())[:160] or type(error).__name__}"


def recap(configs: list[DictConfig], results: list) -> list[str]:
    """The lines that end a sweep: per job, its outcome (the launcher's JobReturns, else the RecordEnd kept, else
    "stopped" / "not run"), where its run stands on disk, its headline metric and run directory."""
    rows, stopped = [], False
    for index, cfg in enumerate(configs):
        run_dir = run_dir_of(cfg)
        result = results[index] if index < len(results) else ENDED.get(str(run_dir))
        status = "not run" if result is None and stopped else job_status(result)  # in-process jobs run in order
        stopped = stopped or result is None
        state = point_status(run_dir, sample_ids(cfg)).describe()
        rows.append((f"#{index}", status, state, headline_value(run_dir, str(cfg.task.name)), str(run_dir)))
    header = ("job", "status", "samples", "headline", "directory")
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header) - 1)]
    lines = [f"sweep recap: {sum(1 for row in rows if row[1] == 'ok')} of {len(rows)} jobs ok"]
    for row in [header, *rows]:
        lines.append("  " + "  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths)) + "  " + row[-1])
    return lines
