"""The cache a batched forward pass runs with: `BatchCache` hands each sequence's rows to its own `EvictingCache` for
one pass. Design: docs/design/decode.md"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from keydiff.attention import RowBatch, bound_cache, bound_to
from keydiff.decode.blocks import evict_groups, grouped_passes, runs, write_groups
from keydiff.cache import EvictingCache


class _RowLayer(CacheLayerMixin):
    """What transformers asks a layer of the batch cache (mask sizes, length); the sequences hold the entries."""

    is_sliding = False

    def __init__(self, owner: "BatchCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("a batch cache's layers are written through BatchCache.update")

    def get_seq_length(self) -> int:
        return max((cache.get_seq_length(self.layer_idx) for cache in self.owner.caches), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The widest sequence's sizes (the keydiff attention functions ignore the model's mask: each sequence is
        computed over its own entries)."""
        sizes = [cache.get_mask_sizes(query_length, self.layer_idx) for cache in self.owner.caches]
        return max(sizes, default=(query_length, 0))

    def get_max_length(self) -> int:
        return -1


class BatchCache(Cache, RowBatch):
    """A transformers Cache over the sequences of one pass (`caches`, `spans[i]` their rows). It runs only inside
    `keydiff_attention(model, batch_cache)` and needs `position_ids` per row; `evict()` evicts every sequence."""

    def __init__(self, num_layers: int, group_rows: bool = True):
        super().__init__(layers=[_RowLayer(self, i) for i in range(num_layers)])
        self.caches: list[EvictingCache] = []
        self.spans: list[slice] = []
        self.group_rows = group_rows  # one-row sequences side by side with equal counts run as one
        self._passes: dict[int, tuple[torch.Tensor, list[tuple[EvictingCache, slice, torch.Tensor, torch.Tensor]]]] = {}
        self._groups: dict[int, list[tuple[list[int], torch.Tensor, torch.Tensor]]] = {}
        self._runs: list = []

    def bind(self, caches: list[EvictingCache], rows: list[int]) -> None:
        """The sequences of the next pass, in batch order, and how many rows each has."""
        self.caches, self.spans, start = list(caches), [], 0
        for count in rows:
            self.spans.append(slice(start, start + count))
            start += count
        self._runs = []

    def release(self) -> None:
        """Forget the pass's sequences (nothing of theirs is held between steps)."""
        self.caches, self.spans, self._runs = [], [], []
        self._passes.clear()
        self._groups.clear()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if bound_cache() is not self:
            raise RuntimeError("a BatchCache runs only inside `with keydiff.keydiff_attention(model, batch_cache):` "
                               "(its rows are computed by keydiff's attention function); use keydiff.generate_batch")
        rows = self.spans[-1].stop if self.spans else 0
        if key_states.shape[0] != rows:
            raise RuntimeError(f"the pass has {key_states.shape[0]} rows, the batch cache {rows}")
        # After the pass's first layer (every sequence made room through its own update), a group's rows are
        # written in one copy; their passes hold no keys: the group attends as one (`row_groups`).
        written = write_groups(self._runs, self.caches, layer_idx, key_states, value_states) if self._groups else ()
        passes = []
        for index, (cache, span) in enumerate(zip(self.caches, self.spans)):
            if index in written:
                passes.append((cache, span, None, None))
                continue
            with bound_to(cache):  # e.g. head-adaptive layers check that their own cache is the bound one
                keys, values = cache.update(key_states[span], value_states[span], layer_idx)
            passes.append((cache, span, keys, values))
        self._passes[layer_idx] = (key_states, passes)
        if self.group_rows:
            if not self._groups:  # the pass's first layer: every sequence's count has moved on, group them once
                self._runs = runs(self.caches, self.spans)
            self._groups[layer_idx] = grouped_passes(self._runs, self.caches, layer_idx)
        return key_states, value_states

    @property
    def groups(self) -> list:
        """The pass's groups of rows that run as one (keydiff.decode.blocks.Group), found at its first layer."""
        return self._runs

    def row_passes(self, layer_idx: int, key: torch.Tensor):
        entry = self._passes.get(layer_idx)
        return entry[1] if entry is not None and entry[0] is key else None

    def row_groups(self, layer_idx: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        return self._groups.get(layer_idx, [])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The most tokens any sequence has seen (they differ: the step passes each row's position_ids)."""
        return self.layers[layer_idx].get_seq_length()

    def evict(self) -> None:
        """Every sequence observes the pass and evicts, as a run of it alone does after each pass (the one-row
        sequences of a group in one call, keydiff.decode.blocks.evict_groups)."""
        self._passes.clear()
        self._groups.clear()
        done = evict_groups(self.caches, self.spans) if self.group_rows else set()
        for cache in self.caches:
            if id(cache) not in done:
                cache.evict()
