"""Whether Triton kernels can run: import triton lazily, never at package import."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

INSTALL_HINT = "pip install 'fusedmoe[gpu]' (or pip install triton)"


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take this tensor: CUDA, or the CPU under the interpreter."""
    return has_triton() and (t.is_cuda or (t.device.type == "cpu" and interpreting()))
