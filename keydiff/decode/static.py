"""The step in fixed shapes: once every row's bounded cache is full, a pass and its eviction never change shape, so
`StaticStep` compiles or captures it as a CUDA graph and replays it. Design: docs/design/decode.md#fixed-shapes-staticpy
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from keydiff.attention import REGISTERED, STATISTIC_KWARG, StatisticBuffer, bound_to
from keydiff.decode.graphs import CudaCalls, calls_for, stand_in_graphs, timed  # noqa: F401 - re-exported
from keydiff.cache.evict import Rows, evict, write_active
from keydiff.device import out_of_memory
from keydiff.policies.base import Policy

LOG = logging.getLogger(__name__)


def statistic_buffer(rows: Rows, policy: Policy, keys: int) -> StatisticBuffer:
    """A float32 buffer for every layer's statistic over `keys` entries, laid out so it flattens to the R rows."""
    kv_heads, planes = rows.base["keys"].shape[3], len(rows.planes)
    shape = (rows.width, planes) if rows.slot_major else (planes, rows.width)
    buffer = torch.zeros(*shape, kv_heads, keys, dtype=torch.float32, device=rows.sequence_of.device)
    return StatisticBuffer(buffer, rows.planes, rows.slot_major, policy.needs.attention_rows, policy.needs.attention_reduction)


class _FixedLayer(CacheLayerMixin):
    """One layer of `FixedCache`: writes a pass into entries [N, N + q) of its active rows and returns all N + q."""

    is_sliding = False
    is_compileable = True

    def __init__(self, rows: Rows, layer_idx: int, kept: int, active: torch.Tensor):
        super().__init__()
        self.rows, self.layer_idx, self.kept, self.active, self.is_initialized = rows, layer_idx, kept, active, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.rows.layer(self.layer_idx)
        stop = self.kept + key_states.shape[-2]
        write_active(keys[:, :, self.kept : stop], key_states, self.active)
        write_active(values[:, :, self.kept : stop], value_states, self.active)
        return keys[:, :, :stop], values[:, :, :stop]

    def get_seq_length(self) -> int:
        return self.kept

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kept + query_length, 0

    def get_max_length(self) -> int:
        return self.kept


class FixedCache(Cache):
    """The transformers Cache a fixed-shape pass runs with: every layer's W rows, N kept entries each."""

    def __init__(self, rows: Rows, kept: int, num_layers: int, active: torch.Tensor):
        super().__init__(layers=[_FixedLayer(rows, i, kept, active) for i in range(num_layers)])


@dataclass
class StepStats:
    """What a run's decoding steps did (`decoder.stats`), as host counts: summary.json's decode_graphs and decode_steps.
    After one failed capture the run stops capturing and runs eagerly, with the same results."""

    captured: int = 0
    failed: int = 0
    reasons: list[str] = field(default_factory=list)  # each distinct one once
    stopped: bool = False
    capture_s: float = 0.0
    warm_up_s: float = 0.0
    pool_bytes: int = 0
    built: list[tuple[int, int]] = field(default_factory=list)  # (W, q) of every fixed-shape step built, in order
    runs: Counter = field(default_factory=Counter)  # (W, q) -> fixed-shape step runs
    arenas: list[int] = field(default_factory=list)  # slots of every shared arena made (join pool, prefill slot)
    slot_copies_in: int = 0  # stacks copied into an arena slot
    slot_copies_out: int = 0  # stacks copied out of one (a stopped sequence's entries, a prefill leaving its slot)
    steps: int = 0  # decoding steps (forward passes of the going sequences)
    group_sizes: Counter = field(default_factory=Counter)  # rows per group of an ordinary pass -> groups
    # Per ordinary pass, its groups' members (batch indices, in slot order); None: not kept ([] keeps them).
    groups: list[list[list[int]]] | None = None
    _resources: dict = field(default_factory=dict, repr=False, compare=False)
    _alive: dict = field(default_factory=dict, repr=False, compare=False)  # the graphs in each pool (weakly)

    def grouped(self, groups: list[list[int]]) -> None:
        """Count an ordinary pass's groups (each one's members in slot order)."""
        self.group_sizes.update(len(members) for members in groups)
        if self.groups is not None:
            self.groups.append(groups)

    def fail(self, reason: str) -> None:
        self.failed += 1
        if not self.stopped:
            LOG.warning("a fixed-shape step could not be captured as a CUDA graph (%s); the run captures no more "
                        "graphs and runs its fixed-shape steps eagerly", reason)
        self.stopped = True
        if reason not in self.reasons:
            self.reasons.append(reason)

    def stream_and_pool(self, calls: CudaCalls, device: torch.device) -> tuple[Any, Any]:
        """The run's capture stream and graph pool on `device`; the pool is made anew once every graph captured into it
        was released (CUDA's allocator can assert on a pool with no graph left)."""
        key = (calls.name, str(device))
        if key not in self._resources:
            self._resources[key] = (calls.stream(device), calls.pool(device))
        elif not self._alive.get(key):
            self._resources[key] = (self._resources[key][0], calls.pool(device))
        return self._resources[key]

    def captured_into(self, calls: CudaCalls, device: torch.device, graph: Any) -> None:
        """Count `graph` among the live graphs of the run's pool on `device` (until it is released)."""
        self._alive.setdefault((calls.name, str(device)), weakref.WeakSet()).add(graph)

    def record(self) -> dict[str, Any]:
        return {"captured": self.captured, "failed": self.failed, "reasons": list(self.reasons),
                "stopped": self.stopped, "capture_s": round(self.capture_s, 6), "warm_up_s": round(self.warm_up_s, 6),
                "pool_bytes": self.pool_bytes}

    def steps_record(self) -> dict[str, Any]:
        """The fixed-shape steps built and run, the shared arenas made and the copies into and out of their slots."""
        return {"built": [list(key) for key in self.built], "runs": [[*key, n] for key, n in sorted(self.runs.items())],
                "arenas": list(self.arenas), "slot_copies_in": self.slot_copies_in,
                "slot_copies_out": self.slot_copies_out, "steps": self.steps}


class StaticStep:
    """One pass of q tokens for the W rows of `rows` (each at N = `budget` entries) and the eviction after it, in fixed
    shapes. `run(ids, positions, active)` -> next-token logits [W, vocab]; inactive rows' eviction is masked."""

    def __init__(self, model: torch.nn.Module, rows: Rows, policy: Policy, budget: int, q: int = 1,
                 compiled: bool = False, stats: StepStats | None = None):
        self.model, self.rows, self.policy, self.budget, self.q = model, rows, policy, budget, q
        self.stats = stats if stats is not None else StepStats()  # the run's record
        device = rows.sequence_of.device
        self.ids = torch.zeros(rows.width, q, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows.width, q, dtype=torch.long, device=device)
        self.active = torch.ones(rows.width, dtype=torch.bool, device=device)
        self.cache = FixedCache(rows, budget, model.config.get_text_config().num_hidden_layers, self.active)
        # Attention policies: each layer's statistic over its N + q entries, in a buffer allocated once.
        self.statistic = None if policy.needs.attention_rows == 0 else statistic_buffer(rows, policy, budget + q)
        self.model_kwargs = {} if self.statistic is None else {STATISTIC_KWARG: self.statistic}
        self.logits: torch.Tensor | None = None
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.device = device
        # The CUDA calls it captures through (torch.cuda's, or the CPU stand-in's), bound to the model's device.
        self.cuda = calls_for(device)
        # (a compiled step is captured on CUDA; the CPU stand-in, which records through a dispatch mode that
        # torch.compile does not trace under, runs it uncaptured)
        self.capture = self.cuda is not None and (not compiled or self.cuda.records_compiled)
        self.step = torch.compile(self.eager, fullgraph=True, dynamic=False) if compiled else self.eager

    def eager(self, ids: torch.Tensor, positions: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The pass and its eviction on the given tensors (no host synchronisation), with no cache bound for the
        attention function; an attention-scoring policy's statistic is written into `statistic`."""
        logits = self.forward(ids, positions)
        self.evict(positions, active)
        return logits

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The pass alone: the new entries written, next-token logits [W, vocab] (float32), the statistic if any."""
        output = self.model(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=1,
                            **self.model_kwargs)
        return output.logits[:, -1, :].float()

    def evict(self, positions: torch.Tensor, active: torch.Tensor) -> None:
        """What `Storage.write` leaves to eviction (the new entries' positions), then `Storage.evict`'s eviction
        for all R rows at once (keydiff.cache.evict.evict), the idle rows' masked."""
        n, stop = self.budget, self.budget + self.q
        row_active = active[self.rows.sequence_of]  # [R]
        rows = self.rows.buffers()
        new_positions = positions[self.rows.sequence_of][:, None, :].expand_as(rows["positions"][:, :, n:stop])
        write_active(rows["positions"][:, :, n:stop], new_positions, row_active)
        attention = None
        if self.statistic is not None:  # [R, kv_heads, N + q], rows in the order of the buffers'
            attention = self.statistic.buffer.view(-1, *self.statistic.buffer.shape[2:])
        evict(self.rows, stop, n, self.policy, {"attention": attention}, fresh=n, active=row_active,
              where="the fixed-shape step")

    def run(self, ids: torch.Tensor, positions: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The step on these inputs (copied into the step's own buffers); next-token logits [W, vocab] (a copy)."""
        if self.statistic is not None and self.model.config._attn_implementation not in REGISTERED.values():
            raise RuntimeError(f"policy {self.policy.name!r} needs attention statistics, which only keydiff's "
                               "attention function writes: run the step inside `with keydiff.keydiff_attention(model, "
                               "...):`")
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.active.copy_(active)
        self.calls += 1
        with bound_to(None):
            if self.calls == 1:  # the first runs eagerly: real work, the warm-up, the score and statistic checks
                return self.warm_up()
            if self.graph is None and not (self.capture and not self.stats.stopped and self.record()):
                return self.step(self.ids, self.positions, self.active).clone()
        self.graph.replay()
        return self.logits.clone()

    def warm_up(self) -> torch.Tensor:
        """The first call, eagerly, on a side stream of the model's device (graph capture wants its kernels' first runs
        off the stream it records); the logits are marked used on the current stream (record_stream)."""
        if not self.capture or self.stats.stopped:
            return self.first_call()
        calls, device = self.cuda, self.device
        start = timed(calls, device)
        current = calls.current_stream(device)
        side = calls.stream(device)
        side.wait_stream(current)
        with calls.use(side):
            logits = self.first_call()
        current.wait_stream(side)
        calls.record_stream(logits, current)
        seconds = timed(calls, device) - start
        self.stats.warm_up_s += seconds
        self.stats.capture_s += seconds
        return logits

    def first_call(self) -> torch.Tensor:
        """The eager step, checking before eviction that every layer wrote its statistic (refused otherwise)."""
        logits = self.forward(self.ids, self.positions)
        missing = [] if self.statistic is None else sorted(set(self.rows.planes) - self.statistic.written)
        if missing:
            raise RuntimeError(f"policy {self.policy.name!r}: layers {missing} wrote no attention statistic in the "
                               "fixed-shape step (the model's forward does not pass keyword arguments to its attention "
                               "function); run it with fixed_shapes=False")
        self.evict(self.positions, self.active)
        return logits.clone()

    def record(self) -> bool:
        """Capture the step as a CUDA graph on the run's stream and pool, begin and end in try/finally. False if the
        capture fails: the run then captures no more (`StepStats.fail`) and this step runs eagerly."""
        calls, device = self.cuda, self.device
        stream, pool = self.stats.stream_and_pool(calls, device)
        graph = calls.graph()
        start = timed(calls, device)
        before = calls.reserved(device)
        try:
            try:
                with calls.use(stream):
                    graph.capture_begin(pool=pool)
                    try:
                        logits = self.step(self.ids, self.positions, self.active)
                    except BaseException:
                        with contextlib.suppress(Exception):  # the capture's own error is the one raised
                            graph.capture_end()
                        raise
                    graph.capture_end()
            except BaseException:
                calls.end_pool(device, pool)
                raise
        except Exception as error:  # noqa: BLE001 - any capture failure but out of memory: run the step eagerly
            self.stats.capture_s += timed(calls, device) - start
            if out_of_memory(error):
                raise  # not the step's fault: the caller's back-off (or failed row) handles it; capture next time
            reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
            self.stats.fail(f"q={self.q}, W={self.rows.width}, {self.policy.name}: {reason}")
            self.logits = None
            return False
        self.stats.capture_s += timed(calls, device) - start
        self.stats.pool_bytes += max(0, calls.reserved(device) - before)
        self.graph, self.logits = graph, logits
        self.stats.captured += 1
        self.stats.captured_into(calls, device, graph)
        return True
