"""A run's samples decoded `batch_size` at a time (keydiff.decode), written as each one finishes.

Each row is the row a batch-1 run writes, plus how it was batched. Design: docs/design/runs.md#batched-decoding
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterator

from keydiff.decode import Failure, Request
from keydiff.run.samples import (
    RunContext, decode_settings, failed_row, prefill_sample, sample_row, sample_seed, screen_sample,
)

log = logging.getLogger(__name__)


class SharedPrefill:
    """The one prefill of consecutive samples with the same prompt, forked once per sample (`take`). A sample taking
    its state again (restarted after an out-of-memory back-off) prefills alone, and the untaken forks are dropped
    (their memory is what the back-off must free), so every later member prefills alone too."""

    def __init__(self, ctx: RunContext, prompt, members: list[str]):
        self.ctx, self.prompt, self.members, self.size = ctx, prompt, members, len(members)
        self.forks: dict[str, Any] | None = None  # member key -> its fork, until taken
        self.broken = False
        self.budget = None

    def abandon(self) -> None:
        """A back-off abandoned a member: the forks not yet taken are dropped now (their memory is part of what
        the back-off frees), and every member still to start prefills alone."""
        self.broken, self.forks = True, {}

    def take(self, key: str):
        """(state, budget, how many samples share that state's prefill) for member `key`."""
        if self.forks is None and not self.broken:
            state, self.budget = prefill_sample(self.ctx, self.prompt)
            # Every member a fork (not the prefilled state and k - 1 forks), so that all k lie side by side in one
            # block and decode as one group where the policy allows (keydiff.decode.blocks).
            self.forks = dict(zip(self.members, state.fork(self.size) if self.size > 1 else [state]))
        if not self.broken and key in self.forks:
            return self.forks.pop(key), self.budget, self.size
        self.broken, self.forks = True, {}
        return (*prefill_sample(self.ctx, self.prompt), 1)


class SampleJob:
    """One sample for the scheduler (keydiff.decode.Job): `start()` prefills it (or takes its fork of a shared
    prefill) and returns its Request; what the row needs afterwards stays here."""

    def __init__(self, ctx: RunContext, sample, prompt, shared: SharedPrefill):
        self.ctx, self.sample, self.prompt, self.shared = ctx, sample, prompt, shared
        self.key = sample.id
        self.state = self.budget = self.seed = None
        self.shared_by = 1  # how many samples share the prefill its state came from (`prefill_shared`)

    def start(self) -> Request:
        self.state = None
        self.state, self.budget, self.shared_by = self.shared.take(self.key)
        self.seed = sample_seed(self.prompt.generation, self.ctx.seed, self.sample)
        return Request(self.state, key=self.key, **decode_settings(self.ctx, self.prompt.generation, self.seed))

    def abandon(self) -> None:
        """Abandoned by a back-off: drop the state (its cache may be a view of the arena the back-off frees) and
        the shared prefill's forks not yet taken."""
        self.state = None
        self.shared.abandon()

    def row(self, out) -> dict[str, Any]:
        """The sample's row from its result (the state is dropped: a pooled cache is a view of the whole arena)."""
        row = {**sample_row(self.ctx, self.sample, self.prompt, self.state, out, self.budget, self.seed),
               **batch_record(out, self.shared_by)}
        self.state = None
        return row


def batched_rows(ctx: RunContext, samples: list) -> Iterator[dict[str, Any]]:
    """Every sample's row, in the order they finish, up to `ctx.batch_size` decoding at once through `ctx.decoder`;
    each `next()` runs interruptibly, and nothing runs while the caller writes a row."""
    ready: deque[dict[str, Any]] = deque()  # rows of samples refused before running (prompt cap, budget)
    jobs: dict[str, SampleJob] = {}
    results = ctx.decoder.generate(_jobs(ctx, deque(samples), ready, jobs))
    while True:
        with ctx.interruptible():
            try:
                finished = next(results, None)
            except Exception as error:  # Preempted is a BaseException and passes through
                raise RuntimeError(f"a batch of samples ({', '.join(jobs)}) failed with "
                                   f"{type(error).__name__}: {error}") from error
        while ready:
            yield ready.popleft()
        if finished is None:
            return
        key, out = finished
        job = jobs.pop(key)
        if isinstance(out, Failure):
            log.warning("sample %s ran out of memory at batch 1: recorded as failed", key)
            yield failed_row(ctx, job.sample, job.prompt, out.reason, out.message)
        else:
            yield job.row(out)
        out = finished = None


def batch_record(out, shared: int) -> dict[str, Any]:
    """How a sample was batched: mean batch size of its decoding passes, decode time per token, shared prefill."""
    sizes = out.batch_sizes
    tokens = len(out.token_ids[0])
    return {"decode_batch_size": sum(sizes) / len(sizes) if sizes else 1.0,
            "decode_s_per_token": out.seconds / tokens if tokens else 0.0,
            "prefill_shared": shared}


def _jobs(ctx: RunContext, pending: deque, ready: deque, jobs: dict) -> Iterator[SampleJob]:
    """The next sample's job whenever the scheduler has a free place; samples that must not run go to `ready` as
    failed rows; consecutive samples with the same prompt share one prefill (forks)."""
    while pending:
        sample = pending.popleft()
        prompt, refused = screen_sample(ctx, sample)
        if refused is not None:
            ready.append(refused)
            continue
        group = [(sample, prompt)]
        while pending and (other := _same_prompt(ctx, pending[0], prompt)) is not None:
            group.append((pending.popleft(), other))
        shared = SharedPrefill(ctx, prompt, [member.id for member, _ in group])
        for member, member_prompt in group:
            jobs[member.id] = SampleJob(ctx, member, member_prompt, shared)
            yield jobs[member.id]


def _same_prompt(ctx: RunContext, sample, prompt):
    """`sample`'s prompt if it has exactly `prompt`'s token ids (so it may share its prefill), else None."""
    own = ctx.plan.build_prompt(sample, ctx.tokenizer)
    return own if own.input_ids == prompt.input_ids else None
