"""Whether Triton kernels can run: import triton lazily, never at package import."""

from __future__ import annotations

import importlib.util
import os

import torch

INSTALL_HINT = "pip install 'fusedmoe[gpu]' (or pip install triton)"


# Found once, without importing triton; a plain global, so torch.compile reads it as a constant
# (it refuses to trace importlib).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def has_triton() -> bool:
    return _HAS_TRITON


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take this tensor: CUDA, or the CPU under the interpreter."""
    return has_triton() and (t.is_cuda or (t.device.type == "cpu" and interpreting()))
