"""KeyDiff (paper §3.2): keep the keys least similar to the other keys of the cache: Eq. 8's anchor score, and
`KeyDiffPairwise`, Eq. 7's exact O(n²) form. Design: docs/design/policies.md#keydiff-keydiffpy"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from keydiff.policies.base import LayerView, Needs, Policy, SegmentView, float32_norms

ANCHORS = ("normalized_mean", "mean", "median")
METRICS = ("cosine", "dot", "euclidean")


def keydiff_anchor(keys: torch.Tensor, anchor: str) -> torch.Tensor:
    """Anchor vector per head [batch, kv_heads, 1, head_dim] from keys [batch, kv_heads, n, head_dim].

    normalized_mean: mean of the unit-normalised keys (Eq. 8, Table 15 "KeyDiff", the default). mean: mean of the raw
    keys (the §3.2 remark that mu(K) works as well as mu(K-hat)). median: element-wise median of the unit-normalised
    keys (Table 15 "Median")."""
    if anchor == "normalized_mean":
        return F.normalize(keys, dim=-1).mean(dim=2, keepdim=True)
    if anchor == "mean":
        return keys.mean(dim=2, keepdim=True)
    if anchor == "median":
        return F.normalize(keys, dim=-1).median(dim=2, keepdim=True).values
    raise ValueError(f"unknown anchor {anchor!r}; valid: {', '.join(ANCHORS)}")


def inverse_key_norms(keys: torch.Tensor) -> torch.Tensor:
    """1 / max(||k||, 1e-8) per entry [batch, kv_heads, n], in float32 (accumulated in float32 without a float32
    copy of the keys on a GPU, whose reduction kernels widen half precision as they read it)."""
    return float32_norms(keys).clamp_min(1e-8).reciprocal()


# Half-precision keys are scored in float32 in slices of (row, KV head) pairs whose float32 copy stays under
# FLOAT_SLICE_BYTES, at most FLOAT_SLICES of them (`in_float32`): a whole copy bounded, few kernels per score.
FLOAT_SLICE_BYTES = 64 << 20
FLOAT_SLICES = 16


def float_slices(keys: torch.Tensor) -> int:
    """How many slices `in_float32` scores half-precision `keys` in: 1 while their float32 copy fits FLOAT_SLICE_BYTES, else more."""
    pairs = keys.shape[0] * keys.shape[1]
    wanted = -(-keys.numel() * 4 // FLOAT_SLICE_BYTES)
    return max(1, min(wanted, FLOAT_SLICES, pairs // 2))


def in_float32(score: Callable[..., torch.Tensor], keys: torch.Tensor, *per_entry: torch.Tensor | None) -> torch.Tensor:
    """score(keys, *per_entry) [batch, kv_heads, n] with the keys in float32, half precision widened a slice of (row,
    head) pairs at a time so no float32 copy of the whole cache exists (a CUDA graph's pool would keep it)."""
    batch, heads = keys.shape[:2]
    slices = 1 if keys.dtype not in (torch.float16, torch.bfloat16) else float_slices(keys)
    if slices < 2:
        return score(keys.float(), *per_entry)
    # flatten: a view (a cache's keys are a slice of the entries of whole (row, head) planes)
    split = [keys.flatten(0, 1).tensor_split(slices)] + [
        [None] * slices if e is None else e.flatten(0, 1).tensor_split(slices) for e in per_entry]
    parts = [score(part[:, None].float(), *[None if e is None else e[:, None] for e in entries])
             for part, *entries in zip(*split)]
    return torch.cat(parts).view(batch, heads, *parts[0].shape[2:])


def cosine_to_mean(keys: torch.Tensor, normalized: bool, inv_norms: torch.Tensor | None = None) -> torch.Tensor:
    """cos(k_i, anchor) [..., n] of keys [..., n, d] with the mean (of unit keys if `normalized`) as anchor, from
    the inverse key norms and two matrix-vector products (nothing the size of the keys is allocated)."""
    if inv_norms is None:
        inv_norms = inverse_key_norms(keys)
    if normalized:
        anchor = (inv_norms[..., None, :] @ keys) / keys.shape[-2]  # [..., 1, d]
    else:
        anchor = keys.mean(dim=-2, keepdim=True)
    dots = (keys @ anchor.transpose(-1, -2)).squeeze(-1)  # [..., n]
    return dots * inv_norms / torch.linalg.vector_norm(anchor, dim=-1).clamp_min(1e-8)


def cosine_to_segment_means(keys: torch.Tensor, segments: SegmentView, normalized: bool,
                            inv_norms: torch.Tensor) -> torch.Tensor:
    """`cosine_to_mean` for every head of every row of head-adaptive segments at once: [rows, P] (free cells mean
    nothing)."""
    weights = torch.where(segments.member, inv_norms[:, None, :], 0.0) if normalized else segments.member.to(keys.dtype)
    anchors = (weights @ keys) / segments.counts.clamp_min(1)[..., None].to(keys.dtype)  # [rows, heads, d]
    dots = (keys @ anchors.transpose(1, 2)).gather(2, segments.owner[..., None]).squeeze(2)  # [rows, P]
    norms = torch.linalg.vector_norm(anchors, dim=-1).clamp_min(1e-8).gather(1, segments.owner)
    return dots * inv_norms / norms


@dataclass
class KeyDiff(Policy):
    """Keep the keys most dissimilar to the anchor. metric (Table 16): cosine (default, -cos), dot (-k·anchor) or
    euclidean (||k - anchor||). The sliding window of Table 14 is a RecentWindow around it (`window_fraction`)."""

    name: ClassVar[str] = "keydiff"
    recent_window_parameter: ClassVar[str | None] = "window_fraction"
    anchor: str = "normalized_mean"
    metric: str = "cosine"

    def validate(self, budget: int) -> None:
        if self.anchor not in ANCHORS:
            raise ValueError(f"keydiff anchor {self.anchor!r} is not valid; valid: {', '.join(ANCHORS)}")
        if self.metric not in METRICS:
            raise ValueError(f"keydiff metric {self.metric!r} is not valid; valid: {', '.join(METRICS)}")

    def initial_state(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"inv_norm": inverse_key_norms(keys)}

    @property
    def needs(self) -> Needs:
        """1/||k|| of every entry is state, computed once when the entry is written (initial_state), not at every
        step; the cosine to a mean anchor is scored on all head-adaptive segments of a row at once
        (`cosine_to_segment_means`)."""
        return Needs(state=("inv_norm",), host_reads=False, rows_alike=True, batch_invariant=True,
                     segment_scores=self.metric == "cosine" and self.anchor in ("normalized_mean", "mean"))

    def score_segments(self, segments: SegmentView) -> torch.Tensor:
        return -cosine_to_segment_means(segments.keys.float(), segments, self.anchor == "normalized_mean",
                                        segments.state["inv_norm"])

    def score(self, layer: LayerView) -> torch.Tensor:
        # in float32: half precision a slice at a time (in_float32), float32 as it is
        if self.metric == "cosine" and self.anchor in ("normalized_mean", "mean"):
            normalized = self.anchor == "normalized_mean"
            return in_float32(lambda keys, inv: -cosine_to_mean(keys, normalized, inv), layer.keys,
                              layer.state.get("inv_norm"))
        return in_float32(self.score_to_anchor, layer.keys)

    def score_to_anchor(self, keys: torch.Tensor) -> torch.Tensor:
        anchor = keydiff_anchor(keys, self.anchor)
        if self.metric == "cosine":
            return -F.cosine_similarity(keys, anchor, dim=-1, eps=1e-8)
        if self.metric == "dot":
            return -(keys * anchor).sum(dim=-1)
        return (keys - anchor).norm(dim=-1)


@dataclass
class KeyDiffPairwise(Policy):
    """Eq. 7 verbatim: score_i = -sum_j cos(k_i, k_j). O(n²) time and memory; a reference for Eq. 8."""

    name: ClassVar[str] = "keydiff_pairwise"
    needs: ClassVar[Needs] = Needs(host_reads=False, rows_alike=True, batch_invariant=True)
    recent_window_parameter: ClassVar[str | None] = "window_fraction"

    def score(self, layer: LayerView) -> torch.Tensor:
        def pairwise(keys: torch.Tensor) -> torch.Tensor:
            unit = F.normalize(keys, dim=-1)
            return -(unit @ unit.transpose(-1, -2)).sum(dim=-1)

        return in_float32(pairwise, layer.keys)
