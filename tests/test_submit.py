"""`make sweep-slurm` (keydiff.run.submit) against tests/fake_slurm: a refused submission is one line and a non-zero
status, an accepted one names its job, DRY_RUN=1 submits nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cluster_processes import ROOT, fake_slurm_env, model_args, tiny_model_dir  # noqa: F401


pytestmark = pytest.mark.slow


def submit(tmp_path: Path, model_dir: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    args = [*model_args(model_dir), "task.context_lengths=[400]", "hydra.launcher.cpus_per_task=1",
            f"results_root={tmp_path / 'runs'}"]
    return subprocess.run([sys.executable, "-m", "keydiff.run.submit", "smoke", "--log", str(tmp_path / "sweep.log"),
                           *extra, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env or fake_slurm_env(tmp_path / "slurm"))


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


def submissions(tmp_path: Path) -> list[dict]:
    path = tmp_path / "slurm" / "submissions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("partition, env, status, expected", [
    ("nonexistent", {}, 2, ["hydra.launcher.partition=nonexistent is not a partition of this cluster; valid: fake, "
                            "gpu"]),
    ("gpu", {"PATH": "{empty}"}, 2, ["no SLURM on this machine (sbatch, srun, sinfo not on PATH)"]),
    ("fake", {"FAKE_SLURM_SBATCH_ERROR": "More processors requested than permitted"}, 1,
     ["the SLURM submission failed", "More processors requested than permitted", "{log}"]),
], ids=["unknown-partition", "no-slurm", "sbatch-refuses"])
def test_a_refused_submission_is_one_line_and_a_non_zero_status(tmp_path, tiny_model_dir, partition, env, status,
                                                                  expected):
    (tmp_path / "empty").mkdir()
    env = {key: value.format(empty=tmp_path / "empty") for key, value in env.items()}
    result = submit(tmp_path, tiny_model_dir, f"hydra.launcher.partition={partition}",
                    env=fake_slurm_env(tmp_path / "slurm", **env))
    assert result.returncode == status, result.stderr
    [line] = error_lines(result)
    assert all(text.format(log=tmp_path / "sweep.log") in line for text in expected), line
    assert "Traceback" not in result.stderr and "submitted SLURM job" not in result.stdout
    assert submissions(tmp_path) == []
    if status == 2:  # refused before anything was submitted
        assert not (tmp_path / "sweep.log").exists()


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
    """DRY_RUN=1 prints the grid and the sbatch script, submits nothing."""
    args = " ".join([*model_args(tiny_model_dir), "task.context_lengths=[400]", "hydra.launcher.partition=fake",
                     f"results_root={tmp_path / 'runs'}"])
    result = subprocess.run(["make", "-s", "-o", ".venv/.installed", "sweep-slurm", "EXP=smoke", "DRY_RUN=1",
                             f"PY={sys.executable}", f"ARGS={args}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=fake_slurm_env(tmp_path / "slurm"))
    assert result.returncode == 0, result.stderr
    assert "dry run: 2 grid point(s)" in result.stdout and "#SBATCH --partition=fake" in result.stdout
    assert submissions(tmp_path) == [] and not list((tmp_path / "runs").rglob("*.jsonl"))
