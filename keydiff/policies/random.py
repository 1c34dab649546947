"""Uniformly random eviction (seeded): the floor any informed policy should beat."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy


@dataclass
class Random(Policy):
    """Keep a uniformly random subset of `budget` entries per head. Same seed and inputs, same choices."""

    name: ClassVar[str] = "random"
    needs: ClassVar[Needs] = Needs(batch_invariant=True)
    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)

    def score(self, layer: LayerView) -> torch.Tensor:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        noise = torch.rand(layer.positions.shape, generator=self._generator)
        return noise.to(layer.positions.device)
