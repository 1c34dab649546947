"""Where an evicting cache keeps each layer: `plan_memory` decides each layer's budget, capacity and kind and which
layers share one storage (a pure function: nothing is allocated); `MemoryPlan.build` makes the layers.
Design: docs/design/cache.md#the-cache"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from keydiff.cache.adaptive import AdaptiveLayer, AdaptiveStorage, SegmentStack
from keydiff.cache.layer import EvictingLayer
from keydiff.cache.sliding import SlidingWindowLayer, layer_windows
from keydiff.cache.storage import Storage
from keydiff.policies.base import Policy
from keydiff.queries import rope_frequencies
from keydiff.signals import asked

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    """The planned layers: the cache's budget, per-layer budgets and capacities (None: unbounded / unknown), the sliding
    layers, the stacks of layers sharing one storage and the RoPE frequencies for key re-rotation (if any)."""

    budget: int | None
    windows: tuple[int | None, ...]
    sliding: frozenset[int]
    budgets: tuple[int | None, ...]
    capacities: tuple[int | None, ...]
    stacks: tuple[tuple[int, ...], ...]
    head_adaptive: bool
    inv_freq: torch.Tensor | None
    contiguous: bool

    @property
    def first_evicted(self) -> int | None:
        """The first layer that lives in a storage (not a sliding-window layer), or None."""
        return next((i for i in range(len(self.windows)) if i not in self.sliding), None)

    def build(self, policy: Policy) -> list[EvictingLayer | SlidingWindowLayer]:
        """Fresh, empty layers as planned (storages allocate on their first write)."""
        needs, state = policy.needs, policy.entry_state
        layers: list[Any] = []
        if self.head_adaptive:
            stacks = {i: stack for stack in map(SegmentStack, self.stacks) for i in stack.layers}
            for i, (b, c) in enumerate(zip(self.budgets, self.capacities)):
                layers.append(EvictingLayer(b, c, needs.state, state, layer_idx=i) if b is None else AdaptiveLayer(
                    AdaptiveStorage(i, b, c, needs.state, state, asked(needs), stacks.get(i)), i))
        else:
            layers = [EvictingLayer(b, c, needs.state, state, layer_idx=i)
                      for i, (b, c) in enumerate(zip(self.budgets, self.capacities))]
            for group in self.stacks:
                budget, capacity = self.budgets[group[0]], self.capacities[group[0]]
                stack = Storage(group, budget, capacity, needs.state, state)
                for plane, i in enumerate(group):
                    layers[i] = EvictingLayer(budget, capacity, layer_idx=i, storage=stack, plane=plane)
        return [SlidingWindowLayer(self.windows[i], i) if i in self.sliding else layer
                for i, layer in enumerate(layers)]


def plan_memory(
    policy: Policy,
    budget: int | None,
    num_layers: int,
    block_size: int | None = None,
    max_tokens: int | None = None,
    scratch_tokens: int = 0,
    placements: list[Any] | None = None,
    config: Any = None,
    compressed_tokens: int | None = None,
) -> MemoryPlan:
    """Plan an `EvictingCache`'s layers (its constructor's arguments; see its docstring). One shared stack per
    placement when the policy and budgets allow, else one storage per layer."""
    needs = policy.needs
    inv_freq = rerotation_frequencies(policy, config)
    contiguous = needs.key_rerotation == "contiguous" and needs.evicts
    budget = budget if needs.evicts else None
    if placements is not None and len(placements) != num_layers:
        raise ValueError(f"layer_placements has {len(placements)} entries for {num_layers} layers")
    placements = list(placements) if placements is not None else [None] * num_layers
    windows = tuple(layer_windows(config, num_layers))  # each layer's sliding window (None: full attention)
    sliding = sliding_layers(policy, windows, budget, contiguous)
    # The tokens eviction sees (sizing a layer schedule): the prompt, or its context when a suffix is held.
    compressed = max_tokens if compressed_tokens is None else compressed_tokens
    # Each layer's own budget N_l (None: never evicted): the policy's layer schedule, uniform by default.
    budgets = [None] * num_layers if budget is None else policy.budgets(budget, num_layers, compressed)
    evicted = [i for i in range(num_layers) if i not in sliding]
    budgets = [b if i in evicted else None for i, b in enumerate(budgets)]
    capacities = [max_tokens if b is None else bounded_capacity(b, block_size, max_tokens) for b in budgets]
    if scratch_tokens:  # a scratch pass writes after the kept entries and the block
        capacities = [None if c is None else c + scratch_tokens for c in capacities]
    if needs.head_adaptive:  # one buffer of per-head segments per bounded layer (capacity: entries per head)
        shared = tuple(i for i, b in enumerate(budgets) if b is not None)
    else:
        shared = tuple(evicted) if needs.rows_alike else ()
    stackable = (bool(shared) and budgets[shared[0]] is not None and capacities[shared[0]] is not None
                 and len({budgets[i] for i in shared}) == 1 and len({capacities[i] for i in shared}) == 1)
    # One stack per placement (a layer alone in its placement keeps a storage of its own).
    stacks = tuple(group for group in placement_groups(shared, placements) if len(group) > 1) if stackable else ()
    return MemoryPlan(budget, windows, sliding, tuple(budgets), tuple(capacities), stacks, needs.head_adaptive,
                      inv_freq, contiguous)


def rerotation_frequencies(policy: Policy, config: Any) -> torch.Tensor | None:
    """RoPE inverse frequencies (float64) for a re-rotating policy, from the model config; else None."""
    if policy.needs.key_rerotation is None or not policy.needs.evicts:
        return None
    if config is None:
        raise ValueError(f"policy {policy.name!r} re-rotates keys (key_rerotation): build the cache with "
                         "config=model.config so that it knows the model's RoPE frequencies")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return rope_frequencies(config, head_dim)[0]


def sliding_layers(policy: Policy, windows: tuple[int | None, ...], budget: int | None,
                   contiguous: bool) -> frozenset[int]:
    """The layers served by a `SlidingWindowLayer` (see docs/design/cache.md#sliding-window-layers-slidingpy)."""
    sizes = [w for w in windows if w is not None]
    if not sizes:
        return frozenset()
    if contiguous:
        raise ValueError(f"policy {policy.name!r} re-rotates keys to contiguous positions, which sliding-window "
                         "attention (by absolute positions) cannot follow")
    if len(sizes) == len(windows) and budget is not None:
        if budget < min(sizes):
            if policy.needs.head_adaptive:
                raise ValueError(f"policy {policy.name!r} has head-adaptive budgets, which keydiff-bench does not "
                                 "combine with sliding windows (every layer of this model slides)")
            return frozenset()
        LOG.warning("every layer has a sliding window of %d tokens, which already bounds the cache at a budget "
                    "of %d: no eviction (policy %s)", min(sizes), budget, policy.name)
    return frozenset(i for i, w in enumerate(windows) if w is not None)


def placement_groups(layers: tuple[int, ...], placements: list[Any]) -> list[tuple[int, ...]]:
    """`layers` grouped by placement (device and dtype of their keys), each group in layer order."""
    groups: dict[Any, list[int]] = {}
    for i in layers:
        groups.setdefault(placements[i], []).append(i)
    return [tuple(group) for group in groups.values()]


def bounded_capacity(budget: int, block_size: int | None, max_tokens: int | None) -> int | None:
    """Entries for a layer bounded to `budget`: budget + block (at most the prompt), at least budget + 1; None if unknown."""
    if not (block_size or max_tokens):
        return None
    capacity = budget + (block_size or max_tokens)
    if max_tokens is not None:
        capacity = min(capacity, max_tokens)
    return max(capacity, budget + 1)


def distinct_storages(layers: list) -> list[Storage]:
    """The distinct storages of the layers that live in one (not sliding-window layers), in layer order."""
    seen: dict[int, Storage] = {}
    for layer in layers:
        if not isinstance(layer, SlidingWindowLayer):
            seen.setdefault(id(layer.storage), layer.storage)
    return list(seen.values())
