"""The scheduler: requests in, results out, up to `batch_size` sequences decoding at once, a free place refilled
as soon as a sequence stops (continuous batching).

    requests = (keydiff.Request(keydiff.prefill(model, ids, policy, budget=1024), max_new_tokens=64, key=i)
                for i, ids in enumerate(prompts))            # lazy: a prompt is prefilled when a place frees
    for key, out in keydiff.generate_batch(model, requests, batch_size=8):
        print(key, tokenizer.decode(out.token_ids[0]))       # in the order the sequences finish

It pulls the next request whenever fewer than `batch_size` sequences run (a lazy iterable prefills each prompt
only then, alone, so its TTFT is timed as at batch 1), runs the decoding step (keydiff.batching.step) until a
sequence stops, yields each stopped sequence's result and refills. Prompts prefilled apart join the block
manager's pool (keydiff.batching.blocks.JoinPool) so that those alike decode as one group, like forks.
Out-of-memory back-off lives with the caller that knows how to redo its work (keydiff.run.batched).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from keydiff.attention import keydiff_attention
from keydiff.batching.blocks import JoinPool
from keydiff.batching.sequence import Request, Sequence, SequenceResult
from keydiff.batching.step import Stepper, decode_step


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module, requests: Iterable[Request], batch_size: int, group_rows: bool = True,
    pool_rows: bool = True, fixed_shapes: bool | None = None, batch_invariant: bool = False,
) -> Iterator[tuple[Any, SequenceResult]]:
    """Decode every request, up to `batch_size` sequences at once, refilling as soon as a sequence stops.

    Yields (request.key, SequenceResult) in the order the sequences finish. Each sequence decodes exactly as it
    would alone (keydiff.generate runs this with one request; see keydiff.batching). `requests` may be a lazy
    iterable: the next one is drawn only when a place is free, so its prefill runs then, outside the steps. A
    request's state may hold several rows (a multi-row prefill): they decode together, as one sequence.
    group_rows=False computes every sequence on its own even where rows could run as one group (the reference
    the grouped path is tested against, and what a benchmark compares it with). pool_rows: move each joining
    sequence prefilled on its own into a slot of one shared block (keydiff.batching.blocks.JoinPool: a copy of
    its entries in, and one out when a later sequence takes the slot), so that such sequences group like forks
    (measured: the copy pays for itself within a 16-token generation on CPU, and on a GPU, where a row's kernel
    launches dominate a step, at once; docs/performance.md). fixed_shapes: run the step in fixed shapes where every
    going sequence is full and alike (keydiff.batching.static; None: the device's default, False: never).
    Outputs are the same either way. batch_invariant: the decoding steps (not the prefills, which run alone) use
    kernels whose reduction order does not depend on the number of rows (keydiff.kernels.batch_invariant), so on a
    GPU a sequence gets the same tokens at any batch size; a no-op on a CPU, whose kernels already give them.
    """
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    source = iter(requests)
    stepper = Stepper(model, group_rows, fixed_shapes, batch_invariant)
    pool = JoinPool(int(batch_size)) if group_rows and pool_rows and batch_size > 1 else None
    active: list[Sequence] = []
    exhausted = False
    while True:
        while not exhausted and len(active) < batch_size:
            request = next(source, None)  # may run a prefill (its own keydiff_attention, timed by itself)
            if request is None:
                exhausted = True
            else:
                active.append(Sequence(request))
                if pool is not None:
                    pool.place(active[-1].cache)
        if not active:
            return
        finished: list[Sequence] = []
        # One switch of the attention function for all the steps until a sequence stops (a switch walks every
        # module); outside it, the caller's code and the next prompts' prefills run with the model as it was.
        with keydiff_attention(model, stepper.batch), stepper.invariant():
            while active and not finished:
                active, finished = decode_step(stepper, active)
        for sequence in finished:
            if pool is not None:
                pool.leave(sequence.cache)
            yield sequence.request.key, sequence.result()
