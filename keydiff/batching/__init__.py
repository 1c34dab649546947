"""Decoding many sequences, each in a bounded cache of its own, one forward pass per step; and one sequence, as
the same thing with one request.

Split the way serving engines split it:
    sequence.py   a request, the token rule (greedy / sampling, stop tokens, min_new_tokens), results
    scheduler.py  continuous batching: requests in, up to W sequences at once, results out; a run's Decoder
                  keeps its width, arena and captured steps across calls; out-of-memory back-off
    step.py       the decoding step every path runs (keydiff.generate and keydiff.generate_batch alike)
    rows.py       the cache a batched forward pass runs with: each sequence's rows to its own cache
    blocks.py     the block manager: where the stacks of sequences that decode as one group live
    static.py     the step in fixed shapes once every going cache is full (captured as a CUDA graph on a GPU)
    graphs.py     the CUDA calls a capture makes, bound to the model's device, and their CPU stand-in

Why one cache per sequence. A batch of bounded caches is cheap to decode together (every sequence holds at
most N + 1 entries per head), but the sequences hold different numbers of entries (a prompt shorter than N,
`full`, decoding without eviction, sequences that joined at different times) and evict different entries.
Padding them to one length would put padding into the scores and the kept set, which is how batched
evaluation corrupted predictions elsewhere. So each sequence keeps its own `EvictingCache`, exactly as a run of
it alone builds it (positions, budget, policy object, eviction, stop rule, `min_new_tokens` and seeded
generator), and only the weights are shared: the projections and MLPs run once for the whole batch, which is
what decoding at batch 1 wastes (it reads every weight to produce one token). Attention runs per sequence
against its own cache (keydiff.attention.rowwise_attention), so no row ever scores, keeps or attends to an
entry that is not its own. A sample's tokens therefore do not depend on the batch size or its neighbours,
beyond the float rounding of batched matrix products.

Rows alike run as one. Forks of one prefill (`state.fork(k)`) lie side by side in one allocation, each in its
own slot of a block (keydiff.batching.blocks), and so do prompts prefilled on their own once they join
(`pool_rows=True`, the default). Where consecutive slots hold the same number of entries and the policy scores
rows from their entries alone (KeyDiff, K-norm, sink, recent, ...), those rows are written in one copy and
attend in one call per layer and evict in one scoring call per step, each row over exactly its own entries;
every other sequence (attention-statistic policies, head-adaptive pools, prompts shorter than N + B, different
counts) runs on its own. `generate_batch(..., group_rows=False)` runs every sequence on its own (the tested
reference). Once every going sequence holds N entries and their policy scores from entries alone, the whole step
runs in fixed shapes instead (static.py), with the same tokens (`fixed_shapes=False`: never).

Timing: each sequence's `seconds` sums the wall time of the steps it took part in, and `batch_sizes` lists the
rows of each of its decoding passes, so per-token time can be read at the batch size it ran at.
"""

from keydiff.batching.rows import BatchCache
from keydiff.batching.scheduler import Decoder, generate_batch
from keydiff.batching.sequence import Failure, GenerationResult, Job, Request, SequenceResult, next_token

__all__ = ["BatchCache", "Decoder", "Failure", "GenerationResult", "Job", "Request", "SequenceResult", "generate_batch",
           "next_token"]
