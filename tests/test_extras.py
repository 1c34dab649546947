"""keydiff.extras: a feature whose optional extra is missing ends in one line naming the extra, never a traceback; each
extra's modules hidden (`sys.modules[name] = None`) in a fresh process, so exit status and stderr are a user's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from keydiff.extras import MissingExtra, install_command, installed, require

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def hidden(modules: list[str], entry: str, argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `entry` (run.py, or -m <module>) with `argv` in a fresh interpreter where `modules` cannot be imported."""
    run = (f"runpy.run_module({entry[3:]!r}, run_name='__main__', alter_sys=True)" if entry.startswith("-m ")
           else f"runpy.run_path({entry!r}, run_name='__main__')")
    code = (f"import runpy, sys\nfor name in {modules!r}:\n    sys.modules[name] = None\n"
            f"sys.argv = [{entry!r}, *{argv!r}]\n{run}\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "HYDRA_FULL_ERROR": "0"})


def one_line(result: subprocess.CompletedProcess, extra: str) -> str:
    """The error line of a refused command: exit status 2, no traceback, the extra and its install command named."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: ") and f"needs the {extra!r} extra" in lines[0]
    assert install_command(extra) in lines[0]
    return lines[0]


@pytest.mark.unit
def test_require_names_the_extra_and_the_module_that_is_missing(monkeypatch):
    assert require("report", "json", "anything").dumps([]) == "[]"  # present: the module itself
    monkeypatch.setitem(sys.modules, "wandb_workspaces", None)
    for name in [name for name in sys.modules if name.startswith("wandb_workspaces.")]:  # imported by an earlier test
        monkeypatch.delitem(sys.modules, name)  # in this process (make report's): the import would find it there
    with pytest.raises(MissingExtra) as error:
        require("report", "wandb_workspaces.reports.v2", "the report", otherwise="nothing else")
    assert isinstance(error.value, ImportError) and isinstance(error.value, ValueError)  # checks catch ValueError
    assert str(error.value) == ("the report needs the 'report' extra (no module wandb_workspaces.reports): "
                                "pip install -e '.[report]'; or nothing else")
    assert not installed("wandb_workspaces") and not installed("wandb_workspaces.reports") and installed("json")
    with pytest.raises(ValueError, match="unknown extra 'wandbb'; valid: report, wandb"):
        install_command("wandbb")


# (hidden modules, entry, arguments, extra, what the line names besides); {out}: where nothing may appear. logger=wandb
# must be refused before a run directory exists (Hydra's callback once only warned, and a sample ran).
WITHOUT_EXTRA = [
    (["wandb_workspaces"], "-m keydiff.report.wandb", ["smoke", "--out", "{out}"], "report",
     "python -m keydiff.report.wandb"),
    (["wandb"], "-m keydiff.report.wandb", ["smoke", "--publish", "--entity", "me", "--out", "{out}"], "report",
     "(no module wandb)"),
    (["wandb"], "run.py", ["logger=wandb", "logger.mode=offline", "task.limit=1", "results_root={out}"], "wandb",
     "logger=wandb"),
    (["hydra_plugins.hydra_submitit_launcher", "submitit"], "run.py",
     ["-m", "experiment=smoke", "hydra/launcher=slurm", "dry_run=true", "results_root={out}"], "slurm",
     "hydra/launcher=slurm"),
    (["datasets"], "run.py", ["task=math500", "dry_run=true", "results_root={out}"], "datasets",
     "task.data_dir="),  # the way without the extra is named too
    (["flash_attn"], "run.py", ["model.attn_implementation=flash_attention_2", "model.dtype=bfloat16", "dry_run=true",
                                "results_root={out}"], "flash", "attn_implementation=sdpa"),
]


@pytest.mark.parametrize("modules, entry, argv, extra, named", WITHOUT_EXTRA,
                         ids=["report", "report-wandb", "logger-wandb", "slurm", "math500-datasets", "flash"])
def test_a_feature_without_its_extra_is_one_line_and_writes_nothing(tmp_path, modules, entry, argv, extra, named):
    out = tmp_path / "out"
    result = hidden(modules, entry, [a.format(out=out) for a in argv], tmp_path)
    assert named in one_line(result, extra)
    assert not out.exists()  # refused before anything is written


@pytest.mark.unit
@pytest.mark.extended
def test_a_check_that_fails_unexpectedly_stops_the_run(tmp_path, monkeypatch):
    """Hydra turns an error in a callback into a warning: any error of the check must still stop run.py."""
    import runpy

    from keydiff.run import checks, runner

    def broken(cfg, **kwargs):
        raise RuntimeError("a check that broke")

    def load(*args, **kwargs):
        raise AssertionError("the run started without its check")

    monkeypatch.setattr(checks, "check_run_config", broken)
    monkeypatch.setattr(runner, "load_model_once", load)  # what an unchecked run would do next (in seconds)
    monkeypatch.setattr(sys, "argv", ["run.py", f"results_root={tmp_path / 'runs'}", "hydra/hydra_logging=none",
                                      "hydra/job_logging=none"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
    assert stop.value.code == 1 and not (tmp_path / "runs").exists()
