"""Zero experts (LongCat-Flash): Z extra expert ids that cost no GEMM.

Router logits have E + Z columns and are routed like any others (scoring, optional correction
bias over all E + Z, top-k). Ids >= E are zero experts:
    "identity"  adds weight * x to the token's output
    "zero"      adds nothing
They never reach an expert backend: `split_zero_experts` takes them out of the routing
(id -1, weight 0: an empty slot, which every backend skips) and computes their output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from fusedmoe._checks import parse_enum
from fusedmoe.router.base import Router
from fusedmoe.router.checks import check_bias
from fusedmoe.router.topk import dispatch_topk_route


class ZeroExpertType(enum.Enum):
    IDENTITY = "identity"
    ZERO = "zero"

    @classmethod
    def parse(cls, value: ZeroExpertType | str) -> ZeroExpertType:
        return parse_enum(cls, value, "zero_expert_type")


class ZeroExpertRouter(Router):
    def __init__(
        self,
        top_k: int,
        num_experts: int,
        *,
        zero_expert_num: int,
        zero_expert_type: ZeroExpertType | str,
        e_score_correction_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        super().__init__(top_k, num_experts, num_logits=num_experts + zero_expert_num, **kwargs)
        self.zero_expert_num = zero_expert_num
        self.zero_expert_type = ZeroExpertType.parse(zero_expert_type)
        self.e_score_correction_bias = (
            None if e_score_correction_bias is None
            else check_bias(e_score_correction_bias, self.num_logits)
        )  # fmt: skip

    def _select(self, x, logits, input_ids):
        bias = self.e_score_correction_bias
        return dispatch_topk_route(
            logits,
            self.top_k,
            scoring=self.scoring,
            renormalize=self.renormalize,
            e_score_correction_bias=None if bias is None else bias.to(logits.device),
            routed_scaling_factor=self.routed_scaling_factor,
        )


@dataclass
class ZeroExpertSplit:
    zero_output: torch.Tensor | None  # [M, H] in x's dtype; None for "zero" experts
    topk_weights: torch.Tensor  # float32 [M, k]; 0 where the slot was a zero expert
    topk_ids: torch.Tensor  # int32 [M, k]; -1 where the slot was a zero expert


def split_zero_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    zero_expert_type: ZeroExpertType,
) -> ZeroExpertSplit:
    """Take zero-expert slots (ids >= num_experts) out of the routing and compute their output."""
    is_zero = topk_ids >= num_experts  # [M, k]
    zero_output = None
    if zero_expert_type is ZeroExpertType.IDENTITY:
        identity_weight = (topk_weights * is_zero).sum(dim=-1, keepdim=True)  # [M, 1]
        acc = torch.promote_types(x.dtype, torch.float32)
        zero_output = (x.to(acc) * identity_weight.to(acc)).to(x.dtype)
    return ZeroExpertSplit(
        zero_output=zero_output,
        topk_weights=topk_weights.masked_fill(is_zero, 0.0),
        topk_ids=topk_ids.masked_fill(is_zero, -1),
    )
