"""create_router: one factory, six router kinds, in a fixed priority order.

    routing simulation > zero experts > grouped top-k > custom function
        > top-k with bias (bias or hash table) > plain top-k

The first kind whose parameters are given wins. Routing simulation replaces the routing on
purpose (benchmarks). Any other parameter that the winning kind does not use is reported with
a warning rather than dropped silently.

RouterBuilder keeps create_router's arguments but the tensors that a layer owns (the
correction bias and hash table), to build the router again when the layer's tensors are
replaced.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fusedmoe.router.base import Router, ScoringFunc
from fusedmoe.router.custom import CustomRoutingFunction, CustomRoutingRouter
from fusedmoe.router.grouped import GroupedTopKRouter
from fusedmoe.router.simulation import RoutingSimulatorRouter, simulation_from_env
from fusedmoe.router.topk import BiasedTopKRouter, TopKRouter
from fusedmoe.router.zero_experts import ZeroExpertRouter, ZeroExpertType


def create_router(
    top_k: int,
    num_experts: int,
    *,
    renormalize: bool = True,
    scoring_func: ScoringFunc | str = "softmax",
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    custom_routing_function: CustomRoutingFunction | None = None,
    zero_expert_num: int = 0,
    zero_expert_type: ZeroExpertType | str | None = None,
    hash_indices_table: torch.Tensor | None = None,
    routing_simulation: str | None = None,
) -> Router:
    """Build the router for these parameters. num_experts counts real experts only."""
    common = dict(
        renormalize=renormalize,
        scoring_func=scoring_func,
        routed_scaling_factor=routed_scaling_factor,
    )
    if isinstance(zero_expert_num, bool) or not isinstance(zero_expert_num, int):
        raise TypeError(f"zero_expert_num must be an int, got {type(zero_expert_num).__name__}")
    if zero_expert_num < 0:
        raise ValueError(f"zero_expert_num must be >= 0, got {zero_expert_num}")
    if zero_expert_num > 0 and zero_expert_type is None:
        raise ValueError("zero_expert_num > 0 needs zero_expert_type ('identity' or 'zero')")
    if zero_expert_num == 0 and zero_expert_type is not None:
        raise ValueError(f"zero_expert_type={zero_expert_type!r} given but zero_expert_num is 0")
    if use_grouped_topk and (num_expert_group is None or topk_group is None):
        raise ValueError("use_grouped_topk needs num_expert_group and topk_group")

    given = {
        "use_grouped_topk": bool(use_grouped_topk),
        "custom_routing_function": custom_routing_function is not None,
        "e_score_correction_bias": e_score_correction_bias is not None,
        "hash_indices_table": hash_indices_table is not None,
    }

    def unused(*used: str) -> None:
        dropped = [name for name, is_given in given.items() if is_given and name not in used]
        if dropped:
            warnings.warn(
                f"create_router: {', '.join(dropped)} not used: a router of higher priority "
                f"was chosen (see fusedmoe.router.factory)",
                stacklevel=3,
            )

    strategy = routing_simulation or simulation_from_env()
    if strategy is not None:
        unused()
        num_logits = num_experts + zero_expert_num
        return RoutingSimulatorRouter(top_k, num_logits, strategy=strategy, **common)
    if zero_expert_num > 0:
        unused("e_score_correction_bias")
        return ZeroExpertRouter(
            top_k,
            num_experts,
            zero_expert_num=zero_expert_num,
            zero_expert_type=zero_expert_type,
            e_score_correction_bias=e_score_correction_bias,
            **common,
        )
    if use_grouped_topk:
        unused("use_grouped_topk", "e_score_correction_bias")
        return GroupedTopKRouter(
            top_k,
            num_experts,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            e_score_correction_bias=e_score_correction_bias,
            **common,
        )
    if custom_routing_function is not None:
        unused("custom_routing_function")
        return CustomRoutingRouter(
            top_k, num_experts, custom_routing_function=custom_routing_function, **common
        )
    if e_score_correction_bias is not None or hash_indices_table is not None:
        return BiasedTopKRouter(
            top_k,
            num_experts,
            e_score_correction_bias=e_score_correction_bias,
            hash_indices_table=hash_indices_table,
            **common,
        )
    return TopKRouter(top_k, num_experts, **common)


class RouterBuilder:
    """create_router(top_k, num_experts, **settings) on the tensors an owner holds.

    A FusedMoE layer keeps e_score_correction_bias and hash_indices_table as buffers, and its
    router holds references to them: where a buffer is replaced rather than changed in place
    (.to(), load_state_dict(..., assign=True) into a layer built on the meta device, a buffer
    assigned anew), that router would route with the old tensor. `synced` gives the router to
    route with: the one given, or one built on the owner's current tensors.
    """

    def __init__(self, top_k: int, num_experts: int, **settings: Any) -> None:
        self.top_k, self.num_experts, self.settings = top_k, num_experts, settings

    def build(
        self,
        e_score_correction_bias: torch.Tensor | None,
        hash_indices_table: torch.Tensor | None,
    ) -> Router:
        return create_router(
            self.top_k,
            self.num_experts,
            e_score_correction_bias=e_score_correction_bias,
            hash_indices_table=hash_indices_table,
            **self.settings,
        )

    def synced(
        self,
        router: Router,
        e_score_correction_bias: torch.Tensor | None,
        hash_indices_table: torch.Tensor | None,
    ) -> Router:
        """`router` where the tensors it holds are the owner's (those given), else a new one
        built on them.

        The owner's buffers are read (as the arguments) before the router's attributes, for
        torch.compile: a tensor Dynamo first meets as a plain attribute becomes a non-static
        graph input, which CUDA graph trees copy at every replay; met first as a buffer it is a
        static one, and Dynamo reuses that input wherever it meets the tensor again."""
        owned = (
            ("e_score_correction_bias", e_score_correction_bias),
            ("hash_indices_table", hash_indices_table),
        )
        for name, mine in owned:
            held = getattr(router, name, None)
            if held is not None and held is not mine:
                return self.build(e_score_correction_bias, hash_indices_table)
        return router
