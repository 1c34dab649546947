"""One sample of a run: what every sample of an invocation runs with (`RunContext`), its prompt screened,
prefill and decode, and its row (or failed row). The runner, keydiff.run.batched and keydiff.run.shared all
build on it, so a row is the same whichever ran it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from keydiff.decode import Decoder
from keydiff.device import out_of_memory, release_memory
from keydiff.engine import generate, prefill
from keydiff.run import memory
from keydiff.run.plan import RunPlan
from keydiff.run.preemption import StopSignals
from keydiff.tasks.base import Prompt
from keydiff.tasks.degenerate import is_degenerate

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RunContext:
    """What every sample of one invocation is run with: the plan, model and tokenizer, stop ids, code label, stop
    signals, run seed, batch size, prompt cap (max_prompt_tokens) and the run's `decoder` (made here when not
    given), so its arena and fixed-shape steps are built once per run and shape, not once per sample."""

    plan: RunPlan
    model: Any
    tokenizer: Any
    stop_ids: list[int]
    code: str | None = None
    signals: StopSignals | None = None  # None: nothing interrupts the samples (an API caller, a test)
    seed: int = 0
    batch_size: int = 1
    prompt_cap: int | None = None
    decoder: Decoder | None = None

    def __post_init__(self):
        if self.decoder is None:
            object.__setattr__(self, "decoder", Decoder(self.model, self.batch_size,
                                                        batch_invariant=self.plan.batch_invariant))

    def interruptible(self):
        """The block in which a stop signal abandons the sample(s) at once (nothing without `signals`)."""
        return contextlib.nullcontext() if self.signals is None else self.signals.interruptible()


def derived_seed(run_seed: int, sample_id: str) -> int:
    digest = hashlib.sha256(f"{run_seed}:{sample_id}".encode()).hexdigest()
    return int(digest[:12], 16)


def cuda_devices(model: torch.nn.Module) -> list[torch.device]:
    """The CUDA devices holding the model's parameters (several when model.device_map spreads it over GPUs)."""
    return sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)


def kv_bytes_per_layer_entry(model: torch.nn.Module) -> int:
    """Bytes one cached token costs in one layer (keys + values, every KV head)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_key_value_heads * head_dim * itemsize


def run_sample(ctx: RunContext, sample, prompt: Prompt | None = None) -> dict[str, Any]:
    """Prefill and decode one sample alone; its result row."""
    prompt = prompt or ctx.plan.build_prompt(sample, ctx.tokenizer)
    for gpu in cuda_devices(ctx.model):
        torch.cuda.reset_peak_memory_stats(gpu)
    state, budget = prefill_sample(ctx, prompt)
    seed = sample_seed(prompt.generation, ctx.seed, sample)
    out = generate(ctx.model, state, **decode_settings(ctx, prompt.generation, seed), decoder=ctx.decoder)
    return sample_row(ctx, sample, prompt, state, out, budget, seed)


def prefill_sample(ctx: RunContext, prompt: Prompt):
    """The sample's block-wise prefill with a fresh policy and its own N: (PrefillResult, budget)."""
    plan = ctx.plan
    compressed = plan.compressed_tokens(prompt)
    held = len(prompt.input_ids) - compressed  # the question, held whole up to the first token (query_aware=False)
    budget = plan.sample_budget(compressed)
    state = prefill(ctx.model, torch.tensor([prompt.input_ids], dtype=torch.long), plan.new_policy(), budget,
                    plan.block_size, attention_statistics=plan.statistics, tokenizer=ctx.tokenizer, held_suffix=held,
                    decoder=ctx.decoder)
    return state, budget


def sample_seed(settings, run_seed: int, sample) -> int:
    """The task's seed for this sample, else one derived from the run seed and the sample id."""
    return settings.seed if settings.seed is not None else derived_seed(run_seed, sample.id)


def decode_settings(ctx: RunContext, settings, seed: int) -> dict[str, Any]:
    """keydiff.generate's arguments for a sample (keydiff.decode.Request takes the same)."""
    return dict(max_new_tokens=settings.max_new_tokens, eos_token_ids=stop_ids_of(ctx, settings),
                do_sample=settings.do_sample, temperature=settings.temperature, top_p=settings.top_p,
                min_new_tokens=settings.min_new_tokens, seed=seed, evict=ctx.plan.decode_eviction)


def stop_ids_of(ctx: RunContext, settings) -> list[int]:
    """The ids that end an answer: the model's and the task's."""
    return list(ctx.stop_ids) + list(settings.stop_token_ids)


def sample_row(ctx: RunContext, sample, prompt: Prompt, state, out, budget: int | None, seed: int) -> dict[str, Any]:
    """The result row of a decoded sample (`state`: its prefill, `out`: its one-row GenerationResult)."""
    plan, model = ctx.plan, ctx.model
    settings = prompt.generation
    device = next(model.parameters()).device
    tokens = out.token_ids[0]
    prediction = ctx.tokenizer.decode(tokens, skip_special_tokens=True)
    length = len(prompt.input_ids)
    compressed = plan.compressed_tokens(prompt)
    held = length - compressed  # the question held whole (query_aware=false), else 0
    # Entries per KV head after prefill (head-adaptive layers: their mean over heads; padding is -1), over the layers
    # the policy bounds (a hybrid model's sliding-window layers hold their window, whatever the budget), of the
    # compressed tokens (a held question is all there, every head).
    bounded = [p for p, kind in zip(state.kept_positions, state.cache.layer_kinds) if kind != "sliding"]
    kept = min(int((positions >= 0).sum()) // (positions.shape[0] * positions.shape[1])
               for positions in bounded or state.kept_positions) - held
    return {
        "sample_id": sample.id,
        "status": "ok",
        "prediction": prediction,
        "scores": plan.task.score(sample, prediction),
        "info": prompt.info,
        "prompt_tokens": length,
        "budget": budget,
        "kept_tokens": kept,
        # The share of the compressed prompt kept, min(N / L, 1): kvpress's compression_ratio is 1 minus this.
        "kept_ratio": 1.0 if budget is None else min(budget / compressed, 1.0),
        "query_aware": plan.query_aware,
        **({} if plan.query_aware else {"context_tokens": compressed, "held_tokens": held}),
        "ttft_s": state.seconds,
        "decode_s": out.seconds,
        "new_tokens": len(tokens),
        "finish_reason": out.finish_reasons[0],
        # The output collapsed into one repeated n-gram (keydiff.tasks.degenerate; the stop token left out).
        "degenerate": is_degenerate(tokens[:-1] if out.finish_reasons[0] == "stop" else tokens),
        "max_cache_entries": out.max_cache_entries,
        # Per layer: its budget N_l (a schedule such as PyramidKV makes them differ) and its peak entries per head.
        "layer_budgets": state.cache.layer_budgets,
        "layer_max_cache_entries": state.cache.layer_max_entries,
        # KVzip's reconstruction passes hold N + B + R + B entries per head while they run (absent for other policies).
        **({"max_scratch_entries": state.max_scratch_entries} if state.max_scratch_entries else {}),
        # Per layer, all KV heads together: the peak entries held and the head count (what bounds a layer whose
        # heads share its budget, AdaKV: kv_heads x (N_l + B)).
        "layer_max_total_entries": state.cache.layer_max_total_entries,
        "layer_kv_heads": state.cache.layer_kv_heads,
        # Bytes of the cache's key/value buffers as allocated (once per sequence, N + B entries per layer).
        "kv_cache_allocated_bytes": state.cache.kv_cache_bytes,
        # Bytes of the entries held at once, at most: every layer's own peak entries, summed (<= allocated).
        "kv_cache_held_peak_bytes": state.cache.entries_peak_sum * kv_bytes_per_layer_entry(model),
        "peak_memory_bytes": memory.peak_memory(device, cuda_devices(model))[0],
        # The seed of sampled decoding; null for greedy decoding, which uses none (the run's `seed` is in summary.json).
        "sampling_seed": seed if settings.do_sample else None,
        # W, the width of the decoding step it ran in (keydiff.decode.scheduler.Decoder): batch_size, or less
        # after an out-of-memory back-off. Under batch_invariant on a GPU tokens do not depend on it (not guaranteed
        # bitwise on a CPU, whose matmuls round by row count; equal in every tested case).
        "decode_width": ctx.decoder.width,
        "code": ctx.code,  # commit (+ "-dirty") that produced this row: a resumed run may span commits
    }


def failed_row(ctx: RunContext, sample, prompt: Prompt, reason: str, message: str) -> dict[str, Any]:
    """The row of a sample that could not run: why, and how long its prompt was (no scores)."""
    plan = ctx.plan
    return {"sample_id": sample.id, "status": "failed", "failure_reason": reason, "error": message[:500],
            "info": prompt.info, "prompt_tokens": len(prompt.input_ids),
            "budget": plan.sample_budget(plan.compressed_tokens(prompt)), "query_aware": plan.query_aware,
            "code": ctx.code}


def process_sample(ctx: RunContext, sample) -> dict[str, Any]:
    """Run one sample; out-of-memory and the prompt cap give a failed row, any other error stops the run."""
    with ctx.interruptible():
        prompt, refused = screen_sample(ctx, sample)
        if refused is not None:
            return refused
        row, oom = unless_out_of_memory(ctx, f"sample {sample.id!r}", lambda: run_sample(ctx, sample, prompt=prompt))
    if oom is None:
        return row
    log.warning("sample %s ran out of memory (%d prompt tokens): recorded as failed", sample.id, len(prompt.input_ids))
    return failed_row(ctx, sample, prompt, "out_of_memory", oom)


def unless_out_of_memory(ctx: RunContext, what: str, call: Callable[[], T]) -> tuple[T | None, str | None]:
    """(call(), None); or, where it ran out of memory, (None, the error) once the decoder holds nothing of it and memory
    is released (outside the except block). Any other error stops the run, naming `what`."""
    try:
        return call(), None
    except Exception as error:  # Preempted is a BaseException and passes through
        if not out_of_memory(error):
            raise RuntimeError(f"{what} failed with {type(error).__name__}: {error}") from error
        oom = f"{type(error).__name__}: {error}"
    ctx.decoder.reset()
    release_memory()
    return None, oom


def screen_sample(ctx: RunContext, sample) -> tuple[Prompt, dict[str, Any] | None]:
    """The sample's prompt, and its failed row if it must not run (over max_prompt_tokens, or a ratio budget
    whose N the policy refuses), else None."""
    plan, cap = ctx.plan, ctx.prompt_cap
    prompt = plan.build_prompt(sample, ctx.tokenizer)
    if cap is not None and len(prompt.input_ids) > cap:
        return prompt, failed_row(ctx, sample, prompt, "max_prompt_tokens",
                                  f"prompt has {len(prompt.input_ids)} tokens > max_prompt_tokens={cap}")
    budget = plan.sample_budget(plan.compressed_tokens(prompt))
    if plan.ratio is not None and budget is not None:
        try:
            plan.new_policy().check(budget)
        except ValueError as error:  # e.g. a sink or window larger than this short prompt's N
            return prompt, failed_row(ctx, sample, prompt, "budget_too_small",
                                      f"budget.ratio={plan.ratio} gives N={budget} for this prompt: {error}")
    return prompt, None
