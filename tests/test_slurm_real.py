"""The SLURM path against a real scheduler (issue 24 section 4): a one-node cluster on this machine
(scripts/local_slurm.py: munged, slurmctld, slurmd, partition `debug`, no accounting), started here if it is
not running; every test is skipped, with the reason, where none can be started (no root, no slurm-wlm).

Each test submits run.py sweeps of the tiny random Llama (tests/test_cluster_processes.py) through
hydra-submitit-launcher and checks what a user would: every grid point completes and `make sweep-slurm`
names its job; `scontrol requeue` mid-run loses and duplicates nothing; SLURM's time-limit signal (the
launcher's --signal=USR2@signal_delay_s) stops the run after its last whole row and submitit requeues it
to completion; only_missing resubmits only what is missing; a partition that does not exist fails before
submitting; submitit's sacct polling stays quiet although accounting is off."""

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


def job_logs(sweep_dir: Path) -> str:
    return "".join(path.read_text(errors="replace") for path in sweep_dir.glob(".submitit/*/*_log.*"))


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


def test_sweep_completes_every_point_then_only_missing_resubmits_only_the_missing_one(cluster, tmp_path,
                                                                                   tiny_model_dir):
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

    predictions = points[1] / "predictions.jsonl"
    first_row = predictions.read_text().splitlines(keepends=True)[0]
    predictions.write_text(first_row)
    before = {p.name for p in (tmp_path / "runs/smoke/.submitit").iterdir() if p.is_dir()}
    again = run_py("experiment=smoke", *args, "only_missing=true", timeout=480)
    assert again.returncode == 0, again.stderr
    assert "only_missing: 1 of 2 grid points are not complete" in again.stdout
    new = {p.name for p in (tmp_path / "runs/smoke/.submitit").iterdir() if p.is_dir()} - before
    assert len(new) == 1 and "_" not in new.pop()  # one plain job, no array
    ids = complete_ids(points[1])
    assert len(ids) == len(set(ids)) == 2 and predictions.read_text().startswith(first_row)
    assert "Bypassing sacct error" not in again.stdout + again.stderr


def test_scontrol_requeue_mid_run_loses_and_duplicates_nothing(cluster, tmp_path, tiny_model_dir):
    root = tmp_path / "runs"
    process = subprocess.Popen(
        [sys.executable, "run.py", "-m", "task.context_lengths=[400,800]", "task.depths=[0,25,50,75,100]",
         "experiment_name=requeue", *slurm_args(tmp_path, tiny_model_dir)],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = root / "requeue/niah_small/custom/keydiff/2k/bs128/seed0"
    wait_for_rows(run_dir / "predictions.jsonl", process)
    [job] = [p.name for p in (root / "requeue/.submitit").iterdir() if p.is_dir()]
    assert subprocess.run(["scontrol", "requeue", job], capture_output=True).returncode == 0
    stdout, stderr = finish(process)
    assert process.returncode == 0, stderr
    ids = complete_ids(run_dir)
    assert len(ids) == len(set(ids)) == 10
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "Restarts=1" in shown, shown


def job_field(job: str, field: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return next((part.split("=", 1)[1] for part in shown.split() if part.startswith(f"{field}=")), "")


def test_time_limit_signal_stops_after_the_last_whole_row_and_submitit_requeues_to_completion(
        cluster, tmp_path, tiny_model_dir):
    """The launcher asks SLURM for USR2 signal_delay_s (here 300 s) before the time limit. Once rows are being
    written, the job's limit is cut to 2-3 minutes from now, so SLURM's time-limit timer (every 30 s) sends
    USR2 at once: the run stops after its last whole row and submitit requeues the job. The requeued
    attempt gets its 10 minutes back (else it would be signalled at once too) and completes the run."""
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
    logs = job_logs(root / "timeout")
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
    """Runs anywhere (no cluster needed): a machine with its own slurm.conf is refused in one line."""
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
