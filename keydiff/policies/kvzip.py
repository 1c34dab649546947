"""KVzip (Kim et al. 2025): an entry's score is the largest attention it receives while the model repeats the context
(one reconstruction pass per prefill block); loops of your own must call `cache.start_generation`. Design:
docs/design/policies.md#kvzip-kvzippy"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from keydiff.policies.base import LayerView, Needs, Policy

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
    # Every row of the reconstruction pass, max-reduced; the running max needs every pass.
    needs: ClassVar[Needs] = Needs(attention_rows=None, attention_reduction="max", every_pass=True, reconstruction=True,
                                   state=("kvzip",), rows_alike=True)
    n_sink: int = 4  # first positions always kept (kvpress n_sink)
    context_overlap: int = 8  # previous block's tokens quoted in a later block's prompt (kvpress prev_postfix_size)
    suffix: str | None = None  # text before the repeated tokens; None: from the chat template ("\n" without one)
    # The reconstruction's softmax runs over "cache" (every entry, the paper's) or "chunk" (kvpress's chunks).
    scoring_keys: str = "cache"
    # Whether the first block's reconstruction repeats the chat template's prefix (False: kvpress's, context only).
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
