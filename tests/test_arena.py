"""keydiff.cache.arena, the one owner of dense KV memory: a storage's counts are its arena slot's, moving into a
shared arena and out again carries entries and counts, and a shared arena is never reallocated (a stack that
outgrows its slot moves to an arena of its own, the slot stays counted for it until vacated)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from keydiff.cache.arena import ENTRIES, SEEN, Arena
from keydiff.cache.storage import Storage

pytestmark = pytest.mark.unit

LAYERS, HEADS, DIM, BUDGET, BLOCK = (0, 1), 2, 4, 6, 3


def filled(tokens: int, seed: int) -> Storage:
    storage = Storage(LAYERS, BUDGET, BUDGET + BLOCK)
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HEADS, tokens, DIM, generator=generator)
    for plane in range(len(LAYERS)):
        storage.write(plane, keys + plane, -keys)
    return storage


def entries(storage: Storage) -> list[torch.Tensor]:
    n = storage.num_entries
    return [storage.keys[..., :n, :].clone(), storage.values[..., :n, :].clone(), storage.positions[..., :n].clone()]


def test_a_pass_begins_once_and_each_plane_s_tokens_seen_follow_from_the_slot_counts():
    """The first plane opens the pass, a later one sees it when it writes, in turn; a fixed step's closes at once."""
    storage = filled(5, 0)
    arena, slot = storage.handle.arena, storage.handle.slot
    keys = torch.randn(1, HEADS, 2, DIM, generator=torch.Generator().manual_seed(3))
    storage.write(0, keys, keys)
    assert (storage.seen, storage.num_entries, storage.max_entries) == (7, 7, 7)
    assert (storage.layer_seen(0), storage.layer_seen(1)) == (7, 5)
    with pytest.raises(RuntimeError, match="in order"):
        arena.wrote(slot, slot + 1, 0, 2)  # plane 0 wrote this pass already
    with pytest.raises(RuntimeError, match="every layer must see every forward pass, in order"):
        storage.write(0, keys, keys)  # a new pass before plane 1 saw this one
    storage.write(1, keys, keys)
    assert (storage.layer_seen(0), storage.layer_seen(1), storage.seen) == (7, 7, 7)
    storage.num_entries = BUDGET  # as a fixed step leaves it: evicted within its pass
    arena.begin_pass(slot, 1, evicted=True)
    assert (storage.seen, storage.num_entries, storage.max_entries) == (8, BUDGET, 7)
    assert (storage.layer_seen(0), storage.layer_seen(1)) == (8, 8)


def test_take_and_vacate_move_entries_and_counts_and_leave_nothing_behind():
    one, two = filled(5, 0), filled(7, 1)
    before = [entries(one), entries(two)]
    arena = Arena.like(one, 3)
    left = weakref.ref(one.handle.arena)
    assert arena.take(2, one) and arena.take(0, two)
    gc.collect()
    assert left() is None  # the private arena it left is gone: nothing points back to it
    assert one.handle.arena is arena and one.handle.slot == 2 and arena.holds(2, one)
    assert arena.counts[:, ENTRIES].tolist() == [7, 0, 5] and arena.counts[:, SEEN].tolist() == [7, 0, 5]
    assert all(torch.equal(a, b) for a, b in zip(entries(one), before[0]))
    assert one.keys.data_ptr() == arena.keys[2].data_ptr()  # its views are the slot's
    with pytest.raises(RuntimeError, match="occupied"):
        arena.take(2, filled(5, 2))
    assert arena.vacate(2) and arena.occupant[2] is None and not one.handle.shared
    assert (one.num_entries, one.seen) == (5, 5) and all(torch.equal(a, b) for a, b in zip(entries(one), before[0]))
    assert all(torch.equal(a, b) for a, b in zip(entries(two), before[1]))  # its neighbour untouched


def test_a_shared_arena_is_never_reallocated_and_keeps_the_slot_a_stack_grew_out_of():
    storage = filled(5, 0)
    arena = Arena.like(storage, 2)
    assert arena.take(1, storage)
    buffers, before = arena.keys, entries(storage)
    storage.reserve(BUDGET + BLOCK + 4)  # more than the slot holds
    assert arena.keys is buffers and not storage.handle.shared and storage.capacity == BUDGET + BLOCK + 4
    assert all(torch.equal(a, b) for a, b in zip(entries(storage), before))
    assert arena.occupant[1] is storage and not arena.holds(1, storage)
    own = storage.keys.nbytes + storage.values.nbytes
    assert sum(storage.handle.arena.bytes_of(0).values()) == own + arena.slot_bytes(1)
    assert not arena.vacate(1)  # nothing to copy: it lives elsewhere; the slot no longer counts as its
    assert sum(storage.handle.arena.bytes_of(0).values()) == own
