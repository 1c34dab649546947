"""Several questions over one compressed context: a task's `multi_request` and `multi_turn` modes.

The context is prefilled and compressed once; one row per question. Design: docs/design/runs.md#shared-contexts
"""

from __future__ import annotations

import logging
from itertools import groupby
from typing import Any, Callable, Iterator

import torch

from keydiff.engine import PrefillResult, copy_state, feed, follow_up, generate, prefill
from keydiff.run.samples import (
    RunContext, decode_settings, failed_row, sample_row, sample_seed, screen_sample, stop_ids_of,
    unless_out_of_memory,
)
from keydiff.tasks.base import Prompt, SharedContext

log = logging.getLogger(__name__)
SHARED_MODES = ("multi_request", "multi_turn")


def shared_rows(ctx: RunContext, todo: list) -> Iterator[dict[str, Any]]:
    """Every question's row, context by context (the task's shard groups); each context runs interruptibly and
    its rows are yielded after, so nothing runs while the caller writes a row."""
    task = ctx.plan.task
    wanted = {sample.id for sample in todo}
    by_group = {}
    # a context's questions in order, also those already written (multi_turn replays them)
    for sample in task.samples():
        by_group.setdefault(task.shard_group(sample), []).append(sample)
    for group, _ in groupby(todo, key=task.shard_group):
        samples = by_group[group]
        with ctx.interruptible():
            rows = context_rows(ctx, samples, wanted)
        yield from rows


def context_rows(ctx: RunContext, samples: list, wanted: set) -> list[dict[str, Any]]:
    """The rows of the wanted questions of one context (out of memory: all of them failed)."""
    plan = ctx.plan
    shared = plan.task.shared_context(samples, ctx.tokenizer, plan.model_cfg.max_length)
    refused = [screen_sample(ctx, s)[1] for s in samples]
    if any(refused):
        reason = next(r for r in refused if r)
        why = f"another question of its context: {reason['error']}"
        return [r or failed_row(ctx, s, p, reason["failure_reason"], why)
                for s, p, r in zip(samples, shared.questions, refused) if s.id in wanted]
    what = f"context of {samples[0].id!r}"
    rows, oom = unless_out_of_memory(ctx, what, lambda: answer(ctx, samples, shared, wanted))
    if oom is None:
        return rows
    log.warning("context of %s ran out of memory: its questions are recorded as failed", samples[0].id)
    return [failed_row(ctx, s, p, "out_of_memory", oom)
            for s, p in zip(samples, shared.questions) if s.id in wanted]


def prefill_context(ctx: RunContext, shared: SharedContext) -> tuple[PrefillResult, int | None]:
    """The context's one block-wise prefill and compression (its own N: a ratio budget counts the context)."""
    plan = ctx.plan
    budget = plan.sample_budget(len(shared.context_ids))
    state = prefill(ctx.model, torch.tensor([shared.context_ids], dtype=torch.long), plan.new_policy(), budget,
                    plan.block_size, attention_statistics=plan.statistics, tokenizer=ctx.tokenizer, decoder=ctx.decoder)
    return state, budget


def answer(ctx: RunContext, samples: list, shared: SharedContext, wanted: set,
           before_question: Callable[[int, PrefillResult], None] | None = None) -> list[dict[str, Any]]:
    """Prefill the context once, then answer its questions in the task's mode; the rows of the `wanted` ones.
    before_question(j, state): called with the state question j is about to be fed into (tests check it)."""
    model = ctx.model
    mode = ctx.plan.task.mode
    if mode not in SHARED_MODES:
        raise ValueError(f"task.mode={mode!r} shares no context; valid here: {', '.join(SHARED_MODES)}")
    context, budget = prefill_context(ctx, shared)
    prefill_s = context.seconds  # before any question is fed (feed adds its time to the state it feeds)
    rows, conversation, state = [], list(shared.context_ids), context
    for j, (sample, prompt) in enumerate(zip(samples, shared.questions)):
        if mode == "multi_request":
            if sample.id not in wanted:
                continue  # written before (a resumed run): its answer changes no other question's
            state = context if j == len(samples) - 1 else copy_state(context, model)  # the last may use it up
            fed = prompt.input_ids[prompt.context_tokens:]
            asked = prompt
        else:
            fed = prompt.input_ids[prompt.context_tokens:] if j == 0 else (
                ([] if last in stop_ids_of(ctx, prompt.generation) else [last]) + shared.follow_ups[j])
            asked = Prompt(conversation + fed, prompt.generation, prompt.info, context_tokens=len(conversation))
        if before_question is not None:
            before_question(j, state)
        ids = torch.tensor([fed], dtype=torch.long)
        if mode == "multi_turn" and j > 0:
            state = follow_up(model, state, ids)
            question_s = state.seconds
        else:
            start = state.seconds
            state = feed(model, state, ids)
            question_s = state.seconds - start
        seed = sample_seed(prompt.generation, ctx.seed, sample)
        out = generate(model, state, **decode_settings(ctx, prompt.generation, seed), decoder=ctx.decoder)
        tokens = out.token_ids[0]
        if mode == "multi_turn":
            conversation = asked.input_ids + tokens[:-1]  # generate feeds every token but the last
            last = tokens[-1]
        if sample.id in wanted:
            row = sample_row(ctx, sample, asked, state, out, budget, seed)
            rows.append({**row, "ttft_s": question_s, "context_prefill_s": prefill_s,
                         "shared_prefill_s": 0.0 if rows else prefill_s, "context_mode": mode})
    return rows
