"""The suite's tiers (tests/conftest.py, docs/testing.md): every test is in exactly one of unit, integration and slow,
real-model and real-SLURM tests are slow, and the make targets select by these markers, not by lists of files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "slow")

pytestmark = pytest.mark.unit

# A plugin for a child pytest: every collected test's markers (after tests/conftest.py gave each its tier).
LISTING = """
import json, os

def pytest_collection_finish(session):
    with open(os.environ["TIER_LISTING"], "w") as handle:
        json.dump({item.nodeid: sorted({mark.name for mark in item.iter_markers()}) for item in session.items}, handle)
"""


def collect(tmp_path: Path, *args: str, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, dict[str, list[str]]]:
    """`pytest --collect-only` in a child with the listing plugin: (the process, {test id: its markers})."""
    (tmp_path / "tier_listing.py").write_text(LISTING)
    listing = tmp_path / "listing.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's xdist worker
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), TIER_LISTING=str(listing))
    # --assert=plain: a collection runs no assert, and rewriting every test module's asserts was a third of its time
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tier_listing",
                             "-p", "no:cacheprovider", "--assert=plain", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=600)
    return result, (json.loads(listing.read_text()) if listing.exists() else {})


@pytest.mark.slow
def test_every_collected_test_is_in_exactly_one_tier(tmp_path):
    result, marks = collect(tmp_path, "tests")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(marks) > 1000, len(marks)
    wrong = {test: names for test, names in marks.items() if sum(name in names for name in TIERS) != 1}
    assert not wrong, list(wrong.items())[:10]
    real = [test for test, names in marks.items() if {"real_model", "slurm"} & set(names) and "slow" not in names]
    assert not real, real[:10]
    device = [test for test, names in marks.items() if "device" in names]
    assert len(device) >= 3 and not [test for test in device if "slow" in marks[test]], device
    slurm = {test.split("::")[0] for test, names in marks.items() if "slurm" in names}
    assert slurm == {"tests/test_slurm_real.py"}, slurm  # make test runs a file in one worker: one cluster, one at a time


@pytest.mark.slow
def test_a_test_with_no_tier_or_two_stops_the_collection(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text("from tests.conftest import pytest_addoption, pytest_collection_modifyitems  # noqa: F401\n")
    (suite / "test_a.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.unit\n\n"
        "def test_file_tier(): pass\n\n"
        "@pytest.mark.slow\ndef test_own_tier_wins(): pass\n\n"
        "@pytest.mark.real_model\ndef test_real_model_is_slow(): pass\n\n"
        "class TestClass:\n    pytestmark = pytest.mark.integration\n\n    def test_class_tier(self): pass\n")
    result, marks = collect(tmp_path, "-c", str(suite / "pytest.ini"), str(suite), cwd=suite)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tiers = {test.split("::", 1)[1]: [name for name in names if name in TIERS] for test, names in marks.items()}
    assert tiers == {"test_file_tier": ["unit"], "test_own_tier_wins": ["slow"], "test_real_model_is_slow": ["slow"],
                     "TestClass::test_class_tier": ["integration"]}

    (suite / "test_b.py").write_text("import pytest\n\ndef test_none(): pass\n\n"
                                     "@pytest.mark.unit\n@pytest.mark.integration\ndef test_two(): pass\n\n"
                                     "@pytest.mark.unit\n@pytest.mark.slurm\ndef test_unit_on_slurm(): pass\n")
    result, _ = collect(tmp_path, "-c", str(suite / "pytest.ini"), str(suite), cwd=suite)
    assert result.returncode != 0
    assert "test_b.py::test_none: no tier" in result.stderr, result.stderr[-3000:]
    assert "test_b.py::test_two: marked integration and unit: one tier only" in result.stderr
    assert "test_b.py::test_unit_on_slurm: marked unit but slurm: slow" in result.stderr
    assert "test_a.py" not in result.stderr


def test_the_make_targets_select_by_tier_markers():
    makefile = (ROOT / "Makefile").read_text()
    quick = re.search(r"^test-quick:.*\n\t(.*)$", makefile, re.M).group(1)
    assert '-m "(unit or integration) and not extended"' in quick and "tests/" not in quick, quick
    full = re.search(r"^test:.*\n\t(.*)$", makefile, re.M).group(1)
    assert "-n $(JOBS) --dist loadfile --no-loadscope-reorder" in full and "--durations=25" in full, full
    assert " -m \"" not in full, full  # every tier
