"""The Triton kernels' launches (keydiff.kernels.launch): a grid past CUDA's limits refused, the device guard. No
triton or GPU needed (the kernels: tests/test_batch_invariant.py)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch

from keydiff.kernels import launch

pytestmark = pytest.mark.unit

# triton_kernels.MATMUL_BLOCK_M, MATMUL_BLOCK_N, read from its source (no triton)
MATMUL_BLOCKS = tuple(map(int, re.search(r"MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K = (\d+), (\d+),",
                                         Path(launch.__file__).with_name("triton_kernels.py").read_text()).groups()))


def test_a_grid_past_the_limits_is_refused_in_one_line():
    with pytest.raises(ValueError, match="exceeds CUDA's limit of 65535 programs on axis 1"):
        launch.attention_grid(1, 1, 70_000)
    with pytest.raises(ValueError, match="on axis 0"):
        launch.matmul_grid(2**16, 2**16, 2**10, *MATMUL_BLOCKS)
    assert launch.attention_grid(128, 1, 32) == (128, 32)


def test_on_device_names_the_tensors_cuda_device():
    guard = launch.on_device(torch.device("cuda:1"))  # constructing it initialises nothing
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(launch.on_device(torch.zeros(1)), contextlib.nullcontext)
