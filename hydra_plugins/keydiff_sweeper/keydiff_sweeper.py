"""KeydiffSweeper: Hydra's BasicSweeper grid with every grid point checked before anything is launched.

Hydra discovers sweepers only under the `hydra_plugins` namespace, hence this package beside keydiff/
(found when run.py runs from the repository root). conf/config.yaml selects it (`hydra/sweeper: keydiff`).

It implements Hydra's public Sweeper plugin interface (setup + sweep; the launcher comes from Hydra's
plugin registry) and builds the same grid in the same order as BasicSweeper (keydiff.run.sweep.grid_points).
Before the first job: each point is composed and checked without torch (keydiff.run.checks), once per
point; the jobs do not check again (run.py). The SLURM
launcher must have SLURM on this machine and an existing partition (`sinfo`; a dry run needs neither and
says when the partition is missing), and nothing is created on disk
until all of that passed. Then
  dry_run=true       prints every point, its run directory and status, and with the SLURM launcher the
                     sbatch script and array size; nothing is run or submitted;
  only_missing=true  drops points that are complete (or have only recorded failures), so a re-submitted
                     sweep asks SLURM only for what is left (with shard=all/n: the shards not complete).
A sweep that launched jobs ends with a recap, one line per job (status, samples done, headline metric, run
directory; keydiff.run.sweep.recap), printed also when a job failed or the sweep was stopped.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, List

from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from keydiff.cli import exit_with_error
from keydiff.run.checks import ConfigError, check_run_config, describe_error, drop_whole_task_limit
from keydiff.run.results import run_dir_of
from keydiff.run.sweep import ENDED, grid_points, point_status, recap, sample_ids

log = logging.getLogger(__name__)
PARTITION_HINT = ("needs a partition: set slurm.partition in conf/local/default.yaml (see conf/local.example.yaml), "
                  "export SBATCH_PARTITION, or pass hydra.launcher.partition=<name>")


def is_slurm(launcher_cfg: Any) -> bool:
    return str(launcher_cfg.get("_target_", "")).endswith("SlurmLauncher")


def slurm_job_script(launcher_params: dict[str, Any], array_size: int) -> str:
    """The sbatch script the submitit launcher would submit for `array_size` grid points (built with
    submitit's own script writer; no `srun` needed, so it works off the cluster too).

    The one place that uses submitit internals: submitit has no public call that returns the job script
    without submitting it (SlurmExecutor writes it inside `submit`), and a dry run must show exactly that
    script, so its writer `_make_sbatch_string`, its memory format `_convert_mem` and the module its jobs
    run (`submitit.core._submit`) are used here and nowhere else."""
    from submitit.slurm.slurm import _convert_mem, _make_sbatch_string

    renamed = {"timeout_min": "time", "tasks_per_node": "ntasks_per_node", "name": "job_name"}
    params = {renamed.get(key, key): value for key, value in launcher_params.items()
              if key not in ("submitit_folder", "max_num_timeout", "mem_gb")}
    if launcher_params.get("mem_gb") is not None:
        params["mem"] = _convert_mem(launcher_params["mem_gb"])
    folder = Path(launcher_params["submitit_folder"]).expanduser().absolute()
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    # submitit sends a single point as a plain job, several as one array
    return _make_sbatch_string(command=command, folder=folder, map_count=array_size if array_size > 1 else None,
                               **params)


def slurm_partitions() -> list[str]:
    """The partitions this machine's SLURM controller knows (`sinfo`); ConfigError when there is no SLURM here
    or its controller does not answer, so a submission fails before submitit is asked to submit anything."""
    missing = [command for command in ("sbatch", "srun", "sinfo") if shutil.which(command) is None]
    if missing:
        raise ConfigError(f"hydra/launcher=slurm: no SLURM on this machine ({', '.join(missing)} not on PATH); "
                          "submit from a cluster's login node, or preview with dry_run=true")
    try:
        answer = subprocess.run(["sinfo", "--noheader", "--format=%R"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ConfigError("hydra/launcher=slurm: sinfo did not answer in 60 s (is slurmctld running?)") from None
    if answer.returncode != 0:
        reason = next((line.strip() for line in answer.stderr.splitlines() if line.strip()), "no message")
        raise ConfigError(f"hydra/launcher=slurm: sinfo failed (exit status {answer.returncode}): {reason}")
    return sorted({line.strip() for line in answer.stdout.splitlines() if line.strip()})


def check_partition(partition: str) -> None:
    """Every partition named (SLURM accepts a comma-separated list) exists on this cluster."""
    known = slurm_partitions()
    unknown = [name for name in str(partition).split(",") if name.strip() not in known]
    if unknown:
        raise ConfigError(f"hydra.launcher.partition={partition} is not a partition of this cluster; "
                          f"valid: {', '.join(known) or '(sinfo lists none)'}")


class WithoutAccounting(logging.Filter):
    """Drops submitit's "Bypassing sacct error" warning on a cluster whose accounting is off.

    submitit polls `sacct` for job states; without accounting storage sacct always fails, and submitit warns
    at every poll. The warning is harmless there: submitit then decides that a task is done from the result
    file the task itself writes, which is how every sweep here finishes. On a cluster with accounting the
    warning means something (sacct broken or slow) and is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Bypassing sacct error" not in record.getMessage()


def accounting_disabled() -> bool:
    try:
        answer = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.split("=", 1)[-1].strip() == "accounting_storage/none"
               for line in answer.stdout.splitlines() if line.startswith("AccountingStorageType"))


def chunks(points: list[list[str]], size: int | None) -> list[list[list[str]]]:
    """The launcher batches: all points at once, or `max_batch_size` at a time (as BasicSweeper)."""
    if size is None or size == -1:
        return [points] if points else []
    if size < 1:
        exit_with_error(f"hydra.sweeper.max_batch_size={size} is not valid; valid: a positive integer or null")
    return [points[start:start + size] for start in range(0, len(points), size)]


class KeydiffSweeper(Sweeper):
    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None,
                 dry_run_needs_partition: bool = False) -> None:
        super().__init__()
        self.max_batch_size = max_batch_size
        self.params = params or {}
        # `make sweep-slurm` checks with a dry run before it submits in the background: that one must fail too
        self.dry_run_needs_partition = dry_run_needs_partition
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def _compose(self, point: List[str]):
        """The point's checked configuration. A task.limit that covers the whole task becomes task.limit=null
        in `point` too (the job composes its run directory from it: the whole run's)."""
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(point))
            check_run_config(cfg, runs_here=not is_slurm(self.config.hydra.launcher))  # SLURM: the device is the node's
            if drop_whole_task_limit(cfg):
                point[:] = [o for o in point if o.lstrip("+").split("=", 1)[0] != "task.limit"] + ["task.limit=null"]
        except (HydraException, ConfigError, ValueError) as error:
            exit_with_error(f"grid point [{' '.join(point)}]: {describe_error(error)}")
        return cfg

    @staticmethod
    def _one_per_run_dir(points, configs):
        """Points that write the same run directory (task.limit=99,6 on a 6-sample task: both the whole run)
        run once."""
        seen, keep = set(), []
        for index, cfg in enumerate(configs):
            run_dir = run_dir_of(cfg)
            if run_dir in seen:
                log.info("grid point [%s] writes %s like an earlier point: run once", " ".join(points[index]), run_dir)
                continue
            seen.add(run_dir)
            keep.append(index)
        return [points[i] for i in keep], [configs[i] for i in keep]

    def _missing_partition(self) -> bool:
        launcher = self.config.hydra.launcher
        return is_slurm(launcher) and not launcher.get("partition")

    def _check_launcher(self) -> None:
        """A real SLURM submission needs SLURM here and an existing partition (a dry run submits nothing, so
        it needs neither and only says when the partition is missing). A GPU pool (GPUS=0,1) needs those GPUs
        here, dry run or not."""
        launcher = self.config.hydra.launcher
        if str(launcher.get("_target_", "")).endswith("GpuPoolLauncher"):
            from hydra_plugins.keydiff_sweeper.gpu_launcher import check_gpus

            problem = check_gpus(list(launcher.get("gpus") or []))
            if problem:
                exit_with_error(problem)
        if self.config.get("dry_run", False) and not self.dry_run_needs_partition:
            return
        if not is_slurm(self.config.hydra.launcher):
            return
        if self._missing_partition():
            exit_with_error(f"hydra/launcher=slurm {PARTITION_HINT}")
        try:
            check_partition(self.config.hydra.launcher.partition)
        except ConfigError as error:
            exit_with_error(str(error))

    def sweep(self, arguments: List[str]) -> Any:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        try:
            points = grid_points(self.params, arguments, self.hydra_context.config_loader)
        except HydraException as error:
            exit_with_error(describe_error(error))
        self._check_launcher()
        configs = [self._compose(point) for point in points]
        points, configs = self._one_per_run_dir(points, configs)
        root = self.config
        if root.get("only_missing", False):
            retry = bool(root.get("retry_failed", False))
            statuses = [point_status(run_dir_of(cfg), sample_ids(cfg)) for cfg in configs]
            for point, status in zip(points, statuses):
                if status.needs_run(retry) and status.sharded:  # it would run every sample again, unsharded
                    exit_with_error(f"grid point [{' '.join(point)}] is split into shards ({status.shards}): "
                                    "re-submit with the same shard=all/<n> to run the missing ones, or move its "
                                    "shards/ folder aside to run it whole")
            keep = [i for i, status in enumerate(statuses) if status.needs_run(retry)]
            log.info("only_missing: %d of %d grid points are not complete", len(keep), len(points))
            points, configs = [points[i] for i in keep], [configs[i] for i in keep]
        if root.get("dry_run", False):
            self._print_dry_run(points, configs)
            return []
        if not points:
            log.info("nothing to launch: every grid point is complete")
            return []

        if is_slurm(self.config.hydra.launcher) and accounting_disabled():
            logging.getLogger("submitit").addFilter(WithoutAccounting())
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns, first, finished = [], 0, []
        ENDED.clear()
        try:
            for batch in chunks(points, self.max_batch_size):
                results = self.launcher.launch(batch, initial_job_idx=first)
                finished.extend(results)
                for result in results:
                    _ = result.return_value  # re-raises a failed job's exception
                first += len(batch)
                returns.append(results)
        finally:  # also when a job failed or the sweep was stopped: what ran, and where
            try:
                print("\n".join(recap(configs, finished)), flush=True)
            except Exception as error:  # noqa: BLE001  (the recap never hides how the sweep itself ended)
                print(f"sweep recap: not available ({type(error).__name__}: {error})", flush=True)
        return returns

    def _print_dry_run(self, points, configs) -> None:
        print(f"dry run: {len(points)} grid point(s); nothing is run or submitted")
        for index, (point, cfg) in enumerate(zip(points, configs)):
            run_dir = run_dir_of(cfg)
            status = point_status(run_dir, sample_ids(cfg)).describe()
            print(f"  #{index} {' '.join(point)}\n      {run_dir}  [{status}]")
        launcher = self.config.hydra.launcher
        if is_slurm(launcher) and points:
            params = OmegaConf.to_container(launcher, resolve=True)
            params.pop("_target_", None)
            kind = "one array task per grid point" if len(points) > 1 else "a single point: a plain job, no --array"
            print(f"SLURM array size: {len(points)} ({kind})")
            if self._missing_partition():
                params.pop("partition", None)
                print(f"no partition set: this job script has no --partition; a real submission {PARTITION_HINT}")
            print("job script (sbatch):")
            print(slurm_job_script(params, len(points)))
