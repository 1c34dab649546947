"""The Triton kernels' launches (keydiff.kernels.launch): grids within CUDA's limits whatever the batch, and every
launch bound to its tensors' device. No triton or GPU needed (the kernels: tests/test_batch_invariant.py)."""

from __future__ import annotations

import ast
import contextlib
import re
from pathlib import Path

import pytest
import torch

from keydiff.kernels import launch

pytestmark = pytest.mark.unit

KERNELS = Path(launch.__file__).with_name("triton_kernels.py")
# triton_kernels.MATMUL_BLOCK_M, MATMUL_BLOCK_N, read from its source (no triton)
MATMUL_BLOCKS = tuple(map(int, re.search(r"MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K = (\d+), (\d+),",
                                         KERNELS.read_text(encoding="utf-8")).groups()))


@pytest.mark.parametrize("width, layers, kv_heads", [(256, 32, 8), (512, 28, 8), (1, 28, 8)])
def test_keydiffs_batched_products_launch_within_cudas_grid_limits(width, layers, kv_heads):
    """W x layers x KV heads matrices: 65,536 at W = 256, 32 layers, 8 KV heads, past CUDA's 65,535 on axes 1 and 2."""
    matrices = width * layers * kv_heads
    for rows, cols in ((1, 128), (1, 1025), (1025, 1)):  # the anchor [1, n] @ [n, d], the dots [n, d] @ [d, 1]
        grid = launch.matmul_grid(rows, cols, matrices, *MATMUL_BLOCKS)
        assert all(size <= limit for size, limit in zip(grid[1:], launch.GRID_LIMITS[1:])), grid
        assert grid[0] <= launch.GRID_LIMITS[0]
        tiles = launch.cdiv(rows, MATMUL_BLOCKS[0]) * launch.cdiv(cols, MATMUL_BLOCKS[1])
        assert grid[0] == tiles * matrices  # every (matrix, tile) gets one program


def test_a_grid_past_the_limits_is_refused_in_one_line():
    with pytest.raises(ValueError, match="exceeds CUDA's limit of 65535 programs on axis 1"):
        launch.attention_grid(1, 1, 70_000)
    with pytest.raises(ValueError, match="on axis 0"):
        launch.matmul_grid(2**16, 2**16, 2**10, *MATMUL_BLOCKS)
    assert launch.attention_grid(128, 1, 32) == (128, 32)


def test_the_matmul_kernel_reads_its_matrix_and_tile_from_the_first_axis_alone():
    """The kernel's side of matmul_grid: program = matrix x tiles + tile, no second axis."""
    source = KERNELS.read_text(encoding="utf-8")
    kernel = source[source.index("def _matmul_kernel"):source.index("def matmul(")]
    assert "tl.program_id(1)" not in kernel
    assert "tile = program % tiles" in kernel and "matrix = (program // tiles)" in kernel


def launches(tree: ast.AST) -> list[tuple[ast.Call, list[ast.With]]]:
    """Every `kernel[grid](...)` call of a module with the `with` blocks around it."""
    found = []

    def visit(node: ast.AST, withs: list) -> None:
        for child in ast.iter_child_nodes(node):
            inner = withs + [child] if isinstance(child, ast.With) else withs
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Subscript):
                found.append((child, inner))
            visit(child, inner)

    visit(tree, [])
    return found


def test_every_kernel_launch_is_bound_to_its_tensors_device():
    """Triton launches on the current device unless the launch runs under the tensors' (launch.on_device)."""
    found = launches(ast.parse(KERNELS.read_text(encoding="utf-8")))
    assert len(found) == 3  # matmul, row sums, attention
    for call, withs in found:
        guards = [item.context_expr for w in withs for item in w.items]
        assert any(isinstance(g, ast.Call) and ast.unparse(g.func) == "launch.on_device" for g in guards), \
            ast.unparse(call)[:60]
        grid = call.func.slice
        assert isinstance(grid, ast.Call) and ast.unparse(grid.func).startswith("launch."), ast.unparse(grid)


def test_on_device_names_the_tensors_cuda_device():
    guard = launch.on_device(torch.device("cuda:1"))  # constructing it initialises nothing
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(launch.on_device(torch.zeros(1)), contextlib.nullcontext)
