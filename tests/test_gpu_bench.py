"""make gpu-bench at tiny sizes on a CPU (`--quick`): every row a GPU run writes runs its code here first, with
stand-ins for what a CPU lacks, and every row measured is kept whatever fails after it."""

from __future__ import annotations

import json

import pytest
import torch

from keydiff.bench import common, gpu_bench


pytestmark = pytest.mark.unit


@pytest.mark.integration
@pytest.mark.extended
def test_quick_rows_and_the_gpu_hours_reader(tmp_path):
    """make gpu-hours refuses --quick rows as rates; the same rows marked as a full run's give every rate."""
    from keydiff.report import gpu_hours

    torch.set_num_threads(1)
    path = tmp_path / "bench.json"
    assert gpu_bench.main(["--quick", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    rows = record["rows"]
    exact = [r for r in rows if r["row"] == "exact"]
    assert exact and all(r["identical"] == r["of"] for r in exact)  # on CPU every row is exact
    rates, = [r for r in rows if r["case"] == "device rates"]
    assert rates["bandwidth"] > 0 and rates["matmul_flops"] > 0
    ours = [r for r in rows if r["row"] == "decode" and r["case"].startswith(("keydiff", "full"))]
    assert len(ours) == 8 and all(r["floor_ms"] > 0 for r in ours)
    assert "code" in record and record["command"].startswith("python -m keydiff.bench.gpu_bench")
    with pytest.raises(gpu_hours.RatesError, match="not --quick"):
        gpu_hours.load_rates(path)
    record = json.loads(json.dumps(record))
    record["device"], record["sizes"]["model"] = "cuda", gpu_hours.MEASURED
    for row in record["rows"]:
        if row["row"] == "decode" and "ms_per_step_steady" in row:
            row["ms_per_step_steady"] = abs(row["ms_per_step_steady"]) + 1.0  # tiny sizes: the difference is noise
    out = tmp_path / "full.json"
    out.write_text(json.dumps(record))
    rates = gpu_hours.load_rates(out)
    assert set(rates.decode) == set(rates.prefill) == {"ordinary", "fixed"}
    assert set(rates.speedup["grouped"]) == set(rates.speedup["full"]) == {record["sizes"]["batch"]}


def fail_at(case: str, error: BaseException):
    def on_row(row: dict) -> None:
        if row["case"] == case:
            raise error
    return on_row


@pytest.mark.integration
@pytest.mark.extended
def test_a_failure_in_a_group_keeps_the_rows_before_it_and_is_a_row(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "bench.json"
    error = ValueError("the third row broke\nsecond line of the message")
    code = gpu_bench.main(["--quick", "--rows", "prefill", "--json", str(out)], on_row=fail_at("keydiff ordinary", error))
    rows = json.loads(out.read_text())["rows"]
    assert code == 1
    planned = [r for g, r in gpu_bench.planned_rows(gpu_bench.QUICK) if g == "prefill"]
    assert [gpu_bench.identity(r) for r in rows] == planned  # every planned row, in its place
    assert all(r["seconds"] > 0 and "error" not in r for r in rows[:2])  # measured before the failure: kept
    failed = rows[2]
    assert failed["case"] == "keydiff ordinary" and failed["group"] == "prefill"
    assert failed["error"] == "ValueError: the third row broke"
    assert all(r["skipped"] and "'keydiff ordinary' failed before it" in r["error"] for r in rows[3:])


@pytest.mark.integration
@pytest.mark.extended
def test_a_failing_release_of_memory_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch):
    def refuse(device):
        raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED\nat CUDACachingAllocator.cpp")

    torch.set_num_threads(1)
    monkeypatch.setattr(common, "release_memory", refuse)
    out = tmp_path / "bench.json"
    assert gpu_bench.main(["--quick", "--rows", "exact,serving", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    measured = [r for r in rows if r["case"] != "release_memory"]
    assert [r["row"] for r in measured] == ["exact", "exact", "serving"] and not [r for r in measured if "error" in r]
    releases = [r for r in rows if r["case"] == "release_memory"]
    assert {r["group"] for r in releases} == {"exact", "serving"}
    assert all(r["error"] == "RuntimeError: captures_underway.empty() INTERNAL ASSERT FAILED" for r in releases)


def test_the_deadline_skips_rows_as_rows(tmp_path):
    out = tmp_path / "bench.json"
    assert gpu_bench.main(["--quick", "--rows", "exact", "--deadline", "0", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [gpu_bench.identity(r) for r in rows] == [r for g, r in gpu_bench.planned_rows(gpu_bench.QUICK)
                                                      if g == "exact"]
    assert all(r["skipped"] and r["error"].startswith("skipped: deadline 0 s passed") for r in rows)


@pytest.mark.extended
def test_the_deadline_stops_a_group_between_rows(tmp_path):
    """A row ending past the deadline is kept; the group's later rows are written as skipped and never run."""
    planned = [{"row": "decode", "case": c} for c in ("a", "b", "c")]
    ran = []

    def rows():
        for row in planned:
            ran.append(row["case"])
            yield {**row, "ms_per_step": 1.0}

    out = tmp_path / "rows.json"
    log = common.RowLog(out, {}, lambda: {"device": "cpu"}, gpu_bench.row_line)
    gpu_bench.run_group("decode", planned, rows, log, deadline=lambda: "deadline 1 s passed (2 s)" if ran else None)
    written = json.loads(out.read_text())["rows"]
    assert ran == ["a"] and written[0] == {"row": "decode", "case": "a", "ms_per_step": 1.0}
    assert written[1:] == [{**r, "error": "skipped: deadline 1 s passed (2 s)", "skipped": True} for r in planned[1:]]


def test_gpu_bench_refuses_a_machine_without_cuda_unless_quick(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        gpu_bench.main([])
    assert "no CUDA device here" in capsys.readouterr().err


@pytest.mark.extended  # seconds: composes every preset / runs a whole benchmark; make test runs it
def test_a_failed_capture_is_said_and_fails_the_run(tmp_path, capsys):
    """A capture that fails leaves its steps eager: the run says so and exits 1."""
    out = tmp_path / "bench.json"
    code = gpu_bench.main(["--quick", "--rows", "decode", "--json", str(out)], capture_fail="end")
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert code == 1 and "capture failed, its steps ran eagerly" in printed
    assert any(r.get("capture_failures") for r in rows) and not any("error" in r for r in rows)
