"""The GPU self-check and the benchmarks, run tiny on CPU: a cluster user's first command must work.

Entry points are imported and their main() called in this process (no interpreter start-up per run);
only the self-check's own benchmark rows start subprocesses (`python -m`), as on a real machine.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from keydiff.bench import gpu_check

pytestmark = pytest.mark.integration

# One thread: tiny models gain nothing from more, and a busy machine then cannot stall them.
TINY = ["--model", "random-tiny", "--length", "64", "--budget", "16", "--block-size", "8", "--threads", "1"]


@pytest.fixture(autouse=True)
def restore_threads():
    """--threads sets torch's thread count for the whole process: put it back after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU table; on CUDA run make gpu-check")
def test_gpu_check_quick_on_cpu(tmp_path, capsys):
    code = gpu_check.main(["--quick", "--threads", "1", "--json", str(tmp_path / "check.json")])
    out, err = capsys.readouterr()
    # the policies' warnings (kvzip without a tokenizer, lagkv's small budgets) come once each, after the table
    assert "kvzip: no tokenizer" not in err and "kvzip: no tokenizer" not in out.split("warnings while checking")[0]
    assert out.count("kvzip: no tokenizer") == 1
    written = json.loads((tmp_path / "check.json").read_text())
    rows = written["rows"]
    assert code == 0, out
    assert [r for r in rows if r["result"] == "FAIL"] == []
    passed = {r["check"] for r in rows if r["result"] == "PASS"}
    assert {"full = forward", "N+B bound", "N >= L = full", "fast ~ materialized", "fixed = ordinary",
            "keydiff.bench.prefill", "keydiff.bench.decode"} <= passed
    skipped = [r for r in rows if r["result"] == "SKIP"]
    cuda_only = {r["check"] for r in skipped if "CUDA" in r["detail"]}
    assert {"flash_attention_2", "FA2 vs SDPA logits", "engine checks", "keydiff.bench.prefill",
            "keydiff.bench.decode"} <= cuda_only
    # The rows a GPU runs with CUDA graphs or at a real model's shape run here too: graphs stood in for, tiny sizes.
    graphs = [r for r in rows if r["check"] == "one graph per run"]
    assert len(graphs) == 4 and all(r["result"] == "PASS" and "stood in for" in r["detail"] for r in graphs)
    assert [r["result"] for r in rows if r["check"] == "batch 16 = alone"] == ["PASS"] * 3
    needle, = [r for r in rows if r["check"] == "needle alone = in a batch"]
    control, = [r for r in rows if r["check"] == "needle control (mode off)"]
    assert needle["result"] == "PASS" and control["result"] == "INFO" and "proves nothing" in control["detail"]
    for row in (needle, control):
        assert {k: row["record"][k] for k in ("gpu", "driver", "cuda", "triton")} == dict.fromkeys(
            ("gpu", "driver", "cuda", "triton"))
        assert row["record"]["torch"] == torch.__version__ and row["record"]["seed"] == gpu_check.NEEDLE_SEED
        assert f"at position {row['record']['position']} of 16" in row["detail"]
    # The other skips allowed: two GPUs (none here), and the plain-loop check while keydiff_attention takes no cache.
    assert [r["detail"] for r in skipped if r["check"] == "two GPUs"] == ["needs 2+ GPUs: 0 visible"]
    assert all("cache argument" in r["detail"] for r in skipped if "CUDA" not in r["detail"] and r["check"] != "two GPUs")
    assert "check" in out and "PASS" in out and "SKIP" in out
    assert "  PASS  full = forward  [tiny sdpa fp32]" in out.split("\ncheck ")[0]  # each row printed as it is done
    assert "stacked = per layer" in passed
    assert written["command"].startswith("python -m keydiff.bench.gpu_check --quick") and "commit" in written["code"]


@pytest.mark.extended
@pytest.mark.parametrize("module, extra, columns", [
    ("keydiff.bench.prefill", ["--reference"],
     ["TTFT s (median)", "x full", "x ref", "stats % (prof.)", "evict % (prof.)"]),
    ("keydiff.bench.decode", ["--new-tokens", "4", "--profile-tokens", "3"],
     ["ms/token (median)", "x full@N", "per round", "evict ms (prof.)", "stats ms (prof.)", "TTFT s", "alloc MiB/token",
      "x KV"]),
    ("keydiff.bench.decode", ["--new-tokens", "4", "--profile-tokens", "3", "--end-to-end", "--policies",
                              "full,keydiff"],
     ["TTFT s", "ms/token", "total s", "x full total"]),
])
def test_benchmark_help_and_tiny_run(tmp_path, capsys, module, extra, columns):
    entry = importlib.import_module(module)
    with pytest.raises(SystemExit) as exit_info:
        entry.main(["--help"])
    assert exit_info.value.code == 0 and "--threads" in capsys.readouterr().out
    entry.main(TINY + ["--repeats", "1"] + extra + ["--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("device=") and "threads=" in first and "dtype=" in first
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    assert all(column in header for column in columns), header
    written = json.loads((tmp_path / "out.json").read_text())
    results = written["results"]
    # What produced the numbers: the command line and the code's commit (None outside a git checkout).
    assert written["command"].startswith(f"python -m {module} --model random-tiny") and "--json" in written["command"]
    assert set(written["code"]) == {"commit", "dirty"} and written["started"] <= written["time"]
    assert written["packages"]["torch"] == torch.__version__ and len(written["data"]["sha256"]) == 64
    policies = [r["policy"] for r in results]
    assert "full" in policies and "keydiff" in policies
    assert all(f"\n{p} " in out for p in policies)


@pytest.mark.extended
def test_the_decode_benchmark_times_the_steady_state(tmp_path):
    """gpu-check's ms/token (keydiff.bench.decode) runs each policy through one Decoder across its warm-up and
    rounds: with CUDA graphs stood in for on the CPU, KeyDiff's block step and decode step are captured once, in
    the untimed warm-up, not in each of the 3 timed rounds (10 captures then), plus once each by the untimed
    allocation pass; `full` captures nothing."""
    from keydiff.batching.static import stand_in_graphs
    from keydiff.bench import decode

    with stand_in_graphs() as cuda:
        decode.main(TINY + ["--repeats", "3", "--new-tokens", "4", "--profile-tokens", "3", "--policies",
                            "full,keydiff", "--json", str(tmp_path / "decode.json")])
    assert len(cuda.captures) == 4 and not [c for c in cuda.captures if c.get("error")]


@pytest.mark.extended
def test_the_prefill_benchmark_times_the_steady_state(tmp_path):
    """gpu-check's TTFT (keydiff.bench.prefill): one Decoder per policy across warm-up and rounds, so with CUDA
    graphs stood in for, KeyDiff's block step is captured once, in the warm-up (4 captures over 3 rounds before)."""
    from keydiff.batching.static import stand_in_graphs
    from keydiff.bench import prefill as prefill_bench

    with stand_in_graphs() as cuda:
        prefill_bench.main(TINY + ["--repeats", "3", "--policies", "keydiff", "--json", str(tmp_path / "p.json")])
    assert len(cuda.captures) == 1 and not cuda.captures[0].get("error")


def test_two_gpu_check_runs_split_over_the_cpu():
    """The two-GPU row's code, with both halves of the model on the CPU (one placement: one stack)."""
    row = gpu_check.check_two_gpus(gpu_check.QUICK_SIZES["random-tiny"], ("cpu", "cpu"), "random-tiny", torch.float32)
    assert row.result == "PASS", row.detail
    assert "stacks [('cpu', 3)]" in row.detail


@pytest.mark.unit
def test_rows_are_written_as_they_finish_and_a_crash_is_a_row(tmp_path, monkeypatch):
    """A check that crashes outside every guard (as a kill would, anywhere) keeps the rows finished before it."""
    def checks(quick):
        yield gpu_check.Row("first", "tiny", "PASS", "done before the crash")
        raise MemoryError("the machine ran out\nsecond line")

    monkeypatch.setattr(gpu_check, "checks", checks)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--quick", "--json", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [(r["check"], r["result"], r["detail"]) for r in rows] == [
        ("first", "PASS", "done before the crash"), ("gpu_check", "FAIL", "MemoryError: the machine ran out")]


def test_the_deadline_stops_the_checks_with_a_row(tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--quick", "--threads", "1", "--deadline", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["check"] for r in rows] == ["full = forward", "deadline"]
    assert rows[1]["result"] == "SKIP" and "after 'full = forward' [tiny sdpa fp32]: the later checks" in rows[1]["detail"]


@pytest.mark.parametrize("differ_on, differ_off, result, control", [
    (False, False, "PASS", "proves nothing"),
    (False, True, "PASS", "can fail and means something"),
    (True, True, "FAIL", "can fail and means something"),
])
def test_the_needle_rows_say_what_they_prove(monkeypatch, differ_on, differ_off, result, control):
    """The needle row fails when the needle's tokens in the batch differ from alone; the control says whether
    the mode off changes them (if not, the check proves nothing on that machine)."""
    def outputs(model, needle, others, position, sizes, batch_invariant):
        differ = differ_on if batch_invariant else differ_off
        return [[[1, 2]], [[3, 4]]], [[[1, 2]], [[3, 5] if differ else [3, 4]]]

    monkeypatch.setattr(gpu_check, "needle_outputs", outputs)
    needle, off = gpu_check.check_needle(gpu_check.QUICK_NEEDLE, "cpu", seed=7)
    assert needle.result == result and off.result == "INFO" and control in off.detail
    assert needle.record["identical"] == [True, not differ_on] and off.record["proves_nothing"] == (not differ_off)
    assert needle.record["position"] == off.record["position"] == __import__("random").Random(7).randrange(16)


@pytest.mark.extended
def test_the_batch_invariance_row_runs_on_a_tiny_model():
    """The 3B row's code on the tiny model (CPU, fp32: every sequence identical, so PASS; bf16 would be INFO)."""
    torch.set_num_threads(1)
    row = gpu_check.check_batch_invariance("random-tiny", torch.float32, "cpu", 4, 5, (96, 160), 48)
    assert row.result == "PASS" and "keydiff 4/4 identical, full 4/4 identical" in row.detail, row
