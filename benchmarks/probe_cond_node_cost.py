"""What a branch on the GPU costs in a CUDA graph: conditional nodes around small kernels.

    PYTHONPATH=.:benchmarks python3 benchmarks/probe_cond_node_cost.py

A graph of seven small Triton kernels (64 programs each), replayed 3000 times, against the same
graph with four of them behind conditional nodes (built with benchmarks/cond_node_shim.py, so
any torch): two IF nodes (what torch's begin_capture_to_if_node makes of an if / else: one
node per flag, each after the kernel that sets its condition), and one IF / ELSE node (CUDA
12.8 and later; not in torch's API). Microseconds per replay, the differences to the plain
graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from cond_node_shim import check, library


@triton.jit
def _add(x_ptr, n, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + c, mask=mask)


def main() -> None:
    lib = library()
    x = torch.zeros(1 << 16, device="cuda")
    flags = torch.tensor([1, 0], dtype=torch.uint8, device="cuda")
    child = torch.cuda.Stream()

    def kernels(n):
        for _ in range(n):
            _add[(64,)](x, x.numel(), 1.0, BLOCK=1024)

    def body(index, n):
        check(lib.fm_begin_body(child.cuda_stream, index), "fm_begin_body")
        with torch.cuda.stream(child):
            kernels(n)
        check(lib.fm_end_body(child.cuda_stream), "fm_end_body")

    def plain(stream):
        kernels(7)

    def two_ifs(stream):
        kernels(2)
        for i in range(2):
            check(lib.fm_add_if(stream, flags.data_ptr() + i, 1), "fm_add_if")
            body(0, 4)
        kernels(1)

    def if_else(stream):
        kernels(2)
        check(lib.fm_add_if(stream, flags.data_ptr(), 2), "fm_add_if")
        body(0, 4)
        body(1, 4)
        kernels(1)

    kernels(1)
    results = {}
    for name, build in (("plain", plain), ("two IF nodes", two_ifs), ("one IF / ELSE", if_else)):
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=stream):
            build(torch.cuda.current_stream().cuda_stream)
        for _ in range(100):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3000):
            graph.replay()
        end.record()
        end.synchronize()
        results[name] = start.elapsed_time(end) / 3000 * 1e3
        print(f"{name:14s} {results[name]:6.2f} us ({results[name] - results['plain']:+.2f})")


if __name__ == "__main__":
    main()
