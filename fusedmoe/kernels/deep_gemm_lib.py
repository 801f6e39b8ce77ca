"""The DeepGEMM library, when one is importable: found once, described, and called.

fusedmoe never needs it. Where it is importable and runs on the GPU, the deep_gemm backend
runs its FP8 grouped GEMMs (DeepGEMM's own CUDA kernels, JIT-compiled by the library with the
machine's nvcc on first use) instead of our Triton ones:

    m_grouped_fp8_gemm_nt_contiguous   a [M_sum, K] in expert-aligned runs, m_indices [M_sum]
                                       (-1 on padding rows), d [M_sum, N]
    m_grouped_fp8_gemm_nt_masked       a [E_l, max_m, K], masked_m [E_l] rows in use per
                                       expert, d [E_l, max_m, N]; max_m a multiple of
                                       MASKED_ROWS

Where it is looked for, in order: the `deep_gemm` package, then the copy a vLLM install bundles
(`vllm.third_party.deep_gemm`). FUSEDMOE_DEEP_GEMM=0 turns the library off (our Triton GEMMs
run); FUSEDMOE_DEEP_GEMM=<module> names the module to import instead.

Scale layouts (sm90): activation scales float32 [rows, K / 128] in the MN-major layout the
library's TMA loads want (strides (1, rows), rows a multiple of 4) -- given another layout the
library copies them into that one first, on every call. Weight scales float32
[E, N / 128, K / 128] as quantize_experts makes them. Output bf16 only.

Hopper (compute capability 9) only, for now: on Blackwell the library keeps only the exponent
of float32 scales (it packs them as UE8M0), which is exact only for power-of-two scales, and
our fp8_block scales are not; there our Triton GEMMs run.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = [
    "MASKED_ROWS",
    "DeepGemmLibrary",
    "device_capability",
    "find_library",
    "library_status",
    "library_unusable_reason",
]

logger = logging.getLogger("fusedmoe")

_ENV = "FUSEDMOE_DEEP_GEMM"
_CANDIDATES = ("deep_gemm", "vllm.third_party.deep_gemm")
#: compute capabilities (major) the library runs our scales on: sm90 (see the module docstring)
_ARCHES = (9,)
#: max_m of the masked layout is a multiple of this (the library's masked kernels compute
#: wrong rows below 64 on an H200, DeepGEMM 2.8.1)
MASKED_ROWS = 64
_ENTRY_POINTS = ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked")


@dataclass(frozen=True)
class DeepGemmLibrary:
    module: ModuleType
    import_name: str
    version: str

    def describe(self) -> str:
        return f"DeepGEMM {self.version} (import {self.import_name})"

    def contiguous(self, a, a_scale, w, w_scale, out, m_indices) -> None:
        """out [M_sum, N] = a [M_sum, K] @ w[m_indices].T, rows of m_indices -1 unwritten."""
        self.module.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w, w_scale), out, m_indices)

    def masked(self, a, a_scale, w, w_scale, out, masked_m, expected_m: int) -> None:
        """out[e, :masked_m[e]] = a[e, :masked_m[e]] @ w[e].T; expected_m: a hint of the
        typical masked_m (the library picks its tiles by it)."""
        self.module.m_grouped_fp8_gemm_nt_masked(
            (a, a_scale), (w, w_scale), out, masked_m, expected_m
        )


_UNSEARCHED = object()
_found: object = _UNSEARCHED
_why_not: str = ""


def _candidates() -> tuple[str, ...]:
    choice = os.environ.get(_ENV, "").strip()
    if choice in ("0", "off", "false", "no"):
        return ()
    if choice and choice not in ("1", "on", "true", "yes", "auto"):
        return (choice,)
    return _CANDIDATES


def _try_import(name: str) -> tuple[DeepGemmLibrary | None, str]:
    root = name.split(".")[0]
    try:
        if importlib.util.find_spec(root) is None:
            return None, f"{name}: not installed"
        module = importlib.import_module(name)
    except Exception as e:  # a broken install (ABI, CUDA libraries) is "not usable", not fatal
        return None, f"{name}: import failed ({type(e).__name__}: {str(e)[:200]})"
    missing = [f for f in _ENTRY_POINTS if not hasattr(module, f)]
    if missing:
        return None, f"{name}: has no {', '.join(missing)}"
    return DeepGemmLibrary(module, name, str(getattr(module, "__version__", "unknown"))), ""


def find_library(*, refresh: bool = False) -> DeepGemmLibrary | None:
    """The DeepGEMM library, imported on the first call (None where there is none)."""
    global _found, _why_not
    if _found is _UNSEARCHED or refresh:
        names = _candidates()
        found, reasons = None, []
        for name in names:
            found, why = _try_import(name)
            if found is not None:
                break
            reasons.append(why)
        if not names:
            reasons.append(f"turned off by {_ENV}={os.environ.get(_ENV)}")
        _found, _why_not = found, "; ".join(reasons)
        if found is not None:
            logger.info("fusedmoe: deep_gemm runs %s", found.describe())
    return _found  # type: ignore[return-value]


@functools.cache
def device_capability(index: int) -> tuple[int, int]:
    """A GPU's compute capability, asked once (the backend asks on every call)."""
    return torch.cuda.get_device_capability(index)


def library_unusable_reason(device: torch.device) -> str | None:
    """None where the library's FP8 grouped GEMMs run on `device`, else why not."""
    if device.type != "cuda":
        return f"the DeepGEMM library runs on CUDA GPUs, not {device.type}"
    lib = find_library()
    if lib is None:
        return f"no DeepGEMM library ({_why_not})"
    major, minor = device_capability(
        torch.cuda.current_device() if device.index is None else device.index
    )
    if major not in _ARCHES:
        return f"{lib.describe()} is used on sm90 only, this GPU is sm{major}{minor}"
    return None


def library_status() -> str:
    """One line: which GEMM engine the deep_gemm backend runs here, and why."""
    lib = find_library()
    if lib is None:
        return f"fusedmoe Triton GEMMs (no DeepGEMM library: {_why_not})"
    if not torch.cuda.is_available():
        return f"{lib.describe()} on sm90 GPUs, fusedmoe Triton GEMMs elsewhere"
    why = library_unusable_reason(torch.device("cuda"))
    if why is not None:
        return f"fusedmoe Triton GEMMs ({why})"
    return f"{lib.describe()} for fp8_block in bf16; fusedmoe Triton GEMMs for the rest"
