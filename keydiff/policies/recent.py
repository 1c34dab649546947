"""Sliding window only: keep the most recent tokens (a sanity floor, no sinks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy


@dataclass
class Recent(Policy):
    """Keep the `budget` most recent tokens."""

    name: ClassVar[str] = "recent"
    needs: ClassVar[Needs] = Needs(host_reads=False, rows_alike=True, batch_invariant=True)

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.positions.float()
