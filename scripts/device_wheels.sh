#!/usr/bin/env bash
# Wheels the lent GPU machine lacks (it has torch 2.11+cu130, transformers 5.17 and no network), into .whl/
# (git-ignored): transformers 5.24 (models take `cache=`), omegaconf and hydra-core (keydiff.config's resolvers,
# the run configs), antlr4-python3-runtime 4.9.3 (omegaconf's parser; an sdist, so built into a wheel here), and
# pytest with what it imports (pluggy, iniconfig, packaging, pygments): `make gpu-check` is the suite's device
# tests. The machine runs Python 3.12. Then, with the device tool (carry [".whl"]), one call per command, as
# docs/contributing.md says (gpu_check, then gpu_bench):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
#     && timeout 500 python3 -m keydiff.bench.gpu_check --device cuda --deadline 420 --json $OUT/gpu_check.json
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  echo "usage: bash scripts/device_wheels.sh   # builds .whl/ for the GPU machine; then docs/contributing.md's command there"
  exit 0
fi
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl transformers==5.24.0 omegaconf==2.3.0 hydra-core==1.3.2 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -l .whl
