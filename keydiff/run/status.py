"""Where every grid point of an experiment stands: complete / partial (n of m) / failed samples / not started.

    python -m keydiff.run.status table1                 # or: make status EXP=table1
    python -m keydiff.run.status smoke results_root=/scratch/me/runs policy=keydiff,tova

The grid is keydiff.grids' (as run.py's sweeper expands it); shards (`shard=i/n`) show which are complete,
missing or merged. Resubmitting what is not complete, and shards: docs/cluster.md.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

import keydiff  # noqa: F401  (config resolvers)
from keydiff.cli import ArgumentParser, exit_with_error
from keydiff.grids import CONF, experiment_grid, experiments
from keydiff.run.checks import check_command_line, describe_error, drop_whole_task_limit
from keydiff.run.results import run_dir_of
from keydiff.run.sweep import PointStatus, expand_shards, point_status, sample_ids


def experiment_status(experiment: str, overrides: list[str]) -> list[tuple[list[str], Path, PointStatus]]:
    """Every grid point of `experiment` (plus `overrides`; keydiff.grids): its overrides, run directory and status."""
    points = experiment_grid(experiment, expand_shards(overrides))
    result = []
    with initialize_config_dir(str(CONF), version_base="1.3"):
        for point in points:
            cfg = compose("config", overrides=point)
            drop_whole_task_limit(cfg)  # a limit covering the whole task runs into the whole run's directory
            run_dir = run_dir_of(cfg)
            result.append((point, run_dir, point_status(run_dir, sample_ids(cfg))))
    return result


def main(argv: list[str] | None = None) -> int:
    # A status query never downloads data: unknown totals show as "?" (set before huggingface_hub is imported).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = ArgumentParser(prog="python -m keydiff.run.status", description=__doc__.splitlines()[0])
    parser.add_argument("experiment", nargs="?", help="conf/experiment/<name>.yaml")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, as given to run.py")
    args = parser.parse_args(argv)
    if not args.experiment:
        exit_with_error(f"which experiment? make status EXP=<name> (python -m keydiff.run.status <name>); "
                        f"valid: {', '.join(experiments())}")
    # the command line as run.py checks it: an unknown experiment or key is one line naming the valid ones
    check_command_line(["-m", f"experiment={args.experiment}", *args.overrides], CONF)
    try:
        rows = experiment_status(args.experiment, args.overrides)
    except (HydraException, ValueError) as error:
        exit_with_error(describe_error(error))
    axes = [o.split("=", 1)[0] for o in rows[0][0]] if rows else []
    varying = {key for i, key in enumerate(axes) if len({tuple(r[0])[i] for r in rows}) > 1}
    width = max((len(" ".join(o for o in p if o.split("=", 1)[0] in varying)) for p, _, _ in rows), default=10)
    print(f"experiment {args.experiment}: {len(rows)} grid point(s)")
    for point, run_dir, status in rows:
        label = " ".join(o for o in point if o.split("=", 1)[0] in varying) or " ".join(point)
        print(f"  {label:<{width}}  {status.describe():<28}  {run_dir}")
    counts = Counter(status.state for _, _, status in rows)
    print("total: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
