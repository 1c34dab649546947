"""Block prompt processing (paper §2.4, Eq. 6) and decoding with eviction after every token: `prefill`, `generate`, and
`copy_state`, `feed` and `follow_up` for several questions or turns over one compressed context. Timings cover the
forward passes only; callers warm up. Design: docs/design/decode.md#the-engine-keydiffenginepy"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Sequence

import torch

from keydiff.attention import keydiff_attention
from keydiff.decode import Decoder, GenerationResult, Request
from keydiff.decode.blocks import place_forks
from keydiff.decode.scheduler import BlockScheduler
from keydiff.decode.step import ModelRunner
from keydiff.cache import EvictingCache
from keydiff.cache.placement import layer_placements
from keydiff.cache.sliding import layer_windows
from keydiff.device import sync
from keydiff.policies import Policy, build_policy


@dataclass
class PrefillResult:
    """State after block-wise prefill: next-token logits, the bounded cache, and what was kept."""

    logits: torch.Tensor  # [batch, vocab] at the last prompt position, float32
    cache: EvictingCache  # the live cache: `generate` keeps evicting into it
    prompt_length: int
    budget: int | None
    block_size: int | None
    seconds: float  # wall time of the prefill (time to first token's logits)
    # Per layer, LongTensor [batch, kv_heads, kept]: the prompt positions kept after prefill (a snapshot).
    kept_positions: list[torch.Tensor] = field(default_factory=list)
    max_cache_entries: int = 0  # peak entries per layer and KV head during prefill
    max_scratch_entries: int = 0  # peak during reconstruction passes (KVzip: N + B + R + B), else 0
    decoded: bool = False  # set by `generate`: the logits and cache belong to one continuation only
    # Trailing prompt tokens held whole at the first generated token (`held_suffix`), in kept_positions.
    held_suffix: int = 0

    def fork(self, copies: int) -> list["PrefillResult"]:
        """`copies` independent states to decode from without prefilling again: each its own cache copy
        (EvictingCache.fork) and logits, placed to decode as one group. This state stays usable."""
        if self.decoded:
            raise RuntimeError("this PrefillResult was already decoded (its cache moved on); fork before generate")
        if isinstance(copies, bool) or int(copies) != copies or copies < 1:
            raise ValueError(f"copies must be a positive integer, got {copies!r}")
        # Side by side in one block where the policy allows (a batch then decodes the forks as one group).
        caches = place_forks(lambda: self.cache.fork(1)[0], int(copies))
        return [replace(self, logits=self.logits.clone(), cache=cache) for cache in caches]


@dataclass(frozen=True)
class PrefillOptions:
    """How `prefill` runs a prompt: everything besides the model, the prompt, the policy and the budget. A run
    builds one and passes it to every prefill (`prefill(..., options=...)`); keywords of the call replace fields."""

    block_size: int | float | str | None = 128  # B; None, math.inf or "inf": the whole prompt as one block
    attention_statistics: str = "fast"  # "fast" or "materialized"
    profile: bool = False  # time the cache's phases (the cache's `timed`)
    on_block: Callable[[EvictingCache], None] | None = None  # called with the cache after each block's eviction
    tokenizer: Any = None  # for a policy's reconstruction prompt (KVzip)
    # The last tokens, fed whole after the rest and held to the first generated token (0: the paper's protocol).
    held_suffix: int = 0
    fixed_shapes: bool | None = None  # full blocks in fixed shapes (None: the device's default, False: never)
    decoder: Decoder | None = None  # a run's keydiff.Decoder, whose block step serves every prompt of the run


class _FromOptions:
    """The default of `prefill`'s positional block_size: the options' own (128 unless they say otherwise)."""

    def __repr__(self) -> str:
        return "options.block_size"


_FROM_OPTIONS = _FromOptions()
PREFILL_SETTINGS = tuple(f.name for f in fields(PrefillOptions))
# What `generate` takes: a Request's decode settings and the decoder's own settings.
REQUEST_SETTINGS = tuple(f.name for f in fields(Request) if f.name not in ("state", "key", "job"))
DECODER_SETTINGS = ("fixed_shapes", "batch_invariant", "decoder")


def check_settings(call: str, settings: dict, valid: Sequence[str]) -> None:
    """Refuse keywords that are no setting of `call`, in one line that names the valid ones."""
    unknown = [name for name in settings if name not in valid]
    if unknown:
        raise TypeError(f"{call}() got unknown setting{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")


def resolve_block_size(block_size: int | float | str | None) -> int | None:
    """None, math.inf or "inf" mean one block (whole prompt); otherwise a positive integer."""
    if block_size is None or (isinstance(block_size, str) and block_size.lower() in ("inf", "infinity", "none")):
        return None
    if isinstance(block_size, float) and math.isinf(block_size):
        return None
    if isinstance(block_size, bool) or int(block_size) != block_size or int(block_size) < 1:
        raise ValueError(f"block_size must be a positive integer or 'inf', got {block_size!r}")
    return int(block_size)


def check_budget(policy: Policy, budget: int | None) -> None:
    if not policy.needs.evicts:
        return
    if budget is None or isinstance(budget, bool) or int(budget) != budget or budget < 1:
        raise ValueError(f"budget must be a positive integer number of tokens for policy {policy.name!r}, got {budget!r}")
    policy.check(int(budget))


def check_model_supported(model: torch.nn.Module) -> None:
    """Full-attention and sliding-window layers only; linear-attention, chunked or shared layers are refused in one line."""
    layer_windows(model.config)


def _forward(
    model: torch.nn.Module, cache: EvictingCache, input_ids: torch.Tensor, reconstruction: torch.Tensor | None = None,
    drop: bool = True,
) -> torch.Tensor:
    """One forward pass of `input_ids` after what the cache has seen, then eviction; next-token logits [b, vocab].
    reconstruction: ids of a scratch pass run in between (KVzip). drop=False: observe only (a held suffix)."""
    output = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    if reconstruction is not None:
        with cache.scratch(chunk_start=cache.get_seq_length() - input_ids.shape[1]):
            model(input_ids=reconstruction, cache=cache, use_cache=True, logits_to_keep=1)
    cache.evict(drop=drop)
    return output.logits[:, -1, :].float()


def reconstruction_inputs(policy: Policy, input_ids: torch.Tensor, step: int, tokenizer) -> list[torch.Tensor | None]:
    """Per prefill block, the ids of its reconstruction pass (None for every block if the policy runs none)."""
    starts = range(0, input_ids.shape[1], step)
    if not policy.needs.reconstruction:
        return [None] * len(starts)
    return [policy.reconstruction_input(input_ids[:, start : start + step], input_ids[:, max(start - step, 0) : start],
                                        tokenizer).to(input_ids.device) for start in starts]


@torch.inference_mode()
def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policy: Policy | str,
    budget: int | None,
    block_size: int | float | str | None = _FROM_OPTIONS,
    *,
    options: PrefillOptions | None = None,
    **settings: Any,
) -> PrefillResult:
    """Process `input_ids` [batch, L] (no padding) block by block, keeping at most `budget` entries per head.

    policy: a Policy or a name. budget: tokens per layer and KV head. options: a PrefillOptions (None: its defaults);
    block_size and keywords (`held_suffix=20`, ...) replace its fields, an unknown one is refused."""
    if options is not None and not isinstance(options, PrefillOptions):
        raise TypeError(f"options must be a keydiff.PrefillOptions, got {type(options).__name__}")
    check_settings("prefill", settings, PREFILL_SETTINGS)
    if block_size is not _FROM_OPTIONS:
        settings["block_size"] = block_size
    options = replace(options or PrefillOptions(), **settings)
    policy = build_policy(policy) if isinstance(policy, str) else policy
    check_budget(policy, budget)
    check_model_supported(model)
    block = resolve_block_size(options.block_size)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    length = input_ids.shape[1]
    if length < 1:
        raise ValueError("the prompt is empty")
    held_suffix = options.held_suffix
    if isinstance(held_suffix, bool) or int(held_suffix) != held_suffix or not 0 <= held_suffix < length:
        raise ValueError(f"held_suffix must be an integer in [0, {length - 1}] (at least one prompt token is "
                         f"compressed), got {held_suffix!r}")
    held_suffix = int(held_suffix)
    compressed = length - held_suffix  # the context: what block-wise eviction sees
    step = compressed if block is None else block
    context = input_ids[:, :compressed]
    reconstructions = reconstruction_inputs(policy, context, step, options.tokenizer)
    scratch = max((ids.shape[1] for ids in reconstructions if ids is not None), default=0)
    cache = EvictingCache(
        policy, budget, model.config.get_text_config().num_hidden_layers, statistics=options.attention_statistics,
        profile=options.profile, block_size=max(step, held_suffix + 1) if held_suffix else step, max_tokens=length,
        scratch_tokens=scratch, config=model.config, compressed_tokens=compressed,
        layer_placements=layer_placements(model, model.config.get_text_config().num_hidden_layers),
    )
    # Full blocks in fixed shapes once the cache is full (planned by a run's decoder, or for this prefill alone).
    decoder = options.decoder
    if decoder is not None:
        decoder.check_options(options.fixed_shapes)
        blocks = decoder.blocks
    else:
        blocks = BlockScheduler(ModelRunner(model, fixed_shapes=options.fixed_shapes))
    with keydiff_attention(model, cache):
        sync(device)
        start_time = time.perf_counter()
        try:
            for start, reconstruction in zip(range(0, compressed, step), reconstructions):
                block_ids = context[:, start : start + step]
                plan = blocks.plan(cache, block_ids, start, step) if reconstruction is None else None
                if plan is not None:  # a block step in fixed shapes, run by the model runner
                    logits = blocks.runner.run(plan).logits
                else:
                    logits = _forward(model, cache, block_ids, reconstruction)
                if options.on_block is not None:
                    options.on_block(cache)
        except BaseException:
            blocks.finish(cache, failed=True)  # discarded: the slot is freed without copying (OOM may unwind)
            raise
        blocks.finish(cache)  # the stack leaves the run's prefill slot (if it was in one) with its entries
        if held_suffix:
            logits = _forward(model, cache, input_ids[:, compressed:], drop=False)
        sync(device)
        seconds = time.perf_counter() - start_time
    return PrefillResult(logits, cache, length, budget if policy.needs.evicts else None, block, seconds,
                         kept_positions=cache.kept_positions(), max_cache_entries=cache.max_entries,
                         max_scratch_entries=cache.max_scratch_entries, held_suffix=held_suffix)


def copy_state(state: PrefillResult, model: torch.nn.Module) -> PrefillResult:
    """An independent copy of a prefilled state (cache buffers, positions, policy state and policy; weights shared),
    so one compressed context can answer several questions: `generate(model, feed(model, copy_state(context,
    model), question), ...)` per question."""
    if state.decoded:
        raise RuntimeError("this PrefillResult was already decoded (its cache moved on); copy it before decoding")
    return state.fork(1)[0]


@torch.inference_mode()
def feed(model: torch.nn.Module, state: PrefillResult, input_ids: torch.Tensor) -> PrefillResult:
    """Feed `input_ids` [batch, S] after a prefilled state in one pass, evicting nothing: they are held whole until
    the first generated token (a held suffix fed later, as `prefill`'s held_suffix feeds it at once)."""
    if state.decoded:
        raise RuntimeError("this PrefillResult was already decoded (its cache moved on); run prefill again")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.shape[1] < 1:
        raise ValueError("feed needs at least one token")
    device = next(model.parameters()).device
    with keydiff_attention(model, state.cache):
        sync(device)
        start_time = time.perf_counter()
        state.logits = _forward(model, state.cache, input_ids.to(device), drop=False)
        sync(device)
        state.seconds += time.perf_counter() - start_time
    state.held_suffix += input_ids.shape[1]
    state.kept_positions = state.cache.kept_positions()
    state.max_cache_entries = max(state.max_cache_entries, state.cache.max_entries)
    return state


def follow_up(model: torch.nn.Module, state: PrefillResult, input_ids: torch.Tensor) -> PrefillResult:
    """The next turn: feed `input_ids` [batch, S] into the cache of a state `generate` decoded, held whole up to the next
    first token, and return a new state (the old one must not be used again). `generate` never feeds the token it
    stops on: put it first in `input_ids` if the conversation keeps it."""
    if not state.decoded:
        raise RuntimeError("follow_up continues a decoded state; an undecoded one takes feed")
    turn = replace(state, seconds=0.0, held_suffix=0, decoded=False)
    state.cache = None  # the cache now belongs to the new turn
    return feed(model, turn, input_ids)


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    state: PrefillResult | Request,
    max_new_tokens: int | None = None,
    *,
    fixed_shapes: bool | None = None,
    batch_invariant: bool = False,
    decoder: Decoder | None = None,
    **settings: Any,
) -> GenerationResult:
    """Decode up to `max_new_tokens` tokens from a prefilled state, evicting after every token (B = 1).

    The decode settings are a keydiff.Request's: `generate(model, Request(state, 64, ...))`, or the state and keywords
    that build one (max_new_tokens, eos_token_ids, do_sample, temperature, top_p, min_new_tokens, seed, evict,
    record_steps; given with a Request they replace its fields). evict=False keeps every generated token. A row stops at
    its first `eos_token_ids` id (after `min_new_tokens`); sampling uses a CPU generator seeded with `seed`.
    fixed_shapes, batch_invariant: as `Decoder`'s. decoder: a run's keydiff.Decoder (None: one of width 1). Returns a
    GenerationResult (`.token_ids` per row, `.finish_reasons`, `.seconds`, `.max_cache_entries`)."""
    check_settings("generate", settings, REQUEST_SETTINGS + DECODER_SETTINGS)
    if max_new_tokens is not None:
        settings["max_new_tokens"] = max_new_tokens
    if isinstance(state, Request):
        request = replace(state, **settings)
    elif "max_new_tokens" not in settings:
        raise TypeError("generate() needs max_new_tokens (or a keydiff.Request that has it)")
    else:
        request = Request(state, **settings)
    if request.state.decoded:
        raise RuntimeError("this PrefillResult was already decoded (its cache moved on); run prefill again")
    if decoder is None:
        decoder = Decoder(model, 1, fixed_shapes=fixed_shapes, batch_invariant=batch_invariant)
    else:
        decoder.check_options(fixed_shapes, batch_invariant)
    (_, out), = decoder.generate([request])
    return GenerationResult(out.token_ids, out.finish_reasons, out.seconds, out.max_cache_entries, out.step_entries)
