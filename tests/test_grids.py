"""keydiff/grids.py: every conf/experiment grid against tests/golden/experiment_grids.json (the jobs each sweep
launches), rewritten after an intended change with `python -c "import json; from keydiff import grids; print(json.dumps(
{n: grids.experiment_grid(n) for n in grids.experiments()}, indent=1))" > tests/golden/experiment_grids.json`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException

from keydiff import grids

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "experiment_grids.json").read_text(encoding="utf-8"))


def test_the_golden_list_has_every_experiment():
    assert sorted(GOLDEN) == grids.experiments()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_each_experiments_grid_is_the_jobs_its_sweep_launches(name):
    assert grids.experiment_grid(name) == GOLDEN[name]


def test_command_line_overrides_join_the_grid_and_replace_an_axis():
    points = grids.experiment_grid("table1", ["model=llama-3.2-3b-instruct", "policy=keydiff,tova", "task.limit=2"])
    axes = grids.grid_axes(points)
    assert len(points) == 1 * 2 * 4 and axes["model"] == ["llama-3.2-3b-instruct"]
    assert axes["policy"] == ["keydiff", "tova"] and axes["budget"] == ["2k", "4k", "6k", "8k"]
    assert axes["experiment"] == ["table1"] and axes["task.limit"] == ["2"]
    assert list(axes) == ["model", "policy", "budget", "block_size", "experiment", "task.limit"]


def test_a_sweep_other_than_a_list_is_one_error_naming_the_forms():
    with pytest.raises(HydraException, match=r"does not support the sweep 'seed=interval\(0,1\)'.*key=a,b,c"):
        grids.sweep_points(["seed=interval(0,1)"])


@pytest.mark.slow
def test_the_module_imports_no_torch():
    code = ("import sys\nfrom keydiff import grids\nassert grids.experiment_grid('smoke')\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
