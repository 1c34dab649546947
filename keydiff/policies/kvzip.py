"""KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction").

The paper scores the context's cache by asking the model to repeat the context: after prefill, the model is
teacher-forced on [repeat prompt + the context], and an entry's importance is the largest attention it
receives from any of those reconstruction queries, over the query heads of its KV group (kvpress: amax over
group and rows). Entries the model needs to rebuild its input are the ones worth keeping, whatever the
question will be (query-agnostic, like KeyDiff).

Memory-bounded form (this harness: block-wise prefill, N entries per head). The one-shot form needs the whole
context's cache. Here the engine runs one reconstruction pass per prefill block, after the block is written
and before its eviction: [repeat prompt + that block's tokens], against the N kept + B new entries and
causally to itself, inside `cache.scratch()`, so its R + B entries are not kept (the cache holds
N + B + R + B entries per head while it runs). Every held entry's score is the running maximum of the
attention it has received in these passes (per-entry state), the new entries getting theirs now; then the
cache evicts to N. One extra forward pass per block: about twice the prefill's compute. With one block
(block_size=inf) it is the paper's one-shot KVzip with the whole context as one chunk.

Prompts (kvpress's, data): the first block is repeated after "\\n\\nRepeat the previous context exactly.";
each later block after "\\n\\nRepeat the part of the previous context exactly, starting with" + the last
`context_overlap` (8) tokens of the block before, as kvpress does for its 2,048-token chunks; then a suffix
(the chat template's assistant opening if the tokenizer has one, else "\\n", as kvpress derives it).
Without a tokenizer (prefill(..., tokenizer=None), e.g. the offline test model) the pass is the block's
tokens alone, and a warning says so.

Differences from kvpress's KVzipPress: the softmax runs over every entry the pass attends to, the paper's
definition (kvpress, like the authors' code, restricts it to the sinks + the chunk + the repeated chunk, which
is the same when there is one chunk; `scoring_keys="chunk"` does that here, with the block as the chunk: each
entry is then scored by its own block's pass only, as kvpress scores each chunk once); the budget is uniform
per KV head (kvpress selects a global top-k over layers and heads: head- and layer-adaptive budgets); the first `n_sink` positions are always kept (kvpress gives them the top score
only when they belong to a chat-template prefix).

What is reconstructed (against kvpress's KVzipPress, kvzip_press.py `prepare`/`_perform_kvzip_compression`):
kvpress reconstructs the context after the chat template's prefix (`prefix_length`), in 2,048-token chunks;
the prefix's entries get no score there (0, the first n_sink 1). Here every prefill block is reconstructed
whole, so the first block repeats the template's prefix too (`reconstruct_prefix=False` leaves it out when
the prompt opens with it, as kvpress; its entries are still scored by the attention the passes give them,
not set to 0). The question: under `query_aware=false` (kvpress's leaderboard protocol) it is fed after the
compressed context and never reconstructed, as in kvpress; under `query_aware=true` (the paper's protocol,
the default) it is in the last block with the end of the user turn and the answer prefix, and that block's
pass repeats all of it (kvpress's `--query_aware` reconstructs the question, part of its context there, but
not the end of the turn or the answer prefix, which it feeds afterwards).

Decoding: no reconstruction. Each generated token's query attention updates the running maximum (its own
entry starts with the attention its query gives itself) and the cache keeps evicting by it; with
generate(evict=False) the generated tokens are all kept, as in kvpress. Decoding statistics start with
`cache.start_generation` (keydiff.generate calls it): a loop of your own must call it too, or new tokens,
never scored, are the first evicted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Policy

logger = logging.getLogger(__name__)

SCORING_KEYS = ("cache", "chunk")
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PLAIN_SUFFIX = "\n"


def chat_prefix(tokenizer) -> str:
    """What the tokenizer's chat template puts before a user turn's content ("" without a template): the text
    kvpress's KVzipPress leaves out of its reconstruction (`prefix_length`)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return ""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "dummy context"}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
    return text.split("dummy context", 1)[0]


def chat_suffix(tokenizer) -> str:
    """What follows a user turn up to the assistant's first token in the tokenizer's chat template ("\\n"
    without a template): the text between the repeat prompt and the repeated context."""
    if getattr(tokenizer, "chat_template", None) is None:
        return PLAIN_SUFFIX
    marker = "\n" + "#" * 13
    text = tokenizer.apply_chat_template([{"role": "user", "content": "dummy context" + marker}],
                                         add_generation_prompt=True, tokenize=False, enable_thinking=False)
    return text.split(marker, 1)[1]


@dataclass
class KVzip(Policy):
    """Keep the entries that receive the most attention (max over rows and group heads) from reconstruction passes."""

    name: ClassVar[str] = "kvzip"
    layers_batchable: ClassVar[bool] = True
    attention_rows: ClassVar[int | None] = None  # every row of the reconstruction pass
    attention_reduction: ClassVar[str] = "max"
    needs_reconstruction: ClassVar[bool] = True
    observes_every_step: ClassVar[bool] = True  # the running max needs every pass
    state_names: ClassVar[tuple[str, ...]] = ("kvzip",)
    n_sink: int = 4  # first positions always kept (kvpress n_sink)
    context_overlap: int = 8  # previous block's tokens quoted in a later block's prompt (kvpress prev_postfix_size)
    suffix: str | None = None  # text before the repeated tokens; None: from the chat template ("\n" without one)
    # The softmax of the reconstruction pass runs over: "cache" every entry it attends to (the paper's
    # definition); "chunk" the sinks + the block's entries + its own (kvpress's / the authors' chunked scoring).
    scoring_keys: str = "cache"
    # Whether the first block's reconstruction repeats the chat template's prefix (system turn, user opening)
    # when the prompt starts with it: True (today's), or False (kvpress's: only the context after the prefix
    # is reconstructed; the prefix's entries are still scored by the attention the pass gives them).
    reconstruct_prefix: bool = True

    def validate(self, budget: int) -> None:
        if self.n_sink < 0 or self.context_overlap < 0:
            raise ValueError(
                f"kvzip n_sink and context_overlap must be >= 0, got {self.n_sink} and {self.context_overlap}")
        if self.scoring_keys not in SCORING_KEYS:
            raise ValueError(f"kvzip scoring_keys {self.scoring_keys!r} is not valid; valid: {', '.join(SCORING_KEYS)}")
        if not isinstance(self.reconstruct_prefix, bool):
            raise ValueError(f"kvzip reconstruct_prefix must be true or false, got {self.reconstruct_prefix!r}")
        if self.n_sink >= budget:
            raise ValueError(f"kvzip n_sink ({self.n_sink}) must be smaller than the budget ({budget})")

    def reconstruction_input(self, block: torch.Tensor, previous: torch.Tensor, tokenizer) -> torch.Tensor:
        """[repeat prompt (+ the previous block's last tokens) + suffix + block], [batch, R + B]."""
        if tokenizer is None:
            if not self.__dict__.get("_warned"):
                logger.warning("kvzip: no tokenizer given to prefill; the reconstruction pass is the block's tokens "
                               "without the repeat prompt")
                self.__dict__["_warned"] = True
            return block

        def encode(text: str) -> torch.Tensor:
            ids = tokenizer.encode(text, add_special_tokens=False)
            return torch.tensor(ids, dtype=block.dtype, device=block.device).expand(block.shape[0], -1)

        suffix = encode(chat_suffix(tokenizer) if self.suffix is None else self.suffix)
        if previous.shape[1] == 0 and not self.reconstruct_prefix:
            prefix = encode(chat_prefix(tokenizer))
            length = min(prefix.shape[1], block.shape[1])
            if length and torch.equal(block[:, :length], prefix[:, :length]):  # the prompt opens with the template
                block = block[:, length:]
        if previous.shape[1] == 0:
            parts = [encode(FIRST_PROMPT)]
        else:
            quoted = min(self.context_overlap, previous.shape[1])
            parts = [encode(NEXT_PROMPT), previous[:, previous.shape[1] - quoted :]]
        return torch.cat([*parts, suffix, block], dim=1)

    def reconstruction_keys(self, positions: torch.Tensor, chunk_start: int | None) -> torch.Tensor | None:
        """"chunk": only the sinks and the reconstructed block's entries (older entries keep their score)."""
        if self.scoring_keys == "cache" or chunk_start is None:
            return None
        return (positions >= chunk_start) | (positions < self.n_sink)

    def observe(self, layer: LayerView) -> None:
        running = layer.state["kvzip"]
        running.copy_(torch.maximum(running, layer.attention))

    def score(self, layer: LayerView) -> torch.Tensor:
        return layer.state["kvzip"]

    def protected(self, layer: LayerView, budget: int) -> torch.Tensor | None:
        return layer.positions < self.n_sink if self.n_sink else None
