"""What every layer needs of a device: wait for its kernels, give freed memory back, and tell running out of
memory from any other error. Torch only and no keydiff import, so the decoding core, the runner and the
benchmarks share one copy (keydiff.bench.peers_runner loads this file by path in kvpress's environment)."""

from __future__ import annotations

import gc

import torch


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: torch.device | str) -> None:
    """Wait for the device, so that a timing covers the kernels, not only their launch."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def release_memory(device: torch.device | str | None = None) -> None:
    """Drop freed tensors and return the CUDA allocator's cached blocks (on `device`'s kind; None: wherever CUDA
    is available). Never inside a timed loop: it would time the allocator."""
    gc.collect()
    if torch.cuda.is_available() if device is None else is_cuda(device):
        torch.cuda.empty_cache()


def out_of_memory(error: BaseException | None) -> bool:
    """Whether an error, or one it was raised from or while handling, is running out of memory: CUDA's OOM, a
    MemoryError, or an allocator's RuntimeError (CPU, MPS, HIP; a failed capture's CUDA error has it as context)."""
    while error is not None:
        if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
            return True
        text = str(error).lower()
        if isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text):
            return True
        error = error.__cause__ or error.__context__
    return False
