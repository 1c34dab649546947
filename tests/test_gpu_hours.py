"""keydiff/report/gpu_hours.py (`make gpu-hours`): the arithmetic on hand-made rates against a hand computation, a
`make gpu-bench` JSON read, the stored H200 rates against their measurements, each grid point's workload against
its task and the paper, and bad input as one `error:` line naming what is missing."""

from __future__ import annotations

import copy
import csv
import json
import re
from pathlib import Path

import pytest

from keydiff import grids
from keydiff.report import gpu_hours as gh

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "results" / "bench"

HAND = {
    "device": "test GPU", "model": gh.MEASURED, "setting": "hand-made", "code": "abc1234", "date": "2026-01-01",
    "prefill_tokens_per_s": {"ordinary": {"value": 1000, "source": "hand"}},
    "decode_ms_per_token": {"ordinary": {"value": 20, "source": "hand"}},
    "speedup": {"per row": {"source": "hand", "8": 4, "16": 5}, "full": {"source": "hand", "8": 2, "16": 4}},
    "policy_ratios": {"source": "hand", "prefill": {"keydiff": 1.0, "full": 1.0, "tova": 2.0},
                      "decode": {"keydiff": 2.0, "full": 1.0, "tova": 3.0}},
}
TASK = gh.Task("longbench", "hand", samples=10, prompt=2000, generated=100, source="hand")
SMALL = "llama-3.2-3b-instruct"  # the measured shape: scale 1
LARGE = "llama-3.1-8b-instruct"  # 16.1 GB over 6.4 GB


def write(path: Path, record: dict) -> Path:
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


@pytest.mark.extended  # seconds: composes every preset / runs a whole benchmark; make test runs it
def test_hours_are_samples_times_prefill_plus_decode_over_the_speedup(tmp_path):
    rates = gh.load_rates(write(tmp_path / "rates.json", HAND))
    seconds = lambda model, policy, batch: gh.point_seconds(TASK, model, policy, rates, batch)  # noqa: E731
    # keydiff: 10 x (2000 / 1000 + 100 x 20 ms) = 10 x (2 + 2)
    assert seconds(SMALL, "keydiff", 1) == pytest.approx(40.0)
    assert seconds(SMALL, "keydiff_window20", 1) == pytest.approx(40.0)  # a variant is timed as KeyDiff
    assert seconds(SMALL, "keydiff", 8) == pytest.approx(10 * (2 + 2 / 4))  # per row at batch 8: x4
    # tova: prefill x 2.0 / 1.0, decode x 3.0 / 2.0, per row at batch 16: x5
    assert seconds(SMALL, "tova", 16) == pytest.approx(10 * (2 * 2.0 + 2 * 1.5 / 5))
    # full: decode x 1.0 / 2.0 and its own speed-up (x2 at batch 8)
    assert seconds(SMALL, "full", 8) == pytest.approx(10 * (2 * 1.0 + 2 * 0.5 / 2))
    assert seconds(LARGE, "keydiff", 1) == pytest.approx(40.0 * 16.1 / 6.4)  # scaled by weight bytes
    with pytest.raises(gh.RatesError, match=r"no prefill ratio for policy 'snapkv'.*has: full, keydiff, tova"):
        seconds(SMALL, "snapkv", 1)

    points = tuple((TASK, m, p) for m in (SMALL, LARGE) for p in ("keydiff", "tova") for _budget in ("2k", "4k"))
    grid = gh.Experiment("hand", points)
    by_hand = 2 * sum(seconds(m, p, 16) for m in (SMALL, LARGE) for p in ("keydiff", "tova")) / 3600
    assert len(grid.points) == 8 and gh.experiment_hours(grid, rates, 16) == pytest.approx(by_hand)
    timing = gh.Experiment("ttft", ((TASK, SMALL, "keydiff"),), batch_1_only=True)
    assert gh.experiment_hours(timing, rates, 16) == gh.experiment_hours(timing, rates, 1) == pytest.approx(40 / 3600)
    assert gh.batches(rates) == [8, 16]


def test_a_fixed_step_applies_to_the_capturable_policies_and_grouped_rows_to_the_pooled_only(tmp_path):
    record = copy.deepcopy(HAND)
    record["prefill_tokens_per_s"]["fixed"] = {"value": 4000, "source": "hand"}
    record["decode_ms_per_token"]["fixed"] = {"value": 10, "source": "hand"}
    record["speedup"]["grouped"] = {"source": "hand", "16": 8}
    rates = gh.load_rates(write(tmp_path / "rates.json", record))
    # keydiff and sink: the fixed step, no ratio (measured on the ordinary step), grouped: 10 x (0.5 + 1 / 8)
    for policy in ("keydiff", "sink", "knorm"):
        assert gh.point_seconds(TASK, SMALL, policy, rates, 16) == pytest.approx(10 * (0.5 + 1.0 / 8))
    # tova: the fixed step where it runs alone (its prefill; its decoding at batch 1), with its ratios; batched, its
    # rows decode on the ordinary step, per row: 10 x (2000 / 4000 x 2.0 + 100 x 20 ms x 1.5 / 5)
    assert gh.point_seconds(TASK, SMALL, "tova", rates, 16) == pytest.approx(10 * (1.0 + 2 * 1.5 / 5))
    assert gh.point_seconds(TASK, SMALL, "tova", rates, 1) == pytest.approx(10 * (1.0 + 1.0 * 1.5))
    assert gh.batches(rates) == [16]  # 'grouped' was measured at 16 only


def gpu_bench_record() -> dict:
    """A `make gpu-bench` JSON as keydiff.bench.gpu_bench writes it (rows, sizes, provenance), numbers by hand."""
    def decode(case, batch, steady):
        return {"row": "decode", "case": case, "batch": batch, "ms_per_step": steady + 1, "ms_per_step_steady": steady,
                "floor_ms": 1.0}

    return {
        "device": "cuda",
        "sizes": {"model": gh.MEASURED, "length": 4096, "budget": 1024, "block": 128, "tokens": 32, "batch": 16,
                  "prefill_lengths": [32768, 131072], "prefill_budget": 2048, "prefill_blocks": [64, 128, 256, 1024]},
        "rows": [decode("keydiff fixed", 1, 5.0), decode("keydiff ordinary", 1, 25.0),
                 {"row": "exact", "case": "fixed step = ordinary step, keydiff", "batch": 1, "identical": 1, "of": 1},
                 decode("keydiff fixed, batch_invariant", 1, 6.0),
                 decode("keydiff fixed", 16, 10.0), decode("keydiff ordinary", 16, 30.0),
                 decode("full (ours)", 16, 40.0),
                 {"row": "decode", "case": "transformers eager DynamicCache", "batch": 1, "ms_per_step": 17.5},
                 {"row": "prefill", "case": "keydiff fixed", "L": 32768, "N": 2048, "B": 64, "seconds": 3.0},
                 {"row": "prefill", "case": "keydiff fixed", "L": 32768, "N": 2048, "B": 128, "seconds": 2.0},
                 {"row": "prefill", "case": "keydiff ordinary", "L": 32768, "N": 2048, "B": 128, "seconds": 8.192},
                 {"row": "prefill", "case": "one full forward", "L": 32768, "seconds": 0.5},
                 {"row": "serving", "case": "failed", "error": "RuntimeError: out of memory"}],
        "wall_s": 300.0, "code": {"commit": "0123456789abcdef", "dirty": False},
        "environment": {"cuda_device": "NVIDIA H100 80GB HBM3"},
        "command": "python -m keydiff.bench.gpu_bench --json results/bench/gpu_bench.json",
        "started": "2026-12-01T10:00:00+0000", "time": "2026-12-01T10:05:00+0000",
    }


def test_a_gpu_bench_result_gives_the_steps_it_measured_and_borrows_the_rest(tmp_path):
    base = write(tmp_path / "base.json", HAND)
    rates = gh.load_rates(write(tmp_path / "gpu_bench.json", gpu_bench_record()), base=base)
    assert (rates.device, rates.code, rates.date) == ("NVIDIA H100 80GB HBM3", "0123456", "2026-12-01")
    assert rates.prefill["fixed"].value == pytest.approx(32768 / 2.0)  # B = 128, not the B = 64 row
    assert rates.prefill["ordinary"].value == pytest.approx(4000.0)
    assert (rates.decode["fixed"].value, rates.decode["ordinary"].value) == (5.0, 25.0)  # the steady steps
    assert rates.speedup["grouped"][16].value == pytest.approx(16 * 5.0 / 10.0)
    # full's batch 1 is not a gpu_bench row: KeyDiff's ordinary batch 1 x the base's full / keydiff (1.0 / 2.0)
    assert rates.speedup["full"][16].value == pytest.approx(16 * 25.0 * 0.5 / 40.0)
    assert rates.speedup["per row"] == gh.load_rates(base).speedup["per row"]
    assert rates.ratios == {phase: HAND["policy_ratios"][phase] for phase in ("prefill", "decode")}
    assert gh.batches(rates) == [16] and "base.json" in rates.borrowed[0]
    # keydiff at batch 16: the fixed step, grouped; full: exactly its measured 40 ms per step of 16 tokens
    assert gh.point_seconds(TASK, SMALL, "keydiff", rates, 16) == pytest.approx(10 * (2000 / 16384 + 0.1 * 5.0 / 8))
    assert gh.point_seconds(TASK, SMALL, "full", rates, 16) == pytest.approx(10 * (0.5 + 100 * 40.0 / 16 / 1000))


def test_the_stored_rates_are_the_measurements_they_name():
    rates = gh.load_rates()
    assert rates.path == gh.DEFAULT_RATES and rates.device == "NVIDIA H200" and set(rates.decode) == {"ordinary"}
    throughput = json.loads((BENCH / "throughput_cuda.json").read_text())
    assert "H200" in throughput["setting"] and "model=random-llama-3.2-3b" in throughput["setting"]
    measured = {(r["policy"], r["batch"]): r for r in throughput["results"]}
    assert rates.decode["ordinary"].value == pytest.approx(1000 / measured["keydiff", 1]["tokens_per_s"])
    for kind, case in (("per row", "keydiff per-row"), ("full", "full")):
        assert {b: r.value for b, r in rates.speedup[kind].items()} == pytest.approx(
            {b: measured[case, b]["speedup_vs_batch_1"] for b in (8, 16)})
    assert rates.prefill["ordinary"].value == pytest.approx(32768 / 7.6)  # issue #30's 7.6 s (no JSON stored)
    check = json.loads((BENCH / "gpu_check_h200.json").read_text())
    for phase, row in (("prefill", "keydiff.bench.prefill"), ("decode", "keydiff.bench.decode")):
        detail = next(r["detail"] for r in check["rows"] if r["check"] == row)
        ratios = {p: float(v) for p, v in re.findall(r"(\w+) (\d+\.\d+)", detail.split(":", 1)[1]) if p != "reference"}
        assert rates.ratios[phase] == ratios
    assert "grouped" not in rates.speedup  # that code decoded a batch's rows each on its own


def test_the_docs_table_is_the_commands_output(capsys):
    assert gh.main([]) == 0
    printed = capsys.readouterr().out
    docs = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert table[0].endswith("| batch 1 | batch 8 | batch 16 |") and table[-1].startswith("| all | | 368 |")
    missing = [line for line in table if "  " + line not in docs]
    assert not missing, f"docs/gpu.md's GPU-hours table is not `make gpu-hours`'s output; regenerate it: {missing}"


@pytest.mark.parametrize("source, change, expected", [
    ("rates", lambda r: r["decode_ms_per_token"].pop("ordinary"),
     r"rates\.json: missing decode_ms_per_token\.ordinary$"),
    ("rates", lambda r: r["speedup"].pop("full"), r"missing speedup\.full$"),
    ("rates", lambda r: r["prefill_tokens_per_s"]["ordinary"].update(value=0),
     r"prefill_tokens_per_s\.ordinary\.value is 0, "),
    ("rates", lambda r: r["speedup"]["per row"].update({"eight": 4}),
     r"speedup\.per row needs batch sizes > 1 as keys"),
    ("rates", lambda r: r["policy_ratios"]["decode"].pop("keydiff"), r"missing policy_ratios\.decode\.keydiff$"),
    ("rates", lambda r: r.update(model="llama-3.1-8b-instruct"),
     r"rates of model 'llama-3.1-8b-instruct'; .* random-llama-3.2-3b"),
    ("bench", lambda r: r["rows"].pop(4),
     r"no gpu_bench row with row=decode, case=keydiff fixed, batch=16 \(failed or skipped"),
    ("bench", lambda r: r["rows"][10].update(error="OOM"),
     r"no gpu_bench row with row=prefill, case=keydiff ordinary, L=32768, B=128"),
    ("bench", lambda r: r["rows"][6].update(ms_per_step_steady=-0.1),
     r"decode row 'full \(ours\)' at batch 16: ms_per_step_steady is -0.1"),
    ("bench", lambda r: r.update(device="cpu"), r"a gpu_bench result on 'cpu' .* not --quick"),
    ("bench", lambda r: r["sizes"].update(model="random-tiny"), r"with model 'random-tiny'; .* not --quick"),
    ("nope", None, r"nope\.json: no such file \(a rates file such as results/bench/gpu_rates_h200\.json or a `make "
                   r"gpu-bench` result\)"),
    ("broken", None, r"broken\.json: not JSON \("),
])
def test_a_rates_file_without_a_rate_or_a_row_is_one_error_line_naming_it(source, change, expected, tmp_path, capsys):
    path = tmp_path / f"{source}.json"
    if source == "broken":
        path.write_text("{not json")
    elif change:
        record = copy.deepcopy(HAND) if source == "rates" else gpu_bench_record()
        change(record)
        write(path, record)
    with pytest.raises(SystemExit) as stop:
        gh.main(["--rates", str(path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(expected, err.strip()), err


# LongBench v1's test sets: 200 samples each but these (LONGBENCH_NOTE)
LONGBENCH_SIZES = {"multifieldqa_en": 150, "lcc": 500, "repobench-p": 500}


@pytest.mark.extended
@pytest.mark.parametrize("name", gh.PAPER_EXPERIMENTS)
def test_each_grid_point_is_its_conf_experiments_with_the_workload_of_the_task_it_composes(name):
    from hydra import compose, initialize_config_dir

    points = grids.experiment_grid(name)
    experiment = gh.experiment(name)
    assert len(experiment.points) == len(points) and experiment.name == name
    for point, (task, model, policy) in zip(points, experiment.points):
        axes = dict(o.split("=", 1) for o in point)
        assert (model, policy) == (axes["model"], axes["policy"]) and task.name == axes.get("task", task.name)
    for task in experiment.tasks:
        task_axis = [f"task={task.name}"] if "task" in grids.grid_axes(points) else []
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"experiment={name}", *task_axis]).task
        assert str(cfg.name) == task.name
        if task.name.startswith("longbench"):
            assert task.samples == sum(LONGBENCH_SIZES.get(d, 200) for d in cfg.datasets)
        if task.name.startswith("math500"):
            assert task.samples == 500 * cfg.num_samples
        if task.name == "niah":
            lengths, depths = list(cfg.context_lengths), list(cfg.depths)
            assert (task.samples, task.prompt) == (len(lengths) * len(depths), round(sum(lengths) / len(lengths)))
        if task.name == "phonebook":
            assert task.samples == len(cfg.sizes) * cfg.books_per_size * cfg.queries_per_book
    assert experiment.batch_1_only == name.startswith(("fig7", "fig17"))
    assert all(m in gh.WEIGHTS_GB for _, m, _ in experiment.points)


def test_a_task_without_a_workload_is_an_error_naming_the_workloads():
    from omegaconf import OmegaConf

    niah_8 = OmegaConf.create({"name": "niah", "context_lengths": [8192], "depths": [0, 50]})
    with pytest.raises(ValueError, match=r"no workload for task 'niah' as composed here; workloads: LongBench \(16\)"):
        gh.workload(niah_8)
    assert gh.workload(OmegaConf.create({"name": "niah", "context_lengths": [16384], "depths": [0, 1, 2, 3, 4]})) \
        == gh.NIAH_16K


def test_math500_lengths_are_the_papers_mean_generation_lengths():
    lengths: dict[str, list[float]] = {}
    for table in ("table4", "table6"):
        with open(ROOT / "results" / "paper" / f"{table}.csv", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                if row["metric"] == "avg_gen_length":
                    lengths.setdefault(row["column"], []).append(float(row["value"]))
    means = {limit: round(sum(v) / len(v)) for limit, v in lengths.items()}
    assert {"4K": gh.MATH_4K.generated, "8K": gh.MATH_8K.generated, "32K": gh.MATH_32K.generated} == means


def test_model_weights_are_the_docs_memory_table():
    docs = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    for model, gb in gh.WEIGHTS_GB.items():
        if model != gh.MEASURED:
            row = next(line for line in docs.splitlines() if line.startswith("  | ") and model in line)
            assert f"| {gb} GB |" in row, row


def test_the_capturable_set_is_the_policies_claim():
    from omegaconf import OmegaConf

    from keydiff import build_policy

    names = {p for e in gh.paper_experiments() for _, _, p in e.points}
    for name in sorted(names):
        spec = OmegaConf.load(ROOT / "conf" / "policy" / f"{name}.yaml")
        policy = build_policy(str(spec.name), **dict(spec.get("params") or {}))
        assert policy.needs.capturable == gh.capturable(name), name
