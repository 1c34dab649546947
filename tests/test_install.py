"""The Makefile's editable install is quiet: the PYTHONWARNINGS its install line sets filters setuptools' "Editable
installation" banner. Checked offline by building this project's editable wheel with and without that environment."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BANNER = re.compile(r"Editable installation|BuildBackendWarning|InformationOnly")


def install_line() -> str:
    lines = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line
             and " -e " in line]
    assert len(lines) == 1, lines
    return lines[0]


def build_editable(tmp_path: Path, env: dict[str, str]) -> str:
    """stderr of setuptools building the editable wheel of this pyproject.toml (README, an empty package)."""
    project, out = tmp_path / "project", tmp_path / "wheel"
    (project / "keydiff").mkdir(parents=True)
    out.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    (project / "keydiff" / "__init__.py").write_text("")
    result = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_editable({str(out)!r})"],
                            cwd=project, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and list(out.glob("*.editable-*.whl")), result.stderr[-2000:]
    return result.stderr


def test_the_editable_install_prints_no_setuptools_banner(tmp_path):
    words = shlex.split(install_line())
    env = dict(word.split("=", 1) for word in words[:words.index("$(PY)")])  # VAR=value before the command
    assert env == {"PYTHONWARNINGS": "ignore:Editable installation"}
    assert BANNER.search(build_editable(tmp_path / "plain", {"PYTHONWARNINGS": ""}))  # what the filter is for
    assert not BANNER.search(build_editable(tmp_path / "filtered", env))
