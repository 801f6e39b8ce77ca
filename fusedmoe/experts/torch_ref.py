"""TorchExperts ("torch"): the reference backend, on any device, in plain torch.

It is the spec every fast backend is checked against, so it rounds exactly where a fused
pipeline stores to memory, and computes in float64 in between (so that its result does not
depend on how a BLAS blocks the rows: chunking over M changes nothing):

    for each local expert e, rows r = (m, j) routed to it:
        h[r] = round(x[m] @ w13[e].T + w13_bias[e])       # GEMM1 output stored in x.dtype
        a[r] = round(act(h[r]))                           # activation output stored in x.dtype
        y[m, j] = round(a[r] @ w2[e].T + w2_bias[e])      # per-slot output [M, k, H]
    finalize: out[m] = sum_j w[m, j] * y[m, j]            # float32 (float64) sum, then x.dtype

Slots with id -1, or whose expert is not on this rank (expert_map[id] == -1), give y = 0.
It groups rows by expert on the host (one sync per call): correct and simple, not fast. Its
ops are out of place, so autograd differentiates through it (training, fine-tuning); it needs
no scratch workspace, only the per-slot output buffer.
"""

from __future__ import annotations

import torch

from fusedmoe.activation import apply_activation
from fusedmoe.modular.experts import Experts
from fusedmoe.modular.reduce import TopKWeightAndReduceContiguous
from fusedmoe.modular.types import WorkspaceShapes


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global ids [M, k] -> local ids [M, k]; -1 for empty slots and experts of other ranks."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    mapped = expert_map.long()[ids.clamp(min=0)]
    return torch.where(ids >= 0, mapped, torch.full_like(mapped, -1))


class TorchExperts(Experts):
    name = "torch"

    @classmethod
    def supports_device(cls, device):
        return True

    @classmethod
    def supports_dtype(cls, dtype):
        return dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)

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
    def supports_expert_map(cls):
        return True

    @classmethod
    def supports_ep(cls, ep_size):
        return True

    @classmethod
    def supports_autograd(cls):
        return True

    def workspace_shapes(self, M, N, K, top_k, global_num_experts, local_num_experts, activation):
        return WorkspaceShapes(workspace13=(0,), workspace2=(0,), output=(M, top_k, K))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceContiguous()

    def apply(
        self,
        output,
        hidden_states,
        weights,
        topk_weights,
        topk_ids,
        *,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        num_tokens, top_k = topk_ids.shape
        store = hidden_states.dtype  # where a fused pipeline writes h and act(h) to memory
        y_slots = output.view(num_tokens * top_k, weights.hidden_size)
        y_slots.zero_()
        compute = torch.float64

        local_ids = local_expert_ids(topk_ids, expert_map).flatten()  # [M*k]
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids + 1, minlength=weights.num_local_experts + 1).tolist()
        start = counts[0]  # rows with id -1 sort first and are skipped
        for expert, count in enumerate(counts[1:]):
            if count == 0:
                continue
            rows = order[start : start + count]
            start += count
            x = hidden_states[rows // top_k].to(compute)  # [c, H]
            h = self._linear(x, weights.w13[expert], weights.w13_bias, expert).to(store)  # [c, N]
            a = apply_activation(activation.kind, h, activation.params).to(store)  # [c, N/2 or N]
            y = self._linear(a.to(compute), weights.w2[expert], weights.w2_bias, expert)  # [c, H]
            y_slots[rows] = y.to(output.dtype)

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, expert: int):
        y = x @ w.to(x.dtype).t()
        if bias is not None:
            y = y + bias[expert].to(x.dtype)
        return y


__all__ = ["TorchExperts", "local_expert_ids"]
