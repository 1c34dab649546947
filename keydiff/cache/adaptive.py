"""One layer with head-adaptive budgets (AdaKV): per-head segments in one buffer of P cells that holds at most the
layer's total; `SegmentStack` puts every bounded layer's buffer in one allocation.
Design: docs/design/cache.md#head-adaptive-budgets-adaptivepy"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from keydiff.cache.evict import evict_segments
from keydiff.cache.layer import EvictingLayer, refuse_batch_change
from keydiff.cache.storage import empty_buffers
from keydiff.policies.base import LayerView, Policy
from keydiff.signals import Recorded, Signal


class SegmentStack:
    """The segment buffers of several head-adaptive layers in one allocation, [layers, batch, P, ...], so one eviction
    scores, chooses and compacts every layer's rows at once; a layer that does not fit or must grow takes buffers of its
    own."""

    def __init__(self, layers: tuple[int, ...]):
        self.layers = layers
        self.keys: torch.Tensor | None = None  # [layers, batch, P, dim]
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [layers, batch, P] long
        self.state: dict[str, torch.Tensor] = {}  # name -> [layers, batch, P] float32
        self.shape: tuple | None = None

    def claim(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, per_head: int,
              state_names: tuple[str, ...]) -> tuple | None:
        """Buffers of `layer`'s plane for a first pass like `key_states` (the first claim allocates all); None if it does not fit."""
        batch, heads = key_states.shape[:2]
        shape = (batch, heads, key_states.shape[-1], value_states.shape[-1], key_states.dtype, value_states.dtype,
                 key_states.device, per_head)
        if self.keys is None:
            keys, values, positions, state = empty_buffers(len(self.layers), key_states[:, :1], value_states[:, :1],
                                                           heads * per_head, state_names)
            self.keys, self.values, self.positions = keys[:, :, 0].zero_(), values[:, :, 0].zero_(), positions[:, :, 0].zero_()
            self.state = {name: buffer[:, :, 0] for name, buffer in state.items()}
            self.shape = shape
        elif shape != self.shape:
            return None
        plane = self.layers.index(layer)
        return self.keys[plane], self.values[plane], self.positions[plane], {n: b[plane] for n, b in self.state.items()}

    def rows(self) -> list[torch.Tensor]:
        """Every buffer with the layers' rows flattened, [layers x batch, P, ...] (views)."""
        return [buffer.flatten(0, 1) for buffer in (self.keys, self.values, self.positions, *self.state.values())]

    def holds(self, storages: list["AdaptiveStorage"]) -> bool:
        """Whether `storages` are this stack's layers, in order, each written into it: `rows()` then holds every
        row of theirs (the cache plans a stack only for layers of one budget)."""
        return (self.keys is not None and [s.layers[0] for s in storages] == list(self.layers)
                and all(s.in_stack for s in storages))


class AdaptiveStorage:
    """The segments of one head-adaptive layer: per-head segments, one entry count per (batch row, KV head).

    budget: N (the layer keeps kv_heads x N). capacity: cells per KV head first allocated (None: from the first pass).
    """

    def __init__(self, layer: int, budget: int, capacity: int | None, state_names: tuple[str, ...] = (),
                 entry_state: Callable[[LayerView], dict[str, torch.Tensor]] | None = None,
                 asked: tuple[Signal, ...] = (), stack: SegmentStack | None = None):
        self.layers = (layer,)
        self.stack = stack  # the shared allocation this layer's buffer is a plane of, if any (see `in_stack`)
        self.in_stack = False
        self.budget, self.capacity = budget, capacity
        self.state_names, self.entry_state = state_names, entry_state
        self.asked = asked  # the model signals the policy asked for (keydiff.signals): entry_state may wait for some
        self.fresh = 0  # entries at the end of every segment whose policy state is not set yet (`initialize_state`)
        self.keys: torch.Tensor | None = None  # [batch, P, dim]
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [batch, P] long
        self.state: dict[str, torch.Tensor] = {}  # name -> [batch, P] float32
        self.heads = 0  # KV heads (known from the first pass)
        self.starts: list[list[int]] = []  # [batch][head]: first cell of the head's segment
        self.counts: list[list[int]] = []  # [batch][head]: entries the head holds
        self.limits: list[list[int]] = []  # [batch][head]: first cell past the head's free cells
        # The model signals (keydiff.signals); the attention statistic is [batch][head] -> [count] float32.
        self.signals = Recorded(1)
        self.seen = 0
        self.max_total = 0  # peak entries held by one batch row of the layer (all heads), during a pass included
        self.allocations = 0
        self.served = True  # whether keydiff's attention function computed the last pass (see `segments`)

    count = 1
    max_scratch_entries = 0  # scratch passes (KVzip's reconstruction) are not supported: see `begin_scratch`
    scratch_kept = None

    def begin_scratch(self) -> None:
        raise RuntimeError(f"{self.where()}: scratch passes (KVzip's reconstruction) are not supported with "
                           "head-adaptive budgets")

    def end_scratch(self) -> None:
        pass

    def where(self) -> str:
        return f"layer {self.layers[0]} (head-adaptive)"

    @property
    def cells(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def row_totals(self) -> list[int]:
        return [sum(row) for row in self.counts]

    @property
    def total_budget(self) -> int:
        """T = kv_heads x N: what the layer keeps in all after eviction (per batch row)."""
        return self.heads * self.budget

    @property
    def num_entries(self) -> int:
        """Entries per KV head averaged over heads (fullest row), rounded up: <= N exactly when within the total."""
        return math.ceil(max(self.row_totals(), default=0) / self.heads) if self.heads else 0

    @property
    def max_entries(self) -> int:
        """Peak entries per KV head averaged over the heads, rounded up (the peak total is `max_total`)."""
        return math.ceil(self.max_total / self.heads) if self.heads else 0

    def entries_after_eviction(self) -> int:
        return min(self.num_entries, self.budget)

    def pending(self) -> bool:
        return max(self.row_totals(), default=0) > self.total_budget or self.signals.pending()

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, per_head: int) -> None:
        """First buffers: `per_head` cells for every KV head, the segments at equal distances."""
        batch, heads = key_states.shape[:2]
        self.heads = heads
        claimed = None if self.stack is None else self.stack.claim(self.layers[0], key_states, value_states, per_head,
                                                                   self.state_names)
        if claimed is not None:
            self.keys, self.values, self.positions, self.state = claimed
        else:  # zero-filled: a free cell's values must be finite (scored with weight 0 by `drop_segments`)
            keys, values, positions, state = empty_buffers(1, key_states[:, :1], value_states[:, :1], heads * per_head,
                                                           self.state_names)
            self.keys, self.values, self.positions = keys[0, :, 0].zero_(), values[0, :, 0].zero_(), positions[0, :, 0]
            self.state = {name: s[0, :, 0] for name, s in state.items()}
        self.in_stack = claimed is not None
        self.starts = [[h * per_head for h in range(heads)] for _ in range(batch)]
        self.limits = [[(h + 1) * per_head for h in range(heads)] for _ in range(batch)]
        self.counts = [[0] * heads for _ in range(batch)]
        self.allocations += 1

    def buffers(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.positions, *self.state.values()]

    def relayout(self, room: int) -> None:
        """Lay every row out again: each head's entries at the front of its new segment, at least `room` free cells each."""
        heads = self.heads
        needed = max(self.row_totals()) + heads * room
        if needed > self.cells:  # grow (at least double): new buffers, the valid entries copied over
            old = self.buffers()
            keys, values, positions, state = empty_buffers(1, self.keys[:, None, :1], self.values[:, None, :1],
                                                           max(needed, 2 * self.cells), self.state_names)
            self.keys, self.values, self.positions = keys[0, :, 0].zero_(), values[0, :, 0].zero_(), positions[0, :, 0]
            self.in_stack = False  # buffers of its own from now on
            self.state = {name: s[0, :, 0] for name, s in state.items()}
            new = self.buffers()
            self.allocations += 1
        else:
            old = new = self.buffers()
        device = self.keys.device
        for row in range(len(self.counts)):
            counts = self.counts[row]
            share = (self.cells - sum(counts)) // heads
            starts, limits, start = [], [], 0
            for count in counts:
                starts.append(start)
                start += count + share
                limits.append(start)
            sources = torch.cat([torch.arange(s, s + c, device=device) for s, c in zip(self.starts[row], counts)])
            targets = torch.cat([torch.arange(s, s + c, device=device) for s, c in zip(starts, counts)])
            for source, target in zip(old, new):
                target[row].index_copy_(0, targets, source[row].index_select(0, sources))  # gather first: no overlap
            self.starts[row], self.limits[row] = starts, limits

    def make_room(self, per_head: int) -> None:
        """Make sure every head has `per_head` free cells (before decoding that keeps every token)."""
        if self.keys is not None and any(s + c + per_head > lim for sr, cr, lr in zip(self.starts, self.counts, self.limits)
                                         for s, c, lim in zip(sr, cr, lr)):
            self.relayout(per_head)

    def layer_seen(self, plane: int) -> int:
        """Tokens its one layer has been given (each pass is written whole by that layer)."""
        return self.seen

    def write(self, plane: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a pass's q entries [batch, kv_heads, q, dim] to every head's segment; return the buffers."""
        batch, heads, q = key_states.shape[:3]
        if self.keys is None:
            planned = self.capacity or q
            self.allocate(key_states, value_states, max(planned, q, self.budget + 1))
        else:
            self.make_room(q)
        device = key_states.device
        size = self.cells
        first = torch.tensor([[row * size + s + c for s, c in zip(sr, cr)] for row, (sr, cr)
                              in enumerate(zip(self.starts, self.counts))], device=device)
        if q == 1:  # decoding: a few kernels fewer per layer and token
            cells = first.view(-1)
            new_positions = torch.full((batch * heads,), self.seen, device=device)
        else:
            cells = (first[..., None] + torch.arange(q, device=device)).reshape(-1)  # [batch * heads * q]
            new_positions = torch.arange(self.seen, self.seen + q, device=device).repeat(batch * heads)
        self.keys.view(batch * size, -1).index_copy_(0, cells, key_states.reshape(batch * heads * q, -1))
        self.values.view(batch * size, -1).index_copy_(0, cells, value_states.reshape(batch * heads * q, -1))
        self.positions.view(-1).index_copy_(0, cells, new_positions)
        if self.state:
            if self.fresh or self.awaits_signal():
                self.fresh += q  # set by `initialize_state` before the entries are next viewed
            else:  # the usual case: set now, from the pass's own dense states (no gather)
                self.set_state(cells, key_states, value_states, new_positions.view(batch, heads, q))
        self.counts = [[c + q for c in row] for row in self.counts]
        self.seen += q
        self.max_total = max(self.max_total, max(self.row_totals()))
        self.served = False
        return self.keys, self.values

    def awaits_signal(self) -> bool:
        """Whether `entry_state` reads a signal the model has not handed over yet (CriticalKV's o_proj weight)."""
        return any(signal.entries and self.signals.get(0, signal.name) is None for signal in self.asked)

    def segments(self) -> list[list[tuple[int, int]]]:
        """(start, count) of every head's segment, [batch][head]; asking marks the pass served (`require_served`)."""
        self.served = True
        return [list(zip(sr, cr)) for sr, cr in zip(self.starts, self.counts)]

    def require_served(self) -> None:
        if not self.served:
            raise RuntimeError(
                f"{self.where()} was computed by an attention function other than keydiff's: head-adaptive "
                "budgets hold each head's entries in segments only keydiff attention reads. Run the model inside "
                "`with keydiff.keydiff_attention(model, cache):` (keydiff.prefill and keydiff.generate do)"
            )

    def set_state(self, cells: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Set the policy state of the entries at `cells` (flat cell indices) from a dense view of them, with the
        layer's whole o_proj weight, so `entry_state` sees them as for a uniform layer."""
        initial = {}
        if self.entry_state is not None:
            initial = self.entry_state(LayerView(keys=keys, values=values, positions=positions, state={},
                                                 layers=self.layers, signals=self.signals.for_entries()))
        for name, buffer in self.state.items():
            value = initial.get(name)
            fresh = torch.zeros(cells.shape[0], device=cells.device) if value is None else value.reshape(-1).float()
            buffer.view(-1).index_copy_(0, cells, fresh)

    def initialize_state(self) -> None:
        """Set the state `write` deferred (policies needing o_proj): the last `fresh` entries of every segment."""
        fresh, self.fresh = self.fresh, 0
        if not fresh or self.keys is None:
            return
        batch, size = len(self.counts), self.cells
        device = self.keys.device
        first = torch.tensor([[row * size + s + c - fresh for s, c in zip(sr, cr)] for row, (sr, cr)
                              in enumerate(zip(self.starts, self.counts))], device=device)
        cells = (first[..., None] + torch.arange(fresh, device=device)).reshape(-1)  # [batch * heads * fresh]
        shape = (batch, self.heads, fresh)
        self.set_state(cells, self.keys.view(batch * size, -1).index_select(0, cells).view(*shape, -1),
                       self.values.view(batch * size, -1).index_select(0, cells).view(*shape, -1),
                       self.positions.view(-1).index_select(0, cells).view(shape))

    def view_head(self, row: int, head: int) -> LayerView:
        """One head of one batch row as a policy sees it: batch 1, one KV head, its own entries."""
        start, count = self.starts[row][head], self.counts[row][head]
        part = slice(start, start + count)
        return LayerView(
            keys=self.keys[row, part][None, None],
            values=self.values[row, part][None, None],
            positions=self.positions[row, part][None, None],
            state={name: buffer[row, part][None, None] for name, buffer in self.state.items()},
            layers=self.layers,
            signals=self.signals.head(row, head, self.heads),
        )

    def evict(self, policy: Policy, inv_freq: torch.Tensor | None = None, rotary_end: int | None = None,
              drop: bool = True) -> None:
        """Observe the last pass's statistics, then keep T entries per batch row (keydiff.cache.evict.evict_segments);
        drop=False observes only. Key re-rotation is not supported here."""
        evict_segments([self], policy, drop)

    def kept_positions(self) -> torch.Tensor:
        """Positions held, [batch, kv_heads, most any head holds], ascending per head, padded with -1 at the end."""
        batch, heads = len(self.counts), self.heads
        width = max((c for row in self.counts for c in row), default=0)
        out = torch.full((batch, heads, width), -1, dtype=torch.long, device=self.positions.device)
        for row in range(batch):
            for head in range(heads):
                start, count = self.starts[row][head], self.counts[row][head]
                out[row, head, :count] = self.positions[row, start : start + count].sort().values
        return out

    def head_counts(self) -> list[list[int]]:
        """Entries each head holds, [batch][head] (copies)."""
        return [list(row) for row in self.counts]


class AdaptiveLayer(EvictingLayer):
    """A layer of an evicting cache on an `AdaptiveStorage` (its segments are in `keys`/`values`: [batch, P, dim])."""

    def __init__(self, storage: AdaptiveStorage, layer_idx: int):
        super().__init__(storage.budget, storage.capacity, layer_idx=layer_idx, storage=storage)

    @property
    def keys(self) -> torch.Tensor | None:
        """[batch, P, dim]: the segments' cells; head h of row b holds keys[b, start:start + count]
        (`storage.segments`)."""
        return self.storage.keys

    @property
    def values(self) -> torch.Tensor | None:
        return self.storage.values

    @property
    def positions(self) -> torch.Tensor | None:
        """[batch, P] absolute positions of the cells (valid inside the segments only)."""
        return self.storage.positions

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.storage.state

    @property
    def max_total_entries(self) -> int:
        return self.storage.max_total

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = self.storage.keys
        refuse_batch_change(None if keys is None else keys.shape[0], key_states.shape[0])
        self.storage.require_served()
        keys, values = self.storage.write(0, key_states, value_states)
        self.returned_keys = keys
        return keys, values

    def view(self, layer_idx: int | None = None) -> LayerView:
        raise NotImplementedError(f"layer {self.layer_idx} has head-adaptive budgets: its heads hold different "
                                  "numbers of entries; use storage.view_head(row, head)")

    def kept_positions(self) -> torch.Tensor:
        """Absolute positions held, [batch, kv_heads, most any head holds], ascending, padded with -1 at the end."""
        return self.storage.kept_positions()

    def held_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [1, 1, n], values [1, 1, n, dim]) of head 0 of row 0: what the re-fed prompt check compares."""
        view = self.storage.view_head(0, 0)
        return view.positions, view.values

    def reset(self) -> None:
        old = self.storage
        self.storage = AdaptiveStorage(old.layers[0], old.budget, old.capacity, old.state_names, old.entry_state,
                                       old.asked)
        self.returned_keys, self.earlier_allocations, self.is_initialized = None, 0, False


__all__ = ["AdaptiveLayer", "AdaptiveStorage", "SegmentStack"]
