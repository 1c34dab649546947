"""The scheduler: requests in, results out, up to W sequences decoding at once, a free place refilled as soon as a
sequence stops (continuous batching), and the back-off when memory runs out (the width halves).

Design: docs/design/decode.md#the-scheduler-schedulerpy
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterable, Iterator

import torch

from keydiff.attention import keydiff_attention
from keydiff.batching.blocks import JoinPool
from keydiff.batching.sequence import Failure, Job, Request, Sequence, SequenceResult
from keydiff.batching.static import StepStats
from keydiff.batching.step import BlockStepper, Stepper, decode_step
from keydiff.device import out_of_memory, release_memory

LOG = logging.getLogger(__name__)


class Decoder:
    """Decodes requests W at a time, keeping its arena and fixed-shape steps across calls.

    width: W (halved on out of memory). group_rows=False: every sequence alone (the reference). pool_rows: move
    joining sequences into arena slots. fixed_shapes: None = device default, False = never. batch_invariant:
    width-independent kernels for the decoding steps. Outputs are the same either way.
    """

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
        if fixed_shapes is not None and bool(fixed_shapes) != self.stepper.fixed_shapes:
            raise ValueError(f"fixed_shapes={fixed_shapes!r}, but the decoder runs fixed_shapes="
                             f"{self.stepper.fixed_shapes}: make the Decoder with it, or pass no decoder")
        if batch_invariant and not self.options[1]:
            raise ValueError("batch_invariant=True, but the decoder runs without it: make the Decoder with "
                             "batch_invariant=True, or pass no decoder")

    @property
    def replays_graphs(self) -> bool:
        """Whether its fixed-shape steps are replayed as CUDA graphs over the arena (the device's arrangement)."""
        return self.stepper.fixed_shapes and self.stepper.full_width

    def reset(self) -> None:
        """Drop the arena, the slot and the steps (rebuilt empty at the same width): after a caller handled an
        error of its own call (a sample at batch 1 that ran out of memory), nothing of that sequence stays."""
        self.stepper = self.pool = self.blocks = None
        self._build()

    def _build(self) -> None:
        """The stepper and the arena for the current width (again after a back-off: the old ones are dropped)."""
        if not self.widths or self.widths[-1] != self.width:
            self.widths.append(self.width)
        self.stepper = Stepper(self.model, self.group_rows, *self.options, stats=self.stats)
        alone = self.replays_graphs  # a replayed graph: even one sequence pools
        pooled = self.group_rows and self.pool_rows and (self.width > 1 or alone)
        self.pool = JoinPool(self.width, start_alone=alone, stats=self.stats) if pooled else None
        # The prefills' block step (keydiff.engine.prefill(..., decoder=)): in a slot kept across prompts where
        # graphs are replayed, so one graph serves every prompt of the run.
        self.blocks = BlockStepper(self.model, self.options[0], arena=alone, stats=self.stats)

    @torch.inference_mode()
    def generate(self, requests: Iterable[Request | Job]) -> Iterator[tuple[Any, SequenceResult | Failure]]:
        """Decode every request, up to `width` at once, refilling as soon as a sequence stops. Yields (key,
        SequenceResult) in finishing order, and (key, Failure) for a job given up at width 1; `requests` may be lazy."""
        source = iter(requests)
        if self.pool is not None:
            self.pool.idle()  # one call at a time: whatever a former call left in the arena has stopped
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
                    if self.pool is not None:
                        self.pool.place(sequence.cache)
                if not active:
                    return
                finished: list[Sequence] = []
                # One switch of the attention function for all the steps until a sequence stops (a switch walks
                # every module); outside it, the caller's code and the next prompts' prefills run as they were.
                with keydiff_attention(self.model, self.stepper.batch), self.stepper.invariant():
                    while active and not finished:
                        active, finished = decode_step(self.stepper, active)
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
                if self.pool is not None:
                    self.pool.leave(sequence.cache)
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
            self.stepper = self.pool = self.blocks = None
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


def generate_batch(
    model: torch.nn.Module, requests: Iterable[Request | Job], batch_size: int, group_rows: bool = True,
    pool_rows: bool = True, fixed_shapes: bool | None = None, batch_invariant: bool = False,
) -> Iterator[tuple[Any, SequenceResult | Failure]]:
    """Decode every request, up to `batch_size` at once, with a Decoder of its own (see `Decoder`)."""
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    yield from Decoder(model, batch_size, group_rows, pool_rows, fixed_shapes, batch_invariant).generate(requests)
