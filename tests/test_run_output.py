"""What run.py prints and leaves beside the results: a log line per sample (no carriage returns in files), the
metrics table, a no-op's line, Hydra's files agreeing with summary.json, run.log across overwrite=true, the recap
that ends a sweep. run.py processes on a tiny checkpoint (not a terminal), and the pieces in this process."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import yaml
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

import run
from keydiff.run import logfile, sweep
from keydiff.run.progress import Progress
from keydiff.run.results import move_aside
from tests.test_cluster_processes import model_args, run_py, tiny_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.unit

TASK = ["task=niah_small", "task.context_lengths=[400]", "task.depths=[0,50,100]", "experiment_name=out"]


def run_dir(root: Path, policy: str = "keydiff", limit: int = 2) -> Path:
    return root / "out" / "niah_small" / "custom" / policy / "2k" / "bs128" / f"seed0-limit{limit}"


@pytest.mark.slow
def test_logs_hydra_files_and_overwrite_across_invocations(tmp_path, tiny_model_dir):  # noqa: F811
    root = tmp_path / "runs"
    args = [*model_args(tiny_model_dir), *TASK, "task.limit=2", f"results_root={root}"]
    directory = run_dir(root)

    first = run_py(*args)
    assert first.returncode == 0, first.stderr
    log_text = (directory / "run.log").read_text()
    # No progress bar in files: not in run.log, not in the captured streams (not a terminal); one line per sample.
    assert "\r" not in log_text + first.stdout + first.stderr
    assert re.findall(r"sample (\d)/2 L400/d\d+: needle_recall", log_text) == ["1", "2"]
    # the metrics as a table (its format: test_metrics_table_has_four_significant_digits), not one JSON line
    assert re.search(r"metrics \(2 samples\):\n  needle_recall\s+[\d.]+$", first.stdout, re.M)
    assert '{"needle_recall"' not in first.stdout

    # A re-run with a new setting computes nothing: one line says so, and it leaves no Hydra files behind.
    again = run_py(*args, "batch_size=4")
    assert again.returncode == 0, again.stderr
    assert ("every sample is already done, so batch_size=4 had no effect (the rows were computed with batch_size 1); "
            "to compare, run the same command with another results_root=<folder>") in again.stdout
    summary = json.loads((directory / "summary.json").read_text())
    folders = sorted(p.relative_to(directory).as_posix() for p in (directory / ".hydra").iterdir())
    assert [entry["hydra_files"] for entry in summary["invocations"]] == folders and len(folders) == 1
    overrides = yaml.safe_load((directory / folders[0] / "overrides.yaml").read_text())
    assert "batch_size=4" not in overrides and summary["invocations"][0]["batch_size"] == 1
    before = (directory / "run.log").read_bytes()

    # overwrite=true: the old run, its run.log and its Hydra files move aside untouched by this invocation.
    third = run_py(*args, "task.max_new_tokens=20", "overwrite=true")
    assert third.returncode == 0, third.stderr
    [old] = directory.parent.glob(f"{directory.name}.old-*")
    assert (old / "run.log").read_bytes() == before
    assert sorted(p.name for p in (old / ".hydra").iterdir()) == [Path(f).name for f in folders]
    new_log = (directory / "run.log").read_text()
    assert new_log.count("overwrite=true: the old run was moved to") == 1 and "batch_size=4" not in new_log
    assert new_log.count("metrics (2 samples)") == 1 and "0 already done" in new_log
    summary = json.loads((directory / "summary.json").read_text())
    assert [e["hydra_files"] for e in summary["invocations"]] == [
        p.relative_to(directory).as_posix() for p in (directory / ".hydra").iterdir()]


@pytest.mark.slow
def test_a_sweep_ends_with_a_recap_per_job(tmp_path, tiny_model_dir):  # noqa: F811
    root = tmp_path / "runs"
    result = run_py("-m", "policy=keydiff,tova", *model_args(tiny_model_dir), *TASK, "task.limit=1",
                    f"results_root={root}")
    assert result.returncode == 0, result.stderr
    recap = result.stdout[result.stdout.index("sweep recap:"):].splitlines()
    assert recap[0] == "sweep recap: 2 of 2 jobs ok" and recap[1].split()[:4] == ["job", "status", "samples", "headline"]
    for line, policy in zip(recap[2:4], ("keydiff", "tova")):
        assert re.match(r"  #\d\s+ok\s+complete \(1 of 1\)\s+needle_recall [\d.]+ \(nothing evicted\)\s+", line)
        assert line.endswith(str(run_dir(root, policy, 1)))


def test_recap_reports_failed_stopped_and_not_run_jobs(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "ENDED", {})
    configs = [OmegaConf.create({"results_root": str(tmp_path), "experiment_name": "x", "run_subdir": f"p{i}",
                                 "task": {"name": "niah_small"}}) for i in range(4)]
    monkeypatch.setattr(sweep, "sample_ids", lambda cfg: {"a"})
    done = tmp_path / "x" / "p0"
    done.mkdir(parents=True)
    (done / "predictions.jsonl").write_text(json.dumps({"sample_id": "a", "scores": {}}) + "\n")
    (done / "summary.json").write_text(json.dumps({"metrics": {"needle_recall": 2 / 3}, "nothing_evicted": False}))
    ok, failed = JobReturn(), JobReturn()
    ok.status, ok.return_value = JobStatus.COMPLETED, None
    failed.status, failed.return_value = JobStatus.FAILED, RuntimeError("out of\nmemory")
    sweep.ENDED[str(tmp_path / "x" / "p1")] = failed  # kept by the callback: the launcher returned nothing
    lines = sweep.recap(configs, [ok])
    assert lines[0] == "sweep recap: 1 of 4 jobs ok"
    cells = [line.split("  /")[0].split() for line in lines[2:]]
    assert cells[0] == ["#0", "ok", "complete", "(1", "of", "1)", "needle_recall", "0.6667"]
    assert cells[1][:4] == ["#1", "failed:", "out", "of"] and cells[2][:2] == ["#2", "stopped"]
    assert cells[3][:3] == ["#3", "not", "run"] and lines[-1].endswith(str(tmp_path / "x" / "p3"))


def test_metrics_table_has_four_significant_digits():
    text = run.format_metrics({"needle_recall": 0.833333333333, "n": 6, "by_length": {"400": 1.0, "800": 2 / 3},
                               "by_cell": {"400": {"0": 0.5}}, "tokens": 12345.678})
    assert text.splitlines() == ["  needle_recall  0.8333", "  n              6", "  by_length      400: 1, 800: 0.6667",
                                 "  by_cell        400: {0: 0.5}", "  tokens         12,346"]
    assert run.rounded({"a": [0.123456, 3], "b": 2.0}) == {"a": [0.1235, 3], "b": 2.0}


def test_run_log_opens_after_the_old_run_moved_aside(tmp_path):
    """run.log's handler holds the records until released: a move-aside in between leaves the old run.log as it was."""
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "run.log").write_text("old invocation\n")
    (directory / "predictions.jsonl").write_text("{}\n")
    handler = logfile.HeldFileHandler(str(directory / "run.log"))
    logger = logging.getLogger("test-held")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("before the move")
        old = move_aside(directory)
        root_handlers = logging.getLogger().handlers
        logging.getLogger().handlers = [handler]
        logfile.release()
        logging.getLogger().handlers = root_handlers
        logger.warning("after the move")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert (old / "run.log").read_text() == "old invocation\n"
    assert (directory / "run.log").read_text() == "before the move\nafter the move\n"


def test_unreleased_records_are_written_at_close_unless_the_directory_is_gone(tmp_path):
    kept, gone = tmp_path / "kept", tmp_path / "gone"
    for folder in (kept, gone):
        folder.mkdir()
        handler = logfile.HeldFileHandler(str(folder / "run.log"))
        handler.emit(logging.makeLogRecord({"msg": "refused"}))
        if folder == gone:
            shutil.rmtree(folder)
        handler.close()
    assert (kept / "run.log").read_text() == "refused\n" and not gone.exists()


def test_progress_on_a_terminal_draws_the_bar_and_still_logs_each_sample(caplog, capsys):
    row = {"sample_id": "a", "scores": {"exact": 1.0}, "prompt_tokens": 10, "ttft_s": 0.5, "new_tokens": 3}
    with caplog.at_level(logging.INFO, logger="keydiff.run.progress"):
        with Progress(1, "phonebook/keydiff", "exact", terminal=True) as progress:
            progress.done(row)
    assert [r.getMessage() for r in caplog.records] == [
        "sample 1/1 a: exact 1, 10 prompt tokens, TTFT 0.5 s, 3 new tokens"]
    assert "phonebook/keydiff: 100%" in capsys.readouterr().err


@pytest.mark.extended
def test_ctrl_c_before_the_first_sample_is_one_line_exit_130_and_no_directory(tmp_path, monkeypatch, caplog):
    """Ctrl-C before the run's own handler (torch loading, the task read): one line, exit 130, no run directory."""
    import runpy
    import sys

    from keydiff.run import runner

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", interrupt)
    monkeypatch.setattr(sys, "argv", ["run.py", f"results_root={tmp_path / 'runs'}", "hydra/hydra_logging=none",
                                      "hydra/job_logging=none"])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # run.py's hook: undone after the test
    with caplog.at_level(logging.INFO, logger="keydiff"), pytest.raises(SystemExit) as exited:
        runpy.run_path(str(Path(run.__file__)), run_name="__main__")
    assert exited.value.code == 130
    assert [r.getMessage() for r in caplog.records if "SIGINT" in r.getMessage()] == [
        "interrupted (SIGINT) before any sample ran; every row written before is kept: re-run the same command to "
        "start or resume"]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))


def test_ctrl_c_during_the_imports_prints_one_line(capsys):
    run.interrupted(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert capsys.readouterr().err == "interrupted (SIGINT) before the run started; nothing was written\n"
