"""CPU threading: keydiff.openmp's defaults fill only what the user left unset; the threading benchmark's one-line
refusals."""

from __future__ import annotations

import pytest

from keydiff import openmp

pytestmark = pytest.mark.unit


def test_defaults_fill_only_what_the_user_left_unset(monkeypatch):
    assert {name for kind in openmp.DEFAULTS.values() for name in kind} <= set(openmp.VARIABLES)  # all recorded
    monkeypatch.setitem(openmp.DEFAULTS, "test", {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"})
    environ = {"OMP_NUM_THREADS": "4"}
    assert openmp.prepare("test", environ) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert environ == {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"}  # the user's thread count stays
    spin = {"GOMP_SPINCOUNT": "300000"}  # libgomp's own name for the wait: the user chose it
    assert openmp.prepare("test", spin) == {"OMP_NUM_THREADS": "1"} and "OMP_WAIT_POLICY" not in spin
    active = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert openmp.prepare("test", active) == {"OMP_NUM_THREADS": "1"} and active["OMP_WAIT_POLICY"] == "ACTIVE"
    with pytest.raises(ValueError, match="unknown kind of process 'tests'; valid: run, bench, test"):
        openmp.prepare("tests", {})


def test_bad_workloads_and_neighbours_are_refused_naming_the_valid_ones(capsys):
    from scripts import bench_threads as threads

    for argv, expected in ((["--workloads", "modle"], "--workloads modle: valid: model, tests"),
                           (["--neighbours", "noisy"], "--neighbours noisy: valid: none, busy, same"),
                           (["--tests", "tests/test_nothing.py::x"], "--tests tests/test_nothing.py::x: no such file")):
        with pytest.raises(SystemExit) as stop:
            threads.main(argv)
        assert stop.value.code == 2 and expected in capsys.readouterr().err
