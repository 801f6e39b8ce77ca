"""The FusedMoE layer's backends: the problem it poses the oracle, and what its calls run.

    layer.backend     a backend name or class, or "auto" (the oracle's choice)
    layer._kernels    (device, dtype, requires_grad) -> (BackendChoice, runner), made at the
                      first call of each signature; emptied where the choice may change
                      (set_backend, .to(), quantize_, a new placement), which also retires the
                      layer's CUDA graphs (fusedmoe.layer_graphs)

The runner is the backend itself where it routes inside, else a modular kernel around it
(fusedmoe.parallel.wiring.make_runner).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from fusedmoe.modular.experts import Experts
from fusedmoe.modular.kernel import FusedMoEModularKernel
from fusedmoe.modular.types import MoEProblem
from fusedmoe.oracle import BackendChoice, get_backend, select_backend
from fusedmoe.parallel.wiring import (
    DispatchChoice,
    attach_fingerprint,
    layer_fingerprint,
    make_runner,
    resolve_dispatch,
)
from fusedmoe.weights.quantize import call_quant_config

if TYPE_CHECKING:
    from fusedmoe.layer import FusedMoE


def layer_dispatch(layer: FusedMoE, device: torch.device, requires_grad: bool) -> DispatchChoice:
    """How a call's tokens travel (fusedmoe.parallel.wiring.resolve_dispatch)."""
    qc = call_quant_config(layer)
    backend = layer.backend
    routes_inside = not (isinstance(backend, str) and backend == "auto") and (
        get_backend(backend).routes_inside
    )
    return resolve_dispatch(
        layer.parallel_config,
        device,
        requires_grad=requires_grad,
        rows_independent=qc is None or qc.rows_independent,
        routes_inside=routes_inside,
    )


def layer_problem(
    layer: FusedMoE,
    device: torch.device,
    dtype: torch.dtype,
    requires_grad: bool,
    dispatch: DispatchChoice | None = None,
) -> MoEProblem:
    """What a call of the layer on `device` / `dtype` asks of a backend."""
    pc = layer.parallel_config
    if dispatch is None:
        dispatch = layer_dispatch(layer, device, requires_grad)
    return MoEProblem(
        device=device,
        dtype=dtype,
        hidden_size=layer.hidden_size,
        intermediate_size=layer.padded_intermediate_size,
        num_experts=layer.num_experts,
        top_k=layer.top_k,
        activation=layer.activation,
        quant_config=call_quant_config(layer),
        has_bias=layer.has_bias,
        # a block of logical experts runs on a shift (monolithic); anything else on a map
        has_expert_map=layer.expert_start is None,
        ep_size=pc.ep_size,
        all2all_backend=dispatch.kind,
        sequence_parallel=pc.sequence_parallel,
        requires_grad=requires_grad,
        has_router_logits=True,
    )


def kernel(
    layer: FusedMoE, device: torch.device, dtype: torch.dtype, requires_grad: bool
) -> tuple[BackendChoice, Experts | FusedMoEModularKernel]:
    """FusedMoE._kernel: the backend chosen for calls of this signature, and their runner."""
    key = (device, dtype, requires_grad)
    if key not in layer._kernels:
        dispatch = layer_dispatch(layer, device, requires_grad)
        problem = layer_problem(layer, device, dtype, requires_grad, dispatch)
        choice = select_backend(problem, backend=layer.backend)
        if dispatch.kind is not None:
            choice = dataclasses.replace(choice, dispatch=dispatch.describe())
        pc, placement = layer.parallel_config, layer.placement
        experts = choice.create()
        runner = make_runner(experts, pc, placement, layer.chunk_size, dispatch=dispatch.kind)
        if pc.use_ep:
            fingerprint = layer_fingerprint(layer, dispatch.kind, experts)
            attach_fingerprint(runner, layer._dispatch, fingerprint)
        layer._kernels[key] = (choice, runner)
    return layer._kernels[key]


def set_backend(layer: FusedMoE, backend: str | type[Experts]) -> None:
    """FusedMoE.set_backend: checked at once for the parameters' device and dtype; a refused
    choice changes nothing."""
    if not (isinstance(backend, str) and backend == "auto"):
        get_backend(backend)
    previous = getattr(layer, "backend", None), getattr(layer, "_kernels", None)
    layer.backend = backend
    layer._kernels = {}
    try:
        layer.backend_choice()
    except (ValueError, TypeError):
        layer.backend, layer._kernels = previous
        raise
