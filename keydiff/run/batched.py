"""A run's samples decoded `batch_size` at a time (keydiff.batching), written as each one finishes.

The runner hands its samples here when `batch_size > 1`; each row is the row a batch-1 run writes for the
sample (same prediction: each sequence keeps its own cache, seed and stop rule), plus how it was batched:
`decode_batch_size` (the mean batch size of its decoding passes) and `decode_s_per_token` (its decode wall time
per token, each pass charged whole to every row of the batch). TTFT stays per sample: its prefill runs alone,
between decoding steps, when a place in the batch frees.

One prefill, many decodes: consecutive samples with the same prompt (Math-500's responses to one problem)
are prefilled once and forked (keydiff.engine.PrefillResult.fork), each decoding with its own seed; their rows
record `prefill_shared` (how many samples share that prefill; its TTFT is the one prefill's).

What survives: a stop signal abandons the samples in flight (nothing of theirs is written; the rows already
yielded are whole) and the resumed run redoes them. Out of memory in a batch step abandons the samples in
flight and runs them again at half the batch (the rest of the run keeps the smaller batch), down to 1, where
the one sample in flight is recorded as failed, as at batch 1.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterator

from keydiff.batching import Request, generate_batch
from keydiff.run.samples import (
    RunContext, decode_settings, failed_row, is_out_of_memory, prefill_sample, release_memory, sample_row, sample_seed,
    screen_sample,
)

log = logging.getLogger(__name__)


def batched_rows(ctx: RunContext, samples: list) -> Iterator[dict[str, Any]]:
    """Every sample's row, in the order the samples finish, `ctx.batch_size` decoding at once. Each `next()` runs
    interruptibly (a stop signal abandons the samples in flight); nothing runs while the caller writes a row."""
    pending = deque(samples)
    batch_size = ctx.batch_size
    while pending:
        ready: deque[dict[str, Any]] = deque()  # rows of samples refused before running (prompt cap, budget)
        in_flight: dict[str, tuple] = {}  # sample id -> (sample, prompt, state, budget, seed, shared)
        results = generate_batch(ctx.model, _requests(ctx, pending, ready, in_flight), batch_size,
                                 batch_invariant=ctx.plan.batch_invariant)
        out_of_memory = None
        while True:
            try:
                with ctx.interruptible():
                    finished = next(results, None)
            except Exception as error:  # Preempted is a BaseException and passes through
                if not is_out_of_memory(error):
                    raise RuntimeError(f"a batch of samples ({', '.join(in_flight)}) failed with "
                                       f"{type(error).__name__}: {error}") from error
                out_of_memory = f"{type(error).__name__}: {error}"
                break
            while ready:
                yield ready.popleft()
            if finished is None:
                break
            key, out = finished
            sample, prompt, state, budget, seed, shared = in_flight.pop(key)
            row = {**sample_row(ctx, sample, prompt, state, out, budget, seed), **batch_record(out, shared)}
            state = out = None  # a pooled cache is a view of the batch's whole block: hold none across a retry
            yield row
        if out_of_memory is None:
            return
        results.close()
        abandoned = [entry[0] for entry in in_flight.values()]
        in_flight.clear()
        release_memory()
        if batch_size == 1:  # as at batch 1: the sample is recorded as failed and the run goes on
            sample, prompt = abandoned[0], ctx.plan.build_prompt(abandoned[0], ctx.tokenizer)
            log.warning("sample %s ran out of memory at batch 1: recorded as failed", sample.id)
            yield failed_row(ctx, sample, prompt, "out_of_memory", out_of_memory)
            abandoned = abandoned[1:]
        else:
            log.warning("out of memory at batch %d: %d samples run again at batch %d", batch_size, len(abandoned),
                        batch_size // 2)
            batch_size //= 2
        pending.extendleft(reversed(abandoned))


def batch_record(out, shared: int) -> dict[str, Any]:
    """How a sample was batched: mean batch size of its decoding passes, decode time per token, shared prefill."""
    sizes = out.batch_sizes
    tokens = len(out.token_ids[0])
    return {"decode_batch_size": sum(sizes) / len(sizes) if sizes else 1.0,
            "decode_s_per_token": out.seconds / tokens if tokens else 0.0,
            "prefill_shared": shared}


def _requests(ctx: RunContext, pending: deque, ready: deque, in_flight: dict) -> Iterator[Request]:
    """The next sample's request whenever the scheduler has a free place; samples that must not run go to
    `ready` as failed rows; consecutive samples with the same prompt share one prefill (forks)."""
    forks: deque = deque()
    while pending or forks:
        if not forks:
            sample = pending.popleft()
            prompt, refused = screen_sample(ctx, sample)
            if refused is not None:
                ready.append(refused)
                continue
            group = [(sample, prompt)]
            while pending and (other := _same_prompt(ctx, pending[0], prompt)) is not None:
                group.append((pending.popleft(), other))
            for member, member_prompt in group:  # in flight from now on: abandoned together if memory runs out
                in_flight[member.id] = (member, member_prompt, None, None, None, len(group))
            state, budget = prefill_sample(ctx, prompt)
            # Every member a fork (not the prefilled state and k - 1 forks), so that all k lie side by side in one
            # block and decode as one group where the policy allows (keydiff.batching.blocks).
            states = state.fork(len(group)) if len(group) > 1 else [state]
            forks.extend((member, member_prompt, forked, budget)
                         for (member, member_prompt), forked in zip(group, states))
        sample, prompt, state, budget = forks.popleft()
        seed = sample_seed(prompt.generation, ctx.seed, sample)
        in_flight[sample.id] = (sample, prompt, state, budget, seed, in_flight[sample.id][-1])
        yield Request(state, key=sample.id, **decode_settings(ctx, prompt.generation, seed))


def _same_prompt(ctx: RunContext, sample, prompt):
    """`sample`'s prompt if it has exactly `prompt`'s token ids (so it may share its prefill), else None."""
    own = ctx.plan.build_prompt(sample, ctx.tokenizer)
    return own if own.input_ids == prompt.input_ids else None
