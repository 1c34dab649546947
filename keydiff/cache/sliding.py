"""Sliding-window layers of hybrid models (Gemma 2/3, gpt-oss, Mistral v0.1): bounded by their window, never evicted.
Design: docs/design/cache.md#sliding-window-layers-slidingpy"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, get_layer_types_and_kwargs

# Layer kinds an evicting cache can serve: full attention (evicted) and sliding windows (bounded by the window).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(config: Any, num_layers: int | None = None) -> list[int | None]:
    """Each layer's sliding window (None: full attention) from a model config; with none, `num_layers` full layers."""
    if config is None:
        return [None] * (num_layers or 0)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds, kwargs = get_layer_types_and_kwargs(config)
    other = sorted({kind for kind in kinds if kind not in SUPPORTED_LAYER_TYPES})
    if other:
        raise ValueError(f"the model has {', '.join(other)} layers; keydiff-bench serves "
                         f"{' and '.join(SUPPORTED_LAYER_TYPES)} layers only")
    windows = [extra.get("sliding_window") if kind == "sliding_attention" else None
               for kind, extra in zip(kinds, kwargs)]
    if num_layers is not None and len(windows) != num_layers:
        raise ValueError(f"the config declares {len(windows)} layers, the cache was built for {num_layers}")
    return windows


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' dynamic sliding-window layer, with the per-layer figures an `EvictingCache` reports."""

    evicts = False  # never handed to the policy

    def __init__(self, window: int, layer_idx: int):
        super().__init__(sliding_window=window)
        self.layer_idx = layer_idx
        self.window = window
        self.max_entries = 0  # peak entries per KV head, a pass's own included (window - 1 + q)
        self.allocations = 0  # one concatenation per pass
        self.returned_keys: torch.Tensor | None = None  # what the last `update` returned (see EvictingLayer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.max_entries = max(self.max_entries, keys.shape[-2])
        self.allocations += 1
        self.returned_keys = keys
        return keys, values

    @property
    def budget(self) -> int:
        """Entries held between passes at most: the window less the next token's own."""
        return self.window - 1

    @property
    def seen(self) -> int:
        """Tokens this layer has been given: the absolute position of the next one."""
        return self.cumulative_length

    @property
    def num_entries(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    @property
    def max_total_entries(self) -> int:
        return self.keys.shape[1] * self.max_entries if self.is_initialized else 0

    def entries_after_eviction(self) -> int:
        return self.num_entries

    def kept_positions(self) -> torch.Tensor:
        """Absolute positions held, [batch, kv_heads, entries], ascending: the last `num_entries` tokens."""
        if not self.is_initialized:
            return torch.empty(0, 0, 0, dtype=torch.long)
        batch, heads, n = self.keys.shape[:3]
        positions = torch.arange(self.seen - n, self.seen, device=self.keys.device)
        return positions.expand(batch, heads, n).clone()

    def snapshot(self) -> tuple:
        """What a scratch pass must leave as it was (its update replaces these, it does not write into them)."""
        return self.keys, self.values, self.cumulative_length, self.returned_keys

    def restore(self, saved: tuple) -> None:
        self.keys, self.values, self.cumulative_length, self.returned_keys = saved

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("an evicting cache does not support beam search; use keydiff.generate")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("an evicting cache cannot be expanded (num_return_sequences); use keydiff.generate")
