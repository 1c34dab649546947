"""How the Triton kernels of keydiff.kernels.triton_kernels are launched: grids within CUDA's limits (`check_grid`)
and each launch bound to its tensors' device (`on_device`). Plain Python, checked without a GPU.
Design: docs/design/decode.md#batch-invariant-kernels-keydiffkernels"""

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
