"""The decoding step: every running sequence picks its next token, then one forward pass of those still going,
which evicts. `keydiff.generate` (one sequence) and `keydiff.generate_batch` (many) both run this step.

    sequences pick their tokens    greedy ones in one argmax and one read back, the others one by one
    one forward pass               the batch cache hands each sequence's rows to its own cache (keydiff.batching.rows)
    every cache evicts             groups of rows side by side in one call (keydiff.batching.blocks)

Timing: every sequence of the step is charged the step's whole wall time (the batch produced its token in that
time), a sequence that stopped in it only the choice of its last token.
"""

from __future__ import annotations

import time

import torch

from keydiff.batching.rows import BatchCache
from keydiff.batching.sequence import Sequence


def sync(device: torch.device) -> None:
    """Wait for the device (timings cover the kernels, not only their launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def choose_greedy(sequences: list[Sequence]) -> None:
    """The next tokens of every plainly greedy sequence in one argmax and one read back (rather than an argmax and
    a device sync per sequence): the same tokens, since an argmax of a row does not depend on the rows beside it."""
    if not sequences:
        return
    tokens = torch.cat([sequence.logits for sequence in sequences]).argmax(dim=-1).tolist()
    start = 0
    for sequence in sequences:
        sequence.take(tokens[start : start + sequence.rows])
        start += sequence.rows


def choose_tokens(active: list[Sequence]) -> None:
    """Every running sequence's next tokens (the token rule: keydiff.batching.sequence.Sequence)."""
    greedy = [sequence for sequence in active if not sequence.done and sequence.plain_greedy]
    choose_greedy(greedy)
    chosen = set(map(id, greedy))
    for sequence in active:
        if not sequence.done and id(sequence) not in chosen:
            sequence.choose()


def forward(model: torch.nn.Module, batch: BatchCache, going: list[Sequence], device: torch.device) -> None:
    """One forward pass of the sequences' last tokens, each row at its own position, then eviction; each sequence
    gets its next-token logits."""
    ids = torch.tensor([[token] for sequence in going for token in sequence.last], dtype=torch.long, device=device)
    positions = torch.tensor([[sequence.cache.get_seq_length()] for sequence in going for _ in range(sequence.rows)],
                             dtype=torch.long, device=device)
    batch.bind([sequence.cache for sequence in going], [sequence.rows for sequence in going])
    try:
        output = model(input_ids=ids, position_ids=positions, cache=batch, use_cache=True, logits_to_keep=1)
        batch.evict()
        logits = output.logits[:, -1, :].float()
        for sequence, span in zip(going, batch.spans):
            sequence.logits = logits[span]
            sequence.batch_sizes.append(ids.shape[0])
            if sequence.request.record_steps:
                sequence.step_entries.append(max(layer.num_entries for layer in sequence.cache.layers))
    finally:
        batch.release()


def decode_step(model: torch.nn.Module, batch: BatchCache, active: list[Sequence],
                device: torch.device) -> tuple[list[Sequence], list[Sequence]]:
    """One decoding step of every active sequence: choose each one's next tokens, then one forward pass of those
    still going (which evicts); returns (still going, stopped)."""
    sync(device)
    start = time.perf_counter()
    choose_tokens(active)
    going = [sequence for sequence in active if not sequence.done]
    chosen = time.perf_counter() - start
    if going:
        forward(model, batch, going, device)
    sync(device)
    step = time.perf_counter() - start
    for sequence in active:
        sequence.seconds += chosen if sequence.done else step
    return going, [sequence for sequence in active if sequence.done]
