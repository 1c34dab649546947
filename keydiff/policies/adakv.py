"""Head-adaptive budgets (AdaKV, Feng et al. 2024, arXiv 2407.11550): the heads of a layer share its budget.

`HeadAdaptive(scorer, alpha_safeguard=0.2)` wraps any scoring policy. A layer's budget is a total,
T = kv_heads x N, not N per KV head: after each pass the layer keeps the T entries with the highest scores
over all its heads together (per batch row), so a head whose scores are high keeps more than N and one whose
scores are low keeps fewer. AdaKV's safeguard: each head first keeps its own top floor(alpha_safeguard x N)
entries whatever the other heads score (kvpress's `AdaKVPress` default 0.2). Entries the wrapped policy
protects (sinks, SnapKV's observation window, a RecentWindow) are always kept, as in the uniform form.

Scores. Each head is scored on its own (`LayerView` of one batch row and one KV head: its own entries, its
attention statistic, its slice of the query statistics), so a per-head quantity such as KeyDiff's anchor is
the mean over that head's entries, as in the uniform form. Scores of different heads are compared as they
are: the scorer's scale must mean the same in every head (kvpress makes the same assumption). Under
block-wise prefill it does not quite, for attention: the heads hold different counts n_h after the first
eviction, each query row's attention sums to 1 over its head's n_h + B entries, so a head holding more entries
gets lower scores per entry and the split leans back towards even at every block (kvpress's one pass scores
every head over the same L entries). The default keeps AdaKV's definition (raw scores, `head_scores="raw"`);
`head_scores="relative"` divides each head's scores by their mean first (`relative_scores`: uniform attention
scores 1 in every head, whatever its count; in float64, so the order of a head's entries changes no bit of
it), for attention-based scorers only; docs/policies.md, "Heads of
different lengths under block-wise prefill". A scorer that scores whole pools (`scores_pools`: KeyDiff)
is asked once for every head of every layer (`drop_pool` -> `adakv_drop_pool`, the same choice; the cache
then evicts all its layers in one call, keydiff.cache.adaptive.evict_stack).

Order. Every entry gets one key: its score (float32), then its position (the newer kept first, as
`Policy.evict_indices`), then its head (the lower head index kept first): `adakv_keep` keeps the forced
entries (protected, safeguard) and then the best others up to T. With alpha_safeguard = 1 every head keeps
exactly its own top N, the uniform policy's choice. Memory: the cache holds head-adaptive layers in a pool
with one segment per head (keydiff.cache.adaptive), so at most T entries (+ kv_heads x the block) are held.

With CriticalKV (`HeadAdaptive(Critical(scorer))`, kvpress's `CriticalAdaKVPress`): the head counts are chosen
over the wrapped scorer's RAW scores, then each head runs CriticalKV's two stages within its count
(`keep_heads_critical`). Refused (one-line ValueError when built, `refuse_unsupported`): KVzip, ChunkKV and key
re-rotation (see docs/policies.md, "With CriticalKV and other options").

Differences from kvpress's `AdaKVPress` (read, not copied): kvpress keeps every entry in the cache and masks
the pruned ones in its attention patch (no memory is freed); it takes the safeguard as int(alpha x N); ties
are broken by torch.topk's order. Here the dropped entries are removed, ties are deterministic, the safeguard
is floor(alpha x N) (the same for these inputs) and eviction runs after every block and generated token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from keydiff.policies.base import LayerView, Policy, PoolView, check_scores, score_then_position
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


REROTATION_REFUSED = ("key_rerotation with head_budgets=adakv is not supported (the pool's per-head segments "
                      "would each need their own re-rotation); drop one of them")


def refuse_unsupported(scorer: Policy) -> None:
    """One-line ValueError for what head-adaptive budgets cannot wrap: a policy with reconstruction passes
    (KVzip: its scratch passes write after a layer's dense entries, which a pool of per-head segments does not
    have), ChunkKV (it keeps whole chunks, by default one set per layer; AdaKV splits a layer's budget entry by
    entry between heads, and a one-head view would silently turn chunk_scope=layer into head), and key
    re-rotation (not implemented over per-head segments)."""
    if scorer.needs_reconstruction:
        raise ValueError(f"{scorer.unwrapped().name} with head_budgets=adakv is not supported (its reconstruction "
                         "passes need dense per-head buffers); drop one of them")
    if scorer.key_rerotation is not None:
        raise ValueError(REROTATION_REFUSED)
    policy = scorer
    while isinstance(policy, PolicyWrapper):
        if isinstance(policy, Chunked):
            raise ValueError("chunk_length with head_budgets=adakv is not supported (ChunkKV keeps whole chunks, "
                             "AdaKV splits the budget between heads entry by entry); drop one of them")
        policy = policy.scorer


def check_head_scores(head_scores: str, scorer: Policy | None = None) -> None:
    """One-line ValueError for an unknown `head_scores`, or "relative" over a scorer whose scores are not a
    share of attention (KeyDiff, K-norm, ...: a mean of them means nothing, and their scale does not depend
    on a head's count)."""
    if head_scores not in HEAD_SCORES:
        raise ValueError(f"unknown head_scores {head_scores!r}; valid: {', '.join(HEAD_SCORES)}")
    if head_scores == "relative" and scorer is not None and scorer.attention_rows == 0 and not scorer.log_scores:
        raise ValueError(f"head_scores=relative applies to scorers whose scores are attention (snapkv, tova, h2o, "
                         f"expected_attention, ...), not to {scorer.unwrapped().name}; drop it or use head_scores=raw")


def relative_scores(scores: torch.Tensor, log_scores: bool) -> torch.Tensor:
    """One head's scores [..., n] over its mean: 1 = the head's average entry, so a head over which attention
    is uniform scores 1 everywhere whatever its count n (log scores: minus their log-mean-exp). For attention
    sums (each query row's weights sum to 1 over the head's n entries, so the mean is rows / n) this is the
    score x n / rows, the count-independent form (head_scores=relative).

    In float64, rounded once to float32 at the end: the mean of n float32 scores is then (all but) exact
    whatever order a kernel adds them in, so the relative score is a function of the scores alone, not of
    the machine's vector width, and the quotient is rounded once, not twice. (The scores themselves can differ
    by an ULP between machines: docs/testing.md, "Goldens on every vector path".)"""
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
    """Which entries each head of one batch row keeps: bool masks [n_h], one per head.

    keys: per head, int64 order keys [n_h] (higher = keep first; unique within a head: score then position).
    protected: per head, bool [n_h] of entries always kept, or None. budget: N, so the layer keeps T = heads x N
    in all (everything if it holds no more). Each head's top floor(alpha x N) by key and its protected entries
    are kept first; the rest of T goes to the highest keys of all heads, ties to the lower head index.
    """
    heads = len(keys)
    total = heads * budget
    counts = [int(k.shape[0]) for k in keys]
    masks = [torch.ones(n, dtype=torch.bool, device=k.device) for n, k in zip(counts, keys)]
    excess = sum(counts) - total
    if excess <= 0:
        return masks
    safe = safeguard_count(alpha, budget)
    # Each head's `excess` lowest unforced entries are the only ones that can be dropped: gather those
    # candidates, then drop the `excess` lowest of them (a sort of at most heads x excess keys, not of all).
    candidates, owners, indices, forced_total = [], [], [], 0
    for head, (key, protect, n) in enumerate(zip(keys, protected, counts)):
        # A head drops only its own lowest entries, so if it cannot lose more than n - safe of them its top
        # `safe` are kept anyway: the safeguard needs marking only where it can bind (not while decoding).
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
    # Lowest key first; equal keys: the higher head is dropped first (the lower one kept), via a stable sort of
    # the candidates listed from the last head to the first.
    order = torch.sort(torch.cat(candidates[::-1]), stable=True).indices[:excess]
    dropped_heads, dropped = torch.cat(owners[::-1])[order], torch.cat(indices[::-1])[order]
    for head in range(heads):
        masks[head][dropped[dropped_heads == head]] = False
    return masks


def adakv_drop_pool(keys: torch.Tensor, pool: PoolView, budget: int, alpha: float) -> torch.Tensor:
    """`adakv_keep` for every row of head-adaptive pools at once: bool [rows, P] of the entries dropped.

    keys: int64 order keys [rows, P] (higher = keep first; unique within a head). A row holding more than
    T = kv_heads x N drops its `excess` lowest keys but those its heads must keep: a head's own top
    floor(alpha x N) where the safeguard can bind (as `adakv_keep`, a head that cannot lose that many needs no
    mark). Equal keys of different heads: the higher head's dropped first. No protected entries (pool scorers
    protect none). The same choice as `adakv_keep` on each row's heads, in a fixed number of kernels.
    """
    member, owner, valid = pool.member, pool.owner, pool.valid
    rows, heads = pool.counts.shape
    counts = pool.counts.tolist()
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
    """The heads of each layer share its budget T = kv_heads x N (AdaKV); each keeps at least
    floor(alpha_safeguard x N) of its own best entries. The cache stores such layers head by head
    (keydiff.cache.adaptive): `head_adaptive` tells it to."""

    alpha_safeguard: float = 0.2
    head_scores: str = "raw"  # "relative": each head's scores over their mean (relative_scores) before the choice

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_unsupported(self.scorer)
        check_head_scores(self.head_scores, self.scorer)

    @property
    def head_adaptive(self) -> bool:
        return True

    @property
    def layers_batchable(self) -> bool:
        return False  # each layer has a pool of its own; never stacked

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
            scores = relative_scores(scores, scorer.log_scores)
        if protect is not None:
            scores = scores.masked_fill(protect, float("inf"))
        return score_then_position(scores, head.positions)[0, 0], None if protect is None else protect[0, 0]

    @property
    def chooses_pools(self) -> bool:
        """Whole pools are chosen on (`drop_pool`) when the wrapped policy scores them (KeyDiff, alone or in a
        window of size 0): not with a window (it protects entries) nor CriticalKV (two stages per head)."""
        return self.scorer.scores_pools and self.head_scores == "raw"

    def drop_pool(self, pool: PoolView, budget: int) -> torch.Tensor:
        scores = self.scorer.score_pool(pool).float()
        return adakv_drop_pool(score_then_position(scores, pool.positions), pool, budget, self.alpha_safeguard)

    def keep_heads(self, heads: list[LayerView], budget: int) -> list[torch.Tensor]:
        """Bool masks of the entries each head keeps ([n_h] per head of one batch row; views of one head each)."""
        if isinstance(self.scorer, Critical):
            return self.keep_heads_critical(heads, budget)
        ordered = [self.order_keys(head, budget) for head in heads]
        return adakv_keep([k for k, _ in ordered], [p for _, p in ordered], budget, self.alpha_safeguard)

    def keep_heads_critical(self, heads: list[LayerView], budget: int) -> list[torch.Tensor]:
        """AdaKV form of CriticalKV (kvpress's `CriticalAdaKVPress`): each head's count N_h is AdaKV's choice
        over the RAW scores of the scorer CriticalKV wraps (its protected entries and the safeguard forced);
        then, within each head, CriticalKV's two stages fill N_h: stage 1 keeps what the scorer protects and
        its floor(first_stage_ratio x N_h) best raw scores, stage 2 the best (score + epsilon) x ||W_o v||_1
        of the rest (ties by position, newer first, as everywhere). The head's safeguard entries (its top
        floor(alpha x N) raw) are kept as well: kvpress gives them the largest score in both stages, so stage 1
        keeps the top max(floor(first_stage_ratio x N_h), floor(alpha x N)) raw scores. The counts are
        `adakv_keep`'s, ties included (equal raw scores at the split: the newer position, then the lower head),
        so they equal plain AdaKV's; kvpress leaves such a tie to torch.topk's order (docs/peers.md)."""
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
            rescaled = critical_scores(scores, head.state[CRITICAL_STATE], critical.scaled_epsilon(head), inner.log_scores)
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


__all__ = ["HEAD_BUDGETS", "HEAD_SCORES", "REROTATION_REFUSED", "HeadAdaptive", "adakv_drop_pool", "adakv_keep",
           "check_alpha", "check_head_scores", "refuse_unsupported", "relative_scores", "safeguard_count"]
