"""LagKV (Liang et al. 2025, arXiv 2504.04704): score each chunk of the cache against the chunk after it.

The entries after the `n_sink` sinks, in position order, are cut into partitions of `lag_size`. Partition p
is scored with partition p + 1 as its reference ("lag"): every key (and value) is min-max normalised with
the reference's per-channel min and max, the standard deviation over channels measures how much it stands
out, a softmax over the partition turns that into a distribution, and the key and value scores are averaged.
Within a partition only the rank counts (the original's default, non cross-scoring): score = rank / lag_size,
so every partition loses its least informative entries in turn. The last full partition plus the partial one
after it have no reference yet: they rank above every scored entry (newest first). Sinks are always kept.

Why this one (issue #9, part 3): it is attention-free (fused kernels, no attention rows), keeps the same
number of entries in every head (the cache's dense [batch, kv_heads, n] buffers and the N + B bound hold
as they are; AdaKV's per-head budgets would need padded, masked slots), and it was designed to compress a
stream partition by partition, which is what block-wise prefill feeds it.

Adaptation: partitions are consecutive cache *entries* (by position), not consecutive prompt positions,
because earlier blocks have already been thinned; with nothing evicted yet the two coincide. With fewer than
two full partitions nothing can be scored and the newest entries are kept (as the original does).
Defaults: n_sink 4, lag_size 128 (kvpress's LagKVPress). Degenerate references (max = min) are clamped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Policy


def lag_relative_scores(states: torch.Tensor, lag: int) -> torch.Tensor:
    """Scores [b, h, chunks - 1, lag] of states [b, h, chunks, lag, d]: each chunk against the next one."""
    reference, target = states[:, :, 1:], states[:, :, :-1]
    low = reference.amin(dim=-2, keepdim=True)
    high = reference.amax(dim=-2, keepdim=True)
    normalised = (target - low) / (high - low).clamp_min(1e-6)
    return normalised.std(dim=-1).softmax(dim=-1)


@dataclass
class LagKV(Policy):
    name: ClassVar[str] = "lagkv"
    n_sink: int = 4
    lag_size: int = 128

    def validate(self, budget: int) -> None:
        if self.lag_size < 1:
            raise ValueError(f"lagkv lag_size must be >= 1, got {self.lag_size}")
        if not 0 <= self.n_sink < budget:
            raise ValueError(f"lagkv n_sink ({self.n_sink}) must be >= 0 and smaller than the budget ({budget})")

    def score(self, layer: LayerView) -> torch.Tensor:
        positions = layer.positions
        batch, heads, n = positions.shape
        order = positions.argsort(dim=-1)  # entries by position; the sinks come first
        sinks = int((positions[0, 0] < self.n_sink).sum())
        rest = n - sinks
        chunks = rest // self.lag_size
        scores = torch.empty(batch, heads, n, dtype=torch.float32, device=positions.device)
        # Unscored entries (tail; everything if fewer than two partitions): 1 + recency, above every rank.
        scores.copy_(1.0 + positions.float() / (positions.max().float() + 1))
        if chunks >= 2:
            end = sinks + (chunks - 1) * self.lag_size  # entries [sinks, end) are scored
            scored = order[..., sinks : sinks + chunks * self.lag_size]
            d = layer.keys.shape[-1]
            index = scored[..., None].expand(-1, -1, -1, d)
            keys = layer.keys.float().gather(2, index).view(batch, heads, chunks, self.lag_size, d)
            values = layer.values.float().gather(2, index).view(batch, heads, chunks, self.lag_size, -1)
            combined = (lag_relative_scores(keys, self.lag_size) + lag_relative_scores(values, self.lag_size)) / 2
            ranks = combined.argsort(dim=-1).argsort(dim=-1).float() / self.lag_size
            scores.scatter_(-1, order[..., sinks:end], ranks.reshape(batch, heads, -1))
        return scores

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        return layer.positions < self.n_sink if self.n_sink else None
