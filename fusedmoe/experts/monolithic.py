"""MonolithicExperts ("monolithic"): takes router logits, routes inside, and runs each expert's
two GEMMs in the activation dtype. The Gaudi engine's unquantized monolithic MoE method, in
device-agnostic torch (CPU, CUDA, any device torch runs matmuls on).

Legend: M tokens, E global experts, E_l experts on this rank, k top-k, H hidden, N = 2I or I.

    topk_weights, topk_ids = route(router_logits)                 # see `route`
    (DP: all-gather x, topk_weights, topk_ids over the group)     # fusedmoe.parallel.dp_dispatch
    for each local expert e (global id expert_start + e), its routed slots r = (m, j):
        h[r] = x[m] @ w13[e].T + w13_bias[e]        # [c, N]  GEMM1, stored in x.dtype
        a[r] = act(h[r])                            # float32, stored in x.dtype
        y[r] = a[r] @ w2[e].T + w2_bias[e]          # [c, H]  GEMM2, in x.dtype
        out[m] += topk_weights[m, j] * y[r]         # float32 accumulator
    (DP: sum over the group, keep this rank's rows)
    output = out.to(x.dtype)

It rounds where the reference backend (fusedmoe.experts.torch_ref, the spec) stores, but its
GEMMs run in x.dtype (float32 accumulation inside the matmul) instead of float64: fast, and
within the dtype's tolerance of the reference.

EP shift: this rank holds the experts expert_start .. expert_start + E_l - 1 (experts_min ..
experts_max, a contiguous block as fusedmoe.parallel.config.linear_expert_map places them); a slot
routed to any other id (another rank's expert, a zero expert >= E) contributes zero here, so
the sum of every rank's output is the unsharded result.

Weights: per-expert lists of views into the layer's stacked parameters (no copies), built on
first use and rebuilt when a parameter tensor is replaced (.to(), .cuda(), assignment); writes
in place (load_weights, load_state_dict) show through the views as they are.

Inference only: no autograd (the oracle gives recorded forwards to the reference backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedmoe._triton import has_triton
from fusedmoe.activation import apply_activation
from fusedmoe.modular.experts import Experts
from fusedmoe.modular.types import (
    ActivationSpec,
    ExpertsCall,
    ExpertWeights,
    InsideRouting,
    MonolithicResult,
)
from fusedmoe.router.base import use_fused_routing


def gpt_oss_route(
    logits: torch.Tensor, top_k: int, routed_scaling_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: logits [M, E] -> (weights float32 [M, k], ids int64 [M, k]).

        values, ids = topk(logits, k)
        weights     = softmax(values) * routed_scaling_factor      (float32, over the k only)

    Equal to softmax over E, top-k, renormalize: softmax is monotonic, so it picks the same
    experts, and exp(l_i) / sum_{j in top-k} exp(l_j) is the renormalized softmax weight.
    """
    values, ids = torch.topk(logits.float(), top_k, dim=-1)
    weights = torch.softmax(values, dim=-1)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def route(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    routing: InsideRouting,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing a monolithic backend does inside: (weights float32 [M, k], ids int32 [M, k]).

    gpt_oss          top-k over the raw logits, softmax over those k (gpt_oss_route)
    any router       router.select_experts: grouped top-k, custom function, correction bias,
                     hash table, zero experts; a plain TopKRouter is softmax over E, top-k,
                     renormalize (fusedmoe.router.topk.topk_route)
    """
    router = routing.router
    if not routing.gpt_oss:
        return router.select_experts(hidden_states, router_logits, input_ids)
    if router_logits.dim() != 2 or router_logits.shape[1] != router.num_logits:
        raise ValueError(
            f"router_logits must be [M, {router.num_logits}] (one column per expert), "
            f"got shape {tuple(router_logits.shape)}"
        )
    if use_fused_routing(router_logits):  # softmax, top-k, renormalize: the same routing
        from fusedmoe.router.fused import fused_topk

        return fused_topk(
            router_logits, router.top_k, renormalize=True,
            routed_scaling_factor=router.routed_scaling_factor,
        )  # fmt: skip
    weights, ids = gpt_oss_route(router_logits, router.top_k, router.routed_scaling_factor)
    return weights, ids.to(torch.int32)


@dataclass(frozen=True)
class PerExpertWeights:
    """This rank's experts as one view per expert into the stacked parameters (no copies)."""

    w13: tuple[torch.Tensor, ...]  # E_l x [N, H]
    w2: tuple[torch.Tensor, ...]  # E_l x [H, I]
    w13_bias: tuple[torch.Tensor | None, ...]  # E_l x [N], or None without biases
    w2_bias: tuple[torch.Tensor | None, ...]  # E_l x [H], or None

    @classmethod
    def views_of(cls, weights: ExpertWeights) -> PerExpertWeights:
        num_local = weights.num_local_experts

        def split(t: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
            return (None,) * num_local if t is None else tuple(t.detach().unbind(0))

        return cls(
            split(weights.w13), split(weights.w2), split(weights.w13_bias), split(weights.w2_bias)
        )

    @property
    def num_local_experts(self) -> int:
        return len(self.w13)


def _storage_key(weights: ExpertWeights) -> tuple:
    """Changes when a parameter tensor is replaced; in-place writes keep it."""
    return tuple(
        None if t is None else (t.data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride())
        for t in (weights.w13, weights.w2, weights.w13_bias, weights.w2_bias)
    )


def experts_forward(
    x: torch.Tensor,
    experts: PerExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_start: int,
    activation: ActivationSpec,
) -> torch.Tensor:
    """x [M, H], routing [M, k] (global ids) -> float32 [M, H]: the weighted sum over the slots
    routed to this rank's experts (global ids expert_start .. expert_start + E_l - 1)."""
    num_tokens, top_k = topk_ids.shape
    num_local = experts.num_local_experts
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_local == 0:
        return out

    local = topk_ids.reshape(-1).long() - expert_start  # [M*k], the EP shift
    on_rank = (local >= 0) & (local < num_local)  # -1, zero experts, other ranks: off
    local = torch.where(on_rank, local, num_local)  # off-rank slots sort last, then dropped
    order = torch.argsort(local, stable=True)  # slots grouped by expert
    counts = torch.bincount(local, minlength=num_local + 1).tolist()  # the one host sync
    num_routed = len(order) - counts[num_local]
    if num_routed == 0:
        return out
    slots = order[:num_routed]  # [R] routed slots, expert by expert
    tokens = slots // top_k
    x_sorted = x[tokens]  # [R, H], one gather; each expert's rows are a contiguous slice
    groups = [(e, c) for e, c in enumerate(counts[:num_local]) if c]

    # GEMM1 per expert into one buffer, the activation once over all rows, then GEMM2.
    h = x.new_empty(num_routed, experts.w13[0].shape[0])  # [R, N]
    _grouped_linear(h, x_sorted, experts.w13, experts.w13_bias, groups)
    a = apply_activation(activation.kind, h, activation.params).to(x.dtype)  # [R, N']
    y = x.new_empty(num_routed, x.shape[1])  # [R, H]
    _grouped_linear(y, a, experts.w2, experts.w2_bias, groups)

    weights = topk_weights.reshape(-1)[slots].float().unsqueeze(1)  # [R, 1]
    out.index_add_(0, tokens, y.float() * weights)
    return out


def _grouped_linear(
    out: torch.Tensor,
    inputs: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor | None, ...],
    groups: list[tuple[int, int]],
) -> None:
    """out[rows of e] = inputs[rows of e] @ weights[e].T (+ biases[e]) for each (e, rows) of
    `groups`, whose rows follow one another from row 0."""
    start = 0
    for expert, count in groups:
        rows = slice(start, start + count)
        w, b = weights[expert], biases[expert]
        if b is None:
            torch.mm(inputs[rows], w.t(), out=out[rows])
        else:
            torch.addmm(b, inputs[rows], w.t(), out=out[rows])
        start += count


class MonolithicExperts(Experts):
    name = "monolithic"
    cuda_graph_safe = True
    routes_inside = True

    @classmethod
    def supports_device(cls, device):
        return True

    @classmethod
    def supports_dtype(cls, dtype):
        return dtype in (torch.float32, torch.float16, torch.bfloat16)

    @classmethod
    def supports_quant_config(cls, quant_config):
        return quant_config is None

    @classmethod
    def supports_activation(cls, activation):
        return True

    @classmethod
    def supports_bias(cls):
        return True

    @classmethod
    def supports_ep(cls, ep_size):
        return True  # by the contiguous shift (expert_start), not by an arbitrary expert_map

    def __init__(self) -> None:
        self._weights_key: tuple | None = None
        self._experts: PerExpertWeights | None = None
        self._shift_map: tuple | None = None  # (key, expert_map) of the fused CUDA path
        self._num_ids = 0  # routable ids of the last call (experts + zero experts)

    def per_expert_weights(self, weights: ExpertWeights) -> PerExpertWeights:
        """The per-expert views of `weights`, rebuilt only when a tensor was replaced."""
        key = _storage_key(weights)
        if key != self._weights_key:
            self._experts = PerExpertWeights.views_of(weights)
            self._weights_key = key
        return self._experts

    def apply_monolithic(
        self,
        hidden_states,
        router_logits,
        weights,
        *,
        routing,
        activation,
        expert_start,
        dispatch=None,
        input_ids=None,
    ):
        x = hidden_states
        for name, w in (("w13", weights.w13), ("w2", weights.w2)):
            if w.dtype != x.dtype:
                raise TypeError(
                    f"monolithic: {name} is {w.dtype} but hidden_states is {x.dtype} (it runs "
                    "unquantized experts in the activation dtype)"
                )
        topk_weights, topk_ids = route(x, router_logits, routing, input_ids)
        self._num_ids = router_logits.shape[1]
        if dispatch is None and x.is_cuda and has_triton():
            # one fused op, no host sync: the loop below needs each expert's row count on the
            # host, a device sync per call (the CPU path, where that costs nothing)
            out = self._experts_triton(x, weights, topk_weights, topk_ids, expert_start, activation)
            return MonolithicResult(out, topk_weights, topk_ids)
        experts = self.per_expert_weights(weights)
        if dispatch is None:
            out = experts_forward(
                x, experts, topk_weights, topk_ids, expert_start=expert_start, activation=activation
            )
        else:
            gathered = dispatch.dispatch(x, topk_weights, topk_ids)
            partial = experts_forward(
                gathered.x,
                experts,
                gathered.topk_weights,
                gathered.topk_ids,
                expert_start=expert_start,
                activation=activation,
            )
            out = dispatch.combine(partial, gathered)
        return MonolithicResult(out.to(x.dtype), topk_weights, topk_ids)

    def _experts_triton(self, x, weights, topk_weights, topk_ids, expert_start, activation):
        """The experts of this rank through the triton backend's fused op: the EP shift becomes
        an expert_map over every routable id (zero experts included), built once per
        (ids, shift, device)."""
        from fusedmoe.experts.triton import TritonExperts

        num_local = weights.num_local_experts
        key = (topk_ids.device, expert_start, num_local, self._num_ids)
        if self._shift_map is None or self._shift_map[0] != key:
            ids = torch.arange(self._num_ids, dtype=torch.int32, device=x.device) - expert_start
            on_rank = (ids >= 0) & (ids < num_local)
            self._shift_map = (key, torch.where(on_rank, ids, -1))
        expert_map = self._shift_map[1]
        if expert_start == 0 and self._num_ids == num_local:
            expert_map = None  # every expert is here: the ids are the local ids
        triton_experts = TritonExperts()
        num_tokens, top_k = topk_ids.shape
        shapes = triton_experts.workspace_shapes(
            num_tokens, weights.gemm1_out_size, weights.hidden_size, top_k, self._num_ids,
            num_local, activation.kind,
        )  # fmt: skip
        out = torch.empty_like(x)
        triton_experts.apply(
            ExpertsCall(
                output=out,
                hidden_states=x,
                weights=weights,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                activation=activation,
                global_num_experts=self._num_ids,
                workspace13=x.new_empty(shapes.workspace13),
                workspace2=x.new_empty(shapes.workspace2),
                expert_map=expert_map,
            )
        )
        return out

    # ---- the modular contract: never used, a monolithic backend runs from router logits ----
    def _not_modular(self):
        raise TypeError(
            "monolithic routes inside: it runs from router logits (apply_monolithic), never in "
            "the modular kernel on topk ids (the oracle refuses it there)"
        )

    def workspace_shapes(self, M, N, K, top_k, global_num_experts, local_num_experts, activation):
        self._not_modular()

    def finalize_weight_and_reduce_impl(self):
        self._not_modular()

    def apply(self, call):
        self._not_modular()


__all__ = ["MonolithicExperts", "PerExpertWeights", "experts_forward", "gpt_oss_route", "route"]
