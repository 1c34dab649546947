"""A sequence's stack of one or several layers: writes, views and eviction over its slot of an arena, seen as [count,
batch, kv_heads, capacity(, dim)]. Design: docs/design/cache.md#storages-and-the-stack"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from keydiff.cache.arena import (ENTRIES, FRESH, MARK_ENTRIES, MARK_PEAK, NONE, OPEN, PEAK, SEEN, WRITTEN, Arena,
                                 Handle, empty_buffers)
from keydiff.cache.evict import evict, init_fresh
from keydiff.policies.base import LayerView, Policy
from keydiff.policies.rerotation import STATE as ROTARY_STATE
from keydiff.signals import Recorded

# What a storage derives from its handle (re-made by `bind`, never copied).
VIEWS = ("handle", "_counts", "keys", "values", "positions", "state", "flat", "rows", "planes")


class Count:
    """A storage attribute that is one of its slot's counts in the arena (optional: None where there is none)."""

    def __init__(self, column: int, optional: bool = False):
        self.column, self.optional = column, optional

    def __get__(self, storage: "Storage | None", owner: type | None = None):
        if storage is None:
            return self
        value = storage._counts.item(self.column)  # a Python int, no tensor or numpy scalar made
        return None if self.optional and value == NONE else value

    def __set__(self, storage: "Storage", value: int | None) -> None:
        storage._counts[self.column] = NONE if value is None else value


class Storage:
    """A sequence's stack: the layers `layers` (one plane each) in one slot of an arena (`handle`), which owns their
    buffers and entry count. budget=None: never evicted (buffers grow geometrically)."""

    def __init__(
        self,
        layers: tuple[int, ...],
        budget: int | None,
        capacity: int | None,
        state_names: tuple[str, ...] = (),
        entry_state: Callable[[LayerView], dict[str, torch.Tensor]] | None = None,
    ):
        self.layers = tuple(layers)
        self.budget = budget
        self.capacity = capacity
        self.state_names = state_names
        self.entry_state = entry_state  # the policy's `entry_state`: state of newly written entries
        self.signals = Recorded(len(self.layers))  # per plane: the model signals the policy asked for (keydiff.signals)
        self.allocations = 0  # buffer (re)allocations (1 when the capacity was right)
        self.max_scratch_entries = 0  # peak entries per head during scratch passes (kept + block + scratch)
        self.bind(Handle(Arena(1, self.layers), 0))  # a private arena, its buffers allocated by the first write

    def bind(self, handle: Handle) -> None:
        """Live in `handle`'s slot from now on: the views of its buffers (keys, values, positions, state
        [count, batch, kv_heads, capacity(, dim)], each plane's, every plane's rows) and its counts."""
        self.handle = handle
        arena, slot = handle.arena, handle.slot
        self._counts = arena.host[slot]
        if arena.keys is None:
            self.keys = self.values = self.positions = None
            self.state, self.planes = {}, []
            return
        self.keys, self.values, self.positions, self.state = arena.slot_buffers(slot)
        self.capacity = self.keys.shape[3]
        # The planes seen as one layer whose batch rows are every plane's rows (layer-major, then batch).
        self.flat = arena.rows(slot, slot + 1)
        self.rows = self.flat.buffers()
        self.planes = [{"keys": self.keys[i], "values": self.values[i], "positions": self.positions[i],
                        "state": {name: s[i] for name, s in self.state.items()}} for i in range(self.count)]

    num_entries = Count(ENTRIES)  # valid entries per layer and KV head (the same for every head and plane)
    seen = Count(SEEN)  # tokens written into the first plane: the absolute position of the next one
    max_entries = Count(PEAK)  # peak entries per head ever held
    fresh = Count(FRESH, optional=True)  # the first entry whose policy state is not set yet (see initialize_state)

    @property
    def scratch_mark(self) -> tuple[int, int, int] | None:
        """While a scratch pass runs (see begin_scratch): (entries, seen, peak) to restore when it ends."""
        mark = self._counts[MARK_ENTRIES : MARK_PEAK + 1].tolist()
        return None if mark[0] == NONE else tuple(mark)

    @scratch_mark.setter
    def scratch_mark(self, value: tuple[int, int, int] | None) -> None:
        self._counts[MARK_ENTRIES : MARK_PEAK + 1] = (NONE,) * 3 if value is None else value

    @property
    def count(self) -> int:
        return len(self.layers)

    def where(self) -> str:
        return f"layer {self.layers[0]}" if self.count == 1 else f"layers {self.layers[0]}..{self.layers[-1]} (stacked)"

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """Move to a new private arena of `capacity` entries shaped like these states, carrying the valid entries
        over (a shared arena is never reallocated: a slot grown out of stays reserved for this stack)."""
        buffers = empty_buffers(self.count, key_states, value_states, capacity, self.state_names)
        self.bind(Handle(self.handle.arena.moved(self.handle.slot, buffers), 0))
        self.allocations += 1

    def __deepcopy__(self, memo: dict) -> "Storage":
        """A copy in a private arena of its own: of a private arena's buffers, or of a shared slot's valid entries."""
        cls = type(self)
        twin = cls.__new__(cls)
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            if name not in VIEWS:
                setattr(twin, name, copy.deepcopy(value, memo))
        twin.bind(Handle(self.handle.arena.copied(self.handle.slot, memo), 0))
        return twin

    def fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the buffers can hold these states (batch, heads, head dims, dtype and device all match)."""
        keys = self.keys
        return (keys.shape[1:3] == key_states.shape[:2] and keys.shape[4] == key_states.shape[3]
                and self.values.shape[4] == value_states.shape[3] and keys.dtype == key_states.dtype
                and keys.device == key_states.device)

    def grown_capacity(self, needed: int) -> int:
        """Capacity for `needed` entries: the planned one first; then room for decoding, or doubling if unbounded."""
        if self.keys is None:
            planned = self.capacity or needed
            return max(needed, planned, 0 if self.budget is None else self.budget + 1)
        return max(needed, 2 * self.capacity)

    def reserve(self, entries: int) -> None:
        """Make room for `entries` valid entries now (e.g. before decoding into an unbounded storage)."""
        if self.keys is not None and entries > self.capacity:
            self.allocate(self.keys[0], self.values[0], entries)

    def split(self) -> list["Storage"]:
        """One storage per plane on these buffers: what remains of a stack when a layer needs buffers of its own."""
        parts = []
        for plane, layer in enumerate(self.layers):
            part = Storage((layer,), self.budget, self.capacity, self.state_names, self.entry_state)
            part.bind(Handle(self.handle.arena.plane(self.handle.slot, plane), 0))
            if plane < self._counts.item(WRITTEN):  # its layer wrote the open pass: none is open for it
                part._counts[OPEN] = 0
            part._counts[WRITTEN] = 0
            part.allocations = self.allocations
            part.max_scratch_entries = self.max_scratch_entries
            parts.append(part)
        for part, signals in zip(parts, self.signals.split()):
            part.signals = signals
        return parts

    def layer_seen(self, plane: int) -> int:
        """Tokens the plane's layer has been given: the slot's, less the open pass while the plane has not written it."""
        counts = self._counts
        open_q = counts.item(OPEN)
        return counts.item(SEEN) - (open_q if open_q and plane >= counts.item(WRITTEN) else 0)

    def write(self, plane: int, key_states: torch.Tensor, value_states: torch.Tensor,
              position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's pass [batch, kv_heads, q, dim] after the kept entries; return its valid entries.
        The first plane begins the pass (room, positions for every plane, the arena's counts); the others follow."""
        q, seen, open_q = key_states.shape[-2], self.seen, self._counts.item(OPEN)
        if plane == 0 and not open_q:
            start = self.num_entries
            needed = start + q
            if self.keys is None or needed > self.capacity:
                self.allocate(key_states, value_states, self.grown_capacity(needed))
            if q == 1:  # decoding: no arange to allocate
                self.positions[..., start].fill_(seen)
            else:
                self.positions[..., start:needed] = torch.arange(seen, seen + q, device=key_states.device)
            if ROTARY_STATE in self.state:
                first = seen if position is None else position
                self.state[ROTARY_STATE][..., start:needed] = torch.arange(first, first + q, device=key_states.device)
            if self.state and self.fresh is None:
                self.fresh = start  # their state is set when the storage is next viewed (once for every plane)
            self.handle.arena.begin_pass(self.handle.slot, q)
        elif open_q == q and plane == self._counts.item(WRITTEN):
            needed = self.num_entries
            start = needed - q
            self.handle.arena.count_plane(self._counts, plane)  # its turn checked just above
        else:
            given = self.layer_seen(plane)
            raise RuntimeError(
                f"layer {self.layers[plane]} was given tokens {given}..{given + q - 1} while the cache is at "
                f"token {seen}: every layer must see every forward pass, in order"
            )
        buffers = self.planes[plane]
        keys, values = buffers["keys"], buffers["values"]
        keys[:, :, start:needed] = key_states
        values[:, :, start:needed] = value_states
        return keys[:, :, :needed], values[:, :, :needed]

    def initialize_state(self) -> None:
        """Set the policy state of entries written since the last view (keydiff.cache.evict.init_fresh)."""
        start, self.fresh = self.fresh, None
        if start is not None and start < self.num_entries:
            init_fresh(self.rows, start, self.num_entries, self.entry_state, self.layers,
                       signals=self.signals.for_entries())

    def begin_scratch(self) -> None:
        """Start a pass whose entries are written after the held ones and forgotten by `end_scratch`."""
        if self.scratch_mark is not None:
            raise RuntimeError(f"{self.where()} is already running a scratch pass")
        self.initialize_state()  # the held entries' state is set now; the scratch entries never get any
        self.scratch_mark = (self.num_entries, self.seen, self.max_entries)

    def end_scratch(self) -> None:
        """Forget the scratch pass's entries: entry count, tokens seen and peak are what they were before it."""
        entries, seen, peak = self.scratch_mark
        self.max_scratch_entries = max(self.max_scratch_entries, self.max_entries)
        self.num_entries, self.seen, self.max_entries = entries, seen, peak
        self.fresh, self.scratch_mark = None, None
        self._counts[OPEN] = self._counts[WRITTEN] = 0  # no pass of the scratch's is left open

    @property
    def scratch_kept(self) -> int | None:
        """Entries held before the running scratch pass (None when none runs)."""
        return None if self.scratch_mark is None else self.scratch_mark[0]

    def view(self, plane: int | None = None) -> LayerView:
        """The valid entries as a policy sees them, in buffer order: one plane's, or (None) every plane's rows."""
        self.initialize_state()
        n = self.num_entries
        buffers = self.rows if plane is None else self.planes[plane]
        return LayerView(
            keys=buffers["keys"][:, :, :n],
            values=buffers["values"][:, :, :n],
            positions=buffers["positions"][:, :, :n],
            state={name: buffer[:, :, :n] for name, buffer in buffers["state"].items()},
            layers=self.layers if plane is None else (self.layers[plane],),
            signals=dict(self.signals.view(plane, self.where())),
        )

    def pending(self) -> bool:
        """Whether the last pass left something to do: a statistic to observe or entries over the budget."""
        return self.budget is not None and (self.num_entries > self.budget or self.signals.pending())

    def evict(self, policy: Policy, inv_freq: torch.Tensor | None = None, rotary_end: int | None = None,
              drop: bool = True) -> None:
        """Observe the last pass's statistics, then drop entries until at most `budget` remain, in place, and
        re-rotate kept keys for a `key_rerotation` policy (keydiff.cache.evict.evict). drop=False observes only."""
        if self.budget is None or self.keys is None:
            self.signals.end_pass()
            return
        n, fresh, self.fresh = self.num_entries, self.fresh, None
        evict(self.flat, n, self.budget, policy, self.signals.view(None, self.where()), fresh=fresh, drop=drop,
              inv_freq=inv_freq, rotary_end=rotary_end, where=self.where())
        if drop and n > self.budget:
            self.num_entries = self.budget
        self.signals.end_pass()

    def entries_after_eviction(self) -> int:
        if self.budget is None or self.scratch_mark is not None:  # nothing is evicted during a scratch pass
            return self.num_entries
        return min(self.num_entries, self.budget)
