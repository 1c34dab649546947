"""CriticalKV (Feng et al. 2025, arXiv 2502.03805, "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective"): rescale any scorer's scores by how much an entry can move the attention output.

An entry's contribution to the layer's output is its attention weight times W_o v, the value projected through
the output-projection rows of the query head reading it; the paper bounds the perturbation from dropping it by
attention x ||W_o v||_1. `Critical(scorer)` selects in two stages, with each KV head's budget N:

1. the floor(first_stage_ratio x N) entries with the highest scores of the wrapped scorer are kept (entries the
   scorer protects, e.g. SnapKV's observation window or a RecentWindow, rank first here, as kvpress's presses
   give them the largest score), together with everything the scorer protects;
2. the rest of the budget goes to the highest (score + epsilon) x ||W_o v||_1, where ||W_o v||_1 is the L1 norm
   of v through each query head's slice of o_proj (o_proj.weight[:, h*d:(h+1)*d]), averaged over the query
   heads of the entry's KV group (as kvpress's `CriticalKVPress.vwl1norm`).

Defaults are the paper's and kvpress's: epsilon 1e-4, first_stage_ratio 0.5. epsilon is added to ONE query's
attention, as in the paper and kvpress (SnapKVPress averages its window's rows); our attention statistic SUMS
the rows a scorer asks for (SnapKV: min(window, block length), 1 while decoding), so for such a scorer epsilon
is multiplied by that row count (`scaled_epsilon`), which ranks exactly as (mean + epsilon) x norm. H2O's
cumulative sum over every query so far has no such count (and no kvpress counterpart): epsilon stays as given. ||W_o v||_1 is per entry and
fixed (the value and the layer's weights never change), so it is computed once when the entry is written
(`entry_state`, state "wov_l1") and moved with the entry; the weight reaches the policy through the cache
(`needs_output_projection`: the attention function hands `module.o_proj.weight` to
`EvictingCache.record_output_projection`, the storage keeps it per layer, `LayerView.output_projection`).

Scores that can be negative. The rescaling assumes a non-negative importance (attention, as in the paper):
multiplying a negative score by a larger norm would LOWER it, reversing the method's meaning. So, per KV head,
a head whose scores reach below 0 is first shifted by its minimum (score - min(0, min score)): an order-
preserving shift after which the least important entry scores 0 and epsilon keeps it from vanishing. Non-
negative scorers (SnapKV, H2O, TOVA: attention) are left as they are, i.e. exactly kvpress's formula. KeyDiff's
-cos in [-1, 1] becomes 1 - cos + (its head's offset), in [0, 2]. A scorer that returns a logarithm
(`log_scores`: Expected Attention) is combined in the log domain: log(exp(score) + epsilon) + log ||W_o v||_1,
the same order as (exp(score) + epsilon) x ||W_o v||_1. kvpress wraps ExpectedAttentionPress with
use_vnorm=False (the norm would count twice); a warning says so here too.

Differences from kvpress: the budget is this cache's N per KV head at every eviction of block-wise prefill and
decoding (kvpress compresses once, keeping int(ratio x (1 - compression_ratio) x length) in stage 1); stage 1
is taken with ties broken by position like every top-k here. W_o is per layer, so `layers_batchable` is False
(each layer is scored with its own weight).

AdaKV form (kvpress's `CriticalAdaKVPress`; `HeadAdaptive(Critical(...))`, preset adakv_criticalkv): head
budgets are first chosen by AdaKV's global top-k over the layer's RAW scores (with the alpha safeguard), then
both stages run per KV head with that head's budget N_h (stage 1: floor(first_stage_ratio x N_h), the head's
safeguard entries kept too): keydiff.policies.adakv.HeadAdaptive.keep_heads_critical, on one-head views whose
`output_projection` is that KV head's group of o_proj columns.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from keydiff.policies.base import LayerView, score_then_position
from keydiff.policies.wrappers import PolicyWrapper

logger = logging.getLogger(__name__)

STATE = "wov_l1"  # the per-entry ||W_o v||_1 (group mean), set when the entry is written


NORM_CHUNK_ELEMENTS = 1 << 24  # float32 elements of W_o v computed at once (64 MB)


def output_norms(values: torch.Tensor, output_projection: torch.Tensor) -> torch.Tensor:
    """||W_o^h v||_1 averaged over the query heads h of each KV group: float32 [batch, kv_heads, n].

    values [batch, kv_heads, n, head_dim]; output_projection [hidden, heads * head_dim] (nn.Linear's weight:
    the output is attn @ weight.T, so query head h's rows of W_o^T are weight[:, h*d:(h+1)*d].T). Query head h
    reads KV head h // groups (transformers' repeat_kv). Every head in one batched product, in chunks of
    entries so that W_o v ([batch, heads, chunk, hidden]) stays below NORM_CHUNK_ELEMENTS.
    """
    batch, kv_heads, n, dim = values.shape
    hidden = output_projection.shape[0]
    heads = output_projection.shape[1] // dim
    if heads * dim != output_projection.shape[1] or heads % kv_heads:
        raise ValueError(f"output projection {list(output_projection.shape)} does not match values "
                         f"{list(values.shape)} ([hidden, heads x head_dim] with heads a multiple of kv_heads)")
    groups = heads // kv_heads
    weight = output_projection.float().t().reshape(kv_heads, groups, dim, hidden)  # head h = (h // groups, h % groups)
    values = values.float()
    out = values.new_empty(batch, kv_heads, n)
    chunk = max(1, NORM_CHUNK_ELEMENTS // max(1, batch * heads * hidden))
    for start in range(0, n, chunk):
        part = values[:, :, None, start:start + chunk]  # [batch, kv_heads, 1, c, d]
        projected = part @ weight  # [batch, kv_heads, groups, c, hidden]
        out[:, :, start:start + chunk] = projected.abs().sum(dim=-1).mean(dim=2)
    return out


def critical_scores(scores: torch.Tensor, norms: torch.Tensor, epsilon: float | torch.Tensor,
                    log_scores: bool) -> torch.Tensor:
    """Stage 2: (score + epsilon) x norm per entry, with the shift (or log domain) described in the module.
    epsilon: one number, or (linear scores only) a tensor broadcast against the scores, e.g. one per head.
    Non-finite scores (allowed only for protected entries) are returned as they are."""
    scores = scores.float()
    finite = torch.isfinite(scores)
    if log_scores:
        rescaled = torch.logaddexp(scores, torch.full_like(scores, math.log(epsilon) if epsilon > 0 else -math.inf))
        rescaled = rescaled + norms.clamp_min(1e-30).log()
    else:
        lowest = scores.masked_fill(~finite, math.inf).amin(dim=-1, keepdim=True)
        shift = lowest.clamp(max=0.0).nan_to_num(0.0, posinf=0.0, neginf=0.0)  # a head with no finite score: 0
        rescaled = (scores - shift + epsilon) * norms
    return torch.where(finite, rescaled, scores)


def first_stage(scores: torch.Tensor, positions: torch.Tensor, protect: torch.Tensor | None,
                count: int | torch.Tensor) -> torch.Tensor:
    """Bool [batch, kv_heads, n]: the `count` highest-scoring entries of each head (protected ones rank first,
    ties by position, newer first). `count` is one number, or per head [batch, kv_heads] (the AdaKV form)."""
    ranked = scores.float().nan_to_num(nan=-math.inf)
    if protect is not None:
        ranked = ranked.masked_fill(protect, math.inf)
    n = scores.shape[-1]
    largest = count if isinstance(count, int) else int(count.max())
    largest = min(largest, n)
    chosen = torch.zeros_like(positions, dtype=torch.bool)
    if largest <= 0:
        return chosen
    order = torch.topk(score_then_position(ranked, positions), largest, dim=-1, sorted=True).indices
    if isinstance(count, int):
        return chosen.scatter_(-1, order, True)
    take = torch.arange(largest, device=order.device) < count[..., None]  # the first count_h of each head
    return chosen.scatter_(-1, order, take)


@dataclass
class Critical(PolicyWrapper):
    """CriticalKV around any scorer: stage 1 keeps floor(first_stage_ratio x budget) entries by the scorer's
    scores, stage 2 fills the budget by (score + epsilon) x ||W_o v||_1 (see the module)."""

    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_parameters()  # a bad value fails when the policy is built, before any model is loaded
        inner = self.scorer.unwrapped()
        if getattr(inner, "use_vnorm", False):
            logger.warning("%s with use_vnorm: the value norm then counts twice under CriticalKV (kvpress wraps "
                           "ExpectedAttentionPress(use_vnorm=False)); set use_vnorm: false", inner.name)

    @property
    def needs_output_projection(self) -> bool:
        return True

    @property
    def state_names(self) -> tuple[str, ...]:
        return (*self.scorer.state_names, STATE)

    @property
    def layers_batchable(self) -> bool:
        return False  # each layer is scored with its own o_proj weight

    def check_parameters(self, budget: int | None = None) -> None:
        for name, value in (("critical_epsilon", self.epsilon), ("first_stage_ratio", self.first_stage_ratio)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.epsilon < 0:
            raise ValueError(f"critical_epsilon must be >= 0, got {self.epsilon}")
        if not 0.0 <= self.first_stage_ratio <= 1.0:
            raise ValueError(f"first_stage_ratio must be in [0, 1], got {self.first_stage_ratio}")

    def first_stage_count(self, budget: int) -> int:
        return math.floor(self.first_stage_ratio * budget + 1e-9)

    def entry_state(self, entries: LayerView) -> dict[str, torch.Tensor]:
        state = dict(self.scorer.entry_state(entries))
        if entries.output_projection is None:
            raise RuntimeError(
                "CriticalKV needs the layer's output projection, but none was recorded: run the model inside "
                "`with keydiff.keydiff_attention(model, cache):` (keydiff.prefill and keydiff.generate do)"
            )
        state[STATE] = output_norms(entries.values, entries.output_projection)
        return state

    def scorer_scores(self, layer: LayerView) -> torch.Tensor:
        """The wrapped scorer's own scores of this view, computed once per eviction (score, then protected):
        what stage 1 ranks by, and what AdaKV's head budgets would be chosen by."""
        cached = self.__dict__.get("_raw")
        if cached is not None and cached[0] is layer:
            return cached[1]
        raw = self.scorer.score(layer)
        self.__dict__["_raw"] = (layer, raw)
        return raw

    def score(self, layer: LayerView) -> torch.Tensor:
        return critical_scores(self.scorer_scores(layer), layer.state[STATE], self.scaled_epsilon(layer),
                               self.scorer.log_scores)

    def scaled_epsilon(self, layer: LayerView) -> float | torch.Tensor:
        """epsilon on the scale of the scorer's scores: x the number of query rows they sum, for a scorer
        whose score sums the attention of its last `attention_rows` queries (SnapKV's window, TOVA's 1 row).

        The paper's and kvpress's epsilon is added to one query's attention (kvpress's SnapKVPress averages its
        window); our statistic sums the rows, so the same epsilon would weigh `rows` times less. Each row's
        softmax sums to 1 over the keys the view holds, so the statistic's total per head is the row count
        (min(window, block length); 1 while decoding). float32 [batch, kv_heads, 1], or the plain epsilon."""
        rows = self.scorer.attention_rows
        if (self.scorer.log_scores or layer.attention is None or not isinstance(rows, int) or rows <= 1
                or self.scorer.attention_reduction != "sum"):
            return self.epsilon
        counted = layer.attention.float().sum(dim=-1, keepdim=True).round().clamp(1, rows)
        return self.epsilon * counted

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        inner = self.scorer.protected(layer, budget)
        count = self.first_stage_count(budget)
        return inner if count == 0 else self.kept_in_stage_one(layer, inner, count)

    def kept_in_stage_one(self, layer: LayerView, inner: torch.Tensor | None, count: int | torch.Tensor) -> torch.Tensor:
        """Bool [batch, kv_heads, n]: stage 1's entries (the `count` best by the scorer's scores, one count or
        one per head [batch, kv_heads] for head budgets) and what the scorer protects (`inner`)."""
        stage_one = first_stage(self.scorer_scores(layer), layer.positions, inner, count)
        self.__dict__.pop("_raw", None)  # the eviction is done with them
        return stage_one if inner is None else stage_one | inner

    def describe(self) -> dict:
        """The wrapped policy's description with the CriticalKV parameters added before `layer_budgets`."""
        described = self.scorer.describe()
        schedule = described.pop("layer_budgets", None)
        return {**described, "critical": True, "critical_epsilon": self.epsilon,
                "first_stage_ratio": self.first_stage_ratio, "layer_budgets": schedule}


__all__ = ["Critical", "STATE", "critical_scores", "first_stage", "output_norms"]
