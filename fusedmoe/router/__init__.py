"""Routers: router logits -> (topk_weights float32 [M, k], topk_ids int32 [M, k])."""

from fusedmoe.router.base import (
    Router,
    ScoringFunc,
    compute_scores,
    fused_routing_on_interpreter,
    use_fused_routing,
)
from fusedmoe.router.custom import CustomRoutingRouter
from fusedmoe.router.factory import create_router
from fusedmoe.router.grouped import GroupedTopKRouter, grouped_topk, grouped_topk_ref
from fusedmoe.router.simulation import RoutingSimulatorRouter
from fusedmoe.router.topk import (
    BiasedTopKRouter,
    TopKRouter,
    hash_route,
    hash_route_ref,
    topk_route,
    topk_route_ref,
)
from fusedmoe.router.zero_experts import (
    ZeroExpertRouter,
    ZeroExpertSplit,
    ZeroExpertType,
    split_zero_experts,
)

__all__ = [
    "BiasedTopKRouter",
    "CustomRoutingRouter",
    "GroupedTopKRouter",
    "Router",
    "RoutingSimulatorRouter",
    "ScoringFunc",
    "TopKRouter",
    "ZeroExpertRouter",
    "ZeroExpertSplit",
    "ZeroExpertType",
    "compute_scores",
    "create_router",
    "fused_routing_on_interpreter",
    "grouped_topk",
    "grouped_topk_ref",
    "hash_route",
    "hash_route_ref",
    "split_zero_experts",
    "topk_route",
    "topk_route_ref",
    "use_fused_routing",
]
