"""Key re-rotation (as kvpress's `KeyRerotationPress`, after transformers' former SinkCache and FINCH): after every
eviction, the kept keys of each KV head are re-rotated so that they sit at the contiguous positions 0..n-1, in
the order of their original positions. Any policy chooses the entries; `Rerotated(policy)` only asks the cache
to re-rotate (`key_rerotation`), since the cache owns the tensors (keydiff.cache.storage.Storage.rerotate).

What changes, exactly (kvpress's pipeline, done at every eviction of block-wise prefill and decoding):
* Keys are cached after RoPE. A key rotated for position p is moved to position p' by the rotation of p' - p
  (RoPE's rotations compose; the model's attention_scaling was applied once and is left alone). The angle
  uses the model's inv_freq as transformers computes it (`keydiff.queries.rope_frequencies`: rope scaling
  types llama3, yarn, linear...; dynamic RoPE and partial rotary dims are refused).
* Each entry's current RoPE position is per-entry state ("rotary_position", float32: exact below 2**24
  tokens); `positions` keep the ABSOLUTE token positions, so recency, sinks, chunks, kept_positions and
  every result file mean what they meant without re-rotation.
* New tokens keep their absolute positions (transformers derives them from `get_seq_length()`, the tokens
  seen), exactly as kvpress's pipeline feeds the question and the answer at context_length + i after the
  compressed context. So after an eviction a query at absolute position t sees the kept keys at 0..n-1 and
  the tokens of its own pass at their true positions: distances t - rank, no longer t - p. The next eviction
  re-rotates the survivors (old and new) to 0..n-1 again.
Values are not touched (RoPE rotates only queries and keys).

When it matters: only once something has been evicted, and the more, the more: with a long prompt and a small
budget the kept keys, spread over positions up to L, collapse into 0..N-1, so keys from far beyond the
positions the model was trained on carry the rotations of a short sequence, and old and new keys look equally
far from the query. Results then differ from the default (keys at their true positions), for better (models
that degrade past their training length) or for worse (the relative order in time is kept but distances are
not); with N close to L, or before the first eviction, the two coincide. In bfloat16 every re-rotation rounds
the key once more; during decoding (an eviction per token) keys behind an evicted one move by one position per
step, so a key is rounded up to once per generated token (kvpress compresses once, so rounds once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keydiff.policies.base import LayerView
from keydiff.policies.wrappers import PolicyWrapper

STATE = "rotary_position"  # the position each cached key is currently rotated for
MODES = ("kvpress",)


def rerotation_mode(value) -> str | None:
    """The flat parameter `key_rerotation` as a mode: False/None: off; True or "kvpress": kvpress's form."""
    if value is None or value is False:
        return None
    if value is True:
        return "kvpress"
    if value in MODES:
        return value
    raise ValueError(f"key_rerotation must be true, false or one of {', '.join(MODES)}, got {value!r}")


@dataclass
class Rerotated(PolicyWrapper):
    """The wrapped policy, with the kept keys re-rotated to positions 0..n-1 after every eviction (see the module)."""

    mode: str = "kvpress"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check()

    def _check(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"key_rerotation must be true, false or one of {', '.join(MODES)}, got {self.mode!r}")

    def validate(self, budget: int) -> None:
        self._check()
        self.scorer.validate(budget)

    def check(self, budget: int) -> None:
        self._check()
        self.scorer.check(budget)

    @property
    def key_rerotation(self) -> str | None:
        return self.mode

    @property
    def state_names(self) -> tuple[str, ...]:
        return (*self.scorer.state_names, STATE)

    def entry_state(self, entries: LayerView) -> dict[str, torch.Tensor]:
        """New entries are rotated at their absolute positions (transformers' position_ids)."""
        return {**self.scorer.entry_state(entries), STATE: entries.positions.float()}

    def describe(self) -> dict:
        described = self.scorer.describe()
        schedule = described.pop("layer_budgets", None)
        return {**described, "key_rerotation": True if self.mode == "kvpress" else self.mode, "layer_budgets": schedule}


__all__ = ["MODES", "Rerotated", "STATE", "rerotation_mode"]
