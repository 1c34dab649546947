"""Kernels of our own, below everything else in keydiff (they import torch and triton only).

    batch_invariant.py  the mode making a decoding step's matmuls, reductions and attention independent of the
                        row count (registered through torch.library; `batch_invariant=true`)
    triton_kernels.py   the Triton kernels it registers (imported on first use)
    launch.py           their grids, within CUDA's limits, and the device each launch is bound to (no triton)

Design: docs/design/decode.md#batch-invariant-kernels-keydiffkernels
"""
