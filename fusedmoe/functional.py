"""Functional entry points: fused_experts (given the routing) and fused_moe (routing included).

Legend: M tokens, H hidden, I intermediate, N = 2I (gated) or I, E global experts,
E_l local experts, k top-k.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from fusedmoe._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_ids_in_range,
    check_shape,
    check_tensor,
)
from fusedmoe.activation import ActivationParams, MoEActivation
from fusedmoe.modular.graphs import DEFAULT_MAX_TOKENS, GraphCache, may_replay
from fusedmoe.modular.kernel import CHUNK_SIZE_ENV, FusedMoEModularKernel, default_chunk_size
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.modular.types import ActivationSpec, ExpertWeights, MoEProblem, needs_grad
from fusedmoe.oracle import select_backend
from fusedmoe.quant.config import FusedMoEQuantConfig, check_inference_only
from fusedmoe.router import ZeroExpertType, create_router, split_zero_experts


def check_expert_weights(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: MoEActivation,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    quant_config: FusedMoEQuantConfig | None = None,
) -> ExpertWeights:
    """Check the expert weights against each other, the input and the quant config."""
    x = hidden_states
    check_tensor("w13", w13, ndim=3, device=x.device)
    check_tensor("w2", w2, ndim=3, device=x.device)
    packing = 1
    if quant_config is not None:
        quant_config.check_weights(w13, w2)
        packing = quant_config.hidden_size(w13) // w13.shape[2]
    num_local, gemm1_out, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * packing
    if hidden != x.shape[1]:
        raise ValueError(
            f"w13 must be [E, N, H={x.shape[1]}] (H of hidden_states), got {tuple(w13.shape)}"
            + (" (packed FP4: H/2 bytes)" if packing == 2 else "")
        )
    intermediate = w2.shape[2] * packing
    expected_n = activation.gemm1_out_size(intermediate)
    check_shape("w2", w2, (num_local, hidden, w2.shape[2]))
    if gemm1_out != expected_n:
        kind = "gated (2 * I)" if activation.is_gated else "non-gated (I)"
        raise ValueError(
            f"w13 must have {expected_n} rows per expert for the {kind} activation "
            f"{activation.value!r} with I = {intermediate} (from w2), got {tuple(w13.shape)}"
        )
    for name, w in (("w13", w13), ("w2", w2)):
        if quant_config is None and w.dtype != x.dtype:
            raise TypeError(
                f"{name} has dtype {w.dtype} but hidden_states has {x.dtype}: unquantized experts "
                "need both in one dtype (cast explicitly, or pass a quant_config)"
            )
    if w13_bias is not None:
        check_tensor("w13_bias", w13_bias, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        check_shape("w13_bias", w13_bias, (num_local, gemm1_out))
    if w2_bias is not None:
        check_tensor("w2_bias", w2_bias, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        check_shape("w2_bias", w2_bias, (num_local, hidden))
    return ExpertWeights(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias, k_packing=packing)


def check_quant_config(quant_config: object) -> FusedMoEQuantConfig | None:
    if quant_config is not None and not isinstance(quant_config, FusedMoEQuantConfig):
        raise TypeError(
            "quant_config must be a FusedMoEQuantConfig (see fusedmoe.quant.quantize_experts), "
            f"got {type(quant_config).__name__}"
        )
    return quant_config


def merge_activation_params(
    activation_params: ActivationParams | None, quant_config: FusedMoEQuantConfig | None
) -> ActivationParams | None:
    """Activation parameters given directly, or as the quant config's gemm1_* (not both)."""
    from_config = None if quant_config is None else quant_config.activation_params()
    if activation_params is not None and from_config is not None:
        raise ValueError(
            "activation parameters given twice: activation_params and the quant config's "
            "gemm1_alpha / gemm1_beta / gemm1_clamp_limit"
        )
    return activation_params or from_config


def check_routing(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    global_num_experts: int,
) -> None:
    check_tensor(
        "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=hidden_states.device
    )
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, device=hidden_states.device)
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
            "must have the same shape [M, k]"
        )
    if topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"topk_ids has {topk_ids.shape[0]} tokens, hidden_states {hidden_states.shape[0]}"
        )
    if topk_ids.shape[1] == 0:
        raise ValueError("top_k must be >= 1, got topk_ids with 0 columns")
    # -1 marks an empty slot (a zero expert taken out of the routing)
    check_ids_in_range("topk_ids", topk_ids, -1, global_num_experts)


def check_expert_map(
    expert_map: torch.Tensor | None,
    global_num_experts: int | None,
    num_local_experts: int,
    device: torch.device,
) -> int:
    """-> the global expert count."""
    if expert_map is None:
        if global_num_experts not in (None, num_local_experts):
            raise ValueError(
                f"global_num_experts={global_num_experts} differs from the {num_local_experts} "
                "experts in w13: pass the expert_map that places them"
            )
        return num_local_experts
    check_tensor("expert_map", expert_map, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if global_num_experts is not None and expert_map.shape[0] != global_num_experts:
        raise ValueError(
            f"expert_map must be [global_num_experts={global_num_experts}], "
            f"got {tuple(expert_map.shape)}"
        )
    check_ids_in_range("expert_map", expert_map, -1, num_local_experts)
    return expert_map.shape[0]


_KERNELS: OrderedDict[tuple, tuple] = OrderedDict()
_MAX_KERNELS = 64


def _kernel_for(
    device, dtype, weights, num_global, top_k, spec, quant_config, has_map, grad, backend
) -> tuple[FusedMoEModularKernel, tuple[FusedMoEModularKernel, GraphCache] | None]:
    """The modular kernel of a call signature, built once: the oracle's choice and the experts
    object (on the process's shared workspaces); and, for a backend whose calls a CUDA graph may
    replay, a second kernel (on the retained workspaces) with the graphs of calls of up to
    DEFAULT_MAX_TOKENS tokens. The quant config is keyed by its content, its tensors by
    identity (they may change in place; the entry holds the config, so their ids stay theirs);
    least recently used first out."""
    # torch.compile traces this once into its graph: no cache there for dynamo to guard on
    compiling = torch.compiler.is_compiling()
    if not compiling:
        key = (
            device, dtype, weights.hidden_size, weights.intermediate_size, num_global, top_k,
            spec, weights.has_bias, has_map, grad,
            None if quant_config is None else quant_config.cache_key(), backend,
            default_chunk_size(),
        )  # fmt: skip
        entry = _KERNELS.get(key)
        if entry is not None:
            with contextlib.suppress(KeyError):  # another thread may have evicted it since
                _KERNELS.move_to_end(key)
            return entry[0], entry[2]
    problem = MoEProblem(
        device=device,
        dtype=dtype,
        hidden_size=weights.hidden_size,
        intermediate_size=weights.intermediate_size,
        num_experts=num_global,
        top_k=top_k,
        activation=spec,
        quant_config=quant_config,
        has_bias=weights.has_bias,
        has_expert_map=has_map,
        requires_grad=grad,
    )
    choice = select_backend(problem, backend=backend)
    experts = choice.create()
    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), experts)
    if compiling:
        return kernel, None
    graphs = None
    rows_independent = quant_config is None or quant_config.rows_independent
    if (
        device.type == "cuda"
        and not grad
        and choice.experts_cls.cuda_graph_safe
        and rows_independent
    ):
        graph_kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), experts, retain_workspaces=True)
        graphs = (graph_kernel, GraphCache())
    _KERNELS[key] = (kernel, quant_config, graphs)  # holding the config keeps its id from reuse
    if len(_KERNELS) > _MAX_KERNELS:
        _KERNELS.popitem(last=False)
    return kernel, graphs


@dataclass(frozen=True)
class _ResolvedCall:
    """What fused_experts resolves from a call's signature (shapes, dtypes, devices, the
    weights' addresses and layouts, the options): done once, with every check, then looked up
    by that signature (_CALLS). Holds no weight tensor (a dropped model must be freed): a call
    builds its ExpertWeights from the tensors it is given."""

    spec: ActivationSpec
    packing: int  # ExpertWeights.k_packing (2: packed FP4 weights)
    num_global: int  # global expert count
    kernel: FusedMoEModularKernel
    graphs: tuple[FusedMoEModularKernel, GraphCache] | None  # (kernel, graphs) or None
    graph_key: tuple  # what a captured call reads by address, for GraphCache.run
    quant_config: FusedMoEQuantConfig | None  # held: the signature names it by id


#: call signature -> its _ResolvedCall, least recently used first out
_CALLS: OrderedDict[tuple, _ResolvedCall] = OrderedDict()
_MAX_CALLS = 256


def _layout(t: torch.Tensor | None) -> tuple | None:
    """A weight's part of a call signature: what the checks read, and its address."""
    if t is None:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _quant_tensors(quant_config: FusedMoEQuantConfig | None) -> tuple:
    """The scale tensors of a quant config (None where an operand has none)."""
    if quant_config is None:
        return ()
    operands = (quant_config.a1, quant_config.a2, quant_config.w1, quant_config.w2)
    return tuple(t for o in operands for t in (o.scale, o.global_scale, o.zero_point))


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: MoEActivation | str = "silu",
    activation_params: ActivationParams | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    apply_router_weight_on_input: bool = False,
    quant_config: FusedMoEQuantConfig | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The experts given the routing: hidden_states [M, H] -> [M, H].

        out[m] = sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(hidden_states[m])
        expert_e(x) = act(x @ w13[e].T + w13_bias[e]) @ w2[e].T + w2_bias[e]

    topk_ids are global expert ids (-1 marks an empty slot); with an expert_map, experts that
    are not on this rank contribute zero.

    A call whose signature (every shape but the token count, dtype and device, the weights' and
    scales' addresses and strides, the options) was checked before skips the checks and the
    backend choice: they read nothing else, so they would pass again. The value checks (ids in
    range, debug mode on a GPU) run on every call.
    """
    x = hidden_states
    signature = resolved = None
    # autograd recording and torch.compile tracing (its graph holds the resolution) take the
    # full path every time
    if not (torch.is_grad_enabled() or torch.compiler.is_compiling()):
        try:
            # no token count: one entry per layer whatever the batch (M is checked below)
            signature = (
                x.shape[1:], x.dtype, x.device,
                topk_weights.shape[1:], topk_weights.dtype, topk_weights.device,
                topk_ids.shape[1:], topk_ids.dtype, topk_ids.device,
                _layout(w13), _layout(w2), _layout(w13_bias), _layout(w2_bias),
                _layout(expert_map), activation, activation_params,
                None if quant_config is None else id(quant_config),
                *(_layout(t) for t in _quant_tensors(quant_config)), global_num_experts,
                apply_router_weight_on_input, backend, os.environ.get(CHUNK_SIZE_ENV),
            )  # fmt: skip
            if x.shape[0] == topk_weights.shape[0] == topk_ids.shape[0]:
                resolved = _CALLS.get(signature)
        # not tensors, an unhashable option, a tensor without storage: the full path's checks
        except (AttributeError, TypeError, RuntimeError, IndexError):
            signature = None
    if resolved is None:
        check_quant_config(quant_config)
        params = merge_activation_params(activation_params, quant_config)
        spec = ActivationSpec.make(activation, params)
        x = check_tensor("hidden_states", x, ndim=2, dtypes=FLOAT_DTYPES)
        weights = check_expert_weights(x, w13, w2, spec.kind, w13_bias, w2_bias, quant_config)
        num_global = check_expert_map(
            expert_map, global_num_experts, weights.num_local_experts, x.device
        )
        check_routing(x, topk_weights, topk_ids, num_global)
        if apply_router_weight_on_input and topk_ids.shape[1] != 1:
            raise ValueError(
                f"apply_router_weight_on_input needs top_k == 1, got top_k = {topk_ids.shape[1]}"
            )
        grad = needs_grad(x, weights, topk_weights)
        if grad:
            experts = (weights.w13, weights.w2, weights.w13_bias, weights.w2_bias)
            check_inference_only(quant_config, experts, x)
        kernel, graphs = _kernel_for(
            x.device, x.dtype, weights, num_global, topk_ids.shape[1], spec, quant_config,
            expert_map is not None, grad, backend,
        )  # fmt: skip
        graph_key = ()
        if graphs is not None:  # (never while tracing: a fake tensor has no address)
            # the captured launches read the weights, the map and the scales by address
            tensors = (w13, w2, w13_bias, w2_bias, expert_map, *_quant_tensors(quant_config))
            graph_key = (
                topk_weights.dtype, topk_ids.dtype, apply_router_weight_on_input,
                *(0 if t is None else t.data_ptr() for t in tensors),
            )  # fmt: skip
        resolved = _ResolvedCall(
            spec, weights.k_packing, num_global, kernel, graphs, graph_key, quant_config
        )
        if signature is not None and not grad:
            _CALLS[signature] = resolved
            if len(_CALLS) > _MAX_CALLS:
                _CALLS.popitem(last=False)
    else:
        with contextlib.suppress(KeyError):  # another thread may have evicted it since
            _CALLS.move_to_end(signature)
        weights = ExpertWeights(w13, w2, w13_bias, w2_bias, k_packing=resolved.packing)
        # what the signature does not hold: the values, where value checks run
        check_ids_in_range("topk_ids", topk_ids, -1, resolved.num_global)
        if expert_map is not None:
            check_ids_in_range("expert_map", expert_map, -1, weights.num_local_experts)
    spec, num_global = resolved.spec, resolved.num_global

    def experts(kernel, x, topk_weights, topk_ids):
        # float32 weights: under a graph the cast is one of its launches, not a host call
        out = kernel.forward(
            x, weights, topk_weights.float(), topk_ids,
            activation=spec, global_num_experts=num_global, expert_map=expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input, quant_config=quant_config,
        )  # fmt: skip
        return (out,)

    if resolved.graphs is not None and may_replay(x, DEFAULT_MAX_TOKENS):
        graph_kernel, cache = resolved.graphs
        replayed = cache.run(
            lambda *args: experts(graph_kernel, *args),
            (x, topk_weights, topk_ids),
            resolved.graph_key,
        )
        if replayed is not None:
            return replayed[0]
    return experts(resolved.kernel, x, topk_weights, topk_ids)[0]


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    custom_routing_function=None,
    zero_expert_num: int = 0,
    zero_expert_type: str | None = None,
    hash_indices_table: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    **experts_kwargs,
) -> torch.Tensor:
    """Routing plus experts: router_logits [M, E (+ zero experts)] -> output [M, H].

    The router keywords are those of `create_router`; `experts_kwargs` those of `fused_experts`.
    """
    num_experts = experts_kwargs.get("global_num_experts") or w13.shape[0]
    router = create_router(
        top_k,
        num_experts,
        renormalize=renormalize,
        scoring_func=scoring_func,
        use_grouped_topk=use_grouped_topk,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
        custom_routing_function=custom_routing_function,
        zero_expert_num=zero_expert_num,
        zero_expert_type=zero_expert_type,
        hash_indices_table=hash_indices_table,
    )
    topk_weights, topk_ids = router.select_experts(hidden_states, router_logits, input_ids)
    zero_output = None
    if zero_expert_num > 0:
        split = split_zero_experts(
            hidden_states,
            topk_weights,
            topk_ids,
            num_experts,
            ZeroExpertType.parse(zero_expert_type),
        )
        topk_weights, topk_ids, zero_output = split.topk_weights, split.topk_ids, split.zero_output
    out = fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, **experts_kwargs)
    return out if zero_output is None else out + zero_output
