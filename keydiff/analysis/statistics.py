"""The statistics behind the paper's analysis figures and Table 3, on captured keys, queries and attention.

Plain tensors (from `keydiff.capture`), token axis second to last, any leading batch of heads.
Design: docs/design/reports.md#figures-reportfigures-analysisfigures
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from keydiff.policies.keydiff import ANCHORS, keydiff_anchor

# The (layer, KV head) pairs of the paper's PCA figures on Llama-3.2-3B (28 layers, 8 KV heads):
# Figure 5 (layer 5, head 3), Figure 8 (27, 4), Figure 9 (20, 0), Figure 10 (8, 1).
PAPER_PCA_HEADS = {"fig05": (5, 3), "fig08": (27, 4), "fig09": (20, 0), "fig10": (8, 1)}
PAPER_NUM_LAYERS = 28


def scaled_heads(num_layers: int, kv_heads: int) -> dict[str, tuple[int, int]]:
    """The paper's PCA (layer, KV head) choices mapped onto a model of another depth and width (layers scaled and
    rounded, heads mod kv_heads): the identity on Llama-3.2-3B."""
    scale = (num_layers - 1) / (PAPER_NUM_LAYERS - 1)
    return {name: (round(layer * scale), head % kv_heads) for name, (layer, head) in PAPER_PCA_HEADS.items()}


def pairwise_cosine(x: torch.Tensor) -> torch.Tensor:
    """[..., n, d] -> [..., n, n] cosine similarity of every pair of rows."""
    unit = F.normalize(x.float(), dim=-1, eps=1e-8)
    return unit @ unit.transpose(-1, -2)


def keydiff_score(keys: torch.Tensor, anchor: str = "normalized_mean") -> torch.Tensor:
    """[..., n, d] -> [..., n] KeyDiff's score -cos(k_i, anchor) (Eq. 8; higher = more distinct, kept first); with
    the default anchor it ranks keys as Eq. 7's negative row sums of the pairwise cosine matrix."""
    if anchor not in ANCHORS:
        raise ValueError(f"unknown anchor {anchor!r}; valid: {', '.join(ANCHORS)}")
    keys = keys.float()
    squeeze = keys.dim() == 2
    batched = keys[None, None] if squeeze else keys.reshape(-1, 1, *keys.shape[-2:])
    score = -F.cosine_similarity(batched, keydiff_anchor(batched, anchor), dim=-1, eps=1e-8)
    return score[0, 0] if squeeze else score.reshape(keys.shape[:-1])


def expand_to_query_heads(keys: torch.Tensor, query_heads: int) -> torch.Tensor:
    """[H_kv, ...] -> [H, ...]: each query head gets the keys of its KV group (heads grouped consecutively)."""
    return keys.repeat_interleave(query_heads // keys.shape[0], dim=0)


def mean_cosine(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """cos(mean key, mean query) per query head (Figure 14): keys [H_kv, n, d], queries [H, n, d] -> [H]."""
    mean_keys = expand_to_query_heads(keys.float().mean(dim=1), queries.shape[0])
    return F.cosine_similarity(mean_keys, queries.float().mean(dim=1), dim=-1, eps=1e-8)


def top_keydiff_key(keys: torch.Tensor, anchor: str = "normalized_mean") -> torch.Tensor:
    """The highest-scoring key of each KV head under KeyDiff: keys [H_kv, n, d] -> [H_kv, d]."""
    best = keydiff_score(keys, anchor).argmax(dim=-1)
    return keys.float()[torch.arange(keys.shape[0]), best]


def top_key_query_cosine(keys: torch.Tensor, queries: torch.Tensor, anchor: str = "normalized_mean") -> torch.Tensor:
    """cos(top KeyDiff key, mean query) per query head (Figure 16): [H]."""
    top = expand_to_query_heads(top_keydiff_key(keys, anchor), queries.shape[0])
    return F.cosine_similarity(top, queries.float().mean(dim=1), dim=-1, eps=1e-8)




@dataclass
class PCA:
    mean: torch.Tensor  # [d]
    components: torch.Tensor  # [k, d], orthonormal rows, by decreasing variance
    explained: torch.Tensor  # [k] share of the total variance each component explains


def fit_pca(points: torch.Tensor, k: int = 2) -> PCA:
    """Principal axes of points [n, d] (SVD of the centred matrix, float64); signs fixed so results are stable."""
    x = points.double()
    mean = x.mean(dim=0)
    _, singular, vh = torch.linalg.svd(x - mean, full_matrices=False)
    components = vh[:k]
    # Sign convention: the largest-magnitude coordinate of each component is positive.
    signs = torch.sign(components.gather(1, components.abs().argmax(dim=1, keepdim=True)))
    components = components * torch.where(signs == 0, 1.0, signs)
    variance = singular**2
    return PCA(mean.float(), components.float(), (variance[:k] / variance.sum().clamp_min(1e-300)).float())


def project(points: torch.Tensor, pca: PCA) -> torch.Tensor:
    """[n, d] -> [n, k] coordinates along the principal axes."""
    return (points.float() - pca.mean) @ pca.components.T




def log_volume(keys: torch.Tensor, normalize: bool = False, ridge: float = 0.0) -> torch.Tensor:
    """log det(K K^T) of a cache K [..., n, d] (Figure 12), in float64 with slogdet; returns [...].
    For n > d, K K^T is singular, so ridge = 0 (the default) gives the log pseudo-determinant (log det(K^T K) when
    n >= d): the log squared volume the keys span, with no regulariser. ridge > 0 gives log det(K K^T + ridge I).
    normalize=True uses unit keys. -inf where slogdet finds a zero or negative determinant."""
    k = keys.double()
    if normalize:
        k = F.normalize(k, dim=-1, eps=1e-12)
    n, d = k.shape[-2], k.shape[-1]
    if ridge > 0:
        gram = k @ k.transpose(-1, -2) + ridge * torch.eye(n, dtype=k.dtype)
    else:
        gram = k.transpose(-1, -2) @ k if n >= d else k @ k.transpose(-1, -2)
    sign, logabs = torch.linalg.slogdet(gram)
    return torch.where(sign > 0, logabs, torch.full_like(logabs, -math.inf))




def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks along the last axis, ties sharing their average rank (as scipy.stats.rankdata)."""
    x = x.double()
    ordered = x.sort(dim=-1).values.contiguous()
    below = torch.searchsorted(ordered, x.contiguous(), right=False)  # entries strictly smaller
    through = torch.searchsorted(ordered, x.contiguous(), right=True)  # entries smaller or equal
    return (below + 1 + through).double() / 2


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spearman's rho along the last axis (Pearson correlation of average ranks); NaN where one side is constant."""
    if x.shape != y.shape:
        raise ValueError(f"spearman needs equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
    rx, ry = average_ranks(x), average_ranks(y)
    rx = rx - rx.mean(dim=-1, keepdim=True)
    ry = ry - ry.mean(dim=-1, keepdim=True)
    denominator = (rx.square().sum(dim=-1) * ry.square().sum(dim=-1)).sqrt()
    rho = (rx * ry).sum(dim=-1) / denominator
    return torch.where(denominator > 0, rho, torch.full_like(rho, math.nan))


ATTENTION_TARGETS = ("mean_received", "column_sum", "last_row")


def keydiff_attention_spearman(
    keys: torch.Tensor, attention: torch.Tensor, anchor: str = "normalized_mean"
) -> torch.Tensor:
    """Table 3's statistic for one layer: per query head, Spearman's rho between -cos(k, anchor) and attention. keys
    [H_kv, n, d], attention [H, n] (e.g. `LayerCapture.received_mean`) -> [H]."""
    score = expand_to_query_heads(keydiff_score(keys, anchor), attention.shape[0])
    return spearman(score, attention)
