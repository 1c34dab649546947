"""L2-norm eviction (Devoto et al., EMNLP 2024): keep the keys with the lowest L2 norm.

The original and KVCache-Factory leave layers 0 and 1 uncompressed; `skip_layers` reproduces that, but
those layers then grow with the prompt, so the hard N + B memory bound no longer holds for them.
The default compresses every layer, as every other policy here does.

Ties it cannot break by rule: a token repeated at two positions has the same key in layer 0 before RoPE, and
RoPE is a rotation, so both copies' norms are equal in exact arithmetic. Computed from the rotated float32
keys the cache holds, they differ by an ULP or so, and that rounding, not the position rule, decides which
copy is kept; it can differ between machines (torch's `default` and AVX-512 paths round layer 0's keys
differently; docs/testing.md, "Goldens on every vector path").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Policy, float32_norms


@dataclass
class KNorm(Policy):
    """Score = -||k||_2 per entry and KV head (RoPE is a rotation, so pre/post-RoPE norms are equal)."""

    name: ClassVar[str] = "knorm"
    layers_batchable: ClassVar[bool] = True
    capturable: ClassVar[bool] = True
    skip_layers: list[int] = field(default_factory=list)

    def compresses_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.skip_layers

    def score(self, layer: LayerView) -> torch.Tensor:
        return -float32_norms(layer.keys)
