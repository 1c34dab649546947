"""keydiff/grids.py: every conf/experiment grid against tests/golden/experiment_grids.json (the jobs each sweep
launches), rewritten after an intended change with `python -c "import json; from keydiff import grids; print(json.dumps(
{n: grids.experiment_grid(n) for n in grids.experiments()}, indent=1))" > tests/golden/experiment_grids.json`."""

from __future__ import annotations

import json
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


def test_a_sweep_other_than_a_list_is_one_error_naming_the_forms():
    with pytest.raises(HydraException, match=r"does not support the sweep 'seed=interval\(0,1\)'.*key=a,b,c"):
        grids.sweep_points(["seed=interval(0,1)"])
