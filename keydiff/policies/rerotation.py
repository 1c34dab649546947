"""Key re-rotation (as kvpress's `KeyRerotationPress`, after transformers' former SinkCache and FINCH): after every
eviction, the kept keys of each KV head are re-rotated so that they sit at contiguous positions, in the order
of their original positions. Any policy chooses the entries; `Rerotated(policy, mode)` only asks the cache to
re-rotate (`key_rerotation`), since the cache owns the tensors (keydiff.cache.storage.Storage.rerotate).
Flat parameter `key_rerotation`: false (default), true or "kvpress", or "contiguous".

What changes, exactly (both modes, at every eviction of block-wise prefill and of decoding):
* Keys are cached after RoPE. A key rotated for position p is moved to position p' by the rotation of p' - p
  (RoPE's rotations compose; the model's attention_scaling was applied once and is left alone). The angle
  uses the model's inv_freq as transformers computes it (`keydiff.queries.rope_frequencies`: rope scaling
  types llama3, yarn, linear...; dynamic RoPE and partial rotary dims are refused), in float64.
* Each entry's current RoPE position is per-entry state ("rotary_position", float32: exact below 2**24),
  written by the cache with the entry and updated at each re-rotation. `positions` keep the ABSOLUTE token
  positions, so recency, sinks, chunks, kept_positions and every result file mean what they meant before.
* Values are not touched (RoPE rotates only queries and keys).

Where the keys go, and where the next tokens go:
* "kvpress" (`key_rerotation: true`): kept keys at 0..n-1; new tokens keep their ABSOLUTE positions
  (transformers derives them from `get_seq_length()`, the tokens seen), as kvpress's pipeline feeds the
  question and the answer at context_length + i after the re-rotated context. A query at absolute position t
  then sees the kept keys at distances t - rank (no longer t - p) and its own pass at the true distances; the
  next eviction re-rotates the survivors (old and new) to 0..n-1 again. Distances stay as large as the
  prompt is long: the keys look older than they are.
* "contiguous" (StreamingLLM's "positions within the cache", and transformers' former SinkCache): the next
  tokens FOLLOW the kept keys. The next token's position P is the most entries any layer holds after
  eviction (N with uniform budgets, the largest N_l with a schedule; the tokens seen while some layer is
  not yet full or never evicts); each layer's n kept keys sit at P-n..P-1 (right-aligned, so the newest
  kept key is next to the query), and a pass of q tokens is rotated for P..P+q-1. The cache reports P as
  `get_seq_length()` (and sizes transformers' masks from it), so every position stays below max N_l + B
  whatever the prompt's length. `get_seq_length()` then no longer counts the tokens seen: continue with
  keydiff.generate (or a loop that passes no position_ids), not transformers' generate with a prefilled
  cache, which slices the prompt by it. Query statistics (Expected Attention) use the same positions.

When it matters: only once something has been evicted (before that every key already sits at its rank;
nothing changes at all), and the more, the more: with a long prompt and a small budget the kept keys, spread
over positions up to L, collapse into a range of N positions. Under "contiguous" the queries move with them,
so positions far beyond what the model was trained on collapse into a short range (the point for prompts
longer than the training length); under "kvpress" only the keys move. Results differ from the default (keys
at their true positions), for better or worse: order in time is kept, distances are not. In bfloat16 every
re-rotation rounds the key once more; during decoding (an eviction per token) keys behind an evicted one move
by one position per step, so a key can be rounded once per generated token (kvpress compresses once).
"""

from __future__ import annotations

from dataclasses import dataclass

from keydiff.policies.wrappers import PolicyWrapper

STATE = "rotary_position"  # the position each cached key is currently rotated for
MODES = ("kvpress", "contiguous")


def rerotation_mode(value) -> str | None:
    """The flat parameter `key_rerotation` as a mode: False/None: off; True or "kvpress": kvpress's form;
    "contiguous": the next tokens follow the kept keys."""
    if value is None or value is False:
        return None
    if value is True:
        return "kvpress"
    if value in MODES:
        return value
    raise ValueError(f"key_rerotation must be true, false or one of {', '.join(MODES)}, got {value!r}")


@dataclass
class Rerotated(PolicyWrapper):
    """The wrapped policy, with the kept keys re-rotated to contiguous positions after every eviction (see the module)."""

    mode: str = "kvpress"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_parameters()

    def check_parameters(self, budget: int | None = None) -> None:
        if self.mode not in MODES:
            raise ValueError(f"key_rerotation must be true, false or one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def key_rerotation(self) -> str | None:
        return self.mode

    @property
    def state_names(self) -> tuple[str, ...]:
        return (*self.scorer.state_names, STATE)

    def describe(self) -> dict:
        described = self.scorer.describe()
        schedule = described.pop("layer_budgets", None)
        return {**described, "key_rerotation": True if self.mode == "kvpress" else self.mode, "layer_budgets": schedule}


__all__ = ["MODES", "Rerotated", "STATE", "rerotation_mode"]
