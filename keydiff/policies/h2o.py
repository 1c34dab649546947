"""H2O (Zhang et al. 2023), as the KeyDiff paper states it (§A.1): phi(A) = A_prev + A^T 1. No recent window by default;
`policy=h2o_recent` is the original's equal split. Design: docs/design/policies.md#h2o-h2opy"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy


@dataclass
class H2O(Policy):
    """Heavy hitters by accumulated attention (its configs' `recent_fraction` is a RecentWindow around it)."""

    name: ClassVar[str] = "h2o"
    needs: ClassVar[Needs] = Needs(attention_rows=None, every_pass=True, state=("h2o",), host_reads=False,
                                   rows_alike=True, batch_invariant=True)
    recent_window_parameter: ClassVar[str | None] = "recent_fraction"

    def observe(self, layer: LayerView) -> None:
        layer.state["h2o"].add_(layer.attention)  # in place: the state lives in the cache's buffer

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.state["h2o"]
