"""The block manager: where the stacks of several sequences live side by side, so that rows alike decode as one.

Blocks come from forks (`place_forks`), from sequences joining a batch (`JoinPool`) and from a run's prefill slot
(`PrefillSlot`); ownership is the storage's `Placement`.
Design: docs/design/decode.md#rows-alike-run-as-one-blockspy
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from keydiff.cache import EvictingCache
from keydiff.cache.evict import Rows, evict
from keydiff.cache.storage import Placement, Storage, empty_buffers


def poolable(cache: EvictingCache, statistic: bool = False) -> bool:
    """Whether this cache's rows can run grouped with others: one stack of every layer and a policy scoring rows
    alike from their entries alone. statistic=True also admits attention-statistic policies (one-slot blocks only)."""
    policy, stack = cache.policy, cache.stack
    return (stack is not None and len(cache.storages) == 1 and stack.keys is not None and stack.budget is not None
            and stack.keys.shape[1] == 1 and stack.scratch_mark is None and not cache.sliding
            and all(window is None for window in cache.windows) and policy.needs.rows_alike
            and (statistic or policy.needs.attention_rows == 0) and not policy.needs.queries
            and not policy.needs.output_projection
            and policy.needs.key_rerotation is None and not policy.needs.head_adaptive and not policy.needs.reconstruction)


@dataclass(eq=False)
class RowBlock:
    """Buffers for the stacks of several sequences: keys/values [slots, layers, kv_heads, capacity, dim], and
    the storage occupying each slot (`occupants`, set by `take`, cleared by `vacate`)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    state: dict[str, torch.Tensor]
    layout: tuple
    occupants: list[Storage | None] = field(default_factory=list)

    def holds(self, storage: Storage, slot: int) -> bool:
        """Whether the storage lives in `slot` of this block (placed there and not grown out since)."""
        placement = storage.placement
        return placement is not None and placement.block is self and placement.slot == slot and placement.resident

    @property
    def slots(self) -> int:
        return self.keys.shape[0]

    @classmethod
    def like(cls, storage: Storage, slots: int) -> "RowBlock":
        """An empty block of `slots` slots, each shaped like this stack's buffers."""
        count = storage.count
        keys, values, positions, state = empty_buffers(slots * count, storage.keys[0], storage.values[0],
                                                       storage.capacity, storage.state_names)

        def split(buffer: torch.Tensor) -> torch.Tensor:
            return buffer.view(slots, count, *buffer.shape[2:])  # [slots, layers, kv_heads, capacity(, dim)]

        return cls(split(keys), split(values), split(positions), {name: split(s) for name, s in state.items()},
                   layout(storage), [None] * slots)

    def take(self, slot: int, storage: Storage) -> bool:
        """Move a stack into a free `slot` (its valid entries copied, its own buffers released); False if shaped unlike the block."""
        if self.occupants[slot] is not None:
            raise RuntimeError(f"slot {slot} of this block is occupied: vacate it first")
        keys, values = storage.keys, storage.values
        if keys is None or keys.shape[1] != 1 or layout(storage) != self.layout:
            return False
        n = storage.num_entries
        mine = (self.keys[slot], self.values[slot], self.positions[slot],
                {name: s[slot] for name, s in self.state.items()})  # [layers, kv_heads, capacity(, dim)]
        mine[0][:, :, :n].copy_(keys[:, 0, :, :n])
        mine[1][:, :, :n].copy_(values[:, 0, :, :n])
        mine[2][:, :, :n].copy_(storage.positions[:, 0, :, :n])
        for name, s in mine[3].items():
            s[:, :, :n].copy_(storage.state[name][:, 0, :, :n])
        storage.adopt(mine[0].unsqueeze(1), mine[1].unsqueeze(1), mine[2].unsqueeze(1),
                      {name: s.unsqueeze(1) for name, s in mine[3].items()})
        storage.placement = Placement(self, slot)
        self.occupants[slot] = storage
        return True

    def vacate(self, slot: int) -> bool:
        """Free `slot`: its occupant, if still there, gets buffers of its own holding its entries (one copy; True)."""
        occupant = self.occupants[slot]
        self.occupants[slot] = None
        if occupant is None:
            return False
        copied = self.holds(occupant, slot)
        if copied:
            occupant.adopt(*occupant.compact_buffers())
        occupant.placement = None
        return copied


def layout(storage: Storage) -> tuple:
    """What a stack must share with a block's slots to live in one: budget, state, buffer shapes, dtypes, device."""
    keys, values = storage.keys, storage.values
    return (storage.budget, tuple(storage.state), keys.shape, values.shape, keys.dtype, values.dtype, keys.device)


def place_forks(copy: Callable[[], EvictingCache], count: int) -> list[EvictingCache]:
    """`count` copies of one cache side by side in one new block where they can group, moved in one at a time."""
    caches, block = [], None
    for slot in range(count):
        cache = copy()
        if count > 1 and poolable(cache):
            block = block or RowBlock.like(cache.stack, count)
            block.take(slot, cache.stack)
        caches.append(cache)
    return caches


class _Counted:
    """An arena block's keeper that counts, in its decoder's record (`stats`, a keydiff.batching.static.StepStats,
    if any), the blocks it makes and the copies into and out of their slots."""

    block: RowBlock | None
    stats: Any

    def _made(self) -> None:
        if self.stats is not None:
            self.stats.arenas.append(self.block.slots)

    def _take(self, slot: int, stack: Storage) -> bool:
        taken = self.block.take(slot, stack)
        if taken and self.stats is not None:
            self.stats.slot_copies_in += 1
        return taken

    def _vacate(self, slot: int) -> None:
        if self.block.vacate(slot) and self.stats is not None:
            self.stats.slot_copies_out += 1


class JoinPool(_Counted):
    """Slots for sequences prefilled on their own, so that those alike decode as one group like forks (`pool_rows`).

    The block is allocated when a second sequence that could share it joins (start_alone: the arena, for the
    first); a stopped sequence keeps its slot until a new one needs it."""

    def __init__(self, slots: int, start_alone: bool = False, stats: Any = None):
        self.slots, self.start_alone = slots, start_alone
        self.stats = stats  # the decoder's record: blocks made, copies into and out of slots
        self.block: RowBlock | None = None
        self.waiting: Storage | None = None  # the first sequence that could start a block, while it decodes
        self.stopped: set[int] = set()  # slots whose occupant has stopped: the next joining sequence may take one

    def place(self, cache: EvictingCache) -> bool:
        """Move `cache`'s stack into a slot; False (nothing moves) if it cannot group, is placed, does not fit, or must wait."""
        stack = cache.stack
        placement = None if stack is None else stack.placement
        if placement is not None and self.block is not None and placement.block is self.block:
            if placement.resident:
                self.stopped.discard(placement.slot)  # decoding again in its slot (a follow-up turn): not free
                return True
            # It grew out of its slot (a follow-up turn fed more than the slot holds): the slot is free, and the
            # stack may move into one again like any other.
            self.block.occupants[placement.slot] = None
            self.stopped.discard(placement.slot)
            stack.placement = placement = None
        # Forks in a block of their own move into the arena (start_alone); elsewhere they stay where they are.
        movable = placement is None or (self.start_alone and placement.resident)
        # A one-slot pool (a run's arena at width 1) takes attention-statistic policies too: one slot never forms a
        # group (`runs` needs two), so the ordinary step still computes each one's statistic row by row.
        if not poolable(cache, statistic=self.slots == 1) or not movable:
            return False
        if self.block is None:
            if cache.block_size is None or stack.capacity != stack.budget + cache.block_size:
                return False  # slots are shaped after prompts of at least N + B tokens (the usual ones)
            if self.start_alone:
                self.block, self.waiting = RowBlock.like(stack, self.slots), None
                self._made()
                return self._take(0, stack)
            waiting = self.waiting
            if (waiting is None or waiting.placement is not None or waiting.keys is None
                    or layout(waiting) != layout(stack)):
                self.waiting = stack  # the block starts when a second one like it joins while this one decodes
                return False
            self.block, self.waiting = RowBlock.like(waiting, self.slots), None
            self._made()
            self._take(0, waiting)
        occupants = self.block.occupants
        slot = next((i for i, occupant in enumerate(occupants) if occupant is None), None)
        if slot is None and self.stopped:
            slot = min(self.stopped)
        if slot is None:
            return False
        self.stopped.discard(slot)
        self._vacate(slot)  # a stopped sequence's entries go to buffers of its own first
        return self._take(slot, stack)

    def idle(self) -> None:
        """No sequence decodes any more: every occupied slot may be given to the next sequence."""
        if self.block is not None:
            self.stopped.update(slot for slot, occupant in enumerate(self.block.occupants) if occupant is not None)
        self.waiting = None

    def leave(self, cache: EvictingCache) -> None:
        """`cache`'s sequence stopped: its slot may be given to the next one (after copying its entries out)."""
        stack = cache.stack if len(cache.storages) == 1 else None
        if stack is not None and stack is self.waiting:
            self.waiting = None
        if self.block is not None:
            for slot, occupant in enumerate(self.block.occupants):
                if occupant is not None and occupant is stack:
                    self.stopped.add(slot)


class PrefillSlot(_Counted):
    """The one slot a prefill's stack moves into once it holds N entries, kept across prompts by a run's decoder so
    the block step (a CUDA graph on a GPU) is built once per run and shape; one copy in, one out (`leave`)."""

    def __init__(self, stats: Any = None):
        self.block: RowBlock | None = None
        self.stats = stats  # the decoder's record: blocks made, copies into and out of the slot

    def enter(self, stack: Storage) -> bool:
        """Move `stack` into the slot (it may be there already); False, nothing moved, if it cannot live there or is shaped otherwise."""
        if self.block is not None and self.block.holds(stack, 0):
            return True
        if self.block is None:
            self.block = RowBlock.like(stack, 1)
            self._made()
        elif self.block.layout != layout(stack):
            return False
        self._vacate(0)  # a prefill that ended without leaving gets its entries back first
        return self._take(0, stack)

    def leave(self, stack: Storage, keep_entries: bool = True) -> None:
        """The prefill of `stack` ended: its entries go to buffers of its own; keep_entries=False frees the slot without copying."""
        if self.block is None or self.block.occupants[0] is not stack:
            return
        if keep_entries:
            self._vacate(0)
        else:
            self.block.occupants[0] = None
            stack.placement = None


@dataclass(frozen=True)
class Group:
    """One-row sequences of a pass that run as one: consecutive slots from `first`; `members` and `rows` in slot order."""

    block: RowBlock
    first: int
    members: list[int]
    rows: list[int]


def runs(caches: list[EvictingCache], spans: list[slice] | None = None) -> list[Group]:
    """Groups of two or more of `caches` that run as one (consecutive resident slots, equal counts and policies); spans: each cache's rows."""
    spans = spans if spans is not None else [slice(i, i + 1) for i in range(len(caches))]
    by_block: dict[int, list[tuple[int, int]]] = {}
    blocks: dict[int, RowBlock] = {}
    for index, cache in enumerate(caches):
        stack = cache.stack if len(cache.storages) == 1 else None
        placement = None if stack is None else stack.placement
        if placement is None or not placement.resident:
            continue
        blocks[id(placement.block)] = placement.block
        by_block.setdefault(id(placement.block), []).append((placement.slot, index))
    groups = []
    for block_id, members in by_block.items():
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
                indices = [i for _, i in run]
                groups.append(Group(blocks[block_id], run[0][0], indices, [spans[i].start for i in indices]))
            run = [(slot, index)]
    return groups


def write_groups(groups: list[Group], caches: list[EvictingCache], layer_idx: int,
                 key_states: torch.Tensor, value_states: torch.Tensor) -> set[int]:
    """Write one pass's keys and values [rows, kv_heads, q, dim] of layer `layer_idx` for every group in one copy;
    return the indices of the caches written (each then accounts via `EvictingCache.note_written`)."""
    written: set[int] = set()
    q = key_states.shape[-2]
    for group in groups:
        lead = caches[group.members[0]].stack
        if layer_idx not in lead.layers:
            continue
        plane, n, stop = lead.layers.index(layer_idx), lead.num_entries, group.first + len(group.members)
        rows = group.rows
        if rows == list(range(rows[0], rows[-1] + 1)):
            keys, values = key_states[rows[0] : rows[-1] + 1], value_states[rows[0] : rows[-1] + 1]
        else:
            order = torch.tensor(rows, device=key_states.device)
            keys, values = key_states.index_select(0, order), value_states.index_select(0, order)
        group.block.keys[group.first:stop, plane, :, n - q : n] = keys
        group.block.values[group.first:stop, plane, :, n - q : n] = values
        for index in group.members:
            caches[index].note_written(layer_idx, q)
        written.update(group.members)
    return written


def evict_groups(caches: list[EvictingCache], spans: list[slice] | None = None) -> set[int]:
    """Evict every group of `caches` that can evict as one, in one scoring call and drop; return the ids evicted."""
    done: set[int] = set()
    spans = spans if spans is not None else [slice(i, i + 1) for i in range(len(caches))]
    ready = [(cache, span) for cache, span in zip(caches, spans)
             if cache.evicts_next_pass() and len(cache.storages) == 1 and cache.stack is not None
             and cache.stack.num_entries > cache.stack.budget]
    for group in runs([cache for cache, _ in ready], [span for _, span in ready]):
        members = [ready[i][0] for i in group.members]
        start = time.perf_counter()
        _evict_group(group.block, group.first, members)
        share = (time.perf_counter() - start) / len(members)
        for cache in members:
            cache.timings["eviction_s"] += share
            done.add(id(cache))
    return done


def _evict_group(block: RowBlock, first: int, members: list[EvictingCache]) -> None:
    """What `Storage.evict` does for one stack, for consecutive slots at once (each row sees its own entries only).
    The new entries' state is set in the same call when every member wrote the same places, else each member's own."""
    storages = [cache.stack for cache in members]
    lead = storages[0]
    starts = {storage.fresh for storage in storages}
    if len(starts) == 1:
        fresh = lead.fresh
        for storage in storages:
            storage.fresh = None
    else:
        fresh = None
        for storage in storages:
            storage.initialize_state()  # each sequence's own
    rows = Rows.of_block(block, lead.layers, first, first + len(members))
    evict(rows, lead.num_entries, lead.budget, members[0].policy, fresh=fresh, where=lead.where())
    for storage in storages:
        storage.num_entries = lead.budget
        storage.signals.end_pass()


def grouped_passes(groups: list[Group], caches: list[EvictingCache],
                   layer_idx: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """For the attention function: each group's rows and its layer's keys and values [rows, kv_heads, n, dim] (block views)."""
    out = []
    for group in groups:
        lead = caches[group.members[0]].stack
        plane, n = lead.layers.index(layer_idx), lead.num_entries
        stop = group.first + len(group.members)
        out.append((group.rows, group.block.keys[group.first:stop, plane, :, :n],
                    group.block.values[group.first:stop, plane, :, :n]))
    return out
