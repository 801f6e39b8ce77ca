"""The routers' argument checks, shared by the routers and the fused routing kernels' entry
points (fusedmoe.router.fused): one home below both, so that the kernels' module imports no
router kind (only router.base, for the scoring functions) and the routers import in no cycle.

Each raises ValueError / TypeError naming the argument, before anything is routed.
"""

from __future__ import annotations

import torch

from fusedmoe._checks import FLOAT_DTYPES, check_positive_int, check_shape, check_tensor


def check_bias(bias: object, num_experts: int) -> torch.Tensor:
    """e_score_correction_bias: a float tensor [E] (E: the columns of the router logits)."""
    t = check_tensor("e_score_correction_bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
    check_shape("e_score_correction_bias", t, (num_experts,))
    return t


def check_groups(
    num_experts: int, top_k: int, num_expert_group: object, topk_group: object
) -> None:
    """Grouped top-k: G = num_expert_group groups of E / G experts, topk_group <= G of them
    kept, holding at least top_k experts."""
    check_positive_int("num_expert_group", num_expert_group)
    check_positive_int("topk_group", topk_group)
    if num_experts % num_expert_group != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by "
            f"num_expert_group ({num_expert_group})"
        )
    if topk_group > num_expert_group:
        raise ValueError(
            f"topk_group ({topk_group}) must be <= num_expert_group ({num_expert_group})"
        )
    kept = topk_group * (num_experts // num_expert_group)
    if top_k > kept:
        raise ValueError(
            f"top_k ({top_k}) must be <= the experts in the kept groups "
            f"(topk_group * num_experts / num_expert_group = {kept})"
        )


def check_scaling_factor(routed_scaling_factor: object) -> float:
    """routed_scaling_factor: a positive number -> that number as a float."""
    if not isinstance(routed_scaling_factor, (int, float)) or routed_scaling_factor <= 0:
        raise ValueError(
            f"routed_scaling_factor must be a positive number, got {routed_scaling_factor!r}"
        )
    return float(routed_scaling_factor)
