"""Kernels of our own, below everything else in keydiff (they import torch and triton only).

    batch_invariant.py  the mode that makes a decoding step's matmuls, row reductions and attention independent of
                        the number of rows (registered through torch.library; what `batch_invariant=true` turns on)
    triton_kernels.py   the Triton kernels it registers (imported on first use: triton is needed only then)
    launch.py           their grids, within CUDA's limits, and the device each launch is bound to (no triton)
"""
