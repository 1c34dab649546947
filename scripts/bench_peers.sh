#!/usr/bin/env bash
# Side by side with kvpress on identical random weights: kept-set parity, TTFT, decode, memory
# (`make bench-peers`; docs/performance.md#against-kvpress). Builds .venv-kvpress once.
#   scripts/bench_peers.sh [parity --length 512 | --help]
cd "$(dirname "$0")/.." && exec "${PYTHON:-python3}" -m keydiff.bench peers "$@"
