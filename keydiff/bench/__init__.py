"""Benchmarks and the GPU self-check. The benchmarks are cases of one runner: ``python -m keydiff.bench CASE``
(``make bench CASE=...``; ``python -m keydiff.bench.<case>`` runs the same).

    __main__      ``python -m keydiff.bench CASE [options]``
    runner        the cases' registry, the options they share (parsed once), the child process for memory peaks
    prefill       time to first token per policy, and the share spent scoring/evicting (``make bench``)
    decode        per-token decode time and allocations at N vs full (``make bench-decode``)
    scoring       the scoring step alone vs N and B, the paper's Tables 19 and 2 (``make bench-scoring``)
    throughput    decode tokens/s of many sequences at once, bounded vs full (``make bench-throughput``)
    batch_steps   decode step time at batch 1 and k, rows grouped or each alone
    fixed_step    the decoding step of full caches: ordinary, fixed-shape, compiled, against its floor
    floor         the least time any implementation could take for a decoding step on this device
    adaptive      head-adaptive budgets (AdaKV) against the uniform policy: memory and time per token
    long_prefill  prefill peak memory and time per prompt token from L = 4K to 128K under a fixed bound
    peers         side by side with kvpress: kept-position parity, then speed and memory (``make bench-peers``)
    peers_env     the separate kvpress environment (`.venv-kvpress`) it runs in
    peers_runner  one measurement of ``peers``, in a fresh process, for either project
    gpu_bench     every GPU row of the step's targets in one command (``make gpu-bench``)
    gpu_check     the machine, then the suite's device tests on it (``make gpu-check``)
    common        model shapes, device and memory helpers, the one timer, and the provenance record they all write

Every ``python -m keydiff.bench ...`` imports this package first, before the module imports torch: the one place
where the benchmarks' OpenMP settings can be set in time (keydiff.openmp).
"""

from keydiff import openmp

openmp.prepare("bench")
