#!/usr/bin/env bash
# CPU speed of two commits, before and after a change, on one quiet machine (2 threads, taskset -c 0,1): each commit
# runs from its own `git archive` tree with this checkout's venv. kvpress at 16K (ours block-wise in the order
# before, after, after, before; kvpress's pipeline call twice), then decode, fixed_step and throughput in the order
# before, after, after, before, before, after, after, before. Results: JSON and logs in OUT.
#
#   BASE=412b1a4 AFTER=HEAD OUT=/tmp/before_after bash docs/audit/before_after.sh
#
# Run it with nothing else running (docs/performance.md: two torch processes slow each other 10x on 2 cores).
# Commits before the bench runner read the old module paths (keydiff.bench.peers); both are handled.
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BASE=$(git -C "$REPO" rev-parse --short "${BASE:?set BASE}"); AFTER=$(git -C "$REPO" rev-parse --short "${AFTER:-HEAD}")
OUT=${OUT:-/tmp/before_after}; PY=${PYTHON:-$REPO/.venv/bin/python}
mkdir -p "$OUT"
for c in $BASE $AFTER; do [ -d "$OUT/tree-$c/keydiff" ] || { mkdir -p "$OUT/tree-$c" && git -C "$REPO" archive $c | tar -x -C "$OUT/tree-$c"; }; done
run() (c=$1; shift; cd "$OUT/tree-$c" && taskset -c 0,1 "$PY" -m "$@")
peers() { c=$1; shift; if [ -f "$OUT/tree-$c/keydiff/bench/__main__.py" ]; then m="keydiff.bench peers"; else m=keydiff.bench.peers; fi
  run $c $m perf --lengths 16384 --rounds 1 --threads 2 --env "$REPO/.venv-kvpress" "$@"; }
i=0
for c in $BASE $AFTER $AFTER $BASE; do
  i=$((i+1))
  peers $c --cases keydiff_blockwise --json "$OUT/peers-$i-$c.json" > "$OUT/peers-$i-$c.log" 2>&1; echo "peers $i $c rc=$?"
  if [ $i = 2 ] || [ $i = 4 ]; then
    peers $AFTER --cases kvpress_keydiff --json "$OUT/peers-kv-$i.json" > "$OUT/peers-kv-$i.log" 2>&1; echo "kvpress $i rc=$?"
  fi
done
i=0
for c in $BASE $AFTER $AFTER $BASE $BASE $AFTER $AFTER $BASE; do
  i=$((i+1))
  run $c keydiff.bench.decode --model random-smollm2 --threads 2 --repeats 3 --length 1024 --budget 256 --new-tokens 32 \
    --policies full,keydiff --json "$OUT/decode-$i-$c.json" > "$OUT/decode-$i-$c.log" 2>&1
  run $c keydiff.bench.fixed_step --model random-smollm2 --threads 2 --length 1024 --budget 256 --widths 1,8 --steps 16 \
    --repeats 3 --json "$OUT/fixed-$i-$c.json" > "$OUT/fixed-$i-$c.log" 2>&1
  run $c keydiff.bench.throughput --threads 2 --repeats 1 --length 1024 --budget 256 --new-tokens 16 --batches 1,8 \
    --policies full,keydiff --no-transformers --json "$OUT/tput-$i-$c.json" > "$OUT/tput-$i-$c.log" 2>&1
  echo "round $i $c done $(date +%T)"
done
