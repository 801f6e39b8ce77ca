"""Routing by a user function: fn(hidden_states, gating_output, topk, renormalize) -> (w, ids).

The function's result is checked (shapes, ids in range, distinct per token) and cast to the
routing convention: float32 weights, int32 ids. routed_scaling_factor is applied after it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusedmoe._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_ids_in_range,
    check_shape,
    check_tensor,
    value_checks_enabled,
)
from fusedmoe.router.base import Router

CustomRoutingFunction = Callable[
    [torch.Tensor, torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]
]


class CustomRoutingRouter(Router):
    cuda_graph_safe = False

    def __init__(
        self, top_k: int, num_experts: int, *, custom_routing_function: CustomRoutingFunction, **kw
    ) -> None:
        super().__init__(top_k, num_experts, **kw)
        if not callable(custom_routing_function):
            raise TypeError("custom_routing_function must be callable")
        self.fn = custom_routing_function

    def _select(self, x, logits, input_ids):
        result = self.fn(x, logits, self.top_k, self.renormalize)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError("custom_routing_function must return a (weights, ids) tuple")
        weights, ids = result
        expected = (logits.shape[0], self.top_k)
        check_tensor("custom routing weights", weights, dtypes=FLOAT_DTYPES, device=logits.device)
        check_tensor("custom routing ids", ids, dtypes=INDEX_DTYPES, device=logits.device)
        check_shape("custom routing weights", weights, expected)
        check_shape("custom routing ids", ids, expected)
        check_ids_in_range("custom routing ids", ids, 0, self.num_logits)
        repeated = ids.numel() > 0 and value_checks_enabled(ids)
        if repeated and ids.sort(dim=1).values.diff(dim=1).eq(0).any():
            raise ValueError("custom routing ids name the same expert twice for a token")
        weights = weights.float()
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, ids
