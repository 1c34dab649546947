"""ChunkKV (Liu et al. 2025, arXiv 2502.00299): keep whole chunks of consecutive positions, not single entries.

`Chunked(scorer, chunk_length=20)` wraps any scoring policy. The positions a KV head holds are grouped into
chunks of `chunk_length` consecutive ABSOLUTE positions (`position // chunk_length`, so a chunk is the same
stretch of text at every eviction, whatever was dropped before); a chunk's score is the sum of the wrapped
scorer's scores of the entries of that chunk the head still holds. Every entry is then scored by its chunk's
score, and the usual top-k (`Policy.evict_indices`: ties by position, the older entry evicted first) keeps
whole chunks, best first. Precision: a chunk's sum is taken in float64 (so a large score does not swallow the
small ones added to it: float32 sums of [2^24, 1, 1, 0] give 2^24, not 2^24 + 2); the ranking, as every
policy's, then compares those sums as float32 (`score_then_position`), so two chunks whose sums differ by less
than float32's resolution (about 6e-8 relative) tie and the newer chunk is kept. kvpress ranks its chunk means
in the scores' own dtype, so this is at least as fine. Where the budget ends inside a chunk, the remainder is filled by the NEWEST
entries (highest positions) of the next-best chunk, so a head always holds exactly its budget. Entries the
wrapped policy protects (SnapKV's observation window, sinks, a RecentWindow) are still kept; their finite
scores count in their chunk's sum like any other, an infinite one (allowed only there) counts 0.

`scope` says over what a chunk's score is summed. "layer" (the default): over the entries of that chunk in
every KV head of the layer, so all heads rank chunks alike and, holding the same positions, keep the same
chunks: kvpress sums over heads and keeps one chunk set per layer, and the paper's layer-wise index reuse
shares one set of kept indices. "head": each KV head ranks its own chunks by its own scores (the per-head
budgets of this harness taken literally). Scores are computed per batch row (a stacked view's rows are
layers), so `layers_batchable` is the wrapped policy's.

Differences from kvpress's `ChunkKVPress` (read, not copied): kvpress sums the scores over KV heads and keeps
one chunk set for all heads of a layer (and takes batch row 0's set for every row), ranks chunks by their
MEAN score (for a full chunk the same order as the sum; the last, partial chunk's mean is not scaled down),
keeps floor(chunks x (1 - compression_ratio)) chunks with no remainder fill (so it may hold fewer entries
than the budget), compresses once after the prompt, and chunks the cache's index (= position there). Here
chunks are scored by the sum (the paper's "summed score"), per layer by default (scope="head" ranks per KV
head), and the budget is filled exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keydiff.policies.base import LayerView
from keydiff.policies.wrappers import PolicyWrapper


SCOPES = ("layer", "head")


def chunk_scores(scores: torch.Tensor, positions: torch.Tensor, chunk_length: int, scope: str = "layer") -> torch.Tensor:
    """Each entry's chunk score [batch, kv_heads, n]: the sum of `scores` over the entries of the same row
    (and, with scope "head", the same KV head) whose positions fall in the same chunk of `chunk_length`
    consecutive positions."""
    chunks = positions // chunk_length
    count = int(chunks.max()) + 1 if chunks.numel() else 1
    totals = torch.zeros(*scores.shape[:-1], count, dtype=scores.dtype, device=scores.device)
    totals.scatter_add_(-1, chunks, scores)
    if scope == "layer":
        totals = totals.sum(dim=1, keepdim=True).expand_as(totals)
    return totals.gather(-1, chunks)


@dataclass
class Chunked(PolicyWrapper):
    """Keep whole chunks of `chunk_length` consecutive positions of each KV head, ranked by the sum of the
    wrapped scorer's scores (ChunkKV); `chunk_length` 1 is the wrapped scorer itself."""

    chunk_length: int = 20
    scope: str = "layer"

    def check_parameters(self, budget: int | None = None) -> None:
        if isinstance(self.chunk_length, bool) or not isinstance(self.chunk_length, int) or self.chunk_length < 1:
            raise ValueError(f"chunk_length must be a positive integer, got {self.chunk_length!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"chunk_scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")

    def score(self, layer: LayerView) -> torch.Tensor:
        # float64 sums, so small scores are not lost beside a large one; the ranking then compares them as
        # float32 (Policy.evict_indices): sums within float32's resolution tie and the newer chunk wins.
        scores = self.scorer.score(layer).double()
        # Only protected entries may score +-inf (they are kept whatever their score): such a score counts 0.
        scores = scores.masked_fill(~torch.isfinite(scores), 0.0)
        return chunk_scores(scores, layer.positions, self.chunk_length, self.scope)

    def describe(self) -> dict:
        """The wrapped policy's description with `chunk_length` added before `layer_budgets`."""
        described = self.scorer.describe()
        schedule = described.pop("layer_budgets", None)
        return {**described, "chunk_length": self.chunk_length, "chunk_scope": self.scope, "layer_budgets": schedule}


__all__ = ["SCOPES", "Chunked", "chunk_scores"]
