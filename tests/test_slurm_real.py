"""The SLURM path against a real one-node cluster (scripts/local_slurm.py, partition `debug`, no accounting), started
here if it is not running; skipped with the reason where none can be started. Only what a real scheduler adds:
a submitted sweep completes, SLURM's own time-limit signal requeues to completion, real partitions are read."""

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


def complete_ids(run_dir: Path) -> list[str]:
    summary = run_dir / "summary.json"
    assert summary.exists() and json.loads(summary.read_text())["complete"] is True, run_dir
    return [row["sample_id"] for row in read_rows(run_dir)]


def wait_for_rows(predictions: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while (not predictions.exists() or not predictions.read_text().count("\n")) and time.time() < deadline:
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    assert predictions.exists(), "no row written in time"


def finish(process: subprocess.Popen, timeout: float = 480) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()


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
        ids = complete_ids(point)
        assert len(ids) == len(set(ids)) == 2
    time.sleep(3)  # the submitting process collects the results and exits
    assert "Bypassing sacct error" not in log.read_text()  # accounting is off: the harmless warning is dropped


def job_field(job: str, field: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return next((part.split("=", 1)[1] for part in shown.split() if part.startswith(f"{field}=")), "")


def test_time_limit_signal_stops_after_the_last_whole_row_and_submitit_requeues_to_completion(
        cluster, tmp_path, tiny_model_dir):
    # The limit is cut to 2-3 minutes from now: within signal_delay_s (300 s), so SLURM's timer (every 30 s) sends
    # USR2 at once. The requeued attempt gets its 10 minutes back (else it would be signalled at once too).
    root = tmp_path / "runs"
    samples = 4 * 51  # enough rows to still be running when SLURM's timer fires (up to 60 s) on a fast machine
    process = subprocess.Popen(
        [sys.executable, "run.py", "-m", "task.context_lengths=[400,800,1200,1600]",
         f"task.depths=[{','.join(str(d) for d in range(0, 101, 2))}]", "experiment_name=timeout",
         *slurm_args(tmp_path, tiny_model_dir, "hydra.launcher.timeout_min=10", "hydra.launcher.signal_delay_s=300")],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = root / "timeout/niah_small/custom/keydiff/2k/bs128/seed0"
    wait_for_rows(run_dir / "predictions.jsonl", process)
    [job] = [p.name for p in (root / "timeout/.submitit").iterdir() if p.is_dir()]
    elapsed_min = int(job_field(job, "RunTime").split(":")[-2]) + 1  # RunTime is [days-][hh:]mm:ss
    assert subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={elapsed_min + 2}"]).returncode == 0
    deadline = time.time() + 120
    while job_field(job, "Restarts") in ("", "0") and time.time() < deadline and process.poll() is None:
        time.sleep(0.5)
    assert job_field(job, "Restarts") == "1", "no requeue after the time-limit signal"
    assert subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"]).returncode == 0
    stdout, stderr = finish(process)
    assert process.returncode == 0, stderr
    logs = "".join(p.read_text(errors="replace") for p in (root / "timeout").glob(".submitit/*/*_log.*"))
    assert "stopped by SIGUSR2 after writing every finished row" in logs and f"Requeued job {job}" in logs, logs[-3000:]
    ids = complete_ids(run_dir)
    assert len(ids) == len(set(ids)) == samples


def test_a_partition_that_does_not_exist_fails_before_submitting(cluster, tmp_path, tiny_model_dir):
    args = [a if a != "hydra.launcher.partition=debug" else "hydra.launcher.partition=nonexistent"
            for a in slurm_args(tmp_path, tiny_model_dir)]
    result = run_py("experiment=smoke", *args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: hydra.launcher.partition=nonexistent is not a partition of this cluster; valid: debug"]
    assert not (tmp_path / "runs").exists()


def test_the_local_cluster_never_touches_a_configuration_it_did_not_write(tmp_path, monkeypatch):
    """No cluster needed: a machine with its own slurm.conf is refused in one line."""
    from scripts import local_slurm

    foreign = tmp_path / "slurm.conf"
    foreign.write_text("ClusterName=production\n")
    monkeypatch.setattr(local_slurm, "CONF", foreign)
    monkeypatch.setattr(local_slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(local_slurm.os, "geteuid", lambda: 0)
    with pytest.raises(local_slurm.ClusterUnavailable, match="exists and was not written here"):
        local_slurm.start()
    assert foreign.read_text() == "ClusterName=production\n"
    text = local_slurm.config_text("host1")
    for setting in ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
                    "AccountingStorageType=accounting_storage/none", "PartitionName=debug Nodes=host1"):
        assert setting in text
