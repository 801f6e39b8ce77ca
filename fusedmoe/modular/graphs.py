"""Eager calls replayed from CUDA graphs: the host work of a call, without a graph of the
caller's own.

An eager decode call of the layer launches four kernels (routing, two GEMMs, the top-k sum),
and on the slow host CPUs of GPU servers each launch, with the Python around it, costs tens
of microseconds: the call takes ~10x its GPU time. Prefill-sized calls of small-expert models
are host-bound too (a model's layers, each issuing its attention, norms and MoE, can keep the
GPU waiting). A CUDA graph replays the same launches for the cost of one. `GraphCache.run`
captures the call once per (token bucket, signature) and replays it after:

    bucket  = the smallest of 1, 2, 4, ..., 256 holding M tokens, then of 512, 768, 1024, ...
              (multiples of 256) up to max_tokens (DEFAULT_MAX_TOKENS: 4096)
    first   : inputs copied into static buffers (arenas, below); warm-up on the capture
              stream (compiles kernels, grows the workspaces); capture into the pool of the
              caller's stream (its lane, below), each output copied into its arena at the end
              of the graph; a capture that fails marks the key and the call runs eagerly
    later   : copy the inputs into rows [0, M) of the arenas (one foreach copy), replay, clone
              rows [0, M) of each output arena: a few host calls, whatever the pipeline
              launches

Arenas: one buffer per (input or output position, dtype, trailing shape) and lane (below),
shared by every graph of the lane (grown geometrically; a graph keeps the buffer it was captured
with). Nothing a graph computes stays alive between replays but the arenas, so its scratch and
outputs are pool memory the next capture of its lane reuses: a model's layers times the buckets
cost graphs, not copies of their activations. Rows [M, bucket) hold the inputs of an earlier
call (zeros at first): they are computed and thrown away. No row may depend on another: every
token is routed on its own, and the callers keep schemes with a batch-wide activation scale
(dynamic per-tensor FP8, NVFP4) off graphs. Kernel configs are those of the bucket's token count
(the same kernels, possibly other tiles).

Lanes: what replays share belongs to the stream they replay on. A lane is (device, the caller's
current stream) and has its own graph memory pool, capture stream, arenas and graphs (the lane
is part of every key), and a lock held from a call's copy in to its copy out, and across a
capture. Calls on one stream, from any number of threads, take turns on the host in the order
the GPU runs them (graphs of one pool share their scratch: they must run one at a time); calls
on two streams (overlapped micro-batches, a serving engine's threads) run side by side and touch
none of each other's memory. Captures take turns across the process (torch allows one at a time,
and the cuBLAS workspace clears around one reach every stream); replays never wait for them.
The cost: each stream that calls a layer captures graphs of its own (one per layer and bucket,
at its first call of the bucket) and keeps its own pool, arenas and workspaces, so graph memory
grows with the number of streams calling.

A lane captures on a stream of torch's pool (as torch.cuda.graph does) that no other lane
captures on or calls from: a capture records whatever any thread queues on its stream, and a
graph writes the workspaces of the stream it was captured on. A pooled stream that callers start
using is taken back from the lane capturing on it. (Work of the caller's own, queued on a pooled
stream that has not called fusedmoe, may still meet a capture there, as with torch.cuda.graph's
own capture stream.) A lane is named by its stream's handle: torch never destroys its pooled
streams; an external stream (torch.cuda.ExternalStream) that is destroyed and whose handle comes
back for a new stream hands its lane over, safely (CUDA releases a destroyed stream only once its
queued work is done, so the lane is idle by then). Lanes stay for the life of the process;
empty_cache frees what they hold. A new bucket costs one capture per layer and lane
(milliseconds each) the first time a call of that size comes.

The caller decides when a graph may stand in for the call (fusedmoe.layer_graphs for the
FusedMoE layer: CUDA, no autograd, not tracing or capturing itself, a graph-safe backend and
router, no EP) and keys the cache by everything the captured launches read by address: a tensor
replaced (`.to()`, quantize_, a new Parameter) changes the key, an in-place write
(load_weights) shows through. FUSEDMOE_CUDA_GRAPHS=0 turns the cache off for the process.

Modules of the caller's own (a router's linear, shared experts) may be captured with the call
where a graph may stand in for them: `graph_reads` says so and gives the addresses they read,
`plain_call` whether calling a module runs its forward and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fusedmoe.modular.kernel import shared_workspaces, stream_handle

GRAPHS_ENV = "FUSEDMOE_CUDA_GRAPHS"
DEFAULT_MAX_TOKENS = 4096
_POW2_BUCKETS = 256  # buckets are powers of two up to here, then its multiples
_MAX_GRAPHS = 8192  # per cache (a cache serves every layer of a signature), LRU first out
_STREAM_DRAWS = 64  # torch's pool hands out its 32 streams per priority round-robin
#: (device index, stream handle) -> the lane of the calls on that stream (module docstring)
_LANES: dict[tuple[int, int], _Lane] = {}
#: held by a capture, by the making of a lane, and by empty_cache; taken before a lane's lock.
#: Reentrant: a module captured with a call may call a layer itself during the warm-up.
_SETUP_LOCK = threading.RLock()
_CACHES: weakref.WeakSet[GraphCache] = weakref.WeakSet()  # every GraphCache alive
_CACHES_LOCK = threading.Lock()  # _CACHES' adds against empty_cache's walk; held alone


def empty_cache() -> None:
    """Free what fusedmoe keeps between calls: every CUDA graph of the process, the pools
    and arenas of every stream's lane, and the workspaces shared by every layer (the eager ones
    and those graphs captured). The next calls allocate and capture again. For a notebook that
    drops a model, or a process that switches to another: without it, these buffers stay sized
    to the largest call seen (for deepseek-v3 shapes at 4096 tokens, several hundred MB). Calls
    of other threads wait meanwhile (a replay under way finishes first)."""
    with _SETUP_LOCK, contextlib.ExitStack() as held:  # no capture, no new lane
        lanes = list(_LANES.values())
        for lane in lanes:
            held.enter_context(lane.lock)  # no replay: none may be queued after the sync
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for index in {torch.cuda.current_device(), *(lane.key[0] for lane in lanes)}:
                torch.cuda.synchronize(index)  # no replay may still be writing what is freed
        with _CACHES_LOCK:
            caches = list(_CACHES)
        for cache in caches:
            cache.clear()
        for lane in lanes:
            lane.release()
        shared_workspaces().clear()
        shared_workspaces(retain=True).release_unused()


# ---- what a graph may stand in for ---------------------------------------------------------
_HOOKS = nn.modules.module
#: the module classes whose forward reads nothing but their parameters, buffers and the
#: settings they were built with; and the packages whose modules are held to do the same
_PLAIN_CLASSES = (nn.Linear, nn.Identity, nn.Dropout)
_PLAIN_PACKAGES = ("torch.nn.modules.activation", "transformers.", "fusedmoe.")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")  # fmt: skip


def _global_hooks() -> bool:
    """Whether any hook is registered for every module (torch.nn.modules.module's globals)."""
    return any(getattr(_HOOKS, name, None) for name in _GLOBAL_HOOKS)


def _called_plainly(module: nn.Module) -> bool:
    """plain_call, less the global hooks (checked once per walk, not once per module)."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in module.__dict__
        or module.__dict__.get("_compiled_call_impl") is not None
    )


def plain_call(module: nn.Module) -> bool:
    """Whether module(...) runs module.forward(...) and nothing else: no hook on it (forward,
    backward, or global), no forward set on the instance (as accelerate's offloading does), no
    compiled call (module.compile())."""
    return not _global_hooks() and _called_plainly(module)


def graph_reads(*modules: nn.Module | None) -> tuple[int, ...] | None:
    """The addresses of the parameters and buffers of these modules (and their submodules),
    which a CUDA graph standing in for their calls reads; None where no graph may stand in for
    them. A graph replays kernels, not Python: every module of each tree must be called plainly
    (plain_call, so no hook is skipped), be in eval mode, and be of a class whose forward reads
    only its tensors and construction-time settings (_PLAIN_CLASSES; torch's activations,
    transformers' and fusedmoe's own modules). Anything else (a LoRA adapter that can be merged
    or disabled, a module of your own) runs eagerly.

    Called on every gated call, so one walk of _modules (not modules(), which names every
    submodule) with the global hooks looked up once."""
    stack = [m for m in modules if m is not None]
    if not stack:
        return ()
    if _global_hooks():
        return None
    addresses: list[int] = []
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        cls = type(m)
        plain = cls in _PLAIN_CLASSES or cls.__module__.startswith(_PLAIN_PACKAGES)
        if not plain or m.training or not _called_plainly(m):
            return None
        for t in m._parameters.values():
            if t is not None:
                addresses.append(t.data_ptr())
        for t in m._buffers.values():
            if t is not None:
                addresses.append(t.data_ptr())
        stack.extend(c for c in m._modules.values() if c is not None)
    return tuple(addresses)


# ---- the graph cache -------------------------------------------------------------------------
def _clear_blas_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces (one per handle and stream), before and after a
    capture, as torch.compile's CUDA graph trees do around theirs. A captured GEMM (a router's
    linear, a shared expert) embeds its workspace's address; a workspace cached before the
    capture lives outside the pool, and torch frees it whenever it clears its cache (a CUDA
    graph tree recording, any graph captured on that stream destroyed) while our graph still
    writes to it. Cleared first, the capture allocates the workspace in its lane's pool, which
    outlives every graph of the lane, and whose memory only these graphs, replayed one at a
    time on the lane's stream, reuse."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def graphs_enabled() -> bool:
    """FUSEDMOE_CUDA_GRAPHS (default on; 0 / false / off turns graph replay off)."""
    return os.environ.get(GRAPHS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def may_replay(x: torch.Tensor, max_tokens: int) -> bool:
    """Whether a call on x [M, ...] may run from a graph: CUDA, 1 <= M <= max_tokens, no
    autograd, and neither torch.compile tracing nor a CUDA graph capture of the caller's own."""
    num_tokens = x.shape[0]
    if not (x.is_cuda and 0 < num_tokens <= max_tokens) or torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    return graphs_enabled()


def bucket_of(num_tokens: int) -> int:
    if num_tokens <= _POW2_BUCKETS:
        return 1 << (num_tokens - 1).bit_length()
    return -(-num_tokens // _POW2_BUCKETS) * _POW2_BUCKETS


def _lane_key(device: torch.device) -> tuple[int, int]:
    """(device index, the handle of its current stream): the lane of a call on device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, stream_handle(device)


@dataclass(eq=False)
class _Lane:
    """What the graphs replayed on one stream share (module docstring: lanes). arenas are read
    and written under lock; pool and side under _SETUP_LOCK too (captures hold both)."""

    #: (device index, stream handle), as _lane_key gives it
    key: tuple[int, int]
    #: held across a call's copy in, replay and copy out, and across a capture
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the graph memory pool of the lane's graphs (made at its first capture)
    pool: tuple | None = None
    #: the stream its graphs are captured on (drawn at its first capture; None again when
    #: callers start using it: the next capture draws another)
    side: torch.cuda.Stream | None = None
    #: (position, dtype, trailing shape) -> the rows every graph of the lane reads or writes
    arenas: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def arena(self, position: str, shape: tuple[int, ...], dtype: torch.dtype, device):
        """Rows [0, shape[0]) of the lane's arena for this position, dtype and trailing shape:
        allocated outside any graph pool, on the current stream (the lane's, which reads and
        writes it), grown geometrically (a graph keeps its own buffer)."""
        key = (position, dtype, tuple(shape[1:]))
        buf = self.arenas.get(key)
        if buf is None or buf.shape[0] < shape[0]:
            rows = max(shape[0], 2 * buf.shape[0]) if buf is not None else shape[0]
            buf = self.arenas[key] = torch.zeros((rows, *shape[1:]), dtype=dtype, device=device)
        return buf[: shape[0]]

    def release(self) -> None:
        """Drop the pool, the capture stream and the arenas (empty_cache, with every graph)."""
        self.pool = self.side = None
        self.arenas.clear()


def _lane(device: torch.device) -> _Lane:
    """The lane of a call on device's current stream, made at the stream's first call."""
    key = _lane_key(device)
    lane = _LANES.get(key)
    if lane is None:
        with _SETUP_LOCK:  # no capture is under way: none runs on the stream taken back here
            lane = _LANES.get(key)
            if lane is None:
                for other in _LANES.values():
                    if other.side is not None and (other.key[0], other.side.cuda_stream) == key:
                        other.side = None  # callers use it now
                lane = _LANES[key] = _Lane(key)
    return lane


def _capture_stream(index: int) -> torch.cuda.Stream:
    """A stream of torch's pool on device `index` that no lane calls from or captures on
    (_SETUP_LOCK held). RuntimeError where the pool has none left: that lane runs eagerly."""
    taken = set()
    for lane in _LANES.values():
        if lane.key[0] == index:
            taken.add(lane.key[1])
            if lane.side is not None:
                taken.add(lane.side.cuda_stream)
    for _ in range(_STREAM_DRAWS):
        stream = torch.cuda.Stream(index)
        if stream.cuda_stream not in taken:
            return stream
    raise RuntimeError(
        f"no stream of torch's pool on cuda:{index} is free to capture on: {len(taken)} are "
        "taken by fusedmoe's lanes"
    )


def _record(fn, statics: list[torch.Tensor], lane: _Lane) -> tuple[object, tuple]:
    """Warm fn up on the lane's capture stream, then capture fn(*statics) into a CUDA graph
    that copies each output into the lane's arena for it: (graph, output arenas). Under
    _SETUP_LOCK and the lane's lock; RuntimeError where something cannot be captured."""
    device = statics[0].device
    if lane.pool is None:
        lane.pool = torch.cuda.graph_pool_handle()
    if lane.side is None:
        lane.side = _capture_stream(lane.key[0])
    side, caller = lane.side, torch.cuda.current_stream(device)
    # warm-up and capture on one stream: the workspaces (kept per stream) that the warm-up grows
    # are the ones the capture records, and the stream being the lane's alone, so are they
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        warm = fn(*statics)  # compiles, fills every cache, grows the workspaces
    outputs = [None if out is None else (out.shape, out.dtype) for out in warm]
    del warm
    caller.wait_stream(side)
    # the output arenas, allocated here: never in the graph's pool
    arenas = tuple(
        None if out is None else lane.arena(f"out{j}", *out, device)
        for j, out in enumerate(outputs)
    )
    graph = torch.cuda.CUDAGraph()
    _clear_blas_workspaces()
    try:
        # thread_local: a capture here does not break CUDA calls of other threads
        with torch.cuda.graph(
            graph, pool=lane.pool, stream=side, capture_error_mode="thread_local"
        ):
            for arena, out in zip(arenas, fn(*statics), strict=True):
                if arena is not None:
                    arena.copy_(out)  # the graph's outputs go back to the pool
    finally:
        _clear_blas_workspaces()
    return graph, arenas


class _Graph:
    def __init__(self, graph, inputs: list[torch.Tensor], outputs: tuple) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self._rows: dict[int, tuple[list[torch.Tensor], tuple]] = {}

    def rows(self, num_tokens: int) -> tuple[list[torch.Tensor], tuple]:
        """Rows [0, num_tokens) of the static inputs and outputs: views made once for decode
        sizes (a slice is a dispatcher call, and a replay only a handful of them), per call
        above (where the call's GPU work dwarfs it and a cache would hold thousands)."""
        views = self._rows.get(num_tokens)
        if views is None:
            views = (
                [t[:num_tokens] for t in self.inputs],
                tuple(None if out is None else out[:num_tokens] for out in self.outputs),
            )
            if num_tokens <= _POW2_BUCKETS:
                self._rows[num_tokens] = views
        return views

    def replay(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """Copy the inputs in, replay, clone the outputs out; the lane's lock held, so no other
        call writes the arenas in between."""
        static_inputs, static_outputs = self.rows(inputs[0].shape[0])
        torch._foreach_copy_(static_inputs, list(inputs))  # one call for every input
        self.graph.replay()
        return tuple(None if out is None else out.clone() for out in static_outputs)


def _capture(fn, inputs: Sequence[torch.Tensor], bucket: int, lane: _Lane) -> _Graph | None:
    """A graph of fn on bucket rows of the lane's arenas; None where fn cannot be captured."""
    device = inputs[0].device
    with torch.inference_mode(False), torch.no_grad():
        statics = []
        for i, given in enumerate(inputs):
            static = lane.arena(f"in{i}", (bucket, *given.shape[1:]), given.dtype, device)
            static[: given.shape[0]].copy_(given)
            statics.append(static)
        try:
            graph, arenas = _record(fn, statics, lane)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            # something in the call cannot be captured (a host sync, a collective), or no
            # stream is left to capture on: it stays eager for this key
            return None
    return _Graph(graph, statics, arenas)


_MISSING = object()  # GraphCache._lookup: no entry yet


class GraphCache:
    """CUDA graphs of one computation, per lane, token bucket and caller key (module
    docstring). Safe to call from any thread on any stream."""

    def __init__(self) -> None:
        #: (lane key, bucket, *caller key) -> its graph, None where it is not capturable
        self._graphs: OrderedDict[tuple, _Graph | None] = OrderedDict()
        self._lock = threading.Lock()  # the dict and the counts, for the calls of every lane
        self.captures = 0
        self.replays = 0
        with _CACHES_LOCK:
            _CACHES.add(self)

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(g is not None for g in self._graphs.values())

    def run(
        self,
        fn: Callable[..., tuple],
        inputs: Sequence[torch.Tensor],
        key: tuple,
    ) -> tuple | None:
        """fn(*inputs) -> a tuple of tensors [M, ...] (or None entries), from a graph of the
        caller's stream; None when this key cannot be captured (the caller then runs fn
        eagerly)."""
        bucket = bucket_of(inputs[0].shape[0])
        lane = _lane(inputs[0].device)
        full_key = (lane.key, bucket, *key)
        with lane.lock:
            entry = self._lookup(full_key)
            if entry is not _MISSING:
                return None if entry is None else entry.replay(inputs)
        with _SETUP_LOCK, lane.lock:  # the lock order everywhere: _SETUP_LOCK, then a lane's
            entry = self._lookup(full_key)  # another thread of the lane may have captured it
            if entry is _MISSING:
                entry = _capture(fn, inputs, bucket, lane)
                self._insert(full_key, entry)
            return None if entry is None else entry.replay(inputs)

    def _lookup(self, full_key: tuple):
        """The entry of full_key (_MISSING if none), made the most recently used; a graph's
        replay counted."""
        with self._lock:
            entry = self._graphs.get(full_key, _MISSING)
            if entry is not _MISSING:
                self._graphs.move_to_end(full_key)
                if entry is not None:
                    self.replays += 1
        return entry

    def _insert(self, full_key: tuple, entry: _Graph | None) -> None:
        """Add a capture's entry (and count its first replay), least recently used first out."""
        with self._lock:
            self._graphs[full_key] = entry
            if len(self._graphs) > _MAX_GRAPHS:
                self._graphs.popitem(last=False)
            if entry is not None:
                self.captures += 1
                self.replays += 1
