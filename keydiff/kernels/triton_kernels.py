"""Triton kernels whose reduction order does not depend on how many rows a call has, in stable triton.language only
(TRITON_INTERPRET=1 runs them on CPU). Design: docs/design/decode.md#batch-invariant-kernels-keydiffkernels"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from keydiff.kernels import launch

MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K = 16, 32, 64
ROW_BLOCK = 512
ATTENTION_BLOCK_N = 64
# Triton's interpreter multiplies a bf16 / fp16 tile's stored bits in tl.dot (3.8), so there the matmul widens its
# tiles to float32 first (exact: the products of two bf16 numbers fit in float32); compiled kernels never do.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                   stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                   stride_cb, stride_cm, stride_cn, stride_biasm, stride_biasn, alpha, beta,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    program = tl.program_id(0)  # matrix x tiles + tile, all on the first axis (keydiff.kernels.launch)
    tile = program % tiles
    matrix = (program // tiles).to(tl.int64)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.arange(0, BLOCK_K)
    a_base = a_ptr + matrix * stride_ab
    b_base = b_ptr + matrix * stride_bb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):  # K in one fixed order: the same sums for row i whatever M is
        k = start + steps
        a = tl.load(a_base + rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_base + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:  # float32 operands as float32 (torch's default with TF32 off)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    acc = acc * alpha
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows[:, None] * stride_biasm + cols[None, :] * stride_biasn, mask=inside, other=0.0)
        acc = acc + beta * bias.to(tl.float32)
    c = c_ptr + matrix * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=inside)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, alpha: float = 1.0,
           beta: float = 1.0) -> torch.Tensor:
    """alpha * (a @ b) + beta * bias in fixed tiles: [M, K] @ [K, N] -> [M, N], or batched [B, M, K] @ [B, K, N];
    bias broadcastable to [M, N] (2-D only). Any strides; the output is new, contiguous, of a's dtype."""
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a[None], b[None])
    matrices, rows, depth = a3.shape
    cols = b3.shape[2]
    out = torch.empty((matrices, rows, cols), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out if batched else out[0]
    if depth == 0:  # an empty sum
        out.zero_()
        if bias is not None:
            out.add_(bias.to(out.dtype), alpha=beta)
        return out if batched else out[0]
    bias_strides = (0, 0)
    if bias is not None:
        bias = bias.expand(rows, cols)
        bias_strides = bias.stride()
    with launch.on_device(out):
        _matmul_kernel[launch.matmul_grid(rows, cols, matrices, MATMUL_BLOCK_M, MATMUL_BLOCK_N)](
            a3, b3, out, out if bias is None else bias, rows, cols, depth,
            a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
            out.stride(0), out.stride(1), out.stride(2), bias_strides[0], bias_strides[1], float(alpha), float(beta),
            HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32 or INTERPRETED,
            WIDEN=INTERPRETED and a.dtype != torch.float32,
            BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=MATMUL_BLOCK_N, BLOCK_K=MATMUL_BLOCK_K,
        )
    return out if batched else out[0]


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, K, stride_row, ABSOLUTE: tl.constexpr, SQUARE: tl.constexpr,
                    DOUBLE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    if DOUBLE:
        acc = tl.zeros((BLOCK,), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = x_ptr + row * stride_row
    for start in range(0, K, BLOCK):  # chunks in order, each element into its own lane of the accumulator
        k = start + offsets
        x = tl.load(base + k, mask=k < K, other=0.0).to(acc.dtype)
        if ABSOLUTE:
            x = tl.abs(x)
        if SQUARE:
            x = x * x
        acc += x
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def row_sums(x: torch.Tensor, absolute: bool = False, square: bool = False) -> torch.Tensor:
    """Per-row sums of x [R, K] (of |x| or x² if asked): float32 [R] (float64 for float64 x), one program per row."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, depth = x.shape
    double = x.dtype == torch.float64
    out = torch.empty(rows, dtype=torch.float64 if double else torch.float32, device=x.device)
    if rows == 0:
        return out
    if depth == 0:
        return out.zero_()
    with launch.on_device(out):
        _row_sum_kernel[launch.row_grid(rows)](x, out, depth, x.stride(0), ABSOLUTE=absolute, SQUARE=square,
                                               DOUBLE=double, BLOCK=ROW_BLOCK)
    return out


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, q_len, kv_len, groups, scale,
                      stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_om, stride_oh, stride_od,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    program = tl.program_id(0)
    head = tl.program_id(1)
    batch = (program // q_len).to(tl.int64)
    query_row = program % q_len
    kv_head = head // groups
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < HEAD_DIM
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + query_row * stride_qm + dims * stride_qd,
                mask=in_dim, other=0.0).to(tl.float32)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    visible_to = kv_len - q_len + query_row  # bottom-right causal: the last key this query row sees
    offsets = tl.arange(0, BLOCK_N)
    best = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros((BLOCK_N,), tl.float32), axis=0)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(0, visible_to + 1, BLOCK_N):  # the keys in chunks, in order (no split over the keys)
        keys_n = start + offsets
        visible = keys_n <= visible_to
        mask = visible[:, None] & in_dim[None, :]
        k = tl.load(k_base + keys_n[:, None] * stride_kn + dims[None, :] * stride_kd, mask=mask, other=0.0)
        logits = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        logits = tl.where(visible, logits, float("-inf"))
        new_best = tl.maximum(best, tl.max(logits, axis=0))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(logits - new_best)
        total = total * rescale + tl.sum(weights, axis=0)
        v = tl.load(v_base + keys_n[:, None] * stride_vn + dims[None, :] * stride_vd, mask=mask, other=0.0)
        acc = acc * rescale + tl.sum(weights[:, None] * v.to(tl.float32), axis=0)
        best = new_best
    out = acc / total
    tl.store(o_ptr + batch * stride_ob + query_row * stride_om + head * stride_oh + dims * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=in_dim)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of query [B, H, q, d] over key/value [B, H_kv, n, d], bottom-right causal, softmax in
    float32. Returns [B, q, H, d], of the query's dtype."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if kv_len < q_len:
        raise ValueError(f"attention needs at least as many keys as queries, got {kv_len} keys for {q_len} queries")
    out = torch.empty((batch, q_len, heads, dim), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    with launch.on_device(out):
        _attention_kernel[launch.attention_grid(batch, q_len, heads)](
            query, key, value, out, q_len, kv_len, heads // kv_heads, float(scale),
            *query.stride(), *key.stride(), *value.stride(), *out.stride(),
            HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=ATTENTION_BLOCK_N,
        )
    return out
