"""The eviction-free baseline: the cache keeps every token (the budget is ignored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy


@dataclass
class Full(Policy):
    """No eviction. Block-wise prefill with this policy equals one ordinary forward pass."""

    name: ClassVar[str] = "full"
    needs: ClassVar[Needs] = Needs(evicts=False, batch_invariant=True)

    def score(self, layer: LayerView) -> torch.Tensor:
        raise RuntimeError("the full policy never evicts")
