"""What passes between the scheduler and the model runner, as plain data: `StepPlan`, `StepOutput` and the scheduler's
per-sequence `SequenceRecord`. Design: docs/design/decode.md"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from keydiff.cache import EvictingCache
from keydiff.cache.evict import Rows


@dataclass(frozen=True)
class StepKey:
    """Which fixed-shape step a plan runs: built over these buffers (the identity of their key tensor: a sequence
    may move to other buffers) and rows [first, stop), for q tokens per row, this policy and N."""

    buffers: int
    first: int
    stop: int
    q: int
    policy: Any
    budget: int


@dataclass(frozen=True)
class StepPlan:
    """One pass for the runner: kind "decode" (q = 1) or "block" (a prefill block, q = B); shape "fixed" (a fixed-shape
    step over W rows, idle ones inactive) or "general" (the batch cache over each sequence's own cache)."""

    kind: str
    shape: str
    q: int
    caches: tuple[EvictingCache, ...]
    row_counts: tuple[int, ...]
    spans: tuple[slice, ...]
    ids: torch.Tensor
    positions: torch.Tensor
    active: torch.Tensor | None = None
    key: StepKey | None = None  # fixed: which step
    owner: Any = None  # fixed: the arena the rows belong to: its steps live as long
    rows: Rows | None = None  # fixed: the rows the step is built over (when the runner has none for `key`)
    slots: tuple[tuple[Any, int], ...] = ()  # fixed: each sequence's (arena, slot), whose counts the pass advances


@dataclass(frozen=True)
class StepOutput:
    """What a pass gives back: next-token logits [rows, vocab] (float32) and each sequence's rows in them."""

    logits: torch.Tensor
    spans: tuple[slice, ...]


@dataclass
class SequenceRecord:
    """What the scheduler knows of a sequence to plan its steps: read once when it is admitted (its place again when a
    neighbour joins), then kept by rule after every step (entries = min(entries + q, budget) while evicting). held: its
    next pass runs the ordinary step; seen: the next pass's position; owner, slot, slots, buffers: its place in an
    arena."""

    fixed_ok: bool
    evicting: bool
    held: bool
    entries: int | None
    budget: int | None
    seen: int
    policy: Any
    owner: Any = None
    slot: int | None = None
    slots: int = 1
    buffers: int = 0
    cut: Callable[[int, int], Rows] | None = field(default=None, repr=False)
    ceiling: int | None = None

    @property
    def ready(self) -> bool:
        """Whether its next pass can run in fixed shapes (with others alike): full at N, evicting, nothing pending."""
        return self.fixed_ok and self.evicting and not self.held and self.entries == self.budget

    def move(self, place: "SequenceRecord") -> None:
        """Take the place of a fresh reading (after a neighbour's admission moved its rows)."""
        self.owner, self.slot, self.slots, self.buffers, self.cut = (
            place.owner, place.slot, place.slots, place.buffers, place.cut)

    def advance(self, q: int) -> None:
        """After a pass of q tokens: what the cache now holds, by rule (no read of the cache)."""
        self.seen = self.seen + q if self.ceiling is None or not self.evicting else min(self.seen + q, self.ceiling)
        if self.entries is not None:
            evicts = self.evicting and self.budget is not None
            self.entries = min(self.entries + q, self.budget) if evicts else self.entries + q
        if self.evicting:
            self.held = False
