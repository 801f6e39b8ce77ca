"""TopKWeightAndReduce: who does the weighted sum over the k experts of a token.

    out[m] = sum_j w[m, j] * y[m, j]          y: [M, k, H] per-slot expert outputs

A backend names the reduce it needs from finalize:
    NoOp        it reduced already (its output is [M, H]); finalize copies
    Contiguous  its output is [M, k, H]; finalize does the weighted sum above
    Delegate    the prepare/finalize picks its own default
"""

from __future__ import annotations

import abc

import torch


class TopKWeightAndReduce(abc.ABC):
    @abc.abstractmethod
    def apply(
        self,
        output: torch.Tensor | None,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        """Reduce into `output` [M, H] (allocated when None) and return it."""

    def __repr__(self) -> str:
        return type(self).__name__


class TopKWeightAndReduceNoOp(TopKWeightAndReduce):
    def apply(
        self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input
    ):
        if fused_expert_output.dim() != 2:
            raise AssertionError("NoOp reduce expects an already reduced [M, H] expert output")
        if output is None:
            return fused_expert_output
        if output is not fused_expert_output:  # identity, not data_ptr: torch.compile traces it
            output.copy_(fused_expert_output)
        return output


class TopKWeightAndReduceContiguous(TopKWeightAndReduce):
    def apply(
        self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input
    ):
        num_tokens, top_k = topk_ids.shape
        # H named: a rank where no token landed has no elements to infer it from
        y = fused_expert_output.view(num_tokens, top_k, fused_expert_output.shape[-1])
        acc = torch.promote_types(y.dtype, torch.float32)  # float32, float64 for float64
        if apply_router_weight_on_input:  # the weight was applied to x in prepare
            reduced = y.to(acc).sum(dim=1)
        else:
            reduced = torch.einsum("mk,mkh->mh", topk_weights.to(acc), y.to(acc))
        if output is None:
            return reduced.to(fused_expert_output.dtype)
        output.copy_(reduced)
        return output


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """A placeholder: the prepare/finalize replaces it with its default reduce."""

    def apply(self, *args, **kwargs):
        raise AssertionError("TopKWeightAndReduceDelegate must be resolved by the prepare/finalize")
