"""collect -> tables -> figures on a fake results tree (made-up numbers, one check each), and conf/experiment/*.yaml."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"

from keydiff.report import against_paper as paper_compare  # noqa: E402
from keydiff.paper import registry  # noqa: E402
from keydiff.report import collect as collect_results  # noqa: E402
from keydiff.report import figures as make_figures  # noqa: E402
from keydiff.report import tables as make_tables  # noqa: E402
from keydiff.report.render import interval, metric_range, standard_error  # noqa: E402

SUITE = registry.SUITE
LLAMA3B = "llama-3.2-3b-instruct"
R1 = "deepseek-r1-distill-llama-8b"


def write_run(runs, experiment, task, model, label, budget_label, block, metrics, rows=(), name=None,
              complete=True, limit=None, ttft=0.5, seed=0, extra=None):
    tokens = None if (name or label) == "full" else {"1k": 1024, "2k": 2048, "4k": 4096, "6k": 6144}[budget_label]
    suffix = f"-limit{limit}" if limit is not None else ""  # as run.py names a subset run's directory
    run_dir = runs / experiment / task / model / label / budget_label / f"bs{block}" / f"seed{seed}{suffix}"
    run_dir.mkdir(parents=True)
    with open(run_dir / "predictions.jsonl", "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    summary = {
        "complete": complete, "metrics": metrics, "budget": tokens, "limit": limit, "block_size": None if block == "inf" else block,
        "statistics": {"samples": max(len(rows), 1), "mean_compression_ratio": 0.5, "mean_ttft_s": ttft,
                       "mean_prompt_tokens": 1000.0, "cache_bound_held": True},
        "attention_statistics": "fast",
        "config": {"experiment_name": experiment, "seed": seed, "block_size": block,
                   "task": {"name": task, "limit": limit}, "model": {"name": model, "attn_implementation": "sdpa"},
                   "policy": {"name": name or label, "label": label}, "budget": {"tokens": tokens, "label": budget_label}},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary | (extra or {})))


def niah_rows(recalls):
    return [{"sample_id": f"niah/{i}", "scores": {"needle_recall": r}, "ttft_s": 0.5, "compression_ratio": 0.5}
            for i, r in enumerate(recalls)]


def longbench_scores(base, **changes):
    scores = {d: base + i for i, d in enumerate(SUITE)} | changes
    return {"datasets": scores, "average": sum(scores.values()) / len(scores), "num_samples": {d: 1 for d in SUITE}}


def math_rows(flex, new_tokens):
    ids = ["p1#0", "p1#1", "p2#0", "p2#1"]
    return [{"sample_id": i, "scores": {"flex": f, "exact": f}, "prompt_tokens": 100, "new_tokens": n,
             "finish_reason": "stop", "compression_ratio": 1.0} for i, f, n in zip(ids, flex, new_tokens)]


@pytest.fixture(scope="module")
def fake_runs(tmp_path_factory):
    runs = tmp_path_factory.mktemp("results") / "runs"
    lb_rows = [{"sample_id": f"{d}/{k}", "info": {"dataset": d}, "prompt_tokens": t, "compression_ratio": c,
                "scores": {"score": c}}
               for d, k, t, c in [("narrativeqa", 0, 9000, 0.1), ("narrativeqa", 1, 3000, 0.3), ("qasper", 0, 2500, 0.5)]]
    write_run(runs, "table11", "longbench_full", LLAMA3B, "keydiff", "2k", 128, longbench_scores(10.5), lb_rows)
    write_run(runs, "table11", "longbench_full", LLAMA3B, "tova", "2k", 128, longbench_scores(10.0, qasper=99.0), lb_rows)
    write_run(runs, "table11", "longbench_full", LLAMA3B, "keydiff", "4k", 128, longbench_scores(70.0), complete=False)
    bins = {"narrativeqa": {"<=2K": 0, "2K-4K": 1, "4K-6K": 0, "6K-8K": 0, ">8K": 1},
            "qasper": {"<=2K": 0, "2K-4K": 1, "4K-6K": 0, "6K-8K": 0, ">8K": 0}}
    write_run(runs, "table11_full", "longbench_full", LLAMA3B, "full", "unbounded", 128,
              {**longbench_scores(50.0), "prompt_length_bins": bins}, lb_rows)
    english = {d: 30.0 for d in ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
                                 "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum", "passage_count",
                                 "passage_retrieval_en", "lcc", "repobench-p"]}
    write_run(runs, "table1", "longbench", LLAMA3B, "sink", "2k", 128, {"datasets": english, "average": 30.0})
    write_run(runs, "table13", "longbench_full", LLAMA3B, "keydiff", "2k", 64, longbench_scores(5.0))
    write_run(runs, "table15", "longbench_full", LLAMA3B, "keydiff_pairwise", "2k", 128, longbench_scores(11.0),
              name="keydiff_pairwise")
    cells_full = {"1000": {"0": 1.0, "50": 0.8}, "2000": {"0": 0.6, "50": 0.4}}
    cells_kd = {"1000": {"0": 0.9, "50": 0.8}, "2000": {"0": 0.7, "50": 0.1}}
    for label, cells in [("full", cells_full), ("keydiff", cells_kd)]:
        write_run(runs, "fig6_niah", "niah", LLAMA3B, label, "6k", 128, {"needle_recall": 0.7, "needle_recall_by_cell": cells})
    full_rows = math_rows([1, 0, 1, 1], [500, 1500, 800, 2000])  # contexts 600, 1600, 900, 2100
    write_run(runs, "table4_full", "math500", R1, "full", "unbounded", 128,
              {"flex": 0.75, "exact": 0.5, "avg_new_tokens": 1200.0}, full_rows)
    write_run(runs, "table4_gen4k", "math500", R1, "keydiff_w20", "1k", 128,
              {"flex": 0.5, "exact": 0.25, "avg_new_tokens": 1000.0}, math_rows([1, 1, 0, 0], [400, 1400, 700, 1900]),
              name="keydiff")
    write_run(runs, "table4_gen4k", "math500", R1, "snapkv", "1k", 128,
              {"flex": 0.25, "exact": 0.25, "avg_new_tokens": 1100.0}, math_rows([0, 0, 0, 1], [400, 1400, 700, 1900]))
    for label, size_478 in [("full", 0.8), ("keydiff", 0.4), ("tova", 0.6)]:
        write_run(runs, "table17", "phonebook", LLAMA3B, label, "6k", 128,
                  {"exact": 0.7, "by_size": {"100": {"exact": 1.0}, "478": {"exact": size_478}}})
    for label in ["keydiff", "tova"]:
        for budget in ["2k", "4k"]:
            for block in [64, 128]:
                ttft = {"keydiff": 1.0, "tova": 2.0}[label] * (1 + int(budget[0]) / 10) * block / 64
                write_run(runs, "fig7_ttft", "niah", LLAMA3B, label, budget, block, {"needle_recall": 1.0}, ttft=ttft)
    write_run(runs, "smoke", "niah_small", "smollm2-135m", "keydiff", "1k", 128,
              {"needle_recall": 0.25, "needle_recall_by_cell": {"2000": {"0": 0.5, "100": 0.0}}}, limit=2)
    return runs


@pytest.fixture(scope="module")
def produced(fake_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    frame = collect_results.collect(fake_runs, out / "summary.csv")
    written = make_tables.main(out / "summary.csv", out / "tables")
    return out, frame, written


def md_rows(path, table=0):
    """The table-th Markdown table of a file -> list of cell lists (header first)."""
    blocks = [b for b in path.read_text().split("\n\n") if b.startswith("|")]
    lines = [l for l in blocks[table].splitlines() if l.startswith("|") and not l.startswith("|---")]
    return [[c.strip() for c in l.strip("|").split("|")] for l in lines]


def value(cell: str) -> str:
    """The value of a "value [low, high] (n=...)" or "value ± half-width (n=...)" cell (bold marker kept)."""
    return cell.split(" ±")[0].split(" [")[0]


def md_cell(path, row_start, column, table=0):
    rows = md_rows(path, table)
    col = rows[0].index(column)
    matches = [r for r in rows[1:] if r[: len(row_start)] == list(row_start)]
    assert len(matches) == 1, (row_start, matches)
    return matches[0][col]


@pytest.mark.extended
def test_summary_csv_holds_the_numbers(produced):
    out, _, _ = produced
    df = pd.read_csv(out / "summary.csv", dtype={"block_size": str})
    kd = df[(df.experiment == "table11") & (df.policy == "keydiff") & (df.budget_label == "2k")].iloc[0]
    assert kd["lb/qasper"] == 11.5 and kd["lb/repobench-p"] == 30.5 and kd["block_size"] == "128"
    assert kd["cr/narrativeqa"] == pytest.approx(0.2) and kd["cr/qasper"] == 0.5
    assert kd["score"] == pytest.approx(20.5) and kd["mean_ttft_s"] == 0.5 and bool(kd["cache_bound_held"])
    assert not df[(df.experiment == "table11") & (df.budget_label == "4k")].iloc[0]["complete"]
    assert len(df) == 7 + 2 + 3 + 3 + 8 + 1
    niah = df[(df.experiment == "fig6_niah") & (df.policy == "keydiff")].iloc[0]
    assert niah["metrics/needle_recall_by_cell/2000/50"] == 0.1
    # Math-500 subset: the full run's contexts over 1024 are p1#1 and p2#1.
    w20 = df[df.policy == "keydiff_w20"].iloc[0]
    assert (w20["subset/n_samples"], w20["subset/n_problems"], w20["subset/total_problems"]) == (2, 2, 2)
    assert (w20["subset/flex"], w20["subset/full_flex"]) == (0.5, 0.5)
    assert df[df.policy == "snapkv"].iloc[0]["subset/flex"] == 0.5
    # standard errors per score: flex of rows 1, 1, 0, 0; 100 x SE of 0.1, 0.3; qasper has one sample
    assert w20["se/metrics/flex"] == pytest.approx((1 / 3) ** 0.5 / 2) and w20["se/score"] == w20["se/metrics/flex"]
    assert kd["se/lb/narrativeqa"] == pytest.approx(10.0)
    assert kd["se/cr/narrativeqa"] == pytest.approx(0.1) and pd.isna(kd["se/lb/qasper"])


@pytest.mark.extended  # seconds: `produced` writes every table of a results tree; make test runs it
def test_longbench_tables_bold_the_best_eviction_method(produced):
    out, _, _ = produced
    md = out / "tables" / "table11.md"
    row = (LLAMA3B, "KeyDiff", "2K")
    assert md_cell(md, row, "NarrativeQA") == "**10.50 [n too small] (n=1)**"  # fewer than 5 samples: no interval
    assert md_cell(md, row, "Qasper") == "11.50 [n too small] (n=1)"
    assert value(md_cell(md, (LLAMA3B, "TOVA", "2K"), "Qasper")) == "**99.00"
    assert value(md_cell(md, (LLAMA3B, "Full", "--"), "NarrativeQA")) == "50.00"  # higher, but a reference
    # any dataset without an SE: no SE for the average; its interval is the widest-spread one over the 21 samples
    assert md_cell(md, row, "Avg.") == "20.50 [8.54, 41.58] (n=21)"
    assert value(md_cell(md, (LLAMA3B, "TOVA", "2K"), "Avg.")) == f"**{20 + (99 - 11) / 21:.2f}"
    assert not any(r[2] == "4K" for r in md_rows(md)[1:])  # the incomplete run is left out
    tex = (out / "tables" / "table11.tex").read_text()
    assert r"\textbf{99.00 [n too small] (n=1)}" in tex and r"\textbf{50.00" not in tex and r"\toprule" in tex
    # Table 1 = English columns of the table11 runs; its average is over those 16 columns only.
    english = [10.5 + i for i, d in enumerate(SUITE) if d in registry.ENGLISH]
    assert value(md_cell(out / "tables" / "table1.md", row, "Avg.")) == f"{sum(english) / 16:.2f}"
    assert "MF-zh" not in md_rows(out / "tables" / "table1.md")[0]
    assert value(md_cell(out / "tables" / "table1.md", (LLAMA3B, "Sink", "2K"), "Avg.")) == "**30.00"  # from table1 itself
    assert not any(r[1] == "Sink" for r in md_rows(md))  # an English-only run cannot fill Table 11
    # Table 13: block size is a row level; the full row (any B) appears once.
    rows13 = md_rows(out / "tables" / "table13.md")
    assert [r[:4] for r in rows13[1:]] == [[LLAMA3B, "--", "Full", "--"], [LLAMA3B, "64", "KeyDiff", "2K"]]
    ablation = out / "tables" / "table15.md"
    assert value(md_cell(ablation, ("KeyDiff",), "2K")) == "20.50"
    assert value(md_cell(ablation, ("Pairwise",), "2K")) == "**21.00"
    generic = out / "tables" / "generic" / "table11__longbench_full.md"  # lb/passage_count: a score, 10.5 + 16
    assert md_cell(generic, (LLAMA3B, "128", "keydiff", "2k"), "passage_count", table=1) == "26.500"


@pytest.mark.extended  # seconds: `produced` writes every table of a results tree; make test runs it
def test_other_tables(produced):
    out, _, _ = produced
    tables = out / "tables"
    assert value(md_cell(tables / "table17.md", ("TOVA",), "478")) == "**0.6"
    # every method at 1.0: no method is best there, none is bold
    assert [value(md_cell(tables / "table17.md", (m,), "100")) for m in ("KeyDiff", "TOVA")] == ["1.0", "1.0"]
    assert value(md_cell(tables / "table17.md", ("Dense",), "478")) == "0.8"
    assert md_cell(tables / "table18.md", ("0",), "1000") == "-0.10"
    assert md_cell(tables / "table18.md", ("50",), "2000") == "-0.30"
    # flex of rows 1, 1, 0, 0: 4 samples, too few for an interval (not 0.500 ± 0.566)
    assert md_cell(tables / "table4.md", ("4K", "1024", "KeyDiff + 20%"), "Flex Match") == "**0.500 [n too small] (n=4)**"
    assert md_cell(tables / "table4.md", ("4K", "--", "Full"), "Avg. Gen. Length") == "1200"
    # the full run's flex on the two samples over 1024 tokens: 0 and 1, SE 0.5, half-width 0.980
    assert md_cell(tables / "table5.md", ("4K", "Num Tokens > 1024 (2/2)", "Full"), "Flex") == "0.500 [n too small] (n=2)"
    assert value(md_cell(tables / "table9.md", ("NarrativeQA",), "2K")) == "0.20"
    assert md_cell(tables / "table9.md", ("NarrativeQA",), "2K").startswith("0.20 [n too small]")  # ratios 0.1, 0.3
    assert md_cell(tables / "table8.md", ("NarrativeQA",), ">8K") == "1"
    assert md_cell(tables / "table8.md", ("NarrativeQA",), "Total") == "2"
    assert md_cell(tables / "table8.md", ("Qasper",), "2K-4K") == "1"


@pytest.mark.extended
def test_tables_without_runs_say_so(produced, capsys):
    out, _, written = produced
    make_tables.main(out / "summary.csv", out / "tables2")
    printed = capsys.readouterr().out
    skipped = [line for line in printed.splitlines() if line.startswith("no results yet for ")]
    assert len(skipped) == 1 and "table10" in skipped[0] and "paper tables (" in skipped[0]  # one line for all
    assert not re.search(r"_vs_paper: 0 of |\b1 paper cells", printed)
    assert "table10" not in written and not {"table6", "table12", "table14", "table16"} & set(written)
    placeholder = (out / "tables2" / "table10.md").read_text()  # every file exists and says what to run
    assert "no results yet" in placeholder and "python run.py experiment=table10" in placeholder
    assert "no results yet" in (out / "tables2" / "table10.tex").read_text()


@pytest.mark.extended  # seconds: `produced` writes every table of a results tree; make test runs it
def test_same_model_cells_show_ours_paper_and_difference(produced):
    out, _, _ = produced
    md = out / "tables" / "table17_vs_paper.md"
    row = (LLAMA3B, LLAMA3B, "tova", "6k")
    assert md_cell(md, row + ("478",), "Ours") == "0.6 [n too small]" and md_cell(md, row + ("478",), "Paper") == "1"
    assert md_cell(md, row + ("478",), "Δ") == "-0.4!"  # beyond the 0.2 tolerance (one book of five)
    assert md_cell(md, (LLAMA3B, LLAMA3B, "full", "6k", "478"), "Δ") == "-0.2"  # at the tolerance: inside
    text = md.read_text()
    assert ("6 of 30 paper cells compared (same model, complete whole-task runs); mean abs. difference accuracy 0.2; "
            "2 outside tolerance") in text
    assert "python run.py experiment=table17 model=llama-3.2-3b-instruct policy=tova budget=6k" in text
    t1 = out / "tables" / "table1_vs_paper.md"
    cells = md_rows(t1)
    kd = [r for r in cells if r[:5] == [LLAMA3B, LLAMA3B, "keydiff", "2k", "narrativeqa"]]
    assert kd and kd[0][6:9] == ["10.5 [n too small]", "18.29", "-7.79!"]  # 2 samples: no interval
    # The unfinished table11 run (~) is shown with its difference but not counted.
    assert md_cell(t1, (LLAMA3B, LLAMA3B, "keydiff", "4k", "narrativeqa"), "Ours") == "70 [n too small]~"
    assert "68 of 711 paper cells" in t1.read_text() and "~ 17 cells from runs not complete, shown but not counted" \
        in t1.read_text()
    assert "python run.py experiment=table1_full model=llama-3.1-8b-instruct" in t1.read_text()
    assert (out / "tables" / "table1_vs_paper.tex").read_text().count(r"\toprule") == 1
    assert [paper_compare.num(v, 0) for v in (10, 200.0, 3)] == ["10", "200", "3"]  # sample counts keep their zeros
    # A cell recovered from the paper's other numbers is compared (results/paper/README.md); one the
    # extracted paper text garbles is shown as such, never compared.
    t11 = out / "tables" / "table11_vs_paper.md"
    assert md_cell(t11, (LLAMA3B, LLAMA3B, "full", "--", "dureader"), "Paper") == "36.24"
    garbled = out.parent / "garbled"
    garbled.mkdir(exist_ok=True)
    ours = {"model": LLAMA3B, "policy": "keydiff_w10", "budget": "2k", "block_size": "", "row": "", "column": "dureader",
            "metric": "score", "value": 20.0, "n": 1, "failed": 0, "subset": False, "incomplete": False}
    paper_compare.write_one("table14", 14, [ours], ("table14", "table11_full"), garbled)
    t14 = garbled / "table14_vs_paper.md"
    assert md_cell(t14, (LLAMA3B, LLAMA3B, "keydiff_w10", "2k", "dureader"), "Paper") == "garbled"
    assert md_cell(t14, (LLAMA3B, LLAMA3B, "keydiff_w10", "2k", "dureader"), "Δ") == ""
    # Table 9 names no model: any model's ratios are compared; its average is weighted by prompts.
    t9 = out / "tables" / "table9_vs_paper.md"
    assert md_cell(t9, (LLAMA3B, "(not named)", "", "2k", "narrativeqa"), "Paper") == "0.1"


@pytest.fixture(scope="module")
def adhoc(tmp_path_factory):
    """python run.py -m policy=keydiff,sink budget=1k,2k task.limit=2, plus a Table 17 run with one sample out of memory."""
    runs = tmp_path_factory.mktemp("adhoc") / "runs"
    for label, score in [("keydiff", 0.75), ("sink", 0.25)]:
        for budget in ["1k", "2k"]:
            step = 0.125 if budget == "2k" else 0
            write_run(runs, "adhoc", "niah_small", "smollm2-135m", label, budget, 128,
                      {"needle_recall": score + step}, rows=niah_rows([score + 0.25, score - 0.25 + 2 * step]), limit=2)
    book = [{"sample_id": f"n100/b0/q{i}", "scores": {"exact": float(i % 2 == 0)}} for i in range(4)]
    write_run(runs, "table17", "phonebook", "smollm2-135m", "keydiff", "6k", 128,
              {"exact": 0.5, "by_size": {"100": {"exact": 0.6}}}, rows=book,
              extra={"num_samples": 4, "num_failed": 1, "failures": {"out_of_memory": 1}})
    out = runs.parent / "out"
    collect_results.collect(runs, out / "summary.csv")
    written = make_tables.main(out / "summary.csv", out / "tables")
    figures = make_figures.main(out / "summary.csv", runs, out / "figures")
    return out, written, figures


@pytest.mark.extended
def test_adhoc_subset_sweep_gets_a_generic_table_and_figure(adhoc):
    out, written, figures = adhoc
    assert "generic/adhoc__niah_small" in written
    md = out / "tables" / "generic" / "adhoc__niah_small.md"
    # recalls 1.0 and 0.5 (not 0.750 ± 0.490: two samples are too few for an interval)
    assert md_cell(md, ("smollm2-135m", "128", "keydiff"), "1k") == "0.750 [n too small] (n=2)§"
    assert md_cell(md, ("smollm2-135m", "128", "sink"), "2k") == "0.375 [n too small] (n=2)§"
    assert md_cell(md, ("smollm2-135m", "128", "sink", "2k"), "limit", table=1) == "2"
    assert md_cell(md, ("smollm2-135m", "128", "sink", "2k"), "needle_recall (primary)", table=1) == "0.375 [n too small] (n=2)"
    assert md_cell(md, ("smollm2-135m", "128", "sink", "2k"), "kept N/L", table=1) == "0.500 [n too small] (n=2)"
    assert "needle_recall" not in md_rows(md, table=1)[0]  # the primary score is not repeated
    assert "4 configurations, 8 samples scored, 4 subset runs (§)" in md.read_text()
    tex = (out / "tables" / "generic" / "adhoc__niah_small.tex").read_text()
    assert r"\toprule" in tex and r"\caption{adhoc / niah\_small" in tex and "0.750 [n too small] (n=2)§" in tex
    names = {p.relative_to(out / "figures").as_posix() for p in figures}
    assert "generic/adhoc__niah_small__smollm2-135m__bs128.png" in names
    readme = (out / "README.md").read_text()
    assert "[adhoc__niah_small](tables/generic/adhoc__niah_small.md)" in readme
    assert "5 runs in results/summary.csv (5 complete, 4 subset runs, 12 samples scored, 1 failed)" in readme
    assert "generic/adhoc__niah_small__smollm2-135m__bs128.png" in readme
    assert "| [table10](tables/table10.md) | `table10`, `table11_full` | no data yet |" in readme
    assert "no data yet (run: python run.py experiment=fig6_niah)" in readme


@pytest.mark.extended  # seconds: its fixture writes a second results tree's tables and figures; make test runs it
def test_failed_samples_and_other_models_are_marked(adhoc):
    out, _, _ = adhoc
    df = pd.read_csv(out / "summary.csv")
    run = df[df.experiment == "table17"].iloc[0]
    assert (run["samples"], run["num_failed"], run["failures/out_of_memory"]) == (4, 1, 1)
    assert md_cell(out / "tables" / "generic" / "table17__phonebook.md", ("smollm2-135m", "128", "keydiff"), "6k") \
        == "0.500 [n too small] (n=4)†1"
    md = out / "tables" / "table17_vs_paper.md"  # SmolLM2 is not the paper's model: reference only, no difference
    assert md_cell(md, ("smollm2-135m", LLAMA3B, "keydiff", "6k", "100"), "Ours") == "0.6 [n too small]†1"
    assert md_cell(md, ("smollm2-135m", LLAMA3B, "keydiff", "6k", "100"), "Paper") == "1"  # the paper's, beside ours
    assert md_cell(md, ("smollm2-135m", LLAMA3B, "keydiff", "6k", "100"), "Δ") == "other model"
    text = md.read_text()
    assert "0 of 30 paper cells compared" in text and "for reference only" in text and "† 1 cell with" in text
    assert "the paper's values for another model, llama-3.2-3b-instruct" in text
    wide = md_rows(md, table=1)  # side by side: the paper's model is named on the row
    assert wide[0][:2] == ["model", "paper_model"] and wide[1][:2] == ["smollm2-135m", LLAMA3B]


@pytest.mark.extended
def test_nothing_run_yet_still_writes_every_file(tmp_path):
    frame = collect_results.collect(tmp_path / "runs", tmp_path / "summary.csv")
    assert frame.empty
    written = make_tables.main(tmp_path / "summary.csv", tmp_path / "tables")
    assert written == []
    for name in make_tables.TABLES:
        assert "no results yet" in (tmp_path / "tables" / f"{name}.md").read_text()
    assert "python run.py experiment=table1 model=llama-3.2-3b-instruct policy=keydiff budget=2k" in \
        (tmp_path / "tables" / "table1_vs_paper.md").read_text()
    assert make_figures.main(tmp_path / "summary.csv", tmp_path / "runs", tmp_path / "figures") == []
    assert "holds no runs yet" in (tmp_path / "README.md").read_text()


EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GROUPS = ("model", "policy", "budget", "task")


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=True)


@pytest.mark.extended
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_to_existing_options(name):
    cfg = compose([f"experiment={name}"])
    assert cfg.experiment_name == name and str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    params = {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}
    assert {"policy", "budget"} <= set(params) and {"block_size", "protocol"} & set(params)  # protocol sets B
    for group in GROUPS:
        for option in params.get(group, [cfg.hydra.runtime.choices[group]]):
            assert (CONF / group / f"{option}.yaml").is_file(), f"{name}: no conf/{group}/{option}.yaml"
    # Keys an experiment sets under task/model must exist in that task/model config (no silent typos).
    raw = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
    for group in ("task", "model"):
        plain = compose([f"{group}={params.get(group, [cfg.hydra.runtime.choices[group]])[0]}"])
        assert set(raw.get(group) or {}) <= set(plain[group]), f"{name}: unknown {group} keys"
    # The first and the last grid point compose and land in results/runs/<name>/...
    for pick in (0, -1):
        point = [f"experiment={name}"] + [f"{k}={v[pick]}" for k, v in params.items()]
        job = compose(point)
        assert job.hydra.sweep.dir == f"{job.results_root}/{name}"
        assert job.run_subdir.startswith(f"{job.task.name}/{job.model.name}/{job.policy.label}/")


@pytest.mark.extended
def test_slurm_launcher_composes(monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from omegaconf import OmegaConf

    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    launcher = OmegaConf.to_container(compose(["experiment=smoke", "hydra/launcher=slurm"]).hydra.launcher, resolve=True)
    assert launcher["gpus_per_node"] == 1 and launcher["partition"] is None and launcher["setup"] == []
    assert launcher["submitit_folder"].startswith("results/runs/smoke/") and launcher["name"] == "kd-smoke"
    monkeypatch.setenv("SBATCH_PARTITION", "gpu-env")
    overrides = ["experiment=smoke", "hydra/launcher=slurm", "+slurm.account=lab", "+slurm.array_parallelism=4"]
    launcher = OmegaConf.to_container(compose(overrides).hydra.launcher, resolve=True)
    assert (launcher["partition"], launcher["account"], launcher["array_parallelism"]) == ("gpu-env", "lab", 4)


def test_predictions_count_the_latest_successful_row_per_sample(tmp_path):
    """Failed rows carry no scores and a retried sample has several rows: only the last, if it succeeded, counts."""
    rows = [{"sample_id": "a", "status": "ok", "compression_ratio": 0.5},
            {"sample_id": "b", "status": "failed", "failure_reason": "out_of_memory"},
            {"sample_id": "c", "status": "failed", "failure_reason": "out_of_memory"},
            {"sample_id": "c", "status": "ok", "compression_ratio": 0.25},
            {"sample_id": "d", "compression_ratio": 0.75}]  # a row written before statuses existed
    (tmp_path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"sample_id": "e"')
    before = (tmp_path / "predictions.jsonl").read_bytes()
    got = collect_results.read_predictions(tmp_path)
    assert {r["sample_id"]: r["kept_ratio"] for r in got} == {"a": 0.5, "c": 0.25, "d": 0.75}  # old name read
    assert (tmp_path / "predictions.jsonl").read_bytes() == before  # a reader never cuts a running job's last line


FULL_RECALLS = [1.0, 1.0, 1.0, 1.0, 0.6, 0.584]  # mean 0.864 (the default job: 6 samples)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The default job (6 samples), then task.limit=2 on the same point (seed0-limit2/), and a subset-only point."""
    runs = tmp_path_factory.mktemp("mixed") / "runs"
    point = dict(runs=runs, experiment="adhoc", task="niah_small", model="smollm2-135m", label="keydiff",
                 budget_label="2k", block=128)
    write_run(**point, metrics={"needle_recall": 0.864, "n": 6}, rows=niah_rows(FULL_RECALLS))
    write_run(**point, metrics={"needle_recall": 1.0, "n": 2}, rows=niah_rows(FULL_RECALLS[:2]), limit=2)
    # A point with only a subset run (limits 2 and 4: the larger one is shown, never their mean).
    other = {**point, "label": "sink"}
    write_run(**other, metrics={"needle_recall": 0.5, "n": 2}, rows=niah_rows([1.0, 0.0]), limit=2)
    write_run(**other, metrics={"needle_recall": 0.25, "n": 4}, rows=niah_rows([1.0, 0.0, 0.0, 0.0]), limit=4)
    out = runs.parent / "out"
    collect_results.collect(runs, out / "summary.csv")
    make_tables.main(out / "summary.csv", out / "tables")
    return out, runs


@pytest.mark.extended
def test_a_subset_run_is_never_averaged_with_the_full_run(mixed):
    out, _ = mixed
    md = out / "tables" / "generic" / "adhoc__niah_small.md"
    kd = ("smollm2-135m", "128", "keydiff")
    # SE of the six recalls: sd 0.2107 / sqrt(6) = 0.0860; Wilson at n_eff = p(1 - p) / SE^2 = 15.9: inside [0, 1]
    assert md_cell(md, kd, "2k") == "0.864 [0.626, 0.960] (n=6)"  # not 0.932 (n=8)§
    assert md_cell(md, kd + ("2k",), "seeds", table=1) == "1"
    assert md_cell(md, kd + ("2k",), "limit", table=1) == "--"
    assert md_cell(md, kd + ("2k",), "n (metric)", table=1) == "6"  # a count prints as an integer
    # Only subset runs: the largest limit, marked §.
    assert md_cell(md, ("smollm2-135m", "128", "sink"), "2k") == "0.250 [n too small] (n=4)§"
    assert md_cell(md, ("smollm2-135m", "128", "sink", "2k"), "limit", table=1) == "4"
    assert "2 subset runs not shown" in md.read_text()


def drawn_figures(monkeypatch, summary, runs, out) -> dict:
    """make_figures.main, recording what each figure draws (legend, error-bar series, titles) before it is saved."""
    plotted, save = {}, make_figures.save

    def keep_axes(fig, where, name):
        ax = fig.axes[0]
        plotted[name] = [text.get_text() for text in ax.get_legend().get_texts()] if ax.get_legend() else []
        plotted[name + "/containers"] = [(c.lines[0].get_ydata().tolist(), c) for c in ax.containers
                                         if hasattr(c, "lines")]  # error-bar series
        plotted[name + "/title"] = ax.get_title()
        plotted[name + "/titles"] = [a.get_title() for a in fig.axes] + [fig.get_suptitle()]
        plotted[name + "/texts"] = [[t.get_text() for t in a.texts] for a in fig.axes]
        plotted[name + "/xticks"] = list(ax.get_xticks())
        plotted[name + "/layout"] = type(fig.get_layout_engine()).__name__
        return save(fig, where, name)

    monkeypatch.setattr(make_figures, "save", keep_axes)
    make_figures.main(summary, runs, out)
    return plotted


@pytest.mark.extended
def test_generic_figures_keep_intervals_in_range_and_points_at_their_budget(mixed, monkeypatch):
    """Every error bar lies in the score's range, every point at its budget's tick, with room for the axis labels."""
    out, runs = mixed
    plotted = drawn_figures(monkeypatch, out / "summary.csv", runs, out / "figures")
    names = [k[: -len("/containers")] for k in plotted if k.endswith("/containers") and "__bs" in k]
    assert names
    checked = 0
    for name in names:
        task = name.split("__")[1]
        low, high = metric_range("score", task)
        for _, container in plotted[name + "/containers"]:
            x, y = (np.asarray(v, dtype=float) for v in container.lines[0].get_data())
            assert set(x) <= set(plotted[name + "/xticks"]), name  # drawn at the budget, not beside it
            for segment in (container.lines[2][0].get_segments() if container.lines[2] else []):
                if not len(segment):  # a point without an interval (fewer than 5 samples)
                    continue
                assert low <= segment[0][1] <= segment[1][1] <= high, (name, segment)
                checked += 1
        assert plotted[name + "/layout"] == "ConstrainedLayoutEngine"  # the x label is not cut off
    assert checked


@pytest.mark.extended
def test_the_generic_figure_plots_the_full_run_with_its_interval(mixed, monkeypatch):
    out, runs = mixed
    plotted = drawn_figures(monkeypatch, out / "summary.csv", runs, out / "figures")
    name = "adhoc__niah_small__smollm2-135m__bs128"
    labels = list(plotted[name])
    assert "KeyDiff (n=6 per budget)" in labels and "Sink § (n=4 per budget)" in labels
    series = dict((round(y[0], 6), c) for y, c in plotted[name + "/containers"])
    assert set(series) == {0.864, 0.25}  # never 0.932
    bar = series[0.864].lines[2][0].get_segments()[0]  # the error bar of the full run's point
    assert [round(v, 3) for v in (bar[0][1], bar[1][1])] == [0.626, 0.960]  # the table's interval
    assert "§" in plotted[name + "/title"]


def test_table9_average_is_over_prompts(tmp_path):
    """Table 9's average is over prompts (0.1, 0.3, 0.5: 0.30), not over dataset means (0.35)."""
    runs = tmp_path / "runs"
    rows = [{"sample_id": f"{d}/{k}", "info": {"dataset": d}, "compression_ratio": c, "scores": {"score": c}}
            for d, k, c in [("narrativeqa", 0, 0.1), ("narrativeqa", 1, 0.3), ("qasper", 0, 0.5)]]
    metrics = {"datasets": {"narrativeqa": 20.0, "qasper": 50.0}, "num_samples": {"narrativeqa": 2, "qasper": 1}}
    write_run(runs, "table11", "longbench_full", LLAMA3B, "keydiff", "2k", 128, metrics, rows)
    collect_results.collect(runs, tmp_path / "summary.csv")
    assert make_tables.compression(make_tables.load(tmp_path / "summary.csv"), tmp_path, registry.TABLES["table9"])
    assert md_cell(tmp_path / "table9.md", ("Average",), "2K").startswith("0.30 [n too small] (n=3)")  # 3 prompts


def test_math500_baseline_is_the_whole_full_run_of_the_experiment(tmp_path):
    """Tables 5/7's baseline is table4_full's whole run, never a subset run; adhoc takes adhoc's full run."""
    runs = tmp_path / "runs"
    whole = math_rows([1, 0, 1, 1], [500, 1500, 800, 2000])  # contexts 600, 1600, 900, 2100
    few = math_rows([0, 0], [2000, 2000])
    for experiment, limit, rows in [("adhoc", 2, few), ("table4_full", 2, few), ("table4_full", None, whole)]:
        write_run(runs, experiment, "math500", R1, "full", "unbounded", 128, {"flex": 0.0, "exact": 0.0}, rows,
                  limit=limit)
    for experiment in ("table4_gen4k", "adhoc"):
        write_run(runs, experiment, "math500", R1, "snapkv", "1k", 128, {"flex": 0.25, "exact": 0.25},
                  math_rows([0, 0, 0, 1], [400, 1400, 700, 1900]))
    df = collect_results.collect(runs, tmp_path / "summary.csv")
    paper = df[(df.experiment == "table4_gen4k") & (df.policy == "snapkv")].iloc[0]
    assert paper["subset/full_flex"] == 0.5 and paper["subset/total_problems"] == 2  # p1#1, p2#1 exceed 1K
    adhoc = df[(df.experiment == "adhoc") & (df.policy == "snapkv")].iloc[0]
    assert adhoc["subset/full_flex"] == 0.0 and adhoc["subset/total_problems"] == 1  # adhoc's own (subset) run


def test_ruler_standard_errors_leave_short_samples_out():
    """A short sample counts in no task's SE; a task of only short samples adds no group to the average's SE."""
    rows = [{"sample_id": f"vt/{i}", "scores": {"score": s}, "info": {"short": short}}
            for i, (s, short) in enumerate([(1.0, False), (0.0, False), (1.0, True)])]
    rows.append({"sample_id": "qa_1/0", "scores": {"score": 1.0}, "info": {"short": True}})
    se = collect_results.standard_errors("ruler", rows, {})
    assert se["se/metrics/tasks/vt"] == pytest.approx(50.0) and "se/metrics/tasks/qa_1" not in se
    assert se["se/score"] == pytest.approx(50.0)


def test_interval_arithmetic():
    from keydiff.report.render import combined_se, format_estimate, grouped_mean_se, seeds_se, standard_error

    assert standard_error([1.0, 0.0]) == pytest.approx(0.5) and standard_error([0.7]) != standard_error([0.7])  # NaN
    assert combined_se([0.3, 0.4]) == pytest.approx(0.25)  # the mean of two independent estimates
    assert seeds_se([0.3, 0.4]) == pytest.approx(0.35) and math.isnan(seeds_se([0.3, float("nan")]))  # same samples
    mean, se = grouped_mean_se([[1.0, 0.0], [1.0, 1.0, 1.0]], scale=100)  # datasets weigh equally, as averages do
    assert (mean, se) == (pytest.approx(75.0), pytest.approx(25.0))
    assert format_estimate(0.5, 0.25, 2) == "0.500 [n too small] (n=2)" and format_estimate(0.5, float("nan")) == "0.500 ± n/a"
    assert format_estimate(9.0, 0.5, 6) == "9.000 ± 0.980 (n=6)"  # unbounded (a time): mean ± 1.96 SE
    # Seeds of one configuration repeat the same samples: values averaged, n per seed (not summed), the SE the
    # mean of the seeds' SEs (a bound for correlated estimates; not sqrt(2) narrower as for independent ones).
    from keydiff.report import generic as generic_tables
    from keydiff.report import selection

    seeds = pd.DataFrame({"policy": ["kd", "kd"], "score": [0.5, 0.7], "se/score": [0.3, 0.4], "samples": [6, 6]})
    row = selection.average_seeds(seeds, ["policy"]).iloc[0]
    assert (row["score"], row["se/score"], row["samples"]) == (pytest.approx(0.6), pytest.approx(0.35), 6)
    assert generic_tables.sample_count(row) == "6"
    row = selection.average_seeds(seeds.assign(samples=[5, 6]), ["policy"]).iloc[0]
    assert generic_tables.sample_count(row) == "5–6"  # seeds that scored different numbers say so


@pytest.mark.extended
def test_two_seeds_of_the_same_samples_show_per_seed_n(tmp_path):
    runs = tmp_path / "runs"
    point = dict(runs=runs, experiment="adhoc", task="niah_small", model="smollm2-135m", label="keydiff",
                 budget_label="2k", block=128)
    second = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    kept = [0.4, 0.5, 0.6, 0.4, 0.5, 0.6]  # kept N/L per sample of seed 0: mean 0.5
    rows = [row | {"compression_ratio": k} for row, k in zip(niah_rows(FULL_RECALLS), kept)]
    write_run(**point, metrics={"needle_recall": 0.864, "length": 4096.0}, rows=rows)
    write_run(**point, metrics={"needle_recall": 5 / 6, "length": 4096.0}, rows=niah_rows(second), seed=1)
    collect_results.collect(runs, tmp_path / "summary.csv")
    make_tables.main(tmp_path / "summary.csv", tmp_path / "tables")
    md = tmp_path / "tables" / "generic" / "adhoc__niah_small.md"
    kd = ("smollm2-135m", "128", "keydiff")
    se = (standard_error(FULL_RECALLS) + standard_error(second)) / 2
    mean = (0.864 + 5 / 6) / 2
    low, high = interval(mean, se, 6, (0.0, 1.0))  # the seeds' SE bound, n per seed
    assert md_cell(md, kd, "2k") == f"{mean:.3f} [{low:.3f}, {high:.3f}] (n=6)"  # not n=12
    assert md_cell(md, kd + ("2k",), "seeds", table=1) == "2" and md_cell(md, kd + ("2k",), "n", table=1) == "6"
    # kept N/L and TTFT average samples: they carry their interval (seed 1 keeps 0.5 of every prompt: SE 0)
    low, high = interval(0.5, standard_error(kept) / 2, 6, (0.0, 1.0))  # kept N/L lives in [0, 1]: Wilson
    assert md_cell(md, kd + ("2k",), "kept N/L", table=1) == f"0.500 [{low:.3f}, {high:.3f}] (n=6)"
    assert md_cell(md, kd + ("2k",), "TTFT (s)", table=1) == "0.500 [constant] (n=6)"  # 0.5 s on every sample
    assert md_cell(md, kd + ("2k",), "length", table=1) == "4096"  # a length prints as an integer


@pytest.mark.extended
def test_a_budget_above_every_prompt_keeps_a_constant_and_scores_read_alike(tmp_path):
    """A constant kept N/L has no interval; perfect recalls and ROUGE-1 F1s of 0.999999995 read as the same score."""
    runs = tmp_path / "runs"
    rows = [{"sample_id": f"niah/{i}", "scores": {"needle_recall": 1.0, "rouge1": 2 / (2 + 1e-8)}, "ttft_s": 0.5 + i,
             "compression_ratio": 1.0} for i in range(6)]
    write_run(runs, "adhoc", "niah_small", "smollm2-135m", "keydiff", "6k", 128,
              {"needle_recall": 1.0, "rouge1": 2 / (2 + 1e-8)}, rows=rows,
              extra={"statistics": {"samples": 6, "mean_compression_ratio": 1.0, "mean_ttft_s": 3.0,
                                    "mean_prompt_tokens": 3500.0, "cache_bound_held": True}})
    collect_results.collect(runs, tmp_path / "summary.csv")
    make_tables.main(tmp_path / "summary.csv", tmp_path / "tables")
    md = tmp_path / "tables" / "generic" / "adhoc__niah_small.md"
    row = ("smollm2-135m", "128", "keydiff", "6k")
    low = interval(1.0, 0.0, 6, (0.0, 1.0))[0]
    assert f"{low:.3f}" == "0.610"
    assert md_cell(md, row[:3], "6k") == "1.000 [0.610, 1.000] (n=6)"
    assert md_cell(md, row, "rouge1", table=1) == "1.000 [0.610, 1.000] (n=6)"
    assert md_cell(md, row, "kept N/L", table=1) == "1.000 [constant] (n=6)"
    assert md_cell(md, row, "TTFT (s)", table=1).startswith("3.000 ± ")  # it varies: its interval stays
    assert "constant" in md.read_text().split("\n")[2]  # the legend says what it means


def test_intervals_snap_to_a_bound_within_the_tolerance_and_constants_have_none():
    from keydiff.report.render import TOLERANCE, format_estimate, is_constant

    near = 1 - 5e-9
    assert interval(near, 1e-17, 6, (0.0, 1.0)) == interval(1.0, 0.0, 6, (0.0, 1.0))  # not [1.000, 1.000]
    assert interval(100 - 5e-7, 1e-15, 6, (0.0, 100.0)) == interval(100.0, 0.0, 6, (0.0, 100.0))
    assert interval(1 + 1e-12, 0.0, 6, (0.0, 1.0)) == interval(1.0, 0.0, 6, (0.0, 1.0))  # a float sum past the bound
    assert interval(1 - 10 * TOLERANCE, 1e-3, 6, (0.0, 1.0)) != interval(1.0, 0.0, 6, (0.0, 1.0))  # a real difference
    assert interval(1.0, 0.0, 6, (0.0, 1.0), measure=True) is None and interval(0.5, 0.0, 6, None, measure=True) is None
    assert interval(0.5, 0.1, 6, (0.0, 1.0), measure=True) == interval(0.5, 0.1, 6, (0.0, 1.0))  # it varies
    assert format_estimate(near, 1e-17, 6, bounds=(0.0, 1.0), measure=True) == "1.000 [constant] (n=6)"
    assert format_estimate(near, 1e-17, 6, bounds=(0.0, 1.0)) == "1.000 [0.610, 1.000] (n=6)"
    assert format_estimate(2.0, 0.0, 6, measure=True) == "2.000 [constant] (n=6)"
    assert format_estimate(2.0, 0.0, 2, measure=True) == "2.000 [n too small] (n=2)"
    assert format_estimate(2.0, float("nan"), 6, measure=True) == "2.000 ± n/a (n=6)"  # unknown SE: not a constant
    assert is_constant(0.3, 1e-9, (0.0, 1.0)) and not is_constant(0.3, float("nan")) and not is_constant(0.3, 1e-3)


@pytest.mark.parametrize("values, bold", [
    ([0.0, 0.0, 0.0], [False, False, False]),   # every method 0: no best
    ([0.5, 0.5, 0.25], [True, True, False]),    # tied at the top, above the rest: both bold
    ([0.5, 0.5 - 1e-9, 0.25], [True, True, False]),  # within the tolerance: a tie
    ([0.7, 0.5, 0.25], [True, False, False]),
    ([0.7, np.nan, np.nan], [False, False, False]),  # one method alone beats nothing
])
def test_bold_marks_only_a_best_above_the_rest(values, bold):
    from keydiff.report.render import best_mask

    table = pd.DataFrame({"Method": ["A", "B", "C", "Full"], "x": values + [0.9]}).set_index("Method")
    assert best_mask(table, None, ["x"])["x"].tolist() == bold + [False]  # the full cache is a reference


def test_counts_take_the_right_number(tmp_path):
    from keydiff.report import index
    from keydiff.report.render import plural

    assert [plural(1, "configuration"), plural(2, "configuration"), plural(0, "run"), plural(3, "policy"),
            plural(1.0, "paper cell")] == ["1 configuration", "2 configurations", "0 runs", "3 policies", "1 paper cell"]
    summary = tmp_path / "summary.csv"
    pd.DataFrame([{"experiment": "adhoc", "task": "niah_small", "complete": True, "limit": np.nan, "samples": 1,
                   "num_failed": 0}]).to_csv(summary, index=False)
    assert index.runs_line(summary).startswith(
        "1 run in results/summary.csv (1 complete, 0 subset runs, 1 sample scored, 0 failed) over 1 experiment: adhoc")
