"""The FusedMoE layer's calls replayed from CUDA graphs (the cache: fusedmoe.modular.graphs).

A call of up to layer.cuda_graph_max_tokens tokens (CUDA, no autograd, no input_ids) whose
routed part is graph safe replays a graph of that part, captured once per token bucket:

    routed(x, logits)      router -> zero-expert split -> experts        (forward)
    routed(x)              gate.logits(gate.module, x) -> the same       (forward_gated)
    either one             + shared_experts(x) * sigmoid(shared_expert_gate(x)), where nothing
                           runs between them and the routed sum (shared_reads)

The gate and the shared experts are captured only where a graph may stand in for their modules
(fusedmoe.modular.graphs.graph_reads: torch's, transformers' and fusedmoe's own classes, in
eval mode, called plainly); the others, hooks and all, run eagerly, outside the graph.

The key holds everything the captured launches read by address besides their inputs: the
logits' dtype and width (or the gate's function and its module's tensors), the shared experts'
tensors, and the layer's own parameters and buffers (graph_addresses). A tensor replaced
changes the key; a write in place shows through.

layer._graph_state = (the layer's set of backends, GraphCache, runner per (device, dtype)); the
graphs belong to that set: a new one (set_backend, .to(), quantize_, a new placement) starts an
empty cache, and a copy of the layer (__getstate__) captures its own. The state and each runner
are made once, by one thread (_STATE_LOCK), so every graph reads the runner the layer keeps;
the cache itself is safe to call from any thread on any stream (each stream replays graphs of
its own: fusedmoe.modular.graphs, lanes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from fusedmoe._checks import FLOAT_DTYPES, check_tensor
from fusedmoe.modular.graphs import GraphCache, graph_reads
from fusedmoe.parallel.wiring import make_runner
from fusedmoe.weights.quantize import call_quant_config

if TYPE_CHECKING:
    from fusedmoe.layer import FusedMoE
    from fusedmoe.oracle import BackendChoice

_STATE_LOCK = threading.Lock()  # the making of a layer's graph state and runners (rare)


@dataclass(frozen=True)
class RouterGate:
    """A router its caller owns, for FusedMoE.forward_gated: logits(module, x [T, H]) gives
    the router logits [T, E (+ zero experts)], reading the module's parameters and buffers
    only (a CUDA graph may replay it: nothing else it reads may change between calls). Pass
    the same `logits` callable on every call (a module-level function): it is part of the
    graph's key, and a new one is a new graph."""

    module: nn.Module
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def gate_logits(gate: RouterGate, x: torch.Tensor) -> torch.Tensor:
    """The router logits [T, E] of a RouterGate, computed eagerly, checked."""
    logits = gate.logits(gate.module, x)
    check_tensor("the gate's logits", logits, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    if logits.shape[0] != x.shape[0]:
        raise ValueError(
            f"the gate's logits {tuple(logits.shape)} must have one row per token ({x.shape[0]})"
        )
    return logits


@dataclass(frozen=True)
class Replayed:
    """What a graph replay of the routed part gives (forward_graphed)."""

    y: torch.Tensor  # [T, H] the routed sum
    zero_output: torch.Tensor | None  # [T, H] the zero experts' output, None without them
    shared_added: bool  # y holds the shared experts' output too


def graph_safe(layer: FusedMoE, choice: BackendChoice) -> bool:
    """Whether the routed part of a call may be captured: a backend and router whose calls
    launch the same kernels every time without reading device values, no EP (naive and
    all_to_all exchange counts on the host; a symm_mem forward can be captured whole, but the
    ranks must capture and replay together, which a per-rank cache of token buckets cannot
    promise: capture the EP forward yourself) or EPLB load counting (padding rows would
    count), and no activation scale taken over the whole batch (the padding rows would
    change it).
    """
    pc = layer.parallel_config
    return (
        choice.experts_cls.cuda_graph_safe
        and layer.router.cuda_graph_safe
        and pc.ep_size == 1
        and pc.dp_size == 1
        and not layer.record_expert_load
        and layer.logical_to_physical is None
        and (layer.quant_scheme is None or call_quant_config(layer).rows_independent)
    )


def gate_reads(layer: FusedMoE, gate: RouterGate) -> tuple[int, ...] | None:
    """What a graph computing the gate's logits reads (graph_reads of its module); None where
    it may not: the logits come from the layer's input (no routed input transform)."""
    return None if layer.routed_input_transform is not None else graph_reads(gate.module)


def shared_reads(layer: FusedMoE) -> tuple[int, ...] | None:
    """What a graph adding the shared experts reads (graph_reads of theirs); None where it may
    not: they come from the layer's input right after the routed sum (no zero experts or
    routed transforms between)."""
    if (
        layer.shared_experts is None
        or layer.routed_input_transform is not None
        or layer.routed_output_transform is not None
        or layer.zero_expert_num != 0
    ):
        return None
    return graph_reads(layer.shared_experts, layer.shared_expert_gate)


def graph_addresses(layer: FusedMoE) -> tuple[int, ...]:
    """The addresses a captured call reads: every parameter and buffer of the layer's own
    (not the shared experts')."""
    tensors = (*layer._parameters.values(), *layer._buffers.values())
    return tuple(t.data_ptr() if t is not None else 0 for t in tensors)


def _graph_runner(layer: FusedMoE, choice: BackendChoice, device, dtype) -> tuple:
    """(layer._graph_state, its runner for device and dtype), made where missing: by one
    thread at a time, so that two first calls do not each capture with a runner of their own."""
    with _STATE_LOCK:
        state = layer._graph_state
        if state is None or state[0] is not layer._kernels:
            state = layer._graph_state = (layer._kernels, GraphCache(), {})
        runners = state[2]
        runner = runners.get((device, dtype))
        if runner is None:
            # its own modular kernel: workspaces that are never freed while a graph holds them
            _, eager = layer._kernel(device, dtype, False)
            experts = eager if choice.experts_cls.routes_inside else eager.experts
            pc, placement = layer.parallel_config, layer.placement
            runner = make_runner(experts, pc, placement, layer.chunk_size, retain_workspaces=True)
            runners[(device, dtype)] = runner
        return state, runner


def forward_graphed(
    layer: FusedMoE,
    choice: BackendChoice,
    x_routed: torch.Tensor,
    logits: torch.Tensor | None,
    gate: RouterGate | None,
    reads_of_gate: tuple[int, ...] | None,
) -> Replayed | None:
    """The routed part of x_routed [T, H] replayed from a CUDA graph, or None where it cannot
    be captured; with a gate (logits None; reads_of_gate, what its module reads: gate_reads),
    the graph computes the logits too."""
    state = layer._graph_state
    device, dtype = x_routed.device, x_routed.dtype
    runner = None if state is None else state[2].get((device, dtype))
    if runner is None or state[0] is not layer._kernels:
        state, runner = _graph_runner(layer, choice, device, dtype)
    graphs = state[1]
    reads_of_shared = shared_reads(layer)
    with_shared = reads_of_shared is not None

    def routed(x, *given):
        router_logits = given[0] if gate is None else gate_logits(gate, x)
        if choice.experts_cls.routes_inside:
            y, zero_output = layer._forward_monolithic(runner, x, router_logits, None)
        else:
            y, zero_output = layer._forward_modular(choice, runner, x, router_logits, None)
        if with_shared:
            y = y + layer._shared_output(x)
        return y, zero_output

    # what the captured launches read by address, besides the inputs
    if gate is None:
        inputs, reads = (x_routed, logits), (logits.dtype, logits.shape[1])
    else:
        inputs, reads = (x_routed,), (gate.logits, *reads_of_gate)
    if with_shared:
        reads += ("shared", *reads_of_shared)
    key = (device, dtype, *reads, *graph_addresses(layer))
    replayed = graphs.run(routed, inputs, key)
    return None if replayed is None else Replayed(*replayed, with_shared)
