"""CriticalKV (Feng et al. 2025, arXiv 2502.03805): rescale any scorer's scores by how much an entry can move the
attention output (`Critical(scorer)`, layer by layer). Design: docs/design/policies.md#criticalkv-criticalkvpy"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from keydiff.policies.base import LayerView, Needs, score_then_position
from keydiff.policies.wrappers import PolicyWrapper

logger = logging.getLogger(__name__)

STATE = "wov_l1"  # the per-entry ||W_o v||_1 (group mean), set when the entry is written


NORM_CHUNK_ELEMENTS = 1 << 24  # float32 elements of W_o v computed at once (64 MB)


def output_norms(values: torch.Tensor, output_projection: torch.Tensor) -> torch.Tensor:
    """||W_o^h v||_1 averaged over the query heads h of each KV group: float32 [batch, kv_heads, n], computed in chunks
    of entries so W_o v stays below NORM_CHUNK_ELEMENTS."""
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
    """Stage 2: (score + epsilon) x norm per entry, shifted (or in the log domain) as the design page says. epsilon:
    a number, or (linear scores) a tensor broadcast against the scores. Non-finite scores are returned as they are."""
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
    def needs(self) -> Needs:
        """The output projection, and ||W_o v||_1 per entry; each layer is scored with its own o_proj weight (never
        stacked). Its scoring is not read for the batch-invariant kernels."""
        inner = super().needs
        return replace(inner, output_projection=True, state=(*inner.state, STATE), rows_alike=False,
                       batch_invariant=False)

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
                               self.scorer.needs.log_scores)

    def scaled_epsilon(self, layer: LayerView) -> float | torch.Tensor:
        """epsilon on the scale of the scorer's scores: x the number of query rows they sum (SnapKV's window, TOVA's
        1 row), since the paper adds it to one query's attention. float32 [batch, kv_heads, 1], or the plain epsilon."""
        needs = self.scorer.needs
        rows = needs.attention_rows
        if (needs.log_scores or layer.attention is None or not isinstance(rows, int) or rows <= 1
                or needs.attention_reduction != "sum"):
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
