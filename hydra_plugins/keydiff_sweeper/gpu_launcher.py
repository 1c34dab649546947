"""GpuPoolLauncher: a sweep on one machine with several GPUs, one grid point per GPU at a time.

`make sweep-local EXP=leaderboard GPUS=0,1,2,3` selects it (`hydra/launcher=gpus hydra.launcher.gpus=[0,1,2,3]`).
Each grid point runs as its own `python run.py <overrides>` process with CUDA_VISIBLE_DEVICES set to one GPU
of the pool, so `model.device=auto` (the run's recorded configuration, unchanged) lands on that GPU; when a
point ends, its GPU takes the next point. Each child is an ordinary single run, so locks, resuming and
`make status` behave as in a one-process sweep. A child's output goes to
`<sweep dir>/.gpu-logs/<index>.log` (its run directory also has Hydra's run.log).

A fresh process per point (not a worker pool such as joblib's, which reuses processes) is what pins a job:
CUDA reads CUDA_VISIBLE_DEVICES once, when a process first uses it. The sweeper checks the GPUs exist
(`check_gpus`) before anything is launched; on a machine without them GPUS is refused in one line.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

log = logging.getLogger(__name__)
RUN_PY = Path(__file__).resolve().parents[2] / "run.py"


def check_gpus(gpus: Sequence[Any]) -> str | None:
    """Why this pool cannot run here (one line), or None. Imports torch: called once, before any launch."""
    if not gpus:
        return "hydra/launcher=gpus needs GPU indices: GPUS=0,1 (hydra.launcher.gpus=[0,1])"
    if len(set(map(str, gpus))) != len(gpus):
        return f"GPUS={','.join(map(str, gpus))} names a GPU twice"
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return f"GPUS={','.join(map(str, gpus))} needs CUDA GPUs; this machine has none (run without GPUS)"
    unknown = [g for g in gpus if not (isinstance(g, int) and 0 <= g < count)]
    if unknown:
        return f"GPUS: {unknown} not on this machine; valid: {', '.join(map(str, range(count)))}"
    return None


def run_on_devices(jobs: Sequence[Any], devices: Sequence[Any], run: Callable[[Any, Any], Any]) -> list[Any]:
    """run(job, device) for every job, at most one job per device at a time, jobs taken in order as devices
    free up; results in the jobs' order."""
    pending: queue.Queue = queue.Queue()
    for index in range(len(jobs)):
        pending.put(index)
    results: list[Any] = [None] * len(jobs)

    def device_worker(device: Any) -> None:
        while True:
            try:
                index = pending.get_nowait()
            except queue.Empty:
                return
            results[index] = run(jobs[index], device)

    threads = [threading.Thread(target=device_worker, args=(device,), daemon=True) for device in devices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


class GpuPoolLauncher(Launcher):
    def __init__(self, gpus: Sequence[int] = ()) -> None:
        self.gpus = list(gpus)
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        logs = Path(str(self.config.hydra.sweep.dir)) / ".gpu-logs"
        logs.mkdir(parents=True, exist_ok=True)
        jobs = [(initial_job_idx + i, list(overrides)) for i, overrides in enumerate(job_overrides)]

        def run(job: tuple[int, list[str]], gpu: int) -> JobReturn:
            index, overrides = job
            log.info("#%d on GPU %s: %s", index, gpu, " ".join(overrides))
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
            with open(logs / f"{index}.log", "w") as output:
                code = subprocess.call([sys.executable, str(RUN_PY), *overrides], env=env, stdout=output,
                                       stderr=subprocess.STDOUT)
            result = JobReturn(overrides=overrides, hydra_cfg=None)
            if code == 0:
                result.status, result.return_value = JobStatus.COMPLETED, code
            else:
                result.status = JobStatus.FAILED
                result.return_value = RuntimeError(f"grid point #{index} on GPU {gpu} failed (exit status {code}): "
                                                   f"see {logs / f'{index}.log'}")
            return result

        return run_on_devices(jobs, self.gpus, run)
