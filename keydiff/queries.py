"""Running statistics of a layer's queries, before RoPE, for policies that predict future attention: `QueryStatistics`
undoes RoPE on each pass's queries and accumulates their first two moments in float64 (`LayerView.queries`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float64, attention_scaling) of a transformers model config's RoPE."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"RoPE type {rope_type!r} is not supported for query statistics (dynamic RoPE changes with length)")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    if inv_freq.shape[-1] * 2 != head_dim:
        raise ValueError(f"partial RoPE ({inv_freq.shape[-1] * 2} of {head_dim} dims) is not supported for query statistics")
    return inv_freq.to(torch.float64), float(scaling)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE rotation of x [..., d] by angles with cos/sin [..., d/2] (no scaling)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mean_rotation(inv_freq: torch.Tensor, scaling: float, start: int, count: int) -> torch.Tensor:
    """The RoPE matrix averaged over positions start..start+count-1: [d, d] float64, scaling included."""
    positions = torch.arange(start, start + count, dtype=torch.float64, device=inv_freq.device)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().mean(dim=0), angles.sin().mean(dim=0)
    half = inv_freq.shape[0]
    matrix = torch.zeros(2 * half, 2 * half, dtype=torch.float64, device=inv_freq.device)
    idx = torch.arange(half, device=inv_freq.device)
    matrix[idx, idx] = cos
    matrix[idx + half, idx + half] = cos
    matrix[idx, idx + half] = -sin
    matrix[idx + half, idx] = sin
    return scaling * matrix


@dataclass
class QueryStatistics:
    """First and second moments of a layer's pre-RoPE queries at positions >= first_position, per query head:
    count, total [batch, heads, d] and outer [batch, heads, d, d] (float64 sums), next_position."""

    inv_freq: torch.Tensor  # [d/2] float64
    scaling: float
    first_position: int = 0
    count: int = 0
    next_position: int = 0
    total: torch.Tensor | None = None
    outer: torch.Tensor | None = None

    def update(self, query: torch.Tensor, first: int) -> None:
        """Add the post-RoPE queries [batch, heads, q, d] of absolute positions first..first+q-1."""
        q_len = query.shape[2]
        self.next_position = first + q_len
        skip = max(self.first_position - first, 0)
        if skip >= q_len:
            return
        positions = torch.arange(first + skip, first + q_len, dtype=torch.float64, device=query.device)
        angles = positions[:, None] * self.inv_freq.to(query.device)[None, :]
        # Undo RoPE: rotate by the negative angle, divide out the scaling.
        x = rotate(query[:, :, skip:].double(), angles.cos(), -angles.sin()) / self.scaling
        if self.total is None:
            batch, heads, _, dim = x.shape
            self.total = x.new_zeros(batch, heads, dim)
            self.outer = x.new_zeros(batch, heads, dim, dim)
        self.total += x.sum(dim=2)
        self.outer += x.transpose(-1, -2) @ x
        self.count += q_len - skip

    def mean(self) -> torch.Tensor:
        """Mean pre-RoPE query [batch, heads, d] (float64)."""
        return self.total / self.count

    def covariance(self) -> torch.Tensor:
        """Population covariance of the pre-RoPE queries [batch, heads, d, d] (float64, divided by count)."""
        mean = self.mean()
        return self.outer / self.count - mean[..., :, None] * mean[..., None, :]

    def heads(self, row: int, first: int, count: int) -> "QueryStatistics":
        """The statistics of query heads first..first+count-1 of batch row `row` (views): one KV head's group."""
        part = slice(first, first + count)
        total = None if self.total is None else self.total[row : row + 1, part]
        outer = None if self.outer is None else self.outer[row : row + 1, part]
        return QueryStatistics(self.inv_freq, self.scaling, self.first_position, self.count, self.next_position,
                               total, outer)
