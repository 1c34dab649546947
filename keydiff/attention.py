"""Attention functions registered with transformers' `AttentionInterface` (keydiff_sdpa/_eager/_fa2).

They derive the bottom-right causal mask from each layer's own key length and compute the attention statistic a policy
needs beside the fused kernel ("fast") or from eager weights ("materialized"); `keydiff_attention(model, cache)`
switches the model to them. Design: docs/design/cache.md#the-attention-functions-keydiffattentionpy"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import lru_cache
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from keydiff.kernels import batch_invariant

BASE_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
# Registered names: transformers loads any "flash" name as a hub kernel, so ours avoid the word.
REGISTERED = {"sdpa": "keydiff_sdpa", "eager": "keydiff_eager", "flash_attention_2": "keydiff_fa2"}
STATISTIC_CHUNK_ELEMENTS = 1 << 26  # ~256 MB of float32 scores per chunk
MIN_FLASH_ATTN = (2, 1)  # bottom-right causal alignment for q_len != kv_len
STATISTIC_KWARG = "keydiff_statistic"  # the model call's keyword argument a fixed-shape step passes (StatisticBuffer)
# The evicting cache the attention functions serve, bound by `keydiff_attention(model, cache)`.
_BOUND_CACHE: ContextVar[Any] = ContextVar("keydiff_bound_cache", default=None)


def causal_mask(
    q_len: int, kv_len: int, device: torch.device, first_row: int = 0, stop_row: int | None = None
) -> torch.Tensor:
    """Bool [rows, kv_len] for query rows first_row..stop_row-1: row i sees key j iff j <= (kv_len - q_len) + i."""
    stop_row = q_len if stop_row is None else stop_row
    rows = torch.arange(first_row, stop_row, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


@dataclass(frozen=True)
class LogitRules:
    """What a layer adds to causal softmax attention: a sliding-window mask, a logit soft cap (Gemma 2), sinks (gpt-oss)."""

    visible: torch.Tensor | None = None  # bool [batch or 1, kv_heads or 1, q, kv]: which keys each query row sees
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads]: one logit per query head, in the softmax's denominator only

    @property
    def fusable(self) -> bool:
        """Whether SDPA / FlashAttention can compute it (a mask yes; a soft cap or sinks no)."""
        return self.softcap is None and self.sinks is None

    def for_head(self, head: int, groups: int) -> "LogitRules":
        """The rules of KV head `head`'s group of query heads (head-adaptive layers compute each head alone)."""
        if self.visible is not None:
            raise ValueError("head-adaptive layers do not combine with a sliding window")
        sinks = None if self.sinks is None else self.sinks[head * groups : (head + 1) * groups]
        return LogitRules(None, self.softcap, sinks)

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def softmax(self, logits: torch.Tensor, head_dim: int, trailing: int = 2) -> torch.Tensor:
        """float32 softmax over the last dim with the sinks (one per query head, at dims `head_dim`..-`trailing`) in the denominator."""
        logits = logits.float()
        if self.sinks is None:
            return torch.softmax(logits, dim=-1)
        shape = [1] * logits.dim()
        stop = logits.dim() - trailing
        shape[head_dim:stop] = logits.shape[head_dim:stop]
        sinks = self.sinks.float().reshape(shape).expand(*logits.shape[:-1], 1)
        return torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]


def rules_for(kwargs: dict[str, Any], query: torch.Tensor, key: torch.Tensor,
              key_positions: tuple[torch.Tensor, int] | None = None) -> LogitRules:
    """The `LogitRules` of a layer from the attention kwargs; key_positions: each key's position and the pass's end, for keys out of order."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    visible = None
    if window is not None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if key_positions is None and kv_len <= window:
            pass  # keys in order, all within the window (decoding against a full window): the causal mask is it
        elif key_positions is None:  # keys in order, the last of them this pass's: positions relative to the end
            keys = torch.arange(kv_len, device=query.device) - kv_len
            queries = torch.arange(q_len, device=query.device) - q_len
            visible = ((keys[None, :] <= queries[:, None]) & (queries[:, None] - keys[None, :] < window))[None, None]
        else:
            positions, end = key_positions
            queries = torch.arange(end - q_len, end, device=query.device)[:, None]
            keys = positions[:, :, None, :]  # [b, H_kv, 1, kv]
            visible = (keys <= queries) & (queries - keys < window)
    return LogitRules(visible, softcap, sinks)


def attention_statistic(
    query: torch.Tensor, key: torch.Tensor, scaling: float, rows: int | None, reduction: str = "sum",
    key_mask: torch.Tensor | None = None, rules: LogitRules = LogitRules(),
) -> torch.Tensor:
    """Attention received by each key from the last `rows` query rows (None: all), group-averaged: query [b, H, q, d],
    key [b, H_kv, kv, d] -> float32 [b, H_kv, kv]. reduction="max": KVzip's maximum. key_mask: the softmax's keys."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    first = 0 if rows is None else max(q_len - rows, 0)
    keys_t = key.transpose(-1, -2)  # [b, H_kv, d, kv]
    grouped = query.view(batch, kv_heads, groups, q_len, dim)
    chunk = max(1, STATISTIC_CHUNK_ELEMENTS // max(1, batch * heads * kv_len))
    total = None
    for start in range(first, q_len, chunk):
        stop = min(start + chunk, q_len)
        block = grouped[:, :, :, start:stop].reshape(batch, kv_heads, groups * (stop - start), dim)
        # Logits in the model's dtype, softmax in float32: the numerics of transformers' eager attention.
        logits = rules.cap(((block @ keys_t) * scaling).float())  # [b, H_kv, g*c, kv]
        logits = logits.view(batch, kv_heads, groups, stop - start, kv_len)
        if rules.visible is not None:
            logits = logits.masked_fill(~rules.visible[:, :, None, start:stop], float("-inf"))
        elif q_len > 1:  # a single query (decoding) sees every key: no mask to build
            visible = causal_mask(q_len, kv_len, query.device, start, stop)  # [c, kv]
            logits = logits.masked_fill(~visible, float("-inf"))
        if key_mask is not None:
            logits = logits.masked_fill(~key_mask[:, :, None, None, :], float("-inf"))
        weights = rules.softmax(logits, head_dim=1)
        if reduction == "max":
            received = weights.amax(dim=(2, 3))
            total = received if total is None else torch.maximum(total, received, out=total)
            continue
        received = weights.sum(dim=(2, 3))
        total = received if total is None else total.add_(received)
    return total if reduction == "max" else total.div_(groups)


def statistic_from_weights(
    weights: torch.Tensor, kv_heads: int, rows: int | None, reduction: str = "sum", key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The same statistic read from materialised weights [b, H, q, kv] (renormalised over `key_mask` if given)."""
    batch, heads, q_len, kv_len = weights.shape
    first = 0 if rows is None else max(q_len - rows, 0)
    if key_mask is not None:
        weights = weights.float() * key_mask.repeat_interleave(heads // kv_heads, dim=1)[:, :, None, :]
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if reduction == "max":
        largest = weights[:, :, first:, :].float().amax(dim=2)
        return largest.view(batch, kv_heads, heads // kv_heads, kv_len).amax(dim=2)
    summed = weights[:, :, first:, :].float().sum(dim=2)
    return summed.view(batch, kv_heads, heads // kv_heads, kv_len).mean(dim=2)


def eager_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
    rules: LogitRules = LogitRules(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention with materialised weights (float32 softmax cast back, like transformers' eager), with `rules`."""
    groups = query.shape[1] // key.shape[1]
    keys, values = repeat_kv(key, groups), repeat_kv(value, groups)
    weights = rules.cap(torch.matmul(query, keys.transpose(2, 3)) * scaling)
    q_len, kv_len = query.shape[2], key.shape[2]
    if rules.visible is not None:
        visible = rules.visible.repeat_interleave(groups, dim=1) if rules.visible.shape[1] > 1 else rules.visible
        weights = weights.masked_fill(~visible, torch.finfo(weights.dtype).min)
    elif q_len > 1:
        weights = weights.masked_fill(~causal_mask(q_len, kv_len, query.device), torch.finfo(weights.dtype).min)
    weights = (rules.softmax(weights, head_dim=1) if rules.sinks is not None
               else torch.softmax(weights, dim=-1, dtype=torch.float32)).to(query.dtype)
    output = torch.matmul(weights, values).transpose(1, 2).contiguous()
    return output, weights


def fused_attention(
    base: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
    rules: LogitRules = LogitRules(),
) -> torch.Tensor:
    """Attention output from SDPA or FlashAttention with the bottom-right causal mask (a soft cap or sinks go
    through the eager computation); under the batch-invariant mode, its fixed-order kernel."""
    if not torch.compiler.is_compiling() and batch_invariant.enabled(query.device):
        if rules.fusable and rules.visible is None:
            return batch_invariant.attention(query, key, value, scaling)
        return eager_attention(module, query, key, value, scaling, rules)[0]
    if not rules.fusable:
        return eager_attention(module, query, key, value, scaling, rules)[0]
    if rules.visible is not None:
        groups = query.shape[1] // key.shape[1]
        visible = rules.visible.repeat_interleave(groups, dim=1) if rules.visible.shape[1] > 1 else rules.visible
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling,
                                                enable_gqa=groups > 1)
        return output.transpose(1, 2).contiguous()
    q_len, kv_len = query.shape[2], key.shape[2]
    if base == "flash_attention_2":
        from flash_attn import flash_attn_func

        # flash-attn >= 2.1: bottom-right causal mask when q_len != kv_len, GQA as is; [batch, seq, heads, dim].
        return flash_attn_func(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling, causal=True
        )
    gqa = query.shape[1] != key.shape[1]
    if q_len == 1 or q_len == kv_len:
        # SDPA's is_causal (top-left) equals bottom-right when q_len == kv_len; one query sees every key.
        output = F.scaled_dot_product_attention(query, key, value, is_causal=q_len > 1, scale=scaling, enable_gqa=gqa)
    else:
        # Compiled, an explicit boolean mask (dynamo cannot build CausalBias); eager runs and CUDA graphs keep the bias.
        bias = (causal_mask(q_len, kv_len, query.device) if torch.compiler.is_compiling()
                else lower_right_bias(q_len, kv_len))
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling, enable_gqa=gqa)
    return output.transpose(1, 2).contiguous()


@lru_cache(maxsize=64)
def lower_right_bias(q_len: int, kv_len: int) -> torch.Tensor:
    """SDPA's bottom-right causal bias, one object per shape (nothing built inside a graph capture)."""
    return causal_lower_right(q_len, kv_len)


def segment_attention(
    base: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
    segments: list[list[tuple[int, int]]], rows: int | None, materialize: bool, rules: LogitRules = LogitRules(),
) -> tuple[torch.Tensor, list[list[torch.Tensor]] | None]:
    """Attention of a head-adaptive layer, every KV head over its own segment: query [batch, H, q, d], segment cells
    [batch, P, d]. Returns the output [batch, q, H, d] and, if rows != 0, the statistic per head."""
    kv_heads = len(segments[0])
    groups = query.shape[1] // kv_heads
    if query.shape[2] == 1:
        return decoding_segment_attention(query, key, value, scaling, segments, rows, rules)
    outputs, statistics = [], []
    for row, heads in enumerate(segments):
        parts, received = [], []
        for head, (start, count) in enumerate(heads):
            q_head = query[row : row + 1, head * groups : (head + 1) * groups]
            k_head = key[row, start : start + count][None, None]
            v_head = value[row, start : start + count][None, None]
            own = rules.for_head(head, groups)
            if materialize:
                out, weights = eager_attention(module, q_head, k_head, v_head, scaling, own)
            else:
                out = fused_attention(base, module, q_head, k_head, v_head, scaling, own)
            parts.append(out)
            if rows != 0:
                statistic = (statistic_from_weights(weights, 1, rows) if materialize
                             else attention_statistic(q_head, k_head, scaling, rows, rules=own))
                received.append(statistic[0, 0])
        outputs.append(torch.cat(parts, dim=2))
        statistics.append(received)
    return torch.cat(outputs, dim=0), statistics if rows != 0 else None


def decoding_segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
    segments: list[list[tuple[int, int]]], rows: int | None, rules: LogitRules = LogitRules(),
) -> tuple[torch.Tensor, list[list[torch.Tensor]] | None]:
    """`segment_attention` for one query: each KV head's group against its own segment in two small products, in
    float32 (as precise as SDPA in bf16), cheaper than an SDPA call per head."""
    batch, heads, _, dim = query.shape
    kv_heads = len(segments[0])
    groups = heads // kv_heads
    outputs, statistics = [], []
    for row, spans in enumerate(segments):
        parts, received = [], []
        for head, (start, count) in enumerate(spans):
            q_group = query[row, head * groups:(head + 1) * groups, 0].float()
            logits = q_group @ key[row, start:start + count].float().T  # [groups, n], float32
            own = rules.for_head(head, groups)
            weights = own.softmax(own.cap(logits * scaling), head_dim=0, trailing=1)
            parts.append((weights @ value[row, start:start + count].float()).to(value.dtype))  # [groups, d]
            if rows != 0:  # the statistic: the attention each entry received, group-averaged
                received.append(weights.mean(dim=0))
        outputs.append(torch.cat(parts))
        statistics.append(received)
    return torch.stack(outputs)[:, None], statistics if rows != 0 else None


class RowBatch:
    """What the attention functions ask of a cache over several sequences' caches (BatchCache): each sequence's
    part of a pass and the groups that attend as one. A base class so this module imports nothing from keydiff.decode."""

    def row_passes(self, layer_idx: int, key: torch.Tensor) -> list[tuple[Any, slice, torch.Tensor, torch.Tensor]] | None:
        """Each sequence's (cache, rows, keys, values) for this layer's pass if `key` is what `update` returned; else None."""
        raise NotImplementedError

    def row_groups(self, layer_idx: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """Groups of one-row sequences that attend as one: (row indices, their keys and values as one tensor each)."""
        raise NotImplementedError


def rowwise_attention(
    attend, module: torch.nn.Module, query: torch.Tensor, passes: list[tuple[Any, slice, torch.Tensor, torch.Tensor]],
    scaling: float, kwargs: dict[str, Any], groups: list[tuple[list[int], torch.Tensor, torch.Tensor]] = (),
    base: str = "sdpa",
) -> torch.Tensor:
    """Attention of a batch whose sequences have caches of their own: each sequence's queries against its own cache's
    keys and values, never padded; `groups` attend in one call each. Output [rows, q, H, d]."""
    rows = query.shape[0]
    outputs: list[torch.Tensor | None] = [None] * rows
    for members, key, value in groups:
        if len(members) == rows and members == list(range(rows)):
            return grouped_attention(base, module, query, key, value, scaling, kwargs)
        index = torch.tensor(members, device=query.device)
        out = grouped_attention(base, module, query.index_select(0, index), key, value, scaling, kwargs)
        for j, row in enumerate(members):
            outputs[row] = out[j : j + 1]
    parts = []
    for cache, span, key, value in passes:
        if outputs[span.start] is None:
            with bound_to(cache):
                parts.append(attend(module, query[span], key, value, scaling, cache.for_layer(module.layer_idx, key),
                                    kwargs))
        else:
            parts.extend(outputs[span])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def grouped_attention(
    base: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Attention that records nothing, keys in order: a pass on no bound cache, or rows of several sequences in one
    call: query [rows, H, q, d] against key/value [rows, kv_heads, n, d], each row its own n entries."""
    rules = rules_for(kwargs, query, key)
    if base == "eager":
        return eager_attention(module, query, key, value, scaling, rules)[0]
    return fused_attention(base, module, query, key, value, scaling, rules)


class StatisticSink:
    """Where a layer's pass leaves what its cache's policy scores from: the attention statistic (`write`) and the other
    model signals the binding lists (`record`). A statistics-only sink (`StatisticBuffer`) keeps these defaults."""

    def write(self, layer_idx: int, statistic: torch.Tensor) -> None:
        """Keep layer `layer_idx`'s attention statistic [batch, kv_heads, keys] of this pass."""
        raise NotImplementedError

    def record(self, layer_idx: int, signals: tuple, module: torch.nn.Module, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, output: torch.Tensor) -> None:
        """Hand a layer's pass to the producers of `signals` (keydiff.signals.LayerPass) and keep what they make."""
        raise NotImplementedError(f"{type(self).__name__} takes no model signals")

    def key_mask(self, layer_idx: int, keys: int) -> torch.Tensor | None:
        """Bool [batch, kv_heads, keys]: the keys the statistic's softmax covers (KVzip's scratch pass); None: all."""
        return None

    def timed(self, name: str) -> Any:
        """A context manager timing the statistic (a profiled cache adds it to its timings); here: nothing."""
        return nullcontext()


class LayerBinding:
    """What the attention function needs for one layer's pass, asked of the cache once (`EvictingCache.for_layer`): the
    query rows and reduction, eager or not, sliding-window positions, head-adaptive segments, the signals to record."""

    __slots__ = ("sink", "rows", "reduction", "materialize", "key_positions", "segments", "signals")

    def __init__(self, sink: StatisticSink, rows: int | None, reduction: str, materialize: bool = False,
                 key_positions: tuple[torch.Tensor, int] | None = None, segments: list | None = None,
                 signals: tuple = ()):
        self.sink, self.rows, self.reduction, self.materialize = sink, rows, reduction, materialize
        self.key_positions, self.segments, self.signals = key_positions, segments, signals


@dataclass(frozen=True, eq=False)
class StatisticBuffer(StatisticSink):
    """Where a step that binds no cache (the fixed-shape step) wants every layer's statistic, passed as the keyword
    argument `STATISTIC_KWARG`. buffer: float32 [planes, W, kv_heads, keys] (slot_major: [W, planes, ...]);
    rows, reduction: as `attention_statistic`. `binding` is every layer's (made once: the step is compiled)."""

    buffer: torch.Tensor
    planes: tuple[int, ...]
    slot_major: bool
    rows: int | None
    reduction: str
    written: set[int] = field(default_factory=set)  # the layers that wrote, in eager calls (the step's first check)
    binding: LayerBinding = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "binding", LayerBinding(self, self.rows, self.reduction))

    def write(self, layer_idx: int, statistic: torch.Tensor) -> None:
        """Copy one layer's statistic [W, kv_heads, keys] into its plane (views made here, from the one buffer)."""
        plane = self.planes.index(layer_idx)
        (self.buffer[:, plane] if self.slot_major else self.buffer[plane]).copy_(statistic)
        if not torch.compiler.is_compiling():
            self.written.add(layer_idx)


@contextmanager
def bound_to(cache: Any) -> Iterator[None]:
    """Bind `cache` for the attention functions for the duration, without switching the model's implementation."""
    token = _BOUND_CACHE.set(cache)
    try:
        yield
    finally:
        _BOUND_CACHE.reset(token)


def check_supported(who: str, module: torch.nn.Module, kwargs: dict[str, Any],
                    names: tuple[str, ...] = ("sliding_window", "softcap", "s_aux")) -> None:
    """Refuse attention features this module's kernels do not implement, rather than silently ignore them."""
    unsupported = [name for name in names if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(f"{who} does not implement {', '.join(unsupported)} (layer {module.layer_idx})")


def make_attention_function(base: str):
    """The attention function registered for `base` (see REGISTERED)."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        target = kwargs.get(STATISTIC_KWARG)
        if target is not None:  # a fixed-shape step of a policy that scores from attention (StatisticBuffer)
            return attend(module, query, key, value, scaling, target.binding, kwargs), None
        # A compiled forward binds nothing (dynamo cannot read a context variable) and runs the plain fused kernel.
        bound = None if torch.compiler.is_compiling() else _BOUND_CACHE.get()
        passes = bound.row_passes(module.layer_idx, key) if isinstance(bound, RowBatch) else None
        if passes is not None:  # a batch of sequences with caches of their own (keydiff.decode)
            groups = bound.row_groups(module.layer_idx)
            return rowwise_attention(attend, module, query, passes, scaling, kwargs, groups, base), None
        binding = None if bound is None else bound.for_layer(module.layer_idx, key)
        return attend(module, query, key, value, scaling, binding, kwargs), None

    def attend(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
        binding: LayerBinding | None, kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """One layer's attention; with a binding (None: the model runs with some other cache), what it records."""
        if binding is None:
            return grouped_attention(base, module, query, key, value, scaling, kwargs)
        layer_idx, sink = module.layer_idx, binding.sink
        positions = binding.key_positions if kwargs.get("sliding_window") is not None else None
        rules = rules_for(kwargs, query, key, positions)
        rows = binding.rows
        materialize = base == "eager" or (rows != 0 and binding.materialize)
        if binding.segments is not None:
            output, statistic = segment_attention(base, module, query, key, value, scaling, binding.segments, rows,
                                                  materialize, rules)
            if binding.signals:
                sink.record(layer_idx, binding.signals, module, query, key, value, output)
            if rows != 0:
                sink.write(layer_idx, statistic)
            return output
        if materialize:
            output, weights = eager_attention(module, query, key, value, scaling, rules)
        else:
            output = fused_attention(base, module, query, key, value, scaling, rules)
        if binding.signals:
            sink.record(layer_idx, binding.signals, module, query, key, value, output)
        if rows != 0:
            with sink.timed("statistics_s"):
                key_mask = sink.key_mask(layer_idx, key.shape[2])
                if materialize:
                    statistic = statistic_from_weights(weights, key.shape[1], rows, binding.reduction, key_mask)
                else:
                    statistic = attention_statistic(query, key, scaling, rows, binding.reduction, key_mask, rules)
            sink.write(layer_idx, statistic)
        return output

    attention.__name__ = f"{REGISTERED[base]}_attention"
    return attention


for _base, _name in REGISTERED.items():
    AttentionInterface.register(_name, make_attention_function(_base))


def bound_cache() -> Any:
    """The cache `keydiff_attention` bound for the current context (None outside it)."""
    return _BOUND_CACHE.get()


def base_implementation(model: torch.nn.Module) -> str:
    """The model's own attention implementation (sdpa, eager or flash_attention_2)."""
    name = model.config._attn_implementation or "sdpa"
    name = {registered: base for base, registered in REGISTERED.items()}.get(name, name)
    if name not in BASE_IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {name!r} is not supported; valid: {', '.join(BASE_IMPLEMENTATIONS)}")
    return name


def check_flash_attn_version(version: str) -> None:
    """flash-attn < 2.1 aligns the causal mask top-left when q_len != kv_len: silently wrong here, so refuse."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_FLASH_ATTN:
        raise RuntimeError(
            f"flash-attn {version} is too old: keydiff-bench needs flash-attn >= 2.1 (bottom-right causal masks "
            "for blocks attending to a kept cache); pip install -U flash-attn, or use attn_implementation=sdpa"
        )


@contextmanager
def keydiff_attention(model: torch.nn.Module, cache: Any = None) -> Iterator[None]:
    """Run the model with its keydiff attention function (and `cache` bound for statistics), then restore it.

        with keydiff.keydiff_attention(model, cache):
            out = model(input_ids=next_ids, cache=cache, use_cache=True)"""
    base = base_implementation(model)
    if base == "flash_attention_2":
        import flash_attn

        check_flash_attn_version(getattr(flash_attn, "__version__", "0"))
    original = model.config._attn_implementation
    target = REGISTERED[base]
    token = _BOUND_CACHE.set(cache)
    switched = original != target
    if switched:
        model.set_attn_implementation(target)
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation(original)
        _BOUND_CACHE.reset(token)
