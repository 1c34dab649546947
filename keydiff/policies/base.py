"""What an eviction policy is: a scoring rule over the entries of one layer's cache.

A policy sees one layer at a time (`LayerView`) and answers one question: which `budget` entries of each
KV head to keep. Most policies only implement `score` (higher = keep); `protected` marks entries that
are always kept (sinks, recent windows); `observe` lets a policy carry state across steps (H2O's
accumulated attention). The cache (`keydiff.cache`) calls `observe` after every forward pass and
`keep_indices` whenever a layer holds more than `budget` entries.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

logger = logging.getLogger(__name__)


@dataclass
class LayerView:
    """One layer's cache as a policy sees it. Entries are in ascending position order along dim 2."""

    keys: torch.Tensor  # [batch, kv_heads, n, head_dim], post-RoPE, as cached
    values: torch.Tensor  # [batch, kv_heads, n, head_dim]
    positions: torch.Tensor  # [batch, kv_heads, n] absolute prompt/generation positions (long)
    # Attention statistic of the forward pass that just ran: for each entry, the attention it received,
    # summed over the query rows the policy asked for and averaged over the query heads of its KV group.
    attention: torch.Tensor | None  # [batch, kv_heads, n] float32, or None if the policy asked for none
    state: dict[str, torch.Tensor]  # per-entry policy state [batch, kv_heads, n]; new entries start at 0
    layer_idx: int


@dataclass
class Policy:
    """Base class: keep the `budget` highest-scoring entries of every KV head, plus nothing else.

    Subclasses are small dataclasses; their fields are the policy's hyper-parameters (set from Hydra).
    """

    name: ClassVar[str] = "base"
    # Which query rows' attention the policy needs: 0 = none (attention-free), k = the last k rows of
    # each forward pass, None = every row (column sums).
    attention_rows: ClassVar[int | None] = 0
    # True if `observe` must see the attention of every forward pass, even those that evict nothing.
    observes_every_step: ClassVar[bool] = False
    # False only for the no-eviction baseline.
    evicts: ClassVar[bool] = True

    def validate(self, budget: int) -> None:
        """Raise ValueError if the hyper-parameters cannot work with `budget` (called before model loading)."""

    def compresses_layer(self, layer_idx: int) -> bool:
        """Whether this layer is ever evicted (L2-norm's optional skip layers say no)."""
        return True

    def observe(self, layer: LayerView) -> None:
        """Update per-entry state in `layer.state` after a forward pass (default: stateless)."""

    def score(self, layer: LayerView) -> torch.Tensor:
        """Per-entry score [batch, kv_heads, n]; the highest `budget` per head are kept."""
        raise NotImplementedError

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        """Bool [batch, kv_heads, n] of entries kept regardless of score, or None."""
        return None

    def keep_indices(self, layer: LayerView, budget: int) -> torch.Tensor:
        """Indices [batch, kv_heads, budget] of the entries to keep, ascending (so position order survives)."""
        scores = self.score(layer).float()
        protect = self.protected(layer, budget)
        if protect is not None:
            scores = scores.masked_fill(protect, float("inf"))
        return torch.topk(scores, budget, dim=-1, sorted=False).indices.sort(dim=-1).values

    def describe(self) -> dict:
        """Name and hyper-parameters, for result files."""
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}


def most_recent(layer: LayerView, count: int) -> torch.Tensor:
    """Bool mask of the `count` most recent entries of every head (entries are kept in position order)."""
    n = layer.positions.shape[-1]
    mask = torch.zeros_like(layer.positions, dtype=torch.bool)
    if count > 0:
        mask[..., max(n - count, 0) :] = True
    return mask


def window_size(fraction: float, budget: int) -> int:
    """Number of budget slots a `fraction` of the budget reserves for the most recent tokens (floor).

    The epsilon keeps float noise from losing a slot: int(0.57 * 100) is 56, this gives 57.
    """
    return math.floor(fraction * budget + 1e-9)


def check_fraction(name: str, value: float, budget: int | None = None) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    if budget is not None and value > 0 and window_size(value, budget) == 0:
        logger.warning("%s=%s of a %d-token budget reserves no slot (floor); the window is empty", name, value, budget)


__all__ = ["LayerView", "Policy", "most_recent", "window_size", "check_fraction", "field"]
