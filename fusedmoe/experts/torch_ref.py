"""TorchExperts ("torch"): the reference backend, on any device, in plain torch.

It is the spec every fast backend is checked against, so it rounds exactly where a fused
pipeline stores to memory, and computes in float64 in between (so that its result does not
depend on how a BLAS blocks the rows: chunking over M changes nothing). Quantized operands
are dequantized (q * scale) and the intermediate is requantized where a quantized pipeline
does it:

    for each local expert e, rows r = (m, j) routed to it:
        h[r] = round(x[m] @ w13[e].T + w13_bias[e])       # GEMM1 output stored in x.dtype
        a[r] = act(h[r])                                  # float32
        a    = fake_quant(a, a2)  or  round(a)            # a2 quantized, or stored in x.dtype
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
from fusedmoe.quant.activation import quantize_activation
from fusedmoe.quant.reference import dequantize


def local_expert_ids(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local_experts: int | None = None
) -> torch.Tensor:
    """Global ids [M, k] -> local ids [M, k]; -1 for empty slots and experts of other ranks.

    An id outside [0, E) (E: the expert_map's length, or num_local_experts without a map) or a
    map entry outside [0, num_local_experts) is -1 as well, as in the kernels: ranges are
    checked on the host only in debug mode (fusedmoe._checks), never read out of bounds."""
    ids = topk_ids.long()
    if expert_map is None:
        if num_local_experts is None:
            return ids.clamp(min=-1)
        return torch.where((ids >= 0) & (ids < num_local_experts), ids, -1)
    in_range = (ids >= 0) & (ids < expert_map.shape[0])
    mapped = expert_map.long()[torch.where(in_range, ids, 0)]
    in_range &= mapped >= 0
    if num_local_experts is not None:
        in_range &= mapped < num_local_experts
    return torch.where(in_range, mapped, -1)


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
        return True  # every scheme, by dequantize -> float64 compute -> requantize

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
    def supports_autograd(cls, quant_config=None):
        return True

    def workspace_shapes(self, M, N, K, top_k, global_num_experts, local_num_experts, activation):
        return WorkspaceShapes(workspace13=(0,), workspace2=(0,), output=(M, top_k, K))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceContiguous()

    def apply(self, call):
        qc, weights, activation, output = (
            call.quant_config,
            call.weights,
            call.activation,
            call.output,
        )
        num_tokens, top_k = call.topk_ids.shape
        if output.is_cuda and torch.cuda.is_current_stream_capturing():
            scheme = "unquantized" if qc is None else qc.scheme
            raise RuntimeError(
                f"the torch reference backend cannot be captured in a CUDA graph (it groups rows "
                f"by expert on the host); this {scheme} call runs on it because no GPU backend "
                "supports it (see backend_choice().explain()). Run it eagerly, or use a scheme "
                "that a GPU backend runs (docs/quantization.md)."
            )
        store = output.dtype  # where a fused pipeline writes h and act(h) to memory
        y_slots = output.view(num_tokens * top_k, weights.hidden_size)
        y_slots.zero_()
        x_all = call.hidden_states
        if call.a1q_scale is not None:  # quantized by prepare: what GEMM1 sees is q * scale
            x_all = dequantize(x_all, call.a1q_scale, qc.a1.key, call.a1q_global_scale)

        local_ids = local_expert_ids(  # [M*k]
            call.topk_ids, call.expert_map, weights.num_local_experts
        ).flatten()
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids + 1, minlength=weights.num_local_experts + 1).tolist()
        skipped = counts[0]  # rows with id -1 sort first
        groups = []  # (expert, rows) with rows in `order`
        start = skipped
        for expert, count in enumerate(counts[1:]):
            if count:
                groups.append((expert, order[start : start + count]))
                start += count
        if not groups:
            return

        # GEMM1 + activation for every routed row, then the a2 quantization over all of them
        # (a dynamic per-tensor a2 scale spans every expert), then GEMM2.
        acts = []
        for expert, rows in groups:
            x = x_all[rows // top_k].to(_COMPUTE)  # [c, H]
            w13 = _expert_weight(weights.w13, qc and qc.w1, expert)
            h = _linear(x, w13, weights.w13_bias, expert).to(store)  # [c, N]
            acts.append(apply_activation(activation.kind, h, activation.params))  # fp32 [c, N']
        a_all = torch.cat(acts)  # [rows routed, N'] in `groups` order
        if qc is not None and qc.a2.quantized:  # quantized from float32, as a fused epilogue does
            qa = quantize_activation(a_all.float(), qc.a2)
            a_all = dequantize(qa.q, qa.scale, qc.a2.key, qa.global_scale)
        else:
            a_all = a_all.to(store)

        offset = 0
        for expert, rows in groups:
            a = a_all[offset : offset + rows.numel()].to(_COMPUTE)
            offset += rows.numel()
            w2 = _expert_weight(weights.w2, qc and qc.w2, expert)
            y_slots[rows] = _linear(a, w2, weights.w2_bias, expert).to(output.dtype)  # [c, H]


_COMPUTE = torch.float64


def _expert_weight(w: torch.Tensor, operand, expert: int) -> torch.Tensor:
    """Expert `expert` of w as float64, dequantized when `operand` quantizes it."""
    if operand is None or not operand.quantized:
        return w[expert].to(_COMPUTE)
    one = slice(expert, expert + 1)
    g = None if operand.global_scale is None else operand.global_scale[one]
    z = None if operand.zero_point is None else operand.zero_point[one]
    return dequantize(w[one], operand.scale[one], operand.key, g, z)[0].to(_COMPUTE)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, expert: int):
    y = x @ w.t()
    if bias is not None:
        y = y + bias[expert].to(x.dtype)
    return y


__all__ = ["TorchExperts", "local_expert_ids"]
