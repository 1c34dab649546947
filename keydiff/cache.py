"""A transformers Cache whose layers shrink to a fixed token budget (paper Eq. 6).

`EvictingCache` is an ordinary `transformers.Cache` made of `EvictingLayer`s, so any model that takes
`past_key_values` can use it unchanged. Each layer stores, next to its keys and values, the absolute
position of every entry and any per-entry state a policy keeps. After every forward pass the engine
calls `EvictingCache.evict()`, which lets the policy observe the pass and shrinks every layer that
holds more than `budget` entries per KV head back to `budget`. Between two evictions a layer gains at
most one block, so it never holds more than budget + block entries; `max_entries` records the peak.

Each KV head keeps its own entries (indices are gathered per head), and since every head keeps exactly
`budget` entries the tensors stay rectangular: no padding, no masked dummy slots, real memory saved.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from keydiff.policies.base import LayerView, Policy

STATISTICS_MODES = ("fast", "materialized")


class EvictingLayer(DynamicLayer):
    """A DynamicLayer that also tracks entry positions and per-entry policy state, and can keep a subset."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None  # [batch, kv_heads, n] long
        self.state: dict[str, torch.Tensor] = {}
        self.attention: torch.Tensor | None = None  # statistic recorded by the attention function
        self.max_entries = 0  # peak entries per head ever held

    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenate a block's keys/values and their absolute positions [batch, q] to the layer."""
        keys, values = super().update(key_states, value_states)
        batch, heads, q = key_states.shape[:3]
        new_positions = positions.to(keys.device)[:, None, :].expand(batch, heads, q)
        self.positions = new_positions if self.positions is None else torch.cat([self.positions, new_positions], -1)
        for name, tensor in self.state.items():
            self.state[name] = torch.cat([tensor, tensor.new_zeros(batch, heads, q)], dim=-1)
        self.max_entries = max(self.max_entries, keys.shape[-2])
        return keys, values

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the entries at `indices` [batch, kv_heads, k] (per head, ascending)."""
        gather = indices[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather)
        self.values = self.values.gather(2, gather)
        self.positions = self.positions.gather(2, indices)
        self.state = {name: tensor.gather(2, indices) for name, tensor in self.state.items()}

    def view(self, layer_idx: int) -> LayerView:
        return LayerView(
            keys=self.keys,
            values=self.values,
            positions=self.positions,
            attention=self.attention,
            state=self.state,
            layer_idx=layer_idx,
        )

    def reset(self) -> None:
        super().reset()
        self.positions, self.state, self.attention, self.max_entries = None, {}, None, 0

    # transformers' generate() / beam search would call these; they would leave positions and policy state
    # out of step with the keys, so refuse rather than corrupt the cache.
    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("EvictingLayer cannot be cropped; use keydiff.generate")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("EvictingLayer does not support beam search; use keydiff.generate")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("EvictingLayer does not support batch expansion; use keydiff.generate")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("EvictingLayer does not support batch selection; use keydiff.generate")


class EvictingCache(Cache):
    """KV cache bounded to `budget` entries per layer and KV head after every `evict()` call.

    budget=None means no bound (the `full` policy). `statistics` chooses how attention-based policies get
    their attention: "fast" computes only the rows they need next to the fused attention kernel,
    "materialized" runs eager attention and reads its weights (the paper's latency setting).
    """

    def __init__(
        self,
        policy: Policy,
        budget: int | None,
        num_layers: int,
        statistics: str = "fast",
        profile: bool = False,
    ):
        if statistics not in STATISTICS_MODES:
            raise ValueError(f"unknown attention statistics mode {statistics!r}; valid: {', '.join(STATISTICS_MODES)}")
        super().__init__(layers=[EvictingLayer() for _ in range(num_layers)])
        self.policy = policy
        self.budget = budget if policy.evicts else None
        self.statistics = statistics
        self.profile = profile
        self.timings = {"statistics_s": 0.0, "eviction_s": 0.0}
        self._incoming_positions: torch.Tensor | None = None
        self.evicting = True  # False while decoding without eviction (decode_eviction=false)

    # --- the transformers Cache interface -------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._incoming_positions is None:
            raise RuntimeError("EvictingCache.set_positions() must be called before each forward pass")
        return self.layers[layer_idx].append(key_states, value_states, self._incoming_positions)

    # --- what the engine and the attention function use ------------------------------------------
    def set_positions(self, positions: torch.Tensor) -> None:
        """Absolute positions [batch, q] of the tokens of the next forward pass (its position_ids)."""
        self._incoming_positions = positions

    def attention_rows_needed(self, layer_idx: int) -> int | None:
        """How many last query rows of this pass the policy needs attention for: 0 = none, None = all."""
        rows = self.policy.attention_rows
        if rows == 0 or self.budget is None or not self.evicting or not self.policy.compresses_layer(layer_idx):
            return 0
        if not self.policy.observes_every_step and self.layers[layer_idx].get_seq_length() <= self.budget:
            return 0  # nothing will be evicted after this pass, so the statistic would be wasted
        return rows

    def record_attention(self, layer_idx: int, statistic: torch.Tensor) -> None:
        self.layers[layer_idx].attention = statistic

    def evict(self) -> None:
        """Let the policy observe the pass just run, then shrink every over-budget layer to `budget`."""
        if self.budget is None:
            return
        start = self._clock()
        for layer_idx, layer in enumerate(self.layers):
            if not layer.is_initialized or not self.policy.compresses_layer(layer_idx):
                continue
            view = layer.view(layer_idx)
            if self.policy.attention_rows != 0 and view.attention is not None:
                self.policy.observe(view)
            if layer.get_seq_length() > self.budget:
                if self.policy.attention_rows != 0 and view.attention is None:
                    raise RuntimeError(
                        f"policy {self.policy.name!r} needs attention statistics but none were recorded in layer "
                        f"{layer_idx}: the model must run with a keydiff_* attention implementation"
                    )
                layer.keep(self.policy.keep_indices(view, self.budget))
            layer.attention = None
        self.timings["eviction_s"] += self._clock() - start

    def kept_positions(self) -> list[torch.Tensor]:
        """Absolute positions kept, one LongTensor [batch, kv_heads, kept] per layer."""
        return [layer.positions for layer in self.layers]

    @property
    def entries_peak_sum(self) -> int:
        """Sum over layers of each layer's peak entries per KV head (an upper bound of what was held at once)."""
        return sum(layer.max_entries for layer in self.layers)

    @property
    def max_entries(self) -> int:
        """Peak number of entries any layer held for one KV head."""
        return max((layer.max_entries for layer in self.layers), default=0)

    def _clock(self) -> float:
        """Wall time; synchronises the GPU first when profiling so the time is the kernels' time."""
        if self.profile and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()
