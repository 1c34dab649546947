"""Shared arenas: where the stacks of several sequences live side by side (forks: `place_forks`; joining sequences:
`JoinPool`), so that rows alike decode as one (`runs`). Design: docs/design/decode.md#rows-alike-run-as-one-blockspy"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from keydiff.cache import EvictingCache
from keydiff.cache.arena import FRESH, Arena, layout
from keydiff.cache.evict import evict
from keydiff.cache.storage import Storage


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


def place_forks(copy: Callable[[], EvictingCache], count: int) -> list[EvictingCache]:
    """`count` copies of one cache side by side in one new shared arena where they can group, moved in one at a time."""
    caches, arena = [], None
    for slot in range(count):
        cache = copy()
        if count > 1 and poolable(cache):
            arena = arena or Arena.like(cache.stack, count)
            arena.take(slot, cache.stack)
        caches.append(cache)
    return caches


def placed(stack: Storage) -> bool:
    """Whether a stack lives in a shared arena's slot, or grew out of one that still keeps it."""
    return stack.handle.shared or stack.handle.arena.reserved > 0


class JoinPool:
    """Slots for sequences prefilled on their own, so that those alike decode as one group like forks (`pool_rows`); the
    shared arena is allocated when a second sequence that could share it joins."""

    def __init__(self, slots: int, start_alone: bool = False, stats: Any = None):
        self.slots, self.start_alone = slots, start_alone
        self.stats = stats  # the decoder's record: arenas made, copies into and out of slots
        self.arena: Arena | None = None
        self.waiting: Storage | None = None  # the first sequence that could start the arena, while it decodes
        self.stopped: set[int] = set()  # slots whose occupant has stopped: the next joining sequence may take one

    def place(self, cache: EvictingCache) -> bool:
        """Move `cache`'s stack into a slot; False (nothing moves) if it cannot group, is placed, does not fit, or must wait."""
        stack, arena = cache.stack, self.arena
        if stack is not None and arena is not None and stack in arena.occupant:
            slot = arena.occupant.index(stack)
            if arena.holds(slot, stack):
                self.stopped.discard(slot)  # decoding again in its slot (a follow-up turn): not free
                return True
            # It grew out of its slot (a follow-up turn fed more): the slot is free; the stack may move into one again.
            arena.vacate(slot)
            self.stopped.discard(slot)
        # Forks in an arena of their own move into this one (start_alone); elsewhere they stay where they are.
        movable = stack is not None and (not placed(stack) or (self.start_alone and stack.handle.shared))
        # A one-slot pool takes attention-statistic policies too: one slot never forms a group (`runs` needs two).
        if not poolable(cache, statistic=self.slots == 1) or not movable:
            return False
        if arena is None:
            if cache.block_size is None or stack.capacity != stack.budget + cache.block_size:
                return False  # slots are shaped after prompts of at least N + B tokens (the usual ones)
            if self.start_alone:
                self.arena, self.waiting = Arena.like(stack, self.slots, self.stats), None
                return self.arena.take(0, stack)
            waiting = self.waiting
            if waiting is None or waiting.keys is None or placed(waiting) or layout(waiting) != layout(stack):
                self.waiting = stack  # the arena starts when a second one like it joins while this one decodes
                return False
            self.arena = arena = Arena.like(waiting, self.slots, self.stats)
            self.waiting = None
            arena.take(0, waiting)
        slot = next((i for i, occupant in enumerate(arena.occupant) if occupant is None), None)
        if slot is None and self.stopped:
            slot = min(self.stopped)
        if slot is None:
            return False
        self.stopped.discard(slot)
        arena.vacate(slot)  # a stopped sequence's entries go to an arena of its own first
        return arena.take(slot, stack)

    def idle(self) -> None:
        """No sequence decodes any more: every occupied slot may be given to the next sequence."""
        if self.arena is not None:
            self.stopped.update(slot for slot, occupant in enumerate(self.arena.occupant) if occupant is not None)
        self.waiting = None

    def leave(self, cache: EvictingCache) -> None:
        """`cache`'s sequence stopped: its slot may be given to the next one (after copying its entries out)."""
        stack = cache.stack if len(cache.storages) == 1 else None
        if stack is not None and stack is self.waiting:
            self.waiting = None
        if self.arena is not None:
            self.stopped.update(slot for slot, occupant in enumerate(self.arena.occupant)
                                if occupant is not None and occupant is stack)


@dataclass(frozen=True)
class Group:
    """One-row sequences of a pass that run as one: consecutive slots of `arena` from `first`, in slot order."""

    arena: Arena
    first: int
    members: list[int]
    rows: list[int]


def runs(caches: list[EvictingCache], spans: list[slice] | None = None) -> list[Group]:
    """Groups of two or more of `caches` that run as one (consecutive slots of a shared arena, equal counts and
    policies); spans: each cache's rows."""
    spans = spans if spans is not None else [slice(i, i + 1) for i in range(len(caches))]
    by_arena: dict[int, list[tuple[int, int]]] = {}
    arenas: dict[int, Arena] = {}
    for index, cache in enumerate(caches):
        stack = cache.stack if len(cache.storages) == 1 else None
        if stack is None or not stack.handle.shared:
            continue
        arena = stack.handle.arena
        arenas[id(arena)] = arena
        by_arena.setdefault(id(arena), []).append((stack.handle.slot, index))
    groups = []
    for arena_id, members in by_arena.items():
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
                groups.append(Group(arenas[arena_id], run[0][0], indices, [spans[i].start for i in indices]))
            run = [(slot, index)]
    return groups


def write_groups(groups: list[Group], caches: list[EvictingCache], layer_idx: int,
                 key_states: torch.Tensor, value_states: torch.Tensor) -> set[int]:
    """Write one pass's keys and values [rows, kv_heads, q, dim] of layer `layer_idx` for every group in one copy;
    return the indices of the caches written. The writer advances their counts in the arena (`Arena.wrote`)."""
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
        group.arena.wrote(group.first, stop, plane, q)  # refused, nothing written, unless it is this plane's turn
        group.arena.keys[group.first:stop, plane, 0, :, n - q : n] = keys
        group.arena.values[group.first:stop, plane, 0, :, n - q : n] = values
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
        _evict_group(group.arena, group.first, members)
        share = (time.perf_counter() - start) / len(members)
        for cache in members:
            cache.timings["eviction_s"] += share
            done.add(id(cache))
    return done


def _evict_group(arena: Arena, first: int, members: list[EvictingCache]) -> None:
    """What `Storage.evict` does for one stack, for consecutive slots at once (each row sees its own entries only).
    The new entries' state is set in the same call when every member wrote the same places, else each member's own."""
    storages, stop = [cache.stack for cache in members], first + len(members)
    lead = storages[0]
    if len(set(arena.host[first:stop, FRESH].tolist())) > 1:
        for storage in storages:
            storage.initialize_state()  # each sequence's own
    evict(arena.rows(first, stop), lead.num_entries, lead.budget, members[0].policy, fresh=lead.fresh,
          where=lead.where())
    arena.settle(first, stop, lead.budget)
    for storage in storages:
        storage.signals.end_pass()


def grouped_passes(groups: list[Group], caches: list[EvictingCache],
                   layer_idx: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """For the attention function: each group's rows and its layer's keys and values (arena views)."""
    out = []
    for group in groups:
        lead = caches[group.members[0]].stack
        plane, n = lead.layers.index(layer_idx), lead.num_entries
        stop = group.first + len(group.members)
        out.append((group.rows, group.arena.keys[group.first:stop, plane, 0, :, :n],
                    group.arena.values[group.first:stop, plane, 0, :, :n]))
    return out
