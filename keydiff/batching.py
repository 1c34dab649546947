"""Batched, continuous decoding: many sequences, each in a bounded cache of its own, one forward pass per step.

    requests = (keydiff.Request(keydiff.prefill(model, ids, policy, budget=1024), max_new_tokens=64, key=i)
                for i, ids in enumerate(prompts))            # lazy: a prompt is prefilled when a slot frees
    for key, out in keydiff.generate_batch(model, requests, batch_size=8):
        print(key, tokenizer.decode(out.token_ids[0]))       # in the order the sequences finish

Why one cache per sequence. A batch of bounded caches is cheap to decode together (every sequence holds at
most N + 1 entries per head), but the sequences hold different numbers of entries (a prompt shorter than N,
`full`, decoding without eviction, sequences that joined at different times) and evict different entries.
Padding them to one length would put padding into the scores and the kept set, which is how batched
evaluation corrupted predictions elsewhere. So each sequence keeps its own `EvictingCache`, exactly as a
batch-1 run builds it (positions, budget, policy object, eviction, stop rule, `min_new_tokens` and seeded
generator), and only the weights are shared: the projections and MLPs run once for the whole batch, which is
what decoding at batch 1 wastes (it reads every weight to produce one token). Attention runs row by row
against each row's own cache (keydiff.attention.rowwise_attention), so no row ever scores, keeps or attends to
an entry that is not its own. A sample's tokens therefore do not depend on the batch size or its neighbours,
beyond the float rounding of batched matrix products.

Rows alike run as one. Forks of one prefill (`state.fork(k)`: the throughput benchmark, Math-500's sampled
answers) lie side by side in one allocation, each in its own slot (keydiff.cache.rowpool), and so do prompts
prefilled on their own once they join (`pool_rows=True`, the default: each is moved into a slot of one block,
`rowpool.JoinPool`). Where consecutive slots hold the same number of entries and the policy scores rows from
their entries alone (KeyDiff, K-norm, sink, recent, ...), those rows are written in one copy and attend in one
call per layer and evict in one scoring call per step, each row over exactly its own entries
(`BatchCache.row_groups`, `rowpool.evict_groups`); every other row (attention-statistic policies, head-adaptive
pools, prompts shorter than N + B, different counts) runs on its own as above. Greedy rows are chosen by one
argmax over the step's logits. `generate_batch(..., group_rows=False)` runs every row on its own (the tested
reference).

Continuous batching. `generate_batch` owns `batch_size` slots. It pulls the next request whenever a slot is
free (a lazy iterable prefills each prompt only then, alone, so its TTFT is timed as at batch 1) and yields
each sequence's result as soon as it stops (a stop token or its length limit), then refills the slot.

One prefill, many decodes: `state.fork(k)` (keydiff.engine.PrefillResult.fork) gives k independent states of
one prompt, e.g. k sampled answers with their own seeds, decoded together as k requests.

Timing: each sequence's `seconds` sums the wall time of the steps it took part in (every row of a step is
charged the whole step: the batch produced its token in that time), and `batch_sizes` lists the batch size of
each of its decoding passes, so per-token time can be read at the batch size it ran at.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from keydiff.attention import bound_cache, bound_to, keydiff_attention
from keydiff.cache import EvictingCache
from keydiff.cache.rowpool import JoinPool, evict_groups, grouped_passes, runs, write_groups
from keydiff.engine import GenerationResult, PrefillResult, next_token


@dataclass
class Request:
    """One sequence to decode from a prefilled single-row state, with the settings `keydiff.generate` takes."""

    state: PrefillResult
    max_new_tokens: int
    eos_token_ids: Sequence[int] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    min_new_tokens: int = 0
    seed: int | None = None
    evict: bool = True
    key: Any = None  # the caller's name for it, handed back with the result


@dataclass
class SequenceResult(GenerationResult):
    """A GenerationResult (one row) plus how it was batched."""

    key: Any = None
    batch_sizes: list[int] = field(default_factory=list)  # the batch size of each decoding pass it took part in
    kv_cache_bytes: int = 0  # what its own cache's buffers hold (a batch holds the sum over its rows)


class _RowLayer(CacheLayerMixin):
    """What transformers asks a layer of the batch cache (mask sizes, length); the rows hold the entries."""

    is_sliding = False

    def __init__(self, owner: "BatchCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("a batch cache's layers are written through BatchCache.update")

    def get_seq_length(self) -> int:
        return max((row.get_seq_length(self.layer_idx) for row in self.owner.rows), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The widest row's sizes (the keydiff attention functions ignore the model's mask: each row is
        computed over its own entries)."""
        sizes = [row.get_mask_sizes(query_length, self.layer_idx) for row in self.owner.rows]
        return max(sizes, default=(query_length, 0))

    def get_max_length(self) -> int:
        return -1


class BatchCache(Cache):
    """A transformers Cache over the rows of a batch, each row an `EvictingCache` of its own (`rows`).

    `update` hands row r's keys and values to row r's cache and remembers what each returned; the keydiff
    attention function asks `row_passes` for them and computes every row over its own entries. It runs only
    inside `keydiff_attention(model, batch_cache)`, and needs `position_ids` per row (rows sit at different
    positions). `evict()` evicts every row as a batch-1 run does after each pass.
    """

    def __init__(self, num_layers: int, group_rows: bool = True):
        super().__init__(layers=[_RowLayer(self, i) for i in range(num_layers)])
        self.rows: list[EvictingCache] = []
        self.group_rows = group_rows  # rows side by side with equal counts run as one (keydiff.cache.rowpool)
        self._passes: dict[int, tuple[torch.Tensor, list[tuple[EvictingCache, torch.Tensor, torch.Tensor]]]] = {}
        self._groups: dict[int, list[tuple[list[int], torch.Tensor, torch.Tensor]]] = {}
        self._runs: list = []

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if bound_cache() is not self:
            raise RuntimeError("a BatchCache runs only inside `with keydiff.keydiff_attention(model, batch_cache):` "
                               "(its rows are computed by keydiff's attention function); use keydiff.generate_batch")
        if key_states.shape[0] != len(self.rows):
            raise RuntimeError(f"the pass has {key_states.shape[0]} rows, the batch cache {len(self.rows)}")
        # After the pass's first layer (every row made room through its own update), a group's rows are written
        # in one copy; their passes are None: the group attends as one (`row_groups`), never row by row.
        written = write_groups(self._runs, self.rows, layer_idx, key_states, value_states) if self._groups else ()
        passes = []
        for row, cache in enumerate(self.rows):
            if row in written:
                passes.append((cache, None, None))
                continue
            with bound_to(cache):  # e.g. head-adaptive layers check that their own cache is the bound one
                keys, values = cache.update(key_states[row : row + 1], value_states[row : row + 1], layer_idx)
            passes.append((cache, keys, values))
        self._passes[layer_idx] = (key_states, passes)
        if self.group_rows:
            if not self._groups:  # the pass's first layer: every row's count has moved on, group them once
                self._runs = runs(self.rows)
            self._groups[layer_idx] = grouped_passes(self._runs, self.rows, layer_idx)
        return key_states, value_states

    def row_passes(
        self, layer_idx: int, key: torch.Tensor
    ) -> list[tuple[EvictingCache, torch.Tensor, torch.Tensor]] | None:
        """For the attention function: each row's (cache, keys, values) of this layer's pass, if `key` is what
        this cache's `update` returned for it (else None: the model runs with some other cache)."""
        entry = self._passes.get(layer_idx)
        return entry[1] if entry is not None and entry[0] is key else None

    def row_groups(self, layer_idx: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """For the attention function: the groups of rows of this layer's pass that attend as one (row indices,
        their keys and values as one tensor each, views of the pool: keydiff.cache.rowpool); rows in no group
        attend on their own. Asked only after `row_passes` answered."""
        return self._groups.get(layer_idx, [])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The most tokens any row has seen (rows differ: the scheduler passes each row's position_ids)."""
        return self.layers[layer_idx].get_seq_length()

    def evict(self) -> None:
        """Every row observes the pass and evicts, as a batch-1 run does after each pass (the rows of a group
        in one call, keydiff.cache.rowpool.evict_groups)."""
        self._passes.clear()
        self._groups.clear()
        done = evict_groups(self.rows) if self.group_rows else set()
        for cache in self.rows:
            if id(cache) not in done:
                cache.evict()


class _Slot:
    """One decoding sequence: its request, cache, next-token logits, generator and tokens so far."""

    def __init__(self, request: Request):
        state = request.state
        if state.decoded:
            raise RuntimeError("this PrefillResult was already decoded (its cache moved on); run prefill again or fork")
        if state.logits.shape[0] != 1:
            raise ValueError(f"a batched request takes a one-row prefill (got {state.logits.shape[0]} rows): prefill "
                             "each prompt on its own, or fork one state into several")
        state.decoded = True
        self.request, self.cache, self.logits = request, state.cache, state.logits
        self.stop_set = {int(i) for i in request.eos_token_ids}
        self.stop_ids = torch.tensor(sorted(self.stop_set), dtype=torch.long, device=state.logits.device)
        seeded = request.do_sample and request.seed is not None
        self.generator = torch.Generator().manual_seed(request.seed) if seeded else None
        self.tokens: list[int] = []
        self.reason = "length"
        self.done = request.max_new_tokens <= 0
        self.seconds = 0.0
        self.batch_sizes: list[int] = []
        self.cache.start_generation(request.max_new_tokens, evict=request.evict)

    @property
    def plain_greedy(self) -> bool:
        """Whether the next token is the argmax of the logits as they are (greedy, no stop token masked yet):
        such rows are chosen together, one argmax over the step's logits (`choose_greedy`)."""
        return not self.request.do_sample and not (len(self.tokens) < self.request.min_new_tokens
                                                   and len(self.stop_ids))

    def choose(self) -> None:
        """Pick the next token from the current logits (as keydiff.generate does at each step)."""
        request, logits = self.request, self.logits
        if len(self.tokens) < request.min_new_tokens and len(self.stop_ids):
            logits = logits.index_fill(-1, self.stop_ids, float("-inf"))
        self.take(int(next_token(logits, request.do_sample, request.temperature, request.top_p, self.generator)[0]))

    def take(self, token: int) -> None:
        """Append the chosen token and stop on a stop token or the length limit."""
        request = self.request
        self.tokens.append(token)
        if token in self.stop_set:
            self.done, self.reason = True, "stop"
        elif len(self.tokens) >= request.max_new_tokens:
            self.done = True

    def result(self) -> SequenceResult:
        return SequenceResult([self.tokens], [self.reason], self.seconds, self.cache.max_entries,
                              key=self.request.key, batch_sizes=self.batch_sizes,
                              kv_cache_bytes=self.cache.kv_cache_bytes)


def choose_greedy(slots: list[_Slot]) -> None:
    """The next token of every plainly greedy row in one argmax and one read back (rather than an argmax and a
    device sync per row): the same tokens, since an argmax of a row does not depend on the rows beside it."""
    if not slots:
        return
    tokens = torch.cat([slot.logits for slot in slots]).argmax(dim=-1).tolist()
    for slot, token in zip(slots, tokens):
        slot.take(token)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: torch.nn.Module, batch: BatchCache, active: list[_Slot],
          device: torch.device) -> tuple[list[_Slot], list[_Slot]]:
    """One decoding step of every active sequence: choose each one's next token, then one forward pass of those
    still going (which evicts); returns (still going, stopped). Each row is charged the step's wall time."""
    _sync(device)
    start = time.perf_counter()
    greedy = [slot for slot in active if not slot.done and slot.plain_greedy]
    choose_greedy(greedy)
    for slot in active:
        if not slot.done and slot not in greedy:
            slot.choose()
    going = [slot for slot in active if not slot.done]
    chosen = time.perf_counter() - start
    if going:
        ids = torch.tensor([[slot.tokens[-1]] for slot in going], dtype=torch.long, device=device)
        positions = torch.tensor([[slot.cache.get_seq_length()] for slot in going], dtype=torch.long,
                                 device=device)
        batch.rows = [slot.cache for slot in going]
        output = model(input_ids=ids, position_ids=positions, cache=batch, use_cache=True, logits_to_keep=1)
        batch.evict()
        logits = output.logits[:, -1, :].float()
        for row, slot in enumerate(going):
            slot.logits = logits[row : row + 1]
            slot.batch_sizes.append(len(going))
        batch.rows = []
    _sync(device)
    step = time.perf_counter() - start
    for slot in active:
        slot.seconds += chosen if slot.done else step
    return going, [slot for slot in active if slot.done]


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module, requests: Iterable[Request], batch_size: int, group_rows: bool = True,
    pool_rows: bool = True,
) -> Iterator[tuple[Any, SequenceResult]]:
    """Decode every request, up to `batch_size` at once, refilling a slot as soon as its sequence stops.

    Yields (request.key, SequenceResult) in the order the sequences finish. Each sequence decodes exactly as
    `keydiff.generate(model, request.state, ...)` would alone (see the module docstring). `requests` may be a
    lazy iterable: the next one is drawn only when a slot is free, so its prefill runs then, outside the steps.
    group_rows=False computes every row on its own even where rows could run as one group (the reference the
    grouped path is tested against, and what a benchmark compares it with). pool_rows: move each joining
    sequence prefilled on its own into a slot of one shared block (keydiff.cache.rowpool.JoinPool: a copy of its
    entries in, and one out when a later sequence takes the slot), so that such sequences group like forks
    (measured: the copy pays for itself within a 16-token generation on CPU, and on a GPU, where a row's kernel
    launches dominate a step, at once; docs/performance.md). Outputs are the same either way.
    """
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    source = iter(requests)
    device = next(model.parameters()).device
    batch = BatchCache(model.config.get_text_config().num_hidden_layers, group_rows)
    pool = JoinPool(int(batch_size)) if group_rows and pool_rows and batch_size > 1 else None
    active: list[_Slot] = []
    exhausted = False
    while True:
        while not exhausted and len(active) < batch_size:
            request = next(source, None)  # may run a prefill (its own keydiff_attention, timed by itself)
            if request is None:
                exhausted = True
            else:
                active.append(_Slot(request))
                if pool is not None:
                    pool.place(active[-1].cache)
        if not active:
            return
        finished: list[_Slot] = []
        # One switch of the attention function for all the steps until a sequence stops (a switch walks every
        # module); outside it, the caller's code and the next prompts' prefills run with the model as it was.
        with keydiff_attention(model, batch):
            while active and not finished:
                active, finished = _step(model, batch, active, device)
        for slot in finished:
            if pool is not None:
                pool.stop(slot.cache)
            yield slot.request.key, slot.result()
