"""Make targets run for real (-o keeps the install stamp; PY is this interpreter): a user's mistake is one `error:`
line and exit status 2; `make report` reads runs of every preset; `make clean` and `make help` reach everything."""

from __future__ import annotations

import json
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


def recorded_config(experiment: str, policy: str, budget: str) -> dict:
    """run_config.json as the runner writes it: the config Hydra composes for the point, resolved."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import keydiff  # noqa: F401  resolvers

    overrides = [f"policy={policy}", f"budget={budget}", f"experiment_name={experiment}"]
    if policy == "custom":
        overrides.append("policy.target=my_lab.policies.Mine")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


@pytest.mark.unit
@pytest.mark.extended
def test_make_report_with_runs_of_every_preset(tmp_path, capsys):
    """Runs of every preset (some hold only `defaults:` and a label), in a conf/experiment grid and adhoc."""
    pytest.importorskip("wandb_workspaces", reason="make report needs the wandb-workspaces package (.[dev])")
    from keydiff.report import wandb as make_report

    presets = sorted(path.stem for path in (ROOT / "conf" / "policy").glob("*.yaml"))
    runs = tmp_path / "runs"
    for experiment, budget in (("leaderboard", "r0.25"), ("adhoc", "2k")):
        for policy in presets:
            config = recorded_config(experiment, policy, budget)
            run_dir = runs / experiment / str(config["run_subdir"])
            run_dir.mkdir(parents=True)
            (run_dir / "run_config.json").write_text(json.dumps(config))
    out = tmp_path / "reports"
    assert make_report.main(["--runs", str(runs), "--out", str(out), "--paper", str(tmp_path / "absent")]) == 0
    printed = capsys.readouterr().out
    assert "adhoc__niah_small:" in printed and "leaderboard:" in printed
    adhoc = json.loads((out / "adhoc__niah_small.json").read_text())["grid"]
    assert adhoc["policies"] == sorted(recorded_config("adhoc", p, "2k")["policy"]["label"] for p in presets)
    board = json.loads((out / "leaderboard.json").read_text())["grid"]
    named = dict(zip(board["policies"], board["policy_names"]))  # composed presets: the base policy's name
    assert named["adakv_keydiff"] == "keydiff" and named["snapkv_pyramid"] == "snapkv" and named["adakv_snapkv"] == "snapkv"
    assert board["budgets"] == ["r0.125", "r0.25", "r0.5", "r0.75"]


@needs_make
def test_make_clean_reaches_every_pycache_and_nothing_hidden(tmp_path):
    for folder in ("keydiff/bench/__pycache__", "keydiff/__pycache__", "tests/__pycache__", ".venv/lib/__pycache__",
                   ".pytest_cache"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "x.pyc").write_text("")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "summary.csv").write_text("kept")
    result = subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), "-C", str(tmp_path), "clean"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_dir())
    assert not [p for p in left if p.endswith("__pycache__") and not p.startswith(".venv")]
    assert (tmp_path / ".venv/lib/__pycache__").is_dir() and not (tmp_path / ".pytest_cache").exists()
    assert (tmp_path / "results" / "summary.csv").read_text() == "kept"


@needs_make
def test_make_help_lists_every_target():
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M)[1].split()
    result = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    listed = {line.split("\t")[0] for line in result.stdout.splitlines()}
    assert "paper-assets" in listed and set(phony) <= listed, set(phony) - listed
