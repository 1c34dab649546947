"""A transformers Cache whose layers stay within a fixed token budget (paper Eq. 6), in preallocated buffers.

`EvictingCache` is an ordinary `transformers.Cache`, usable by any model in any decoding loop; it evicts after each pass
or on `evict()` and counts tokens seen (`get_seq_length`) apart from entries held (`entries_held`).
Design: docs/design/cache.md"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
from transformers.cache_utils import Cache

from keydiff.attention import LayerBinding, StatisticSink, bound_cache
from keydiff.cache.adaptive import AdaptiveLayer, AdaptiveStorage
from keydiff.cache.arena import allocation_bytes
from keydiff.cache.evict import evict_segments
from keydiff.cache.layer import EvictingLayer
from keydiff.cache.plan import distinct_storages, plan_memory
from keydiff.cache.sliding import SlidingWindowLayer
from keydiff.cache.storage import Storage
from keydiff.config import STATISTICS_MODES
from keydiff.policies.base import Policy, chooses_whole_segments
from keydiff import signals as model_signals

# How close (relative to the largest) refed layer-0 values must be to the kept ones: a few dtype roundings.
REFED_TOLERANCE = 1e-3
REFED_ROUNDINGS = 8


class EvictingCache(Cache):
    """KV cache bounded to `budget` entries per layer and KV head, in buffers allocated once per sequence.

    budget=None: unbounded. block_size: the largest pass (bounded layers hold budget + block_size). max_tokens: the
    prompt's length. statistics: "fast" or "materialized". profile: synchronise around statistics and eviction (kernel
    timings). config and layer_placements: see docs/design/cache.md#the-cache."""

    def __init__(
        self,
        policy: Policy,
        budget: int | None,
        num_layers: int,
        statistics: str = "fast",
        profile: bool = False,
        block_size: int | None = None,
        max_tokens: int | None = None,
        scratch_tokens: int = 0,
        config: Any = None,
        layer_placements: list[Any] | None = None,
        compressed_tokens: int | None = None,
    ):
        if statistics not in STATISTICS_MODES:
            raise ValueError(f"unknown attention statistics mode {statistics!r}; valid: {', '.join(STATISTICS_MODES)}")
        self.policy = policy
        self.plan = plan_memory(policy, budget, num_layers, block_size, max_tokens, scratch_tokens, layer_placements,
                                config, compressed_tokens)
        self.inv_freq, self.contiguous, self.budget = self.plan.inv_freq, self.plan.contiguous, self.plan.budget
        self.num_layers, self.block_size, self.max_tokens = num_layers, block_size, max_tokens
        self.scratch_tokens = scratch_tokens  # room for the longest scratch pass (KVzip's reconstruction)
        self.windows, self.sliding = list(self.plan.windows), self.plan.sliding  # each layer's window (None: none)
        self._first_evicted = self.plan.first_evicted
        super().__init__(layers=self.plan.build(policy))
        self._storages = distinct_storages(self.layers)
        self.evicted_layers = evicted_layers(self.layers)  # the layers that live in storages (read-only)
        self.statistics = statistics
        self.profile = profile
        self.timings = {"statistics_s": 0.0, "eviction_s": 0.0}
        self.sink = CacheSink(self)  # where the attention function leaves the model signals the policy asked for
        asked = model_signals.asked(policy.needs)
        self.produced = tuple(signal for signal in asked if signal.produce is not None)  # recorded through the sink
        self.attention_reduction = policy.needs.attention_reduction  # "sum" or "max" (see keydiff.attention)
        self._mode = Mode()  # what the cache is doing (set last: the constructor is done)

    @property
    def mode(self) -> "Mode":
        """What the cache is doing now (a value, replaced on each change)."""
        return self._mode

    @property
    def storages(self) -> list[Storage]:
        """The distinct storages, in layer order (one if stacked)."""
        return list(self._storages)

    @property
    def stack(self) -> Storage | None:
        """The storage every evicted layer shares, or None if the layers evict one by one."""
        evicted = self.evicted_layers
        if not evicted:
            return None
        storage = evicted[0].storage
        return storage if storage.count == len(evicted) > 1 else None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if isinstance(layer, SlidingWindowLayer):  # transformers' own sliding-window semantics
            return layer.update(key_states, value_states)
        storage = layer.storage
        if self._mode.scratch:  # written after the held entries, forgotten when the scratch pass ends
            return layer.update(key_states, value_states)
        if self.windows[layer_idx] is not None and bound_cache() is not self:
            raise RuntimeError(
                f"layer {layer_idx} is evicted under a sliding window: its entries are in no particular order, so only "
                "keydiff's attention function masks them right. Run the model inside `with keydiff.keydiff_attention("
                "model, cache):` (keydiff.prefill and keydiff.generate do)"
            )
        if layer_idx == self._first_evicted:
            refuse_prompt_fed_again(layer, value_states, self.max_tokens)
            if self.contiguous:  # before anything of this pass is written
                self._mode = replace(self._mode, pass_position=self.next_position())
        if isinstance(storage, AdaptiveStorage) and bound_cache() is not self:
            raise RuntimeError(
                f"layer {layer_idx} has head-adaptive budgets ({self.policy.name}): its heads' entries live in segments "
                "only keydiff's attention function reads. Run the model inside `with keydiff.keydiff_attention(model, "
                "cache):` (keydiff.prefill and keydiff.generate do)"
            )
        joining = storage.count > 1 and storage.keys is not None and layer.seen == 0
        if joining and not storage.fits(key_states, value_states):
            split_stack(self.layers, layer, self.policy)
            self._storages = distinct_storages(self.layers)
            storage = layer.storage
        # What the previous pass left to do (a plain loop never calls `evict()`), when the next pass starts.
        if self._mode.evicts and layer.seen == storage.seen and storage.pending():
            with self.timed("eviction_s"):
                storage.evict(self.policy, self.inv_freq, self.next_position() if self.contiguous else None)
        return layer.update(key_states, value_states, position=self._mode.pass_position if self.contiguous else None)

    def reset(self) -> None:
        """Empty the cache for a new sequence (fresh storages, as planned at construction)."""
        self.layers = self.plan.build(self.policy)
        self._storages = distinct_storages(self.layers)
        self.evicted_layers = evicted_layers(self.layers)
        self._mode = Mode()

    def fork(self, copies: int) -> list["EvictingCache"]:
        """`copies` independent caches holding exactly what this one holds, without re-running the prompt: each owns
        its buffers, statistics and policy object (o_proj weights stay shared). Refused inside a scratch pass."""
        if self._mode.scratch:
            raise RuntimeError("a cache cannot be forked inside a scratch pass")
        if isinstance(copies, bool) or int(copies) != copies or copies < 1:
            raise ValueError(f"copies must be a positive integer, got {copies!r}")
        forks = []
        for _ in range(int(copies)):
            cache = copy.deepcopy(self)  # the model's own tensors stay shared (keydiff.signals.Recorded)
            for layer in cache.layers:
                layer.returned_keys = None  # a copy of some earlier pass's tensor: no attention call will bring it
            forks.append(cache)
        return forks

    def next_position(self) -> int:
        """The RoPE position of the next token: tokens seen, or under contiguous re-rotation the kept keys' end."""
        first = self.layers[0]
        if not self.contiguous:
            return first.seen
        if any(layer.seen != first.seen for layer in self.layers):  # a pass is under way
            return self._mode.pass_position
        return max(entries_next(layer, self._mode.evicts) for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens seen (the next absolute position), or `next_position()` under contiguous re-rotation."""
        if self.contiguous:
            return self.next_position()
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """Keys the next pass attends to and the offset of the first (see EvictingLayer.get_mask_sizes)."""
        layer = self.layers[layer_idx]
        kept = entries_next(layer, self._mode.evicts)  # held entries (evict(drop=False)) included
        return kept + query_length, (self.next_position() if self.contiguous else layer.seen) - kept

    def timed(self, name: str) -> "_Timed":
        """`with cache.timed("statistics_s"):` adds the block's wall time to `timings[name]`."""
        return _Timed(self, name)

    @contextmanager
    def scratch(self, chunk_start: int | None = None) -> Iterator[None]:
        """`with cache.scratch(): model(...)` runs passes whose entries are not kept (KVzip's reconstruction);
        chunk_start: the first position of the tokens the pass reconstructs."""
        if self._mode.scratch:
            raise RuntimeError("scratch passes do not nest")
        windows = [(layer, layer.snapshot()) for layer in self.layers if isinstance(layer, SlidingWindowLayer)]
        for storage in self._storages:
            storage.begin_scratch()
        self._mode = replace(self._mode, scratch=True, chunk_start=chunk_start)
        try:
            yield
        finally:
            self._mode = replace(self._mode, scratch=False, chunk_start=None)
            for storage in self._storages:
                storage.end_scratch()
            for layer in self.evicted_layers:  # their tokens seen are their storages' again
                layer.returned_keys = None
            for layer, saved in windows:
                layer.restore(saved)

    @property
    def max_scratch_entries(self) -> int:
        """Peak entries any layer held for one KV head during scratch passes (0 if none ran)."""
        return max((storage.max_scratch_entries for storage in self._storages), default=0)

    def for_layer(self, layer_idx: int, key: torch.Tensor) -> LayerBinding | None:
        """What the attention function records for this layer's pass, or None if `key` is not exactly what this
        cache's layer returned from its last `update` (the model runs with another cache: plain attention)."""
        layer = self.layers[layer_idx]
        if layer.returned_keys is not key:
            return None
        needs = self.policy.needs
        if isinstance(layer, SlidingWindowLayer):
            return LayerBinding(self.sink, 0, self.attention_reduction)
        storage = layer.storage
        mode = self._mode
        signals = storage.signals.wanted(layer.plane, self.produced, mode.evicting) if self.produced else ()
        bounded = storage.budget is not None
        rows = needs.attention_rows
        if rows == 0 or not bounded or not mode.evicting:
            rows = 0
        elif needs.reconstruction and not (mode.scratch or mode.decoding):
            rows = 0  # a prefill block's own queries: only its reconstruction pass (and decoding) scores
        elif not needs.every_pass and storage.num_entries <= storage.budget:
            rows = 0  # nothing will be evicted after this pass, so the statistic would be wasted
        positions = None
        if self.windows[layer_idx] is not None:  # evicted under a sliding window: the keys' positions, out of order
            positions = layer.positions[:, :, : key.shape[2]], layer.seen
        return LayerBinding(
            self.sink, rows, self.attention_reduction, self.statistics == "materialized", positions,
            storage.segments() if isinstance(storage, AdaptiveStorage) else None,  # asking marks the pass served
            signals if bounded else ())

    def evict(self, drop: bool = True) -> None:
        """Let the policy observe the pass just run, then shrink every over-budget layer to `budget`.
        drop=False observes only: entries over the budget are held until the next `evict()`."""
        if self.budget is None or not self._mode.evicting:
            return
        if self._mode.held == drop:
            self._mode = replace(self._mode, held=not drop)
        with self.timed("eviction_s"):
            together = set()  # head-adaptive layers evicted with the rest of their segment stack, in one call
            if drop and chooses_whole_segments(self.policy) and self.policy.needs.key_rerotation is None:
                stacks: dict[int, list[AdaptiveStorage]] = {}
                for storage in self._storages:
                    if isinstance(storage, AdaptiveStorage) and storage.stack is not None:
                        stacks.setdefault(id(storage.stack), []).append(storage)
                for group in stacks.values():
                    if group[0].stack.holds(group):
                        evict_segments(group, self.policy, buffers=group[0].stack.rows())
                        together.update(id(storage) for storage in group)
            end = self.next_position() if self.contiguous else None  # where re-rotated kept keys end
            for storage in self._storages:
                if id(storage) not in together:
                    storage.evict(self.policy, self.inv_freq, end, drop=drop)

    def evicts_next_pass(self) -> bool:
        """Whether `evict()` would now drop the entries over the budget (bounded, evicting, no held pass)."""
        return self.budget is not None and self._mode.evicts

    def start_generation(self, new_tokens: int, evict: bool = True) -> None:
        """Prepare to decode up to `new_tokens` tokens, making room now. evict=False keeps every generated token
        (no eviction or statistics from now on), and held entries stay for good."""
        self._mode = replace(self._mode, evicting=evict, decoding=True)
        held = self._mode.held
        for storage in self._storages:
            if isinstance(storage, AdaptiveStorage):
                if not evict or held:
                    storage.make_room(1 if evict else new_tokens)
            elif storage.budget is None or not evict or held:
                storage.reserve(storage.num_entries + (1 if evict and storage.budget is not None else new_tokens))
        for layer in self.layers:
            layer.returned_keys = None  # may hold a released buffer

    def entries_held(self, layer_idx: int = 0) -> int:
        """Entries per KV head layer `layer_idx` holds now (not `get_seq_length()`, the tokens seen)."""
        return self.layers[layer_idx].num_entries

    @property
    def layer_budgets(self) -> list[int | None]:
        """Each layer's budget N_l (None: unbounded; a sliding layer: its window less one)."""
        return [layer.budget for layer in self.layers]

    @property
    def layer_kinds(self) -> list[str]:
        """Each layer's kind: "sliding" (bounded by its window), "evicted" (by its budget) or "full" (unbounded)."""
        return ["sliding" if isinstance(layer, SlidingWindowLayer) else "full" if layer.budget is None else "evicted"
                for layer in self.layers]

    @property
    def layer_max_entries(self) -> list[int]:
        """Each layer's peak entries per KV head."""
        return [layer.max_entries for layer in self.layers]

    @property
    def layer_max_total_entries(self) -> list[int]:
        """Each layer's peak entries over all its KV heads (per batch row)."""
        return [layer.max_total_entries for layer in self.layers]

    @property
    def layer_kv_heads(self) -> list[int]:
        """Each layer's KV heads (0 before its first pass)."""
        return [0 if layer.keys is None else (layer.storage.heads if isinstance(layer, AdaptiveLayer) else
                                              layer.keys.shape[1]) for layer in self.layers]

    def kept_positions(self) -> list[torch.Tensor]:
        """Absolute positions held, one LongTensor [batch, kv_heads, entries] per layer, ascending (copies);
        head-adaptive layers pad shorter heads with -1."""
        return [layer.kept_positions() for layer in self.layers]

    @property
    def entries_peak_sum(self) -> int:
        """Sum over layers of each layer's peak entries per KV head, scratch passes included."""
        return sum(layer.max_entries if isinstance(layer, SlidingWindowLayer) else
                   max(layer.max_entries, layer.storage.max_scratch_entries) for layer in self.layers)

    @property
    def max_entries(self) -> int:
        """Peak number of entries any layer held for one KV head."""
        return max((layer.max_entries for layer in self.layers), default=0)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the key and value buffers hold (allocated capacity, every layer; see docs/design/cache.md#memory):
        each stack's from its arena (a shared arena's slot: that slot only), the other layers' allocations."""
        sizes = {}
        for storage in self._storages:
            if isinstance(storage, Storage):
                sizes.update(storage.handle.arena.bytes_of(storage.handle.slot))
        for layer in self.layers:
            if not isinstance(layer, EvictingLayer) or isinstance(layer, AdaptiveLayer):
                sizes.update(allocation_bytes(layer.keys, layer.values))
        return sum(sizes.values())

    @property
    def allocations(self) -> int:
        """Buffer allocations over all layers since the sequence started (one per layer when sized right)."""
        return sum(layer.allocations for layer in self.layers)


@dataclass(frozen=True)
class Mode:
    """What an `EvictingCache` is doing, one value replaced on each change: decoding (after `start_generation`),
    evicting, held (after `evict(drop=False)`), scratch (inside `scratch()`), pass_position (contiguous re-rotation)."""

    decoding: bool = False
    evicting: bool = True
    held: bool = False
    scratch: bool = False
    chunk_start: int | None = None
    pass_position: int = 0

    @property
    def evicts(self) -> bool:
        """The next pass starts by dropping the entries over the budget (evicting, nothing held)."""
        return self.evicting and not self.held


class _Timed:
    """The context manager `EvictingCache.timed` returns (a class: it runs per layer and step)."""

    __slots__ = ("cache", "name", "start")

    def __init__(self, cache: EvictingCache, name: str):
        self.cache, self.name = cache, name

    def __enter__(self) -> None:
        self.start = self.clock()

    def __exit__(self, *exc_info: Any) -> None:
        self.cache.timings[self.name] += self.clock() - self.start

    def clock(self) -> float:
        """Wall time; synchronises the GPU first when profiling so the time is the kernels' time."""
        if self.cache.profile and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()


class CacheSink(StatisticSink):
    """Where the attention function leaves what `EvictingCache`'s policy scores from, in the layers' storages."""

    __slots__ = ("cache",)

    def __init__(self, cache: EvictingCache):
        self.cache = cache

    def write(self, layer_idx: int, statistic: torch.Tensor) -> None:
        """Keep the statistic over the held entries (a scratch pass's own keys are not kept)."""
        layer = self.cache.layers[layer_idx]
        kept = layer.storage.scratch_kept
        layer.storage.signals.put(layer.plane, "attention", statistic if kept is None else statistic[..., :kept])

    def record(self, layer_idx: int, signals: tuple, module: torch.nn.Module, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, output: torch.Tensor) -> None:
        """Fold a layer's pass into what its storage keeps of `signals` (keydiff.signals.Recorded)."""
        cache = self.cache
        layer = cache.layers[layer_idx]
        # The queries were rotated for their RoPE positions: the absolute ones, or the pass's under contiguous re-rotation.
        start = cache.mode.pass_position if cache.contiguous else layer.seen - query.shape[2]
        step = model_signals.LayerPass(module, query, key, value, output, start, cache.policy.needs)
        layer.storage.signals.record(layer.plane, signals, step)

    def key_mask(self, layer_idx: int, keys: int) -> torch.Tensor | None:
        """In a scratch pass, the held keys the policy reconstructs from and the pass's own; else None (all keys)."""
        cache = self.cache
        if not cache.mode.scratch:
            return None
        layer = cache.layers[layer_idx]
        kept = layer.storage.scratch_kept
        chosen = cache.policy.reconstruction_keys(layer.positions[:, :, :kept], cache.mode.chunk_start)
        if chosen is None:
            return None
        own = torch.ones(*chosen.shape[:2], keys - kept, dtype=torch.bool, device=chosen.device)
        return torch.cat([chosen, own], dim=-1)

    def timed(self, name: str) -> "_Timed":
        return self.cache.timed(name)


def refuse_prompt_fed_again(layer: EvictingLayer, value_states: torch.Tensor, max_tokens: int | None) -> None:
    """Refuse the whole consumed prompt (`max_tokens`) fed a second time (what model.generate does when its cache
    covers it): layer 0's values match the kept ones."""
    q, seen = value_states.shape[-2], layer.seen
    if max_tokens is None or seen != max_tokens or q != seen or layer.num_entries == 0:
        return
    positions, kept = layer.held_entries()
    value_states = value_states[: positions.shape[0], : positions.shape[1]]
    again = value_states.gather(2, positions[..., None].expand(-1, -1, -1, value_states.shape[-1]))
    tolerance = max(REFED_TOLERANCE, REFED_ROUNDINGS * torch.finfo(kept.dtype).eps)
    scale = kept.abs().max().float().clamp_min(1e-6)
    if float((again.float() - kept.float()).abs().max()) <= tolerance * float(scale):
        raise RuntimeError(
            "this cache already holds the whole prompt, which is being fed again (what model.generate does when "
            "its cache covers all of input_ids). Continue with keydiff.generate(model, state, ...), or "
            "prefill all but the last prompt token: state = keydiff.prefill(model, prompt[:, :-1], ...), then "
            "model.generate(prompt, cache=state.cache, ...)"
        )


def split_stack(layers: list, leaving: EvictingLayer, policy: Policy) -> None:
    """Give `leaving` (which does not fit its stack) a storage of its own, and every other layer its own plane."""
    stack = leaving.storage
    for part, plane in zip(stack.split(), range(stack.count)):
        layer = layers[stack.layers[plane]]
        if layer is leaving:
            own = Storage((layer.layer_idx,), stack.budget, stack.capacity, policy.needs.state,
                          policy.entry_state)  # nothing written yet: allocated by its first write
            layer.move_to(own, 0, new_buffers=True)
        else:
            layer.move_to(part, 0, new_buffers=False)


def entries_next(layer: EvictingLayer, evicting: bool) -> int:
    """Entries the layer holds when the next pass starts (after the pending eviction, unless none will run)."""
    return layer.entries_after_eviction() if evicting else layer.num_entries


def evicted_layers(layers: list) -> list[EvictingLayer]:
    """The layers that live in storages (all but sliding-window ones)."""
    return [layer for layer in layers if not isinstance(layer, SlidingWindowLayer)]
