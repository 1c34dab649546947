"""What the analyses look at: per-layer keys, queries and attention of a prompt (`capture_prompt`, without eviction,
attention reduced on the fly under the "keydiff_capture" attention function), and what an eviction run kept
(`trace_eviction`). Batch size 1 only; tensors are returned as float32 on the CPU."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from keydiff.attention import attention_statistic, causal_mask, check_supported
from keydiff.engine import check_model_supported, prefill
from keydiff.policies import Policy, build_policy, layer_by_layer

CAPTURE_IMPLEMENTATION = "keydiff_capture"
_RECORDER: ContextVar["_Recorder | None"] = ContextVar("keydiff_capture_recorder", default=None)


@dataclass
class LayerCapture:
    """One layer of one prompt. H query heads, H_kv KV heads (query head h uses KV head h // (H / H_kv))."""

    keys: torch.Tensor  # [H_kv, L, d] post-RoPE, as cached
    queries: torch.Tensor  # [H, L, d] post-RoPE, as attention uses them
    received_sum: torch.Tensor  # [H, L] attention each key receives, summed over every query row
    last_row: torch.Tensor  # [H, L] attention of the last query row (TOVA's statistic, per query head)
    window_weights: torch.Tensor  # [H, w, w] attention weights among the first w tokens (Figure 2)

    @property
    def group(self) -> int:
        return self.queries.shape[0] // self.keys.shape[0]

    @property
    def received_mean(self) -> torch.Tensor:
        """[H, L] attention each key receives averaged over the L - j query rows that see it (removes the causal bias)."""
        length = self.received_sum.shape[-1]
        visible = torch.arange(length, 0, -1, dtype=torch.float32)
        return self.received_sum / visible


@dataclass
class _Recorder:
    window: int
    layers: set[int] | None
    captures: dict[int, LayerCapture] = field(default_factory=dict)


def _capture_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA output (causal, whole prompt) plus, when a recorder is bound, this layer's keys/queries/attention."""
    check_supported("capture", module, kwargs)
    if query.shape[2] != key.shape[2]:
        raise ValueError("capture runs a whole prompt in one pass, without a cache (query and key lengths differ)")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    gqa = query.shape[1] != key.shape[1]
    output = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                            enable_gqa=gqa)
    recorder = _RECORDER.get()
    layer = module.layer_idx
    if recorder is not None and (recorder.layers is None or layer in recorder.layers):
        q, k = query[0:1].float(), key[0:1].float()
        per_head_keys = repeat_kv(k, q.shape[1] // k.shape[1])  # each query head its own "group" of one
        window = min(recorder.window, q.shape[2])
        logits = (q[:, :, :window] @ per_head_keys[:, :, :window].transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~causal_mask(window, window, q.device), float("-inf"))
        recorder.captures[layer] = LayerCapture(
            keys=k[0].cpu(),
            queries=q[0].cpu(),
            received_sum=attention_statistic(q, per_head_keys, scaling, None)[0].cpu(),
            last_row=attention_statistic(q, per_head_keys, scaling, 1)[0].cpu(),
            window_weights=torch.softmax(logits, dim=-1)[0].cpu(),
        )
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_attention)


@contextmanager
def _capturing(model: torch.nn.Module, recorder: _Recorder) -> Iterator[None]:
    original = model.config._attn_implementation
    token = _RECORDER.set(recorder)
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
        _RECORDER.reset(token)


@torch.inference_mode()
def capture_prompt(
    model: torch.nn.Module, input_ids: torch.Tensor, window: int = 64, layers: list[int] | None = None
) -> list[LayerCapture | None]:
    """Keys, queries and attention statistics of every layer (or of `layers`; None for others) for one prompt [1, L] or [L]."""
    check_model_supported(model)
    input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if input_ids.shape[0] != 1:
        raise ValueError(f"capture takes one prompt (batch 1), got batch {input_ids.shape[0]}")
    num_layers = model.config.get_text_config().num_hidden_layers
    bad = [layer for layer in layers or [] if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has layers 0..{num_layers - 1}")
    recorder = _Recorder(window=window, layers=None if layers is None else set(layers))
    device = next(model.parameters()).device
    with _capturing(model, recorder):
        model(input_ids=input_ids.to(device), use_cache=False, logits_to_keep=1)
    return [recorder.captures.get(layer) for layer in range(num_layers)]




@dataclass
class LayerTrace:
    """One layer after a block-wise prefill under a policy: what it kept and what it dropped, per KV head."""

    retained_keys: torch.Tensor  # [H_kv, N, d] ordered by position
    retained_positions: torch.Tensor  # [H_kv, N] ascending
    evicted_keys: torch.Tensor  # [H_kv, E, d] in eviction order (E = L - N)
    evicted_positions: torch.Tensor  # [H_kv, E]


def recording_policy(policy: Policy, layers: set[int] | None = None) -> Policy:
    """The same policy that also records, per layer, the keys [H_kv, e, d] and positions [H_kv, e] it drops (batch
    row 0) into `recorded`; it evicts layer by layer (`needs.rows_alike` False)."""
    cls = type(layer_by_layer(policy))

    def evict_indices(self, layer, budget):
        indices = cls.evict_indices(self, layer, budget)
        if self.record_layers is None or layer.layer_idx in self.record_layers:
            keys = layer.keys[0].gather(1, indices[0][..., None].expand(-1, -1, layer.keys.shape[-1]))
            positions = layer.positions[0].gather(1, indices[0])
            self.recorded.setdefault(layer.layer_idx, []).append((keys.float().cpu(), positions.cpu()))
        return indices

    recording_cls = type(f"Recording{cls.__name__}", (cls,), {"evict_indices": evict_indices, "__module__": __name__})
    params = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}
    recorder = recording_cls(**params)
    recorder.recorded = {}
    recorder.record_layers = layers
    return recorder


def trace_eviction(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policy: Policy | str,
    budget: int,
    block_size: int | None = 128,
    layers: list[int] | None = None,
    attention_statistics: str = "fast",
) -> list[LayerTrace | None]:
    """Block-wise prefill of one prompt under `policy` at `budget`; per layer (None if not asked) what was retained and evicted."""
    policy = build_policy(policy) if isinstance(policy, str) else policy
    input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if input_ids.shape[0] != 1:
        raise ValueError(f"trace_eviction takes one prompt (batch 1), got batch {input_ids.shape[0]}")
    recorder = recording_policy(policy, None if layers is None else set(layers))
    state = prefill(model, input_ids, recorder, budget, block_size, attention_statistics=attention_statistics)
    traces: list[LayerTrace | None] = []
    for layer_idx, layer in enumerate(state.cache.layers):
        if layers is not None and layer_idx not in layers:
            traces.append(None)
            continue
        n = layer.num_entries
        positions, order = layer.positions[0, :, :n].sort(dim=-1)
        keys = layer.keys[0, :, :n].gather(1, order[..., None].expand(-1, -1, layer.keys.shape[-1]))
        parts = recorder.recorded.get(layer_idx, [])
        dim = keys.shape[-1]
        evicted_keys = torch.cat([k for k, _ in parts], dim=1) if parts else keys.new_zeros(keys.shape[0], 0, dim)
        evicted_positions = (torch.cat([p for _, p in parts], dim=1) if parts
                             else positions.new_zeros(positions.shape[0], 0))
        traces.append(LayerTrace(keys.float().cpu(), positions.cpu(), evicted_keys.float().cpu(), evicted_positions))
    return traces
