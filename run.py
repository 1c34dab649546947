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
line, `error: ...`, exit status 2, and leave no run directory behind. A stop signal (SIGTERM/SIGUSR1/SIGUSR2) ends the run after its last
whole row and hands the signal on (keydiff.run.preemption): exit status 128 + signal, or submitit's requeue.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import keydiff  # noqa: F401  (registers the config resolvers; torch is imported later, on first use)
from keydiff import openmp
from keydiff.run.checks import ConfigError, check_command_line, exit_with_error
from keydiff.run.lock import RunLock, RunLockedError
from keydiff.run.preemption import Preempted
from keydiff.run.results import ConfigMismatchError, ResultWriteError, run_dir_of

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


def budget_note(summary: dict[str, Any]) -> str | None:
    """One line when the budget never bound: every prompt fit in N and no layer's cache ever exceeded its N_l, so
    nothing was evicted and the run scores as the full cache would (`budget=8k` on the default task, whose prompts
    are at most 3,870 tokens). None when something may have been evicted (a sufficient test: the largest cache of
    any layer and KV head never exceeded the smallest layer budget; without eviction while decoding, the longest
    prompt did not)."""
    statistics = summary.get("statistics") or {}
    budgets = [b for b in statistics.get("layer_budgets") or [summary.get("budget")] if b is not None]
    if not budgets or not statistics.get("samples") or statistics.get("mean_kept_ratio", statistics.get("mean_compression_ratio")) != 1.0:
        return None
    held = statistics["max_cache_entries"] if summary.get("decode_eviction", True) else statistics["max_prompt_tokens"]
    if held > min(budgets):
        return None
    ratio = summary.get("budget_ratio")
    budget = f"budget.ratio={ratio}" if ratio is not None else f"budget.tokens={summary['budget']}"
    return (f"{budget} >= every prompt (longest {statistics['max_prompt_tokens']:,} tokens): nothing was evicted "
            "(compression 1.0), so this run scores as the full cache; a smaller budget or longer prompts compare policies")


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


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if cfg.dry_run:  # a sweep's dry run never launches jobs; kept for launchers that bypass the sweeper
            print(f"dry run: would write {run_dir_of(cfg)}; nothing is run")
            remove_if_empty(run_dir, Path(cfg.results_root))
            return None
        try:
            with RunLock(run_dir, cfg.lock_wait):  # before torch: a second writer is refused in seconds
                openmp.prepare("run")  # again for jobs that start in main (submitit); a no-op after torch
                from keydiff.run.runner import run  # imports torch

                summary = run(cfg, run_dir, checked=True, holding_lock=True)  # checked before start
        except Preempted as stop:
            log.warning("%s after writing every finished row; re-run the same command to resume", stop)
            stop.deliver()
    except (ConfigError, ValueError, ConfigMismatchError, RunLockedError, ResultWriteError) as error:
        remove_if_empty(run_dir, Path(cfg.results_root))
        exit_with_error(str(error).replace("\n", " | "))
    log.info("metrics: %s", json.dumps(summary["metrics"], default=str)[:2000])
    if note := budget_note(summary):
        log.warning(note)
    log.info("statistics: %s", json.dumps(summarize_lists(summary["statistics"]), default=str))
    if summary["num_failed"]:
        log.warning("%d sample(s) failed: %s (recorded; retry_failed=true re-runs them)",
                    summary["num_failed"], summary["failures"])
    log.info("results: %s", summary["run_dir"])
    primary = summary["metrics"].get("score") if isinstance(summary["metrics"], dict) else None
    return primary if isinstance(primary, (int, float)) else None


if __name__ == "__main__":
    openmp.prepare("run")  # first: OpenMP reads its settings when torch loads (a config check may import torch)
    check_command_line(sys.argv[1:], CONF)  # one line and exit status 2 for what Hydra would report at length
    main()
