"""The bounded caches of a batch's rows side by side in one allocation, so that rows alike run as one.

Why. A batch of sequences (keydiff.batching) keeps one `EvictingCache` per sequence, so that no row ever scores,
keeps or attends to an entry that is not its own. Decoding them with one attention call and one eviction per
row costs a kernel launch (and, with several threads, a parallel region) per row and layer, which at batch 8
is a large part of a step. Rows whose stacks hold the same number of entries can instead run as one tensor:
one SDPA call per layer, one scoring call and one top-k per step, each row still computed over exactly its own
entries (batch rows are independent in these kernels). Copying the rows' buffers together at every step would
cost more than it saves, so their buffers live together instead: a `RowPool` owns blocks
[slots, layers, kv_heads, capacity, dim] and a row's stack storage adopts views of its slot when the row joins
(one copy), and buffers of its own again when it leaves (one copy of its valid entries), so nothing a finished
sequence holds is ever overwritten by the row that takes its slot. Entry counts, tokens seen and statistics stay
the row's own (its `Storage`); only the memory is shared.

Only what provably scores rows alike joins (`poolable`): one stack holding every layer (no sliding-window layers,
no head-adaptive pools, no per-layer budgets), and a policy that scores each row by its own entries
(`layers_batchable`) from the entries alone: no attention statistic (H2O, TOVA, SnapKV keep their per-row path),
no queries, no output projection, no key re-rotation. Every other cache decodes row by row, as before.
Rows group only when their slots are consecutive, their counts equal and their policies equal (`runs`): a row
is never padded to another's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from keydiff.cache.cache import EvictingCache
from keydiff.cache.storage import Storage, drop_entries, empty_buffers
from keydiff.policies.base import LayerView


def poolable(cache: EvictingCache) -> bool:
    """Whether this cache's rows can run grouped with others (see the module): a single stack of every layer and
    a policy that scores rows alike from their entries alone."""
    policy, stack = cache.policy, cache.stack
    return (stack is not None and len(cache.storages) == 1 and stack.keys is not None and stack.budget is not None
            and stack.keys.shape[1] == 1 and stack.scratch_mark is None and not cache.sliding
            and all(window is None for window in cache.windows) and policy.layers_batchable
            and policy.attention_rows == 0 and not policy.needs_queries and not policy.needs_output_projection
            and policy.key_rerotation is None and not policy.head_adaptive and not policy.needs_reconstruction)


@dataclass
class _Block:
    """Buffers for `slots` rows of one shape: keys/values [slots, layers, kv_heads, capacity, dim]."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    state: dict[str, torch.Tensor]
    members: dict[int, EvictingCache] = field(default_factory=dict)  # slot -> cache

    def free_slot(self) -> int | None:
        return next((s for s in range(self.keys.shape[0]) if s not in self.members), None)


class RowPool:
    """Blocks of `slots` rows each, one per buffer shape; see the module."""

    def __init__(self, slots: int):
        self.slots = slots
        self.blocks: dict[tuple, _Block] = {}
        self.home: dict[int, tuple[_Block, int]] = {}  # id(cache) -> (block, slot)

    @staticmethod
    def _shape(storage: Storage) -> tuple:
        keys, values = storage.keys, storage.values
        return (keys.shape, values.shape, keys.dtype, values.dtype, keys.device, storage.state_names, storage.budget)

    def join(self, cache: EvictingCache) -> bool:
        """Move a poolable cache's stack into a free slot (its buffers then are views of the block); False if the
        cache is not poolable or no slot is free (it then decodes row by row)."""
        if id(cache) in self.home or not poolable(cache):
            return False
        storage = cache.stack
        key = self._shape(storage)
        block = self.blocks.get(key)
        if block is None:
            keys, values, positions, state = empty_buffers(self.slots * storage.count, storage.keys[0], storage.values[0],
                                                           storage.capacity, storage.state_names)
            split = (self.slots, storage.count)
            block = _Block(keys.view(*split, *keys.shape[2:]), values.view(*split, *values.shape[2:]),
                           positions.view(*split, *positions.shape[2:]),
                           {name: s.view(*split, *s.shape[2:]) for name, s in state.items()})
            self.blocks[key] = block
        slot = block.free_slot()
        if slot is None:
            return False
        n = storage.num_entries
        mine = (block.keys[slot], block.values[slot], block.positions[slot],
                {name: s[slot] for name, s in block.state.items()})  # [layers, kv_heads, capacity(, dim)]
        mine[0][:, :, :n].copy_(storage.keys[:, 0, :, :n])
        mine[1][:, :, :n].copy_(storage.values[:, 0, :, :n])
        mine[2][:, :, :n].copy_(storage.positions[:, 0, :, :n])
        for name, s in mine[3].items():
            s[:, :, :n].copy_(storage.state[name][:, 0, :, :n])
        storage.adopt(mine[0].unsqueeze(1), mine[1].unsqueeze(1), mine[2].unsqueeze(1),
                      {name: s.unsqueeze(1) for name, s in mine[3].items()})
        block.members[slot] = cache
        self.home[id(cache)] = (block, slot)
        return True

    def leave(self, cache: EvictingCache) -> None:
        """Give the cache buffers of its own again (a copy of its valid entries) and free its slot."""
        entry = self.home.pop(id(cache), None)
        if entry is None:
            return
        block, slot = entry
        del block.members[slot]
        storage = cache.stack
        if storage is None or not self._in_slot(storage, block, slot):
            return  # it has left the slot by itself (buffers of its own already)
        n = storage.num_entries
        keys, values, positions, state = empty_buffers(storage.count, storage.keys[0], storage.values[0],
                                                       storage.capacity, storage.state_names)
        keys[..., :n, :] = storage.keys[..., :n, :]
        values[..., :n, :] = storage.values[..., :n, :]
        positions[..., :n] = storage.positions[..., :n]
        for name, buffer in state.items():
            buffer[..., :n] = storage.state[name][..., :n]
        storage.adopt(keys, values, positions, state)

    def leave_all(self) -> None:
        for block in list(self.blocks.values()):
            for cache in list(block.members.values()):
                self.leave(cache)

    @staticmethod
    def _in_slot(storage: Storage, block: _Block, slot: int) -> bool:
        return storage.keys is not None and storage.keys.data_ptr() == block.keys[slot].data_ptr()

    def runs(self, caches: list[EvictingCache]) -> list[tuple[_Block, int, list[int]]]:
        """Groups of two or more of `caches` (their indices in the list) that run as one: members of one block in
        consecutive slots, holding equal entry counts, with equal policies; each as (block, first slot,
        indices in slot order). Rows in no group run on their own."""
        by_slot: dict[int, list[tuple[int, int]]] = {}
        blocks: dict[int, _Block] = {}
        for index, cache in enumerate(caches):
            entry = self.home.get(id(cache))
            if entry is None or not self._in_slot(cache.stack, *entry):
                continue
            block, slot = entry
            blocks[id(block)] = block
            by_slot.setdefault(id(block), []).append((slot, index))
        groups = []
        for block_id, members in by_slot.items():
            members.sort()
            run = [members[0]]
            for slot, index in members[1:] + [(None, None)]:
                previous = caches[run[-1][1]]
                if (slot is not None and slot == run[-1][0] + 1
                        and caches[index].stack.num_entries == previous.stack.num_entries
                        and caches[index].policy == previous.policy):
                    run.append((slot, index))
                    continue
                if len(run) > 1:
                    groups.append((blocks[block_id], run[0][0], [i for _, i in run]))
                run = [(slot, index)]
        return groups

    def evict(self, caches: list[EvictingCache]) -> set[int]:
        """Evict every group of `caches` that can evict as one (see `runs`; rows over their budget, evicting, no
        held entries) in one scoring call and one drop; returns the ids of the caches it evicted (the caller
        evicts the others one by one). Each row is timed its share of the group's eviction."""
        done: set[int] = set()
        ready = [c for c in caches if c._evicting and not c._held and c.stack is not None
                 and c.stack.num_entries > c.stack.budget]
        for block, first, indices in self.runs(ready):
            members = [ready[i] for i in indices]
            start = time.perf_counter()
            self._evict_group(block, first, members)
            share = (time.perf_counter() - start) / len(members)
            for cache in members:
                cache.timings["eviction_s"] += share
                done.add(id(cache))
        return done

    @staticmethod
    def _evict_group(block: _Block, first: int, members: list[EvictingCache]) -> None:
        """What `Storage.evict` does for one stack, for consecutive slots at once (rows layer-major within each
        sequence, sequences in slot order): the policy sees each row's own entries only."""
        storages = [cache.stack for cache in members]
        for storage in storages:
            storage.initialize_state()  # the new entries' policy state, each sequence's own
        lead, count = storages[0], storages[0].count
        stop, n, budget = first + len(members), lead.num_entries, lead.budget
        rows = len(members) * count

        def flat(buffer: torch.Tensor) -> torch.Tensor:
            return buffer[first:stop].reshape(rows, *buffer.shape[2:])

        buffers = {"keys": flat(block.keys), "values": flat(block.values), "positions": flat(block.positions),
                   "state": {name: flat(s) for name, s in block.state.items()}}
        view = LayerView(keys=buffers["keys"][:, :, :n], values=buffers["values"][:, :, :n],
                         positions=buffers["positions"][:, :, :n], attention=None,
                         state={name: s[:, :, :n] for name, s in buffers["state"].items()},
                         layers=lead.layers * len(members))
        policy = members[0].policy
        drop_entries(buffers, budget, n, policy.evict_indices(view, budget))
        for storage in storages:
            storage.num_entries = budget
            storage.attention = [None] * count


def grouped_passes(runs: list[tuple[_Block, int, list[int]]], caches: list[EvictingCache],
                   layer_idx: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """For the attention function: the groups (`RowPool.runs` of this pass's rows `caches`) with their keys and
    values of layer `layer_idx` as one tensor each [rows, kv_heads, n, dim], views of the block (no copy)."""
    out = []
    for block, first, indices in runs:
        lead = caches[indices[0]].stack
        slot, n = lead.layers.index(layer_idx), lead.num_entries
        stop = first + len(indices)
        out.append((indices, block.keys[first:stop, slot, :, :n], block.values[first:stop, slot, :, :n]))
    return out
