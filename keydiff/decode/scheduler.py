"""The scheduler: requests in, results out, up to W sequences decoding at once (continuous batching), the width halved
when memory runs out. It decides every step as a plan (keydiff.decode.plan.StepPlan) for the model runner.
Design: docs/design/decode.md#the-scheduler-schedulerpy"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterable, Iterator

import torch

from keydiff.attention import keydiff_attention
from keydiff.decode.blocks import JoinPool, poolable
from keydiff.decode.plan import SequenceRecord, StepKey, StepPlan
from keydiff.decode.sequence import Failure, Job, Request, Sequence, SequenceResult
from keydiff.decode.static import StepStats
from keydiff.decode.step import ModelRunner, decode_step
from keydiff.cache import EvictingCache
from keydiff.cache.arena import Arena, layout
from keydiff.cache.evict import Rows
from keydiff.device import out_of_memory, release_memory

LOG = logging.getLogger(__name__)


class Decoder:
    """Decodes requests W at a time, keeping its arena and fixed-shape steps across calls.

    width: W (halved on out of memory). group_rows=False: every sequence alone (the reference). pool_rows: move joining
    sequences into arena slots. fixed_shapes: None = device default, False = never. batch_invariant: width-independent
    kernels for the decoding steps. Outputs are the same either way."""

    def __init__(self, model: torch.nn.Module, width: int = 1, group_rows: bool = True, pool_rows: bool = True,
                 fixed_shapes: bool | None = None, batch_invariant: bool = False):
        if isinstance(width, bool) or int(width) != width or width < 1:
            raise ValueError(f"the width (batch_size) must be a positive integer, got {width!r}")
        self.model, self.width = model, int(width)
        self.group_rows, self.pool_rows = group_rows, pool_rows
        self.options = (fixed_shapes, batch_invariant)
        self.widths: list[int] = []  # every width it has run at, in order (the first, then each halving)
        # What its steps did at any width: the steps built and run, arena blocks, CUDA graphs captured or failed.
        self.stats = StepStats()
        self._build()

    def check_options(self, fixed_shapes: bool | None = None, batch_invariant: bool = False) -> None:
        """Refuse a call's fixed_shapes / batch_invariant that the decoder does not run with (keydiff.generate and
        keydiff.prefill with `decoder=` run with the decoder's own); the calls' defaults (None, False) pass."""
        if fixed_shapes is not None and bool(fixed_shapes) != self.runner.fixed_shapes:
            raise ValueError(f"fixed_shapes={fixed_shapes!r}, but the decoder runs fixed_shapes="
                             f"{self.runner.fixed_shapes}: make the Decoder with it, or pass no decoder")
        if batch_invariant and not self.options[1]:
            raise ValueError("batch_invariant=True, but the decoder runs without it: make the Decoder with "
                             "batch_invariant=True, or pass no decoder")

    @property
    def replays_graphs(self) -> bool:
        """Whether its fixed-shape steps are replayed as CUDA graphs over the arena (the device's arrangement)."""
        return self.runner.fixed_shapes and self.runner.full_width

    def reset(self) -> None:
        """Drop the arena, the slot and the steps (rebuilt empty at the same width): after a caller handled an
        error of its own call (a sample at batch 1 that ran out of memory), nothing of that sequence stays."""
        self._drop()
        self._build()

    def _drop(self) -> None:
        """Forget everything of the current width: the runner and its steps, the arena, the records, the rows."""
        self.runner = self.pool = self.blocks = self.records = self._rows = None

    def _build(self) -> None:
        """The runner and the arena for the current width (again after a back-off: the old ones are dropped)."""
        if not self.widths or self.widths[-1] != self.width:
            self.widths.append(self.width)
        self.runner = ModelRunner(self.model, self.group_rows, *self.options, stats=self.stats)
        alone = self.replays_graphs  # a replayed graph: even one sequence pools
        pooled = self.group_rows and self.pool_rows and (self.width > 1 or alone)
        self.pool = JoinPool(self.width, start_alone=alone, stats=self.stats) if pooled else None
        # The prefills' block step: in a slot kept across prompts, so one replayed graph serves every prompt.
        self.blocks = BlockScheduler(self.runner, keep_slot=alone)
        self.records: dict[int, SequenceRecord] = {}  # per active sequence (by id), what its plans are made from
        self._rows: tuple[StepKey, object, Rows] | None = None  # the last fixed step's rows (cut once per change)

    def admit(self, sequence: Sequence, active: list[Sequence]) -> None:
        """Place a new sequence (into an arena slot where it can group) and record it; a neighbour the placement moved
        into the block is read again. A sequence in a block stays in its slot until it stops."""
        if self.pool is not None:
            self.pool.place(sequence.cache)
        self._rows = None  # rows may have moved: cut again
        self.records[id(sequence)] = read_cache(sequence.cache, evict=sequence.request.evict)
        for other in active:
            record = self.records[id(other)]
            if other is not sequence and record.slot is None:
                record.move(read_cache(other.cache))  # a step over the arena it left goes with that arena

    def stop(self, sequence: Sequence) -> None:
        """The sequence stopped: its arena slot may be given to the next one; its record goes."""
        if self.pool is not None:
            self.pool.leave(sequence.cache)
        self.records.pop(id(sequence), None)

    def plan(self, going: list[Sequence]) -> StepPlan:
        """The decode step of the going sequences, from their records: in fixed shapes where every one is full and
        alike, in one block (or alone in its own stack), else through the batch cache."""
        records = [self.records[id(sequence)] for sequence in going]
        caches, counts = tuple(s.cache for s in going), tuple(s.row_count for s in going)
        device = self.runner.device
        fixed = self._fixed(records) if self.runner.fixed_shapes else None
        if fixed is None:
            spans, start = [], 0
            for count in counts:
                spans.append(slice(start, start + count))
                start += count
            ids = torch.tensor([[token] for sequence in going for token in sequence.last], dtype=torch.long,
                               device=device)
            positions = torch.tensor([[record.seen] for record, count in zip(records, counts) for _ in range(count)],
                                     dtype=torch.long, device=device)
            return StepPlan("decode", "general", 1, caches, counts, tuple(spans), ids, positions)
        key, owner, rows, starts = fixed
        width = key.stop - key.first
        ids, positions, active = [0] * width, [0] * width, [False] * width
        for sequence, record, start in zip(going, records, starts):
            for row, token in enumerate(sequence.last):
                ids[start + row], positions[start + row], active[start + row] = token, record.seen, True
        return StepPlan("decode", "fixed", 1, caches, counts,
                        tuple(slice(start, start + count) for start, count in zip(starts, counts)),
                        torch.tensor(ids, device=device)[:, None], torch.tensor(positions, device=device)[:, None],
                        torch.tensor(active, device=device), key, owner, rows,
                        tuple((record.owner, record.slot or 0) for record in records))

    def _fixed(self, records: list[SequenceRecord]) -> tuple[StepKey, object, Rows, list[int]] | None:
        """The fixed-shape step the records can share (its key, owner and rows) and each one's first row in it; None
        if they cannot (not all full and alike, or not all in one block / one sequence alone in its own stack)."""
        lead = records[0]
        if (not all(record.ready and record.policy == lead.policy for record in records)
                or (not self.group_rows and len(records) > 1)):  # group_rows=False: each on its own
            return None
        if all(record.slot is not None for record in records) and all(r.owner is lead.owner for r in records):
            slots = [record.slot for record in records]
            # A CUDA graph replays every slot of the block; elsewhere only the slots the going sequences span run.
            first, stop = (0, lead.slots) if self.runner.full_width else (min(slots), max(slots) + 1)
            starts = [slot - first for slot in slots]
        elif len(records) == 1 and lead.slot is None:  # alone, in its own buffers
            first, stop, starts = 0, lead.slots, [0]
        else:
            return None
        # Built for these buffers and rows, this policy and N: the going sequences may span other slots.
        key = StepKey(lead.buffers, first, stop, 1, lead.policy, lead.budget)
        if self._rows is None or self._rows[0] != key or self._rows[1] is not lead.owner:
            self._rows = (key, lead.owner, lead.cut(first, stop))
        return key, lead.owner, self._rows[2], starts

    def advance(self, going: list[Sequence], q: int) -> None:
        """After a step: every going sequence's record moves on by rule (the test compares them to the caches)."""
        for sequence in going:
            self.records[id(sequence)].advance(q)

    @torch.inference_mode()
    def generate(self, requests: Iterable[Request | Job]) -> Iterator[tuple[Any, SequenceResult | Failure]]:
        """Decode every request, up to `width` at once, refilling as soon as a sequence stops. Yields (key,
        SequenceResult) in finishing order, and (key, Failure) for a job given up at width 1; `requests` may be lazy."""
        source = iter(requests)
        if self.pool is not None:
            self.pool.idle()  # one call at a time: whatever a former call left in the arena has stopped
        self.records, self._rows = {}, None
        again: deque = deque()  # jobs abandoned by a back-off: started again before any new one
        active: list[Sequence] = []
        exhausted = False
        while True:
            oom = None
            try:
                while len(active) < self.width and (again or not exhausted):
                    item = again.popleft() if again else next(source, None)
                    if item is None:
                        exhausted = True
                        continue
                    sequence = self._start(item)
                    active.append(sequence)
                    self.admit(sequence, active)
                if not active:
                    return
                finished: list[Sequence] = []
                # One switch of the attention function (a walk of every module) for the steps until a sequence stops.
                with keydiff_attention(self.model, self.runner.batch), self.runner.invariant():
                    while active and not finished:
                        active, finished = decode_step(self, active)
            except Exception as error:  # noqa: BLE001 - only out of memory is handled; the rest is raised
                if not out_of_memory(error):
                    raise
                starting = getattr(error, "job", None)
                jobs = [sequence.request.job for sequence in active] + ([starting] if starting is not None else [])
                if any(job is None for job in jobs):
                    raise  # a plain request in flight: it cannot be started again
                oom = f"{type(error).__name__}: {error}"
            if oom is not None:  # outside the except block: the traceback (and what it pins) is gone
                active = finished = sequence = None
                failures = self._back_off(jobs, oom)
                given_up = {id(failure.job) for _, failure in failures}
                again.extendleft(reversed([job for job in jobs if id(job) not in given_up]))
                active, jobs = [], None
                yield from failures
                continue
            for sequence in finished:
                self.stop(sequence)
                yield sequence.request.key, sequence.result()

    def _start(self, item: Request | Job) -> Sequence:
        """A sequence for a request, or for a job once its prefill ran; an out-of-memory error of the prefill
        carries the job (`error.job`) so that the back-off can start it again."""
        if isinstance(item, Request):
            return Sequence(item)
        try:
            request = item.start()
        except Exception as error:  # noqa: BLE001 - tagged and raised on
            error.job = item
            raise
        request.job = item
        return Sequence(request)

    def _back_off(self, jobs: list[Job], message: str) -> list[tuple[Any, Failure]]:
        """After out of memory: drop everything of the failed width (the jobs' states, the arena, the steps),
        release memory, halve the width; at width 1 the job in flight is given up (returned as a failure)."""
        for job in jobs:
            job.abandon()
        failed_width = self.width
        try:
            self._drop()
            release_memory()
        finally:  # even if interrupted here, the decoder stays usable
            self.width = max(1, failed_width // 2)
            self._build()
        if failed_width > 1:
            LOG.warning("out of memory at width %d: %d sequences start again at width %d", failed_width, len(jobs),
                        self.width)
            return []
        for job in jobs:
            LOG.warning("%s ran out of memory at width 1: given up", job.key)
        return [(job.key, Failure(job.key, "out_of_memory", message, job)) for job in jobs]


class BlockScheduler:
    """Plans a prefill's blocks (`plan` per block): in fixed shapes once its cache holds N entries, in a shared one-slot
    arena kept across prompts (`keep_slot`) or its own buffers; None: the ordinary pass. `finish` at the end."""

    def __init__(self, runner: ModelRunner, keep_slot: bool = False):
        self.runner, self.keep_slot = runner, keep_slot
        self.slot: Arena | None = None  # the kept slot, made like the first prompt's stack
        self._stack = None  # the prompt's stack, once one of its blocks was planned (until `finish`)
        self._own = None  # the arena of the prompt's own buffers, where a step was planned over them

    def plan(self, cache: EvictingCache, ids: torch.Tensor, start: int, block: int) -> StepPlan | None:
        """The block `ids` [rows, q] at `start` as a fixed-shape block step; None if it cannot run as one."""
        q = ids.shape[1]
        if not self.runner.fixed_shapes or q != block:
            return None
        record = read_cache(cache, q)
        if not record.ready:
            return None
        self._stack = cache.stack
        if self.keep_slot and self.enter(cache.stack):
            record = read_cache(cache, q)  # in the slot now: its rows are the slot's (else its own buffers')
        else:
            self._own = record.owner
        key = StepKey(record.buffers, 0, record.slots, q, record.policy, record.budget)
        rows = ids.shape[0]
        positions = torch.arange(start, start + q, device=ids.device).expand(rows, q)
        active = torch.ones(record.slots, dtype=torch.bool, device=ids.device)
        return StepPlan("block", "fixed", q, (cache,), (rows,), (slice(0, rows),), ids, positions, active, key,
                        record.owner, record.cut(0, record.slots), ((record.owner, record.slot or 0),))

    def finish(self, cache: EvictingCache, failed: bool = False) -> None:
        """The prefill of `cache` ended: it leaves the slot (with its entries unless failed), and the step over its
        own buffers goes."""
        stack, own, self._stack, self._own = self._stack, self._own, None, None
        if own is not None:
            self.runner.forget(own)
        if stack is not None and self.slot is not None and self.slot.occupant[0] is stack:
            self.slot.vacate(0, keep=not failed)

    def enter(self, stack) -> bool:
        """Move `stack` into the kept slot (it may be there already); False, nothing moved, if shaped otherwise."""
        if self.slot is not None and self.slot.holds(0, stack):
            return True
        if self.slot is None:
            self.slot = Arena.like(stack, 1, self.runner.stats)
        elif self.slot.layout != layout(stack):
            return False
        self.slot.vacate(0)  # a prefill that ended without leaving gets its entries back first
        return self.slot.take(0, stack)


def read_cache(cache: EvictingCache, q: int = 1, evict: bool = True) -> SequenceRecord:
    """What the scheduler plans from, read from a cache: the decode core's one read of the arena (at admission, when a
    neighbour joins a block, and per prefill block). q: the pass length; evict: the request's."""
    policy, stack, needs = cache.policy, cache.stack, cache.policy.needs
    statistic = needs.attention_rows != 0
    fixed_ok = (needs.capturable and not policy._check_every_call  # checking every call's scores reads them
                and poolable(cache, statistic) and not cache.mode.scratch
                and not cache.profile  # a profiled run times its statistics and evictions apart: the ordinary step
                and (not statistic or cache.statistics == "fast")  # materialised weights: the ordinary step
                and stack.capacity >= stack.budget + q)
    evicting = evict and cache.budget is not None
    held = evicting and (not cache.evicts_next_pass() or (stack is not None and stack.fresh is not None))
    record = SequenceRecord(fixed_ok, evicting, held, None if stack is None else stack.num_entries,
                            cache.budget if stack is None else stack.budget, cache.get_seq_length(), policy)
    if cache.contiguous and evicting:  # the next position is the kept keys' end, the largest budget once full
        record.ceiling = max((budget for budget in cache.layer_budgets if budget is not None), default=None)
    if stack is None or stack.keys is None:
        return record
    arena, slot = stack.handle.arena, stack.handle.slot
    record.owner, record.buffers = arena, id(arena.keys)
    if arena.shared:  # a slot beside other sequences' stacks
        record.slot, record.slots, record.cut = slot, arena.slots, arena.rows
    else:  # its own buffers: every row of its one slot
        record.slots, record.cut = stack.keys.shape[1], lambda first, stop: arena.rows()
    return record


def generate_batch(
    model: torch.nn.Module, requests: Iterable[Request | Job], batch_size: int, group_rows: bool = True,
    pool_rows: bool = True, fixed_shapes: bool | None = None, batch_invariant: bool = False,
) -> Iterator[tuple[Any, SequenceResult | Failure]]:
    """Decode every request, up to `batch_size` at once, with a Decoder of its own (see `Decoder`)."""
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    yield from Decoder(model, batch_size, group_rows, pool_rows, fixed_shapes, batch_invariant).generate(requests)
