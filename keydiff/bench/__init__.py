"""Benchmarks and the GPU self-check, each runnable as ``python -m keydiff.bench.<module>``.

* ``prefill``: time to first token per policy, and the share spent scoring/evicting (``make bench``).
* ``decode``: per-token decode time and allocations at N vs full (``make bench-decode``).
* ``scoring``: the scoring step alone vs N and B, the paper's Tables 19 and 2 (``make bench-scoring``).
* ``gpu_check``: engine exactness per attention kernel, then both benchmarks (``make gpu-check``).
* ``common``: model shapes, device and memory helpers, and the provenance record they all write.

Every ``python -m keydiff.bench.<module>`` imports this package first, before the module imports torch:
the one place where the benchmarks' OpenMP settings can be set in time (keydiff.openmp).
"""

from keydiff import openmp

openmp.prepare("bench")
