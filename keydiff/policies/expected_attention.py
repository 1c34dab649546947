"""Expected Attention (Devoto, Jeblick, Jégou 2025, arXiv 2510.00636): the attention future queries will pay, with
queries modelled as Gaussian (keydiff.queries). Design: docs/design/policies.md#expected-attention-expected_attentionpy
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy
from keydiff.queries import mean_rotation


@dataclass
class ExpectedAttention(Policy):
    name: ClassVar[str] = "expected_attention"
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    @property
    def needs(self) -> Needs:
        """The queries' statistics, without the sink positions' queries (outliers, left out as in the original);
        score() is log((expected attention + epsilon) x ||v||)."""
        return Needs(queries=True, queries_from=self.n_sink, log_scores=True)

    def validate(self, budget: int) -> None:
        if self.n_future_positions < 1:
            raise ValueError(f"expected_attention n_future_positions must be >= 1, got {self.n_future_positions}")
        if not 0 <= self.n_sink < budget:
            raise ValueError(f"expected_attention n_sink ({self.n_sink}) must be >= 0 and smaller than the budget ({budget})")
        if self.epsilon < 0:
            raise ValueError(f"expected_attention epsilon must be >= 0, got {self.epsilon}")

    def score(self, layer: LayerView) -> torch.Tensor:
        stats = layer.queries
        keys = layer.keys.float()  # [b, h_kv, n, d]; statistics and rotation in float64, the O(n d²) part in float32
        batch, kv_heads, n, dim = keys.shape
        if stats is None or stats.count == 0:  # only sink queries so far: nothing to estimate from, keep the newest
            return layer.positions.float()
        rotation = mean_rotation(stats.inv_freq.to(keys.device), stats.scaling, stats.next_position, self.n_future_positions)
        mean = (stats.mean() @ rotation.T).float()  # [b, H, d]
        heads = mean.shape[1]
        groups = heads // kv_heads
        grouped_keys = keys.repeat_interleave(groups, dim=1)  # [b, H, n, d]
        logits = (grouped_keys @ mean[..., None]).squeeze(-1) / math.sqrt(dim)
        if self.use_covariance:
            cov = (rotation @ stats.covariance() @ rotation.T).float()  # [b, H, d, d]
            logits = logits + ((grouped_keys @ cov) * grouped_keys).sum(dim=-1) / (2 * dim)
        logits = logits.masked_fill(layer.positions.repeat_interleave(groups, dim=1) < self.n_sink, float("-inf"))
        # In log space, so tiny expected attentions keep their order.
        log_attention = torch.log_softmax(logits, dim=-1).view(batch, kv_heads, groups, n)
        scores = torch.logsumexp(log_attention, dim=2) - math.log(groups)  # log of the group mean
        if self.use_vnorm:
            if self.epsilon:
                scores = torch.logaddexp(scores, torch.full_like(scores, math.log(self.epsilon)))
            scores = scores + layer.values.float().norm(dim=-1).clamp_min(1e-30).log()
        return scores  # log of (expected attention + epsilon) * ||v||: the same order

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        return layer.positions < self.n_sink if self.n_sink else None
