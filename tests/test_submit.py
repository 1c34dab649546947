"""`make sweep-slurm` (keydiff.run.submit) against the fake SLURM of tests/fake_slurm (issue 21): a submission
that fails says so in one line and exits non-zero, one that works names its job, DRY_RUN=1 submits nothing,
and a partition SLURM does not know or a machine without SLURM is refused before anything is submitted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cluster_processes import FAKE_SLURM, ROOT, child_env, model_args, tiny_model_dir  # noqa: F401


pytestmark = pytest.mark.slow


def fake_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return child_env(PATH=f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_DIR=str(tmp_path / "slurm"),
                     FAKE_SLURM_PYTHON=sys.executable, **extra)


def submit(tmp_path: Path, model_dir: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    args = [*model_args(model_dir), "task.context_lengths=[400]", "hydra.launcher.cpus_per_task=1",
            f"results_root={tmp_path / 'runs'}"]
    return subprocess.run([sys.executable, "-m", "keydiff.run.submit", "smoke", "--log", str(tmp_path / "sweep.log"),
                           *extra, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env or fake_env(tmp_path))


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


def submissions(tmp_path: Path) -> list[dict]:
    path = tmp_path / "slurm" / "submissions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_partition_slurm_does_not_know_is_refused_before_submitting(tmp_path, tiny_model_dir):
    result = submit(tmp_path, tiny_model_dir, "hydra.launcher.partition=nonexistent")
    assert result.returncode == 2, result.stderr
    assert error_lines(result) == ["error: hydra.launcher.partition=nonexistent is not a partition of this cluster; "
                                   "valid: fake, gpu"], result.stderr
    assert "Traceback" not in result.stderr and submissions(tmp_path) == []
    assert not (tmp_path / "sweep.log").exists()


def test_a_machine_without_slurm_is_refused_in_one_line(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty-path"
    empty.mkdir()
    result = submit(tmp_path, tiny_model_dir, "hydra.launcher.partition=gpu", env=child_env(PATH=str(empty)))
    assert result.returncode == 2, result.stderr
    [line] = error_lines(result)
    assert "no SLURM on this machine (sbatch, srun, sinfo not on PATH)" in line and "Traceback" not in result.stderr


def test_a_submission_sbatch_refuses_fails_with_its_reason_and_a_non_zero_status(tmp_path, tiny_model_dir):
    env = fake_env(tmp_path, FAKE_SLURM_SBATCH_ERROR="More processors requested than permitted")
    result = submit(tmp_path, tiny_model_dir, "hydra.launcher.partition=fake", env=env)
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result)
    assert "the SLURM submission failed" in line and "More processors requested than permitted" in line
    assert str(tmp_path / "sweep.log") in line and "submitted SLURM job" not in result.stdout


def test_a_submission_that_works_names_its_job_and_the_array_runs(tmp_path, tiny_model_dir):
    result = submit(tmp_path, tiny_model_dir, "hydra.launcher.partition=fake")
    assert result.returncode == 0, result.stderr
    assert "submitted SLURM job 1000 (2 task(s)); the submitting process" in result.stdout
    assert [s["array_size"] for s in submissions(tmp_path)] == [2]
    deadline = time.time() + 240  # the detached submitting process waits for the fake array, then exits
    while not (tmp_path / "slurm" / "done_1000").exists() and time.time() < deadline:
        time.sleep(0.5)
    rows = list((tmp_path / "runs").rglob("predictions.jsonl"))
    assert len(rows) == 2 and all(len(path.read_text().splitlines()) == 2 for path in rows)


def test_make_sweep_slurm_dry_run_submits_nothing(tmp_path, tiny_model_dir):
    """DRY_RUN=1 is the documented dry run (the grid and the sbatch script), not a submission."""
    args = " ".join([*model_args(tiny_model_dir), "task.context_lengths=[400]", "hydra.launcher.partition=fake",
                     f"results_root={tmp_path / 'runs'}"])
    result = subprocess.run(["make", "-s", "-o", ".venv/.installed", "sweep-slurm", "EXP=smoke", "DRY_RUN=1",
                             f"PY={sys.executable}", f"ARGS={args}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=fake_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "dry run: 2 grid point(s)" in result.stdout and "#SBATCH --partition=fake" in result.stdout
    assert submissions(tmp_path) == [] and not list((tmp_path / "runs").rglob("*.jsonl"))
