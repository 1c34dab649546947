"""The one owner of dense KV memory: the buffers of one or several sequences' stacks and each one's entry counts.

An `Arena` holds [slots, planes, batch, kv_heads, capacity(, dim)] buffers and each slot's counts on the host; a
`Storage` lives in one slot through a `Handle`. A shared arena is never reallocated, so a fixed-shape step built or
captured over it keeps its addresses. Design: docs/design/cache.md#storages-and-the-stack"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from keydiff.cache.evict import Rows

# Each slot's counts: entries, seen, peak, the first unset state, a scratch pass's saved ones and the open pass.
COUNTS = ("entries", "seen", "peak", "fresh", "mark_entries", "mark_seen", "mark_peak", "open", "written")
ENTRIES, SEEN, PEAK, FRESH, MARK_ENTRIES, MARK_SEEN, MARK_PEAK, OPEN, WRITTEN = range(len(COUNTS))
NONE = -1
EMPTY = (0, 0, 0, NONE, NONE, NONE, NONE, 0, 0)


def empty_buffers(
    count: int, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int, state_names: tuple[str, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Keys, values, positions and state buffers [count, batch, kv_heads, capacity(, dim)], shaped like these states."""
    batch, heads = key_states.shape[:2]
    shape = (count, batch, heads, capacity)
    with torch.inference_mode(False):
        keys = key_states.new_empty(*shape, key_states.shape[-1])
        values = value_states.new_empty(*shape, value_states.shape[-1])
        positions = torch.empty(shape, dtype=torch.long, device=key_states.device)
        state = {name: torch.zeros(shape, dtype=torch.float32, device=key_states.device) for name in state_names}
    return keys, values, positions, state


def copy_entries(target: tuple, source: tuple, n: int) -> None:
    """Copy the first n entries of (keys, values, positions, {name: state}) buffers into others of the same layout."""
    (keys, values, positions, state), (from_keys, from_values, from_positions, from_state) = target, source
    keys[..., :n, :].copy_(from_keys[..., :n, :])
    values[..., :n, :].copy_(from_values[..., :n, :])
    positions[..., :n].copy_(from_positions[..., :n])
    for name, buffer in state.items():
        buffer[..., :n].copy_(from_state[name][..., :n])


def allocation_bytes(*tensors: torch.Tensor | None) -> dict[int, int]:
    """Each tensor's whole allocation in bytes, keyed by where it starts: the layers of one stack (or the parts of a
    split one) share an allocation, counted once."""
    sizes = {}
    for tensor in tensors:
        if tensor is not None:
            allocation = tensor.untyped_storage()
            sizes[allocation.data_ptr()] = allocation.nbytes()
    return sizes


def layout(storage: Any) -> tuple:
    """What a stack must share with a shared arena's slots to live in one: budget, state, shapes, dtypes, device."""
    keys, values = storage.keys, storage.values
    return (storage.budget, tuple(storage.state), keys.shape, values.shape, keys.dtype, values.dtype, keys.device)


@dataclass(frozen=True)
class Handle:
    """A sequence's rows: slot `slot` of `arena`."""

    arena: "Arena"
    slot: int

    @property
    def shared(self) -> bool:
        """Whether the slot is one of a shared arena (beside other sequences' stacks)."""
        return self.arena.shared


class Arena:
    """Buffers of `slots` stacks of the layers `layers` (None until allocated) and their counts. shared: slots handed to
    several sequences, never reallocated. stats: the decoder's StepStats, if any."""

    def __init__(self, slots: int, layers: tuple[int, ...], buffers: tuple | None = None, shared: bool = False,
                 stats: Any = None):
        self.layers = tuple(layers)
        self.keys, self.values, self.positions, self.state = buffers if buffers is not None else (None, None, None, {})
        with torch.inference_mode(False):
            self.counts = torch.tensor([EMPTY] * slots, dtype=torch.long)
        self.host = self.counts.numpy()  # the same memory, indexed without making tensors
        self.shared, self.stats = shared, stats
        self.occupant: list[Any] = [None] * slots  # a shared arena's storage in each slot (None: free)
        # A private arena's: bytes of the shared slot its storage grew out of, held until it vacates (kv_cache_bytes).
        self.reserved = 0
        self.layout: tuple | None = None  # a shared arena's: what a stack must share with its slots
        if shared and stats is not None:
            stats.arenas.append(slots)

    @property
    def slots(self) -> int:
        return len(self.occupant)

    @classmethod
    def like(cls, storage: Any, slots: int, stats: Any = None) -> "Arena":
        """An empty shared arena of `slots` slots, each shaped like this one-row stack's buffers."""
        count = storage.count
        buffers = empty_buffers(slots * count, storage.keys[0], storage.values[0], storage.capacity,
                                storage.state_names)

        def split(buffer: torch.Tensor) -> torch.Tensor:
            return buffer.view(slots, count, *buffer.shape[1:])  # [slots, planes, 1, kv_heads, capacity(, dim)]

        arena = cls(slots, storage.layers, (split(buffers[0]), split(buffers[1]), split(buffers[2]),
                                            {name: split(s) for name, s in buffers[3].items()}), True, stats)
        arena.layout = layout(storage)
        return arena

    def rows(self, first: int = 0, stop: int | None = None) -> Rows:
        """Slots [first, stop) (default all) as rows: slot-major, then plane, then batch."""
        base = {"keys": self.keys, "values": self.values, "positions": self.positions, "state": self.state}
        return Rows.of(base, self.layers, first, self.slots if stop is None else stop)

    def slot_buffers(self, slot: int) -> tuple:
        """Slot `slot`'s keys, values, positions and {name: state} buffers, each
        [planes, batch, kv_heads, capacity(, dim)]."""
        return (self.keys[slot], self.values[slot], self.positions[slot],
                {name: s[slot] for name, s in self.state.items()})

    def slot_bytes(self, slot: int) -> int:
        """Bytes of one slot's key and value buffers."""
        return self.keys[slot].nbytes + self.values[slot].nbytes

    def bytes_of(self, slot: int) -> dict[Any, int]:
        """What slot `slot`'s sequence holds, keyed so that nothing is counted twice: its slot of a shared arena, or
        a private arena's allocations and the shared slot it still reserves."""
        if self.keys is None:
            return {}
        if self.shared:
            return {("slot", id(self), slot): self.slot_bytes(slot)}
        sizes: dict[Any, int] = allocation_bytes(self.keys, self.values)
        if self.reserved:
            sizes[("left", id(self))] = self.reserved
        return sizes

    def settle(self, first: int, stop: int, budget: int) -> None:
        """After slots [first, stop) were evicted as one: at most `budget` entries each, every entry's state set."""
        self.counts[first:stop, ENTRIES].clamp_(max=budget)
        self.counts[first:stop, FRESH] = NONE

    def begin_pass(self, slot: int, q: int, evicted: bool = False) -> None:
        """Open a pass of q tokens in `slot`, once per pass, by whoever starts it: tokens seen, peak, entries (+q), its
        first plane written. evicted: its writer wrote every plane and evicted within the pass (the fixed step, from
        the host before or after it): the entries stay and no pass is left open. Scalars: once per layer and token."""
        counts = self.host[slot]
        grown = int(counts[ENTRIES]) + q
        counts[SEEN] += q
        counts[PEAK] = max(grown, int(counts[PEAK]))
        if not evicted:
            counts[ENTRIES] = grown
            counts[OPEN], counts[WRITTEN] = (q, 1) if len(self.layers) > 1 else (0, 0)

    def wrote(self, first: int, stop: int, plane: int, q: int) -> None:
        """Plane `plane` of slots [first, stop) is written by their row group for their open pass of q tokens (never
        a scratch pass); the pass closes after the last plane. Planes write in order, each once per pass."""
        counts = self.host[first:stop]
        if not ((counts[:, OPEN] == q) & (counts[:, WRITTEN] == plane) & (counts[:, MARK_ENTRIES] == NONE)).all():
            raise RuntimeError(f"layer {self.layers[plane]}: a pass written by its row group must follow the pass's "
                               "first layer, written through update (every layer must see every forward pass, in order)")
        self.count_plane(counts, plane)

    def count_plane(self, counts: Any, plane: int) -> None:
        """Count plane `plane` of the open pass written in `counts` (rows of `host`: a slot, or [first, stop)), its
        turn already checked by the writer; the pass closes after the last plane."""
        if plane + 1 == len(self.layers):
            counts[..., OPEN], counts[..., WRITTEN] = 0, 0
        else:
            counts[..., WRITTEN] += 1

    def moved(self, slot: int, buffers: tuple | None = None) -> "Arena":
        """A new private arena holding slot `slot`'s valid entries and counts, in `buffers` ([planes, batch, ...],
        from empty_buffers; None: of this slot's shape). A shared slot the stack leaves stays reserved for it."""
        if buffers is None:
            buffers = empty_buffers(len(self.layers), self.keys[slot][0], self.values[slot][0], self.keys.shape[4],
                                    tuple(self.state))
        keys, values, positions, state = buffers
        n = int(self.host[slot, ENTRIES])
        if n and self.keys is not None:
            copy_entries(buffers, self.slot_buffers(slot), n)
        arena = Arena(1, self.layers, (keys[None], values[None], positions[None],
                                       {name: s[None] for name, s in state.items()}))
        arena.host[0] = self.host[slot]
        arena.reserved = self.slot_bytes(slot) if self.shared else self.reserved
        return arena

    def copied(self, slot: int, memo: dict) -> "Arena":
        """A private arena holding a copy of slot `slot`: a shared slot's valid entries, or a private arena's
        buffers (deep-copied through `memo`, so that views of one allocation stay views of one)."""
        if self.shared:
            arena = self.moved(slot)
            arena.reserved = 0
            return arena
        buffers = copy.deepcopy((self.keys, self.values, self.positions, self.state), memo)
        arena = Arena(1, self.layers, None if self.keys is None else buffers)
        arena.host[0] = self.host[slot]
        return arena

    def plane(self, slot: int, plane: int) -> "Arena":
        """A private arena on one plane of slot `slot` (views of the same memory), with the slot's counts."""
        cut = (slice(slot, slot + 1), slice(plane, plane + 1))
        buffers = None if self.keys is None else (self.keys[cut], self.values[cut], self.positions[cut],
                                                  {name: s[cut] for name, s in self.state.items()})
        arena = Arena(1, (self.layers[plane],), buffers)
        arena.host[0] = self.host[slot]
        return arena

    def holds(self, slot: int, storage: Any) -> bool:
        """Whether `storage` lives in slot `slot` of this arena (taken and not grown out since)."""
        return self.occupant[slot] is storage and storage.handle == Handle(self, slot)

    def take(self, slot: int, storage: Any) -> bool:
        """Move a one-row stack into a free slot of this shared arena: its valid entries and counts copied, its own
        buffers released; False (nothing moved) if it is shaped unlike the slots."""
        if self.occupant[slot] is not None:
            raise RuntimeError(f"slot {slot} of this arena is occupied: vacate it first")
        if storage.keys is None or storage.keys.shape[1] != 1 or layout(storage) != self.layout:
            return False
        source = storage.handle
        copy_entries(self.slot_buffers(slot), (storage.keys, storage.values, storage.positions, storage.state),
                     storage.num_entries)
        self.host[slot] = source.arena.host[source.slot]
        storage.bind(Handle(self, slot))
        self.occupant[slot] = storage
        if self.stats is not None:
            self.stats.slot_copies_in += 1
        return True

    def vacate(self, slot: int, keep: bool = True) -> bool:
        """Free slot `slot`. Its occupant, if it still lives there, moves to a private arena holding its entries
        (one copy; True); keep=False frees the slot without copying (a failed prefill's discarded entries)."""
        occupant = self.occupant[slot]
        self.occupant[slot] = None
        if occupant is None or not keep:
            return False
        if occupant.handle != Handle(self, slot):  # it grew out of the slot: the slot no longer counts as its
            occupant.handle.arena.reserved = 0
            return False
        occupant.bind(Handle(self.moved(slot), 0))
        occupant.handle.arena.reserved = 0
        if self.stats is not None:
            self.stats.slot_copies_out += 1
        return True
