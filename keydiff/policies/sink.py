"""StreamingLLM ("sink attention", Xiao et al. 2024): the first tokens plus the most recent ones. Keys keep the absolute
position they were rotated with (as the KeyDiff paper and KVCache-Factory do), not their in-cache index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy


@dataclass
class Sink(Policy):
    """Keep positions < `sinks` (default 4, as the paper and the original) and the most recent tokens."""

    name: ClassVar[str] = "sink"
    needs: ClassVar[Needs] = Needs(host_reads=False, rows_alike=True, batch_invariant=True)
    sinks: int = 4

    def validate(self, budget: int) -> None:
        if self.sinks < 0:
            raise ValueError(f"sink count must be >= 0, got {self.sinks}")
        if self.sinks >= budget:
            raise ValueError(f"sink count ({self.sinks}) must be smaller than the budget ({budget})")

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.positions.float()

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        return layer.positions < self.sinks
