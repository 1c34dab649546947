"""TOVA (Oren et al. 2024): keep the entries the last query attends to most (phi(A) = A_{-1,:}), per KV head
(`heads="group"`) or one set per layer (`"layer"`). Design: docs/design/policies.md#tova-tovapy"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy

HEAD_MODES = ("group", "layer")


@dataclass
class TOVA(Policy):
    name: ClassVar[str] = "tova"
    needs: ClassVar[Needs] = Needs(attention_rows=1, host_reads=False, rows_alike=True, batch_invariant=True)
    heads: str = "group"

    def validate(self, budget: int) -> None:
        if self.heads not in HEAD_MODES:
            raise ValueError(f"tova heads {self.heads!r} is not valid; valid: {', '.join(HEAD_MODES)}")

    def score(self, layer: LayerView) -> torch.Tensor:
        if self.heads == "layer":
            return layer.attention.mean(dim=1, keepdim=True).expand_as(layer.attention)
        return layer.attention
