"""The HPC-style fused FP8 MoE op: the fewest launches, no gathered copy of x, no [M * k, H]
intermediate, the weighted top-k reduce inside GEMM2.

    routing = moe_align_block_size(topk_ids, BM)      # none for M = 1 (direct rows)
    a2      = quant(silu(q(x)[rows // k] @ w13[e].T) * up)     GEMM1: x arrives in bf16; at decode
                                                       (16-row blocks) it is quantized tile by
                                                       tile in the kernel (the static a1 scale,
                                                       or 1 x 128 groups), above by one launch
                                                       first; it also zeroes acc
    acc[t] += topk_weight[s] * (a2[s] @ w2[e].T)       GEMM2: float32 atomics, t = s // k
    output  = acc (+ shared_output)                    one cast

Schemes: FP8 per-tensor with static activation scales (w13 / w2 scale per expert, a1 / a2
scales [1]: GEMM1's output scale is a1_scale * w13_scale[e], the "g1 alpha", and a2 is
quantized with 1 / a2_scale), and FP8 128 x 128 blocks with dynamic 1 x 128 activation groups
(float32 or UE8M0 scales). SiLU only. Under expert parallelism the slots whose expert is not
local (expert_map: global -> local, -1 elsewhere) are skipped; local_expert_map gives the map
of a rank's linear block when the caller has none.

Legend: M tokens, k top-k, S = M * k slots, E_l local experts, H hidden, I intermediate.
The float32 atomics make the sum order (and so the last bit of acc) vary from run to run;
each slot's output is rounded to the activation dtype first, as the reference stores it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fusedmoe._triton import device_guard, op_or_impl
from fusedmoe.activation import MoEActivation
from fusedmoe.kernels import moe_gemm as g
from fusedmoe.kernels.fused_moe import (
    TL_DTYPE,
    GemmVariant,
    device_name,
    gemm_rows,
    launch_gemm,
)
from fusedmoe.kernels.moe_config import moe_kernel_config
from fusedmoe.parallel.config import linear_expert_map
from fusedmoe.quant.activation import per_token_group_quant_fp8, quantize_fp8_per_tensor
from fusedmoe.quant.formats import FP8_DTYPE

__all__ = ["fused_moe_hpc", "local_expert_map"]

_SILU_PARAMS = (1.0, 0.0, 0.0, False)  # alpha, beta, limit, has_limit: plain SiLU * up
_SHARED_MEMORY_BUDGET = 192 * 1024  # of the 227 KB an H100 / H200 block may use, for the stages
# Rows per block up to which GEMM1 quantizes x itself (decode). On an H200 (deepseek-v3 fp8_block
# at M = 256, 64-row blocks) quantizing inside cost 4.4 ms against triton's 2.8 ms.
_QUANTIZE_INSIDE_MAX_ROWS = 16


@functools.lru_cache(maxsize=32)
def local_expert_map(
    num_experts: int, ep_size: int, ep_rank: int, device: torch.device
) -> torch.Tensor | None:
    """The expert_map of rank ep_rank's linear block of experts (fusedmoe.parallel.config's
    placement; None without EP). Cached, so a CUDA graph captured after a first call keeps
    reading it."""
    if ep_size == 1:
        return None
    return linear_expert_map(num_experts, ep_size, ep_rank).to(device)


def _fused_moe_hpc_impl(
    output: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a1_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    accumulator: torch.Tensor,
    shared_output: torch.Tensor | None,
    block_quant: bool,
    use_ue8m0: bool,
) -> None:
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return
    num_slots = num_tokens * top_k
    num_local, gemm1_rows, hidden = w13.shape
    inter = gemm1_rows // 2
    scheme = "fp8_block" if block_quant else "fp8_tensor"
    config = moe_kernel_config(
        num_tokens, top_k, num_local, gemm1_rows, hidden, inter, scheme, device_name(x)
    )
    gemm1 = config.gemm1
    if block_quant:  # one 1 x 128 group of x per K tile; whole groups of a2 per output tile
        gemm1 = dataclasses.replace(gemm1, block_k=g.QUANT_GROUP)
        if gemm1.block_n % g.QUANT_GROUP:
            gemm1 = dataclasses.replace(gemm1, block_n=g.QUANT_GROUP)
    # Decode (16-row blocks): x is quantized tile by tile inside GEMM1, no launch for it. Above,
    # each token's row would be quantized k * (N / BN) times over: one quantization launch.
    quantize_inside = config.block_m <= _QUANTIZE_INSIDE_MAX_ROWS
    a, a_scale = x, a1_scale
    if not quantize_inside:
        if block_quant:
            a, a_scale = per_token_group_quant_fp8(x, g.QUANT_GROUP, False, use_ue8m0)
        else:
            a, _ = quantize_fp8_per_tensor(x, a1_scale)
    # x read in the activation dtype (2 bytes, not FP8's 1): fewer stages fit in shared memory
    block_bytes = gemm1.block_k * (config.block_m * a.element_size() + 2 * gemm1.block_n)
    stages = max(2, min(gemm1.num_stages, _SHARED_MEMORY_BUDGET // block_bytes))
    gemm1 = dataclasses.replace(gemm1, num_stages=stages)
    if block_quant:
        a_quant = g.AQ_GROUP_UE8M0 if use_ue8m0 else g.AQ_GROUP
        a_mode, w_mode, a2_mode = g.A_GROUP, g.W_BLOCK, g.A_GROUP
        out_mode = g.OUT_FP8_GROUP_UE8M0 if use_ue8m0 else g.OUT_FP8_GROUP
    else:
        a_quant = g.AQ_STATIC
        a_mode, w_mode, a2_mode, out_mode = g.A_TENSOR, g.W_TENSOR, g.A_TENSOR, g.OUT_FP8_STATIC
    if not quantize_inside:
        a_quant = g.AQ_NONE
    acc = accumulator.view(-1)[: num_tokens * hidden].view(num_tokens, hidden)
    with device_guard(x):
        rows = gemm_rows(topk_ids, expert_map, config.block_m, num_local)
        a2 = torch.empty((num_slots, inter), dtype=FP8_DTYPE, device=x.device)
        if block_quant:
            groups = -(-inter // g.QUANT_GROUP)
            a2_scale = torch.empty((num_slots, groups), dtype=torch.float32, device=x.device)
        h_dtype = TL_DTYPE[output.dtype]
        launch_gemm(
            a, a_scale, a_mode, top_k, w13, w13_scale, w_mode, None, a2, a2_scale,
            topk_weights, rows, num_slots, gemm1,
            activation=MoEActivation.SILU, params=_SILU_PARAMS, out_mode=out_mode,
            mul_routed_weight=False, h_dtype=h_dtype,
            variant=GemmVariant(a_quant=a_quant, zero=acc),
        )  # fmt: skip
        launch_gemm(
            a2, a2_scale, a2_mode, 1, w2, w2_scale, w_mode, None, acc, None,
            topk_weights.reshape(-1), rows, num_slots, config.gemm2,
            activation=None, params=_SILU_PARAMS, out_mode=g.OUT_ATOMIC,
            mul_routed_weight=True, h_dtype=h_dtype,
            variant=GemmVariant(out_row_div=top_k),
        )  # fmt: skip
        if shared_output is None:
            output.copy_(acc)
        else:
            torch.add(acc, shared_output, out=output)


_fused_moe_hpc_op = torch.library.custom_op(
    "fusedmoe::fused_moe_hpc", mutates_args=("output", "accumulator")
)(_fused_moe_hpc_impl)


@_fused_moe_hpc_op.register_fake
def _(output, x, w13, w2, w13_scale, w2_scale, a1_scale, a2_scale, topk_weights, topk_ids,
      expert_map, accumulator, shared_output, block_quant, use_ue8m0):  # fmt: skip
    return None


def fused_moe_hpc(
    output: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    accumulator: torch.Tensor,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    shared_output: torch.Tensor | None = None,
    block_quant: bool = True,
    use_ue8m0: bool = False,
) -> None:
    """output [M, H] = sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(x[m]) (+ shared_output).

    x [M, H] in the activation dtype (quantized inside); w13 [E_l, 2I, H] and w2 [E_l, H, I]
    FP8 with scales [E_l] (per tensor; then a1_scale and a2_scale [1] are the static activation
    scales) or [E_l, 2I/128, H/128] and [E_l, H/128, I/128] (block_quant); accumulator float32
    with at least M * H elements; expert_map [E] global -> local (-1: skipped). Inputs are
    assumed checked by the caller (HPCExperts).
    """
    op_or_impl(_fused_moe_hpc_op, _fused_moe_hpc_impl)(
        output, x, w13, w2, w13_scale, w2_scale, a1_scale, a2_scale, topk_weights.float(),
        topk_ids, expert_map, accumulator, shared_output, block_quant, use_ue8m0,
    )  # fmt: skip
