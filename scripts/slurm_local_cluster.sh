#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (root; apt-get install -y slurm-wlm munge): start is idempotent
# and exits 0 once the node is idle, else says in one line why not (docs/cluster.md; used by .ci/run).
#   scripts/slurm_local_cluster.sh [start | status | stop]
cd "$(dirname "$0")/.." && exec "${PYTHON:-python3}" -m keydiff.run.local_slurm "$@"
