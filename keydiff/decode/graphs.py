"""CUDA graph capture for the fixed-shape step (keydiff.decode.static), through a small set of CUDA calls that a CPU can
stand in for: `CudaCalls` is torch.cuda itself; under `stand_in_graphs()` a CPU runs the same capture code against
`StandIn`. Design: docs/design/decode.md#the-cuda-stand-in-graphspy"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils import _pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CAPTURING = "operation not permitted when stream is capturing"


class CudaCalls:
    """The CUDA calls a capture makes, each bound to the device it is given (torch.cuda's own)."""

    name = "cuda"
    records_compiled = True  # a torch.compile'd step can be captured

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> Any:
        """The context in which `stream` is current (and its device the current device)."""
        return torch.cuda.stream(stream)

    def guard(self, device: torch.device) -> Any:
        return torch.cuda.device(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def pool(self, device: torch.device) -> Any:
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()

    def reserved(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def end_pool(self, device: torch.device, pool: Any) -> None:
        """After a failed capture: stop routing the device's allocations into the capture's pool (torch builds without the capture_end fix leave it on)."""
        end = getattr(torch.cuda.memory, "_cuda_endAllocateToPool", None)
        if end is None:
            return
        with contextlib.suppress(Exception):
            end(torch.cuda._utils._get_device_index(device, optional=True), pool)


CUDA = CudaCalls()
_STAND_IN: list["StandIn"] = []  # the active stand-in, if any (innermost last)


def calls_for(device: torch.device) -> CudaCalls | None:
    """The CUDA calls a step on `device` captures through: torch.cuda's on a CUDA device, the active stand-in on a
    CPU, None where nothing is captured."""
    if device.type == "cuda":
        return CUDA
    if device.type == "cpu" and _STAND_IN:
        return _STAND_IN[-1]
    return None


@contextlib.contextmanager
def stand_in_graphs(model_device: str = "cuda:0", current_device: str = "cuda:0", fail: str | None = None,
                    fixed_allocator: bool = False) -> Iterator["StandIn"]:
    """Within it, a CPU step captures and replays CUDA graphs through `StandIn` (see the module), which it yields."""
    if fail not in (None, "end", "inside"):
        raise ValueError(f"fail={fail!r} is not valid; valid: None, 'end', 'inside'")
    stand_in = StandIn(model_device, current_device, fail, fixed_allocator)
    _STAND_IN.append(stand_in)
    try:
        yield stand_in
    finally:
        _STAND_IN.remove(stand_in)


_ids = itertools.count(1)


@dataclass(eq=False)
class StandInStream:
    """A stream of the stand-in: the device it was made on, and the streams it was told to wait for."""

    device: str
    id: int = field(default_factory=lambda: next(_ids))
    default: bool = False
    waited_for: list[int] = field(default_factory=list)

    def wait_stream(self, other: "StandInStream") -> None:
        self.waited_for.append(other.id)


class StandIn(CudaCalls):
    """Stands in for CUDA on a CPU and records what a capture was asked (see the module)."""

    name = "stand-in"
    records_compiled = False  # torch.compile does not trace under the recording dispatch mode

    def __init__(self, model_device: str, current_device: str, fail: str | None, fixed_allocator: bool):
        self.model_device, self.current_device = model_device, current_device
        self.fail, self.fixed_allocator = fail, fixed_allocator
        self.defaults: dict[str, StandInStream] = {}
        self.current: dict[str, StandInStream] = {}  # each device's current stream
        self.streams: list[tuple[str, int]] = []  # every stream made: (device, id)
        self.captures: list[dict[str, Any]] = []
        self.capturing: StandInStream | None = None  # the stream a capture is underway on
        self.routed: list[Any] = []  # pools the allocator still routes allocations into
        self.recorded_streams: list[tuple[torch.Tensor, int]] = []  # record_stream calls: (tensor, stream id)
        self.replays = 0
        self.synchronized: list[str] = []
        # graphs alive per pool given to a capture (a failed capture never gives its use back, as in CUDA)
        self.pool_users: dict[Any, int] = {}

    def device_name(self, device: torch.device | str | None) -> str:
        """The CUDA device a CPU device stands for: the model's (None: the current device)."""
        if device is None:
            return self.current_device
        device = torch.device(device)
        return self.model_device if device.type == "cpu" else str(device)

    def default_stream(self, name: str) -> StandInStream:
        if name not in self.defaults:
            self.defaults[name] = StandInStream(name, default=True)
        return self.defaults[name]

    def stream(self, device: torch.device | None = None) -> StandInStream:
        made = StandInStream(self.device_name(device))
        self.streams.append((made.device, made.id))
        return made

    def current_stream(self, device: torch.device | None = None) -> StandInStream:
        name = self.device_name(device)
        return self.current.get(name) or self.default_stream(name)

    @contextlib.contextmanager
    def use(self, stream: StandInStream) -> Iterator[None]:
        """As torch.cuda.stream: the stream current on its device, and its device the current device."""
        before, before_device = self.current.get(stream.device), self.current_device
        self.current[stream.device], self.current_device = stream, stream.device
        try:
            yield
        finally:
            self.current_device = before_device
            if before is None:
                self.current.pop(stream.device, None)
            else:
                self.current[stream.device] = before

    @contextlib.contextmanager
    def guard(self, device: torch.device) -> Iterator[None]:
        before, self.current_device = self.current_device, self.device_name(device)
        try:
            yield
        finally:
            self.current_device = before

    def synchronize(self, device: torch.device | None = None) -> None:
        self.synchronized.append(self.device_name(device))

    def graph(self) -> "StandInGraph":
        return StandInGraph(self)

    def pool(self, device: torch.device | None = None) -> tuple[int, int]:
        return (0, next(_ids))

    def reserved(self, device: torch.device | None = None) -> int:
        return sum(capture["bytes"] for capture in self.captures)

    def record_stream(self, tensor: torch.Tensor, stream: StandInStream) -> None:
        self.recorded_streams.append((tensor, stream.id))

    def end_pool(self, device: torch.device, pool: Any) -> None:
        if pool in self.routed:
            self.routed.remove(pool)

    def clean(self) -> bool:
        """No capture underway, every device on its default stream, the allocator routing into no pool."""
        return self.capturing is None and not self.current and not self.routed


class StandInGraph:
    """A CUDAGraph of the stand-in: capture_begin/capture_end record every operation between them (undoing their
    writes to memory that existed before), `replay` runs them again."""

    def __init__(self, calls: StandIn):
        self.calls = calls
        self.recorder: _Recorder | None = None
        self.record: dict[str, Any] | None = None
        self.operations: list[tuple] | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        calls = self.calls
        if calls.capturing is not None:
            raise RuntimeError("a capture is already underway")
        stream = calls.current_stream(None)  # as CUDA: the current device's current stream
        if stream.default:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream")
        if pool is not None:  # CUDA's allocator shares a pool with live graphs only (create_or_incref_pool)
            if calls.pool_users.get(pool, 1) == 0:
                raise RuntimeError("INTERNAL ASSERT FAILED: use_count > 0 (stand-in: every graph of this pool was "
                                   "released; the allocator may still hold the pool, and shares it with no capture)")
            calls.pool_users[pool] = calls.pool_users.get(pool, 0) + 1
        self.record = {"device": stream.device, "stream": stream.id, "pool": pool, "bytes": 0, "allocations": [],
                       "error": None}
        calls.captures.append(self.record)
        calls.capturing = stream
        calls.routed.append(pool)
        # Kernels run at once unless the capture stream is on their device (as a capture on another device does).
        self.recorder = _Recorder(calls.fail == "inside") if stream.device == calls.model_device else None
        if self.recorder is not None:
            self.recorder.__enter__()

    def capture_end(self) -> None:
        calls, recorder = self.calls, self.recorder
        on_its_stream = calls.current_stream(None) is calls.capturing
        self.recorder = None
        if recorder is not None:
            recorder.__exit__(None, None, None)
            recorder.undo()
            self.operations = recorder.operations
            self.record["bytes"] = recorder.bytes
            self.record["allocations"] = recorder.allocations
        else:
            self.operations = []
        calls.capturing = None
        if not on_its_stream:
            self.operations = None
            raise RuntimeError("Capture must end on the same stream it began on.")
        if calls.fail == "end":
            self.operations = None
            self.record["error"] = "end"
            if calls.fixed_allocator:
                calls.routed.remove(self.record["pool"])
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture (stand-in)")
        calls.routed.remove(self.record["pool"])

    def __del__(self) -> None:
        # a captured graph gives its pool's use back when it is released (CUDAGraph::reset); a failed one does not
        pool = None if self.record is None else self.record["pool"]
        if self.operations is not None and pool is not None and pool in self.calls.pool_users:
            self.calls.pool_users[pool] -= 1

    def replay(self) -> None:
        if self.operations is None:
            raise RuntimeError("replay of a graph that was not captured")
        self.calls.replays += 1
        with torch.inference_mode():
            for func, args, kwargs, result, fresh in self.operations:
                again = func(*args, **kwargs)
                if fresh:
                    old, new = _pytree.tree_leaves(result), _pytree.tree_leaves(again)
                    for index in fresh:
                        old[index].copy_(new[index])

    def pool(self) -> Any:
        return None if self.record is None else self.record["pool"]


def _reads_values(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an operation reads a value on the host or sizes its output by values (a host synchronisation, which
    a CUDA capture refuses). Indexing is so only with boolean masks; with integer indices its shape is fixed."""
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        return True
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    if func.name().startswith(("aten::index", "aten::_index_put_impl")):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return True


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operation writes into (its schema's mutable arguments)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        written += [t for t in _pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


class _HostReads(TorchFunctionMode):
    """Refuses, inside a stand-in capture, the host reads a CPU tensor serves without reaching the dispatcher:
    `tolist`, `numpy` and `cpu` (on CUDA a copy to the host and a synchronisation, which a capture refuses)."""

    REFUSED = ("tolist", "numpy", "cpu", "__array__")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if any(func is getattr(torch.Tensor, name) for name in self.REFUSED):
            raise RuntimeError(f"{CAPTURING} (stand-in: Tensor.{func.__name__})")
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Runs and records every operation of a stand-in capture, keeping pre-existing storages' first contents to restore (`undo`)."""

    def __init__(self, fail_inside: bool):
        super().__init__()
        self.fail_inside = fail_inside
        self.operations: list[tuple] = []
        self.fresh: set[int] = set()  # storages allocated inside the capture (their StorageImpl, `_cdata`)
        self.saved: dict[int, tuple[Any, Any]] = {}
        self.bytes = 0
        self.allocations: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __enter__(self):
        self.host_reads = _HostReads()
        self.host_reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.host_reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.fail_inside or _reads_values(func, args, kwargs):
            raise RuntimeError(f"{CAPTURING} (stand-in: {func})")
        for tensor in _written(func, args, kwargs):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key not in self.fresh and key not in self.saved and storage.nbytes():
                self.saved[key] = (storage, storage.clone())
        result = func(*args, **kwargs)
        leaves = _pytree.tree_leaves(result)
        fresh = []
        # An output is new memory unless it shares an input's: "may alias" annotated, or unannotated (_unsafe_view).
        inputs = {t.untyped_storage()._cdata for t in _pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage()._cdata not in inputs:
                fresh.append(index)
                storage = leaf.untyped_storage()
                if storage._cdata not in self.fresh:
                    self.fresh.add(storage._cdata)
                    self.bytes += storage.nbytes()
                    self.allocations.append((tuple(leaf.shape), leaf.dtype))
        self.operations.append((func, args, kwargs, result, fresh))
        return result

    @torch.inference_mode()
    def undo(self) -> None:
        """Restore what the capture overwrote, and leave the pool's tensors as a graph leaves them: unset."""
        for storage, copy in self.saved.values():
            storage.copy_(copy)
        self.saved.clear()
        for *_, result, fresh in self.operations:
            leaves = _pytree.tree_leaves(result)
            for index in fresh:
                if leaves[index].is_floating_point():
                    leaves[index].fill_(float("nan"))


def timed(calls: CudaCalls, device: torch.device) -> float:
    """A clock reading after the device's queued work (a capture's or warm-up's time covers its kernels)."""
    calls.synchronize(device)
    return time.perf_counter()
