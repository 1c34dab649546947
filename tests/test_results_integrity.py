"""What reaches the tables is exactly the runs that stand: a run moved aside by overwrite=true is history; a
task.limit at or above the task's size is the whole run; a device that is not there is refused before any directory."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from keydiff.report import collect, ruler, tables
from keydiff.run.results import ResultStore, is_moved_aside, run_summaries

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def ruler_summary(policy: str, budget: str, scores: dict[str, float], limit=1, complete=True) -> dict:
    """A RULER run's summary.json as the runner writes it (the keys collect and ruler read)."""
    return {
        "config": {"experiment_name": "leaderboard", "seed": 0, "model": {"name": "smollm2-135m"},
                   "policy": {"name": policy, "label": policy}, "budget": {"label": budget},
                   "task": {"_target_": "keydiff.tasks.ruler.Ruler", "name": "ruler_4k", "length": 4096,
                            "limit": limit}},
        "metrics": {"tasks": scores, "average": round(sum(scores.values()) / len(scores), 2),
                    "n": {t: 1 for t in scores}, "comparable_to_published": False, "not_comparable": ["fixture"]},
        "block_size": 128, "budget": None, "limit": limit, "complete": complete,
        "num_samples": len(scores), "num_failed": 0, "statistics": {"samples": len(scores)},
    }


def write_run(run_dir: Path, summary: dict) -> None:
    """What a finished run leaves: run_config.json (through ResultStore, as the runner), rows, summary.json."""
    store = ResultStore(run_dir, summary["config"])
    for task, score in summary["metrics"]["tasks"].items():
        store.append({"sample_id": f"{task}/0", "status": "ok", "scores": {"score": score / 100}})
    store.write_summary(summary)


def point(runs: Path, policy: str, budget: str) -> Path:
    return runs / "leaderboard" / "ruler_4k" / "smollm2-135m" / policy / budget / "bs128" / "seed0-limit1"


@pytest.mark.extended
def test_overwrite_then_tables_shows_only_the_new_run(tmp_path, caplog):
    """The leaderboard smoke re-run with overwrite=true, then `make tables`: only the new run (7.69) is shown."""
    runs, out = tmp_path / "runs", tmp_path / "tables"
    old = ruler_summary("keydiff", "r0.125", {"niah_single_1": 100.0, "qa_2": 0.0})
    new = ruler_summary("keydiff", "r0.125", {"niah_single_1": 0.0, "qa_2": 15.38})
    target = point(runs, "keydiff", "r0.125")
    write_run(target, old)
    for budget in ("r0.25", "r0.5", "r0.75"):
        scores = {"niah_single_1": 100.0, "qa_2": 0.0}
        write_run(point(runs, "keydiff", budget), ruler_summary("keydiff", budget, scores))

    with caplog.at_level(logging.WARNING, logger="keydiff.run.results"):
        store = ResultStore(target, new["config"], overwrite=True)  # what overwrite=true does to the directory
    (backup,) = target.parent.glob("seed0-limit1.old-*")
    assert is_moved_aside(backup) and (backup / "summary.json").exists() and not (target / "summary.json").exists()
    assert f"moved to {backup}" in caplog.text  # the log says where the old run went
    for task, score in new["metrics"]["tasks"].items():
        store.append({"sample_id": f"{task}/0", "status": "ok", "scores": {"score": score / 100}})
    store.write_summary(new)

    assert backup / "summary.json" not in run_summaries(runs)
    assert backup / "summary.json" in run_summaries(runs, include_old=True)
    tables.cli(["--runs", str(runs), "--summary", str(tmp_path / "summary.csv"), "--out", str(out)])
    ruler.main(runs, out)

    frame = pd.read_csv(tmp_path / "summary.csv")
    assert len(frame) == 4 and not frame["run_dir"].str.contains(".old-", regex=False).any()
    r0125 = frame[frame["budget_label"] == "r0.125"]
    assert r0125["score"].tolist() == [7.69]
    board = (out / "leaderboard.md").read_text()
    assert "7.69 [n too small] (n=1)§" in board and "28.845" not in board
    assert "50.00 [n too small] (n=1)§ (2/13)" in board
    generic = (out / "generic" / "leaderboard__ruler_4k.md").read_text()
    assert "28.845" not in generic
    assert "| keydiff | 7.690 [n too small] (n=2)§ |" in generic  # n: the new run's 2 samples
    assert "| keydiff | r0.125 | 2 | 0 | 1 | 1 |" in generic  # one seed, not the old run as a second one
    ruler_md = (out / "ruler.md").read_text()
    assert ".old-" not in ruler_md and ruler_md.count("| smollm2-135m | keydiff | r0.125 |") == 1
    assert ".old-" not in (out / "ruler.csv").read_text()


def test_a_summary_collected_before_the_fix_is_collected_again(tmp_path):
    """A summary.csv that still lists a moved-aside run (written by an older collect) is re-collected."""
    runs = tmp_path / "runs"
    write_run(point(runs, "keydiff", "r0.5"), ruler_summary("keydiff", "r0.5", {"vt": 50.0}))
    stale = tmp_path / "summary.csv"
    pd.DataFrame({"run_dir": ["leaderboard/ruler_4k/m/keydiff/r0.5/bs128/seed0.old-20261125-172335"],
                  "score": [1.0]}).to_csv(stale, index=False)
    collect.ensure_summary(stale, runs)
    assert pd.read_csv(stale)["run_dir"].tolist() == [
        "leaderboard/ruler_4k/smollm2-135m/keydiff/r0.5/bs128/seed0-limit1"]


def test_collect_include_old_only_lists_the_moved_aside_runs(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_run(point(runs, "keydiff", "r0.5"), ruler_summary("keydiff", "r0.5", {"vt": 50.0}))
    config = ruler_summary("keydiff", "r0.5", {"vt": 50.0})["config"]
    ResultStore(point(runs, "keydiff", "r0.5"), config, overwrite=True)
    write_run(point(runs, "keydiff", "r0.5"), ruler_summary("keydiff", "r0.5", {"vt": 0.0}))
    frame = collect.main(["--runs", str(runs), "--out", str(tmp_path / "a.csv")])
    assert frame["score"].tolist() == [0.0] and "1 moved-aside run(s) left out" in capsys.readouterr().out
    frame = collect.main(["--runs", str(runs), "--out", str(tmp_path / "b.csv"), "--include-old"])
    printed = capsys.readouterr().out
    assert frame["score"].tolist() == [0.0]  # listed, never collected
    assert "moved aside by overwrite=true (history, not collected): 1" in printed and "score=50.0" in printed


def test_two_overwrites_in_one_second_keep_both_old_runs(tmp_path):
    run_dir = tmp_path / "run"
    for n in range(3):
        store = ResultStore(run_dir, {"n": n}, overwrite=True)
        store.append({"sample_id": "a", "status": "ok", "scores": {}})
    assert len(list(tmp_path.glob("run.old-*"))) == 2


def run_py(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from tests.test_runner import OUTSIDE_RESULTS

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=[OUTSIDE_RESULTS, *overrides])


@pytest.mark.extended
@pytest.mark.parametrize("overrides, covers", [
    (["task.limit=6"], True), (["task.limit=99"], True), (["task.limit=5"], False),  # niah_small: 6 samples
    (["task=ruler_4k", "task.tasks=[vt,cwe]", "task.num_samples=3", "task.limit=3"], True),  # limit: per RULER task
    (["task=ruler_4k", "task.tasks=[vt,cwe]", "task.num_samples=3", "task.limit=4"], True),
    (["task=ruler_4k", "task.tasks=[vt,cwe]", "task.num_samples=3", "task.limit=2"], False),
])
def test_a_limit_that_covers_the_task_is_the_whole_run(overrides, covers):
    from keydiff.run.checks import drop_whole_task_limit, limit_covers_task

    cfg = compose(*overrides)
    assert limit_covers_task(cfg) is covers
    assert drop_whole_task_limit(cfg) is covers
    assert (cfg.task.limit is None) is covers
    assert str(cfg.run_subdir).endswith("seed0") is covers


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="this machine has CUDA: model.device=cuda is valid here")
def test_a_missing_device_is_refused_before_any_directory_exists(tmp_path):
    """`model.device=cuda` without a GPU: one error line, exit 2, no run directory (the corrected command runs)."""
    result = run_py("model.device=cuda", f"results_root={tmp_path}")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: model.device=cuda is not available on this machine (0 CUDA device(s)); valid here: auto, cpu"]
    assert not list(tmp_path.iterdir())
    sweep = run_py("-m", "model.device=cuda:0", "policy=keydiff,tova", f"results_root={tmp_path}")
    assert sweep.returncode == 2 and "model.device=cuda:0 is not available" in sweep.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.extended
def test_a_slurm_sweep_leaves_the_device_to_the_node():
    """The login node that submits a SLURM array has no GPU: its points are checked without the device."""
    from keydiff.run.checks import check_run_config

    cfg = compose("model.device=cuda")
    check_run_config(cfg, runs_here=False)
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="model.device=cuda is not available"):
            check_run_config(cfg)
