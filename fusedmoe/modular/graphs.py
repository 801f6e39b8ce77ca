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
              stream (compiles kernels, grows the workspaces); capture into a pool shared by
              every graph of the process, each output copied into its arena at the end of the
              graph; a capture that fails marks the key and the call runs eagerly
    later   : copy the inputs into rows [0, M) of the arenas (one foreach copy), replay, clone
              rows [0, M) of each output arena: a few host calls, whatever the pipeline
              launches

Arenas: one buffer per (input or output position, dtype, trailing shape) and device, shared by
every graph (grown geometrically; a graph keeps the buffer it was captured with). Nothing a
graph computes stays alive between replays but the arenas, so its scratch and outputs are pool
memory the next capture reuses: a model's layers times the buckets cost graphs, not copies of
their activations. Rows [M, bucket) hold the inputs of an earlier call (zeros at first): they
are computed and thrown away. No row may depend on another: every token is routed on its own,
and the callers keep schemes with a batch-wide activation scale (dynamic per-tensor FP8,
NVFP4) off graphs. Kernel configs are those of the bucket's token count (the same kernels,
possibly other tiles).

The graphs of a process share their pool, arenas and workspaces per device: replays are meant
to run one at a time, as a model's layers do on one stream; calls from several threads or
streams at once should turn graphs off (FUSEDMOE_CUDA_GRAPHS=0). A new bucket costs one capture
per layer (milliseconds each) the first time a call of that size comes.

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

import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fusedmoe.modular.kernel import shared_workspaces

GRAPHS_ENV = "FUSEDMOE_CUDA_GRAPHS"
DEFAULT_MAX_TOKENS = 4096
_POW2_BUCKETS = 256  # buckets are powers of two up to here, then its multiples
_MAX_GRAPHS = 8192  # per cache (a cache serves every layer of a signature), LRU first out
#: device index -> (the graph memory pool all caches share, the stream they capture on)
_POOLS: dict[int, tuple[object, torch.cuda.Stream]] = {}
#: (position, device, dtype, trailing shape) -> the rows every graph reads or writes there
_ARENAS: dict[tuple, torch.Tensor] = {}
_CACHES: weakref.WeakSet[GraphCache] = weakref.WeakSet()  # every GraphCache alive


def empty_cache() -> None:
    """Free what fusedmoe keeps between calls: every CUDA graph of the process, their arenas
    and pool, and the workspaces shared by every layer (the eager ones and those graphs
    captured). The next calls allocate and capture again. For a notebook that drops a model,
    or a process that switches to another: without it, these buffers stay sized to the
    largest call seen (for deepseek-v3 shapes at 4096 tokens, several hundred MB)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # no replay may still be writing what is freed below
    for cache in list(_CACHES):
        cache.clear()
    _ARENAS.clear()
    _POOLS.clear()
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
    writes to it. Cleared first, the capture allocates the workspace in the graphs' pool, which
    outlives every graph of the process, and whose memory only these graphs, replayed one at a
    time, reuse."""
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


def _arena(position: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Rows [0, shape[0]) of the process's arena for this position, dtype and trailing shape:
    allocated outside any graph pool, grown geometrically (a graph keeps its own buffer)."""
    key = (position, device, dtype, tuple(shape[1:]))
    buf = _ARENAS.get(key)
    if buf is None or buf.shape[0] < shape[0]:
        rows = max(shape[0], 2 * buf.shape[0]) if buf is not None else shape[0]
        buf = _ARENAS[key] = torch.zeros((rows, *shape[1:]), dtype=dtype, device=device)
    return buf[: shape[0]]


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


class GraphCache:
    """CUDA graphs of one computation, per token bucket and caller key (module docstring)."""

    def __init__(self) -> None:
        self._graphs: OrderedDict[tuple, _Graph | None] = OrderedDict()  # None: not capturable
        self.captures = 0
        self.replays = 0
        _CACHES.add(self)

    def clear(self) -> None:
        self._graphs.clear()

    def __len__(self) -> int:
        return sum(g is not None for g in self._graphs.values())

    def run(
        self,
        fn: Callable[..., tuple],
        inputs: Sequence[torch.Tensor],
        key: tuple,
    ) -> tuple | None:
        """fn(*inputs) -> a tuple of tensors [M, ...] (or None entries), from a graph; None when
        this key cannot be captured (the caller then runs fn eagerly)."""
        num_tokens = inputs[0].shape[0]
        bucket = bucket_of(num_tokens)
        full_key = (bucket, *key)
        entry = self._graphs.get(full_key, ())
        if entry == ():
            entry = self._capture(fn, inputs, bucket)
            self._graphs[full_key] = entry
            if len(self._graphs) > _MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(full_key)
        if entry is None:
            return None
        static_inputs, static_outputs = entry.rows(num_tokens)
        torch._foreach_copy_(static_inputs, list(inputs))  # one call for every input
        entry.graph.replay()
        self.replays += 1
        return tuple(None if out is None else out.clone() for out in static_outputs)

    def _capture(self, fn, inputs, bucket) -> _Graph | None:
        device = inputs[0].device
        with torch.inference_mode(False), torch.no_grad():
            statics = []
            for i, given in enumerate(inputs):
                static = _arena(f"in{i}", (bucket, *given.shape[1:]), given.dtype, device)
                static[: given.shape[0]].copy_(given)
                statics.append(static)
            try:
                index = device.index if device.index is not None else torch.cuda.current_device()
                if index not in _POOLS:
                    _POOLS[index] = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))
                pool, side = _POOLS[index]
                # warm-up and capture on one stream: the workspaces (kept per stream) that the
                # warm-up grows are the ones the capture records
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    warm = fn(*statics)  # compiles, fills every cache, grows the workspaces
                    # the output arenas, allocated here: never in the graph's pool
                    arenas = tuple(
                        None if out is None else _arena(f"out{j}", out.shape, out.dtype, device)
                        for j, out in enumerate(warm)
                    )
                    del warm
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                _clear_blas_workspaces()
                try:
                    # thread_local: a capture here does not break CUDA calls of other threads
                    with torch.cuda.graph(
                        graph, pool=pool, stream=side, capture_error_mode="thread_local"
                    ):
                        for arena, out in zip(arenas, fn(*statics), strict=True):
                            if arena is not None:
                                arena.copy_(out)  # the graph's outputs go back to the pool
                finally:
                    _clear_blas_workspaces()
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                # something in the call cannot be captured (a host sync, a collective): it
                # stays eager for this key
                return None
        self.captures += 1
        return _Graph(graph, statics, arenas)
