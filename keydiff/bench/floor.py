"""The floor of a decoding step: the least time any implementation could take on this device.

The larger of reading every weight and every row's keys and values once (bytes / bandwidth) and doing the
multiply-adds (FLOPs / matmul rate). GPU bandwidth is the vendor's figure by device name; CPU bandwidth and the
matmul rate are measured here.

Design: docs/design/benchmarks.md#the-floor-of-a-step-floor
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from keydiff.bench.common import head_dim, kv_cache_bytes, timings

# Memory bandwidth by GPU name (bytes per second; the vendor's figure).
GPU_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


@dataclass(frozen=True)
class DeviceRates:
    bandwidth: float | None  # bytes per second read from memory; None: unknown GPU
    bandwidth_source: str
    matmul_flops: float | None  # multiply-adds x 2 per second, square matmul in the model's dtype
    dtype: str

    def record(self) -> dict:
        return asdict(self)


def measure(device: str, dtype: torch.dtype, read_mib: int = 1024, matmul_size: int | None = None,
            repeats: int = 5) -> DeviceRates:
    """The device's bandwidth and matmul rate (see the module for their sources). read_mib: the CPU read's size;
    matmul_size: the square matmul's side (default 8,192 on a GPU, 2,048 on a CPU: large enough for the peak)."""
    matmul_size = matmul_size or (8192 if device == "cuda" else 2048)
    if device == "cuda":
        name = torch.cuda.get_device_name()
        bandwidth = next((bw for key, bw in GPU_BANDWIDTH.items() if key in name), None)
        source = f"vendor figure for {name}" if bandwidth is not None else f"unknown GPU {name}: no figure"
    else:
        data = torch.ones(read_mib * (1 << 20) // 4, dtype=torch.float32, device=device)
        bandwidth = data.numel() * 4 / min(timings(device, data.sum, repeats))
        source = f"measured: best of {repeats} sums over {read_mib} MiB, {torch.get_num_threads()} threads"
        del data
    a = torch.randn(matmul_size, matmul_size, dtype=dtype, device=device)
    b = torch.randn(matmul_size, matmul_size, dtype=dtype, device=device)
    seconds = min(timings(device, lambda: a @ b, repeats, warm_up=1))  # the untimed first call: library setup
    return DeviceRates(bandwidth, source, 2 * matmul_size ** 3 / seconds, str(dtype).removeprefix("torch."))


def step_bytes(model, rows: int, entries: int) -> int:
    """What one decoding step must read: every weight once, and each row's keys and values (`entries` per row)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + kv_cache_bytes(None, model, entries, rows)


def step_flops(model, rows: int, entries: int) -> int:
    """Multiply-adds x 2 of one decoding step of one token per row: every weight matrix once per row (the input
    embedding is a lookup, so it counts only where it is also the output layer, tied), and attention's scores and
    weighted sum over `entries` keys for every query head."""
    config = model.config.get_text_config()
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    if not getattr(config, "tie_word_embeddings", False):
        matrices -= model.get_input_embeddings().weight.numel()
    attention = 2 * config.num_hidden_layers * config.num_attention_heads * head_dim(config) * entries
    return 2 * rows * (matrices + attention)


def floor_ms(model, rows: int, entries: int, rates: DeviceRates) -> dict:
    """The step's bandwidth floor, compute floor and floor (their maximum), in ms; None where a rate is unknown."""
    memory = 1e3 * step_bytes(model, rows, entries) / rates.bandwidth if rates.bandwidth else None
    compute = 1e3 * step_flops(model, rows, entries) / rates.matmul_flops if rates.matmul_flops else None
    known = [v for v in (memory, compute) if v is not None]
    return {"floor_ms": max(known) if known else None, "bandwidth_floor_ms": memory, "compute_floor_ms": compute}
