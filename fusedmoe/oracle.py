"""The oracle: picks the expert backend for a call, and says why every other was refused.

Backends are listed once, in order of preference (fastest first, the reference last). Each
declares what it supports on its own class (fusedmoe.modular.experts.Experts); the oracle
only asks.

monolithic precedes torch: on the CPU it is faster than the reference in every measured case
but one (benchmarks/bench_cpu_backends.py: the presets at 1/16 size, bf16 and fp32, M 1 / 16 /
128: 1.2x to 5.7x, and 0.8x to 1.0x for qwen3-30b bf16 at M = 1, where tiny bf16 GEMMs cost a
fixed ~10 us; at 1/4 size 1.2x to 15x). It routes inside, so it is only chosen where the router
logits are at hand (FusedMoE), and only for unquantized, non-float64 inference calls (no
autograd); elsewhere torch runs.

triton precedes deep_gemm and hpc wherever it runs the scheme, with one exception: where the
DeepGEMM library is importable and runs fp8_block on the GPU (DeepGemmExperts.library_runs),
or else where our wgmma GEMMs run it (DeepGemmExperts.wgmma_runs: Hopper, Triton with Gluon),
deep_gemm goes first. Its library GEMMs are 1.1x to 1.6x faster than triton from 128 slots per
expert (M * k / E) on an H200, its wgmma GEMMs 1.06x to 1.4x from 128, and an auto-chosen
deep_gemm hands smaller calls to triton (LIBRARY_MIN_SLOTS_PER_EXPERT,
WGMMA_MIN_SLOTS_PER_EXPERT), so the layer gets the faster path at every size (under skewed
routing, inside a CUDA graph, the wgmma engine can take such a call all the same: the choice
is made on the GPU, DeepGemmExperts._branch_on_device). On our own
Triton GEMMs deep_gemm is faster only from M ~ 16384 (1.03x to 1.08x) and 1.1x to 1.6x
slower from 256 to 4096 tokens; hpc is faster only with static per-tensor FP8 scales at M <= 64
and trails triton with 128-block scales. The oracle picks per layer, not per call size, so
those stay choices by name (backend="hpc" for a decode-only layer); deep_gemm and deep_gemm_fp4
are the automatic choice for mxfp8 and mxfp4_w4a8, which triton does not run (it runs the
weight-only schemes, mxfp4_w4a16 among them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from fusedmoe.activation import ActivationParams, MoEActivation
from fusedmoe.experts.deep_gemm import (
    LIBRARY_MIN_SLOTS_PER_EXPERT,
    WGMMA_MIN_SLOTS_PER_EXPERT,
    DeepGemmExperts,
    DeepGemmFP4Experts,
)
from fusedmoe.experts.hpc import HPCExperts
from fusedmoe.experts.monolithic import MonolithicExperts
from fusedmoe.experts.torch_ref import TorchExperts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.modular.experts import Experts
from fusedmoe.modular.types import ActivationSpec, MoEProblem

#: every backend, most preferred first
BACKENDS: tuple[type[Experts], ...] = (
    TritonExperts,
    DeepGemmExperts,
    DeepGemmFP4Experts,
    HPCExperts,
    MonolithicExperts,
    TorchExperts,
)


@dataclass(frozen=True)
class BackendChoice:
    name: str
    experts_cls: type[Experts]
    reason: str  # why this backend was chosen
    refused: dict[str, str] = field(default_factory=dict)  # backend name -> why not
    requested: bool = False  # named by the caller, not picked by "auto"
    #: what was asked (the engine's plan depends on its shape); not part of the choice's identity
    problem: MoEProblem | None = field(default=None, compare=False, repr=False)
    #: how the tokens travel between ranks, and why (FusedMoE under EP; None: not told)
    dispatch: str | None = None

    def create(self) -> Experts:
        """The backend instance to run (Experts.create)."""
        return self.experts_cls.create(requested=self.requested)

    def explain(self) -> str:
        lines = [f"{self.name}: {self.reason}"]
        if self.dispatch is not None:
            lines.append(f"  dispatch: {self.dispatch}")
        engine = self.experts_cls.engine_description(self.problem)
        if engine is not None:
            lines.append(f"  GEMM engine: {engine}")
        lines += [f"  not {name}: {why}" for name, why in self.refused.items()]
        return "\n".join(lines)


def backend_names() -> tuple[str, ...]:
    return tuple(cls.name for cls in BACKENDS)


def get_backend(name: str | type[Experts]) -> type[Experts]:
    """A backend by name; an Experts subclass (a backend of your own) is returned as is."""
    if isinstance(name, type) and issubclass(name, Experts):
        return name
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str or an Experts subclass, got {name!r}")
    for cls in BACKENDS:
        if cls.name == name:
            return cls
    raise ValueError(f"unknown backend {name!r}; expected 'auto' or one of {list(backend_names())}")


def _local_devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return devices


def available_backends() -> list[str]:
    """The backends that can run on this machine (dependencies importable, a device present)."""
    return [
        cls.name
        for cls in BACKENDS
        if cls.is_available() is None and any(cls.supports_device(d) for d in _local_devices())
    ]


def select_backend(
    problem: MoEProblem | None = None,
    *,
    backend: str | type[Experts] = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_experts: int | None = None,
    top_k: int | None = None,
    activation: MoEActivation | str = "silu",
    activation_params: ActivationParams | None = None,
    quant_config: object | None = None,
    has_bias: bool = False,
    has_expert_map: bool = False,
    ep_size: int = 1,
    has_router_logits: bool = False,
) -> BackendChoice:
    """Choose the backend for `problem` (or for the problem the keywords describe).

    backend="auto" takes the most preferred backend that supports the problem; a named backend
    is checked and refused with a ValueError that says why.
    """
    if problem is None:
        missing = [
            name
            for name, value in (
                ("hidden_size", hidden_size),
                ("intermediate_size", intermediate_size),
                ("num_experts", num_experts),
                ("top_k", top_k),
            )
            if value is None
        ]
        if missing:
            raise ValueError(f"select_backend needs a problem or {', '.join(missing)}")
        problem = MoEProblem(
            device=torch.device(device),
            dtype=dtype,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_experts=num_experts,
            top_k=top_k,
            activation=ActivationSpec.make(activation, activation_params),
            quant_config=quant_config,
            has_bias=has_bias,
            has_expert_map=has_expert_map,
            ep_size=ep_size,
            has_router_logits=has_router_logits,
        )
    order = _preference(problem)
    refused = {cls.name: cls.refusal_reason(problem) for cls in order}
    explicit = not (isinstance(backend, str) and backend == "auto")
    for cls in order:
        if not explicit and refused[cls.name] is None and not cls.preferred_on(problem.device):
            refused[cls.name] = f"runs on {problem.device.type} only when requested by name"

    if explicit:
        cls = get_backend(backend)
        why = cls.refusal_reason(problem)
        if why is not None:
            raise ValueError(f"backend {backend!r} cannot run this call: {why}")
        others = {n: r or "not requested" for n, r in refused.items() if n != cls.name}
        return BackendChoice(
            cls.name, cls, "requested explicitly", others, requested=True, problem=problem
        )

    for cls in order:
        if refused[cls.name] is None:
            preferred = [c.name for c in order[: order.index(cls)]]
            reason = (
                f"most preferred backend that supports {_describe(problem)}"
                if preferred
                else f"first choice, supports {_describe(problem)}"
            )
            if order is not BACKENDS and cls is DeepGemmExperts:
                reason += (
                    "; ahead of triton where the DeepGEMM library (or, without it, the wgmma "
                    "GEMMs on Hopper) runs fp8_block; calls of fewer than "
                    f"{LIBRARY_MIN_SLOTS_PER_EXPERT} (wgmma: {WGMMA_MIN_SLOTS_PER_EXPERT}) "
                    "slots per expert run on triton, unless, on the wgmma GEMMs and captured "
                    "into a CUDA graph, their ids put enough slots on the experts they touch "
                    "(chosen on the GPU)"
                )
            others = {
                n: r if r is not None else f"supported, but {cls.name} is preferred"
                for n, r in refused.items()
                if n != cls.name
            }
            if cls is TorchExperts:
                _warn_reference_on_gpu(problem, others)
            return BackendChoice(cls.name, cls, reason, others, problem=problem)
    details = "; ".join(f"{n}: {r}" for n, r in refused.items())
    raise ValueError(f"no backend supports {_describe(problem)} ({details})")


class ReferenceFallbackWarning(UserWarning):
    """A quantized call on a GPU runs on the float64 torch reference: no GPU backend runs it."""


def _warn_reference_on_gpu(problem: MoEProblem, refused: dict[str, str]) -> None:
    """A quantized problem on CUDA that only the reference backend runs. It is correct and
    hundreds of times slower than a GPU kernel, and it cannot be captured in a CUDA graph (it
    groups rows on the host). Python's warning registry shows each message once (per scheme,
    dtype and activation: they are in it) under the default filters."""
    qc = problem.quant_config
    if problem.device.type != "cuda" or qc is None:
        return
    why = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
    warnings.warn(
        f"{_describe(problem)} runs on the torch reference backend: no GPU backend runs it "
        f"({why}). The reference is correct but far slower, and cannot be captured in a CUDA "
        "graph. docs/quantization.md lists which scheme runs on which GPU.",
        ReferenceFallbackWarning,
        stacklevel=3,
    )


def _preference(problem: MoEProblem) -> tuple[type[Experts], ...]:
    """BACKENDS, with deep_gemm moved ahead of triton where the DeepGEMM library or our wgmma
    GEMMs run the problem (the fastest prefill GEMMs we have; deep_gemm hands small calls to
    triton)."""
    if not (DeepGemmExperts.library_runs(problem) or DeepGemmExperts.wgmma_runs(problem)):
        return BACKENDS
    rest = tuple(cls for cls in BACKENDS if cls is not DeepGemmExperts)
    return (DeepGemmExperts, *rest)


def _describe(problem: MoEProblem) -> str:
    quant = "unquantized" if problem.quant_config is None else problem.quant_config.scheme
    return (
        f"{problem.device.type}, {str(problem.dtype).removeprefix('torch.')}, {quant}, "
        f"{problem.activation.kind.value}"
    )
