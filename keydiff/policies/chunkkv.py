"""ChunkKV (Liu et al. 2025, arXiv 2502.00299): keep whole chunks of consecutive positions, not single entries.

`Chunked(scorer, chunk_length=20)` scores each chunk by the sum of its scorer's scores and keeps the best chunks.
Design: docs/design/policies.md#chunkkv-chunkkvpy"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from keydiff.policies.base import LayerView, Needs
from keydiff.policies.wrappers import PolicyWrapper


SCOPES = ("layer", "head")


def chunk_scores(scores: torch.Tensor, positions: torch.Tensor, chunk_length: int, scope: str = "layer") -> torch.Tensor:
    """Each entry's chunk score [batch, kv_heads, n]: the sum of `scores` over its row's (or head's) entries in the same chunk."""
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

    @property
    def needs(self) -> Needs:
        """The wrapped policy's (chunk sums are read on the host); its scoring is not read for the batch-invariant kernels."""
        return replace(super().needs, batch_invariant=False)

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
