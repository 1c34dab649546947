"""Entry point: `python run.py [group=choice ...] [key=value ...]` (Hydra; see conf/config.yaml).

    python run.py                                    # default job: smollm2-135m, keydiff, 2k, B=128, NIAH
    python run.py policy=keydiff budget=8k
    python run.py -m policy=keydiff,snapkv,tova budget=2k,4k block_size=64,128,256
    python run.py experiment=table1                  # a whole paper table (conf/experiment/)
    python run.py experiment=table1 dry_run=true     # its grid points and run directories, nothing run

The command line is composed and checked before Hydra runs it (keydiff.run.checks.check_command_line: an
unknown choice, key or `budget=2048`), the configuration once, before any run directory exists
(keydiff.run.checks.check_run_config: by the CheckBeforeStart callback of conf/config.yaml for a single
run, by the sweeper in hydra_plugins/keydiff_sweeper for every grid point of a sweep), and a run that must
download from an unreachable Hub is refused in seconds. The run directory's lock is taken here, once,
before the runner (torch) is imported, so a second writer is refused in seconds. User errors print one
line, `error: ...`, exit status 2, and leave no run directory behind. A stop signal (SIGTERM/SIGUSR1/SIGUSR2, and
Ctrl-C: SIGINT) ends the run after its last whole row, says in one line how many samples are done, and hands the
signal on (keydiff.run.preemption): exit status 128 + signal (130 for Ctrl-C), or submitit's requeue.

What it leaves beside the results: run.log, opened once the directory is settled (after overwrite=true moved an
old run aside: keydiff.run.logfile), one line per sample; each invocation's Hydra files in `.hydra/<time>/`,
named by its entry in summary.json, or removed when it computed no row. It ends with the metrics as a small table.
"""

from __future__ import annotations

import sys


def interrupted(kind, value, traceback) -> None:
    """Ctrl-C while Python imports or Hydra composes (before any handler of ours): one line, not a traceback."""
    if issubclass(kind, KeyboardInterrupt):
        print("interrupted (SIGINT) before the run started; nothing was written", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, traceback)


if __name__ == "__main__":
    sys.excepthook = interrupted  # first: the imports below take seconds

# The imports come after the hook above, so that Ctrl-C during them prints one line.
import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import keydiff  # noqa: F401  (registers the config resolvers; torch is imported later, on first use)
from keydiff import openmp
from keydiff.run import logfile
from keydiff.cli import exit_with_error
from keydiff.run.checks import ConfigError, check_command_line
from keydiff.run.eviction import budget_note  # noqa: F401  (run.budget_note: the closing line)
from keydiff.run.lock import RunLock, RunLockedError
from keydiff.run.preemption import Preempted
from keydiff.run.progress import short
from keydiff.run.results import ConfigMismatchError, ResultWriteError, holds_a_run, move_aside, run_dir_of

log = logging.getLogger("keydiff")
HYDRA_ONLY = {".hydra", "run.log"}  # what Hydra writes into a job directory before our code runs
CONF = Path(__file__).resolve().parent / "conf"


def summarize_lists(statistics: dict[str, Any]) -> dict[str, Any]:
    """The run statistics for the log: a per-layer list (30 entries for SmolLM2) as one short string,
    "2048 x30" when every layer has the same value, else "min..max over n layers" (summary.json keeps
    the lists)."""
    short = {}
    for key, value in statistics.items():
        if isinstance(value, list) and len(value) > 3:
            known = [v for v in value if v is not None]
            if len(set(map(str, value))) == 1:
                value = f"{value[0]} x{len(value)}"
            elif known:
                value = f"{min(known)}..{max(known)} over {len(value)} layers" + (
                    f" ({len(value) - len(known)} unbounded)" if len(known) < len(value) else "")
        short[key] = value
    return short


def remove_if_empty(run_dir: Path, root: Path) -> None:
    """Undo Hydra's job directory when the run wrote nothing into it, then any parent left empty."""
    run_dir, root = run_dir.absolute(), root.absolute()
    if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= HYDRA_ONLY:
        return
    shutil.rmtree(run_dir)
    for parent in run_dir.parents:
        if parent == root or root not in parent.parents or any(parent.iterdir()):
            break
        parent.rmdir()


def hydra_files(run_dir: Path) -> str | None:
    """This invocation's folder of Hydra files (hydra.output_subdir, one per invocation), relative to the run
    directory; None where Hydra writes none there."""
    subdir = HydraConfig.get().output_subdir
    return None if subdir is None or not (run_dir / str(subdir)).is_dir() else Path(str(subdir)).as_posix()


def drop_unrecorded_hydra_files(run_dir: Path, files: str | None) -> None:
    """An invocation that computed no row leaves no Hydra files: they would say how rows were computed (a
    `batch_size=4` in overrides.yaml) when summary.json's invocations hold no row of theirs."""
    if files is None or not (run_dir / files).is_dir():
        return
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    listed = summary.get("invocations") if isinstance(summary, dict) else None
    if not any(entry.get("hydra_files") == files for entry in listed or []):
        shutil.rmtree(run_dir / files, ignore_errors=True)
        with contextlib.suppress(OSError):
            (run_dir / files).parent.rmdir()  # .hydra itself, when it held nothing else


def format_metrics(metrics: dict[str, Any], indent: str = "  ") -> str:
    """The metrics as a small two-column table, numbers to 4 significant digits; a nested metric (by length,
    by depth, ...) on one row as `key: value` pairs."""
    def value(item: Any) -> str:
        if isinstance(item, dict):
            return ", ".join(f"{key}: {value(inner) if not isinstance(inner, dict) else '{' + value(inner) + '}'}"
                             for key, inner in item.items())
        return short(item)

    if not metrics:
        return f"{indent}(no successful sample)"
    width = max(len(str(key)) for key in metrics)
    return "\n".join(f"{indent}{str(key):<{width}}  {value(item)}" for key, item in metrics.items())


def rounded(data: Any) -> Any:
    """`data` with every float to 4 significant digits (the log line; summary.json keeps the full values)."""
    if isinstance(data, dict):
        return {key: rounded(item) for key, item in data.items()}
    if isinstance(data, list):
        return [rounded(item) for item in data]
    return float(f"{data:.4g}") if isinstance(data, float) else data


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    files = hydra_files(run_dir)
    try:
        if cfg.dry_run:  # a sweep's dry run never launches jobs; kept for launchers that bypass the sweeper
            print(f"dry run: would write {run_dir_of(cfg)}; nothing is run")
            remove_if_empty(run_dir, Path(cfg.results_root))
            return None
        try:
            with RunLock(run_dir, cfg.lock_wait):  # before torch: a second writer is refused in seconds
                if cfg.overwrite and holds_a_run(run_dir):
                    move_aside(run_dir, keep_hydra=files)  # the old run.log too: before this invocation's opens
                logfile.release()  # run.log, in the directory as it now stays
                openmp.prepare("run")  # again for jobs that start in main (submitit); a no-op after torch
                from keydiff.run.runner import run  # imports torch

                summary = run(cfg, run_dir, checked=True, holding_lock=True,  # checked before start
                              invocation_fields=None if files is None else {"hydra_files": files})
        except Preempted as stop:
            drop_unrecorded_hydra_files(run_dir, files)
            log.warning("%s after writing every finished row (%s, summary.json written); re-run the same command "
                        "to resume", stop, stop.progress or "no sample done")
            stop.deliver()
        except KeyboardInterrupt:  # Ctrl-C before the run's own handler was installed (loading torch, the task)
            log.warning("interrupted (SIGINT) before any sample ran; every row written before is kept: re-run the "
                        "same command to start or resume")
            drop_unrecorded_hydra_files(run_dir, files)
            remove_if_empty(run_dir, Path(cfg.results_root))
            sys.exit(130)
    except (ConfigError, ValueError, ConfigMismatchError, RunLockedError, ResultWriteError) as error:
        drop_unrecorded_hydra_files(run_dir, files)
        remove_if_empty(run_dir, Path(cfg.results_root))
        exit_with_error(str(error).replace("\n", " | "))
    drop_unrecorded_hydra_files(run_dir, files)
    statistics = summary["statistics"]
    samples = statistics.get("samples", 0)
    log.info("metrics (%d sample%s):\n%s", samples, "" if samples == 1 else "s", format_metrics(summary["metrics"]))
    if note := budget_note(summary):
        log.warning(note)
    log.info("statistics: %s", json.dumps(rounded(summarize_lists(statistics)), default=str))
    if summary["num_failed"]:
        log.warning("%d sample(s) failed: %s (recorded; retry_failed=true re-runs them)",
                    summary["num_failed"], summary["failures"])
    log.info("results: %s", summary["run_dir"])
    primary = summary["metrics"].get("score") if isinstance(summary["metrics"], dict) else None
    return primary if isinstance(primary, (int, float)) else None


if __name__ == "__main__":
    try:
        openmp.prepare("run")  # first: OpenMP reads its settings when torch loads (a config check may import torch)
        check_command_line(sys.argv[1:], CONF)  # one line and exit status 2 for what Hydra would report at length
        main()
    except KeyboardInterrupt:  # Ctrl-C while Hydra composes, or between the jobs of a sweep
        print("interrupted (SIGINT); every row written before is kept: re-run the same command to resume",
              file=sys.stderr)
        sys.exit(130)
