"""Key re-rotation (as kvpress's `KeyRerotationPress`, after transformers' former SinkCache and FINCH): after every
eviction, the kept keys of each KV head are re-rotated so that they sit at contiguous positions, in the order
of their original positions. Any policy chooses the entries; `Rerotated(policy, mode)` only asks the cache to
re-rotate (`key_rerotation`), since the cache owns the tensors (keydiff.cache.storage.Storage.rerotate).
Flat parameter `key_rerotation`: false (default), true or "contiguous" (kvpress's pipeline), or "absolute".

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
* "contiguous" (`key_rerotation: true`; kvpress's pipeline, StreamingLLM's "positions within the cache", and
  transformers' former SinkCache): the next tokens FOLLOW the kept keys. kvpress's pipeline sets
  `context_length = cache.get_seq_length()` for a `KeyRerotationPress` (kvpress/pipeline.py, `_forward`, since
  its commit 2b350b0) and feeds the question and the answer at context_length + i, i.e. right after the n kept
  keys at 0..n-1. Here the next token's position P is the most entries any layer holds after eviction (N with
  uniform budgets, the largest N_l with a schedule; the tokens seen while some layer is not yet full or never
  evicts); each layer's n kept keys sit at P-n..P-1 (right-aligned, so the newest kept key is next to the
  query), and a pass of q tokens is rotated for P..P+q-1. With uniform budgets this is kvpress's layout (every
  layer holds N: keys at 0..N-1, next token at N); with a layer schedule kvpress would put every layer's keys
  at 0..n_l-1 and continue at layer 0's count, ours right-aligns each layer below max N_l. The cache reports P
  as `get_seq_length()` (and sizes transformers' masks from it), so every position stays below max N_l + B
  whatever the prompt's length. `get_seq_length()` then no longer counts the tokens seen: continue with
  keydiff.generate (or a loop that passes no position_ids), not transformers' generate with a prefilled
  cache, which slices the prompt by it. Query statistics (Expected Attention) use the same positions.
* "absolute" (ours; not kvpress's): kept keys at 0..n-1; new tokens keep their ABSOLUTE positions
  (transformers derives them from `get_seq_length()`, the tokens seen). A query at absolute position t then
  sees the kept keys at distances t - rank (no longer t - p) and its own pass at the true distances; the next
  eviction re-rotates the survivors (old and new) to 0..n-1 again. Distances stay as large as the prompt is
  long: the keys look older than they are. (Until this was checked against kvpress's pipeline it was
  documented, wrongly, as kvpress's form and was what `true` meant; "kvpress" is no longer accepted, so that
  no configuration changes meaning silently.)

When it matters: only once something has been evicted (before that every key already sits at its rank;
nothing changes at all), and the more, the more: with a long prompt and a small budget the kept keys, spread
over positions up to L, collapse into a range of N positions. Under "contiguous" the queries move with them,
so positions far beyond what the model was trained on collapse into a short range (the point for prompts
longer than the training length); under "absolute" only the keys move. Results differ from the default (keys
at their true positions), for better or worse: order in time is kept, distances are not. In bfloat16 every
re-rotation rounds the key once more; during decoding (an eviction per token) keys behind an evicted one move
by one position per step, so a key can be rounded once per generated token (kvpress compresses once).
"""

from __future__ import annotations

from dataclasses import dataclass

from keydiff.policies.wrappers import PolicyWrapper

STATE = "rotary_position"  # the position each cached key is currently rotated for
MODES = ("contiguous", "absolute")
RENAMED = ("key_rerotation 'kvpress' was withdrawn: kvpress's pipeline continues after the kept keys, which is "
           "'contiguous' (= true); the layout it used to name is 'absolute'")


def rerotation_mode(value) -> str | None:
    """The flat parameter `key_rerotation` as a mode: False/None: off; True or "contiguous": the next tokens
    follow the kept keys (kvpress's pipeline); "absolute": they keep their absolute positions."""
    if value is None or value is False:
        return None
    if value is True:
        return "contiguous"
    if value == "kvpress":
        raise ValueError(RENAMED)
    if value in MODES:
        return value
    raise ValueError(f"key_rerotation must be true, false or one of {', '.join(MODES)}, got {value!r}")


@dataclass
class Rerotated(PolicyWrapper):
    """The wrapped policy, with the kept keys re-rotated to contiguous positions after every eviction (see the module)."""

    mode: str = "contiguous"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_parameters()

    def check_parameters(self, budget: int | None = None) -> None:
        if self.mode == "kvpress":
            raise ValueError(RENAMED)
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
        return {**described, "key_rerotation": self.mode, "layer_budgets": schedule}


__all__ = ["MODES", "Rerotated", "STATE", "rerotation_mode"]
