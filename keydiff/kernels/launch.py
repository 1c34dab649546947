"""How the Triton kernels of keydiff.kernels.triton_kernels are launched: their grids, within CUDA's limits, and
the device each launch is bound to. Plain Python (no triton), so that a machine without a GPU or triton checks it.

Grids. CUDA allows 2^31 - 1 programs along a grid's first axis and 65,535 along the second and third. A batched
matmul has one program per output tile and per matrix, and KeyDiff's batched products under batch_invariant have
W x layers x KV heads matrices (65,536 at W = 256 on a 32-layer model with 8 KV heads), so the matmul puts tiles
and matrices together on the first axis (program = matrix x tiles + tile). Attention keeps the query heads on the
second axis (a model has far fewer than 65,535). `check_grid` refuses a grid past the limits in one line rather
than letting CUDA fail at launch.

Device. Triton launches on the current CUDA device's current stream, and a model may live on another device than
the current one (model.device=cuda:1 with nothing calling set_device); every launch runs inside `on_device(x)`, the
device of the tensors it reads.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

GRID_LIMITS = (2**31 - 1, 65_535, 65_535)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_grid(grid: tuple[int, ...]) -> tuple[int, ...]:
    """The grid, if every axis is within CUDA's limits; a ValueError naming the axis otherwise."""
    for axis, (size, limit) in enumerate(zip(grid, GRID_LIMITS)):
        if size > limit:
            raise ValueError(f"a kernel grid of {grid} exceeds CUDA's limit of {limit} programs on axis {axis}")
    return grid


def matmul_grid(rows: int, cols: int, matrices: int, block_m: int, block_n: int) -> tuple[int]:
    """One program per (matrix, output tile), all on the first axis: program = matrix x tiles + tile."""
    return check_grid((cdiv(rows, block_m) * cdiv(cols, block_n) * matrices,))


def row_grid(rows: int) -> tuple[int]:
    """One program per row."""
    return check_grid((rows,))


def attention_grid(batch: int, q_len: int, heads: int) -> tuple[int, int]:
    """One program per (batch row, query row) on the first axis and per query head on the second."""
    return check_grid((batch * q_len, heads))


def on_device(tensor: torch.Tensor | torch.device) -> Any:
    """The context a launch on `tensor`'s device runs in: that CUDA device made current (a no-op elsewhere)."""
    device = tensor.device if isinstance(tensor, torch.Tensor) else torch.device(tensor)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
