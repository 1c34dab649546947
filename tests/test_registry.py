"""keydiff.paper.registry is the one source of which experiments feed which paper table and of policy names (tables,
comparisons with the paper, the figures index, W&B reports); report/ and paper/ have no import cycle and nothing in
the package edits sys.path."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from keydiff.paper import registry
from keydiff.report import collect, figures, render, tables
from keydiff.report import wandb as wandb_report
from tests.test_tables import LLAMA3B, longbench_scores, md_cell, write_run

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keydiff"


def phonebook_runs(runs: Path, experiment: str) -> None:
    for label, size_478 in [("full", 0.8), ("keydiff", 0.4), ("tova", 0.6)]:
        write_run(runs, experiment, "phonebook", LLAMA3B, label, "6k", 128,
                  {"exact": 0.7, "by_size": {"100": {"exact": 1.0}, "478": {"exact": size_478}}})


def build(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    collect.collect(tmp_path / "runs", out / "summary.csv")
    tables.main(out / "summary.csv", out / "tables")
    return out / "tables"


@pytest.mark.extended
def test_the_registry_decides_which_runs_fill_a_table_and_its_comparison(tmp_path, monkeypatch):
    """Runs of an unlisted experiment fill nothing; listing them makes the table, comparison and index take them."""
    phonebook_runs(tmp_path / "runs", "phonebook_rerun")
    before = build(tmp_path)
    assert "no results yet" in (before / "table17.md").read_text()
    assert "No run of ours fills a cell" in (before / "table17_vs_paper.md").read_text()

    table = registry.TABLES["table17"]
    monkeypatch.setitem(registry.TABLES, "table17", dataclasses.replace(
        table, reads=("phonebook_rerun",), run=("phonebook_rerun",), fill=("phonebook_rerun", "phonebook_rerun")))
    after = build(tmp_path)
    assert md_cell(after / "table17.md", ("TOVA",), "478").startswith("**0.6")
    comparison = (after / "table17_vs_paper.md").read_text()
    assert f"| {LLAMA3B} | {LLAMA3B} | tova | 6k | 478 | accuracy | 0.6 [n too small] | 1 |" in comparison
    assert "python run.py experiment=phonebook_rerun model=llama-3.2-3b-instruct" in comparison  # missing sizes
    entries = {(e["kind"], e["name"]): e for e in json.loads((after.parent / "tables" / "index.json").read_text())}
    assert entries[("paper", "table17")]["experiments"] == ["phonebook_rerun"]
    assert entries[("vs_paper", "table17_vs_paper")]["experiments"] == ["phonebook_rerun"]


def methods(tables_dir: Path) -> list[str]:
    return [row.split(" | ")[1] for row in (tables_dir / "table11.md").read_text().splitlines()
            if row.startswith("| llama")]


@pytest.mark.extended
def test_the_registry_decides_a_tables_policies_and_display_names(tmp_path, monkeypatch):
    """knorm is "L2-norm" wherever it is printed; a policy the registry does not list for a table is left out."""
    runs = tmp_path / "runs"
    for label, base in [("keydiff", 10.5), ("knorm", 9.0), ("random", 1.0)]:
        write_run(runs, "table11", "longbench_full", LLAMA3B, label, "2k", 128, longbench_scores(base))
    out = build(tmp_path)
    assert methods(out) == ["KeyDiff", "L2-norm"]  # random is not one of Table 11's policies
    monkeypatch.setitem(registry.TABLES, "table11", dataclasses.replace(
        registry.TABLES["table11"], policies=["keydiff", "knorm", "random"]))
    monkeypatch.setitem(registry.DISPLAY_NAMES, "random", "Random")
    out = build(tmp_path)
    assert methods(out) == ["KeyDiff", "L2-norm", "Random"]
    assert registry.display_name("knorm") == "L2-norm" and registry.display_name("mine") == "mine"


def test_the_figures_index_and_the_wandb_report_follow_the_registry(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "FIGURES", [registry.PaperFigure("Figure 99: something", "fig99_", ("fig99_run",))])
    entries = figures.index_entries([], tmp_path)
    assert entries[0]["name"] == "Figure 99: something" and "python run.py experiment=fig99_run" in entries[0]["status"]

    paper = tmp_path / "paper"
    paper.mkdir()
    head = "table,model,policy,budget,block_size,row,column,column_kind,metric,value,samples,samples_total,note\n"
    (paper / "table1.csv").write_text(head + f"1,{LLAMA3B},keydiff,2k,128,,avg,average,score,41.5,,,\n")
    (paper / "table11.csv").write_text(head + f"11,{LLAMA3B},keydiff,2k,128,,avg,average,score,37.25,,,\n")
    grid = wandb_report.Grid("table1", "table1", "", "longbench", [LLAMA3B], ["keydiff"], ["keydiff"], ["2k"], ["128"])
    text = wandb_report.paper_table(grid, LLAMA3B, paper)
    assert "(Table 1;" in text and "41.5" in text
    monkeypatch.setitem(registry.SHARED_TABLES, "1", ("11",))  # Table 1's runs compared with Table 11 instead
    text = wandb_report.paper_table(grid, LLAMA3B, paper)
    assert "(Table 11;" in text and "37.25" in text and "41.5" not in text


def test_budget_labels_sort_by_tokens_everywhere():
    labels = ["8k", "unbounded", "512", "--", "2k", "1k", "1.5k"]
    assert sorted(labels, key=render.budget_tokens) == ["--", "512", "1k", "1.5k", "2k", "8k", "unbounded"]
    assert render.marks(True, 2, True) == "§†2~" and render.marks(False, float("nan"), False) == ""
    assert [render.trimmed(v) for v in (10, 0.5, 1 / 3, None)] == ["10", "0.5", "0.333", "--"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """keydiff modules a file imports anywhere in it (submodules by name, relative imports made absolute)."""
    found = set()
    package = module_name(path).split(".")[: None if path.name == "__init__.py" else -1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.startswith("keydiff"):
                subs = {f"{module}.{alias.name}" for alias in node.names} & modules
                found |= subs or ({module} & modules)
    return found


@pytest.mark.extended
def test_report_and_paper_have_no_import_cycle_and_nothing_edits_sys_path():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imports(path, set(files)) - {name} for name, path in files.items()}
    ours = [n for n in graph if n.startswith(("keydiff.report", "keydiff.paper"))]
    assert "keydiff.paper.registry" in ours and "keydiff.report.tables" in ours

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            for nxt in graph.get(node, ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    assert [n for n in ours if reaches(n, n)] == []
    report_tests = [ROOT / "tests" / f"test_{n}.py"
                    for n in ("tables", "report", "paper_numbers", "tracking", "golden_reports")]
    edits = [str(p.relative_to(ROOT)) for p in [*PACKAGE.rglob("*.py"), *report_tests]
             if "sys.path" in p.read_text(encoding="utf-8")]
    assert edits == []
