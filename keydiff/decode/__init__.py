"""Decoding many sequences, each in a bounded cache of its own, one forward pass per step; and one sequence, as
the same thing with one request. Only the weights are shared: padding caches to one length would corrupt the
scores, so attention and eviction run per sequence, and rows alike run as one group.

    sequence.py   a request, the token rule (greedy / sampling, stop tokens, min_new_tokens), results
    scheduler.py  continuous batching: up to W sequences at once; decides each step as a plan; a run's Decoder
                  keeps its arena and steps
    plan.py       what passes from the scheduler to the model runner: StepPlan in, StepOutput back
    step.py       the model runner, and the decode step every path runs (keydiff.generate, generate_batch alike)
    rows.py       the cache a batched forward pass runs with: each sequence's rows to its own cache
    blocks.py     shared arenas: forks and joining sequences side by side, and the groups of rows that run as one
    static.py     the step in fixed shapes once every going cache is full (a CUDA graph on a GPU)
    graphs.py     the CUDA calls a capture makes, bound to the model's device, and their CPU stand-in

Design: docs/design/decode.md
"""

from keydiff.decode.rows import BatchCache
from keydiff.decode.scheduler import Decoder, generate_batch
from keydiff.decode.sequence import Failure, GenerationResult, Job, Request, SequenceResult, next_token

__all__ = ["BatchCache", "Decoder", "Failure", "GenerationResult", "Job", "Request", "SequenceResult", "generate_batch",
           "next_token"]
