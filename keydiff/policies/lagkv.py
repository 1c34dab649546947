"""LagKV (Liang et al. 2025, arXiv 2504.04704): score each chunk of the cache against the chunk after it. Design:
docs/design/policies.md#lagkv-lagkvpy"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy

logger = logging.getLogger(__name__)

SCORINGS = ("frozen", "rescore")
UNSCORED = -1.0  # `lag_rank` of an entry whose partition has not been scored yet


def recency(positions: torch.Tensor) -> torch.Tensor:
    """1 + position / (newest position of the row + 1): in [1, 2), above every rank, newest highest."""
    return 1.0 + positions.float() / (positions.amax(dim=-1, keepdim=True).float() + 1)


def lag_relative_scores(states: torch.Tensor, lag: int) -> torch.Tensor:
    """Scores [b, h, chunks - 1, lag] of states [b, h, chunks, lag, d]: each chunk against the next one."""
    reference, target = states[:, :, 1:], states[:, :, :-1]
    low = reference.amin(dim=-2, keepdim=True)
    high = reference.amax(dim=-2, keepdim=True)
    normalised = (target - low) / (high - low).clamp_min(1e-6)
    return normalised.std(dim=-1).softmax(dim=-1)


@dataclass
class LagKV(Policy):
    name: ClassVar[str] = "lagkv"
    n_sink: int = 4
    lag_size: int = 128
    scoring: str = "frozen"  # frozen (the authors' streaming method) | rescore (re-partition the survivors)

    @property
    def needs(self) -> Needs:
        """Every reduction is per batch row (the sinks counted, the partitions cut, the recency scaled); frozen scoring
        keeps each entry's rank within its partition (UNSCORED until it is scored)."""
        return Needs(rows_alike=True, state=("lag_rank",) if self.scoring == "frozen" else ())

    def initial_state(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.scoring != "frozen":
            return {}
        return {"lag_rank": torch.full(keys.shape[:-1], UNSCORED, dtype=torch.float32, device=keys.device)}

    def validate(self, budget: int) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"lagkv scoring {self.scoring!r} is not valid; valid: {', '.join(SCORINGS)}")
        if self.lag_size < 1:
            raise ValueError(f"lagkv lag_size must be >= 1, got {self.lag_size}")
        if not 0 <= self.n_sink < budget:
            raise ValueError(f"lagkv n_sink ({self.n_sink}) must be >= 0 and smaller than the budget ({budget})")
        if self.scoring == "frozen" and budget < self.n_sink + 2 * self.lag_size - 1:
            logger.warning(
                "lagkv: a %d-entry budget cannot hold %d sinks plus the raw tail (up to %d entries); the oldest raw "
                "entries are dropped by recency before they are scored", budget, self.n_sink, 2 * self.lag_size - 1,
            )

    def score(self, layer: LayerView) -> torch.Tensor:
        return self._score_frozen(layer) if self.scoring == "frozen" else self._score_again(layer)

    def _score_frozen(self, layer: LayerView) -> torch.Tensor:
        """Score the raw partitions that now have a raw successor, freeze their ranks, return all ranks (per batch row)."""
        ranks = layer.state["lag_rank"]
        raw = (ranks < 0) & (layer.positions >= self.n_sink)
        self._rank_partitions(layer, raw, ranks)
        return torch.where(ranks >= 0, ranks, recency(layer.positions))

    def _rank_partitions(self, layer: LayerView, members: torch.Tensor, ranks: torch.Tensor) -> None:
        """Write into `ranks` the rank of each entry of `members` (bool [b, h, n]) in a full partition with a full
        successor (per row, position order, from the oldest); other entries are left as they are."""
        positions = layer.positions
        full = members.sum(dim=-1) // self.lag_size  # [b, h] full partitions per row
        chunks = int(full.max())  # the widest row sets the tensor shape; each row is masked to its own count
        if chunks < 2:
            return
        # Members first, by position; the rest after them (only ever gathered as padding, never written).
        order = torch.where(members, positions, positions + (1 << 40)).argsort(dim=-1)
        taken = order[..., : chunks * self.lag_size]
        new_ranks = self._partition_ranks(layer, taken, chunks)  # [b, h, (chunks - 1) * lag]
        chunk = torch.arange(chunks - 1, device=positions.device).repeat_interleave(self.lag_size)
        scored_now = chunk < (full[..., None] - 1)  # partitions with a successor in this row
        targets = taken[..., : (chunks - 1) * self.lag_size]
        ranks.scatter_(-1, targets, torch.where(scored_now, new_ranks, ranks.gather(-1, targets)))

    def _partition_ranks(self, layer: LayerView, entries: torch.Tensor, chunks: int) -> torch.Tensor:
        """rank / lag_size of `entries` [b, h, chunks * lag] (in partition order) within each of the first
        chunks - 1 partitions, each scored against the next: [b, h, (chunks - 1) * lag]."""
        batch, heads = entries.shape[:2]
        d = layer.keys.shape[-1]
        index = entries[..., None].expand(-1, -1, -1, d)
        keys = layer.keys.float().gather(2, index).view(batch, heads, chunks, self.lag_size, d)
        values = layer.values.float().gather(2, index).view(batch, heads, chunks, self.lag_size, -1)
        combined = (lag_relative_scores(keys, self.lag_size) + lag_relative_scores(values, self.lag_size)) / 2
        ranks = combined.argsort(dim=-1).argsort(dim=-1).float() / self.lag_size
        return ranks.reshape(batch, heads, -1)

    def _score_again(self, layer: LayerView) -> torch.Tensor:
        """`rescore`: the survivors re-partitioned and re-scored; unscored entries (and sinks) get 1 + recency."""
        scores = recency(layer.positions)
        self._rank_partitions(layer, layer.positions >= self.n_sink, scores)
        return scores

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        return layer.positions < self.n_sink if self.n_sink else None
