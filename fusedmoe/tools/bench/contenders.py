"""What `fusedmoe bench` times in one row: the backends that support it, and the two baselines.

Backends come from fusedmoe.oracle.BACKENDS and their own capability predicates (nothing here
names one): by default every backend whose refusal_reason(problem) is None and that may run
on this device unasked (preferred_on: triton on the CPU interpreter runs only when named);
named with --backends, a backend runs wherever it supports the problem.

    modular backends       fusedmoe.fused_experts(x, w13, w2, topk_weights, topk_ids,
                           backend=name): the whole modular kernel, input checks included
    routes inside          Experts.apply_monolithic(x, router_logits, ...) with a plain softmax
    (monolithic)           top-k router over the row's logits: the same ids as the others get,
                           and the top-k selection is inside its time
    peers (--peers)        other libraries on the same weights and routing, built by
                           fusedmoe.tools.peers; timed after the backends, before the baselines
    grouped_mm, eager      fusedmoe.tools.baselines on the weights' values in the activation dtype

The reference for rel_err is fused_experts(..., backend="torch") on the same inputs (float64
inside, on the scheme's quantized weights).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fusedmoe.functional import check_expert_weights, fused_experts
from fusedmoe.modular.types import ActivationSpec, InsideRouting, MoEProblem
from fusedmoe.oracle import BACKENDS, BackendChoice, get_backend, select_backend
from fusedmoe.router import create_router
from fusedmoe.tools.baselines import eager_experts, grouped_mm_experts, grouped_mm_unavailable
from fusedmoe.tools.bench.inputs import ExpertSet, RoutingInputs

__all__ = [
    "BASELINES",
    "Contender",
    "Selection",
    "make_contenders",
    "reference_run",
    "select_backends",
]

BASELINES = ("grouped_mm", "eager")
REFERENCE = "torch"  # the backend rel_err is measured against


@dataclass(frozen=True)
class Contender:
    name: str  # a backend's name, or a baseline's
    weights: str  # the weight format it reads: the row's scheme, or the activation dtype
    run: Callable[[RoutingInputs], torch.Tensor]  # -> out [M, H]
    #: False: known to read device values on the host (timed by launches, no CUDA graph)
    capturable: bool = True
    note: str = ""  # how it runs, where that is worth saying
    #: an untimed check of a row's inputs, a line for the notes where something is off (a peer
    #: that routes the logits itself: whether it picked topk_ids' experts)
    check: Callable[[RoutingInputs], str | None] | None = None


@dataclass(frozen=True)
class Selection:
    """Which backends one (shape, scheme) is benchmarked on, and what the oracle would pick."""

    backends: list[str]
    refused: dict[str, str] = field(default_factory=dict)  # backend -> why it is not timed
    choice: BackendChoice | None = None  # the oracle's pick for a FusedMoE layer of this shape
    choice_error: str | None = None  # why the oracle found none


def select_backends(problem: MoEProblem, requested: Sequence[str] | None) -> Selection:
    """The backends to time for `problem` (requested None: every one that supports it here)."""
    names = [cls.name for cls in BACKENDS] if requested is None else list(requested)
    chosen, refused = [], {}
    for name in names:
        if name in BASELINES:
            continue
        cls = get_backend(name)
        why = cls.refusal_reason(problem)
        if why is None and requested is None and not cls.preferred_on(problem.device):
            why = f"runs on {problem.device.type} only when named (--backends {name})"
        if why is None:
            chosen.append(name)
        else:
            refused[name] = why
    try:
        return Selection(chosen, refused, select_backend(problem))
    except ValueError as exc:
        return Selection(chosen, refused, None, str(exc))


def _backend_run(name: str, experts: ExpertSet, activation: str, num_experts: int, top_k: int):
    cls = get_backend(name)
    qc = experts.quant_config
    if not cls.routes_inside:

        def run(r: RoutingInputs) -> torch.Tensor:
            return fused_experts(
                r.x, experts.w13, experts.w2, r.topk_weights, r.topk_ids,
                activation=activation, quant_config=qc, backend=name,
                w13_bias=experts.w13_bias, w2_bias=experts.w2_bias,
            )  # fmt: skip

        return run
    backend = cls()
    routing = InsideRouting(create_router(top_k, num_experts, renormalize=True))
    act = ActivationSpec.make(activation)

    def run_inside(r: RoutingInputs) -> torch.Tensor:
        weights = check_expert_weights(
            r.x, experts.w13, experts.w2, act.kind, experts.w13_bias, experts.w2_bias, qc
        )
        result = backend.apply_monolithic(
            r.x, r.router_logits, weights, routing=routing, activation=act, expert_start=0
        )
        return result.output

    return run_inside


def make_contenders(
    backends: Sequence[str],
    experts: ExpertSet,
    *,
    activation: str,
    num_experts: int,
    top_k: int,
    act_name: str,
    quant: str,
    device: torch.device,
    peers: Sequence[Contender] = (),
) -> list[Contender]:
    """The row's contenders: `backends` in order, then `peers` (fusedmoe.tools.peers), then
    grouped_mm and eager."""
    out = [
        Contender(name, quant, _backend_run(name, experts, activation, num_experts, top_k))
        for name in backends
    ]
    out += peers
    w13, w2 = experts.w13_plain, experts.w2_plain
    bias = dict(w13_bias=experts.w13_bias, w2_bias=experts.w2_bias)
    unavailable = grouped_mm_unavailable(device, w13.dtype)
    loop = unavailable is not None

    def grouped_mm(r: RoutingInputs) -> torch.Tensor:
        return grouped_mm_experts(
            r.x, w13, w2, r.topk_weights, r.topk_ids, activation, loop, **bias
        )

    def eager(r: RoutingInputs) -> torch.Tensor:
        return eager_experts(r.x, w13, w2, r.topk_weights, r.topk_ids, activation, **bias)

    note = f"per-expert loop ({unavailable})" if loop else "torch._grouped_mm"
    out.append(Contender("grouped_mm", act_name, grouped_mm, capturable=not loop, note=note))
    out.append(Contender("eager", act_name, eager, capturable=False, note="per-expert loop"))
    return out


def reference_run(experts: ExpertSet, activation: str) -> Callable[[RoutingInputs], torch.Tensor]:
    """The reference backend on the weights of `experts`: a row's (quantized) ones, or the
    unquantized ones a scheme was made from (err_bf16)."""

    def run(r: RoutingInputs) -> torch.Tensor:
        return fused_experts(
            r.x, experts.w13, experts.w2, r.topk_weights, r.topk_ids,
            activation=activation, quant_config=experts.quant_config, backend=REFERENCE,
            w13_bias=experts.w13_bias, w2_bias=experts.w2_bias,
        )  # fmt: skip

    return run
