"""The eviction: `evict` for dense rows (cut from base tensors as `Rows`, seen as one batch [R, kv_heads, capacity(,
dim)]) and `evict_segments` for head-adaptive segments; the only places outside the policies that ask a policy what to
drop. Neither reads the host, so the fixed-shape step runs them compiled or captured; the entry counts are the caller's.
Design: docs/design/cache.md#eviction-evictpy"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from keydiff.policies.base import LayerView, Policy, SegmentView
from keydiff.policies.rerotation import STATE as ROTARY_STATE
from keydiff.queries import rotate
from keydiff.signals import SIGNALS, asked, missing_error


@dataclass(frozen=True)
class Rows:
    """R rows cut from an arena's base tensors [slots, planes, batch, kv_heads, capacity(, dim)], slots [first, stop),
    slot-major, then plane, then batch (views made when used, so torch.compile sees each buffer once)."""

    base: dict[str, Any]
    first: int
    stop: int
    planes: tuple[int, ...]
    sequence_of: torch.Tensor

    @classmethod
    def of(cls, base: dict[str, Any], planes: tuple[int, ...], first: int, stop: int) -> "Rows":
        slots, batch = stop - first, base["keys"].shape[2]
        sequence = torch.arange(slots * batch, device=base["keys"].device).view(slots, 1, batch)
        return cls(base, first, stop, tuple(planes), sequence.expand(slots, len(planes), batch).reshape(-1))

    @property
    def batch(self) -> int:
        return self.base["keys"].shape[2]

    @property
    def width(self) -> int:
        return (self.stop - self.first) * self.batch

    @property
    def slot_major(self) -> bool:
        """Whether a layer's W rows are W slots (one row each), else one slot's batch rows."""
        return self.batch == 1

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers a policy's view of the R rows names (LayerView.layers), slot by slot; a plane's batch rows
        are stacked along the batch dimension."""
        return self.planes * (self.stop - self.first)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [W, kv_heads, capacity, dim] of one model layer's W rows."""
        plane = self.planes.index(layer_idx)
        keys, values = self.base["keys"], self.base["values"]
        return keys[self.first:self.stop, plane].flatten(0, 1), values[self.first:self.stop, plane].flatten(0, 1)

    def buffers(self) -> dict[str, Any]:
        """Every layer's rows as one batch [R, kv_heads, capacity(, dim)]: "keys", "values", "positions", "state"."""
        def flat(buffer: torch.Tensor) -> torch.Tensor:
            return buffer[self.first:self.stop].flatten(0, 2)  # a view: the slots are consecutive

        return {"keys": flat(self.base["keys"]), "values": flat(self.base["values"]),
                "positions": flat(self.base["positions"]),
                "state": {name: flat(s) for name, s in self.base["state"].items()}}


NO_SIGNALS: dict[str, Any] = {}


def write_active(buffer: torch.Tensor, new: torch.Tensor, active: torch.Tensor) -> None:
    """buffer = new in the active rows (bool [rows]), unchanged in the others (an idle slot's entries must stay)."""
    buffer.copy_(torch.where(active.view(-1, *([1] * (buffer.dim() - 1))), new, buffer))


def init_fresh(buffers: dict, start: int, n: int, entry_state: Callable[[LayerView], dict] | None,
               layers: tuple[int, ...], active: torch.Tensor | None = None,
               signals: dict[str, Any] = NO_SIGNALS) -> None:
    """Set the policy state of entries [start, n) of every row of `buffers` (active: only these rows): the policy's
    `entry_state`, 0 for names it leaves out; signals: what the entries' view carries."""
    if not buffers["state"]:
        return
    initial = {}
    if entry_state is not None:
        entries = LayerView(keys=buffers["keys"][:, :, start:n], values=buffers["values"][:, :, start:n],
                            positions=buffers["positions"][:, :, start:n], state={}, layers=layers, signals=signals)
        initial = entry_state(entries)
    for name, buffer in buffers["state"].items():
        if name == ROTARY_STATE:
            continue
        if active is None:
            buffer[:, :, start:n] = initial.get(name, 0.0)
        else:
            value = initial.get(name)
            value = torch.zeros_like(buffer[:, :, start:n]) if value is None else value.to(buffer.dtype)
            write_active(buffer[:, :, start:n], value, active)


def evict(rows: Rows, n: int, budget: int, policy: Policy, signals: dict[str, Any] = NO_SIGNALS, *, fresh: int | None,
          active: torch.Tensor | None = None, drop: bool = True, inv_freq: torch.Tensor | None = None,
          rotary_end: int | None = None, where: str = "") -> None:
    """Evict the R rows of `rows` (`n` entries each) down to `budget`: set the state of entries [fresh, n), let the
    policy observe the pass, drop (drop=False: observe only) and re-rotate kept keys for a `key_rerotation` policy."""
    buffers = rows.buffers()
    layers = rows.layers
    attention = signals.get("attention")
    if fresh is not None and fresh < n:
        entries = {name: value for name, value in signals.items() if SIGNALS[name].entries} if signals else signals
        init_fresh(buffers, fresh, n, policy.entry_state, layers, active, entries)
    state = {name: s[:, :, :n] for name, s in buffers["state"].items()}
    if attention is not None and active is not None:
        state = {name: s.clone() for name, s in state.items()}  # observed apart: an idle row's state stays
    view = LayerView(keys=buffers["keys"][:, :, :n], values=buffers["values"][:, :, :n],
                     positions=buffers["positions"][:, :, :n], state=state, layers=layers, signals=signals)
    if attention is not None:  # the policy observes the pass (H2O accumulates)
        policy.observe(view)
        if active is not None:
            for name, buffer in buffers["state"].items():
                write_active(buffer[:, :, :n], view.state[name], active)
    if not drop or n <= budget:
        return
    for signal in asked(policy.needs):
        if signals.get(signal.name) is None:
            raise missing_error(policy.name, signal, where)
    dropped = policy.evict_indices(view, budget)  # [R, kv_heads, n - budget]
    if active is not None and n - budget == 1:
        # decoding in fixed shapes: the new entry moves into the dropped place, an idle row's onto itself
        tail = torch.full_like(dropped, budget)
        move_entries(buffers, tail, torch.where(active[:, None, None], dropped, tail))
    else:  # (with `active` given: a block step of one sequence, every row active)
        drop_entries(buffers, budget, n, dropped)
    if policy.needs.key_rerotation is not None:
        if inv_freq is None:
            raise RuntimeError(f"policy {policy.name!r} re-rotates keys but the cache was given no RoPE "
                               "frequencies: build EvictingCache(..., config=model.config)")
        rerotate(buffers, budget, inv_freq, rotary_end)


def rerotate(buffers: dict, n: int, inv_freq: torch.Tensor, end: int | None = None) -> None:
    """Re-apply RoPE so each head's n kept keys sit at contiguous positions in order of their absolute positions:
    0..n-1, or end-n..end-1 when `end` is given (docs/design/cache.md#position)."""
    offset = 0 if end is None else end - n
    positions = buffers["positions"][:, :, :n]
    rotary = buffers["state"][ROTARY_STATE][:, :, :n]
    keys = buffers["keys"][:, :, :n]
    order = positions.argsort(dim=-1)
    ranks = torch.arange(offset, offset + n, device=order.device).expand_as(order)
    target = torch.empty_like(order).scatter_(-1, order, ranks)
    delta = (target - rotary.long()).double()
    angles = delta[..., None] * inv_freq.to(device=keys.device, dtype=torch.float64)  # [rows, heads, n, d/2]
    rotated = rotate(keys.float(), angles.cos().float(), angles.sin().float())
    keys.copy_(rotated.to(keys.dtype))
    rotary.copy_(target)


def drop_entries(rows: dict, budget: int, n: int, dropped: torch.Tensor) -> None:
    """Remove the entries at `dropped` [rows, kv_heads, n - budget] by moving surviving tail entries into them, in
    `rows`' buffers ("keys", "values", "positions", "state"); the first `budget` places then hold the kept ones."""
    tail = n - budget
    if tail == 1:  # decoding: the one new entry moves into the dropped place (onto itself if it was dropped)
        move_entries(rows, torch.full_like(dropped, budget), dropped)
        return
    dropped = dropped.sort(dim=-1).values
    # Mark the dropped tail places; dropped places below the budget all go to one spare column at the end.
    column = torch.where(dropped >= budget, dropped - budget, tail)
    tail_dropped = torch.zeros(*dropped.shape[:2], tail + 1, dtype=torch.uint8, device=dropped.device)
    tail_dropped.scatter_(-1, column, 1)
    # Surviving tail places first (stable: ascending), then the dropped ones.
    sources = budget + torch.argsort(tail_dropped[..., :tail], dim=-1, stable=True)
    move_entries(rows, sources, dropped)


def move_entries(rows: dict, sources: torch.Tensor, targets: torch.Tensor) -> None:
    """buffer[..., targets] = buffer[..., sources] for every buffer of `rows` (indices [rows, kv_heads, k])."""
    for buffer in (rows["keys"], rows["values"]):
        src = sources[..., None].expand(-1, -1, -1, buffer.shape[-1])
        dst = targets[..., None].expand(-1, -1, -1, buffer.shape[-1])
        buffer.scatter_(2, dst, buffer.gather(2, src))
    for buffer in (rows["positions"], *rows["state"].values()):
        buffer.scatter_(2, targets, buffer.gather(2, sources))


def evict_segments(storages: list, policy: Policy, drop: bool = True, buffers: list[torch.Tensor] | None = None
                   ) -> None:
    """Evict head-adaptive segments (keydiff.cache.adaptive): observe each head, then keep T = kv_heads x N entries in
    every row, one move for all rows. buffers: a SegmentStack's [rows, P, ...] (None: the one storage's own)."""
    first = storages[0]
    if policy.needs.key_rerotation is not None:
        raise RuntimeError(f"{first.where()}: key re-rotation is not supported with head-adaptive budgets")
    if buffers is None:
        if first.keys is None:
            first.signals.end_pass()
            return
        buffers = first.buffers()
    for storage in storages:
        storage.require_served()
        storage.initialize_state()
        if storage.signals.get(0, "attention") is not None:
            for row in range(len(storage.counts)):
                for head in range(storage.heads):
                    policy.observe(storage.view_head(row, head))
    if drop and any(total > storage.total_budget for storage in storages for total in storage.row_totals()):
        for storage in storages:
            signal = storage.signals.missing(asked(policy.needs), 0)
            if signal is not None:
                raise missing_error(policy.name, signal, storage.where())
        compact_segments(storages, buffers, policy)
    for storage in storages:
        storage.signals.end_pass()


def compact_segments(storages: list, buffers: list[torch.Tensor], policy: Policy) -> None:
    """Drop what the policy's `drop_segments` chooses in every row and move the kept entries past each segment's new end
    into its dropped cells (segments are disjoint and in head order, so one flat pairing serves every row)."""
    keys, values, positions, *states = buffers
    device, (rows, size) = keys.device, keys.shape[:2]
    starts = [row for storage in storages for row in storage.starts]  # [rows][heads]
    counts = torch.tensor([row for storage in storages for row in storage.counts], device=device)
    cells = torch.arange(size, device=device)
    first = torch.tensor(starts, device=device)
    member = (cells >= first[..., None]) & (cells < (first + counts)[..., None])  # [rows, heads, P]
    # Segments lie in head order: a cell's head is the number of later heads whose segment starts at or before it.
    owner = (cells >= first[:, 1:, None]).sum(dim=1)  # [rows, P]
    rows_of = [(storage, row) for storage in storages for row in range(len(storage.counts))]
    view = SegmentView(keys=keys, positions=positions, state=dict(zip(storages[0].state_names, states)),
                    member=member, owner=owner, counts=counts, starts=starts,
                    head=lambda row, head: rows_of[row][0].view_head(rows_of[row][1], head))
    dropped = policy.drop_segments(view, storages[0].budget)  # bool [rows, P]
    kept_counts = counts - torch.zeros_like(counts).scatter_add_(1, owner, dropped.long())
    new_ends = (first + kept_counts).gather(1, owner)  # each cell's segment's new end
    holes = (dropped & (cells < new_ends)).view(-1).nonzero().squeeze(1)
    sources = (view.valid & ~dropped & (cells >= new_ends)).view(-1).nonzero().squeeze(1)
    if holes.numel():
        for buffer in buffers:
            flat = buffer.view(rows * size, -1) if buffer.dim() == 3 else buffer.view(-1)
            flat.index_copy_(0, holes, flat.index_select(0, sources))
    kept = kept_counts.tolist()
    for storage in storages:
        storage.counts, kept = kept[: len(storage.counts)], kept[len(storage.counts):]


__all__ = ["NO_SIGNALS", "Rows", "compact_segments", "drop_entries", "evict", "evict_segments", "init_fresh",
           "move_entries", "rerotate", "write_active"]
