"""Make targets run for real (-o keeps the install stamp; PY is this interpreter): a user's mistake is one `error:`
line and exit status 2; `make report` reads runs of every preset; `make help` lists every target."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed on this machine")


def make(*args: str, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-o", ".venv/.installed", f"PY={sys.executable}", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "KEYDIFF_PAPER_TEXT": ""})


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The program's single `error:` line (make adds its own `make: *** ... Error 2` after it)."""
    lines = [line for line in result.stderr.splitlines()  # make's own "make: ***" ("make[1]: ***" under make test)
             if line.strip() and not re.match(r"make(\[\d+\])?: \*\*\*", line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert not any(line.startswith("usage:") for line in result.stderr.splitlines())  # argparse's usage block
    return lines[0]


@needs_make
@pytest.mark.parametrize("args, expected", [
    (["status", "EXP=smoke", "ARGS=polcy=tova"], r"polcy is not a config group or key; valid groups: .*policy"),
    (["report", "ARGS=tabel1 --runs {tmp}/runs"], r"unknown experiment\(s\) tabel1; valid: .*table1"),
    (["paper-numbers"], r"no paper text given: make paper-numbers TEXT=.*arXiv 2504.15364"),
    (["paper-numbers", "TEXT=/nonexistent/keydiff-paper.txt"], r"/nonexistent/keydiff-paper.txt is not a file.*2504.15364"),
    (["tables", "ARGS=--bogus"], r"unrecognized arguments: --bogus \(usage: python -m keydiff.report.tables --help\)"),
    (["sweep-local"], r"experiment= is not valid; valid: .*smoke"),
    (["smoke", "ARGS=budget=r0.3"], r"budget=r0.3 is not valid; valid: .*r0.25.*budget.ratio=0.3"),
    (["leaderboard", "POLICIES=keydif"], r"policy=keydif is not valid; valid: .*keydiff"),
    (["gpu-hours", "ARGS=--rates {tmp}/gpu_bench.json"], r"gpu_bench\.json: no such file \(a rates file such as "),
    (["bench", "CASE=decod"], r"unknown case 'decod'; valid: prefill, decode, throughput"),
    (["bench-decode", "ARGS=--end-to-end --memory-scaling"], r"--end-to-end and --memory-scaling are two modes"),
])
def test_a_users_mistake_is_one_error_line_and_exit_2(args, expected, tmp_path):
    result = make(*(arg.replace("{tmp}", str(tmp_path)) for arg in args))  # {tmp}: not the checkout's results
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(expected, one_error_line(result)), result.stderr


@pytest.mark.unit
def test_status_without_an_experiment_or_with_a_typo_is_one_line(capsys, tmp_path):
    from keydiff.run import status

    for argv, expected in (([], "which experiment? make status EXP=<name>"),
                           (["tabel1"], "experiment=tabel1 is not valid; valid: "),
                           (["smoke", "--bogus"], "unrecognized arguments: --bogus")):
        with pytest.raises(SystemExit) as stop:
            status.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert status.main(["smoke", f"results_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "experiment smoke: 2 grid point(s)" in out and "total: 2 not started" in out, out
