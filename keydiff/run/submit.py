"""Submit an experiment to SLURM and say whether the submission worked (`make sweep-slurm EXP=...`): checks the
grid, starts submitit detached and waits for its job id. Exit 0 with the job id, 2 for a configuration
error, 1 when the submission failed.

    python -m keydiff.run.submit table1 [--only-missing] [--dry-run] [--log PATH] [override ...]

Design: docs/design/runs.md#submitting-to-slurm
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ERROR_LINE = re.compile(r"^(error: |[\w.]*(Error|Exception)\b)")


def sweep_dir(experiment: str, overrides: list[str]) -> Path:
    """The sweep's directory (`hydra.sweep.dir`, results_root/experiment_name), composed as run.py would."""
    from hydra import compose, initialize_config_dir

    import keydiff  # noqa: F401  (the configs' resolvers)

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}", "hydra/launcher=slurm", *overrides],
                      return_hydra_config=True)
    return Path(str(cfg.hydra.sweep.dir))


def submitted_jobs(folder: Path, since: float) -> list[str]:
    """Job ids submitit recorded as submitted (one pickle per array task) since `since`."""
    found = [path for path in folder.glob("*/*_submitted.pkl") if path.stat().st_mtime >= since]
    return sorted({path.name[: -len("_submitted.pkl")] for path in found})


def last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return (errors or lines or ["(the log is empty)"])[-1]


def submit(experiment: str, overrides: list[str], log: Path, only_missing: bool = False, dry_run: bool = False,
           poll_s: float = 0.5) -> int:
    command = [sys.executable, str(ROOT / "run.py"), f"experiment={experiment}", "hydra/launcher=slurm",
               *(["only_missing=true"] if only_missing else []), *overrides]
    if dry_run:
        return subprocess.run([*command, "dry_run=true"]).returncode
    check = subprocess.run([*command, "dry_run=true", "hydra.sweeper.dry_run_needs_partition=true"],
                           stdout=subprocess.DEVNULL)
    if check.returncode != 0:  # its stderr already said why, in one line
        return check.returncode
    folder = sweep_dir(experiment, overrides) / ".submitit"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time() - 1
    with open(log, "w") as output:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    while True:
        jobs = submitted_jobs(folder, start)
        if jobs:
            arrays = sorted({job.split("_")[0] for job in jobs})
            print(f"submitted SLURM job {', '.join(arrays)} ({len(jobs)} task(s)); the submitting process "
                  f"(pid {child.pid}) waits for it: see {log}")
            return 0
        code = child.poll()
        if code == 0:
            print(f"nothing submitted: every grid point is complete (log: {log})")
            return 0
        if code is not None:
            print(f"error: the SLURM submission failed (exit status {code}): {last_error(log)} (log: {log})",
                  file=sys.stderr)
            return 1
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keydiff.run.submit", description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", help="a conf/experiment/ name, e.g. table1")
    parser.add_argument("overrides", nargs="*", help="run.py overrides, e.g. hydra.launcher.partition=gpu")
    parser.add_argument("--only-missing", action="store_true", help="submit only grid points that are not complete")
    parser.add_argument("--dry-run", action="store_true", help="print the grid and the sbatch script; submit nothing")
    parser.add_argument("--log", type=Path, help="the submitting process's log (default results/sweep-EXP.log)")
    args = parser.parse_intermixed_args(argv)
    log = args.log or Path("results") / f"sweep-{args.experiment}.log"
    return submit(args.experiment, args.overrides, log, args.only_missing, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
