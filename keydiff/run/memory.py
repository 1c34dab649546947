"""A run's peak memory (CUDA's max allocated, else this process's resident peak, VmHWM: not ru_maxrss, which
inherits a parent's peak), a reset of that peak, and the process's current size. No keydiff import and torch
only inside functions: keydiff.bench.peers_runner loads this file by path. Design: docs/design/runs.md#peak-memory
"""

from __future__ import annotations

import gc
import resource
import sys

VMHWM = "vmhwm"
RU_MAXRSS = "ru_maxrss"
CUDA_MAX_ALLOCATED = "cuda_max_allocated"


def peak_rss() -> tuple[int, str]:
    """(bytes, kind): this process's resident high-water mark, from VmHWM in /proc/self/status ("vmhwm"),
    else from ru_maxrss ("ru_maxrss") where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, VMHWM
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024), RU_MAXRSS


def peak_rss_bytes() -> int:
    """This process's own peak resident set size in bytes (peak_rss without the kind)."""
    return peak_rss()[0]


def reset_peak_rss() -> bool:
    """Restart the peak count from the current RSS (Linux: malloc_trim, then 5 to /proc/self/clear_refs resets
    VmHWM), so a later peak is what follows, not the model load. False where unsupported."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def current_rss_bytes() -> int | None:
    """Resident set size now (Linux /proc), or None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None


def reset_peak(device) -> bool:
    """Restart `device`'s peak count (CUDA: its allocator's peak statistics; CPU: reset_peak_rss), so that a later
    peak_memory covers what follows, not the model load. False where the CPU's cannot be reset."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return reset_peak_rss()


def peak_memory(device, devices: list | None = None) -> tuple[int, str]:
    """(bytes, kind): on CUDA the allocator's peak summed over `devices` (default: `device`), "cuda_max_allocated";
    on CPU this process's resident peak (peak_rss)."""
    import torch

    if torch.device(device).type == "cuda":
        return int(sum(torch.cuda.max_memory_allocated(d) for d in (devices or [device]))), CUDA_MAX_ALLOCATED
    return peak_rss()
