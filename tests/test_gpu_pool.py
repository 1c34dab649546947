"""`make sweep-local EXP=... GPUS=0,1,2,3`: one grid point per GPU at a time, each its own process pinned to its GPU
(hydra_plugins/keydiff_sweeper/gpu_launcher.py); without those GPUs, GPUS is refused in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hydra.core.utils import JobStatus
from omegaconf import OmegaConf

from hydra_plugins.keydiff_sweeper import gpu_launcher
from hydra_plugins.keydiff_sweeper.gpu_launcher import GpuPoolLauncher
from tests.test_cluster_processes import ROOT, child_env, files_under

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA GPUs")
def test_gpus_on_a_cpu_machine_are_refused_in_one_line_before_anything_runs(tmp_path):
    result = subprocess.run(["make", "-s", "-o", ".venv/.installed", "sweep-local", "EXP=smoke", "GPUS=0,1",
                             f"PY={sys.executable}", f"ARGS=results_root={tmp_path / 'runs'}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: GPUS=0,1 needs CUDA GPUs; this machine has none (run without GPUS)"], result.stderr
    assert "Traceback" not in result.stderr and files_under(tmp_path / "runs") == []


def test_each_grid_point_is_its_own_process_pinned_to_one_gpu(tmp_path, monkeypatch):
    """The launcher's children (a stand-in run.py printing what it was given) see one GPU each."""
    stand_in = tmp_path / "run.py"
    stand_in.write_text("import os, sys, time\nprint(os.environ['CUDA_VISIBLE_DEVICES'], *sys.argv[1:])\n"
                        "time.sleep(0.2)\nsys.exit(3 if 'policy=broken' in sys.argv else 0)\n")
    monkeypatch.setattr(gpu_launcher, "RUN_PY", stand_in)
    launcher = GpuPoolLauncher(gpus=[2, 5])
    launcher.setup(hydra_context=None, task_function=None,
                   config=OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}}))
    points = [["policy=keydiff"], ["policy=tova"], ["policy=snapkv"], ["policy=broken"]]
    returns = launcher.launch(points, initial_job_idx=0)
    logs = [(tmp_path / f"sweep/.gpu-logs/{index}.log").read_text().split() for index in range(4)]
    assert [log[1:] for log in logs] == points and {log[0] for log in logs} == {"2", "5"}
    assert [r.status for r in returns] == [JobStatus.COMPLETED] * 3 + [JobStatus.FAILED]
    with pytest.raises(RuntimeError, match=r"grid point #3 on GPU \d failed \(exit status 3\)"):
        _ = returns[3].return_value
