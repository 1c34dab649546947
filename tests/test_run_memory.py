"""keydiff.run.memory: the one CPU peak reading (VmHWM) of the runner and the benchmarks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keydiff.bench import common
from keydiff.run import memory

pytestmark = [pytest.mark.slow, pytest.mark.extended,
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM needs Linux /proc")]

CHECKOUT = Path(__file__).resolve().parents[1]
RUNNER_CHILD = ("import json, resource, torch; from keydiff.run import memory; "
                "peak = memory.peak_memory(torch.device('cpu'))[0]; "
                "print(json.dumps({'runner_peak': peak, 'vmhwm': memory.peak_rss(), "
                "'ru_maxrss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")


def test_a_run_started_by_a_parent_holding_memory_reports_its_own_cpu_peak():
    """ru_maxrss survives execve (it would be the parent's peak); VmHWM, which the runner reads, is the child's own."""
    held = torch.ones(2 ** 28)  # 1 GiB, every page touched
    child = json.loads(subprocess.run([sys.executable, "-c", RUNNER_CHILD], capture_output=True, text=True,
                                      check=True, cwd=CHECKOUT).stdout)
    assert float(held[-1]) == 1.0
    assert child["ru_maxrss"] >= 2 ** 30  # the premise: ru_maxrss holds the parent's peak
    assert child["vmhwm"][1] == memory.VMHWM
    assert child["runner_peak"] <= child["vmhwm"][0]  # read first, and the same reading
    assert child["runner_peak"] < child["ru_maxrss"] - 2 ** 29  # not the parent's 1 GiB


@pytest.mark.unit
def test_reset_restarts_the_peak_from_the_current_size_and_the_benchmarks_read_the_same():
    block = torch.ones(2 ** 26)  # 256 MiB, every page touched
    with_block = memory.peak_rss_bytes()
    assert with_block >= memory.current_rss_bytes() - 2 ** 20 and with_block >= 2 ** 28
    del block
    assert memory.reset_peak_rss()
    assert memory.peak_rss_bytes() < with_block - 2 ** 27  # the freed 256 MiB no longer counts
    assert common.peak_rss_bytes is memory.peak_rss_bytes and common.peak_memory is memory.peak_memory  # one reader
