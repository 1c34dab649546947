"""One decoding sequence: what it was asked (`Request`), how it picks its next token and when it stops
(`Sequence`), and what it returns (`GenerationResult`, `SequenceResult`). The token rule lives here once:
greedy or seeded CPU sampling, stop tokens masked until `min_new_tokens`. Design: docs/design/decode.md"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence as Ids

import torch

from keydiff.cache import EvictingCache


class Prefilled(Protocol):
    """What decoding needs of a prefilled state (keydiff.engine.PrefillResult): its cache, the next-token logits
    [rows, vocab], and whether it was decoded already (a state decodes once: its cache moves on)."""

    cache: EvictingCache
    logits: torch.Tensor
    decoded: bool


@dataclass
class Request:
    """One sequence to decode from a prefilled state, with the settings `keydiff.generate` takes."""

    state: Prefilled
    max_new_tokens: int
    eos_token_ids: Ids[int] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    min_new_tokens: int = 0
    seed: int | None = None
    evict: bool = True
    key: Any = None  # the caller's name for it, handed back with the result
    record_steps: bool = False  # record the largest layer size after each step's eviction (`step_entries`)
    job: "Job | None" = None  # the job that made it (set by the scheduler), which can make it again


class Job(Protocol):
    """A request not yet prefilled: `start()` runs its prefill (callable again after an out-of-memory back-off)."""

    key: Any

    def start(self) -> Request: ...

    def abandon(self) -> None:
        """Called when a back-off abandons the started job: drop what `start` made (its state), so that its
        memory is freed before anything starts again."""


@dataclass(frozen=True)
class Failure:
    """What the scheduler yields for a job it gave up on: out of memory at width 1 (a caller records it as a
    failed sample, as a sample run alone that ran out would be)."""

    key: Any
    reason: str  # "out_of_memory"
    message: str  # the error, as "<type>: <text>"
    job: Any = None


@dataclass
class GenerationResult:
    """What `generate` returns: `token_ids[row]` are batch row `row`'s new token ids, without the prompt
    (`tokenizer.decode(out.token_ids[0], skip_special_tokens=True)` is the first row's text)."""

    token_ids: list[list[int]]  # per batch row, generated ids (the stop token included if one was hit)
    finish_reasons: list[str]  # per batch row: "stop" (a stop token) or "length"
    seconds: float  # decode wall time (after the first token's logits)
    max_cache_entries: int
    # Largest layer size (entries per head) after each step's eviction, if `record_steps` was set.
    step_entries: list[int] = field(default_factory=list)


@dataclass
class SequenceResult(GenerationResult):
    """A GenerationResult plus how it was batched."""

    key: Any = None
    batch_sizes: list[int] = field(default_factory=list)  # the rows of each decoding pass it took part in
    kv_cache_bytes: int = 0  # what its own cache's buffers hold (a batch holds the sum over its sequences)


def next_token(
    logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Greedy argmax, or sampling with temperature and nucleus (top-p) filtering. logits [batch, vocab]."""
    if not do_sample:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold included).
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        outside[..., 0] = False  # always keep the most likely token (top_p = 0 means greedy-like)
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    samples = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
    return samples.to(logits.device)


class Sequence:
    """A sequence being decoded: its request, cache, next-token logits, generator and tokens so far, per row."""

    def __init__(self, request: Request):
        state = request.state
        if state.decoded:
            raise RuntimeError("this PrefillResult was already decoded (its cache moved on); run prefill again or fork")
        state.decoded = True
        self.request, self.cache, self.logits = request, state.cache, state.logits
        self.row_count = state.logits.shape[0]
        self.stop_set = {int(i) for i in request.eos_token_ids}
        self.stop_ids = torch.tensor(sorted(self.stop_set), dtype=torch.long, device=state.logits.device)
        seeded = request.do_sample and request.seed is not None
        self.generator = torch.Generator().manual_seed(request.seed) if seeded else None
        self.tokens: list[list[int]] = [[] for _ in range(self.row_count)]
        self.last: list[int] = []  # the tokens chosen at the last step, every row's (a stopped row's is fed too)
        self.stopped = [False] * self.row_count
        self.reasons = ["length"] * self.row_count
        self.steps = 0  # tokens chosen so far
        self.done = request.max_new_tokens <= 0
        self.seconds = 0.0
        self.batch_sizes: list[int] = []
        self.step_entries: list[int] = []
        self.cache.start_generation(request.max_new_tokens, evict=request.evict)

    @property
    def masking_stops(self) -> bool:
        """Whether stop tokens are masked at this step (fewer than `min_new_tokens` chosen yet)."""
        return self.steps < self.request.min_new_tokens and len(self.stop_ids) > 0

    @property
    def plain_greedy(self) -> bool:
        """Whether the next tokens are the argmax of the logits as they are (greedy, no stop token masked):
        such sequences are chosen together, one argmax over the step's logits (keydiff.decode.step)."""
        return not self.request.do_sample and not self.masking_stops

    def choose(self) -> None:
        """Pick the next tokens from the current logits."""
        request, logits = self.request, self.logits
        if self.masking_stops:
            logits = logits.index_fill(-1, self.stop_ids, float("-inf"))
        chosen = next_token(logits, request.do_sample, request.temperature, request.top_p, self.generator)
        self.take(chosen.tolist())

    def take(self, tokens: list[int]) -> None:
        """Record the chosen tokens (one per row); a row stops at a stop token, the sequence when every row has
        stopped or `max_new_tokens` were chosen."""
        self.last = tokens
        for row, token in enumerate(tokens):
            if self.stopped[row]:
                continue
            self.tokens[row].append(token)
            if token in self.stop_set:
                self.stopped[row], self.reasons[row] = True, "stop"
        self.steps += 1
        self.done = all(self.stopped) or self.steps >= self.request.max_new_tokens

    def result(self) -> SequenceResult:
        return SequenceResult(self.tokens, self.reasons, self.seconds, self.cache.max_entries, self.step_entries,
                              key=self.request.key, batch_sizes=self.batch_sizes,
                              kv_cache_bytes=self.cache.kv_cache_bytes)
