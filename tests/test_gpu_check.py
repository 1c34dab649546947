"""The GPU self-check and the benchmarks, run tiny on CPU: a cluster user's first command must work.

Scripts are imported and their main() called in this process (no interpreter start-up per run); only
the self-check's own benchmark rows start subprocesses, as on a real machine.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
# One thread: tiny models gain nothing from more, and a busy machine then cannot stall them.
TINY = ["--model", "random-tiny", "--length", "64", "--budget", "16", "--block-size", "8", "--repeats", "1",
        "--threads", "1"]


@pytest.fixture
def load_script(monkeypatch):
    """Import scripts/<name>.py as a module; sys.path (which the scripts extend), sys.modules and torch's
    thread count (--threads) are restored afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    threads = torch.get_num_threads()

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module

    yield load
    torch.set_num_threads(threads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU table; on CUDA run make gpu-check")
def test_gpu_check_quick_on_cpu(load_script, tmp_path, capsys):
    code = load_script("gpu_check").main(["--quick", "--threads", "1", "--json", str(tmp_path / "check.json")])
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert code == 0, out
    assert [r for r in rows if r["result"] == "FAIL"] == []
    passed = {r["check"] for r in rows if r["result"] == "PASS"}
    assert {"full = forward", "N+B bound", "N >= L = full", "fast ~ materialized",
            "bench_prefill.py", "bench_decode.py"} <= passed
    skipped = [r for r in rows if r["result"] == "SKIP"]
    cuda_only = {r["check"] for r in skipped if "CUDA" in r["detail"]}
    assert {"flash_attention_2", "FA2 vs SDPA logits", "engine checks", "bench_prefill.py", "bench_decode.py"} <= cuda_only
    # The one other skip allowed: the plain-loop check while keydiff_attention takes no cache argument.
    assert all("cache argument" in r["detail"] for r in skipped if "CUDA" not in r["detail"])
    assert "check" in out and "PASS" in out and "SKIP" in out
    assert "stacked = per layer" in passed


@pytest.mark.parametrize("script, extra, columns", [
    ("bench_prefill", ["--reference"], ["TTFT s (median)", "x full", "x ref", "stats % (prof.)", "evict % (prof.)"]),
    ("bench_decode", ["--new-tokens", "4", "--profile-tokens", "3"],
     ["ms/token (median)", "x full@N", "per round", "evict ms (prof.)", "stats ms (prof.)", "TTFT s", "alloc MiB/token",
      "x KV"]),
    ("bench_decode", ["--new-tokens", "4", "--profile-tokens", "3", "--end-to-end", "--policies", "full,keydiff"],
     ["TTFT s", "ms/token", "total s", "x full total"]),
])
def test_benchmark_help_and_tiny_run(load_script, tmp_path, capsys, script, extra, columns):
    module = load_script(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0 and "--threads" in capsys.readouterr().out
    module.main(TINY + extra + ["--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("device=") and "threads=" in first and "dtype=" in first
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    assert all(column in header for column in columns), header
    written = json.loads((tmp_path / "out.json").read_text())
    results = written["results"]
    # What produced the numbers: the command line and the code's commit (None outside a git checkout).
    assert written["command"].startswith(f"{script}.py") and "--json" in written["command"]
    assert set(written["code"]) == {"commit", "dirty"} and written["started"] <= written["time"]
    assert written["packages"]["torch"] == torch.__version__ and len(written["data"]["sha256"]) == 64
    policies = [r["policy"] for r in results]
    assert "full" in policies and "keydiff" in policies
    assert all(f"\n{p} " in out for p in policies)
