"""One layer with head-adaptive budgets (AdaKV): a pool of per-head segments that holds at most the layer's total.

With head-adaptive budgets (keydiff.policies.adakv) the heads of a layer keep different numbers of entries,
T = kv_heads x N in all. Dense [batch, kv_heads, entries, dim] buffers would have to be as long as the
largest head, i.e. hold up to kv_heads x T entries (and kvpress's `AdaKVPress` keeps the whole prompt and
masks it). Here a layer is one pool instead:

    keys/values [batch, P, dim], positions [batch, P], policy state {name: [batch, P]},   P = kv_heads x (N + B)

the same bytes as the uniform buffers [batch, kv_heads, N + B, dim]. Every (batch row, KV head) owns a
contiguous segment [start, start + count) of its row, in no fixed order of heads, with free cells after it
up to the next segment (`limit`). What a layer holds is therefore at most T + kv_heads x B entries (T after
eviction, plus the block being processed), never more, whatever the split between heads.

Writes. A pass's q new entries of each head are appended at the end of that head's segment, so a segment is
always "kept entries, then the pass's own tokens": attention over one segment with the bottom-right causal
mask is exact (keydiff.attention computes each head over its own segment, SDPA per batch row and KV head).
If some head has no room for q more, the row is laid out again first (`relayout`: every segment moved to
the front of its new place, the free cells shared evenly between heads; a transient gather of one row of
one layer). When the pool itself is too small (e.g. keeping every generated token), it grows (counted in
`allocations`).

Eviction. Each head is viewed on its own (a `LayerView` of batch 1 and one KV head: its entries, its
attention statistic, its group's slice of the query statistics), the policy's `keep_heads` chooses what
every head of the row keeps (a global top-k over the row's heads), and each segment is compacted in place:
its surviving entries past the new count move into the cells of its dropped ones (only moved entries are
written, as in keydiff.cache.storage). Decoding (B = 1) runs the same global choice after every token; a
head that gains an entry uses its free cells, and the row is laid out again only when some head has none
left (every ~B tokens at most), so the per-token cost is the scoring plus a few moved entries. (Freezing each
head's count after prefill and replacing in place would need the same per-head scoring and stop adapting.)

All layers at once. The cache gives its bounded head-adaptive layers one allocation (`PoolStack`, each pool a
plane of it) and, for a scorer that scores whole pools (KeyDiff: `Policy.scores_pools`), evicts every layer in
one call (`evict_stack` -> `evict_pools`): one cell -> head map for all rows, the policy's `drop_pool` (AdaKV's
choice over every row at once) and one gather and scatter per buffer for the same moves as `compact`. Other
scorers are chosen head by head, layer by layer, as above. A pool that grows leaves the stack.

A pool is not what transformers' own attention functions expect: such a layer must run under
`keydiff.keydiff_attention(model, cache)` (the cache refuses otherwise).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from keydiff.cache.layer import EvictingLayer, refuse_batch_change
from keydiff.cache.storage import empty_buffers
from keydiff.policies.base import LayerView, Policy, PoolView


class PoolStack:
    """The pools of several head-adaptive layers in one allocation, [layers, batch, P, ...]: what lets one
    eviction score, choose and compact every layer's rows in one set of kernels (`evict_pools`), as the uniform
    cache's stack does for dense layers. A decoding step otherwise costs a few dozen small kernels per layer.

    Each layer's `AdaptiveStorage` still owns its segments and counts; only its buffers are views of its plane
    here (`claim`). A layer whose first pass does not fit (other batch, heads, head dim, dtype) or whose pool
    must grow takes buffers of its own, and the layers are then evicted one by one.
    """

    def __init__(self, layers: tuple[int, ...]):
        self.layers = layers
        self.keys: torch.Tensor | None = None  # [layers, batch, P, dim]
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [layers, batch, P] long
        self.state: dict[str, torch.Tensor] = {}  # name -> [layers, batch, P] float32
        self.shape: tuple | None = None

    def claim(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, per_head: int,
              state_names: tuple[str, ...]) -> tuple | None:
        """(keys, values, positions, state) of `layer`'s plane for a first pass like `key_states` with `per_head`
        cells per KV head; the first claim allocates every layer's plane (zero-filled). None if it does not fit."""
        batch, heads = key_states.shape[:2]
        shape = (batch, heads, key_states.shape[-1], value_states.shape[-1], key_states.dtype, value_states.dtype,
                 key_states.device, per_head)
        if self.keys is None:
            keys, values, positions, state = empty_buffers(len(self.layers), key_states[:, :1], value_states[:, :1],
                                                           heads * per_head, state_names)
            self.keys, self.values, self.positions = keys[:, :, 0].zero_(), values[:, :, 0].zero_(), positions[:, :, 0].zero_()
            self.state = {name: buffer[:, :, 0] for name, buffer in state.items()}
            self.shape = shape
        elif shape != self.shape:
            return None
        plane = self.layers.index(layer)
        return self.keys[plane], self.values[plane], self.positions[plane], {n: b[plane] for n, b in self.state.items()}

    def rows(self) -> list[torch.Tensor]:
        """Every buffer with the layers' rows flattened, [layers x batch, P, ...] (views)."""
        return [buffer.flatten(0, 1) for buffer in (self.keys, self.values, self.positions, *self.state.values())]


class AdaptiveStorage:
    """The pool of one head-adaptive layer: per-head segments, one entry count per (batch row, KV head).

    budget: N, so the layer keeps kv_heads x N entries in all. capacity: cells per KV head the pool is first
    allocated with (N + B, so the pool is kv_heads x (N + B); None: sized from the first pass).
    """

    def __init__(self, layer: int, budget: int, capacity: int | None, state_names: tuple[str, ...] = (),
                 entry_state: Callable[[LayerView], dict[str, torch.Tensor]] | None = None,
                 needs_output_projection: bool = False, stack: PoolStack | None = None):
        self.layers = (layer,)
        self.stack = stack  # the shared allocation this layer's pool is a plane of, if any (see `in_stack`)
        self.in_stack = False
        self.placement = None  # never in a block of other sequences' stacks (keydiff.batching.blocks.poolable)
        self.budget, self.capacity = budget, capacity
        self.state_names, self.entry_state = state_names, entry_state
        self.needs_output_projection = needs_output_projection  # entry_state reads it (CriticalKV)
        self.fresh = 0  # entries at the end of every segment whose policy state is not set yet (`initialize_state`)
        self.output_projection: list[torch.Tensor | None] = [None]  # the layer's o_proj weight (CriticalKV)
        self.keys: torch.Tensor | None = None  # [batch, P, dim]
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [batch, P] long
        self.state: dict[str, torch.Tensor] = {}  # name -> [batch, P] float32
        self.heads = 0  # KV heads (known from the first pass)
        self.starts: list[list[int]] = []  # [batch][head]: first cell of the head's segment
        self.counts: list[list[int]] = []  # [batch][head]: entries the head holds
        self.limits: list[list[int]] = []  # [batch][head]: first cell past the head's free cells
        # The attention statistic of the last pass ([batch][head] -> [count] float32) and the query moments.
        self.attention: list[Any] = [None]
        self.queries: list[Any] = [None]
        self.seen = 0
        self.max_total = 0  # peak entries held by one batch row of the layer (all heads), during a pass included
        self.allocations = 0
        self.served = True  # whether keydiff's attention function computed the last pass (see `segments`)

    count = 1
    max_scratch_entries = 0  # scratch passes (KVzip's reconstruction) are not supported: see `begin_scratch`
    scratch_kept = None

    def begin_scratch(self) -> None:
        raise RuntimeError(f"{self.where()}: scratch passes (KVzip's reconstruction) are not supported with "
                           "head-adaptive budgets")

    def end_scratch(self) -> None:
        pass

    def where(self) -> str:
        return f"layer {self.layers[0]} (head-adaptive)"

    # --- sizes ----------------------------------------------------------------------------------
    @property
    def pool(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def row_totals(self) -> list[int]:
        return [sum(row) for row in self.counts]

    @property
    def total_budget(self) -> int:
        """T = kv_heads x N: what the layer keeps in all after eviction (per batch row)."""
        return self.heads * self.budget

    @property
    def num_entries(self) -> int:
        """Entries per KV head averaged over the heads (the fullest batch row's), rounded up: <= N exactly when
        the layer holds no more than its total, so comparisons with the budget mean what they do elsewhere."""
        return math.ceil(max(self.row_totals(), default=0) / self.heads) if self.heads else 0

    @property
    def max_entries(self) -> int:
        """Peak entries per KV head averaged over the heads, rounded up (the peak total is `max_total`)."""
        return math.ceil(self.max_total / self.heads) if self.heads else 0

    def entries_after_eviction(self) -> int:
        return min(self.num_entries, self.budget)

    def pending(self) -> bool:
        return max(self.row_totals(), default=0) > self.total_budget or self.attention[0] is not None

    # --- layout ---------------------------------------------------------------------------------
    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, per_head: int) -> None:
        """First buffers: `per_head` cells for every KV head, the segments at equal distances."""
        batch, heads = key_states.shape[:2]
        self.heads = heads
        claimed = None if self.stack is None else self.stack.claim(self.layers[0], key_states, value_states, per_head,
                                                                   self.state_names)
        if claimed is not None:
            self.keys, self.values, self.positions, self.state = claimed
        else:  # zero-filled: a free cell's values must be finite (scored with weight 0 by `evict_pools`)
            keys, values, positions, state = empty_buffers(1, key_states[:, :1], value_states[:, :1], heads * per_head,
                                                           self.state_names)
            self.keys, self.values, self.positions = keys[0, :, 0].zero_(), values[0, :, 0].zero_(), positions[0, :, 0]
            self.state = {name: s[0, :, 0] for name, s in state.items()}
        self.in_stack = claimed is not None
        self.starts = [[h * per_head for h in range(heads)] for _ in range(batch)]
        self.limits = [[(h + 1) * per_head for h in range(heads)] for _ in range(batch)]
        self.counts = [[0] * heads for _ in range(batch)]
        self.allocations += 1

    def buffers(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.positions, *self.state.values()]

    def relayout(self, room: int) -> None:
        """Lay every row out again: each head's entries at the front of its new segment, the free cells shared
        evenly (at least `room` per head; the pool grows, at least doubling, if it cannot give that: only when
        generated tokens are all kept, since a bounded pool, kv_heads x (N + B), holds T plus a block)."""
        heads = self.heads
        needed = max(self.row_totals()) + heads * room
        if needed > self.pool:  # grow (at least double): new buffers, the valid entries copied over
            old = self.buffers()
            keys, values, positions, state = empty_buffers(1, self.keys[:, None, :1], self.values[:, None, :1],
                                                           max(needed, 2 * self.pool), self.state_names)
            self.keys, self.values, self.positions = keys[0, :, 0].zero_(), values[0, :, 0].zero_(), positions[0, :, 0]
            self.in_stack = False  # buffers of its own from now on
            self.state = {name: s[0, :, 0] for name, s in state.items()}
            new = self.buffers()
            self.allocations += 1
        else:
            old = new = self.buffers()
        device = self.keys.device
        for row in range(len(self.counts)):
            counts = self.counts[row]
            share = (self.pool - sum(counts)) // heads
            starts, limits, start = [], [], 0
            for count in counts:
                starts.append(start)
                start += count + share
                limits.append(start)
            sources = torch.cat([torch.arange(s, s + c, device=device) for s, c in zip(self.starts[row], counts)])
            targets = torch.cat([torch.arange(s, s + c, device=device) for s, c in zip(starts, counts)])
            for source, target in zip(old, new):
                target[row].index_copy_(0, targets, source[row].index_select(0, sources))  # gather first: no overlap
            self.starts[row], self.limits[row] = starts, limits

    def make_room(self, per_head: int) -> None:
        """Make sure every head has `per_head` free cells (before decoding that keeps every token)."""
        if self.keys is not None and any(s + c + per_head > lim for sr, cr, lr in zip(self.starts, self.counts, self.limits)
                                         for s, c, lim in zip(sr, cr, lr)):
            self.relayout(per_head)

    # --- writes ---------------------------------------------------------------------------------
    def write(self, plane: int, key_states: torch.Tensor, value_states: torch.Tensor,
              layer_seen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a pass's q entries [batch, kv_heads, q, dim] to every head's segment; return the pools."""
        batch, heads, q = key_states.shape[:3]
        if layer_seen != self.seen:
            raise RuntimeError(
                f"layer {self.layers[0]} was given tokens {layer_seen}..{layer_seen + q - 1} while the cache is at "
                f"token {self.seen}: every layer must see every forward pass, in order"
            )
        if self.keys is None:
            planned = self.capacity or q
            self.allocate(key_states, value_states, max(planned, q, self.budget + 1))
        else:
            self.make_room(q)
        device = key_states.device
        pool = self.pool
        first = torch.tensor([[row * pool + s + c for s, c in zip(sr, cr)] for row, (sr, cr)
                              in enumerate(zip(self.starts, self.counts))], device=device)
        if q == 1:  # decoding: a few kernels fewer per layer and token
            cells = first.view(-1)
            new_positions = torch.full((batch * heads,), self.seen, device=device)
        else:
            cells = (first[..., None] + torch.arange(q, device=device)).reshape(-1)  # [batch * heads * q]
            new_positions = torch.arange(self.seen, self.seen + q, device=device).repeat(batch * heads)
        self.keys.view(batch * pool, -1).index_copy_(0, cells, key_states.reshape(batch * heads * q, -1))
        self.values.view(batch * pool, -1).index_copy_(0, cells, value_states.reshape(batch * heads * q, -1))
        self.positions.view(-1).index_copy_(0, cells, new_positions)
        if self.state:
            if self.fresh or (self.needs_output_projection and self.output_projection[0] is None):
                self.fresh += q  # set by `initialize_state` before the entries are next viewed
            else:  # the usual case: set now, from the pass's own dense states (no gather)
                self.set_state(cells, key_states, value_states, new_positions.view(batch, heads, q))
        self.counts = [[c + q for c in row] for row in self.counts]
        self.seen += q
        self.max_total = max(self.max_total, max(self.row_totals()))
        self.served = False
        return self.keys, self.values

    def segments(self) -> list[list[tuple[int, int]]]:
        """(start, count) of every head's segment, [batch][head]: what keydiff's attention function computes
        each head over. Asking marks the pass as served by it (the check in `require_served`)."""
        self.served = True
        return [list(zip(sr, cr)) for sr, cr in zip(self.starts, self.counts)]

    def require_served(self) -> None:
        if not self.served:
            raise RuntimeError(
                f"{self.where()} was computed by an attention function other than keydiff's: head-adaptive "
                "budgets hold each head's entries in a pool only keydiff attention reads. Run the model inside "
                "`with keydiff.keydiff_attention(model, cache):` (keydiff.prefill and keydiff.generate do)"
            )

    def set_state(self, cells: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Set the policy state of the entries at `cells` (flat pool indices, row-major [batch, kv_heads, q])
        from a dense view of them (keys/values [batch, kv_heads, q, dim], positions [batch, kv_heads, q]): the
        policy's `entry_state` with the layer's whole o_proj weight, so that a function of each entry (KeyDiff's,
        LagKV's, CriticalKV's ||W_o v||_1 per KV group) sees them as it sees a uniform layer's, in one call."""
        initial = {}
        if self.entry_state is not None:
            initial = self.entry_state(LayerView(keys=keys, values=values, positions=positions, attention=None,
                                                 state={}, layers=self.layers,
                                                 output_projection=self.output_projection[0]))
        for name, buffer in self.state.items():
            value = initial.get(name)
            fresh = torch.zeros(cells.shape[0], device=cells.device) if value is None else value.reshape(-1).float()
            buffer.view(-1).index_copy_(0, cells, fresh)

    def initialize_state(self) -> None:
        """Set the policy state of the entries whose state `write` deferred: those of a policy that needs the
        output projection, written before the attention function first recorded it (the layer's first pass).
        Every head got the same passes, so they are the last `fresh` of every segment (relayout keeps a
        segment's order; nothing is compacted before this runs): gathered into one dense view for `set_state`.
        """
        fresh, self.fresh = self.fresh, 0
        if not fresh or self.keys is None:
            return
        batch, pool = len(self.counts), self.pool
        device = self.keys.device
        first = torch.tensor([[row * pool + s + c - fresh for s, c in zip(sr, cr)] for row, (sr, cr)
                              in enumerate(zip(self.starts, self.counts))], device=device)
        cells = (first[..., None] + torch.arange(fresh, device=device)).reshape(-1)  # [batch * heads * fresh]
        shape = (batch, self.heads, fresh)
        self.set_state(cells, self.keys.view(batch * pool, -1).index_select(0, cells).view(*shape, -1),
                       self.values.view(batch * pool, -1).index_select(0, cells).view(*shape, -1),
                       self.positions.view(-1).index_select(0, cells).view(shape))

    # --- views and eviction -----------------------------------------------------------------------
    def head_output_projection(self, head: int) -> torch.Tensor | None:
        """The o_proj columns of KV head `head`'s group of query heads (query head j reads KV head
        j // groups, transformers' repeat_kv): what a one-head view's `output_projection` is, so that a policy
        mapping heads as for a dense layer (keydiff.policies.criticalkv.output_norms) reads this head's."""
        weight = self.output_projection[0]
        if weight is None:
            return None
        width = weight.shape[1] // self.heads
        return weight[:, head * width:(head + 1) * width]

    def view_head(self, row: int, head: int) -> LayerView:
        """One head of one batch row as a policy sees it: batch 1, one KV head, its own entries."""
        start, count = self.starts[row][head], self.counts[row][head]
        part = slice(start, start + count)
        attention, queries = self.attention[0], self.queries[0]
        if queries is not None and queries.total is not None:
            groups = queries.total.shape[1] // self.heads
            queries = queries.heads(row, head * groups, groups)
        return LayerView(
            keys=self.keys[row, part][None, None],
            values=self.values[row, part][None, None],
            positions=self.positions[row, part][None, None],
            attention=None if attention is None else attention[row][head][None, None],
            state={name: buffer[row, part][None, None] for name, buffer in self.state.items()},
            layers=self.layers,
            queries=queries,
            output_projection=self.head_output_projection(head),
        )

    def evict(self, policy: Policy, inv_freq: torch.Tensor | None = None, rotary_end: int | None = None,
              drop: bool = True) -> None:
        """Observe the last pass's statistics, then keep T entries per batch row (the policy's `keep_heads`);
        drop=False observes only (EvictingCache.evict).
        `inv_freq`/`rotary_end` (key re-rotation, as `Storage.evict`): re-rotation is not supported with
        head-adaptive budgets (build_policy refuses the combination; a policy composed by hand fails here)."""
        if policy.key_rerotation is not None:
            raise RuntimeError(f"{self.where()}: key re-rotation is not supported with head-adaptive budgets")
        if self.keys is None:
            self.attention = [None]
            return
        self.require_served()
        self.initialize_state()
        over = [row for row, total in enumerate(self.row_totals()) if drop and total > self.total_budget]
        recorded = self.attention[0] is not None
        if recorded:
            for row in range(len(self.counts)):
                for head in range(self.heads):
                    policy.observe(self.view_head(row, head))
        if over:
            if policy.attention_rows != 0 and not recorded:
                raise RuntimeError(f"policy {policy.name!r} needs attention statistics but none were recorded in "
                                   f"{self.where()}: run the model inside `with keydiff.keydiff_attention(model, cache):`")
            if policy.needs_queries and self.queries[0] is None:
                raise RuntimeError(f"policy {policy.name!r} needs query statistics but none were recorded in "
                                   f"{self.where()}: run the model inside `with keydiff.keydiff_attention(model, cache):`")
            if chooses_pools(policy):
                evict_pools([self], self.buffers(), policy, self.budget)
            else:
                for row in over:
                    keep = policy.keep_heads([self.view_head(row, head) for head in range(self.heads)], self.budget)
                    self.compact(row, keep)
        self.attention = [None]

    def compact(self, row: int, keep: list[torch.Tensor]) -> None:
        """Keep the entries `keep` marks (bool [count] per head) in place: in each segment, the kept entries
        past its new count move into its dropped cells below it (k-th such source to the k-th such hole)."""
        holes, sources, counts = [], [], []
        for start, count, mask in zip(self.starts[row], self.counts[row], keep):
            kept = int(mask.sum())
            counts.append(kept)
            if kept < count:  # a head that kept everything moves nothing
                holes.append(start + (~mask[:kept]).nonzero().squeeze(1))
                sources.append(start + kept + mask[kept:].nonzero().squeeze(1))
        if holes:
            holes, sources = torch.cat(holes), torch.cat(sources)
            if holes.numel():
                for buffer in self.buffers():
                    buffer[row].index_copy_(0, holes, buffer[row].index_select(0, sources))
        self.counts[row] = counts

    def kept_positions(self) -> torch.Tensor:
        """Positions held, [batch, kv_heads, most any head holds], ascending per head, padded with -1 at the end."""
        batch, heads = len(self.counts), self.heads
        width = max((c for row in self.counts for c in row), default=0)
        out = torch.full((batch, heads, width), -1, dtype=torch.long, device=self.positions.device)
        for row in range(batch):
            for head in range(heads):
                start, count = self.starts[row][head], self.counts[row][head]
                out[row, head, :count] = self.positions[row, start : start + count].sort().values
        return out

    def head_counts(self) -> list[list[int]]:
        """Entries each head holds, [batch][head] (copies)."""
        return [list(row) for row in self.counts]


def chooses_pools(policy: Policy) -> bool:
    """Whether `policy` chooses on whole pools (`evict_pools`): a head-adaptive policy whose scorer scores pools
    and needs no attention or query statistics (KeyDiff, kept out of every wrapper but HeadAdaptive)."""
    return policy.chooses_pools and policy.attention_rows == 0 and not policy.needs_queries


def evict_pools(storages: list[AdaptiveStorage], buffers: list[torch.Tensor], policy: Policy, budget: int) -> None:
    """Choose and compact the rows of `storages` in one set of kernels: each storage's batch rows, in order, are
    the rows of `buffers` (keys, values, positions, then the policy state: [rows, P, ...], one pool size).

    The choice is `policy.drop_pool` (AdaKV over whole pools), the moves the same as `compact`'s: in every
    segment, the k-th surviving entry past the new count moves into the k-th dropped cell below it (one
    gather and one scatter per buffer for all rows), so the layout is what row-by-row eviction leaves."""
    keys, values, positions, *states = buffers
    device, (rows, pool_size) = keys.device, keys.shape[:2]
    starts = torch.tensor([row for storage in storages for row in storage.starts], device=device)  # [rows, heads]
    counts = torch.tensor([row for storage in storages for row in storage.counts], device=device)
    cells = torch.arange(pool_size, device=device)
    member = (cells >= starts[..., None]) & (cells < (starts + counts)[..., None])  # [rows, heads, P]
    # Segments lie in head order (`allocate` and `relayout` place them so; compaction never moves a start):
    # a cell's head is the number of later heads whose segment starts at or before it.
    owner = (cells >= starts[:, 1:, None]).sum(dim=1)  # [rows, P]
    view = PoolView(keys=keys, positions=positions, state=dict(zip(storages[0].state_names, states)),
                    member=member, owner=owner, counts=counts)
    dropped = policy.drop_pool(view, budget)  # bool [rows, P]
    kept_counts = counts - torch.zeros_like(counts).scatter_add_(1, owner, dropped.long())
    new_ends = (starts + kept_counts).gather(1, owner)  # each cell's segment's new end
    holes = (dropped & (cells < new_ends)).view(-1).nonzero().squeeze(1)
    sources = (view.valid & ~dropped & (cells >= new_ends)).view(-1).nonzero().squeeze(1)
    if holes.numel():
        for buffer in buffers:
            flat = buffer.view(rows * pool_size, -1) if buffer.dim() == 3 else buffer.view(-1)
            flat.index_copy_(0, holes, flat.index_select(0, sources))
    kept = kept_counts.tolist()
    for storage in storages:
        storage.counts, kept = kept[: len(storage.counts)], kept[len(storage.counts):]


def evict_stack(storages: list[AdaptiveStorage], policy: Policy) -> bool:
    """Evict every storage of one `PoolStack` at once (`evict_pools` over all their rows) if it can: all are
    cells of the same stack, in its order, have been written and chose by pools. False: evict them one by one."""
    stack = storages[0].stack if storages else None
    if (stack is None or stack.keys is None or not chooses_pools(policy) or policy.key_rerotation is not None
            or [s.layers[0] for s in storages] != list(stack.layers) or not all(s.in_stack for s in storages)):
        return False  # (the cache plans a stack only for layers of one budget; `in_stack`: written into it)
    for storage in storages:
        storage.require_served()
        storage.initialize_state()
    if any(total > storage.total_budget for storage in storages for total in storage.row_totals()):
        evict_pools(storages, stack.rows(), policy, storages[0].budget)
    for storage in storages:
        storage.attention = [None]
    return True


class AdaptiveLayer(EvictingLayer):
    """A layer of an evicting cache on an `AdaptiveStorage` (its pool is `keys`/`values`: [batch, P, dim])."""

    def __init__(self, storage: AdaptiveStorage, layer_idx: int):
        super().__init__(storage.budget, storage.capacity, layer_idx=layer_idx, storage=storage)

    @property
    def keys(self) -> torch.Tensor | None:
        """[batch, P, dim]: the pool; head h of row b holds keys[b, start:start + count] (`storage.segments`)."""
        return self.storage.keys

    @property
    def values(self) -> torch.Tensor | None:
        return self.storage.values

    @property
    def positions(self) -> torch.Tensor | None:
        """[batch, P] absolute positions of the pool's cells (valid inside the segments only)."""
        return self.storage.positions

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.storage.state

    @property
    def max_total_entries(self) -> int:
        return self.storage.max_total

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = self.storage.keys
        refuse_batch_change(None if keys is None else keys.shape[0], key_states.shape[0])
        self.storage.require_served()
        keys, values = self.storage.write(0, key_states, value_states, self.seen)
        self.seen += key_states.shape[-2]
        self.returned_keys = keys
        return keys, values

    def view(self, layer_idx: int | None = None) -> LayerView:
        raise NotImplementedError(f"layer {self.layer_idx} has head-adaptive budgets: its heads hold different "
                                  "numbers of entries; use storage.view_head(row, head)")

    def kept_positions(self) -> torch.Tensor:
        """Absolute positions held, [batch, kv_heads, most any head holds], ascending, padded with -1 at the end."""
        return self.storage.kept_positions()

    def held_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [1, 1, n], values [1, 1, n, dim]) of head 0 of row 0: what the re-fed prompt check compares."""
        view = self.storage.view_head(0, 0)
        return view.positions, view.values

    def reset(self) -> None:
        old = self.storage
        self.storage = AdaptiveStorage(old.layers[0], old.budget, old.capacity, old.state_names, old.entry_state,
                                       old.needs_output_projection)
        self.seen, self.returned_keys, self.earlier_allocations, self.is_initialized = 0, None, 0, False


__all__ = ["AdaptiveLayer", "AdaptiveStorage", "PoolStack", "chooses_pools", "evict_pools", "evict_stack"]
