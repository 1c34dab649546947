"""One W&B report per experiment (conf/experiment/*.yaml), built with wandb-workspaces from the same configs
that define the sweeps, so a dashboard always shows the grid that was run.

Per model of the grid, one panel grid whose run sets are the experiment's policies (found by the config
keydiff/run/tracking.py logs); the panels and the files written: docs/wandb.md. Building needs no network or
account; `--publish` saves to W&B. Each specification goes to `results/reports/<experiment>[__<task>].json`.

    python -m keydiff.report.wandb                          # every experiment with runs (adhoc included)
    python -m keydiff.report.wandb table1 --publish --entity ME [--project keydiff-bench]

Which paper table an experiment is compared with, and how policies are named: keydiff/paper/registry.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from keydiff.config import budget_label
from keydiff.extras import MissingExtra, require
from keydiff.grids import experiment_grid, experiments, grid_axes
from keydiff.paper.reference import paper_values, read_tables
from keydiff.paper.registry import table_numbers
from keydiff.report.render import budget_tokens, plural
from keydiff.cli import ArgumentParser, exit_with_error
from keydiff.run.results import is_moved_aside
from keydiff.run.shards import is_shard_dir
from keydiff.run.tracking import headline

ROOT = Path(__file__).resolve().parents[2]
WHAT = "python -m keydiff.report.wandb (W&B report specifications)"

CONF = ROOT / "conf"


@dataclass
class Grid:
    """What one experiment file sweeps (after Hydra composes it with the base config)."""

    stem: str                 # conf/experiment/<stem>.yaml
    experiment: str           # experiment_name: the W&B group
    description: str          # the file's first comment line
    task: str
    models: list[str]
    policies: list[str]       # policy labels, as logged in config policy.label
    policy_names: list[str]   # the policies' names (keydiff for keydiff_w20)
    budgets: list[str]        # budget labels (2k, 4k, ...)
    block_sizes: list[str]
    datasets: list[str] = field(default_factory=list)  # LongBench datasets of the task, [] otherwise
    by_task: bool = False     # a grid read from runs: one report per task, run sets filtered by task.name
    runs: int = 0             # run directories found under the results root

    @property
    def command(self) -> str:
        if self.by_task:
            return f"python run.py experiment_name={self.experiment} task={self.task} ..."
        return f"python run.py experiment={self.stem}"

    @property
    def name(self) -> str:
        """The report's file name (without .json) and title suffix."""
        return f"{self.experiment}__{self.task}" if self.by_task else self.experiment


def load_grid(stem: str) -> Grid:
    """conf/experiment/<stem>.yaml's sweep axes (keydiff.grids) and its composed config (offline, nothing is run)."""
    from hydra import compose, initialize_config_dir

    axes = grid_axes(experiment_grid(stem))
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={stem}"], return_hydra_config=True)

        def composed(group: str, choice: str):
            """A preset as the runner gets it: composed with its `defaults:` (adakv_keydiff extends keydiff)."""
            return compose("config", overrides=[f"experiment={stem}", f"{group}={choice}"])[group]

        policy_files = [composed("policy", p) for p in axes["policy"]] if "policy" in axes else [cfg.policy]
        files = [composed("budget", b) for b in axes.get("budget", [])]
    budgets = [budget_label(f.tokens, f.get("ratio")) for f in files] if files else [str(cfg.budget.label)]  # r0.25 too
    text = (CONF / "experiment" / f"{stem}.yaml").read_text(encoding="utf-8").splitlines()
    comments = [line.lstrip("# ").strip() for line in text if line.startswith("#") and "@package" not in line]
    task = str(cfg.task.name)
    datasets = list(cfg.task.get("datasets") or []) if task.startswith("longbench") else []
    return Grid(stem, str(cfg.experiment_name), comments[0] if comments else stem, task,
                axes.get("model") or [str(cfg.model.name)], [str(p.label) for p in policy_files],
                [str(p.name) for p in policy_files], budgets,
                axes.get("block_size") or [str(cfg.block_size)], datasets)


def experiment_stems() -> list[str]:
    return experiments()


def recorded_configs(experiment_dir: Path) -> list[dict[str, Any]]:
    """The configurations the runs of one experiment recorded (run_config.json, written when a run starts);
    hidden folders (.submitit), runs moved aside by overwrite=true (`<dir>.old-<time>`) are not runs, and a sharded grid point is one."""
    configs, points = [], set()
    for path in sorted(experiment_dir.rglob("run_config.json")):
        parts = path.relative_to(experiment_dir).parts
        if any(part.startswith(".") for part in parts) or is_moved_aside(path.parent, experiment_dir):
            continue
        # A shard (keydiff.run.shards) records its grid point's configuration: one per point.
        point = path.parent.parent.parent if is_shard_dir(path.parent) else path.parent
        if point in points:
            continue
        points.add(point)
        try:
            configs.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # a run being rewritten right now; the next report has it
    return configs


def grids_from_runs(experiment: str, configs: list[dict[str, Any]]) -> list[Grid]:
    """Grids of an experiment that no conf/experiment file describes (`adhoc`): what its runs recorded,
    one grid per task."""
    def unique(values) -> list[str]:
        return sorted({str(value) for value in values if value is not None})

    grids = []
    for task in unique(config.get("task", {}).get("name") for config in configs):
        runs = [config for config in configs if config.get("task", {}).get("name") == task]
        policies = {str(c["policy"].get("label", c["policy"].get("name"))): str(c["policy"].get("name")) for c in runs}
        datasets = unique(d for c in runs for d in (c["task"].get("datasets") or [])) if task.startswith("longbench") else []
        grids.append(Grid(
            stem=experiment, experiment=experiment, task=task, by_task=True, runs=len(runs),
            description=f"Runs of experiment_name={experiment} on {task}, as recorded in their run directories",
            models=unique(c.get("model", {}).get("name") for c in runs), policies=sorted(policies),
            policy_names=[policies[label] for label in sorted(policies)],
            budgets=sorted(unique(c.get("budget", {}).get("label") for c in runs), key=budget_tokens),
            block_sizes=sorted(unique(c.get("block_size") for c in runs), key=budget_tokens), datasets=datasets))
    return grids


def experiments_with_runs(runs_root: Path) -> list[str]:
    if not runs_root.is_dir():
        return []
    return sorted(path.name for path in runs_root.iterdir()
                  if path.is_dir() and not path.name.startswith(".") and recorded_configs(path))


def report_grids(names: list[str], runs_root: Path) -> list[Grid]:
    """The grid of each named experiment: its conf/experiment file, else what its runs recorded."""
    stems = set(experiment_stems())
    grids = []
    for name in names:
        configs = recorded_configs(runs_root / name)
        if name in stems:
            grid = load_grid(name)
            grid.runs = len(configs)
            grids.append(grid)
        else:
            grids.extend(grids_from_runs(name, configs))
    return grids


def paper_table(grid: Grid, model: str, paper_dir: Path) -> str | None:
    """The paper's headline value per policy x budget (block size) as Markdown, or None without any."""
    tables = table_numbers(grid.experiment)
    rows = read_tables(paper_dir, tables)
    if not rows:
        return None
    lines = []
    for policy, name in zip(grid.policies, grid.policy_names):
        for block in grid.block_sizes:
            cells = [paper_values(rows, model=model, policy=policy, policy_name=name, budget_label=b, block_size=block,
                                  experiment_name=grid.experiment, primary=headline(grid.task)[1]).get("score")
                     for b in grid.budgets]
            if any(cell is not None for cell in cells):
                shown = " | ".join("–" if cell is None else f"{cell:g}" for cell in cells)
                lines.append(f"| {policy} | {block} | {shown} |")
    if not lines:
        return None
    header = f"| policy | block | {' | '.join(grid.budgets)} |\n|---|---|{'---|' * len(grid.budgets)}"
    return (f"The paper's {headline(grid.task)[1]} (Table {'/'.join(tables)}; logged on each run as `paper/score`):"
            "\n\n" + header + "\n" + "\n".join(lines))


def runsets(grid: Grid, entity: str, project: str, model: str | None):
    """One run set per policy, selected by the config keys keydiff/run/tracking.py logs."""
    wr, expr = reports_api(), require("report", "wandb_workspaces.expr", WHAT)

    sets = []
    for policy in grid.policies:
        filters = [expr.Config("experiment_name") == grid.experiment, expr.Config("policy.label") == policy]
        if model is not None:
            filters.insert(1, expr.Config("model.name") == model)
        if grid.by_task:
            filters.insert(1, expr.Config("task.name") == grid.task)
        sets.append(wr.Runset(entity=entity, project=project, name=policy, filters=expr.And(*filters)))
    return sets


def reports_api():
    """wandb_workspaces' report model (the 'report' extra; MissingExtra without it)."""
    return require("report", "wandb_workspaces.reports.v2", WHAT)


def main_panels(with_paper: bool) -> list:
    wr = reports_api()

    budget, score, paper = wr.Config("budget.tokens"), wr.SummaryMetric("score"), wr.SummaryMetric("paper/score")
    panels = [wr.ScatterPlot(title="score vs budget", x=budget, y=score)]
    if with_paper:
        panels += [
            wr.ScatterPlot(title="paper: score vs budget", x=budget, y=paper),
            wr.ScatterPlot(title="ours vs paper (diagonal = reproduced)", x=paper, y=score),
            wr.BarPlot(title="score and paper score, per budget", metrics=[score, paper],
                       groupby=wr.Config("budget.label")),
        ]
    panels += [
        wr.ScatterPlot(title="TTFT vs block size", x=wr.Config("block_size"), y=wr.SummaryMetric("statistics/mean_ttft_s")),
        wr.ScatterPlot(title="kept ratio vs budget", x=budget, y=wr.SummaryMetric("statistics/mean_kept_ratio")),
        wr.LinePlot(title="running score (per written row)", x="Step", y=["running/score"]),
    ]
    return panels


def build_report(grid: Grid, entity: str, project: str, paper_dir: Path):
    """The wandb_workspaces Report of one experiment (nothing is sent anywhere)."""
    wr = reports_api()

    intro = (f"{grid.description}\n\nReproduce: `{grid.command}` with `logger=wandb`. Task `{grid.task}`; "
             f"models {', '.join(grid.models)}; policies {', '.join(grid.policies)}; budgets "
             f"{', '.join(grid.budgets)}; block sizes {', '.join(grid.block_sizes)}. Each point is one run "
             f"(W&B group `{grid.experiment}`); `score` is the task's {headline(grid.task)[1]}.")
    blocks = [wr.TableOfContents(), wr.MarkdownBlock(text=intro)]
    for model in grid.models:
        reference = paper_table(grid, model, paper_dir)
        blocks.append(wr.H1(text=model))
        if reference:
            blocks.append(wr.MarkdownBlock(text=reference))
        blocks.append(wr.PanelGrid(runsets=runsets(grid, entity, project, model),
                                   panels=main_panels(with_paper=reference is not None)))
        if grid.datasets:
            blocks.append(wr.H2(text=f"{model}: per dataset"))
            blocks.append(wr.PanelGrid(runsets=runsets(grid, entity, project, model), panels=[
                wr.ScatterPlot(title=f"{dataset}: score vs budget", x=wr.Config("budget.tokens"),
                               y=wr.SummaryMetric(f"metrics/datasets/{dataset}"))
                for dataset in grid.datasets]))
    title = f"keydiff-bench: {grid.experiment}" + (f" / {grid.task}" if grid.by_task else "")
    return wr.Report(entity=entity, project=project, title=title[:128],
                     description=grid.description, blocks=blocks, width="fluid")


def outline(report) -> list[str]:
    """Readable summary of a report: its blocks and the panel titles of each grid."""
    lines = [f"{report.title}"]
    for block in report.blocks:
        name = type(block).__name__
        if hasattr(block, "panels"):
            lines.append(f"  {name} [{', '.join(rs.name for rs in block.runsets)}]: "
                         + "; ".join(panel.title for panel in block.panels))
        elif getattr(block, "text", None):
            lines.append(f"  {name}: {str(block.text).splitlines()[0][:90]}")
        else:
            lines.append(f"  {name}")
    return lines


def check_credentials() -> None:
    wandb = require("report", "wandb", f"{WHAT} --publish")
    if not wandb.login(prompt=False, verify=False):
        raise SystemExit("--publish needs W&B credentials: run `wandb login` or set WANDB_API_KEY "
                         "(building without --publish needs none).")


def write_specification(grid: Grid, report, out_dir: Path) -> Path:
    """results/reports/<name>.json: the grid, the outline and the W&B report model (what --publish saves)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{grid.name}.json"
    model = report._to_model()
    spec = {"report": grid.name, "title": report.title, "command": grid.command, "runs": grid.runs,
            "grid": asdict(grid), "outline": outline(report),
            "wandb_report": json.loads(model.model_dump_json() if hasattr(model, "model_dump_json") else model.json())}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="*",
                        help="experiments (conf/experiment stems or experiment_name of runs; default: every one with runs)")
    parser.add_argument("--entity", default="", help="W&B entity (user or team) that owns the project")
    parser.add_argument("--project", default="keydiff-bench")
    parser.add_argument("--paper", type=Path, default=ROOT / "results" / "paper", help="the paper's numbers (CSV)")
    parser.add_argument("--runs", type=Path, default=ROOT / "results" / "runs", help="the results root (run directories)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "reports", help="where the specifications go")
    parser.add_argument("--publish", action="store_true", help="save the reports to W&B (needs credentials)")
    args = parser.parse_args(argv)
    try:  # the extra first: one line and exit status 2, before any file is read or written
        reports_api()
        if args.publish:
            require("report", "wandb", f"{WHAT} --publish")
    except MissingExtra as error:
        exit_with_error(str(error))
    with_runs = experiments_with_runs(args.runs)
    names = args.experiments or with_runs
    unknown = sorted(set(names) - set(experiment_stems()) - set(with_runs))
    if unknown:
        parser.error(f"unknown experiment(s) {', '.join(unknown)}; valid: {', '.join(experiment_stems())}, "
                     f"or one with runs under {args.runs}: {', '.join(with_runs) or 'none yet'}")
    if not names:
        print(f"no runs under {args.runs}: nothing to report (name experiments to build their reports anyway)")
        return 0
    if args.publish:
        if not args.entity:
            parser.error("--publish needs --entity (your W&B user or team name)")
        check_credentials()
    for grid in report_grids(names, args.runs):
        report = build_report(grid, args.entity, args.project, args.paper)
        path = write_specification(grid, report, args.out)
        panels = sum(len(block.panels) for block in report.blocks if hasattr(block, "panels"))
        saved = ""
        if args.publish:
            report.save()
            saved = f"; saved: {report.url}"
        print(f"{grid.name}: {plural(panels, 'panel')}, {plural(len(grid.policies), 'policy')}, {plural(grid.runs, 'run')} "
              f"-> {path}{saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
