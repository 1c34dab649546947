"""The SLURM path against a real one-node cluster (scripts/local_slurm.py, partition `debug`), started here if it is
not running, skipped with the reason where none can be; only what a real scheduler adds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cluster_processes import ROOT, child_env, model_args, read_rows, run_py, tiny_model_dir  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm"), pytest.mark.slurm]


@pytest.fixture(scope="module")
def cluster() -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    started = subprocess.run([sys.executable, "scripts/local_slurm.py", "start"], cwd=ROOT,
                             capture_output=True, text=True, timeout=180)
    if started.returncode != 0:
        pytest.skip(started.stderr.strip().splitlines()[-1] if started.stderr.strip() else "no local SLURM cluster")


def slurm_args(tmp_path: Path, model_dir: Path, *extra: str) -> list[str]:
    return [*model_args(model_dir), "hydra/launcher=slurm", "hydra.launcher.partition=debug",
            "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
            f"results_root={tmp_path / 'runs'}", *extra]


def test_a_submitted_sweep_completes_every_point_and_sacct_stays_quiet(cluster, tmp_path, tiny_model_dir):
    args = ["task.context_lengths=[400]", *slurm_args(tmp_path, tiny_model_dir)]
    log = tmp_path / "sweep.log"
    submitted = subprocess.run([sys.executable, "-m", "keydiff.run.submit", "smoke", "--log", str(log), *args],
                               cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env())
    assert submitted.returncode == 0, submitted.stderr
    assert "submitted SLURM job" in submitted.stdout and "(2 task(s))" in submitted.stdout
    points = [tmp_path / f"runs/smoke/niah_small/custom/{policy}/1k/bs128/seed0-limit2" for policy in ("keydiff", "tova")]
    deadline = time.time() + 400
    while not all((p / "summary.json").exists() for p in points) and time.time() < deadline:
        time.sleep(1)
    for point in points:
        ids = [row["sample_id"] for row in read_rows(point)]
        assert len(ids) == len(set(ids)) == 2 and json.loads((point / "summary.json").read_text())["complete"], point
    time.sleep(3)  # the submitting process collects the results and exits
    assert "Bypassing sacct error" not in log.read_text()  # accounting is off: the harmless warning is dropped


def test_a_partition_that_does_not_exist_fails_before_submitting(cluster, tmp_path, tiny_model_dir):
    args = [a if a != "hydra.launcher.partition=debug" else "hydra.launcher.partition=nonexistent"
            for a in slurm_args(tmp_path, tiny_model_dir)]
    result = run_py("experiment=smoke", *args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: hydra.launcher.partition=nonexistent is not a partition of this cluster; valid: debug"]
    assert not (tmp_path / "runs").exists()


def test_the_local_cluster_never_touches_a_configuration_it_did_not_write(tmp_path, monkeypatch):
    from scripts import local_slurm

    foreign = tmp_path / "slurm.conf"
    foreign.write_text("ClusterName=production\n")
    monkeypatch.setattr(local_slurm, "CONF", foreign)
    monkeypatch.setattr(local_slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(local_slurm.os, "geteuid", lambda: 0)
    with pytest.raises(local_slurm.ClusterUnavailable, match="exists and was not written here"):
        local_slurm.start()
    assert foreign.read_text() == "ClusterName=production\n"
