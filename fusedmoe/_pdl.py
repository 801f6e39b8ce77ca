"""Programmatic dependent launch (PDL, Hopper and later): the next kernel of a chain is
launched while the previous one finishes, and waits for it on the GPU instead of on the launch.

A decode-sized call is a chain of short kernels (route, quantize x, align, GEMM1, act + quant,
GEMM2, top-k sum). Between two of them the GPU sits through the next kernel's launch and start.
With PDL the next kernel's programs start early and stop at `griddepcontrol.wait`, which
returns once the previous kernel has finished and its writes are visible. A short kernel lets
its dependents start at once (`pdl_start`); a GEMM lets them start as its programs exit
(`pdl_wait`; see there why). On an H100 this took 0.8 to 2.6 us off a decode call of the triton
backend (benchmarks/bench_pdl.py; qwen3-30b-a3b fp8_block at M = 1: 21.0 -> 19.9 us).

The contract, kept by construction: a kernel launched with PDL calls `pdl_start(PDL)` or
`pdl_wait(PDL)` before it touches global memory, so nothing it reads or writes can race with
the kernel before it (tests/test_pdl.py checks each such kernel's first statement). Only kernels
that take the PDL constexpr are launched with it (`pdl_args` gives both the constexpr and the
launch option, or neither); the others, and torch's own kernels, launch as always and wait for
the whole previous kernel.

PDL is on for CUDA tensors on compute capability >= 9.0 with a Triton that has the
griddepcontrol intrinsics; FUSEDMOE_PDL=0 turns it off (read at a device's first launch). This
module imports triton: only the kernel modules import it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # the griddepcontrol intrinsics and the launch option (Triton 3.3 on)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = "launch_pdl" in CUDAOptions.__dataclass_fields__
except (ImportError, AttributeError):  # an older Triton: no PDL
    _HAS_GDC = False

__all__ = ["pdl_args", "pdl_start", "pdl_wait"]

if _HAS_GDC:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """First statement of a short kernel that may be launched with PDL: wait for the
        previous kernel (its writes visible), then let the next one start."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """First statement of a long kernel (the GEMMs) that may be launched with PDL: wait for
        the previous kernel; the next one starts as this one's programs exit. Signalled at its
        start, the next kernel's programs take the SMs that free up first and wait there: a
        GEMM2 of fewer programs than SMs then sits packed on a few of them (mixtral-8x7b
        fp8_block at M = 1 went from 139 to 176 us on an H100)."""
        if PDL:
            gdc_wait()

else:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        pass

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        pass


_OFF: dict = {"PDL": False}
_ON: dict = {"PDL": True, "launch_pdl": True}
_BY_DEVICE: dict[int, dict] = {}


def _enabled() -> bool:
    return _HAS_GDC and os.environ.get("FUSEDMOE_PDL", "1") != "0"


def pdl_args(t: torch.Tensor) -> dict:
    """The PDL constexpr and launch option for a kernel launched on t's device: {"PDL": True,
    "launch_pdl": True} on a CUDA device of compute capability >= 9.0, else {"PDL": False}
    (the CPU interpreter, older GPUs, FUSEDMOE_PDL=0). Spread into the launch's keywords."""
    if not t.is_cuda or torch.version.cuda is None:  # griddepcontrol is NVIDIA's (not ROCm)
        return _OFF
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    args = _BY_DEVICE.get(index)
    if args is None:
        args = _ON if _enabled() and torch.cuda.get_device_capability(index)[0] >= 9 else _OFF
        _BY_DEVICE[index] = args
    return args
