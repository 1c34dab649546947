"""Head-adaptive budgets (AdaKV, Feng et al. 2024, arXiv 2407.11550): the heads of a layer share its budget.

`HeadAdaptive(scorer, alpha_safeguard=0.2)` wraps any scoring policy. Design: docs/design/policies.md#adakv-adakvpy"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from keydiff.policies.base import (LayerView, Needs, Policy, SegmentView, check_scores, chooses_whole_segments,
                                   score_then_position)
from keydiff.policies.chunkkv import Chunked
from keydiff.policies.criticalkv import STATE as CRITICAL_STATE
from keydiff.policies.criticalkv import Critical, critical_scores, first_stage
from keydiff.policies.wrappers import PolicyWrapper

HEAD_BUDGETS = ("uniform", "adakv")
HEAD_SCORES = ("raw", "relative")
FORCED = torch.iinfo(torch.int64).max


def safeguard_count(alpha: float, budget: int) -> int:
    """Entries each head keeps whatever the other heads score: floor(alpha x N) (epsilon against float noise)."""
    return math.floor(alpha * budget + 1e-9)


REROTATION_REFUSED = ("key_rerotation with head_budgets=adakv is not supported (the per-head segments "
                      "would each need their own re-rotation); drop one of them")


def refuse_unsupported(scorer: Policy) -> None:
    """One-line ValueError for what head-adaptive budgets cannot wrap: KVzip, ChunkKV and key re-rotation."""
    if scorer.needs.reconstruction:
        raise ValueError(f"{scorer.unwrapped().name} with head_budgets=adakv is not supported (its reconstruction "
                         "passes need dense per-head buffers); drop one of them")
    if scorer.needs.key_rerotation is not None:
        raise ValueError(REROTATION_REFUSED)
    policy = scorer
    while isinstance(policy, PolicyWrapper):
        if isinstance(policy, Chunked):
            raise ValueError("chunk_length with head_budgets=adakv is not supported (ChunkKV keeps whole chunks, "
                             "AdaKV splits the budget between heads entry by entry); drop one of them")
        policy = policy.scorer


def check_head_scores(head_scores: str, scorer: Policy | None = None) -> None:
    """One-line ValueError for an unknown `head_scores`, or "relative" over a scorer whose scores are not attention shares."""
    if head_scores not in HEAD_SCORES:
        raise ValueError(f"unknown head_scores {head_scores!r}; valid: {', '.join(HEAD_SCORES)}")
    needs = None if scorer is None else scorer.needs
    if head_scores == "relative" and needs is not None and needs.attention_rows == 0 and not needs.log_scores:
        raise ValueError(f"head_scores=relative applies to scorers whose scores are attention (snapkv, tova, h2o, "
                         f"expected_attention, ...), not to {scorer.unwrapped().name}; drop it or use head_scores=raw")


def relative_scores(scores: torch.Tensor, log_scores: bool) -> torch.Tensor:
    """One head's scores [..., n] over its mean (log scores: minus their log-mean-exp), so uniform attention scores 1
    whatever the head's count (head_scores=relative). In float64, rounded once to float32."""
    n = scores.shape[-1]
    wide = scores.double()
    if log_scores:
        return (wide - (torch.logsumexp(wide, dim=-1, keepdim=True) - math.log(n))).float()
    return (wide / wide.mean(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)).float()


def check_alpha(alpha: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha_safeguard must be a number in [0, 1], got {alpha!r}")


def adakv_keep(keys: list[torch.Tensor], protected: list[torch.Tensor | None], budget: int,
               alpha: float) -> list[torch.Tensor]:
    """Which entries each head of one batch row keeps (bool masks [n_h], one per head): safeguard and protected first,
    then the highest order keys of all heads, T = heads x N in all."""
    heads = len(keys)
    total = heads * budget
    counts = [int(k.shape[0]) for k in keys]
    masks = [torch.ones(n, dtype=torch.bool, device=k.device) for n, k in zip(counts, keys)]
    excess = sum(counts) - total
    if excess <= 0:
        return masks
    safe = safeguard_count(alpha, budget)
    # Only each head's `excess` lowest unforced entries can be dropped: sort those candidates, not all.
    candidates, owners, indices, forced_total = [], [], [], 0
    for head, (key, protect, n) in enumerate(zip(keys, protected, counts)):
        # A head that cannot lose more than n - safe entries keeps its top `safe` anyway: mark only where it binds.
        binding = safe and n - excess < safe
        forced = torch.zeros(n, dtype=torch.bool, device=key.device) if binding or protect is None else protect.clone()
        if binding:
            forced[torch.topk(key, min(safe, n)).indices] = True
            if protect is not None:
                forced |= protect
        free = n - int(forced.sum())
        forced_total += n - free
        if free:
            lowest = torch.topk(key.masked_fill(forced, FORCED), min(excess, free), largest=False)
            candidates.append(lowest.values)
            indices.append(lowest.indices)
            owners.append(torch.full_like(lowest.indices, head))
    if forced_total > total:
        raise RuntimeError(
            f"head-adaptive budgets: {forced_total} entries are protected or safeguarded, more than the layer's "
            f"total of {total} ({heads} heads x {budget}); lower alpha_safeguard or the protected windows"
        )
    # Lowest key first; equal keys: the higher head drops first (a stable sort from the last head to the first).
    order = torch.sort(torch.cat(candidates[::-1]), stable=True).indices[:excess]
    dropped_heads, dropped = torch.cat(owners[::-1])[order], torch.cat(indices[::-1])[order]
    for head in range(heads):
        masks[head][dropped[dropped_heads == head]] = False
    return masks


def adakv_drop_segments(keys: torch.Tensor, segments: SegmentView, budget: int, alpha: float) -> torch.Tensor:
    """`adakv_keep` for every row of head-adaptive segments at once: bool [rows, P] of the entries dropped.
    keys: int64 order keys [rows, P]; the same choice as `adakv_keep`, in a fixed number of kernels."""
    member, owner, valid = segments.member, segments.owner, segments.valid
    rows, heads = segments.counts.shape
    counts = segments.counts.tolist()
    excess = [sum(row) - heads * budget for row in counts]
    most = max(excess, default=0)
    dropped = torch.zeros_like(valid)
    if most <= 0:
        return dropped
    safe = safeguard_count(alpha, budget)
    binding = [[bool(safe) and e > 0 and n - e < safe for n in row] for row, e in zip(counts, excess)]
    droppable = keys.masked_fill(~valid, FORCED)
    if any(any(row) for row in binding):  # each binding head keeps its own top `safe` (all, if it has fewer)
        lowest = torch.iinfo(torch.int64).min
        own = torch.where(member, keys[:, None, :], lowest)  # [rows, heads, P]
        kth = torch.topk(own, min(safe, own.shape[-1]), dim=-1).values[..., -1]  # [rows, heads]
        bound = torch.tensor(binding, device=keys.device)
        floor = torch.where(bound, kth, FORCED).gather(1, owner)  # [rows, P]
        droppable = droppable.masked_fill(valid & (keys >= floor) & bound.gather(1, owner), FORCED)
    need = torch.tensor(excess, device=keys.device).clamp_min(0)
    lowest = torch.topk(droppable, most, dim=1, largest=False).values  # [rows, most], ascending
    threshold = lowest.gather(1, (need - 1).clamp_min(0)[:, None])  # [rows, 1]: the excess-th lowest
    active = (need > 0)[:, None]
    if bool((active & (threshold == FORCED)).any()):
        raise RuntimeError("head-adaptive budgets: a row has fewer droppable entries than it must drop")
    dropped = active & (droppable < threshold)
    tied = active & (droppable == threshold)  # at most one entry per head (keys are unique within a head)
    missing = need - dropped.sum(dim=1)  # [rows]
    tied_heads = (member & tied[:, None]).any(dim=-1)  # [rows, heads]
    above = tied_heads.flip(1).cumsum(1).flip(1) - tied_heads.long()  # tied heads above each head
    chosen = tied_heads & (above < missing[:, None])  # the `missing` highest tied heads
    return dropped | (tied & chosen.gather(1, owner))


@dataclass
class HeadAdaptive(PolicyWrapper):
    """The heads of each layer share its budget T = kv_heads x N (AdaKV), each keeping at least floor(alpha_safeguard x N)."""

    alpha_safeguard: float = 0.2
    head_scores: str = "raw"  # "relative": each head's scores over their mean (relative_scores) before the choice

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_unsupported(self.scorer)
        check_head_scores(self.head_scores, self.scorer)

    @property
    def needs(self) -> Needs:
        """Head-adaptive, each layer's segments a buffer of their own (never stacked); all segments of a row are chosen
        on at once (`drop_segments`) when the wrapped policy's scores are raw (no window, no CriticalKV)."""
        return replace(super().needs, head_adaptive=True, rows_alike=False, batch_invariant=False,
                       segment_scores=self.scorer.needs.segment_scores and self.head_scores == "raw")

    def check_parameters(self, budget: int | None = None) -> None:
        check_alpha(self.alpha_safeguard)

    def checked(self, scores: torch.Tensor, head: LayerView, protect: torch.Tensor | None) -> torch.Tensor:
        """`scores` as float32, checked (`check_scores`) at the first eviction, or at every one when asked."""
        if self._check_every_call or not self.__dict__.get("_scores_checked"):
            check_scores(self, scores, head, protect)
            self.__dict__["_scores_checked"] = True
        return scores.float()

    def order_keys(self, head: LayerView, budget: int, scorer: Policy | None = None,
                   scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One head's (order keys [n], protected [n] or None) from a policy's score and protected (default the
        wrapped policy's; `scores`: its scores, already computed)."""
        scorer = scorer or self.scorer
        protect = scorer.protected(head, budget)
        scores = self.checked(scorer.score(head) if scores is None else scores, head, protect)
        if self.head_scores == "relative":  # before the protected entries become +inf: they count in the mean
            scores = relative_scores(scores, scorer.needs.log_scores)
        if protect is not None:
            scores = scores.masked_fill(protect, float("inf"))
        return score_then_position(scores, head.positions)[0, 0], None if protect is None else protect[0, 0]

    def drop_segments(self, segments: SegmentView, budget: int) -> torch.Tensor:
        if not chooses_whole_segments(self):
            return Policy.drop_segments(self, segments, budget)  # head by head (`keep_heads`)
        scores = self.scorer.score_segments(segments).float()
        return adakv_drop_segments(score_then_position(scores, segments.positions), segments, budget,
                                   self.alpha_safeguard)

    def keep_heads(self, heads: list[LayerView], budget: int) -> list[torch.Tensor]:
        """Bool masks of the entries each head keeps ([n_h] per head of one batch row; views of one head each)."""
        if isinstance(self.scorer, Critical):
            return self.keep_heads_critical(heads, budget)
        ordered = [self.order_keys(head, budget) for head in heads]
        return adakv_keep([k for k, _ in ordered], [p for _, p in ordered], budget, self.alpha_safeguard)

    def keep_heads_critical(self, heads: list[LayerView], budget: int) -> list[torch.Tensor]:
        """AdaKV form of CriticalKV (kvpress's `CriticalAdaKVPress`): head counts N_h from AdaKV over the RAW scores,
        then CriticalKV's two stages within each head, its safeguard entries kept too (docs/design/policies.md)."""
        critical = self.scorer
        inner = critical.scorer
        raw = [inner.score(head) for head in heads]
        ordered = [self.order_keys(head, budget, inner, scores) for head, scores in zip(heads, raw)]
        counts = [int(mask.sum()) for mask in
                  adakv_keep([k for k, _ in ordered], [p for _, p in ordered], budget, self.alpha_safeguard)]
        masks = []
        for head, scores, (_, protect), count in zip(heads, raw, ordered, counts):
            n = head.positions.shape[-1]
            if count >= n:
                masks.append(torch.ones(n, dtype=torch.bool, device=head.positions.device))
                continue
            protect = None if protect is None else protect[None, None]
            first = max(critical.first_stage_count(count), safeguard_count(self.alpha_safeguard, budget))
            stage_one = first_stage(scores, head.positions, protect, first)
            if protect is not None:
                stage_one |= protect
            rescaled = critical_scores(scores, head.state[CRITICAL_STATE], critical.scaled_epsilon(head),
                                       inner.needs.log_scores)
            keys = score_then_position(rescaled.float().masked_fill(stage_one, float("inf")), head.positions)[0, 0]
            keep = torch.zeros(n, dtype=torch.bool, device=keys.device)
            masks.append(keep.index_fill_(0, torch.topk(keys, count).indices, True))
        return masks

    def describe(self) -> dict:
        """The wrapped policy's description with head_budgets, alpha_safeguard (and head_scores where not raw)
        added before `layer_budgets`."""
        described = self.scorer.describe()
        schedule = described.pop("layer_budgets", None)
        relative = {"head_scores": self.head_scores} if self.head_scores != "raw" else {}
        return {**described, "head_budgets": "adakv", "alpha_safeguard": self.alpha_safeguard, **relative,
                "layer_budgets": schedule}


__all__ = ["HEAD_BUDGETS", "HEAD_SCORES", "REROTATION_REFUSED", "HeadAdaptive", "adakv_drop_segments", "adakv_keep",
           "check_alpha", "check_head_scores", "refuse_unsupported", "relative_scores", "safeguard_count"]
