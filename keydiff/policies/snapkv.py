"""SnapKV (Li et al. 2024) applied block by block, as the KeyDiff paper runs it (§F.2): the last `window` queries of
each block score the entries before them; the window's own entries are kept. Design:
docs/design/policies.md#snapkv-snapkvpy"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from keydiff.policies.base import LayerView, Needs, Policy, most_recent

POOLINGS = ("avg", "max")


@dataclass
class SnapKV(Policy):
    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel_size: int = 7
    pooling: str = "avg"

    @property
    def needs(self) -> Needs:
        """The observation window decides how many query rows the attention function must score."""
        return Needs(attention_rows=self.window, host_reads=False, rows_alike=True, batch_invariant=True)

    def validate(self, budget: int) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"snapkv pooling {self.pooling!r} is not valid; valid: {', '.join(POOLINGS)}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"snapkv kernel_size must be a positive odd number, got {self.kernel_size}")
        if not 1 <= self.window < budget:
            raise ValueError(f"snapkv window ({self.window}) must be >= 1 and smaller than the budget ({budget})")

    def score(self, layer: LayerView) -> torch.Tensor:
        n = layer.attention.shape[-1]
        prefix = max(n - self.window, 0)  # entries outside the always-kept window
        if not prefix:
            return layer.attention
        # Pool along the sequence: entries in position order (the cache stores them in no particular order).
        order = layer.positions.argsort(dim=-1)
        ordered = layer.attention.gather(-1, order)
        b, h, _ = ordered.shape
        flat = ordered[..., :prefix].reshape(b * h, 1, prefix)
        pad = self.kernel_size // 2
        if self.pooling == "avg":
            pooled = F.avg_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        else:
            pooled = F.max_pool1d(flat, self.kernel_size, stride=1, padding=pad)
        ordered[..., :prefix] = pooled.reshape(b, h, prefix)
        return torch.empty_like(ordered).scatter_(-1, order, ordered)

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        return most_recent(layer, self.window)
