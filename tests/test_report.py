"""keydiff/report/wandb.py: the W&B report objects of an experiment hold the expected panels, built offline
(no account, no network); publishing without credentials is refused with the fix named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("wandb_workspaces")
pytestmark = [pytest.mark.unit, pytest.mark.extended, pytest.mark.filterwarnings('ignore::DeprecationWarning')]
from wandb_workspaces import expr  # noqa: E402

from keydiff.report import wandb as make_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

PAPER_CSV = ("table,model,policy,budget,block_size,row,column,metric,value,note\n"
             "1,llama-3.1-8b-instruct,keydiff,2k,128,,avg,score,44.33,\n"
             "1,llama-3.1-8b-instruct,keydiff,8k,128,,avg,score,49.03,\n"
             "1,llama-3.1-8b-instruct,snapkv,2k,128,,avg,score,39.6,\n")


def test_a_model_the_paper_csv_does_not_cover_gets_no_paper_table(tmp_path):
    (tmp_path / "table1.csv").write_text(PAPER_CSV)
    grid = make_report.load_grid("table1")
    shown = make_report.paper_table(grid, "llama-3.1-8b-instruct", tmp_path)
    assert "| keydiff | 128 | 44.33 | – | – | 49.03 |" in shown
    assert make_report.paper_table(grid, "llama-3.2-3b-instruct", tmp_path) is None


GOLDEN_RUNS = ROOT / "tests" / "golden" / "runs"


class RecordedRun:
    """Stands in for a wandb run (tracking opens it with wandb.init): keeps the config, history and summary."""

    def __init__(self, kwargs):
        self.config, self.history, self.summary = kwargs["config"], set(), {}

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, data, step=None):
        self.history |= set(data)

    def finish(self):
        pass


def logged(monkeypatch, tmp_path, run_dir: Path, **config) -> RecordedRun:
    """What keydiff.tracking logs to W&B for a recorded run directory, `config` replacing recorded keys."""
    wandb = pytest.importorskip("wandb")
    from omegaconf import OmegaConf

    from keydiff.run import tracking
    from keydiff.run.results import read_rows

    runs = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: runs.append(RecordedRun(kwargs)) or runs[-1])
    monkeypatch.setattr(wandb, "Table", lambda **kwargs: type("Table", (), {"data": [], "add_data": lambda *a: None})())
    monkeypatch.setenv("WANDB_MODE", "offline")
    summary = json.loads((run_dir / "summary.json").read_text())
    recorded = {**summary["config"], "results_root": str(tmp_path / "runs"), **config,  # not the checkout's
                "logger": {"wandb": True, "paper_dir": str(tmp_path)}}
    work = tmp_path / "run"
    work.mkdir(exist_ok=True)
    tracker = tracking.start(OmegaConf.create(recorded), work, read_rows(run_dir))
    tracker.finish(summary)
    return runs[0]


def flat_keys(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        out.update(flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def panel_reads(report) -> tuple[set, set, set]:
    """(summary keys, config keys, history keys) the report's panels and run-set filters read."""
    summary, config, history = set(), set(), set()
    for block in (b for b in report.blocks if hasattr(b, "panels")):
        for panel in block.panels:
            fields = [getattr(panel, f, None) for f in ("x", "y", "groupby")]
            fields += list(getattr(panel, "metrics", None) or [])
            for field in fields:
                for item in field if isinstance(field, list) else [field]:
                    kind = type(item).__name__
                    if kind == "SummaryMetric":
                        summary.add(item.name)
                    elif kind == "Config":
                        config.add(item.name)
                    elif isinstance(item, str) and item != "Step" and type(panel).__name__ == "LinePlot":
                        history.add(item)
        for runset in block.runsets:
            config |= {f.key.name for f in expr.expr_to_filters(runset.filters).filters}
    return summary, config, history


def test_every_panel_reads_a_key_that_tracking_logs(tmp_path, monkeypatch):
    """Each W&B key a panel, run-set filter or paper table reads is one keydiff.tracking logs for a real run."""
    smoke = GOLDEN_RUNS / "smoke/niah_small/smollm2-135m/keydiff/1k/bs128/seed0-limit2"
    (tmp_path / "table1.csv").write_text("table,model,policy,budget,block_size,row,column,column_kind,metric,value,"
                                         "samples,samples_total,note\n1,smollm2-135m,keydiff,1k,128,,avg,average,score,"
                                         "50.0,,,\n")
    run = logged(monkeypatch, tmp_path, smoke, experiment_name="table1")  # a table1 point: paper/score logged
    grid = make_report.Grid("table1", "table1", "", "niah_small", ["smollm2-135m"], ["keydiff"], ["keydiff"], ["1k"],
                            ["128"])
    report = make_report.build_report(grid, "", "keydiff-bench", tmp_path)
    summary, config, history = panel_reads(report)
    assert "paper/score" in summary and "running/score" in history  # the paper panels and the running panel exist
    assert summary <= set(run.summary), summary - set(run.summary)
    assert config <= set(flat_keys(run.config)), config - set(flat_keys(run.config))
    assert history <= run.history, history - run.history
    # The run set of a policy whose label is not its name (keydiff_w20 runs keydiff) selects this very run.
    windowed = GOLDEN_RUNS / "table4_gen4k/math500/deepseek-r1-distill-llama-8b/keydiff_w20/1k/bs128/seed0"
    run = logged(monkeypatch, tmp_path, windowed)
    grid = make_report.Grid("table4_gen4k", "table4_gen4k", "", "math500", ["deepseek-r1-distill-llama-8b"],
                            ["keydiff_w20"], ["keydiff"], ["1k"], ["128"])
    main = next(block for block in make_report.build_report(grid, "", "p", tmp_path / "absent").blocks
                if hasattr(block, "panels"))
    logged_config = flat_keys(run.config)
    for f in expr.expr_to_filters(main.runsets[0].filters).filters:
        assert str(logged_config[f.key.name]) == str(f.value), f.key.name

    # LongBench: one panel per dataset, reading metrics/datasets/<dataset>.
    longbench = GOLDEN_RUNS / "table11/longbench_full/llama-3.2-3b-instruct/keydiff/2k/bs128/seed0"
    run = logged(monkeypatch, tmp_path, longbench)
    grid = make_report.load_grid("table11")
    report = make_report.build_report(grid, "", "keydiff-bench", tmp_path / "absent")
    summary, _, _ = panel_reads(report)
    datasets = {key for key in summary if key.startswith("metrics/datasets/")}
    assert len(datasets) == 21 and datasets <= set(run.summary), datasets - set(run.summary)


def test_publish_needs_an_entity_and_credentials(tmp_path, monkeypatch, capsys):
    runs = ["--runs", str(tmp_path / "runs")]  # never the checkout's results/runs: the user's own runs
    with pytest.raises(SystemExit):
        make_report.main(["smoke", "--publish", *runs])
    assert "--publish needs --entity" in capsys.readouterr().err
    monkeypatch.setattr(make_report, "check_credentials", lambda: (_ for _ in ()).throw(SystemExit("no key")))
    with pytest.raises(SystemExit, match="no key"):
        make_report.main(["smoke", "--publish", "--entity", "someone", *runs])
    assert make_report.main(["smoke", "--paper", str(tmp_path), "--out", str(tmp_path / "reports"), *runs]) == 0
    assert capsys.readouterr().out.startswith("smoke: 4 panels, 2 policies, 0 runs -> ")
    assert json.loads((tmp_path / "reports" / "smoke.json").read_text())["title"] == "keydiff-bench: smoke"
    with pytest.raises(SystemExit):
        make_report.main(["table99", *runs])
    assert "valid: fig17_ttft_eager" in capsys.readouterr().err


def write_run(root: Path, experiment: str, task: str, policy: str, budget: str, block_size: int = 128) -> None:
    """A run directory as run.py leaves it when a run starts (run_config.json: the recorded configuration)."""
    run_dir = root / experiment / task / "smollm2-135m" / policy / budget / f"bs{block_size}" / "seed0"
    run_dir.mkdir(parents=True)
    config = {"model": {"name": "smollm2-135m"}, "policy": {"name": policy.split("_")[0], "label": policy},
              "budget": {"label": budget}, "block_size": block_size, "task": {"name": task}}
    (run_dir / "run_config.json").write_text(json.dumps(config))


def test_make_report_writes_one_specification_per_experiment_with_runs_adhoc_included(tmp_path, capsys):
    runs, out = tmp_path / "runs", tmp_path / "reports"
    for policy, budget in [("keydiff", "2k"), ("keydiff", "3000"), ("tova", "1k")]:
        write_run(runs, "adhoc", "niah_small", policy, budget)
    write_run(runs, "adhoc", "phonebook", "keydiff_w20", "2k", block_size=64)
    write_run(runs, "adhoc", "phonebook", "keydiff_w20", "2k", block_size=256)
    write_run(runs, "smoke", "niah_small", "keydiff", "1k")
    (runs / "empty_experiment").mkdir()  # no run in it: no report
    backup = runs / "smoke/niah_small/smollm2-135m/keydiff/1k/bs128/seed0.old-20260101-000000"
    backup.mkdir()  # a run moved aside by overwrite=true is not a run
    (backup / "run_config.json").write_text("{}")
    assert make_report.main(["--runs", str(runs), "--out", str(out), "--paper", str(tmp_path / "absent")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["adhoc__niah_small", "adhoc__phonebook", "smoke"]  # one line each
    assert sorted(path.name for path in out.iterdir()) == [
        "adhoc__niah_small.json", "adhoc__phonebook.json", "smoke.json"]

    niah = json.loads((out / "adhoc__niah_small.json").read_text())
    assert niah["runs"] == 3 and niah["title"] == "keydiff-bench: adhoc / niah_small"
    grid = niah["grid"]
    assert (grid["policies"], grid["budgets"], grid["block_sizes"]) == (
        ["keydiff", "tova"], ["1k", "2k", "3000"], ["128"])
    assert any("PanelGrid [keydiff, tova]: score vs budget" in line for line in niah["outline"])
    phonebook = json.loads((out / "adhoc__phonebook.json").read_text())
    assert (phonebook["grid"]["policies"], phonebook["grid"]["policy_names"]) == (["keydiff_w20"], ["keydiff"])
    assert phonebook["grid"]["block_sizes"] == ["64", "256"] and phonebook["runs"] == 2
    # The run sets of a grid read from runs select its task too (adhoc mixes tasks in one W&B group).
    adhoc = make_report.grids_from_runs("adhoc", make_report.recorded_configs(runs / "adhoc"))[0]
    report = make_report.build_report(adhoc, "", "keydiff-bench", tmp_path / "absent")
    main = next(block for block in report.blocks if hasattr(block, "panels"))
    filters = expr.expr_to_filters(main.runsets[0].filters).filters
    assert ("task.name", "niah_small") in {(f.key.name, f.value) for f in filters}
    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["runs"] == 1 and smoke["grid"]["policies"] == ["keydiff", "tova"]  # the experiment file's grid

    assert make_report.main(["--runs", str(tmp_path / "nothing"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("no runs under")
