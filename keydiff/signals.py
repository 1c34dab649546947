"""The model signals a policy may score from besides the cached entries, each declared once: its name, what produces it
from a layer's attention call, how a cache keeps it, and how a view carries it (`LayerView.signals[name]`). A new signal
is one `register(Signal(...))` here. Design: docs/design/policies.md#model-signals"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from keydiff.queries import QueryStatistics, rope_frequencies

KEEPS = ("pass", "running", "first")


@dataclass(frozen=True)
class LayerPass:
    """What the attention function hands a signal's producer for one layer's pass: the attention module, post-RoPE
    queries, keys and values attended, the output (before o_proj), the first query's position and the policy's needs."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    start: int
    needs: Any


@dataclass(frozen=True)
class Signal:
    """One model signal. produce(kept, step) -> what to keep, from what is kept (None at first) and this pass (None: the
    attention statistic). keep: "pass", "running" (folded over every pass) or "first". entries, stack, head: how views
    carry it; asks: whether a policy's Needs ask for it; shared: a forked cache shares it; description: how errors name
    it."""

    name: str
    description: str
    produce: Callable[[Any, LayerPass], Any] | None
    keep: str = "pass"
    entries: bool = False
    stack: Callable[[list], Any] | None = None
    head: Callable[[Any, int, int, int], Any] | None = None
    asks: Callable[[Any], bool] | None = None
    shared: bool = False

    def __post_init__(self) -> None:
        if self.keep not in KEEPS:
            raise ValueError(f"signal {self.name!r}: keep {self.keep!r} is not valid; valid: {', '.join(KEEPS)}")

    def asked_by(self, needs: Any) -> bool:
        return self.asks(needs) if self.asks is not None else self.name in needs.signals


SIGNALS: dict[str, Signal] = {}


def register(signal: Signal) -> Signal:
    """Declare `signal` (a name declared twice is refused)."""
    if signal.name in SIGNALS:
        raise ValueError(f"model signal {signal.name!r} is already registered")
    SIGNALS[signal.name] = signal
    return signal


def named() -> tuple[str, ...]:
    """The signals a policy asks for by name in `Needs.signals` (the built-ins have fields of their own)."""
    return tuple(name for name, signal in SIGNALS.items() if signal.asks is None)


def asked(needs: Any) -> tuple[Signal, ...]:
    """The signals a policy's needs ask for, in registration order."""
    return tuple(signal for signal in SIGNALS.values() if signal.asked_by(needs))


def query_statistics(kept: QueryStatistics | None, step: LayerPass) -> QueryStatistics:
    """Running moments of the layer's pre-RoPE queries from position `needs.queries_from` on (keydiff.queries)."""
    if kept is None:
        inv_freq, scaling = rope_frequencies(step.module.config, step.query.shape[-1])
        kept = QueryStatistics(inv_freq.to(step.query.device), scaling, step.needs.queries_from)
    kept.update(step.query, step.start)
    return kept


def query_head(queries: QueryStatistics, row: int, head: int, kv_heads: int) -> QueryStatistics:
    if queries.total is None:
        return queries
    groups = queries.total.shape[1] // kv_heads
    return queries.heads(row, head * groups, groups)


def projection_head(weight: torch.Tensor, row: int, head: int, kv_heads: int) -> torch.Tensor:
    """The o_proj columns of KV head `head`'s group of query heads (transformers' repeat_kv mapping)."""
    width = weight.shape[1] // kv_heads
    return weight[:, head * width:(head + 1) * width]


# The attention each entry received in the pass, [batch, kv_heads, entries] float32 (a head-adaptive layer's:
# [batch][kv_head] -> [count]); computed by the attention function from the binding's rows and reduction.
ATTENTION = register(Signal(
    "attention", "attention statistics", None, keep="pass", stack=torch.cat,
    head=lambda statistic, row, head, kv_heads: statistic[row][head][None, None],
    asks=lambda needs: needs.attention_rows != 0))
QUERIES = register(Signal(
    "queries", "query statistics", query_statistics, keep="running", head=query_head,
    asks=lambda needs: needs.queries))
OUTPUT_PROJECTION = register(Signal(
    "output_projection", "the layer's output projection", lambda kept, step: step.module.o_proj.weight,
    keep="first", entries=True, head=projection_head, asks=lambda needs: needs.output_projection, shared=True))


class Recorded:
    """What a storage keeps of its planes' signals (one plane per layer it holds): name -> value per plane."""

    __slots__ = ("planes",)

    def __init__(self, count: int):
        self.planes: list[dict[str, Any]] = [{} for _ in range(count)]

    def get(self, plane: int, name: str) -> Any:
        return self.planes[plane].get(name)

    def put(self, plane: int, name: str, value: Any) -> None:
        self.planes[plane][name] = value

    def record(self, plane: int, signals: tuple[Signal, ...], step: LayerPass) -> None:
        """Fold a layer's pass into what the plane keeps of each of `signals`."""
        kept = self.planes[plane]
        for signal in signals:
            kept[signal.name] = signal.produce(kept.get(signal.name), step)

    def wanted(self, plane: int, signals: tuple[Signal, ...], evicting: bool) -> tuple[Signal, ...]:
        """Which of `signals` (those with producers) this plane's next pass records: a "first" one until it is
        kept, the others while the cache evicts."""
        kept = self.planes[plane]
        return tuple(s for s in signals if (s.name not in kept if s.keep == "first" else evicting))

    def pending(self) -> bool:
        """Whether a pass left a signal that the next eviction consumes."""
        return any(SIGNALS[name].keep == "pass" for kept in self.planes for name in kept)

    def end_pass(self) -> None:
        """Forget what the pass left for eviction ("pass" signals); the others stay."""
        for kept in self.planes:
            for name in [name for name in kept if SIGNALS[name].keep == "pass"]:
                del kept[name]

    def view(self, plane: int | None, where: str = "") -> dict[str, Any]:
        """The signals a view of one plane carries, or (None) a view of every plane's rows stacked: each signal
        with a stack rule, combined (recorded for every plane or for none)."""
        if plane is not None or len(self.planes) == 1:
            return self.planes[plane or 0]
        stacked = {}
        for name in {name for kept in self.planes for name in kept}:
            signal = SIGNALS[name]
            if signal.stack is None:
                continue
            values = [kept.get(name) for kept in self.planes]
            if any(value is None for value in values):
                raise RuntimeError(f"{signal.description} were recorded for only some of {where}; every layer of a "
                                   "forward pass must run with keydiff_attention")
            stacked[name] = signal.stack(values)
        return stacked

    def for_entries(self, plane: int | None = None) -> dict[str, Any]:
        """The signals `entry_state`'s views carry (one plane's; None: the only plane's, none for a stack)."""
        if plane is None and len(self.planes) > 1:
            return {}
        return {name: value for name, value in self.planes[plane or 0].items() if SIGNALS[name].entries}

    def head(self, row: int, head: int, kv_heads: int) -> dict[str, Any]:
        """The signals of one KV head of one batch row of a head-adaptive layer (one plane)."""
        out = {}
        for name, value in self.planes[0].items():
            signal = SIGNALS[name]
            out[name] = value if signal.head is None or value is None else signal.head(value, row, head, kv_heads)
        return out

    def missing(self, signals: tuple[Signal, ...], plane: int | None = None) -> Signal | None:
        """The first of `signals` that a view of `plane` (None: of every plane) would not carry."""
        kept = self.view(plane)
        return next((signal for signal in signals if kept.get(signal.name) is None), None)

    def split(self) -> list["Recorded"]:
        """One record per plane (the planes of a stack going their own ways)."""
        parts = []
        for kept in self.planes:
            part = Recorded(1)
            part.planes[0] = kept
            parts.append(part)
        return parts

    def __deepcopy__(self, memo: dict) -> "Recorded":
        """A copy owning its values, but sharing the model's own tensors (`Signal.shared`: the o_proj weight)."""
        twin = Recorded(0)
        memo[id(self)] = twin
        twin.planes = [{name: value if SIGNALS[name].shared else copy.deepcopy(value, memo)
                        for name, value in kept.items()} for kept in self.planes]
        return twin


def missing_error(policy_name: str, signal: Signal, where: str) -> RuntimeError:
    """The error for a policy that asked for `signal` when none was recorded for `where`."""
    return RuntimeError(
        f"policy {policy_name!r} needs {signal.description} but none were recorded in {where}: run the model inside "
        "`with keydiff.keydiff_attention(model, cache):` (keydiff.prefill and keydiff.generate do this for you)")


__all__ = ["ATTENTION", "OUTPUT_PROJECTION", "QUERIES", "SIGNALS", "LayerPass", "Recorded", "Signal", "asked",
           "missing_error", "named", "register"]
