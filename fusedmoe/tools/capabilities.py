"""`fusedmoe backends`: what every backend of fusedmoe.oracle.BACKENDS supports, and whether it
runs on this machine. Everything is read from the backends' own capability predicates
(fusedmoe.modular.experts.Experts); a backend added to BACKENDS appears here by itself.

Columns: the activation dtypes (bf16, fp16, fp32, fp64) and quantization schemes
(fusedmoe.quant SCHEMES) it accepts, its activations, the hidden sizes it takes, biases,
expert_map, expert parallelism, autograd, whether it routes inside (needs the router logits),
the devices it supports (CPU, CUDA, and where the CPU only emulates it: preferred_on), and
"runs here". Last, the GEMM engine of the backends that have a choice (deep_gemm: the DeepGEMM
library and its version, or our Triton GEMMs).

A scheme is asked about with a config built from a small quantized tensor on the CPU (a
predicate may look at keys, layouts or scale dtypes, never at values). "runs here" is yes when
the backend's dependencies import and a device it supports is present, else the reason.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from fusedmoe.activation import MoEActivation
from fusedmoe.modular.experts import Experts
from fusedmoe.oracle import BACKENDS
from fusedmoe.quant.config import SCHEMES, FusedMoEQuantConfig, quantize_experts

__all__ = ["DTYPES", "BackendCapabilities", "capabilities", "capability_matrix", "format_matrix"]

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
#: an EP size asked of supports_ep: any size > 1 that the backend accepts means "EP"
_EP_PROBE = 8


@dataclass(frozen=True)
class BackendCapabilities:
    name: str
    dtypes: list[str]  # unquantized activation dtypes
    schemes: list[str]  # quantization schemes
    activations: list[str]  # MoEActivation values; "all" collapses the full list in the table
    bias: bool
    expert_map: bool
    ep: bool
    autograd: bool
    routes_inside: bool
    hidden_multiple: int | None  # hidden sizes it takes are multiples of this (None: unclear)
    devices: list[str]  # "cpu", "cuda"; "cpu (by name)" where auto never picks it there
    runs_here: str | None  # None: yes; else why not
    engine: str | None  # the GEMMs it runs, where it has a choice (engine_description)


@functools.lru_cache(maxsize=1)
def _scheme_configs() -> dict[str, FusedMoEQuantConfig]:
    """One quant config per scheme, from tiny CPU weights (E=1, N=2*128, K=128)."""
    w13 = torch.randn(1, 256, 128) / 8
    w2 = torch.randn(1, 128, 128) / 8
    return {scheme: quantize_experts(w13, w2, scheme)[2] for scheme in SCHEMES}


def _devices(cls: type[Experts]) -> list[str]:
    devices = []
    for device in (torch.device("cpu"), torch.device("cuda")):
        if cls.supports_device(device):
            by_name = not cls.preferred_on(device)
            devices.append(f"{device.type} (by name)" if by_name else device.type)
    return devices


def _hidden_multiple(cls: type[Experts]) -> int | None:
    """The smallest power of two a such that the backend takes hidden sizes a and 3a (so
    probably every multiple of a); the layer pads to Experts.hidden_size_alignment anyway."""
    for shift in range(11):
        a = 1 << shift
        if cls.supports_hidden_size(a) and cls.supports_hidden_size(3 * a):
            return max(a, cls.hidden_size_alignment)
    return None


def _runs_here(cls: type[Experts]) -> str | None:
    why = cls.is_available()
    if why is not None:
        return why
    local = [torch.device("cpu")]
    if torch.cuda.is_available():
        local.append(torch.device("cuda"))
    if any(cls.supports_device(d) for d in local):
        return None
    if torch.cuda.is_available():
        return "supports neither the CPU nor this GPU"
    if cls.supports_device(torch.device("cuda")):
        return "needs a CUDA GPU, none is visible"
    return "supports no device present here"


def capabilities(cls: type[Experts]) -> BackendCapabilities:
    configs = _scheme_configs()
    return BackendCapabilities(
        name=cls.name,
        dtypes=[name for name, dtype in DTYPES.items() if cls.supports_dtype(dtype)],
        schemes=[s for s in SCHEMES if cls.supports_quant_config(configs[s])],
        activations=[a.value for a in MoEActivation if cls.supports_activation(a)],
        bias=cls.supports_bias(),
        expert_map=cls.supports_expert_map(),
        ep=cls.supports_ep(_EP_PROBE),
        autograd=cls.supports_autograd(),
        routes_inside=cls.routes_inside,
        hidden_multiple=_hidden_multiple(cls),
        devices=_devices(cls),
        runs_here=_runs_here(cls),
        engine=cls.engine_description(),
    )


def capability_matrix() -> list[BackendCapabilities]:
    """One entry per backend, in the oracle's order of preference."""
    return [capabilities(cls) for cls in BACKENDS]


def as_json(matrix: list[BackendCapabilities]) -> list[dict]:
    return [asdict(c) for c in matrix]


def _multiple(value: int | None) -> str:
    return "any" if value == 1 else "?" if value is None else f"% {value} == 0"


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def format_matrix(matrix: list[BackendCapabilities]) -> str:
    """Two tables: the capability flags, then each scheme and dtype as a yes / - grid."""
    all_acts = [a.value for a in MoEActivation]
    rows = []
    for c in matrix:
        acts = "all" if c.activations == all_acts else ",".join(c.activations) or "-"
        rows.append(
            {
                "backend": c.name,
                "runs here": "yes" if c.runs_here is None else f"no ({c.runs_here})",
                "devices": ", ".join(c.devices) or "-",
                "activations": acts,
                "hidden size": _multiple(c.hidden_multiple),
                "bias": _yes(c.bias),
                "expert_map": _yes(c.expert_map),
                "EP": _yes(c.ep),
                "autograd": _yes(c.autograd),
                "routes inside": _yes(c.routes_inside),
            }
        )
    formats = {c.name: {*c.dtypes, *c.schemes} for c in matrix}
    grid = [
        {"backend": c.name, **{f: _yes(f in formats[c.name]) for f in (*DTYPES, *SCHEMES)}}
        for c in matrix
    ]
    engines = [f"  {c.name}: {c.engine}" for c in matrix if c.engine is not None]
    tail = "\n\nGEMM engines:\n" + "\n".join(engines) if engines else ""
    return _table(rows) + "\n\n" + _table(grid) + tail


def _table(rows: list[dict[str, str]]) -> str:
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(widths[k]) for k in keys).rstrip()]
    lines.append("  ".join("-" * widths[k] for k in keys))
    lines += ["  ".join(r[k].ljust(widths[k]) for k in keys).rstrip() for r in rows]
    return "\n".join(lines)
