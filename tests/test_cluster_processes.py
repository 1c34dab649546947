"""run.py as child processes on a tiny checkpoint: one-line config errors, lock, stop and resume, and SLURM through
submitit against the fake executables of tests/fake_slurm (sweep, only_missing, USR2 requeue)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import char_tokenizer, tiny_llama

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FAKE_SLURM = ROOT / "tests" / "fake_slurm"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-checkpoint")
    tiny_llama("sdpa").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def model_args(folder: Path) -> list[str]:
    return ["model=custom", f"model.path={folder}", "model.dtype=float32", "model.device=cpu", "model.max_length=4096"]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "HYDRA_FULL_ERROR"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def fake_slurm_env(state: Path, **extra: str) -> dict[str, str]:
    """child_env with tests/fake_slurm first on PATH, keeping its state in `state`."""
    return child_env(**{"PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_DIR": str(state),
                        "FAKE_SLURM_PYTHON": sys.executable, **extra})


def run_py(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env or child_env())


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]


def wait_for_a_row(run_dir: Path, deadline: float) -> None:
    predictions = run_dir / "predictions.jsonl"
    while (not predictions.exists() or not predictions.read_text().count("\n")) and time.time() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("args, expected", [
    (["-m", "policy=keydiff,keydif"], ["policy=keydif is not valid; valid: adakv_criticalkv, adakv_expected_attention, "
                                       "adakv_keydiff, adakv_snapkv, adakv_snapkv_relative, chunkkv"]),  # a grid point
    (["-m", "budget=2k", "block_size=64,0"], ["block_size=0 is not valid"]),
    (["budget=5k"], ["budget=5k is not valid", "3k", "8k"]),
    (["model=llama-9"], ["model=llama-9 is not valid", "smollm2-135m", "llama-3.1-8b-instruct"]),
    (["-m", "experiment=smoke", "hydra/launcher=slurm", "hydra.launcher.partition=null"],
     ["hydra/launcher=slurm needs a partition"]),
    (["-m", "polcy=a,b"], ["polcy is not a config group or key; valid groups: budget, experiment, logger, model, "
                           "policy, protocol, task; valid keys: attention_statistics, batch_invariant, batch_size,"]),
    (["model.nme=x"], ["model.nme is not a key of model; valid: attn_implementation, device, dtype,"]),
    (["budget=r0.3"], ["budget=r0.3 is not valid; valid: 1k, 2k, 3k, 4k, 6k, 8k, r0.1, r0.125, r0.25, r0.5, r0.75, "
                       "or any ratio: budget=r0.25 budget.ratio=0.3"]),
    (["results_root={tmp}/a-file/runs"], ["results_root=", "not writable"]),
])
def test_config_errors_are_one_line_exit_2_before_work_and_leave_no_directory(tmp_path, args, expected):
    (tmp_path / "a-file").write_text("not a directory")
    args = [arg.format(tmp=tmp_path) for arg in args]
    if not any(arg.startswith("results_root=") for arg in args):
        args.append(f"results_root={tmp_path / 'runs'}")
    result = run_py(*args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(text in lines[0] for text in expected), lines[0]
    assert "+polcy" not in result.stderr  # Hydra's own hint would follow the line
    assert not any((tmp_path / "runs").rglob("*"))


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_second_writer_is_refused_and_a_stop_then_a_rerun_loses_and_duplicates_nothing(tmp_path, tiny_model_dir,
                                                                                        signum, status):
    """A second writer is refused naming the holder; a stop after a row keeps every row and says how to resume."""
    name = signal.Signals(signum).name
    args = [*model_args(tiny_model_dir), "task.context_lengths=[400,800]", "task.depths=[0,25,50,75,100]",
            f"results_root={tmp_path / 'runs'}", "experiment_name=sig"]
    run_dir = tmp_path / "runs/sig/niah_small/custom/keydiff/2k/bs128/seed0"
    first = subprocess.Popen([sys.executable, "run.py", *args], cwd=ROOT, env=child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not (run_dir / ".lock").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.2)
        second = run_py(*args)
        assert second.returncode == 2, second.stderr
        assert f"host {socket.gethostname()}, pid {first.pid}" in second.stderr.splitlines()[-1]

        wait_for_a_row(run_dir, deadline)
        first.send_signal(signum)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == status, stderr
    assert "Traceback" not in stderr + stdout and "KeyboardInterrupt" not in stderr + stdout
    written = read_rows(run_dir)  # every line parses: no partial row
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 1 <= len(written) < 10 and summary["stopped_by"] == f"stopped by {name}" and not summary["complete"]
    assert summary["num_samples"] == len(written) and not (run_dir / ".lock").exists()
    lines = [line for line in stdout.splitlines() if f"stopped by {name}" in line]  # Hydra logs to stdout
    assert len(lines) == 1 and lines[0].endswith(
        f"stopped by {name} after writing every finished row ({len(written)} of 10 samples done, summary.json "
        "written); re-run the same command to resume")

    resumed = run_py(*args)
    assert resumed.returncode == 0 and f"10 samples, {len(written)} already done" in resumed.stdout, resumed.stderr
    rows = read_rows(run_dir)
    ids = [row["sample_id"] for row in rows]
    assert rows[: len(written)] == written and len(ids) == len(set(ids)) == 10
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True


def sweep_points(root: Path) -> dict[str, list[dict]]:
    return {p.parent.relative_to(root).as_posix(): read_rows(p.parent) for p in sorted(root.rglob("predictions.jsonl"))}


SAME = ("sample_id", "status", "prediction", "scores", "prompt_tokens", "kept_tokens", "new_tokens", "max_cache_entries")


def test_slurm_sweep_through_submitit_matches_a_local_sweep_and_resubmits_only_missing(tmp_path, tiny_model_dir):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    state = tmp_path / "slurm"
    env = fake_slurm_env(state)
    common = ["experiment=smoke", *model_args(tiny_model_dir), "task.context_lengths=[400]"]
    local = run_py(*common, f"results_root={tmp_path / 'local'}")
    assert local.returncode == 0, local.stderr
    slurm_args = [*common, "hydra/launcher=slurm", "hydra.launcher.partition=fake", "hydra.launcher.cpus_per_task=1",
                  f"results_root={tmp_path / 'slurm-runs'}"]
    submitted = run_py(*slurm_args, env=env)
    assert submitted.returncode == 0, submitted.stderr

    submissions = [json.loads(line) for line in (state / "submissions.jsonl").read_text().splitlines()]
    assert [(s["array_size"], s["partition"], s["cpus_per_task"]) for s in submissions] == [(2, "fake", "1")]
    script = Path(submissions[0]["script"]).read_text()
    assert "#SBATCH --array=0-1%2" in script and "submitit.core._submit" in script
    local_rows, slurm_rows = sweep_points(tmp_path / "local"), sweep_points(tmp_path / "slurm-runs")
    assert set(local_rows) == set(slurm_rows) and len(slurm_rows) == 2
    for point, rows in slurm_rows.items():
        assert [{k: r[k] for k in SAME} for r in rows] == [{k: r[k] for k in SAME} for r in local_rows[point]]
        assert all(r["threads"] == 1 for r in rows)  # SLURM_CPUS_PER_TASK from --cpus-per-task
    # Per-task logs where the README says: <results_root>/<experiment>/.submitit/<array>_<task>/
    job = submissions[0]["job_id"]
    for task in (0, 1):
        log = tmp_path / f"slurm-runs/smoke/.submitit/{job}_{task}/{job}_{task}_0_log.out"
        assert log.exists() and "results:" in log.read_text()

    # Lose the last row of one point: only that point is resubmitted (submitit sends a single job as a plain job).
    point = sorted(slurm_rows)[1]
    predictions = tmp_path / "slurm-runs" / point / "predictions.jsonl"
    predictions.write_text(predictions.read_text().splitlines(keepends=True)[0])
    again = run_py(*slurm_args, "only_missing=true", env=env)
    assert again.returncode == 0, again.stderr
    submissions = [json.loads(line) for line in (state / "submissions.jsonl").read_text().splitlines()]
    assert [s["array_size"] for s in submissions] == [2, 1]
    assert [r["sample_id"] for r in read_rows(predictions.parent)] == [r["sample_id"] for r in slurm_rows[point]]
    deadline = time.time() + 60
    while len(list(state.glob("done_*"))) < 2 and time.time() < deadline:  # the fake runners have exited
        time.sleep(0.2)


def test_usr2_under_submitit_requeues_and_the_requeued_task_resumes(tmp_path, tiny_model_dir):
    """USR2 to a running array task: the runner stops after its last whole row, submitit requeues, the task resumes."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]'")
    state = tmp_path / "slurm"
    env = fake_slurm_env(state)
    root = tmp_path / "runs"
    submitting = subprocess.Popen(
        [sys.executable, "run.py", "-m", *model_args(tiny_model_dir), "task.context_lengths=[400,800]",
         "task.depths=[0,25,50,75,100]", "experiment_name=pre", f"results_root={root}", "hydra/launcher=slurm",
         "hydra.launcher.partition=fake", "hydra.launcher.cpus_per_task=1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = root / "pre/niah_small/custom/keydiff/2k/bs128/seed0"
    try:
        wait_for_a_row(run_dir, time.time() + 240)
        os.kill(int((state / "pid_1000").read_text()), signal.SIGUSR2)
        stdout, stderr = submitting.communicate(timeout=400)
    finally:
        if submitting.poll() is None:
            submitting.kill()
    assert submitting.returncode == 0, stderr
    calls = [json.loads(line) for line in (state / "calls.log").read_text().splitlines()]
    assert ["scontrol", "requeue", "1000"] in calls
    logs = "".join(path.read_text() for path in (root / "pre/.submitit/1000").glob("1000_0_log.*"))
    assert "stopped by SIGUSR2 after writing every finished row" in logs and "Requeued job 1000" in logs
    ids = [row["sample_id"] for row in read_rows(run_dir)]
    assert len(ids) == len(set(ids)) == 10  # nothing lost, nothing twice
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True
    deadline = time.time() + 60
    while not list(state.glob("done_1000_*requeue")) and time.time() < deadline:
        time.sleep(0.2)
