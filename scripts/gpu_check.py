#!/usr/bin/env python3
"""Run first on a new (GPU) machine: the environment, then the test suite's device tests on it (engine exactness
per attention kernel; what `make gpu-check` runs; docs/gpu.md).

    python scripts/gpu_check.py [--help for the options]
"""

import sys

from keydiff.bench import gpu_check

if __name__ == "__main__":
    sys.exit(gpu_check.main())
