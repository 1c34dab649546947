"""One layer of an evicting cache as transformers sees it: a view of its plane in a `Storage`.

It keeps its storage and plane and the key tensor it last returned from `update` (how the attention function recognises
its buffer); the tokens it has seen, counts, buffers and statistics are the storage's (its arena's)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from keydiff.cache.storage import Storage
from keydiff.policies.base import LayerView


def refuse_batch_change(held: int | None, given: int) -> None:
    """Raise if a pass brings another number of batch rows than the cache holds (None: nothing held yet)."""
    if held is not None and given != held:
        raise RuntimeError(
            f"the batch changed from {held} to {given} rows: an evicting cache supports neither beam search nor "
            "num_return_sequences; use keydiff.generate (greedy or sampling)"
        )


class EvictingLayer(CacheLayerMixin):
    """One layer's bounded cache: a plane of a storage (its own when built alone, or the shared stack)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        budget: int | None,
        capacity: int | None,
        state_names: tuple[str, ...] = (),
        entry_state: Callable[[LayerView], dict[str, torch.Tensor]] | None = None,
        layer_idx: int = 0,
        storage: Storage | None = None,
        plane: int = 0,
    ):
        # CacheLayerMixin.__init__ would assign keys/values, which are views of the storage here.
        self.is_initialized = False
        self.layer_idx = layer_idx
        self.storage = storage if storage is not None else Storage((layer_idx,), budget, capacity, state_names,
                                                                   entry_state)
        self.plane = plane
        # What the last `update` returned (see module docstring); older after a pass another party wrote.
        self.returned_keys: torch.Tensor | None = None
        self.earlier_allocations = 0  # allocations of storages this layer has left

    def move_to(self, storage: Storage, plane: int, new_buffers: bool) -> None:
        """Continue in `storage` at `plane` (new_buffers: its buffers are not the ones this layer had)."""
        if new_buffers:
            self.earlier_allocations += self.storage.allocations
        self.storage, self.plane = storage, plane

    @property
    def seen(self) -> int:
        """Tokens this layer has been given (the absolute position of the next one): its storage's, less a pass
        under way that this layer has not written yet."""
        return self.storage.layer_seen(self.plane)

    @property
    def keys(self) -> torch.Tensor | None:
        """[batch, kv_heads, capacity, dim]: this layer's key buffer (valid entries first)."""
        return self.storage.planes[self.plane]["keys"] if self.storage.keys is not None else None

    @property
    def values(self) -> torch.Tensor | None:
        return self.storage.planes[self.plane]["values"] if self.storage.keys is not None else None

    @property
    def positions(self) -> torch.Tensor | None:
        """[batch, kv_heads, capacity] absolute positions of the entries (long)."""
        return self.storage.planes[self.plane]["positions"] if self.storage.keys is not None else None

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """Policy state buffers, name -> [batch, kv_heads, capacity] float32."""
        return self.storage.planes[self.plane]["state"] if self.storage.keys is not None else {}

    @property
    def attention(self) -> torch.Tensor | None:
        """The attention statistic recorded in the last pass [batch, kv_heads, entries], until eviction uses it."""
        return self.storage.signals.get(self.plane, "attention")

    @property
    def queries(self):
        """The layer's running query statistics (keydiff.signals), for a policy with `needs.queries`."""
        return self.storage.signals.get(self.plane, "queries")

    @property
    def budget(self) -> int | None:
        return self.storage.budget

    @property
    def capacity(self) -> int | None:
        return self.storage.capacity

    @property
    def num_entries(self) -> int:
        """Valid entries per KV head (the same for every head)."""
        return self.storage.num_entries

    @property
    def max_entries(self) -> int:
        """Peak entries per KV head ever held."""
        return self.storage.max_entries

    @property
    def max_total_entries(self) -> int:
        """Peak entries held by the layer, all KV heads together (per batch row)."""
        keys = self.storage.keys
        return 0 if keys is None else keys.shape[2] * self.storage.max_entries

    @property
    def allocations(self) -> int:
        """Buffer (re)allocations this layer went through this sequence: 1 when the capacity was right."""
        return self.earlier_allocations + self.storage.allocations

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, position: int | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a pass's keys/values [batch, kv_heads, q, dim] after the kept entries; return the valid ones.
        position: the RoPE position of the pass's first token (key re-rotation; default: tokens seen)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = self.storage.keys
        refuse_batch_change(None if keys is None else keys.shape[1], key_states.shape[0])
        keys, values = self.storage.write(self.plane, key_states, value_states, position)
        self.returned_keys = keys
        return keys, values

    def view(self, layer_idx: int | None = None) -> LayerView:
        """This layer's valid entries as a policy sees them (views, buffer order); `layer_idx` must be its own."""
        if layer_idx is not None and layer_idx != self.layer_idx:
            raise ValueError(f"this is layer {self.layer_idx}, not layer {layer_idx}")
        return self.storage.view(self.plane)

    def kept_positions(self) -> torch.Tensor:
        """Absolute positions held, [batch, kv_heads, entries], ascending (a copy)."""
        return self.positions[:, :, : self.num_entries].sort(dim=-1).values

    def held_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [batch, kv_heads, n], values [batch, kv_heads, n, dim]) of the valid entries (views)."""
        n = self.num_entries
        return self.positions[:, :, :n], self.values[:, :, :n]

    def get_seq_length(self) -> int:
        """Tokens seen so far: the absolute position of the next token (not the number of entries held)."""
        return self.seen

    def entries_after_eviction(self) -> int:
        return self.storage.entries_after_eviction()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Keys the next pass attends to, and the offset that makes transformers' causal mask exact: seen - entries
        maps key j to position j + offset, so every kept entry and the new tokens causally are visible."""
        kept = self.entries_after_eviction()
        return kept + query_length, self.seen - kept

    def get_max_length(self) -> int:
        return -1 if self.budget is None else self.budget

    # transformers' generate() calls these for beam search and the like: every buffer would need reordering.
    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be cropped (no assisted decoding); use keydiff.generate")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("an evicting cache does not support beam search; use keydiff.generate")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("an evicting cache cannot be expanded (num_return_sequences); use keydiff.generate")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("an evicting cache does not support batch selection; use keydiff.generate")

    def offload(self) -> None:
        raise NotImplementedError("an evicting cache cannot be offloaded")

    def reset(self) -> None:
        """Empty this layer for a new sequence (a layer of a stack is reset with its cache: `cache.reset()`)."""
        old = self.storage
        if old.count > 1:
            raise NotImplementedError("this layer shares its storage with other layers: reset the whole cache")
        self.storage = Storage(old.layers, old.budget, old.capacity, old.state_names, old.entry_state)
        self.returned_keys, self.earlier_allocations, self.is_initialized = None, 0, False
