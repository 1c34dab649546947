"""L2-norm eviction (Devoto et al., EMNLP 2024): keep the keys with the lowest L2 norm (`skip_layers`: leave layers 0
and 1 uncompressed, as the original). Design: docs/design/policies.md#l2-norm-knormpy"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy, float32_norms


@dataclass
class KNorm(Policy):
    """Score = -||k||_2 per entry and KV head (RoPE is a rotation, so pre/post-RoPE norms are equal)."""

    name: ClassVar[str] = "knorm"
    needs: ClassVar[Needs] = Needs(host_reads=False, rows_alike=True, batch_invariant=True)
    skip_layers: list[int] = field(default_factory=list)

    def compresses_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.skip_layers

    def score(self, layer: LayerView) -> torch.Tensor:
        return -float32_norms(layer.keys)
