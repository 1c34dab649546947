#!/usr/bin/env bash
# The quick control for a recheck.sh result: run every test a plant failed (the node ids in its CAUGHT lines) on
# the code with no plant in, in one pytest call; all must pass, so each CAUGHT was the plant's doing.
#   bash docs/audit/plants/control.sh WORKTREE RESULTS.tsv
set -u
TREE="$(cd "${1:?usage: control.sh WORKTREE RESULTS.tsv}" && pwd)"
RESULTS="$(cd "$(dirname "${2:?}")" && pwd)/$(basename "$2")"
PYTHON="${PYTHON:-$TREE/.venv/bin/python}"
if ! git -C "$TREE" diff --quiet; then echo "the worktree has uncommitted changes: is a plant still in?" >&2; exit 2; fi
mapfile -t nodes < <(awk -F'\t' '$2 == "CAUGHT" {print $3}' "$RESULTS" | grep -o 'tests/[^ ]*' | sort -u)
echo "${#nodes[@]} tests"
cd "$TREE" && OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -p no:randomly -p no:cacheprovider "${nodes[@]}" < /dev/null
