"""The Triton fused-experts op: align, GEMM1 + activation (+ a2 quantization), GEMM2 x router
weight, top-k sum. Registered as a custom op (fake: it only writes `output`), so a layer that
calls it traces under torch.compile; it never synchronises with the host, so it captures in a
CUDA graph.

    routing = moe_align_block_size(topk_ids, BM)             # 1 launch (S <= 4096) or 3;
                                                              # none for M = 1 (direct rows)
    a2      = act(x[rows // k] @ w13[e].T + b13)             # GEMM1, quantized in its epilogue
    a2      = quantize(a2)          only for per-token / dynamic per-tensor a2 (after GEMM1)
    y       = (a2[rows] @ w2[e].T + b2) * topk_weights       # GEMM2, rows in slot order
    output  = sum over the k slots of each token              # moe_sum

Legend: M tokens, k top-k, S = M * k slots, E_l local experts, H hidden, I intermediate,
N_w = w13 rows per expert (2I gated), N_act = I (the activation output width).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton.language as tl

from fusedmoe._pdl import pdl_args
from fusedmoe._triton import cdiv, device_guard, launch, next_power_of_2, op_or_impl
from fusedmoe.activation import MoEActivation
from fusedmoe.kernels import moe_gemm as g
from fusedmoe.kernels.moe_align import AlignedRouting, moe_align_block_size
from fusedmoe.kernels.moe_config import moe_kernel_config
from fusedmoe.quant import keys
from fusedmoe.quant.activation import quantize_activation
from fusedmoe.quant.config import OperandQuant
from fusedmoe.quant.formats import FP8_DTYPE
from fusedmoe.quant.kernels import (
    ACTIVATION_CODE,
    act_mul_group_quant_fp8_impl,
    act_mul_group_quant_fp8_op,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from fusedmoe.modular.types import OutputColumns

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    _TensorDescriptor = None

__all__ = ["A2_MODES", "A_MODES", "W_MODES", "fused_experts_triton"]

A_MODES = {"none": g.A_NONE, "tensor": g.A_TENSOR, "row": g.A_ROW, "group": g.A_GROUP}
W_MODES = {"none": g.W_NONE, "tensor": g.W_TENSOR, "channel": g.W_CHANNEL, "block": g.W_BLOCK}
#: how a2 (the input of GEMM2) is made: in GEMM1's epilogue, or from fp32 after it
A2_MODES = {
    "none": (g.OUT_PLAIN, None),
    "fp8_static": (g.OUT_FP8_STATIC, None),
    "fp8_group": (g.OUT_FP8_GROUP, None),
    "fp8_group_ue8m0": (g.OUT_FP8_GROUP_UE8M0, None),
    "fp8_dynamic_tensor": (g.OUT_FP32, keys.FP8_DYNAMIC_TENSOR),
    "fp8_dynamic_token": (g.OUT_FP32, keys.FP8_DYNAMIC_TOKEN),
    "int8_dynamic_token": (g.OUT_FP32, keys.INT8_DYNAMIC_TOKEN),
}
_A2_SCALE = {  # the scale layout GEMM2 reads a2 with
    "none": g.A_NONE,
    "fp8_static": g.A_TENSOR,
    "fp8_group": g.A_GROUP,
    "fp8_group_ue8m0": g.A_GROUP,
    "fp8_dynamic_tensor": g.A_TENSOR,
    "fp8_dynamic_token": g.A_ROW,
    "int8_dynamic_token": g.A_ROW,
}
ACT_CODES = {
    **ACTIVATION_CODE,
    MoEActivation.GELU_TANH: g.ACT_GELU_TANH,
    MoEActivation.SILU_NO_MUL: g.ACT_SILU_NO_MUL,
    MoEActivation.GELU_NO_MUL: g.ACT_GELU_NO_MUL,
    MoEActivation.RELU2_NO_MUL: g.ACT_RELU2_NO_MUL,
}
TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_SUM_BLOCK_H = 1024


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(t: torch.Tensor | torch.device) -> str | None:
    """The name of the GPU a tensor (or device) is on, for the tuned tables; None on the
    interpreter."""
    device = t if isinstance(t, torch.device) else t.device
    return _device_name(device.index or 0) if device.type == "cuda" else None


def _bytes_view(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
    """A [shape] dtype tensor over buf's bytes from `offset` (a scratch carved into parts)."""
    raw = buf.view(-1).view(torch.uint8)
    size = 1
    for s in shape:
        size *= s
    nbytes = size * torch.empty((), dtype=dtype).element_size()
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def _a2_buffers(workspace2, num_slots, width, a2_mode, dtype):
    """(a2 written by GEMM1, its group scales or None) inside workspace2 when they fit."""
    out_mode, _ = A2_MODES[a2_mode]
    if out_mode == g.OUT_PLAIN:
        return workspace2.view(-1)[: num_slots * width].view(num_slots, width), None
    if out_mode == g.OUT_FP32:  # zeros: the rows of slots not routed here stay out of any amax
        return torch.zeros((num_slots, width), dtype=torch.float32, device=workspace2.device), None
    q_bytes = (num_slots * width + 15) // 16 * 16
    groups = cdiv(width, g.QUANT_GROUP)
    if q_bytes + num_slots * groups * 4 > workspace2.numel() * workspace2.element_size():
        q = torch.empty((num_slots, width), dtype=FP8_DTYPE, device=workspace2.device)
        scales = torch.empty((num_slots, groups), dtype=torch.float32, device=q.device)
        return q, scales
    q = _bytes_view(workspace2, 0, (num_slots, width), FP8_DTYPE)
    scales = _bytes_view(workspace2, q_bytes, (num_slots, groups), torch.float32)
    return q, scales


def _scale_args(scale: torch.Tensor | None, dummy: torch.Tensor, ndim: int):
    if scale is None:
        return (dummy,) + (0,) * ndim
    if scale.dim() == 1 and ndim > 1:  # [1] or [E_l]
        return (scale, scale.stride(0)) + (0,) * (ndim - 1)
    return (scale, *scale.stride()[:ndim]) + (0,) * (ndim - scale.dim())


@dataclass
class GemmRows:
    """Where each GEMM program finds its rows: the aligned layout, or (direct) one slot per
    block with its expert read from the ids (M = 1: the k slots hit k distinct experts, so
    nothing is gained by sorting, and the alignment launch is saved)."""

    block_m: int
    num_blocks: int  # the grid's row blocks (some may turn out empty)
    routing: AlignedRouting | None  # None: direct
    ids: torch.Tensor  # int [S] topk_ids, read when direct
    expert_map: torch.Tensor | None
    num_local: int  # E_l

    def kernel_args(self) -> tuple:
        """(sorted ids, expert ids, num post padded, ids, map, num_ids, num_local)."""
        r = self.routing
        num_ids = self.num_local if self.expert_map is None else self.expert_map.shape[0]
        if r is None:
            emap = self.ids if self.expert_map is None else self.expert_map
            return (self.ids, self.ids, self.ids, self.ids, emap, num_ids, self.num_local)
        return (
            r.sorted_token_ids, r.expert_ids, r.num_tokens_post_padded, self.ids, self.ids,
            num_ids, self.num_local,
        )  # fmt: skip


def _tma_rows(t: torch.Tensor) -> torch.Tensor | None:
    """The [rows, K] matrix a TMA descriptor of t walks, or None where there is none: t
    contiguous (t.view(-1, K)), or a weight's block of rows w[:, lo:hi] [E_l, n, K], whose row
    n of expert e lies at row e * (stride(0) // K) + n from its first element, as the GEMM
    addresses it (an output column block, OutputColumns)."""
    if t.is_contiguous():
        return t.view(-1, t.shape[-1])
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) % t.shape[2]:
        return None
    rows = (t.shape[0] - 1) * (t.stride(0) // t.shape[2]) + t.shape[1]
    return t.as_strided((rows, t.shape[2]), (t.shape[2], 1))


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA loads of t: a Hopper-or-newer GPU, t with a row matrix (_tma_rows) of 16-byte
    aligned rows."""
    if not (t.is_cuda and _TensorDescriptor is not None and _tma_rows(t) is not None):
        return False
    if torch.cuda.get_device_capability(t.device)[0] < 9:
        return False
    return (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _tma_descriptor(t: torch.Tensor, block_rows: int, block_k: int):
    return _TensorDescriptor.from_tensor(_tma_rows(t), [block_rows, block_k])


def _w_columns(scale: torch.Tensor | None, w_mode: str, lo: int, hi: int) -> torch.Tensor | None:
    """The scales of a weight's rows [lo, hi) (GEMM2: output columns), a view: per tensor
    all of them, per channel [E_l, hi - lo], per 128 x 128 block those of rows lo // 128 on
    (lo a multiple of 128)."""
    if scale is None or w_mode in ("none", "tensor"):
        return scale
    if w_mode == "channel":
        return scale[:, lo:hi]
    assert w_mode == "block" and lo % g.QUANT_GROUP == 0, (w_mode, lo)
    return scale[:, lo // g.QUANT_GROUP : cdiv(hi, g.QUANT_GROUP)]


@dataclass(frozen=True)
class GemmVariant:
    """What the DeepGEMM-style and HPC-style paths change in the expert GEMM (the defaults are
    the triton backend's gather-GEMM)."""

    a_quant: int = g.AQ_NONE  # quantize A's tiles in the kernel (HPC: A in the activation dtype)
    align: int = 0  # > 0: A is the contiguous expert-aligned layout, runs aligned to this
    out_row_div: int = 1  # OUT_ATOMIC: slot -> output row
    zero: torch.Tensor | None = None  # a float32 buffer the launch zeroes (GEMM2's accumulator)
    w_fp4: bool = False  # W_MX weights pack two E2M1 codes per byte
    # aligned (gather) layout, training: A's rows / the output's rows are in expert order (S
    # rows, no padding: row_map[p] is the row of the layout's position p), not the slots'
    a_in_order: bool = False
    out_in_order: bool = False
    row_map: torch.Tensor | None = None


_GATHER = GemmVariant()


def launch_gemm(
    a, a_scale, a_mode, a_row_div, w, w_scale, w_mode, bias, out, out_scale, topk_weights,
    rows: GemmRows, num_slots, config, *, activation, params, out_mode, mul_routed_weight, h_dtype,
    variant: GemmVariant = _GATHER,
):  # fmt: skip
    n_out = out.shape[1]
    k = a.shape[1]
    act_code = g.ACT_NONE if activation is None else ACT_CODES[activation]
    alpha, beta, limit, has_limit = params
    grid = (rows.num_blocks * cdiv(n_out, config.block_n),)
    dummy = rows.ids
    exact = a.dtype == torch.float32 or not a.is_cuda  # no tf32 (the interpreter dots in fp32)
    interleaved = activation is MoEActivation.SWIGLUOAI
    # TMA weight loads: 8-15% faster at prefill on an H200, 1-7% slower at decode (16-row
    # blocks), where the pointer loads stay
    use_tma = rows.block_m >= 64 and not interleaved and w_mode != g.W_MX and _tma_ok(w)
    w_desc = _tma_descriptor(w, config.block_n, config.block_k) if use_tma else w
    contiguous = variant.align > 0
    positional_a = contiguous or variant.a_in_order
    use_tma_a = positional_a and rows.block_m >= 64 and variant.a_quant == g.AQ_NONE and _tma_ok(a)
    a_desc = _tma_descriptor(a, rows.block_m, config.block_k) if use_tma_a else a
    zero = variant.zero
    args = (
        a, a.stride(0), a.stride(1),
        a_desc,
        *_scale_args(a_scale, dummy, 2),
        w, w.stride(0), w.stride(1), w.stride(2),
        w_desc,
        *_scale_args(w_scale, dummy, 3),
        *((bias, bias.stride(0), bias.stride(1)) if bias is not None else (dummy, 0, 0)),
        out, out.stride(0), out.stride(1),
        *_scale_args(out_scale, dummy, 2),
        topk_weights,
        *rows.kernel_args(),
        dummy if zero is None else zero, 0 if zero is None else zero.numel(),
        dummy if variant.row_map is None else variant.row_map,
        n_out, k, num_slots, rows.num_blocks,
        alpha, beta, limit,
    )  # fmt: skip
    constexprs = dict(
        A_ROW_DIV=a_row_div,
        A_SCALE=a_mode,
        A_QUANT=variant.a_quant,
        W_SCALE=w_mode,
        W_FP4=variant.w_fp4,
        HAS_BIAS=bias is not None,
        ACTIVATION=act_code,
        GATED=activation is not None and activation.is_gated,
        HAS_LIMIT=has_limit,
        OUT_MODE=out_mode,
        OUT_ROW_DIV=variant.out_row_div,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        H_DTYPE=h_dtype,
        DOT_PRECISION="ieee" if exact else "tf32",
        ROUND_IN_FP32=not a.is_cuda,
        UPCAST=not a.is_cuda,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=rows.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        DIRECT=rows.routing is None,
        CONTIGUOUS=contiguous,
        A_IN_ORDER=variant.a_in_order,
        OUT_IN_ORDER=variant.out_in_order,
        ALIGN=max(variant.align, 1),
        HAS_MAP=rows.expert_map is not None,
        USE_TMA=use_tma,
        USE_TMA_A=use_tma_a,
        W_BLOCK_UNIFORM=(
            w_mode == g.W_BLOCK
            and g.QUANT_GROUP % config.block_n == 0
            and not interleaved
            and (activation is None or not activation.is_gated or n_out % g.QUANT_GROUP == 0)
        ),
        ZERO_OUT=zero is not None,
        MX_DTYPE=tl.float32 if not a.is_cuda else tl.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_args(a),
    )  # fmt: skip
    launch(g._moe_gemm_kernel, grid, args, constexprs, a.is_cuda)


def _unfused_ok(a2_mode: str, act: MoEActivation) -> bool:
    """Whether GEMM1 may leave the activation to the separate act + group quant kernel."""
    return a2_mode in ("fp8_group", "fp8_group_ue8m0") and act in ACTIVATION_CODE


def gemm_rows(topk_ids, expert_map, block_m, num_local) -> GemmRows:
    ids = topk_ids.reshape(-1)
    if topk_ids.shape[0] == 1:
        return GemmRows(block_m, ids.numel(), None, ids, expert_map, num_local)
    routing = moe_align_block_size(topk_ids, block_m, num_local, expert_map)
    return GemmRows(block_m, routing.expert_ids.shape[0], routing, ids, expert_map, num_local)


def _fused_experts_triton_impl(
    output: torch.Tensor,
    x: torch.Tensor,
    a1_scale: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    a2_static_scale: torch.Tensor | None,
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    activation: str,
    alpha: float,
    beta: float,
    limit: float,
    has_limit: bool,
    a_mode: str,
    w_mode: str,
    a2_mode: str,
    mul_routed_weight: bool,
    dtype_key: str,
    gate: torch.Tensor | None = None,
) -> None:
    _fused_experts(
        output, x, a1_scale, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, topk_weights,
        topk_ids, expert_map, a2_static_scale, workspace13, workspace2, activation, alpha, beta,
        limit, has_limit, a_mode, w_mode, a2_mode, mul_routed_weight, dtype_key, gate,
    )  # fmt: skip


def _fused_experts(
    output,
    x,
    a1_scale,
    w13,
    w2,
    w13_scale,
    w2_scale,
    w13_bias,
    w2_bias,
    topk_weights,
    topk_ids,
    expert_map,
    a2_static_scale,
    workspace13,
    workspace2,
    activation,
    alpha,
    beta,
    limit,
    has_limit,
    a_mode,
    w_mode,
    a2_mode,
    mul_routed_weight,
    dtype_key,
    gate=None,
    columns: OutputColumns | None = None,
    input_ready: Callable[[], None] | None = None,
) -> None:
    """_fused_experts_triton_impl (the custom op's signature), and columns: GEMM2 and the sum
    by those output column blocks, each reported when issued; input_ready: called after the
    slots' alignment, before GEMM1 reads x and a1_scale (eager only: a callback is no op
    argument)."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    num_local, gemm1_rows, hidden = w13.shape
    act = MoEActivation(activation)
    width = act.output_size(gemm1_rows)
    if num_tokens == 0:
        if input_ready is not None:
            input_ready()
        return
    config = moe_kernel_config(
        num_tokens, top_k, num_local, gemm1_rows, hidden, width, dtype_key, device_name(x)
    )
    with device_guard(x):
        rows = gemm_rows(topk_ids, expert_map, config.block_m, num_local)
        if gate is not None:
            if rows.routing is None:
                raise ValueError("a gated call needs the aligned rows: more than one token")
            # no rows in use: every GEMM program returns at once; the sum writes nothing
            rows.routing.num_tokens_post_padded.mul_(gate)
        if input_ready is not None:  # x may have been arriving while the slots were aligned
            input_ready()
        out_mode, post_key = A2_MODES[a2_mode]
        a2, a2_scale = _a2_buffers(workspace2, num_slots, width, a2_mode, output.dtype)
        if out_mode == g.OUT_FP8_STATIC:
            a2_scale = a2_static_scale
        params = (alpha, beta, limit, has_limit)
        h_dtype = TL_DTYPE[output.dtype]
        if config.fuse_activation or not _unfused_ok(a2_mode, act):
            gemm1 = config.gemm1
            if out_mode in (g.OUT_FP8_GROUP, g.OUT_FP8_GROUP_UE8M0) and gemm1.block_n % 128:
                # the group quantization in the epilogue needs whole 128-wide groups per tile
                gemm1 = dataclasses.replace(gemm1, block_n=g.QUANT_GROUP)
            launch_gemm(
                x, a1_scale, A_MODES[a_mode], top_k, w13, w13_scale, W_MODES[w_mode], w13_bias,
                a2, a2_scale, topk_weights, rows, num_slots, gemm1,
                activation=act, params=params, out_mode=out_mode, mul_routed_weight=False,
                h_dtype=h_dtype,
            )  # fmt: skip
        else:  # GEMM1 stores h; the fused act + group quant kernel makes a2 from it
            h = torch.empty((num_slots, gemm1_rows), dtype=output.dtype, device=x.device)
            # gated: every slot, or none where the gate reads 0
            slots_in_use = None if gate is None else gate.to(torch.int32) * num_slots
            launch_gemm(
                x, a1_scale, A_MODES[a_mode], top_k, w13, w13_scale, W_MODES[w_mode], w13_bias,
                h, None, topk_weights, rows, num_slots, config.gemm1,
                activation=None, params=params, out_mode=g.OUT_PLAIN, mul_routed_weight=False,
                h_dtype=h_dtype,
            )  # fmt: skip
            a2, a2_scale = op_or_impl(act_mul_group_quant_fp8_op, act_mul_group_quant_fp8_impl)(
                h, act.value, alpha, beta, limit, has_limit, g.QUANT_GROUP, False,
                a2_mode == "fp8_group_ue8m0", slots_in_use,
            )  # fmt: skip
        if post_key is not None:  # a scale over the whole row or tensor: after GEMM1
            qa = quantize_activation(a2, OperandQuant(post_key))
            a2, a2_scale = qa.q, qa.scale
        y = workspace13.view(-1)[: num_slots * hidden].view(num_slots, hidden)
        bounds = (0, hidden) if columns is None else columns.bounds
        for block, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            launch_gemm(
                a2, a2_scale, _A2_SCALE[a2_mode], 1, w2[:, lo:hi],
                _w_columns(w2_scale, w_mode, lo, hi), W_MODES[w_mode],
                None if w2_bias is None else w2_bias[:, lo:hi],
                y[:, lo:hi], None, topk_weights.reshape(-1), rows, num_slots, config.gemm2,
                activation=None, params=params, out_mode=g.OUT_PLAIN,
                mul_routed_weight=mul_routed_weight, h_dtype=h_dtype,
            )  # fmt: skip
            moe_sum(y[:, lo:hi], output[:, lo:hi], topk_ids, expert_map, num_local, gate=gate)
            if columns is not None:
                columns.done(block)


_fused_experts_triton_op = torch.library.custom_op(
    "fusedmoe::fused_experts_triton", mutates_args=("output", "workspace13", "workspace2")
)(_fused_experts_triton_impl)


@_fused_experts_triton_op.register_fake
def _(output, x, a1_scale, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, topk_weights,
      topk_ids, expert_map, a2_static_scale, workspace13, workspace2, activation, alpha, beta,
      limit, has_limit, a_mode, w_mode, a2_mode, mul_routed_weight, dtype_key,
      gate=None):  # fmt: skip
    return None


def moe_sum(
    y: torch.Tensor,
    output: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_local_experts: int,
    *,
    inv_perm: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> None:
    """output [M, H] = sum over j of y's row of slot m * k + j, for the slots routed to this
    rank: row m * k + j of y [M * k, H], or row inv_perm[m * k + j] of a permuted y; plus
    bias[e] [E_l, H] of the slot's local expert e when given; times topk_weights[m, j] when
    given (in fp32, rounded once). A slot whose id lies outside the expert range (or maps
    outside [0, E_l)) is not routed here, as in the GEMMs. gate (uint8 [1] on the device):
    where it reads 0, output is left as it was (read on the GPU: no host sync)."""
    num_tokens, top_k = topk_ids.shape
    hidden = y.shape[1]
    if num_tokens == 0:
        return
    num_ids = num_local_experts if expert_map is None else expert_map.shape[0]
    block_h = min(_SUM_BLOCK_H, next_power_of_2(hidden))
    grid = (num_tokens, cdiv(hidden, block_h))
    w = topk_ids if topk_weights is None else topk_weights
    args = (
        y, y.stride(0), y.stride(1),
        output, output.stride(0), output.stride(1),
        topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_ids if expert_map is None else expert_map,
        topk_ids if inv_perm is None else inv_perm,
        w, w.stride(0), w.stride(1),
        *((y, 0, 0) if bias is None else (bias, *bias.stride())),
        topk_ids if gate is None else gate,
        hidden, num_ids, num_local_experts,
    )  # fmt: skip
    constexprs = dict(
        TOP_K=top_k,
        HAS_MAP=expert_map is not None,
        HAS_INV=inv_perm is not None,
        MUL_WEIGHT=topk_weights is not None,
        HAS_BIAS=bias is not None,
        HAS_GATE=gate is not None,
        BLOCK_H=block_h,
        ROUND_IN_FP32=not y.is_cuda,
        num_warps=4,
        **pdl_args(y),
    )
    launch(g._moe_sum_kernel, grid, args, constexprs, y.is_cuda)


def fused_experts_triton(
    output: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: MoEActivation,
    params: tuple[float, float, float, bool],
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    a1_scale: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    a2_static_scale: torch.Tensor | None = None,
    a_mode: str = "none",
    w_mode: str = "none",
    a2_mode: str = "none",
    mul_routed_weight: bool = True,
    dtype_key: str = "bfloat16",
    gate: torch.Tensor | None = None,
    output_columns: OutputColumns | None = None,
    input_ready: Callable[[], None] | None = None,
) -> None:
    """Write the experts' weighted top-k sum into output [M, H]. Inputs are assumed checked by
    the caller (TritonExperts); params are (alpha, beta, limit, has_limit) with defaults
    resolved (fusedmoe.quant.kernels.resolve_params). gate (uint8 [1] on the device, more
    than one token): where it reads 0 the call writes nothing into output, and its GEMMs,
    activation and sum return at once (read on the GPU: one of two paths chosen without a host
    sync; a2 quantized per row or tensor still runs). output_columns (eager, not while
    torch.compile traces): GEMM2 and the sum run by its column blocks, each reported
    (fusedmoe.modular.types.OutputColumns; inner bounds multiples of 128 for 128-block
    weights). input_ready (eager too): called once the slots are aligned, before x and a1_scale
    are read (fusedmoe.modular.types.ExpertsCall.input_ready)."""
    alpha, beta, limit, has_limit = params
    if output_columns is not None:  # before any launch: a rank that raises mid-way strands
        # its peers at the combine's barriers
        output_columns.check(output.shape[1], g.QUANT_GROUP if w_mode == "block" else 1)
    args = (
        output, x, a1_scale, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias,
        topk_weights, topk_ids, expert_map, a2_static_scale, workspace13, workspace2,
        activation.value, alpha, beta, limit, has_limit, a_mode, w_mode, a2_mode,
        mul_routed_weight, dtype_key, gate,
    )  # fmt: skip
    if output_columns is not None or input_ready is not None:
        if torch.compiler.is_compiling():
            raise ValueError(
                "output_columns and input_ready are eager only (a callback is no op argument)"
            )
        _fused_experts(*args, columns=output_columns, input_ready=input_ready)
        return
    op_or_impl(_fused_experts_triton_op, _fused_experts_triton_impl)(*args)
