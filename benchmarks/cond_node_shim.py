"""Conditional CUDA graph nodes for a torch without them (before CUDAGraph.
begin_capture_to_if_node), for measuring fusedmoe's choice on the GPU on such a torch.

    import cond_node_shim; cond_node_shim.install()    # needs nvcc (CUDA >= 12.4)

`install` builds a small library with nvcc (a kernel that sets a conditional handle from a
bool on the device, which only device code can do, and the host calls that add an IF node to
the graph being captured), then gives torch.cuda.CUDAGraph what fusedmoe.experts.deep_gemm asks
of it: `get_currently_capturing_graph`, `begin_capture_to_if_node(pred)` and
`end_capture_to_conditional_node()`. As torch's own version does, a body is captured on a
stream of its own into the node's graph, with the thread's allocations sent to the capture's
memory pool; so that the pool is known, captures given no pool take the shim's (`graph`'s
default pool is replaced). A measuring aid, not part of the package.
"""

from __future__ import annotations

import ctypes
import os
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
extern "C" int fm_stale_error() { return fm_stale; }

extern "C" int fm_begin_if(void* parent_ptr, const void* pred, void* child_ptr) {
    cudaStream_t parent = (cudaStream_t)parent_ptr;
    cudaError_t stale = cudaGetLastError();  // an error left by an earlier call: kept, cleared
    if (stale != cudaSuccess) fm_stale = stale;
    cudaStreamCaptureStatus status;
    cudaGraph_t graph;
    const cudaGraphNode_t* deps = nullptr;
    const cudaGraphEdgeData* edges = nullptr;
    size_t num_deps = 0;
#if CUDART_VERSION >= 13000
    cudaError_t err = cudaStreamGetCaptureInfo(parent, &status, nullptr, &graph, &deps, &edges,
                                               &num_deps);
#else
    cudaError_t err = cudaStreamGetCaptureInfo_v3(parent, &status, nullptr, &graph, &deps,
                                                  &edges, &num_deps);
#endif
    if (err != cudaSuccess) return 1000 + err;
    if (status != cudaStreamCaptureStatusActive) return 999;
    cudaGraphConditionalHandle handle;
    err = cudaGraphConditionalHandleCreate(&handle, graph, 0, 0);
    if (err != cudaSuccess) return 2000 + err;
    fm_set_cond<<<1, 1, 0, parent>>>(handle, (const unsigned char*)pred);
    err = cudaGetLastError();
    if (err != cudaSuccess) return 3000 + err;
#if CUDART_VERSION >= 13000
    err = cudaStreamGetCaptureInfo(parent, &status, nullptr, &graph, &deps, &edges, &num_deps);
#else
    err = cudaStreamGetCaptureInfo_v3(parent, &status, nullptr, &graph, &deps, &edges, &num_deps);
#endif
    if (err != cudaSuccess) return 4000 + err;
    cudaGraphNodeParams params = {};
    params.type = cudaGraphNodeTypeConditional;
    params.conditional.handle = handle;
    params.conditional.type = cudaGraphCondTypeIf;
    params.conditional.size = 1;
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
    err = cudaStreamBeginCaptureToGraph((cudaStream_t)child_ptr, params.conditional.phGraph_out[0],
                                        nullptr, nullptr, 0, cudaStreamCaptureModeThreadLocal);
    if (err != cudaSuccess) return 7000 + err;
    return 0;
}

extern "C" const char* fm_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

extern "C" int fm_end_if(void* child_ptr) {
    cudaGraph_t body;
    cudaError_t err = cudaStreamEndCapture((cudaStream_t)child_ptr, &body);
    return err == cudaSuccess ? 0 : 8000 + err;
}
"""

_LIB = None
_POOL = None
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
    for name in ("fm_begin_if", "fm_end_if"):
        getattr(handle, name).restype = ctypes.c_int
    handle.fm_begin_if.argtypes = [ctypes.c_void_p] * 3
    handle.fm_end_if.argtypes = [ctypes.c_void_p]
    handle.fm_stale_error.restype = ctypes.c_int
    handle.fm_error_string.restype = ctypes.c_char_p
    handle.fm_error_string.argtypes = [ctypes.c_int]
    return handle


class _Capturing:
    """What deep_gemm asks of the graph being captured."""

    def begin_capture_to_if_node(self, pred: torch.Tensor) -> None:
        device = torch.cuda.current_device()
        parent = torch.cuda.current_stream()
        child = torch.cuda.Stream()
        rc = _LIB.fm_begin_if(parent.cuda_stream, pred.data_ptr(), child.cuda_stream)
        if rc:
            what = _LIB.fm_error_string(rc % 1000).decode()
            raise RuntimeError(f"fm_begin_if failed: {rc} ({what}; step {rc // 1000})")
        # the body's allocations: from the capture's pool, whatever stream asks
        torch._C._cuda_endAllocateToPool(device, _POOL)
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, _POOL)
        guard = torch.cuda.stream(child)
        guard.__enter__()
        stack = getattr(_BODIES, "stack", None) or []
        stack.append((device, parent, child, guard))
        _BODIES.stack = stack

    def end_capture_to_conditional_node(self) -> None:
        device, parent, child, guard = _BODIES.stack.pop()
        guard.__exit__(None, None, None)
        rc = _LIB.fm_end_if(child.cuda_stream)
        if rc:
            raise RuntimeError(f"fm_end_if failed: {rc}")
        torch._C._cuda_endAllocateToPool(device, _POOL)
        with torch.cuda.stream(parent):  # the rest of the capture: the parent stream's
            torch._C._cuda_beginAllocateCurrentStreamToPool(device, _POOL)


def install() -> None:
    """Build the library and patch torch.cuda (idempotent)."""
    global _LIB, _POOL
    if _LIB is not None:
        return
    _LIB = _build()
    _POOL = torch.cuda.graph_pool_handle()
    capturing = _Capturing()
    torch.cuda.CUDAGraph.get_currently_capturing_graph = staticmethod(lambda: capturing)
    torch.cuda.CUDAGraph.begin_capture_to_if_node = _Capturing.begin_capture_to_if_node
    real_init = torch.cuda.graph.__init__

    def init(self, cuda_graph, pool=None, *args, **kwargs):
        real_init(self, cuda_graph, _POOL if pool is None else pool, *args, **kwargs)

    torch.cuda.graph.__init__ = init
    os.environ.setdefault("FUSEDMOE_COND_SHIM", "1")


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
