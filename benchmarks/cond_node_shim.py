"""Conditional CUDA graph nodes for a torch without them (before CUDAGraph.
begin_capture_to_if_node), for measuring fusedmoe's choice on the GPU on such a torch.

    import cond_node_shim; cond_node_shim.install()    # needs nvcc (CUDA >= 12.4)
    python3 -m pytest -p cond_node_shim ...             # the same for a test run

`install` builds a small library with nvcc (a kernel that sets a conditional handle from a
bool on the device, which only device code can do, and the host calls that add an IF node to
the graph being captured), then gives torch.cuda.CUDAGraph what fusedmoe.experts.deep_gemm asks
of it: `get_currently_capturing_graph`, `begin_capture_to_if_node(pred)` and
`end_capture_to_conditional_node()`. As torch's own version does, a body is captured on a
stream of its own into the node's graph, with the thread's allocations sent to the capture's
memory pool (torch.cuda.graph is wrapped to note which: a capture given none gets a new pool
of its own, as its private one would be). A measuring aid, not part of the package.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

_SOURCE = r"""
#include <cuda_runtime.h>

__global__ void fm_set_cond(cudaGraphConditionalHandle handle, const unsigned char* pred) {
    cudaGraphSetConditional(handle, *pred ? 1u : 0u);
}

static int fm_stale = 0;
static cudaGraph_t fm_bodies[2];

extern "C" int fm_stale_error() { return fm_stale; }
extern "C" const char* fm_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

static cudaError_t capture_info(cudaStream_t s, cudaGraph_t* graph, const cudaGraphNode_t** deps,
                                const cudaGraphEdgeData** edges, size_t* num_deps) {
    cudaStreamCaptureStatus status;
#if CUDART_VERSION >= 13000
    cudaError_t err = cudaStreamGetCaptureInfo(s, &status, nullptr, graph, deps, edges, num_deps);
#else
    cudaError_t err = cudaStreamGetCaptureInfo_v3(s, &status, nullptr, graph, deps, edges,
                                                  num_deps);
#endif
    if (err == cudaSuccess && status != cudaStreamCaptureStatusActive) return cudaErrorIllegalState;
    return err;
}

// After the work captured so far on `parent`: a kernel that sets a new condition from *pred,
// then a conditional node of `size` bodies (1: IF; 2: IF / ELSE, CUDA >= 12.8), which the
// rest of the capture follows. The bodies' graphs are kept for fm_begin_body.
extern "C" int fm_add_if(void* parent_ptr, const void* pred, int size) {
    cudaStream_t parent = (cudaStream_t)parent_ptr;
    cudaError_t stale = cudaGetLastError();  // an error left by an earlier call: kept, cleared
    if (stale != cudaSuccess) fm_stale = stale;
    cudaGraph_t graph;
    const cudaGraphNode_t* deps = nullptr;
    const cudaGraphEdgeData* edges = nullptr;
    size_t num_deps = 0;
    cudaError_t err = capture_info(parent, &graph, &deps, &edges, &num_deps);
    if (err != cudaSuccess) return 1000 + err;
    cudaGraphConditionalHandle handle;
    err = cudaGraphConditionalHandleCreate(&handle, graph, 0, 0);
    if (err != cudaSuccess) return 2000 + err;
    fm_set_cond<<<1, 1, 0, parent>>>(handle, (const unsigned char*)pred);
    err = cudaGetLastError();
    if (err != cudaSuccess) return 3000 + err;
    err = capture_info(parent, &graph, &deps, &edges, &num_deps);
    if (err != cudaSuccess) return 4000 + err;
    cudaGraphNodeParams params = {};
    params.type = cudaGraphNodeTypeConditional;
    params.conditional.handle = handle;
    params.conditional.type = cudaGraphCondTypeIf;
    params.conditional.size = size;
    cudaGraphNode_t node;
#if CUDART_VERSION >= 13000
    err = cudaGraphAddNode(&node, graph, deps, edges, num_deps, &params);
#else
    err = cudaGraphAddNode_v2(&node, graph, deps, edges, num_deps, &params);
#endif
    if (err != cudaSuccess) return 5000 + err;
#if CUDART_VERSION >= 13000
    err = cudaStreamUpdateCaptureDependencies(parent, &node, nullptr, 1,
                                              cudaStreamSetCaptureDependencies);
#else
    err = cudaStreamUpdateCaptureDependencies_v2(parent, &node, nullptr, 1,
                                                 cudaStreamSetCaptureDependencies);
#endif
    if (err != cudaSuccess) return 6000 + err;
    for (int i = 0; i < size && i < 2; ++i) fm_bodies[i] = params.conditional.phGraph_out[i];
    return 0;
}

extern "C" int fm_begin_body(void* child_ptr, int index) {
    cudaError_t err = cudaStreamBeginCaptureToGraph(
        (cudaStream_t)child_ptr, fm_bodies[index], nullptr, nullptr, 0,
        cudaStreamCaptureModeThreadLocal);
    return err == cudaSuccess ? 0 : 7000 + err;
}

extern "C" int fm_end_body(void* child_ptr) {
    cudaGraph_t body;
    cudaError_t err = cudaStreamEndCapture((cudaStream_t)child_ptr, &body);
    return err == cudaSuccess ? 0 : 8000 + err;
}
"""

_LIB = None
_CAPTURES = threading.local()  # .pools: the memory pools of the captures under way, innermost last
_BODIES = threading.local()


def _build() -> ctypes.CDLL:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    work = Path(tempfile.mkdtemp(prefix="fm_cond_"))
    src, obj, dlink, lib = (work / n for n in ("shim.cu", "shim.o", "dlink.o", "shim.so"))
    src.write_text(_SOURCE)
    major, minor = torch.cuda.get_device_capability()
    arch = f"-arch=sm_{major}{minor}"
    steps = [  # device code calling the device runtime: relocatable, then device-linked
        [nvcc, "-O2", arch, "-rdc=true", "-Xcompiler", "-fPIC", "-c", str(src), "-o", str(obj)],
        [nvcc, arch, "-Xcompiler", "-fPIC", "-dlink", str(obj), "-o", str(dlink), "-lcudadevrt"],
        [nvcc, arch, "-shared", str(obj), str(dlink), "-o", str(lib), "-lcudadevrt"],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    handle = ctypes.CDLL(str(lib))
    for name, args in (
        ("fm_add_if", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]),
        ("fm_begin_body", [ctypes.c_void_p, ctypes.c_int]),
        ("fm_end_body", [ctypes.c_void_p]),
        ("fm_stale_error", []),
        ("fm_error_string", [ctypes.c_int]),
    ):
        getattr(handle, name).argtypes = args
        getattr(handle, name).restype = ctypes.c_int
    handle.fm_error_string.restype = ctypes.c_char_p
    return handle


def check(rc: int, what: str) -> None:
    """Raise for a nonzero code of the library: 1000 * step + the CUDA error."""
    if rc:
        error = _LIB.fm_error_string(rc % 1000).decode()
        raise RuntimeError(f"{what} failed at step {rc // 1000}: {error} ({rc % 1000})")


def library() -> ctypes.CDLL:
    """The built library (fm_add_if, fm_begin_body, fm_end_body), for probes of its own."""
    install()
    return _LIB


class _Capturing:
    """What deep_gemm asks of the graph being captured."""

    def begin_capture_to_if_node(self, pred: torch.Tensor) -> None:
        device = torch.cuda.current_device()
        parent = torch.cuda.current_stream()
        child = torch.cuda.Stream()  # from torch's pool, as torch's own version takes it
        check(_LIB.fm_add_if(parent.cuda_stream, pred.data_ptr(), 1), "fm_add_if")
        check(_LIB.fm_begin_body(child.cuda_stream, 0), "fm_begin_body")
        # the body's allocations: from the capture's pool, whatever stream asks
        pool = _CAPTURES.pools[-1]
        torch._C._cuda_endAllocateToPool(device, pool)
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
        guard = torch.cuda.stream(child)
        guard.__enter__()
        stack = getattr(_BODIES, "stack", None) or []
        stack.append((device, parent, child, guard))
        _BODIES.stack = stack

    def end_capture_to_conditional_node(self) -> None:
        device, parent, child, guard = _BODIES.stack.pop()
        guard.__exit__(None, None, None)
        check(_LIB.fm_end_body(child.cuda_stream), "fm_end_body")
        pool = _CAPTURES.pools[-1]
        torch._C._cuda_endAllocateToPool(device, pool)
        with torch.cuda.stream(parent):  # the rest of the capture: the parent stream's
            torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool)


def install() -> None:
    """Build the library and patch torch.cuda (idempotent)."""
    global _LIB
    if _LIB is not None:
        return
    _LIB = _build()
    capturing = _Capturing()
    torch.cuda.CUDAGraph.get_currently_capturing_graph = staticmethod(lambda: capturing)
    torch.cuda.CUDAGraph.begin_capture_to_if_node = _Capturing.begin_capture_to_if_node
    real_init, real_enter = torch.cuda.graph.__init__, torch.cuda.graph.__enter__
    real_exit = torch.cuda.graph.__exit__

    def init(self, cuda_graph, pool=None, *args, **kwargs):
        # a capture given no pool gets a new one of its own (as its private pool would be),
        # whose id is then known
        self.shim_pool = torch.cuda.graph_pool_handle() if pool is None else pool
        real_init(self, cuda_graph, self.shim_pool, *args, **kwargs)

    def enter(self):
        real_enter(self)
        pools = getattr(_CAPTURES, "pools", None) or []
        pools.append(self.shim_pool)
        _CAPTURES.pools = pools

    def exit(self, *exc):
        _CAPTURES.pools.pop()
        return real_exit(self, *exc)

    torch.cuda.graph.__init__ = init
    torch.cuda.graph.__enter__, torch.cuda.graph.__exit__ = enter, exit


def self_test() -> str:
    """A graph of two IF nodes holding an allocating torch op each, replayed both ways."""
    install()
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    flags = torch.tensor([1, 0], dtype=torch.uint8, device="cuda")
    out = torch.zeros(8, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=s):
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        b = flags.view(torch.bool)
        for flag, scale in ((b[0], 2.0), (b[1], 3.0)):
            graph.begin_capture_to_if_node(flag)
            try:
                out.copy_(x * scale)
            finally:
                graph.end_capture_to_conditional_node()
        out.add_(torch.ones_like(out))
    results = []
    for value in ([1, 0], [0, 1]):
        flags.copy_(torch.tensor(value, dtype=torch.uint8))
        g.replay()
        torch.cuda.synchronize()
        results.append(out[3].item())
    if results != [7.0, 10.0]:
        raise RuntimeError(f"conditional nodes: got {results}, expected [7.0, 10.0]")
    return "conditional nodes through the shim: ok"


def pytest_configure(config) -> None:
    """`python3 -m pytest -p cond_node_shim` (benchmarks/ on PYTHONPATH): the GPU tests of the
    choice on the GPU, on a torch without conditional nodes."""
    if torch.cuda.is_available() and not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        print(self_test())
