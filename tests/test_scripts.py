"""scripts/: each command is a thin entry point into keydiff (at most ~30 lines, no sys.path edits) that runs --help;
the one-off tools (TOOLS) are whole in their file, and docs/layout.md names each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path for path in (ROOT / "scripts").iterdir() if path.suffix in (".py", ".sh"))
TOOLS = {"transcribe_paper.py", "local_slurm.py", "bench_threads.py"}


@pytest.mark.unit
def test_the_scripts_folder_holds_the_commands_the_design_names():
    names = {path.name for path in SCRIPTS}
    assert {"make_tables.py", "make_figures.py", "sweep_slurm.sh", "bench_peers.sh", "gpu_check.py"} | TOOLS <= names
    layout = (ROOT / "docs" / "layout.md").read_text()
    assert [name for name in sorted(TOOLS) if name not in layout] == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_each_script_is_a_thin_entry_point_that_runs(script):
    text = script.read_text()
    assert "sys.path" not in text
    if script.name not in TOOLS:
        assert len(text.splitlines()) <= 30 and "keydiff" in text
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, str(script)] if script.suffix == ".py" else ["bash", str(script)]
    result = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert any(usage in result.stdout for usage in ("usage:", "python -m keydiff", f"scripts/{script.name}")), \
        result.stdout
