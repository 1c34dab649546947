"""A transformers Cache whose layers stay within a fixed token budget (paper Eq. 6), in preallocated buffers.

`EvictingCache` is an ordinary `transformers.Cache` made of `EvictingLayer`s, so any model that takes
`past_key_values` can use it unchanged, in any decoding loop:

    out = model(input_ids=next_ids, past_key_values=cache, use_cache=True)   # position_ids optional

Memory. Each layer allocates its buffers once per sequence: keys, values, absolute positions and the
policy's per-entry state, with room for `budget + block_size` entries (a prefill block, or one token while
decoding, on top of the kept entries). A forward pass writes its new entries into the free slots after the
kept ones; eviction then chooses the entries to drop and moves the surviving new entries into the slots of
the dropped old ones. Nothing proportional to the cache size is allocated or copied after the first block:
only the new entries move. Entries therefore sit in the buffer in no particular order; each carries its
absolute position, policies that care about recency or adjacency read positions, never buffer indices.

Stack. When every layer has the same budget and the policy scores each batch row on its own
(`Policy.layers_batchable`), the cache allocates all layers' buffers as one [layers, batch, ...] tensor and
each layer adopts its slice. `evict()` then treats the stack as one layer whose batch rows are every layer's
rows: one scoring call, one top-k and one move per buffer per step instead of one per layer, which is most
of what eviction costs on a small model (the per-layer work is launch-bound, not bandwidth-bound).

Position. The cache counts the tokens it has seen, so `get_seq_length()` is the absolute position of the
next token (what transformers relies on: `cache_position` and `position_ids` when none are given, and
`generate`'s slicing of the prompt) while `entries_held()` (a layer's `num_entries`) is what the layer holds:
after prefill of 3058 tokens with N = 1024, 3058 and 1024. Masks for transformers' own attention functions are sized from it (`get_mask_sizes`), so
attention-free policies work with stock sdpa/eager/FlashAttention too.

Eviction. Each layer evicts itself at the start of its next `update` (before the new entries are written)
and `evict()` does it for every layer at once (what the engine calls after every forward pass, so after a
call each layer holds at most `budget` entries). Either way the policy sees the same entries and the same
attention statistic, so a plain loop and `keydiff.generate` choose the same tokens.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from keydiff.policies.base import LayerView, Policy
from keydiff.queries import QueryStatistics, rope_frequencies

STATISTICS_MODES = ("fast", "materialized")


def empty_buffers(
    leading: tuple[int, ...], key_states: torch.Tensor, value_states: torch.Tensor, capacity: int,
    state_names: tuple[str, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Keys, values, positions and policy-state buffers [*leading, batch, kv_heads, capacity(, dim)], shaped
    like these states. Ordinary tensors even under inference mode, so that a loop the user runs later under
    plain `no_grad` can still write into them."""
    batch, heads = key_states.shape[:2]
    shape = (*leading, batch, heads, capacity)
    with torch.inference_mode(False):
        keys = key_states.new_empty(*shape, key_states.shape[-1])
        values = value_states.new_empty(*shape, value_states.shape[-1])
        positions = torch.empty(shape, dtype=torch.long, device=key_states.device)
        state = {name: torch.zeros(shape, dtype=torch.float32, device=key_states.device) for name in state_names}
    return keys, values, positions, state


class EvictingLayer(CacheLayerMixin):
    """One layer's bounded cache: fixed buffers, a count of valid entries, and a count of tokens seen.

    budget=None: this layer never evicts (the `full` policy, or a layer a policy skips); its buffers grow
    geometrically instead. capacity: entries the buffers are first allocated for.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        budget: int | None,
        capacity: int | None,
        state_names: tuple[str, ...] = (),
        initial_state: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None,
    ):
        super().__init__()
        self.budget = budget
        self.capacity = capacity  # None: sized from the first update
        self.state_names = state_names
        self.initial_state = initial_state  # the policy's `initial_state`: state of newly written entries
        self.positions: torch.Tensor | None = None  # [batch, kv_heads, capacity] long
        self.state: dict[str, torch.Tensor] = {}  # name -> [batch, kv_heads, capacity] float32
        self.attention: torch.Tensor | None = None  # statistic of the last pass, [batch, kv_heads, entries]
        self.queries: QueryStatistics | None = None  # running pre-RoPE query moments (policies with needs_queries)
        self.num_entries = 0  # valid entries per KV head (the same for every head)
        self.seen = 0  # tokens this layer has been given: the absolute position of the next one
        self.max_entries = 0  # peak entries per head ever held
        self.allocations = 0  # buffer (re)allocations this sequence: 1 when the capacity was right
        self.stacked = False  # buffers are this layer's slices of the cache's stack (EvictingCache.stack)
        self.fresh: int | None = None  # first slot whose policy state is not set yet (see _initialize_state)

    # --- storage -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """(Re)allocate every buffer for `capacity` entries, keeping the valid ones."""
        self.install(*empty_buffers((), key_states, value_states, capacity, self.state_names))

    def install(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, state: dict[str, torch.Tensor],
                stacked: bool = False) -> None:
        """Make these new buffers this layer's own, carrying the valid entries over (stacked: they are slices
        of the cache's stack)."""
        n = self.num_entries
        if n:
            keys[:, :, :n] = self.keys[:, :, :n]
            values[:, :, :n] = self.values[:, :, :n]
            positions[:, :, :n] = self.positions[:, :, :n]
            for name, buffer in state.items():
                buffer[:, :, :n] = self.state[name][:, :, :n]
        self.keys, self.values, self.positions, self.state = keys, values, positions, state
        self.capacity = keys.shape[2]
        self.allocations += 1
        self.stacked = stacked

    def fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the buffers can hold these states (heads, head dims, dtype and device all match)."""
        return (self.keys.shape[1] == key_states.shape[1] and self.keys.shape[3] == key_states.shape[3]
                and self.values.shape[3] == value_states.shape[3] and self.keys.dtype == key_states.dtype
                and self.keys.device == key_states.device)

    def _grown_capacity(self, needed: int) -> int:
        """Capacity for `needed` entries: the planned one first; then room for decoding, or doubling if unbounded."""
        if self.keys is None:
            planned = self.capacity or needed
            return max(needed, planned, 0 if self.budget is None else self.budget + 1)
        return max(needed, 2 * self.capacity)

    def reserve(self, entries: int) -> None:
        """Make room for `entries` valid entries now (e.g. before decoding into an unbounded layer)."""
        if self.keys is not None and entries > self.capacity:
            self._allocate(self.keys, self.values, entries)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a pass's keys/values [batch, kv_heads, q, dim] after the kept entries; return the valid ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        n = self.num_entries
        if self.keys is not None and key_states.shape[0] != self.keys.shape[0]:
            raise RuntimeError(
                f"the batch changed from {self.keys.shape[0]} to {key_states.shape[0]} rows: an evicting cache supports "
                "neither beam search nor num_return_sequences; use keydiff.generate (greedy or sampling)"
            )
        needed = n + q
        if self.keys is not None and self.stacked and n == 0 and not self.fits(key_states, value_states):
            self.keys = None  # a layer unlike the one the stack was shaped from: buffers of its own
        if self.keys is None or needed > self.capacity:
            self._allocate(key_states, value_states, self._grown_capacity(needed))
        self.keys[:, :, n:needed] = key_states
        self.values[:, :, n:needed] = value_states
        if q == 1:  # decoding: no arange to allocate
            self.positions[:, :, n].fill_(self.seen)
        else:
            self.positions[:, :, n:needed] = torch.arange(self.seen, self.seen + q, device=self.device)
        if self.state and self.fresh is None:
            self.fresh = n  # their state is set when the layer is next viewed (once for all layers if stacked)
        self.num_entries, self.seen = needed, self.seen + q
        self.max_entries = max(self.max_entries, needed)
        return self.keys[:, :, :needed], self.values[:, :, :needed]

    def _initialize_state(self) -> None:
        """Set the policy state of the entries written since the last view: `initial_state` of their keys, else 0.

        Deferred from `update` to here so that a stacked cache does it for all layers in one call.
        """
        start, n = self.fresh, self.num_entries
        self.fresh = None
        if start is None or start >= n:
            return
        initial = self.initial_state(self.keys[:, :, start:n]) if self.initial_state is not None else {}
        for name, buffer in self.state.items():
            buffer[:, :, start:n] = initial.get(name, 0.0)

    def view(self, layer_idx: int | None) -> LayerView:
        """The valid entries as a policy sees them (views into the buffers, in buffer order)."""
        self._initialize_state()
        n = self.num_entries
        return LayerView(
            keys=self.keys[:, :, :n],
            values=self.values[:, :, :n],
            positions=self.positions[:, :, :n],
            attention=self.attention,
            state={name: buffer[:, :, :n] for name, buffer in self.state.items()},
            layer_idx=layer_idx,
            queries=self.queries,
        )

    # --- eviction ------------------------------------------------------------------------------
    def evict(self, policy: Policy, layer_idx: int | None = None) -> None:
        """Observe the last pass's statistic, then drop entries until at most `budget` remain, in place."""
        if self.budget is None or not self.is_initialized:
            self.attention = None
            return
        layer_idx = self.layer_idx if layer_idx is None else layer_idx
        where = "the stacked layers" if layer_idx is None else f"layer {layer_idx}"
        view = self.view(layer_idx)
        if self.attention is not None:
            policy.observe(view)
        excess = self.num_entries - self.budget
        if excess > 0:
            if policy.attention_rows != 0 and self.attention is None:
                raise RuntimeError(
                    f"policy {policy.name!r} needs attention statistics but none were recorded in {where}: "
                    "run the model inside `with keydiff.keydiff_attention(model, cache):` (keydiff.prefill and "
                    "keydiff.generate do this for you)"
                )
            if policy.needs_queries and self.queries is None:
                raise RuntimeError(
                    f"policy {policy.name!r} needs query statistics but none were recorded in {where}: run the "
                    "model inside `with keydiff.keydiff_attention(model, cache):` (keydiff.prefill and keydiff.generate do)"
                )
            self._drop(policy.evict_indices(view, self.budget))
        self.attention = None

    def _drop(self, dropped: torch.Tensor) -> None:
        """Remove the entries at `dropped` [batch, kv_heads, excess] by moving surviving tail entries into them.

        With N = budget and n entries, the tail slots N..n-1 are exactly as many as the dropped entries, so
        every dropped slot below N receives one surviving tail entry: pair the k-th dropped slot with the
        k-th surviving tail slot (both ascending). Pairs past the survivors land in dropped tail slots.
        """
        budget, n = self.budget, self.num_entries
        tail = n - budget
        if tail == 1:  # decoding: the one new entry moves into the dropped slot (onto itself if it was dropped)
            self._move(torch.full_like(dropped, budget), dropped)
            self.num_entries = budget
            return
        dropped = dropped.sort(dim=-1).values
        # Mark the dropped tail slots; dropped slots below the budget all go to one spare column at the end.
        column = torch.where(dropped >= budget, dropped - budget, tail)
        tail_dropped = torch.zeros(*dropped.shape[:2], tail + 1, dtype=torch.uint8, device=dropped.device)
        tail_dropped.scatter_(-1, column, 1)
        # Surviving tail slots first (stable: ascending), then the dropped ones.
        sources = budget + torch.argsort(tail_dropped[..., :tail], dim=-1, stable=True)
        self._move(sources, dropped)
        self.num_entries = budget

    def _move(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """buffer[..., targets] = buffer[..., sources] for every buffer (indices [batch, kv_heads, k])."""
        for buffer in (self.keys, self.values):
            src = sources[..., None].expand(-1, -1, -1, buffer.shape[-1])
            dst = targets[..., None].expand(-1, -1, -1, buffer.shape[-1])
            buffer.scatter_(2, dst, buffer.gather(2, src))
        for buffer in (self.positions, *self.state.values()):
            buffer.scatter_(2, targets, buffer.gather(2, sources))

    def kept_positions(self) -> torch.Tensor:
        """Absolute positions held, [batch, kv_heads, entries], ascending (a copy)."""
        return self.positions[:, :, : self.num_entries].sort(dim=-1).values

    # --- the transformers layer interface -------------------------------------------------------
    def get_seq_length(self) -> int:
        """Tokens seen so far: the absolute position of the next token (not the number of entries held)."""
        return self.seen

    def entries_after_eviction(self) -> int:
        return self.num_entries if self.budget is None else min(self.num_entries, self.budget)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Keys the next pass attends to, and the offset that makes transformers' causal mask exact.

        The next pass sees the entries left after eviction plus its own q tokens. Its queries sit at absolute
        positions seen..seen+q-1; an offset of seen - entries maps key slot j to j + offset, so "key <= query"
        means: every kept entry, and the new tokens causally (bottom-right).
        """
        kept = self.entries_after_eviction()
        return kept + query_length, self.seen - kept

    def get_max_length(self) -> int:
        return -1 if self.budget is None else self.budget

    def reset(self) -> None:
        self.keys = self.values = self.positions = self.attention = self.queries = None
        self.state, self.num_entries, self.seen, self.max_entries = {}, 0, 0, 0
        self.is_initialized = self.stacked = False
        self.fresh = None

    # transformers' generate() calls these for beam search, assisted decoding and num_return_sequences; they
    # would need every buffer (positions, policy state) reordered with the keys, so refuse instead.
    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be cropped (no assisted decoding); use keydiff.generate")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("an evicting cache does not support beam search; use keydiff.generate")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("an evicting cache cannot be expanded (num_return_sequences); use keydiff.generate")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("an evicting cache does not support batch selection; use keydiff.generate")


class EvictingCache(Cache):
    """KV cache bounded to `budget` entries per layer and KV head, in buffers allocated once per sequence.

    budget=None means no bound (the `full` policy). block_size: the largest pass expected (the prefill
    block); bounded layers hold budget + block_size entries. max_tokens: the tokens the sequence is expected
    to reach (the prompt length), which sizes unbounded layers. Buffers grow (and say so in `allocations`)
    only if a pass or a sequence outgrows them. `statistics`
    chooses how attention-based policies get their attention: "fast" computes only the rows they need next
    to the fused attention kernel, "materialized" runs eager attention and reads its weights (the paper's
    latency setting). profile=True synchronises the GPU around every statistic and eviction so that
    `timings` are the kernels' time; it slows the run down, so never time TTFT with it.
    """

    def __init__(
        self,
        policy: Policy,
        budget: int | None,
        num_layers: int,
        statistics: str = "fast",
        profile: bool = False,
        block_size: int | None = None,
        max_tokens: int | None = None,
    ):
        if statistics not in STATISTICS_MODES:
            raise ValueError(f"unknown attention statistics mode {statistics!r}; valid: {', '.join(STATISTICS_MODES)}")
        self.policy = policy
        self.budget = budget if policy.evicts else None
        # Each layer's own budget N_l (None: never evicted): the policy's layer schedule, uniform by default.
        budgets = [None] * num_layers if self.budget is None else policy.budgets(self.budget, num_layers, max_tokens)
        layers = []
        for layer_idx, layer_budget in enumerate(budgets):
            capacity = max_tokens if layer_budget is None else self._bounded_capacity(layer_budget, block_size, max_tokens)
            layer = EvictingLayer(layer_budget, capacity, policy.state_names, policy.initial_state)
            layer.layer_idx = layer_idx
            layers.append(layer)
        super().__init__(layers=layers)
        self.statistics = statistics
        self.profile = profile
        self.timings = {"statistics_s": 0.0, "eviction_s": 0.0}
        self.evicting = True  # False while decoding without eviction (decode_eviction=false)
        # Every layer's buffers as one allocation, seen as one layer whose batch rows are all layers' rows:
        # `evict()` then evicts every layer with one set of kernel launches (see _evict_stacked). Only when
        # the policy allows it and every layer has the same budget and capacity; built at the first update.
        self.stack: EvictingLayer | None = None
        self.stackable = (
            policy.layers_batchable and budgets[0] is not None and len(set(budgets)) == 1
            and layers[0].capacity is not None and len({layer.capacity for layer in layers}) == 1
        )
        # Set by keydiff.prefill: the prompt it consumed, to refuse it being fed a second time (see update).
        self.prompt_length: int | None = None

    @staticmethod
    def _bounded_capacity(budget: int, block_size: int | None, max_tokens: int | None) -> int | None:
        """Slots for a layer bounded to `budget`: budget + block (never more than the whole prompt), at least
        budget + 1 for decoding; None (sized from the first pass) if neither block nor length is known."""
        if not (block_size or max_tokens):
            return None
        capacity = budget + (block_size or max_tokens)
        if max_tokens is not None:
            capacity = min(capacity, max_tokens)
        return max(capacity, budget + 1)

    # --- the transformers Cache interface -------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        q = key_states.shape[-2]
        if layer_idx == 0 and self.prompt_length is not None and layer.seen == self.prompt_length == q:
            raise RuntimeError(
                "this cache already holds the whole prompt, which is being fed again (what model.generate does when "
                "past_key_values covers all of input_ids). Continue with keydiff.generate(model, state, ...), or "
                "prefill all but the last prompt token: state = keydiff.prefill(model, prompt[:, :-1], ...), then "
                "model.generate(prompt, past_key_values=state.cache, ...)"
            )
        if self.stackable and self.stack is None and all(other.keys is None for other in self.layers):
            self._allocate_stack(key_states, value_states, self.layers[0].capacity)
        # What the previous pass left to do (a plain loop never calls `evict()`): observe and evict now.
        if self.evicting and layer.budget is not None and (layer.attention is not None or layer.num_entries > layer.budget):
            start = self._clock()
            layer.evict(self.policy, layer_idx)
            self.timings["eviction_s"] += self._clock() - start
        return layer.update(key_states, value_states)

    def reset(self) -> None:
        super().reset()
        self.stack = None

    # --- the stack: every layer's buffers in one allocation ---------------------------------------
    def _allocate_stack(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """Allocate [layers, batch, kv_heads, capacity, ...] buffers; each layer adopts its own slice.

        Each layer still owns a contiguous [batch, kv_heads, capacity, dim] block, so attention reads it
        exactly as it would read buffers of its own; a layer that turns out not to fit leaves the stack.
        Called at the first update (shaped like its states), and by `reserve` to grow the whole stack, in
        which case the valid entries are copied over and the old stack is released.
        """
        count, (batch, heads) = len(self.layers), key_states.shape[:2]
        keys, values, positions, state = empty_buffers((count,), key_states, value_states, capacity, self.policy.state_names)
        for index, layer in enumerate(self.layers):
            layer.install(keys[index], values[index], positions[index], {name: s[index] for name, s in state.items()},
                          stacked=True)
        stack = EvictingLayer(self.layers[0].budget, capacity, self.policy.state_names, self.policy.initial_state)
        stack.lazy_initialization(key_states, value_states)
        rows = count * batch
        stack.install(keys.view(rows, heads, capacity, -1), values.view(rows, heads, capacity, -1),
                      positions.view(rows, heads, capacity), {name: s.view(rows, heads, capacity) for name, s in state.items()},
                      stacked=True)
        stack.layer_idx = None
        self.stack = stack

    def _stack_ready(self) -> bool:
        """Whether every layer is in the stack with the same entries and statistics, so they evict as one."""
        if self.stack is None:
            return False
        if not all(layer.stacked for layer in self.layers):
            self.stack = None  # a layer left for buffers of its own: evict layer by layer from now on
            return False
        first = self.layers[0]
        recorded = first.attention is not None
        return all(layer.num_entries == first.num_entries and layer.fresh == first.fresh
                   and (layer.attention is not None) == recorded for layer in self.layers)

    def _evict_stacked(self) -> None:
        """Evict every layer at once: the policy sees one view whose batch rows are all layers' rows.

        The same per-row computation as evicting layer by layer (`Policy.layers_batchable`), so the same
        entries go; only the number of kernel launches (and of Python calls) drops by the layer count.
        """
        stack = self.stack
        stack.num_entries, stack.fresh = self.layers[0].num_entries, self.layers[0].fresh
        stack.attention = torch.cat([layer.attention for layer in self.layers]) if self.layers[0].attention is not None else None
        stack.evict(self.policy)
        for layer in self.layers:
            layer.num_entries, layer.attention, layer.fresh = stack.num_entries, None, None

    # --- what the engine and the attention function use ------------------------------------------
    def attention_rows_needed(self, layer_idx: int) -> int | None:
        """How many last query rows of this pass the policy needs attention for: 0 = none, None = all."""
        layer = self.layers[layer_idx]
        rows = self.policy.attention_rows
        if rows == 0 or layer.budget is None or not self.evicting:
            return 0
        if not self.policy.observes_every_step and layer.num_entries <= layer.budget:
            return 0  # nothing will be evicted after this pass, so the statistic would be wasted
        return rows

    def owns(self, layer_idx: int, key: torch.Tensor) -> bool:
        """Whether `key` is this cache's layer buffer (the attention function checks before recording)."""
        keys = self.layers[layer_idx].keys
        return keys is not None and key.data_ptr() == keys.data_ptr()  # this layer's slots, not just its storage

    def record_attention(self, layer_idx: int, statistic: torch.Tensor) -> None:
        self.layers[layer_idx].attention = statistic

    def queries_needed(self, layer_idx: int) -> bool:
        """Whether the attention function must hand this layer's queries over (Expected Attention)."""
        layer = self.layers[layer_idx]
        return self.policy.needs_queries and layer.budget is not None and self.evicting

    def record_queries(self, layer_idx: int, query: torch.Tensor, config) -> None:
        """Add a pass's post-RoPE queries [batch, heads, q, d] (the newest q positions) to the layer's statistics."""
        layer = self.layers[layer_idx]
        if layer.queries is None:
            inv_freq, scaling = rope_frequencies(config, query.shape[-1])
            layer.queries = QueryStatistics(inv_freq.to(query.device), scaling, self.policy.first_query_position)
        layer.queries.update(query, layer.seen - query.shape[2])

    def entries_held(self, layer_idx: int = 0) -> int:
        """Entries per KV head that layer `layer_idx` holds now: at most its budget after `evict()` (one pass
        more before it). Not `get_seq_length()`, which counts the tokens seen, as transformers needs."""
        return self.layers[layer_idx].num_entries

    @property
    def layer_budgets(self) -> list[int | None]:
        """Each layer's budget N_l (None: unbounded)."""
        return [layer.budget for layer in self.layers]

    @property
    def layer_max_entries(self) -> list[int]:
        """Each layer's peak entries per KV head."""
        return [layer.max_entries for layer in self.layers]

    def evict(self) -> None:
        """Let the policy observe the pass just run, then shrink every over-budget layer to `budget`."""
        if self.budget is None or not self.evicting:
            return
        start = self._clock()
        if self._stack_ready():
            self._evict_stacked()
        else:
            for layer_idx, layer in enumerate(self.layers):
                layer.evict(self.policy, layer_idx)
        self.timings["eviction_s"] += self._clock() - start

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more tokens in every layer that will keep them (before decoding).

        A stacked cache (all layers bounded) keeps tokens only when not evicting; it then grows as a whole,
        into a new stack, so that the old one is released rather than held by the layers still in it.
        """
        if self._stack_ready() and not self.evicting:
            needed = max(layer.entries_after_eviction() for layer in self.layers) + new_tokens
            if needed > self.stack.capacity:
                self._allocate_stack(self.layers[0].keys, self.layers[0].values, needed)
            return
        for layer in self.layers:
            if layer.budget is None or not self.evicting:
                layer.reserve(layer.entries_after_eviction() + new_tokens)

    def kept_positions(self) -> list[torch.Tensor]:
        """Absolute positions held, one LongTensor [batch, kv_heads, entries] per layer, ascending (copies)."""
        return [layer.kept_positions() for layer in self.layers]

    @property
    def entries_peak_sum(self) -> int:
        """Sum over layers of each layer's peak entries per KV head (an upper bound of what was held at once)."""
        return sum(layer.max_entries for layer in self.layers)

    @property
    def max_entries(self) -> int:
        """Peak number of entries any layer held for one KV head."""
        return max((layer.max_entries for layer in self.layers), default=0)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the key and value buffers hold (their allocated capacity, every layer): the real footprint.

        Counted per storage, so a stack is counted whole, including the slots of a layer that has left it.
        """
        storages = {}
        for layer in self.layers:
            for buffer in (layer.keys, layer.values):
                if buffer is not None:
                    storage = buffer.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    @property
    def allocations(self) -> int:
        """Buffer allocations over all layers since the sequence started (one per layer when sized right)."""
        return sum(layer.allocations for layer in self.layers)

    def _clock(self) -> float:
        """Wall time; synchronises the GPU first when profiling so the time is the kernels' time."""
        if self.profile and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()
