#!/usr/bin/env bash
# Submit a paper experiment as one SLURM array and say whether it was submitted (`make sweep-slurm`;
# docs/cluster.md). Runs from the repository root, where results/ and run.py are.
#   scripts/sweep_slurm.sh table1 [--only-missing] [--dry-run] [override ...]
cd "$(dirname "$0")/.." && exec "${PYTHON:-python3}" -m keydiff.run.submit "$@"
