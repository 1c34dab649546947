"""The batch-invariant mode: while on, a device's matmuls, row reductions and decode attention run kernels whose
reduction order does not depend on the number of rows, so a sequence decoded in a batch gets the bits it gets alone.
Registered through `torch.library` (`mode("CUDA")`); a CPU does not need it. Design:
docs/design/decode.md#batch-invariant-kernels-keydiffkernels"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch

# The dispatch key the mode registers for, by device type; None: the mode has no kernels there (CPU).
DEVICE_KEYS: dict[str, str | None] = {"cuda": "CUDA", "cpu": None}
# The aten operators the mode replaces (overload names as torch.library spells them).
OPERATORS = ("mm", "addmm", "bmm", "mean.dim", "sum.dim_IntList", "linalg_vector_norm")
# Calls of each replacement since import (what the tests read to see that the kernels really ran).
calls: Counter = Counter()
_active: dict[str, int] = {}  # dispatch key -> nesting depth of `mode`


def kernels():
    """keydiff.kernels.triton_kernels, imported on first use (it imports triton)."""
    from keydiff.kernels import triton_kernels

    return triton_kernels


def check_device(device: torch.device) -> None:
    """Refuse a device the mode has no form for, in one line (a CUDA device also needs triton)."""
    if device.type not in DEVICE_KEYS:
        raise ValueError(f"batch_invariant=true does not run on {device.type} (valid devices: "
                         f"{', '.join(DEVICE_KEYS)}; on cpu it is a no-op: it has no CPU kernels)")
    if DEVICE_KEYS[device.type] is not None:
        try:
            import triton  # noqa: F401
        except ImportError as error:
            raise ImportError("batch_invariant=true needs triton (shipped with torch's CUDA build): "
                              "pip install -e '.[triton]'") from error


def for_device(device: torch.device):
    """The mode for `device` as a context manager (a null one where the device needs none: see DEVICE_KEYS)."""
    check_device(device)
    key = DEVICE_KEYS[device.type]
    return nullcontext() if key is None else mode(key)


def enabled(device: torch.device) -> bool:
    """Whether the mode is on for this device's dispatch key (keydiff.attention routes its attention here)."""
    return _active.get(_key_of(device), 0) > 0


def _key_of(device: torch.device) -> str:
    return {"cuda": "CUDA", "cpu": "CPU"}.get(device.type, device.type)


@contextmanager
def mode(dispatch_key: str = "CUDA") -> Iterator[None]:
    """Register the invariant kernels for `dispatch_key` ("CUDA"; "CPU" in tests) for the duration; nested uses register once."""
    if _active.get(dispatch_key, 0):
        _active[dispatch_key] += 1
        try:
            yield
        finally:
            _active[dispatch_key] -= 1
        return
    kernels()  # import triton before registering, so that a missing triton fails here with nothing registered
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # torch warns that each registration overrides the built-in kernel
            warnings.simplefilter("ignore")
            for name in OPERATORS:
                library.impl(name, IMPLEMENTATIONS[name], dispatch_key)
        _active[dispatch_key] = 1
        yield
    finally:
        _active.pop(dispatch_key, None)
        library._destroy()  # unregisters every kernel this library registered (torch.library has no public undo)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Invariant attention [B, q, H, d] of query [B, H, q, d] over key/value [B, H_kv, n, d], bottom-right causal."""
    calls["attention"] += 1
    return kernels().attention(query, key, value, scale)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    calls["mm"] += 1
    return kernels().matmul(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    calls["addmm"] += 1
    return kernels().matmul(a, b, bias, float(alpha), float(beta))


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    calls["bmm"] += 1
    return kernels().matmul(a, b)


def _rows(x: torch.Tensor, dim: Any) -> tuple[torch.Tensor, list[int], list[int]]:
    """x as [rows, reduced] with the reduced dims last (a copy if needed), and the kept and reduced dims (None: every dim)."""
    if x.dim() == 0:
        return x.reshape(1, 1), [], []
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else sorted({d % x.dim() for d in dim})
    kept = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*kept, *dims) if kept + dims != list(range(x.dim())) else x
    rows = math.prod(x.shape[d] for d in kept)
    return moved.reshape(rows, math.prod(x.shape[d] for d in dims)), kept, dims


def _shaped(flat: torch.Tensor, x: torch.Tensor, kept: list[int], dims: list[int], keepdim: bool) -> torch.Tensor:
    """Per-row results back in the reduced shape of x."""
    if keepdim:
        return flat.reshape([1 if d in dims else size for d, size in enumerate(x.shape)])
    return flat.reshape([x.shape[d] for d in kept])


def _sum(x: torch.Tensor, dim: Any, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    calls["sum"] += 1
    if dtype is not None and dtype.is_floating_point:
        x = x.to(dtype)
    if x.dtype.is_complex:
        raise NotImplementedError("the batch-invariant sum takes real tensors only")
    flat, kept, dims = _rows(x, dim)
    if not x.dtype.is_floating_point:  # integers and booleans add exactly in any order: a scan's last column
        target = dtype or torch.int64
        sums = (flat.cumsum(-1, dtype=target)[:, -1] if flat.shape[1] else
                torch.zeros(flat.shape[0], dtype=target, device=x.device))
        return _shaped(sums, x, kept, dims, keepdim)
    sums = kernels().row_sums(flat)
    return _shaped(sums.to(dtype or x.dtype), x, kept, dims, keepdim)


def _mean(x: torch.Tensor, dim: Any, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    calls["mean"] += 1
    if dtype is not None:
        x = x.to(dtype)
    if not x.dtype.is_floating_point:
        raise RuntimeError(f"mean(): could not infer output dtype. Input dtype must be floating point, got {x.dtype}")
    flat, kept, dims = _rows(x, dim)
    sums = kernels().row_sums(flat)
    means = sums / flat.shape[1] if flat.shape[1] else torch.full_like(sums, float("nan"))
    return _shaped(means.to(x.dtype), x, kept, dims, keepdim)


def _vector_norm(x: torch.Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    calls["linalg_vector_norm"] += 1
    order = float(ord)
    # Half precision summed in float32, widened as read: no float32 copy of x (a CUDA graph's pool would keep it).
    widened = dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16) and order in (1.0, 2.0)
    if dtype is not None and not widened:
        x = x.to(dtype)
    if not x.dtype.is_floating_point:
        raise NotImplementedError(f"the batch-invariant vector norm takes real floating tensors, got {x.dtype}")
    out_dtype = dtype or x.dtype
    flat, kept, dims = _rows(x, dim)
    if order == 2:
        norms = kernels().row_sums(flat, square=True).sqrt()
    elif order == 1:
        norms = kernels().row_sums(flat, absolute=True)
    elif math.isinf(order):  # a maximum or minimum: exact in any order
        norms = flat.abs().amax(-1) if order > 0 else flat.abs().amin(-1)
    elif order == 0:
        norms = kernels().row_sums((flat != 0).to(flat.dtype))
    else:
        norms = kernels().row_sums(flat.abs().pow(order)).pow(1.0 / order)
    return _shaped(norms.to(out_dtype), x, kept, dims, keepdim)


IMPLEMENTATIONS = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "mean.dim": _mean, "sum.dim_IntList": _sum,
                   "linalg_vector_norm": _vector_norm}
