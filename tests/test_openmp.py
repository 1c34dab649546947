"""CPU threading: keydiff.openmp's defaults reach the OpenMP runtime only when set before torch loads it and never
override the user's; results record what was in effect; the threading benchmark's pieces; no timings asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from keydiff import openmp

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


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


def test_an_unknown_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown kind of process 'tests'; valid: run, bench, test"):
        openmp.prepare("tests", {})


def test_nothing_is_set_once_torch_is_loaded(monkeypatch):
    """After `import torch` the runtime has read its settings: a variable set then would be recorded, not used."""
    import torch  # noqa: F401

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert openmp.prepare("run") == {} and "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.slow
def test_prepare_before_torch_reaches_libgomp():
    """What libgomp read (OMP_DISPLAY_ENV) in a fresh interpreter: PASSIVE is spin count 0; the user's is kept."""
    script = ("from keydiff import openmp; openmp.DEFAULTS['run'] = {'OMP_WAIT_POLICY': 'PASSIVE'}; "
              "openmp.prepare('run'); import torch; torch.ones(1)")

    def spin_count(**variables) -> str:
        env = {k: v for k, v in os.environ.items() if k not in openmp.VARIABLES}
        result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env={**env, "PYTHONPATH": str(ROOT), "OMP_DISPLAY_ENV": "verbose", **variables})
        assert result.returncode == 0, result.stderr[-2000:]
        found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", result.stderr)
        if found is None:
            pytest.skip("this torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in OMP_DISPLAY_ENV)")
        return found.group(1)

    assert spin_count() == "0"
    assert spin_count(GOMP_SPINCOUNT="300000") == "300000"


def test_provenance_records_the_runtime_and_its_variables(monkeypatch):
    import torch  # noqa: F401  (environment() records threads only where torch is loaded)

    from keydiff.run.provenance import environment

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    recorded = environment(["x"])["openmp"]
    assert recorded["variables"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert set(recorded["variables"]) <= set(openmp.VARIABLES) and isinstance(recorded["set_by_keydiff"], list)
    if sys.platform == "linux":
        assert recorded["library"] and "omp" in recorded["library"]  # libgomp.so.1 with torch's pip wheels
    assert "OMP_WAIT_POLICY=PASSIVE" in openmp.describe()


@pytest.mark.integration
def test_the_model_workload_times_a_prefill_and_a_batched_decode():
    from scripts import bench_threads as threads

    args = types.SimpleNamespace(model="random-tiny", length=96, budget=32, block_size=16, batch=2, new_tokens=3,
                                 loop=False)
    result = threads.model_workload(args)
    assert result["ttft_s"] > 0 and result["decode_s"] > 0
    assert result["decode_tokens_per_s"] == pytest.approx(2 * 2 / result["decode_s"])
    assert result["threads"] >= 1 and "variables" in result["openmp"]


def test_bad_workloads_and_neighbours_are_refused_naming_the_valid_ones(capsys):
    from scripts import bench_threads as threads

    for argv, expected in ((["--workloads", "modle"], "--workloads modle: valid: model, tests"),
                           (["--neighbours", "noisy"], "--neighbours noisy: valid: none, busy, same"),
                           (["--tests", "tests/test_nothing.py::x"], "--tests tests/test_nothing.py::x: no such file")):
        with pytest.raises(SystemExit) as stop:
            threads.main(argv)
        assert stop.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.extended
def test_rounds_announce_every_run_with_the_time_left(capsys):
    from keydiff.bench import common

    calls = []
    results = common.interleaved_rounds({"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2},
                                        2, "cpu")
    assert results == {"a": [1, 1], "b": [2, 2]} and calls == ["a", "b"] * 3  # a warm-up, then 2 rounds
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("  2 case(s): one untimed warm-up run of each, then 2 timed round(s)")
    assert [line.split(" ...")[0].strip() for line in lines[1:]] == [
        "warm-up: a", "warm-up: b", "round 1/2: a", "round 1/2: b", "round 2/2: a", "round 2/2: b"]
    assert "left" not in lines[1] and re.search(r"\(about \d+ s left; 1 of 2 timed\)", lines[2])
    assert lines[-1].endswith("; 2 of 2 timed)")


def test_time_left_counts_each_pending_run_at_its_own_last_time():
    from keydiff.bench import common

    progress = common.Progress("plan", 2)
    progress.took = {"slow": 10.0, "fast": 1.0}
    assert progress.left(["slow", "fast", "slow"]) == 21.0
    assert progress.left(["new"]) == 5.5  # not run yet: the mean of those timed
    assert common.minutes(40) == "40 s" and common.minutes(252) == "4.2 min"
