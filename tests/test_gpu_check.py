"""The GPU self-check (keydiff.bench.gpu_check: the environment, then the suite's device tests as rows), run on CPU:
a cluster user's first command must work."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from _pytest.reports import TestReport

from keydiff.bench import common, gpu_check

pytestmark = pytest.mark.integration

# The device machine has no hydra: the whole self-check runs with it unimportable.
NO_HYDRA = """
import sys
class NoHydra:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'hydra':
            raise ImportError('hydra is not installed on the device machine')
sys.meta_path.insert(0, NoHydra())
from keydiff.bench import gpu_check
sys.exit(gpu_check.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run; on CUDA run make gpu-check")
def test_the_self_check_reports_the_machine_then_runs_the_device_tests_without_hydra(tmp_path):
    """A -k subset of the device tests: the environment lines, one JSON row per test, the table, the exit status."""
    K = "equals_one_forward or flash_attention_2 or (bound_n_plus_b and 64-32-keydiff and not keydiff_)"
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-c", NO_HYDRA, "--device", "cpu", "--threads", "1", "--json", str(out),
                           "--", "-k", K],
                          cwd=common.CHECKOUT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("device=cpu threads=1 torch=") and "transformers=" in lines[0]
    assert lines[1].startswith("  gpu: None, gpus: 0, driver: None, cuda: None") and "kernels: ['sdpa', 'eager']" in lines[1]
    assert lines[2] == "pytest -m device --device cpu " + " ".join(gpu_check.DEVICE_TESTS) + " -k " + K
    assert re.search(r"^PASS 5 FAIL 0 SKIP 2 -> OK; rows in .*check.json$", done.stdout, re.M), done.stdout[-2000:]
    written = json.loads(out.read_text())
    assert written["machine"]["torch"] == torch.__version__ and written["machine"]["gpu"] is None
    assert written["counts"] == {"PASS": 5, "FAIL": 0, "SKIP": 2}
    assert written["command"].startswith("python -m keydiff.bench.gpu_check --device cpu") and "commit" in written["code"]
    rows = {(r["check"], r["setting"]): r for r in written["rows"]}
    forward = rows["test_full_block_prefill_equals_one_forward", "tiny-eager-bf16"]
    assert forward["result"] == "PASS" and forward["detail"].startswith("L=160: rel. max |diff|")
    assert forward["test"] == "tests/test_device_invariants.py::test_full_block_prefill_equals_one_forward[tiny-eager-bf16]"
    flash = [r for (check, _), r in rows.items() if check == "test_flash_attention_2_gives_sdpas_logits"]
    assert [(r["result"], r["detail"]) for r in flash] == [("SKIP", "flash_attention_2 runs on CUDA only")] * 2
    assert {setting for check, setting in rows if check == "test_bound_n_plus_b_holds_at_every_step"} == {
        "64-32-keydiff"}  # tests/test_engine.py's device tests run too
    assert f"test_full_block_prefill_equals_one_forward{' ' * 2}" in done.stdout  # the table


def report(nodeid: str, when: str, outcome: str, longrepr=None, properties=()) -> TestReport:
    return TestReport(nodeid, ("f.py", 1, "t"), {}, outcome, longrepr, when, user_properties=list(properties),
                      duration=0.5)


@pytest.mark.unit
def test_each_test_is_one_row_written_when_its_last_phase_is_reported(tmp_path):
    """FAIL rows carry the error's first line (a failed teardown too), SKIP its reason, PASS its recorded detail."""
    out = tmp_path / "rows.json"
    rows = gpu_check.Rows(str(out), common.provenance("keydiff.bench.gpu_check", []), {"machine": {}})
    crash = SimpleNamespace(reprcrash=SimpleNamespace(message="AssertionError: differ: keydiff\nassert 4 == 5"))
    a, b, c = "t.py::test_a[tiny-sdpa-bf16]", "t.py::test_b", "t.py::test_c[mid]"
    rows.pytest_runtest_logreport(report(a, "setup", "passed"))
    rows.pytest_runtest_logreport(report(a, "call", "failed", crash, [("detail", "4/5 identical")]))
    assert not out.exists()  # not before its teardown
    rows.pytest_runtest_logreport(report(a, "teardown", "passed"))
    assert json.loads(out.read_text())["rows"][0]["result"] == "FAIL"
    rows.pytest_runtest_logreport(report(b, "setup", "passed"))
    rows.pytest_runtest_logreport(report(b, "call", "passed", properties=[("detail", "ok"), ("position", 3)]))
    rows.pytest_runtest_logreport(report(b, "teardown", "failed", crash))
    rows.pytest_runtest_logreport(report(c, "setup", "skipped", ("t.py", 9, "Skipped: needs 2+ GPUs: 1 visible")))
    rows.pytest_runtest_logreport(report(c, "teardown", "passed"))
    written = json.loads(out.read_text())
    assert [(r["check"], r["setting"], r["result"], r["detail"], r["record"]) for r in written["rows"]] == [
        ("test_a", "tiny-sdpa-bf16", "FAIL", "call: AssertionError: differ: keydiff", None),
        ("test_b", "", "FAIL", "teardown: AssertionError: differ: keydiff", {"position": 3}),
        ("test_c", "mid", "SKIP", "needs 2+ GPUs: 1 visible", None)]
    assert written["counts"] == {"PASS": 0, "FAIL": 2, "SKIP": 1} and written["rows"][0]["seconds"] == 1.5


@pytest.mark.unit
def test_after_the_deadline_no_test_starts():
    """Rows' setup hook skips every test once the deadline has passed (later rows: SKIP, not started)."""
    on_time = gpu_check.Rows(None, {}, {}, deadline=600)
    on_time.pytest_runtest_setup(None)
    late = gpu_check.Rows(None, {}, {}, deadline=0)
    with pytest.raises(pytest.skip.Exception, match=r"deadline: \d+ s passed \(0 s allowed\), not started"):
        late.pytest_runtest_setup(None)


@pytest.mark.unit
def test_every_file_with_device_tests_is_one_the_self_check_runs():
    """gpu_check collects only DEVICE_TESTS: a `device` test in another file would be left out of make gpu-check."""
    tests = common.CHECKOUT / "tests"
    marked = sorted(f"tests/{path.name}" for path in tests.glob("test_*.py")
                    if re.search(r"pytest\.mark\.device\b", path.read_text()))
    assert marked == sorted(gpu_check.DEVICE_TESTS)


@pytest.mark.unit
@pytest.mark.parametrize("device, message", [
    ("cdua", "--device 'cdua' is not a device; valid: cpu, cuda, cuda:N"),
    ("meta", "--device meta: the checks run on cpu or cuda; valid: cpu, cuda, cuda:N"),
    pytest.param("cuda", "--device cuda: no CUDA device is visible here; valid: cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")),
])
def test_a_device_this_machine_lacks_is_one_line_before_anything_runs(capsys, device, message):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", device])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.strip().splitlines() == [
        f"error: {message} (usage: python -m keydiff.bench.gpu_check --help)"], err
