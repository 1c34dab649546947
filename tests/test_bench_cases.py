"""Every benchmark case of `python -m keydiff.bench CASE` runs at tiny sizes on the tiny random model (runs and
counts, never timings), through the one runner: its JSON carries the results and the command that produced them.
A case added to keydiff.bench.runner.CASES without a tiny run here fails `test_every_case_has_a_tiny_run`."""

from __future__ import annotations

import json

import pytest
import torch

from keydiff.bench import runner

pytestmark = [pytest.mark.integration, pytest.mark.extended]

TINY = ["--model", "random-tiny", "--threads", "1", "--repeats", "1"]
SMALL = ["--length", "64", "--budget", "24", "--block-size", "16", "--new-tokens", "3"]


def prefill(record):
    assert [r["policy"] for r in record["results"]] == ["reference", "full", "keydiff"]
    assert len(record["data"]["sha256"]) == 64  # the prompt the numbers were measured on
    assert all(r["ttft_median_s"] > 0 for r in record["results"])


def policies_and_batches(record, policies, batches):
    assert {(r["policy"], r["batch"]) for r in record["results"]} == {(p, b) for p in policies for b in batches}


def decode_rows(record):
    assert [r["policy"] for r in record["results"]] == ["full", "keydiff"] and len(record["data"]["sha256"]) == 64
    assert all(r["decode_ms_per_token"] > 0 and r["alloc_bytes_per_token"] > 0 for r in record["results"])


def memory_scaling(record):
    rows = record["results"]
    assert [(r["policy"], r["length"]) for r in rows] == [("keydiff", 64), ("keydiff", 96)]
    assert all(r["peak_rss_bytes"] >= r["rss_after_load_bytes"] > 0 for r in rows)


def batch_steps(record):
    assert {(r["batch"], r["group_rows"]) for r in record["results"]} == {(1, True), (1, False), (2, True), (2, False)}
    assert all(r["step_s"] > 0 for r in record["results"])


def fixed_step(record):
    assert {(r["width"], r["form"]) for r in record["results"]} == {
        (w, form) for w in (1, 3) for form in ("ordinary", "fixed", "model")}
    ours = [r for r in record["results"] if r["form"] != "model"]
    assert all(r["same_tokens"] and r["ms_per_step"] > 0 for r in ours)
    assert all(r["same_tokens"] is None and r["ms_per_step"] > 0 for r in record["results"] if r["form"] == "model")
    assert all(r["floor_ms"] == max(r["bandwidth_floor_ms"], r["compute_floor_ms"]) > 0
               and r["x_floor"] == pytest.approx(r["ms_per_step"] / r["floor_ms"]) for r in record["results"])
    assert record["device_rates"]["bandwidth_source"].startswith("measured")


def adaptive(record):
    uniform, adakv = record["results"]
    assert (uniform["form"], adakv["form"]) == ("uniform", "adakv") and record["summary"]["bytes_ratio"] > 0
    assert all(r["peak_rss_bytes"] > 0 and r["peak_is_run_only"] is not None for r in record["results"])


def long_prefill(record):
    rows = record["results"]
    assert [(r["policy"], r["length"], "skipped" in r) for r in rows] == [
        ("keydiff", 64, False), ("keydiff", 128, False), ("full", 64, False), ("full", 128, True)]
    assert record["verdicts"][0]["policy"] == "keydiff" and rows[1]["memory_ratio"] > 0


def scoring(record):
    assert {r["policy"] for r in record["results"]} == {"keydiff", "tova"} and len(record["results"]) == 4
    assert all(r["median_s"] > 0 and r["peak_bytes"] > 0 for r in record["results"])


def peers(record):
    """Our side alone: no kvpress environment needed."""
    assert set(record["perf"]["samples"]["64"]) == {"keydiff_blockwise", "keydiff_one_block"}
    assert record["kvpress_env"].startswith("not used")


def gpu_bench(record):
    assert [r["case"] for r in record["rows"]] == ["batch 4 = alone, keydiff", "batch 4 = alone, full"]


# (case, arguments, JSON file name, what the JSON must hold); slow: the case starts processes of its own.
RUNS = [
    ("prefill", TINY + ["--length", "128", "--budget", "40", "--block-size", "16", "--policies", "full,keydiff",
                        "--reference"], "out.json", prefill),
    ("decode", TINY + SMALL + ["--profile-tokens", "3", "--policies", "full,keydiff"], "out.json", decode_rows),
    ("decode", TINY + SMALL + ["--end-to-end", "--profile-tokens", "3", "--policies", "full,keydiff"], "out.json",
     decode_rows),
    pytest.param("decode", TINY + SMALL + ["--memory-scaling", "--scaling-lengths", "64,96"], "out.json",
                 memory_scaling, marks=pytest.mark.slow, id="decode-memory-scaling"),
    ("throughput", TINY + SMALL + ["--batches", "1,2", "--per-row", "--pooled"], "out.json",
     lambda r: policies_and_batches(r, ("full", "keydiff", "keydiff per-row", "keydiff pooled", "transformers"), (1, 2))),
    ("batch_steps", TINY + SMALL + ["--batches", "1,2"], "out.json", batch_steps),
    ("fixed_step", TINY + ["--length", "128", "--budget", "32", "--block-size", "16", "--widths", "1,3", "--steps", "3",
                           "--warm-up", "1", "--forms", "ordinary,fixed,model"], "out.json", fixed_step),
    pytest.param("adaptive", TINY + ["--length", "96", "--budget", "16", "--block-size", "16", "--new-tokens", "3"],
                 "out.json", adaptive, marks=pytest.mark.slow, id="adaptive"),
    pytest.param("long_prefill", ["--threads", "1", "--lengths", "64,128", "--budget", "16", "--block-size", "32",
                                  "--full-max-length", "64"], "out.json", long_prefill, marks=pytest.mark.slow,
                 id="long_prefill"),
    ("scoring", ["table19", "--shape", "tiny", "--sizes", "48,96", "--policies", "keydiff,tova", "--repeats", "2",
                 "--warmup", "1", "--block-size", "8", "--threads", "1", "--out", "{tmp}", "--figures", "{tmp}"],
     "table19_scoring_latency_cpu.json", scoring),
    pytest.param("peers", ["perf", "--shape", "tiny", "--lengths", "64", "--budget", "8", "--block-size", "16",
                           "--new-tokens", "3", "--rounds", "1", "--threads", "1", "--cases",
                           "keydiff_blockwise,keydiff_one_block", "--cache-dir", "{tmp}"], "out.json", peers,
                 marks=pytest.mark.slow, id="peers"),
    ("gpu_bench", ["--quick", "--rows", "exact"], "out.json", gpu_bench),
]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case, arguments, written, holds", RUNS)
def test_each_case_runs_at_tiny_sizes(case, arguments, written, holds, tmp_path, capsys, one_thread):
    arguments = [a.replace("{tmp}", str(tmp_path)) for a in arguments]
    if written == "out.json":
        arguments += ["--json", str(tmp_path / written)]
    status = runner.main([case, *arguments])
    assert status in (None, 0) or isinstance(status, list), status  # scoring returns the paths it wrote
    record = json.loads((tmp_path / written).read_text())
    holds(record)
    assert record["command"].startswith(f"python -m keydiff.bench {case} ")
    assert set(record["code"]) == {"commit", "dirty"} and record["started"] <= record["time"]
    assert record["packages"]["torch"] == torch.__version__
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.unit
def test_every_case_has_a_tiny_run():
    ran = {run.values[0] if hasattr(run, "values") else run[0] for run in RUNS}
    assert ran == set(runner.CASES)


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    (["decod"], "unknown case 'decod'; valid: prefill, decode,"),
    (["decode", "--end-to-end", "--memory-scaling"], "--end-to-end and --memory-scaling"),
    (["prefill", "--policies", "keydif"], "unknown policies ['keydif']; valid:"),
    (["throughput", "--device", "tpu"], "--device 'tpu' is not valid; valid: cpu, cuda"),
    (["batch_steps", "--new-tokens", "1"], "--repeats must be >= 1 and --new-tokens >= 2"),
    (["fixed_step", "--forms", "fixed,graph"], "--forms 'fixed,graph': valid forms"),
    (["long_prefill", "--lengths", "4k"], "--lengths must be a comma list of integers"),
    (["long_prefill", "--lengths", "100", "--block-size", "128"], "every length must be at least two blocks"),
    (["peers", "parity", "--pairs", "nope"], "unknown pairs ['nope']; valid:"),
    (["peers", "perf", "--lengths", "512,4096"], "every --lengths value must exceed the budget"),
    (["peers", "perf", "--lengths", "4k"], "--lengths must be a comma list of integers"),
    (["peers", "parity", "--ratio", "1.5"], "--ratio must be in (0, 1]"),
    (["peers", "--shape", "gpt2"], "argument --shape: invalid choice: 'gpt2' (choose from"),
    (["peers", "perf", "--cases", "kvpress"], "unknown cases ['kvpress']; valid: kvpress_keydiff,"),
    (["peers", "perf", "--cases", " , "], "--cases names no case; valid: kvpress_keydiff,"),
    (["peers", "tables", "missing.json"], "tables: name perf JSON files; no such file: missing.json"),
])
def test_a_wrong_case_or_value_is_one_line_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        runner.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.unit
def test_default_policies_that_cannot_run_at_the_budget_are_dropped_with_a_note(capsys):
    from keydiff.bench import common

    assert common.parse_policies(None, 16) == ["full", "keydiff", "sink", "knorm", "tova", "h2o"]  # no snapkv
    assert "note: snapkv skipped: snapkv window (32)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^snapkv: snapkv window \(32\)"):  # asked for by name: an error
        common.parse_policies("snapkv", 16)
