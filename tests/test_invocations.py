"""keydiff.run.invocations: a no-op re-run leaves summary.json as it was, a resume lists each invocation and its rows,
and compare_runs, point_status and collect read that list, old summaries included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keydiff.report import collect, compare_runs
from keydiff.run import invocations, runner
from keydiff.run.results import ResultStore, run_dir_of
from keydiff.run.sweep import point_status
from tests.test_cluster import make_cfg, rows_of, tiny  # noqa: F401  (tiny: the fixture)

pytestmark = pytest.mark.integration


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def without_last_checked(summary: dict) -> dict:
    return {key: value for key, value in summary.items() if key != "last_checked_at"}


def no_model(monkeypatch):
    """Fail the test if the model is loaded; returns the loader it replaced (the tiny model's)."""
    loader = runner.load_model
    monkeypatch.setattr(runner, "load_model", lambda cfg: pytest.fail("loaded the model with nothing to do"))
    monkeypatch.setattr(runner, "_LOADED", {})
    return loader


@pytest.mark.extended
def test_a_no_op_rerun_keeps_the_record_and_a_resume_lists_both_invocations(tmp_path, tiny, monkeypatch, capsys):
    """A batch-1 run of 1 sample, the same with batch_size=8 (nothing to do), then both samples at batch 2."""
    first_cfg = make_cfg(tmp_path, "threads=1", task={"limit": 1})
    run_dir = run_dir_of(first_cfg)
    first = runner.run(first_cfg, run_dir)
    written = summary_of(run_dir)
    (entry,) = written["invocations"]
    assert entry["batch_size"] == 1 and entry["threads"] == 1 and entry["rows"] == 1 and entry["samples_wall_s"] > 0
    assert entry["source"] == "invocation" and entry["finished_at"] and entry["argv"] == first["environment"]["argv"]
    assert (written["batch_size"], written["threads"], written["samples_wall_s"], written["started_at"]) == (
        1, 1, entry["samples_wall_s"], entry["started_at"])
    assert [row["invocation"] for row in rows_of(run_dir)] == [entry["id"]]
    assert "last_checked_at" not in written
    rows = (run_dir / "predictions.jsonl").read_bytes()

    # Nothing to compute: no model, no row, and summary.json as it was but for last_checked_at.
    loader = no_model(monkeypatch)
    again = runner.run(make_cfg(tmp_path, "threads=2", "batch_size=8", task={"limit": 1}), run_dir)
    checked = summary_of(run_dir)
    assert without_last_checked(checked) == written and checked["last_checked_at"]
    assert again["batch_size"] == 1 and again["samples_wall_s"] == entry["samples_wall_s"]
    assert (run_dir / "predictions.jsonl").read_bytes() == rows
    # compare_runs still has the wall time of the rows (before: `wall time b / a: -`)
    other_cfg = make_cfg(tmp_path, "threads=1", "experiment_name=other", task={"limit": 1})
    monkeypatch.setattr(runner, "load_model", loader)
    runner.run(other_cfg, run_dir_of(other_cfg))
    record = compare_runs.compare(run_dir_of(other_cfg), run_dir)
    assert record["wall_ratio"] == pytest.approx(entry["samples_wall_s"] / summary_of(run_dir_of(other_cfg))["samples_wall_s"])
    assert record["b"]["batch_size"] == 1 and record["b"]["wall_note"] == ""

    # A larger task.limit at batch 2 resumes: a second invocation, naming the one row it computed.
    tiny.clear()
    extended = runner.run(make_cfg(tmp_path, "threads=1", "batch_size=2"), run_dir)
    listed = summary_of(run_dir)["invocations"]
    assert len(listed) == 2 and without_last_checked(listed[0]) == entry  # the first one as it was recorded
    second = listed[1]
    assert second["batch_size"] == 2 and second["rows"] == 1 and second["samples_wall_s"] > 0
    assert second["started_at"] and second["id"] != entry["id"]
    assert {row["sample_id"]: row["invocation"] for row in rows_of(run_dir)} == {"len30": entry["id"],
                                                                                  "len100": second["id"]}
    assert extended["complete"] and extended["num_samples"] == 2
    # the run's own fields: no single batch size, the sum of both sample loops, the first start
    assert extended["batch_size"] is None and extended["threads"] == 1 and extended["started_at"] == entry["started_at"]
    assert extended["samples_wall_s"] == pytest.approx(entry["samples_wall_s"] + second["samples_wall_s"])

    # compare_runs: no ratio of a run computed at two batch sizes, and it says why
    record = compare_runs.compare(run_dir_of(other_cfg), run_dir)
    assert record["wall_ratio"] is None and record["b"]["batch_size"] == "mixed: 1, 2"
    assert "batch_size 1, 2" in record["b"]["wall_note"] and len(record["b"]["invocations"]) == 2
    capsys.readouterr()
    assert compare_runs.main([str(run_dir_of(other_cfg)), str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "wall time b / a: - (b: its rows were computed by 2 invocations with batch_size 1, 2)" in text
    assert "invocation 1: batch 1, threads 1, 1 rows" in text and "invocation 2: batch 2, threads 1, 1 rows" in text

    # make status (point_status) and collect read the list
    status = point_status(run_dir, {"len30", "len100"})
    assert status.describe().startswith("complete (2 of 2); batch_size mixed: 1, 2 (mean 1.0 per pass")
    record = collect.run_record(run_dir / "summary.json", tmp_path / "runs")
    assert record["batch_size"] == "mixed: 1, 2" and record["invocations"] == 2

    # a further re-run that computes nothing again changes only last_checked_at
    before = summary_of(run_dir)
    no_model(monkeypatch)
    runner.run(make_cfg(tmp_path, "batch_size=4"), run_dir)
    assert without_last_checked(summary_of(run_dir)) == without_last_checked(before)


@pytest.mark.extended
def test_rows_of_a_process_killed_before_its_summary_are_recorded_by_the_next_invocation(tmp_path, tiny, monkeypatch):
    """A no-op re-run lists the killed invocation from what its rows record, not leaving its rows out."""
    run_dir = tmp_path / "run"
    first = runner.run(make_cfg(tmp_path, "threads=1", task={"limit": 1}), run_dir)

    def killed(self, summary):
        raise KeyboardInterrupt  # the process ends after its rows, before its summary

    write_summary = ResultStore.write_summary
    monkeypatch.setattr(ResultStore, "write_summary", killed)
    with pytest.raises(KeyboardInterrupt):
        runner.run(make_cfg(tmp_path, "threads=1"), run_dir)
    monkeypatch.setattr(ResultStore, "write_summary", write_summary)
    assert summary_of(run_dir)["num_samples"] == 1 and len(rows_of(run_dir)) == 2

    no_model(monkeypatch)
    summary = runner.run(make_cfg(tmp_path, "threads=1"), run_dir)
    recorded, lost = summary["invocations"]
    assert recorded == first["invocations"][0]
    assert lost["source"] == invocations.ROWS and lost["rows"] == 1 and lost["threads"] == 1
    assert lost["code"] == rows_of(run_dir)[1]["code"] and lost["samples_wall_s"] is None
    assert summary["complete"] and summary["num_samples"] == 2 and summary["samples_wall_s"] is None
    assert compare_runs.run_side(run_dir, summary)["wall_note"] == "1 of 2 invocations recorded no wall time (rows)"
