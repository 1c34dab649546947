"""keydiff.bench.long_prefill: its checks before anything runs, the per-L comparison and the targets' verdicts
(the measurement itself is for a quiet machine: `make bench-long`)."""

from __future__ import annotations

import pytest

from keydiff.bench import common, long_prefill


pytestmark = pytest.mark.unit


def row(policy, length, peak, seconds):
    return {"policy": policy, "length": length, "peak_memory_bytes": peak, "seconds_per_token": seconds,
            "max_cache_entries": 1152, "kv_cache_bytes": 1 << 20}


def test_compare_gives_ratios_to_the_first_length_and_the_verdicts(capsys):
    rows = [row("keydiff", 4096, 1000, 1.0), row("keydiff", 131072, 1050, 1.3),
            row("full", 4096, 1000, 1.0), {"policy": "full", "length": 131072, "skipped": "L > --full-max-length"}]
    verdicts = long_prefill.compare(rows, 1024, 128)
    assert rows[1]["memory_ratio"] == pytest.approx(1.05) and rows[1]["time_ratio"] == pytest.approx(1.3)
    assert verdicts == [{"policy": "keydiff", "from": 4096, "to": 131072, "memory_ratio": pytest.approx(1.05),
                         "time_ratio": pytest.approx(1.3), "memory_ok": True, "time_ok": False}]
    out = capsys.readouterr().out
    assert "time per token 1.300 x (target <= 1.25: NOT met)" in out and "L > --full-max-length" in out


@pytest.mark.parametrize("arguments, message", [
    (["--policies", "nope"], "unknown policies"),
    (["--lengths", "4k"], "comma list of integers"),
    (["--lengths", "100", "--block-size", "128"], "at least two blocks"),
])
def test_bad_arguments_fail_before_any_model_is_built(arguments, message, capsys):
    with pytest.raises(SystemExit):
        long_prefill.main(arguments)
    assert message in capsys.readouterr().err


def test_peak_memory_reads_vmhwm_on_cpu():
    assert common.peak_memory("cpu")[0] > 10 * 2**20
