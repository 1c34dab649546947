"""What an eviction policy is: a scoring rule over the entries of one layer's cache.

A policy sees one layer at a time (`LayerView`, entries in no particular order) and says which entries of each KV head
to drop so that `budget` remain; its `needs` (a `Needs`) say what it needs from the cache and the engine. User guide:
docs/policies.md. Design: docs/design/policies.md#what-a-policy-is-basepy"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Callable, ClassVar

import torch

from keydiff import signals as model_signals
from keydiff.queries import QueryStatistics

logger = logging.getLogger(__name__)


class LayerView:
    """One layer's cache as a policy sees it: views of the valid entries, in buffer order (not position order).

    keys, values [batch, kv_heads, n, head_dim] (keys post-RoPE, as cached); positions [batch, kv_heads, n] absolute
    positions (long). state: per-entry policy state [batch, kv_heads, n], one view per name in `needs.state`; new
    entries start at 0; update it in place (`state["h2o"].add_(...)`): it lives in the cache's buffers. layers: the
    model layers whose rows the view holds, layer-major: one layer, or several when the cache scores them in one call
    (their rows stacked along the batch dimension, see `Needs.rows_alike`); an int is taken as that one layer. signals:
    what the model handed the cache for the signals the policy asked for (keydiff/signals.py), by name; `attention`,
    `queries` and `output_projection` read the built-in ones (and may be given as arguments)."""

    __slots__ = ("keys", "values", "positions", "state", "layers", "signals")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 attention: torch.Tensor | None = None, state: dict[str, torch.Tensor] | None = None,
                 layers: tuple[int, ...] | int = 0, queries: QueryStatistics | None = None,
                 output_projection: torch.Tensor | None = None, signals: dict[str, Any] | None = None):
        self.keys, self.values, self.positions = keys, values, positions
        self.state = {} if state is None else state
        if type(layers) is not tuple:  # the cache's views pass a tuple: nothing to convert (it runs at every eviction)
            if not isinstance(layers, int) or isinstance(layers, bool):
                raise TypeError(f"LayerView.layers must be a layer index or a tuple of them, got {layers!r}")
            layers = (layers,)
        self.layers = layers
        if attention is not None or queries is not None or output_projection is not None:
            signals = dict(signals or {})
            for name, value in (("attention", attention), ("queries", queries),
                                ("output_projection", output_projection)):
                if value is not None:
                    signals[name] = value
        self.signals = {} if signals is None else signals

    @property
    def attention(self) -> torch.Tensor | None:
        """Attention statistic of the forward pass that just ran: for each entry, the attention it received, summed
        over the query rows the policy asked for and averaged over the query heads of its KV group; [batch,
        kv_heads, n] float32, or None if the policy asked for none."""
        return self.signals.get("attention")

    @attention.setter
    def attention(self, value: torch.Tensor | None) -> None:
        self.signals["attention"] = value

    @property
    def queries(self) -> QueryStatistics | None:
        """Running mean/covariance of this layer's pre-RoPE queries (every pass so far), for policies with
        `needs.queries`; None otherwise."""
        return self.signals.get("queries")

    @queries.setter
    def queries(self, value: QueryStatistics | None) -> None:
        self.signals["queries"] = value

    @property
    def output_projection(self) -> torch.Tensor | None:
        """The layer's attention output projection (o_proj.weight, [hidden, heads * head_dim], as the model holds
        it), for policies with `needs.output_projection` (CriticalKV); None otherwise and in stacked views."""
        return self.signals.get("output_projection")

    @output_projection.setter
    def output_projection(self, value: torch.Tensor | None) -> None:
        self.signals["output_projection"] = value

    @property
    def layer_idx(self) -> int:
        """The one layer this view holds; an error if it stacks several (such a policy's rows are not alike)."""
        if len(self.layers) != 1:
            raise RuntimeError(f"this view stacks layers {self.layers[0]}..{self.layers[-1]}: a policy that reads "
                               "layer_idx must not set needs.rows_alike")
        return self.layers[0]


@dataclass
class SegmentView:
    """Rows of head-adaptive segments as a policy scores them in one call (keydiff.cache.adaptive): each row [P cells]
    holds one contiguous segment per KV head; free cells hold finite values whose scores are ignored."""

    keys: torch.Tensor  # [rows, P, head_dim], as cached
    positions: torch.Tensor  # [rows, P] long (free cells: anything)
    state: dict[str, torch.Tensor]  # name -> [rows, P] float32, as in LayerView
    member: torch.Tensor  # bool [rows, kv_heads, P]: cell p holds an entry of head h
    owner: torch.Tensor  # long [rows, P]: the head whose entry cell p holds (any head for a free cell)
    counts: torch.Tensor  # long [rows, kv_heads]: entries each head holds
    # For a choice head by head (`drop_segments`'s default): each head's first cell and its one-head view.
    starts: list[list[int]] | None = None
    head: Callable[[int, int], LayerView] | None = None

    @cached_property
    def valid(self) -> torch.Tensor:
        """bool [rows, P]: the cells that hold an entry (computed once: the selection and the cache both read it)."""
        return self.member.any(dim=1)


@dataclass(frozen=True)
class Needs:
    """What a policy needs from the cache, the attention function and the engine, declared once per class (`needs:
    ClassVar[Needs] = Needs(rows_alike=True)`). Every default is the safe answer. Design:
    docs/design/policies.md#capabilities"""

    # Query rows whose attention it reads: 0 none, k the last k of each pass, None all; reduced by "sum" or "max".
    attention_rows: int | None = 0
    attention_reduction: str = "sum"
    every_pass: bool = False  # `observe` sees every forward pass's attention, even one that evicts nothing
    # The engine runs a reconstruction pass (inside `cache.scratch()`) after each prefill block (KVzip).
    reconstruction: bool = False
    # Reads LayerView.queries: running statistics of the layer's pre-RoPE queries, from position `queries_from` on.
    queries: bool = False
    queries_from: int = 0
    output_projection: bool = False  # reads LayerView.output_projection, the layer's o_proj weight (CriticalKV)
    state: tuple[str, ...] = ()  # names of the per-entry float32 state buffers the cache allocates (LayerView.state)
    # None, or how the cache re-applies RoPE to kept keys after eviction: "contiguous" or "absolute" (rerotation.py)
    key_rerotation: str | None = None
    # False: `evict_indices` and `observe` read no value on the host, so a fixed step may capture them.
    host_reads: bool = True
    # Every row of a view is scored alike from its own entries, so the cache may stack all layers in one call.
    rows_alike: bool = False
    head_adaptive: bool = False  # a layer's heads share its budget (AdaKV): per-head segments, `keep_heads`
    # Scores every head-adaptive segment of a row at once (`score_segments`); see `chooses_segments`.
    segment_scores: bool = False
    log_scores: bool = False  # `score` returns the log of a non-negative importance (Expected Attention)
    evicts: bool = True  # False only for the no-eviction baseline
    # Its scores use only what keydiff.kernels.batch_invariant makes invariant, or what is invariant as it is.
    batch_invariant: bool = False
    # Further model signals by name (keydiff/signals.py), in LayerView.signals; scored layer by layer.
    signals: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("state", "signals"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        unknown = [name for name in self.signals if name not in model_signals.named()]
        if unknown:
            raise ValueError(f"Needs.signals names unknown model signal {unknown[0]!r}; valid: "
                             f"{', '.join(model_signals.named()) or '(none registered)'}")
        if self.signals and self.rows_alike:
            raise ValueError("Needs.signals with rows_alike: a policy reading model signals scores layer by layer")
        if self.attention_reduction not in REDUCTIONS:
            raise ValueError(f"Needs.attention_reduction {self.attention_reduction!r} is not valid; valid: "
                             f"{', '.join(REDUCTIONS)}")
        rows = self.attention_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise ValueError(f"Needs.attention_rows must be None (every row) or an int >= 0, got {rows!r}")

    @property
    def capturable(self) -> bool:
        """A fixed-shape step may compile or capture the policy's eviction (no host reads)."""
        return not self.host_reads

    @property
    def chooses_segments(self) -> bool:
        """A head-adaptive policy that chooses on all segments of a row at once (`drop_segments`), not head by head."""
        return self.head_adaptive and self.segment_scores

    @property
    def groupable(self) -> bool:
        """Rows of several sequences may be evicted as one (keydiff.decode.blocks.poolable's policy half): rows
        alike, and nothing but the entries read (no model signal, re-rotation, segments)."""
        return (self.rows_alike and self.attention_rows == 0 and not self.queries and not self.output_projection
                and not self.signals                and self.key_rerotation is None and not self.head_adaptive and not self.reconstruction)


REDUCTIONS = ("sum", "max")
# The capability attributes a policy stated one by one before `needs`: their `Needs` field (or what replaced them).
LEGACY = {"attention_rows": "attention_rows", "attention_reduction": "attention_reduction",
          "needs_reconstruction": "reconstruction", "observes_every_step": "every_pass", "evicts": "evicts",
          "state_names": "state", "needs_queries": "queries", "first_query_position": "queries_from",
          "needs_output_projection": "output_projection", "key_rerotation": "key_rerotation",
          "log_scores": "log_scores", "layers_batchable": "rows_alike", "capturable": "host_reads=False",
          "head_adaptive": "head_adaptive", "chooses_segments": "head_adaptive and segment_scores",
          "scores_segments": "segment_scores"}


def chooses_whole_segments(policy: "Policy") -> bool:
    """Whether `drop_segments` chooses on all segments of a row at once (a head-adaptive, segment-scoring policy needing
    no attention or query statistics) rather than head by head (`keep_heads` per row, `Policy.drop_segments`'s
    default)."""
    return policy.needs.chooses_segments and policy.needs.attention_rows == 0 and not policy.needs.queries


@dataclass
class Policy:
    """Base class: keep the `budget` highest-scoring entries of every KV head, plus nothing else.

    Subclasses are small dataclasses whose fields are hyper-parameters; `needs` is declared once per class."""

    needs: ClassVar[Needs] = Needs()

    def __init_subclass__(cls, **kwargs) -> None:
        """Refuse a capability stated the old way (one attribute each), which the cache would no longer read; record
        a built-in by its config name (`register`)."""
        super().__init_subclass__(**kwargs)
        legacy = [name for name in LEGACY if name in vars(cls)]
        if legacy:
            name = legacy[0]
            raise TypeError(f"{cls.__qualname__}.{name}: capabilities are declared in one place now: declare "
                            f"needs = Needs(...) ({name} is Needs.{LEGACY[name]}); valid fields: "
                            f"{', '.join(f.name for f in fields(Needs))}")
        declared = vars(cls).get("needs")
        if declared is not None and not isinstance(declared, (Needs, property)):
            raise TypeError(f"{cls.__qualname__}.needs must be a keydiff.policies.Needs (or a property returning one), "
                            f"got {type(declared).__name__}")
        if isinstance(declared, property):
            cls.needs = remembered(declared.fget)
        register(cls)

    def __setattr__(self, name: str, value) -> None:
        """Set the attribute and forget the `needs` a property computed (they may follow it)."""
        object.__setattr__(self, name, value)
        self.__dict__.pop("_needs", None)

    @property
    def name(self) -> str:
        """The config name (a built-in states its own); a policy of your own is named by its class's dotted path."""
        cls = type(self)
        return f"{cls.__module__}.{cls.__qualname__}"

    def reconstruction_input(self, block: torch.Tensor, previous: torch.Tensor, tokenizer) -> torch.Tensor:
        """Token ids [batch, R + B] of the reconstruction pass for prefill block `block` [batch, B] (`previous`: the block before)."""
        raise NotImplementedError(f"{type(self).__qualname__} runs no reconstruction pass")

    def reconstruction_keys(self, positions: torch.Tensor, chunk_start: int | None) -> torch.Tensor | None:
        """Bool [batch, kv_heads, n]: the held entries the reconstruction pass's softmax covers besides its own; None: all."""
        return None

    def keep_heads(self, heads: list[LayerView], budget: int) -> list[torch.Tensor]:
        """For a head-adaptive policy: bool masks of the entries each head of one batch row keeps."""
        raise NotImplementedError(f"policy {self.name!r} does not share a layer's budget between its heads")

    def drop_segments(self, segments: SegmentView, budget: int) -> torch.Tensor:
        """For a head-adaptive policy: bool [rows, P], the entries of every row of `segments` to drop (budget: N). What
        the cache asks; by default head by head, `keep_heads` for each row over kv_heads x N (`needs.chooses_segments`
        policies choose on all of a row's segments at once)."""
        dropped = torch.zeros_like(segments.owner, dtype=torch.bool)
        heads = segments.counts.shape[1]
        for row, counts in enumerate(segments.counts.tolist()):
            if sum(counts) > heads * budget:
                keep = self.keep_heads([segments.head(row, head) for head in range(heads)], budget)
                for start, count, mask in zip(segments.starts[row], counts, keep):
                    dropped[row, start:start + count] = ~mask
        return dropped

    def score_segments(self, segments: SegmentView) -> torch.Tensor:
        """Scores [rows, P] float32 of every entry of `segments`, as `score` gives them on each head alone. Only with
        `needs.segment_scores`."""
        raise NotImplementedError(f"policy {self.name!r} does not score head-adaptive segments")

    # True: check the scores at every eviction, not only at the policy object's first (keydiff.testing).
    _check_every_call: ClassVar[bool] = False
    # The parameter name for a RecentWindow around it in build_policy and the configs (KeyDiff: window_fraction).
    recent_window_parameter: ClassVar[str | None] = None

    def validate(self, budget: int) -> None:
        """Raise ValueError if the hyper-parameters cannot work with `budget` (called before model loading)."""

    def check(self, budget: int) -> None:
        """Everything `validate` checks, for the whole cache's budget (LayerBudgets checks the smallest layer budget)."""
        self.validate(budget)

    def compresses_layer(self, layer_idx: int) -> bool:
        """Whether this layer is ever evicted (L2-norm's optional skip layers say no)."""
        return True

    def budgets(self, budget: int, num_layers: int, prompt_length: int | None = None) -> list[int | None]:
        """Each layer's budget (None: never evicted): `budget` in every layer this policy compresses."""
        return [budget if self.compresses_layer(i) else None for i in range(num_layers)]

    def unwrapped(self) -> Policy:
        """The innermost policy (itself; a wrapper answers with the policy it wraps, unwrapped)."""
        return self

    def initial_state(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """State of newly written entries, {name: [batch, kv_heads, q]}, from their keys [batch, kv_heads, q, dim];
        set once per entry before `observe` and `score`. Names left out start at 0."""
        return {}

    def entry_state(self, entries: LayerView) -> dict[str, torch.Tensor]:
        """State of newly written entries from a view of them (keys, values, positions, output_projection); default `initial_state(keys)`."""
        return self.initial_state(entries.keys)

    def observe(self, layer: LayerView) -> None:
        """Update per-entry state in `layer.state` after a forward pass (default: stateless)."""

    def score(self, layer: LayerView) -> torch.Tensor:
        """Per-entry score [batch, kv_heads, n]; the highest `budget` per head are kept."""
        raise NotImplementedError

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        """Bool [batch, kv_heads, n] of entries kept regardless of score, or None."""
        return None

    def evict_indices(self, layer: LayerView, budget: int) -> torch.Tensor:
        """Indices [batch, kv_heads, n - budget] of the entries to drop: the lowest scores, never a protected one.
        Ties go by position (older first); the first call checks the scores (`check_scores`)."""
        scores = self.score(layer)
        protect = self.protected(layer, budget)
        if self._check_every_call or not self.__dict__.get("_scores_checked"):  # a check costs a device sync
            check_scores(self, scores, layer, protect)
            self.__dict__["_scores_checked"] = True
        scores = scores.float()
        if protect is not None:
            scores = scores.masked_fill(protect, float("inf"))
        excess = scores.shape[-1] - budget
        return torch.topk(score_then_position(scores, layer.positions), excess, dim=-1, largest=False, sorted=False).indices

    def keep_indices(self, layer: LayerView, budget: int) -> torch.Tensor:
        """Indices [batch, kv_heads, budget] of the entries kept (the complement of `evict_indices`), ascending."""
        batch, heads, n = layer.positions.shape
        if n <= budget:
            return torch.arange(n, device=layer.positions.device).expand(batch, heads, n)
        keep = torch.ones(batch, heads, n, dtype=torch.bool, device=layer.positions.device)
        keep.scatter_(-1, self.evict_indices(layer, budget), False)
        return torch.arange(n, device=keep.device).expand(batch, heads, n)[keep].view(batch, heads, budget)

    def describe(self) -> dict:
        """Name and hyper-parameters for result files: what `build_policy(**describe())` takes to build it again."""
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self) if f.init}, "layer_budgets": None}


# The built-in policies by config name: each class of keydiff.policies' modules that states its own `name`.
BUILT_IN: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> None:
    """Record `cls` as a built-in if it states its config name in a module of keydiff.policies (a policy of your
    own, elsewhere, is named by its dotted path); a name two built-ins state is refused, naming both."""
    name = vars(cls).get("name")
    if not isinstance(name, str) or not cls.__module__.startswith(f"{__package__}."):
        return
    known = BUILT_IN.setdefault(name, cls)
    where = [f"{klass.__module__}.{klass.__qualname__}" for klass in (known, cls)]
    if where[0] != where[1]:
        raise TypeError(f"{where[1]}.name {name!r} is already {where[0]}'s; a built-in policy's config name is its own")
    BUILT_IN[name] = cls  # the same class defined again (a module reloaded)


def remembered(compute):
    """A `needs` property computed once per policy object, again after one of its attributes is set or its scorer's
    needs change: the cache reads it per layer and pass. Kept by name, so a policy object still pickles."""
    key = f"{compute.__module__}.{compute.__qualname__}"

    def needs(self: Policy) -> Needs:
        scorer = self.__dict__.get("scorer")
        inner = None if scorer is None else scorer.needs
        answers = self.__dict__.setdefault("_needs", {})
        known = answers.get(key)
        if known is not None and known[0] is inner:
            return known[1]
        value = compute(self)
        answers[key] = (inner, value)
        return value

    return property(needs, doc=compute.__doc__)


def policy_error_name(policy: Policy) -> str:
    """How errors name a policy: its config name, or its class's dotted path for one of your own (wrappers: the wrapped one)."""
    policy = policy.unwrapped()
    cls, name = type(policy), policy.name
    owner = next(klass for klass in cls.__mro__ if "name" in vars(klass))  # where `name` was set
    if owner is Policy or (owner.__module__, owner.__qualname__) == (cls.__module__, cls.__qualname__):
        return name
    return f"{cls.__module__}.{cls.__qualname__} ({name} subclass)"


def check_scores(policy: Policy, scores: torch.Tensor, layer: LayerView, protect: torch.Tensor | None) -> None:
    """Raise RuntimeError naming the policy if `scores` is not [batch, kv_heads, n] or holds NaN/inf for an unprotected entry."""
    expected = tuple(layer.positions.shape)
    if tuple(scores.shape) != expected:
        raise RuntimeError(
            f"policy {policy_error_name(policy)!r}: score() returned shape {list(scores.shape)}; expected "
            f"[batch, kv_heads, n] = {list(expected)}, one score per cached entry"
        )
    bad = ~torch.isfinite(scores)
    if protect is not None:
        bad &= ~protect
    count = int(bad.sum())
    if count:
        raise RuntimeError(
            f"policy {policy_error_name(policy)!r}: score() returned {count} NaN/inf value(s) for entries that are not "
            "protected; scores must be finite (mark entries that must stay with `protected`)"
        )


def layer_by_layer(policy: Policy) -> Policy:
    """The same policy (class behaviour and parameters) with `needs.rows_alike` False: the reference stacked
    choices are checked against."""
    if not policy.needs.rows_alike:
        return policy
    cls = type(policy)
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}  # named (in errors) as the class itself
    unstacked = type(f"LayerByLayer{cls.__name__}", (cls,), {"needs": replace(policy.needs, rows_alike=False), **names})
    return unstacked(**{f.name: getattr(policy, f.name) for f in fields(policy) if f.init})


def float32_norms(keys: torch.Tensor) -> torch.Tensor:
    """||k|| per entry [..., n] in float32, half precision widened inside the reduction (no float32 copy of the keys)."""
    if keys.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
    return torch.linalg.vector_norm(keys.float(), dim=-1)


def score_then_position(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One unique int64 key per entry ordered by float32 score, then position, so top-k has no ties."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0 (and is a fresh tensor)
    ordered = (bits >> 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)
    return ordered.to(torch.int64).bitwise_left_shift_(32).bitwise_or_(positions)


def most_recent(layer: LayerView, count: int) -> torch.Tensor:
    """Bool mask of the `count` most recent entries of every head (by position; positions are unique per head)."""
    n = layer.positions.shape[-1]
    if count <= 0:
        return torch.zeros_like(layer.positions, dtype=torch.bool)
    if count >= n:
        return torch.ones_like(layer.positions, dtype=torch.bool)
    threshold = torch.kthvalue(layer.positions, n - count + 1, dim=-1, keepdim=True).values
    return layer.positions >= threshold


def window_size(fraction: float, budget: int) -> int:
    """Budget entries a `fraction` reserves for the most recent tokens (floor, with an epsilon against float noise)."""
    return math.floor(fraction * budget + 1e-9)


def check_fraction(name: str, value: float, budget: int | None = None) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    if budget is not None and value > 0 and window_size(value, budget) == 0:
        logger.warning("%s=%s of a %d-token budget reserves no entry (floor); the window is empty", name, value, budget)


__all__ = ["LayerView", "Needs", "Policy", "SegmentView", "check_scores", "layer_by_layer", "most_recent",
           "window_size", "check_fraction", "field"]
