"""Activation quantization kernels: FP8 per-token-group, gated activation fused with FP8
per-token-group quantization, and MXFP8. Their torch twins (the spec) are in
fusedmoe.quant.activation, which imports this module lazily.

Legend: M rows (tokens), K the quantized width (for the fused op K = I and h is [M, 2I]),
g the group size, G = ceil(K / g) groups per row (the last one may be partial).

Every program quantizes a tile of BLOCK_M rows x GROUPS_PER_PROGRAM groups, whole groups only:

    x     = load(tile)                                        # [BLOCK_M, GROUPS, BLOCK_G] fp32
    amax  = max |x| over each group                           # [BLOCK_M, GROUPS]
    scale = max(amax, 1e-10) / 448                            FLOAT32
          = 2 ** ceil(log2(max(amax, 1e-10) / 448))           UE8M0 (float32 power of two)
          = 2 ** clamp(floor(log2(amax)) - 8, -127, 127)      E8M0, stored as exponent + 127
    q     = e4m3(clamp(x / scale, -448, 448))                 # round to nearest, ties to even

Why the kernels match the twin bit for bit:
- fp32 `/` in Triton compiles to an approximate division on NVIDIA GPUs. x / scale is
  rounded as IEEE division (torch's) by a multiply with the group's correctly rounded
  reciprocal and one fma correction (Markstein); a power-of-two scale divides exactly as a
  multiplication by its reciprocal, built from the exponent bits.
- UE8M0 and E8M0 exponents come from the float's bits, not from log2: an approximate log2 of a
  value within an ulp of a power of two would move the scale by a factor of two.
- Triton's CPU interpreter casts fp32 -> fp8 by rounding half up and drops mantissa carries, so
  for CPU tensors the kernel first rounds onto the e4m3 grid in fp32 (ROUND_IN_FP32); the cast
  of a value already on the grid is exact. On a GPU the hardware conversion rounds to even.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedmoe._pdl import pdl_args, pdl_start
from fusedmoe._triton import cdiv, device_guard, next_power_of_2, op_or_impl, triton_runs_on
from fusedmoe.activation import (
    OAI_ALPHA,
    OAI_LIMIT,
    STEP_LIMIT,
    ActivationParams,
    MoEActivation,
)
from fusedmoe.quant.formats import AMAX_EPS, E8M0_BIAS, FP8_DTYPE, FP8_EMAX, FP8_MAX

__all__ = [
    "QuantKernelConfig",
    "act_mul_per_token_group_quant_fp8_triton",
    "fused_supports",
    "per_token_group_quant_fp8_triton",
    "quant_kernel_config",
    "quantize_mxfp8_triton",
    "use_quant_kernel_config",
]

# float64 is rounded to float32 on load, as the twin quantizes x.float() (the reference
# backend hands float64 activations to the dispatchers).
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_MX_GROUP = 32

# Compile-time codes (Triton kernels only read globals that are constexpr).
FP8_MAX_TL = tl.constexpr(FP8_MAX)
_FP8_EMAX = tl.constexpr(FP8_EMAX)
_AMAX_EPS = tl.constexpr(AMAX_EPS)
_E8M0_BIAS = tl.constexpr(E8M0_BIAS)
_FLOAT32, _UE8M0, _E8M0 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_SILU, _GELU, _SWIGLUOAI, _SWIGLUOAI_UNINTERLEAVE, _SWIGLUSTEP = (tl.constexpr(i) for i in range(5))
ACTIVATION_CODE = {
    MoEActivation.SILU: _SILU.value,
    MoEActivation.GELU: _GELU.value,
    MoEActivation.SWIGLUOAI: _SWIGLUOAI.value,
    MoEActivation.SWIGLUOAI_UNINTERLEAVE: _SWIGLUOAI_UNINTERLEAVE.value,
    MoEActivation.SWIGLUSTEP: _SWIGLUSTEP.value,
}


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def round_to_e4m3_grid(y):
    """fp32 y in [-448, 448] -> the nearest E4M3 value (ties to even), still fp32."""
    y_bits = y.to(tl.int32, bitcast=True)
    sign = y_bits & -2147483648  # 0x80000000: keeps -0.0 and negatives rounding to zero
    bits = y_bits & 0x7FFFFFFF
    mag = bits.to(tl.float32, bitcast=True)
    # normals (>= 2**-6) keep 3 of the 23 mantissa bits: add half an ulp - 1, plus the kept lsb
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    # subnormals are multiples of 2**-9, the spacing of fp32 at 2**14: the add rounds to even
    subnormal = ((mag + 16384.0) - 16384.0).to(tl.int32, bitcast=True)
    r = tl.where(mag < 0.015625, subnormal, normal)
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def divide_by_group_scale(x, scale, inverse):
    """x / scale rounded to nearest, as IEEE division, given inverse = 1 / scale rounded to
    nearest (once per group): a multiply and Markstein's fma correction per element instead of a
    full division. The remainder r is exact; r == 0 keeps the sign of a zero quotient."""
    q = x * inverse
    r = tl.fma(-q, scale, x)
    return tl.where(r == 0.0, q, tl.fma(r, inverse, q))


@triton.jit
def quantize_groups(x, SCALE_FORMAT: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """x fp32 [BLOCK_M, GROUPS, BLOCK_G], padding lanes 0
    -> (y fp32 on the e4m3 range (and grid if ROUND_IN_FP32), scale [BLOCK_M, GROUPS] as stored).
    """
    amax = tl.max(tl.abs(x), axis=2)  # [BLOCK_M, GROUPS]
    if SCALE_FORMAT == _E8M0:
        # floor(log2(amax)) + 127 is the biased exponent field (0 for 0 and subnormals, whose
        # exponent clamps to -127 either way)
        biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        exponent = tl.minimum(tl.maximum(biased - _E8M0_BIAS - _FP8_EMAX, -127), 127)
        stored = (exponent + _E8M0_BIAS).to(tl.uint8)
        inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**-exponent, normal
        y = x * inverse[:, :, None]
    else:
        scale = tl.math.div_rn(tl.maximum(amax, _AMAX_EPS), FP8_MAX_TL)
        if SCALE_FORMAT == _UE8M0:
            bits = scale.to(tl.int32, bitcast=True)
            # round up to a power of two: bump the exponent unless the mantissa is already 0
            bits = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
            scale = bits.to(tl.float32, bitcast=True)
            inverse = ((254 << 23) - bits).to(tl.float32, bitcast=True)  # 2**-e, exact
            y = x * inverse[:, :, None]
        else:
            y = divide_by_group_scale(x, scale[:, :, None], tl.math.div_rn(1.0, scale)[:, :, None])
        stored = scale
    y = tl.minimum(tl.maximum(y, -FP8_MAX_TL), FP8_MAX_TL)
    if ROUND_IN_FP32:
        y = round_to_e4m3_grid(y)
    return y, stored


@triton.jit
def _group_tile(
    pid_m, pid_g, M, K, G,
    BLOCK_M: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    """This program's rows, groups and columns, and the masks of its elements and scales."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    groups = pid_g * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)  # [NG]
    lane = tl.arange(0, BLOCK_G)  # [BG]
    cols = groups[:, None] * GROUP_SIZE + lane[None, :]  # [NG, BG]
    col_ok = (lane[None, :] < GROUP_SIZE) & (cols < K)
    mask = (rows < M)[:, None, None] & col_ok[None, :, :]  # [BM, NG, BG]
    scale_mask = (rows < M)[:, None] & (groups < G)[None, :]  # [BM, NG]
    return rows.to(tl.int64), groups, cols[None, :, :], mask, scale_mask


@triton.jit
def _group_quant_fp8_kernel(
    x_ptr, stride_xm, stride_xk,  # [M, K] bf16 / fp16 / fp32 / fp64
    q_ptr, stride_qm, stride_qk,  # [M, K] e4m3
    s_ptr, stride_sm, stride_sg,  # [M, G] fp32, or uint8 E8M0
    M, K, G,
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two >= GROUP_SIZE
    BLOCK_M: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    SCALE_FORMAT: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_start(PDL)
    rows, groups, cols, mask, scale_mask = _group_tile(
        tl.program_id(0), tl.program_id(1), M, K, G, BLOCK_M, GROUPS_PER_PROGRAM, GROUP_SIZE,
        BLOCK_G,
    )  # fmt: skip
    x = tl.load(
        x_ptr + rows[:, None, None] * stride_xm + cols * stride_xk, mask=mask, other=0.0
    ).to(tl.float32)
    y, scale = quantize_groups(x, SCALE_FORMAT, ROUND_IN_FP32)
    q_ptrs = q_ptr + rows[:, None, None] * stride_qm + cols * stride_qk
    tl.store(q_ptrs, y.to(q_ptr.dtype.element_ty), mask=mask)
    s_ptrs = s_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg
    tl.store(s_ptrs, scale, mask=scale_mask)


# The formulas of torch's kernels (x / (1 + exp(-x)), 1 / (1 + exp(-x))). On a GPU, exp and
# `/` are the fast approximate instructions (a few ulps; the fused kernel's budget is tight),
# on the interpreter they are numpy's: the amax, and so the scale, may differ from the twin's
# in the last bits.
@triton.jit
def _silu(z):
    return z / (1.0 + tl.exp(-z))


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def gated_activation(
    gate, up, alpha, beta, limit, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr
):
    """fp32 gate, up -> act(gate, up) in fp32, as fusedmoe.activation defines it."""
    if ACTIVATION == _SILU:
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        out = _silu(gate) * up
    elif ACTIVATION == _GELU:
        out = gate * 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == _SWIGLUSTEP:
        out = tl.minimum(_silu(gate), limit) * tl.minimum(tl.maximum(up, -limit), limit)
    else:  # SWIGLUOAI (beta = 1) and SWIGLUOAI_UNINTERLEAVE
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + beta) * gate * _sigmoid(alpha * gate)
    return out


@triton.jit
def _act_mul_group_quant_fp8_kernel(
    h_ptr, stride_hm, stride_hk,  # [M, 2I] bf16 / fp16 / fp32 / fp64: gate half, up half
    q_ptr, stride_qm, stride_qk,  # [M, I] e4m3
    s_ptr, stride_sm, stride_sg,  # [M, G] fp32
    M, I, G,  # noqa: E741 (I: the intermediate size of the legend)
    alpha, beta, limit,  # fp32 activation parameters (defaults resolved by the launcher)
    rows_in_use_ptr,  # int32 [1] (HAS_ROWS_IN_USE): the row tiles starting past it are skipped
    bias_ptr, stride_be, stride_bn,  # HAS_BIAS: [E, 2I] GEMM1 biases, added to h before act
    row_expert_ptr, num_bias,  # HAS_BIAS: int32 [M], each row's expert (outside [0, E): none)
    ACTIVATION: tl.constexpr,
    HAS_LIMIT: tl.constexpr,  # SILU only: whether it clamps
    GROUP_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    SCALE_FORMAT: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    HAS_ROWS_IN_USE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_start(PDL)
    if HAS_ROWS_IN_USE:  # noqa: SIM102 (a constexpr guard: nothing loaded without it)
        # the contiguous layout's M is a bound; the rows it fills end here
        if tl.program_id(0) * BLOCK_M >= tl.load(rows_in_use_ptr):
            return
    rows, groups, cols, mask, scale_mask = _group_tile(
        tl.program_id(0), tl.program_id(1), M, I, G, BLOCK_M, GROUPS_PER_PROGRAM, GROUP_SIZE,
        BLOCK_G,
    )  # fmt: skip
    h_rows = h_ptr + rows[:, None, None] * stride_hm
    if HAS_BIAS:
        expert = tl.load(row_expert_ptr + rows, mask=rows < M, other=-1)
        b_rows = bias_ptr + tl.maximum(expert, 0).to(tl.int64)[:, None, None] * stride_be
        b_mask = mask & ((expert >= 0) & (expert < num_bias))[:, None, None]
    if ACTIVATION == _SWIGLUOAI:  # gpt-oss: gate and up interleaved, loaded as one run of
        # 2 x BLOCK_G columns a group (vector loads) and split in registers
        pair = 2 * cols[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]
        gate, up = tl.split(
            tl.load(h_rows[:, :, :, None] + pair * stride_hk, mask=mask[:, :, :, None], other=0.0)
        )
        gate = gate.to(tl.float32)
        up = up.to(tl.float32)
        if HAS_BIAS:
            b_pair_ptrs = b_rows[:, :, :, None] + pair * stride_bn
            b_pair = tl.load(b_pair_ptrs, mask=b_mask[:, :, :, None], other=0.0)
            b_gate, b_up = tl.split(b_pair)
            gate += b_gate.to(tl.float32)
            up += b_up.to(tl.float32)
    else:
        gate = tl.load(h_rows + cols * stride_hk, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_rows + (cols + I) * stride_hk, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            gate += tl.load(b_rows + cols * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
            up += tl.load(b_rows + (cols + I) * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
    a = gated_activation(gate, up, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
    a = tl.where(mask, a, 0.0)  # padding lanes must not count in the group's amax
    y, scale = quantize_groups(a, SCALE_FORMAT, ROUND_IN_FP32)
    q_ptrs = q_ptr + rows[:, None, None] * stride_qm + cols * stride_qk
    tl.store(q_ptrs, y.to(q_ptr.dtype.element_ty), mask=mask)
    s_ptrs = s_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg
    tl.store(s_ptrs, scale, mask=scale_mask)


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantKernelConfig:
    block_m: int  # rows per program, a power of two
    groups_per_program: int  # whole groups per program along K, a power of two
    num_warps: int


_TILE = 4096  # elements per program at large M: 32 per thread at 4 warps, 16-byte loads
_COLS_PER_PROGRAM = 1024  # widest tile along K
_MIN_TILE = 512  # smallest tile the small-M split goes down to
_MIN_PROGRAMS = 264  # two per SM of an H100 / H200 (132 SMs)
_INTERPRETER_TILE = 1 << 16  # the CPU interpreter: cost per program, not per element

_override: contextvars.ContextVar[QuantKernelConfig | None] = contextvars.ContextVar(
    "fusedmoe_quant_kernel_config", default=None
)


def quant_kernel_config(
    num_rows: int, num_groups: int, group_size: int, on_gpu: bool = True
) -> QuantKernelConfig:
    """The tile for quantizing [num_rows, num_groups * group_size]: large tiles of whole groups
    (few, long memory transactions), split while that leaves fewer programs than the GPU has
    room for (small M), down to _MIN_TILE elements. On the interpreter (on_gpu False), where
    each program costs Python overhead, tiles of up to _INTERPRETER_TILE and no split."""
    override = _override.get()
    if override is not None:
        return override
    block_g = next_power_of_2(group_size)
    groups = min(next_power_of_2(num_groups), max(1, _COLS_PER_PROGRAM // block_g))
    tile = _TILE if on_gpu else _INTERPRETER_TILE
    block_m = min(next_power_of_2(max(num_rows, 1)), max(1, tile // (groups * block_g)))
    if not on_gpu:
        return QuantKernelConfig(block_m=block_m, groups_per_program=groups, num_warps=4)

    def programs() -> int:
        return cdiv(num_rows, block_m) * cdiv(num_groups, groups)

    while programs() < _MIN_PROGRAMS and block_m * groups * block_g > _MIN_TILE:
        if block_m > 1:
            block_m //= 2
        elif groups > 1:
            groups //= 2
        else:
            break
    num_warps = max(1, min(8, block_m * groups * block_g // 1024))
    return QuantKernelConfig(block_m=block_m, groups_per_program=groups, num_warps=num_warps)


@contextlib.contextmanager
def use_quant_kernel_config(config: QuantKernelConfig) -> Iterator[None]:
    """Scoped override of the heuristic (tests, benchmarks): every launch inside uses `config`."""
    token = _override.set(config)
    try:
        yield
    finally:
        _override.reset(token)


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------
def _check_matrix(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {x.dtype}")
    if not triton_runs_on(x):
        raise ValueError(
            f"{name} is on {x.device}: Triton kernels need a CUDA tensor "
            "(or a CPU tensor under TRITON_INTERPRET=1)"
        )
    return x


def _check_group_args(group_size: object, column_major_scales: object, use_ue8m0: object) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    for name, flag in (("column_major_scales", column_major_scales), ("use_ue8m0", use_ue8m0)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def _round_in_fp32(x: torch.Tensor) -> bool:
    """Only the interpreter (CPU tensors) needs the fp32 rounding onto the e4m3 grid."""
    return x.device.type != "cuda"


# ---------------------------------------------------------------------------------------------
# output allocation (shared by the ops and their fake implementations)
# ---------------------------------------------------------------------------------------------
def _alloc_group_outputs(
    x: torch.Tensor, m: int, k: int, group_size: int, column_major: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q e4m3 [M, K], scales [M, G] (strides (1, M) when column-major)."""
    g = math.ceil(k / group_size)
    q = x.new_empty((m, k), dtype=FP8_DTYPE)
    if column_major:
        scales = x.new_empty((g, m), dtype=scale_dtype).t()
    else:
        scales = x.new_empty((m, g), dtype=scale_dtype)
    return q, scales


def _launch_group_quant(
    x: torch.Tensor, group_size: int, column_major: bool, scale_format: int
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    scale_dtype = torch.uint8 if scale_format == _E8M0.value else torch.float32
    q, scales = _alloc_group_outputs(x, m, k, group_size, column_major, scale_dtype)
    if m == 0 or k == 0:
        return q, scales
    num_groups = scales.shape[1]
    cfg = quant_kernel_config(m, num_groups, group_size, x.is_cuda)
    grid = (cdiv(m, cfg.block_m), cdiv(num_groups, cfg.groups_per_program))
    with device_guard(x):
        _group_quant_fp8_kernel[grid](
            x, x.stride(0), x.stride(1),
            q, q.stride(0), q.stride(1),
            scales, scales.stride(0), scales.stride(1),
            m, k, num_groups,
            GROUP_SIZE=group_size,
            BLOCK_G=next_power_of_2(group_size),
            BLOCK_M=cfg.block_m,
            GROUPS_PER_PROGRAM=cfg.groups_per_program,
            SCALE_FORMAT=scale_format,
            ROUND_IN_FP32=_round_in_fp32(x),
            num_warps=cfg.num_warps,
            **pdl_args(x),
        )  # fmt: skip
    return q, scales


# ---------------------------------------------------------------------------------------------
# FP8 per-token-group quantization
# ---------------------------------------------------------------------------------------------
def _per_token_group_quant_fp8_impl(
    x: torch.Tensor, group_size: int, column_major_scales: bool, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    scale_format = _UE8M0 if use_ue8m0 else _FLOAT32
    return _launch_group_quant(x, group_size, column_major_scales, scale_format.value)


_per_token_group_quant_fp8_op = torch.library.custom_op(
    "fusedmoe::per_token_group_quant_fp8_triton", mutates_args=()
)(_per_token_group_quant_fp8_impl)


@_per_token_group_quant_fp8_op.register_fake
def _(x, group_size, column_major_scales, use_ue8m0):
    m, k = x.shape
    return _alloc_group_outputs(x, m, k, group_size, column_major_scales, torch.float32)


def per_token_group_quant_fp8_triton(
    x: torch.Tensor,
    group_size: int = 128,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q e4m3 [M, K], scales fp32 [M, ceil(K/g)], strides (1, M) if column-major).

    For each 1 x g group (the last one may be partial):
        scale = max(amax, 1e-10) / 448           (UE8M0: rounded up to a power of two)
        q     = e4m3(clamp(x / scale, -448, 448))
    """
    _check_matrix("x", x)
    _check_group_args(group_size, column_major_scales, use_ue8m0)
    op = op_or_impl(_per_token_group_quant_fp8_op, _per_token_group_quant_fp8_impl)
    return op(x, group_size, column_major_scales, use_ue8m0)


# ---------------------------------------------------------------------------------------------
# gated activation fused with FP8 per-token-group quantization
# ---------------------------------------------------------------------------------------------
def fused_supports(activation: MoEActivation | str, params: ActivationParams | None = None) -> bool:
    """Whether the fused kernel implements `activation` (with any of its parameters)."""
    return MoEActivation.parse(activation) in ACTIVATION_CODE


def resolve_params(
    act: MoEActivation, params: ActivationParams | None
) -> tuple[float, float, float, bool]:
    """(alpha, beta, limit, has_limit) with fusedmoe.activation's defaults filled in."""
    if params is not None and not isinstance(params, ActivationParams):
        raise TypeError(f"params must be an ActivationParams, got {type(params).__name__}")
    p = params or ActivationParams()
    p.check_for(act)
    if act is MoEActivation.SILU:
        return 0.0, 0.0, float(p.limit or 0.0), p.limit is not None
    if act is MoEActivation.SWIGLUSTEP:
        return 0.0, 0.0, float(STEP_LIMIT if p.limit is None else p.limit), True
    if act in (MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUOAI_UNINTERLEAVE):
        alpha = float(OAI_ALPHA if p.alpha is None else p.alpha)
        beta = float(1.0 if p.beta is None else p.beta)  # SWIGLUOAI takes none: 1
        return alpha, beta, float(OAI_LIMIT if p.limit is None else p.limit), True
    return 0.0, 0.0, 0.0, False  # GELU takes no parameters


def act_mul_group_quant_fp8_impl(
    h: torch.Tensor,
    activation: str,
    alpha: float,
    beta: float,
    limit: float,
    has_limit: bool,
    group_size: int,
    column_major_scales: bool,
    use_ue8m0: bool,
    rows_in_use: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    row_expert: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, two_i = h.shape
    i = two_i // 2
    q, scales = _alloc_group_outputs(h, m, i, group_size, column_major_scales, torch.float32)
    if m == 0 or i == 0:
        return q, scales
    num_groups = scales.shape[1]
    cfg = quant_kernel_config(m, num_groups, group_size, h.is_cuda)
    grid = (cdiv(m, cfg.block_m), cdiv(num_groups, cfg.groups_per_program))
    bias_args = (h, 0, 0, h, 0)  # never read without a bias
    if bias is not None:
        bias_args = (bias, *bias.stride(), row_expert, bias.shape[0])
    with device_guard(h):
        _act_mul_group_quant_fp8_kernel[grid](
            h, h.stride(0), h.stride(1),
            q, q.stride(0), q.stride(1),
            scales, scales.stride(0), scales.stride(1),
            m, i, num_groups,
            alpha, beta, limit,
            h if rows_in_use is None else rows_in_use,  # None: never read
            *bias_args,
            ACTIVATION=ACTIVATION_CODE[MoEActivation(activation)],
            HAS_LIMIT=has_limit,
            GROUP_SIZE=group_size,
            BLOCK_G=next_power_of_2(group_size),
            BLOCK_M=cfg.block_m,
            GROUPS_PER_PROGRAM=cfg.groups_per_program,
            SCALE_FORMAT=(_UE8M0 if use_ue8m0 else _FLOAT32).value,
            ROUND_IN_FP32=_round_in_fp32(h),
            HAS_ROWS_IN_USE=rows_in_use is not None,
            HAS_BIAS=bias is not None,
            num_warps=cfg.num_warps,
            **pdl_args(h),
        )  # fmt: skip
    return q, scales


act_mul_group_quant_fp8_op = torch.library.custom_op(
    "fusedmoe::act_mul_per_token_group_quant_fp8_triton", mutates_args=()
)(act_mul_group_quant_fp8_impl)


@act_mul_group_quant_fp8_op.register_fake
def _(h, activation, alpha, beta, limit, has_limit, group_size, column_major_scales, use_ue8m0,
      rows_in_use=None, bias=None, row_expert=None):  # fmt: skip
    m, two_i = h.shape
    return _alloc_group_outputs(h, m, two_i // 2, group_size, column_major_scales, torch.float32)


def act_mul_per_token_group_quant_fp8_triton(
    h: torch.Tensor,
    activation: MoEActivation | str = "silu",
    params: ActivationParams | None = None,
    group_size: int = 128,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
    rows_in_use: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    row_expert: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, 2I] -> (q e4m3 [M, I], scales fp32 [M, ceil(I/g)]), in one pass over h:

        h' = h + bias[row_expert[m]]    in fp32 (with bias; a row_expert < 0 adds nothing)
        a = act(gate, up) in fp32       gate = h'[:, :I], up = h'[:, I:] (SWIGLUOAI: interleaved)
        q, scales = per_token_group_quant_fp8(a)     (a is never written to memory)

    bias [E, 2I] (the experts' GEMM1 biases) and row_expert (int32 [M], the expert of each row
    of h; a row outside [0, E) takes none) come together: GEMM1 over a layout whose rows are
    sorted by expert leaves the bias to this pass.

    exp and the divisions inside the activation are the GPU's fast ones (float64 h is
    computed in fp32 too), so a scale may differ from the twin's in its last few bits.

    rows_in_use: an int32 tensor of one element on h's device, read on the device (the
    contiguous expert layout's rows in use, where M is only a bound): the row tiles that start
    at or past it are skipped, so q and scales hold no values from there on. None: every row.
    """
    act = MoEActivation.parse(activation)
    _check_matrix("h", h)
    _check_group_args(group_size, column_major_scales, use_ue8m0)
    if not fused_supports(act):
        raise ValueError(
            f"activation {act.value!r} has no fused kernel; supported: "
            f"{sorted(a.value for a in ACTIVATION_CODE)}"
        )
    if h.shape[1] % 2 != 0:
        raise ValueError(f"h must be [M, 2I] (an even width), got shape {tuple(h.shape)}")
    if rows_in_use is not None:
        if not isinstance(rows_in_use, torch.Tensor):
            raise TypeError(f"rows_in_use must be a tensor, got {type(rows_in_use).__name__}")
        if rows_in_use.dtype != torch.int32 or rows_in_use.numel() != 1:
            raise ValueError(
                "rows_in_use must be an int32 tensor of one element, got "
                f"{rows_in_use.dtype} of shape {tuple(rows_in_use.shape)}"
            )
        if rows_in_use.device != h.device:
            raise ValueError(f"rows_in_use is on {rows_in_use.device}, h on {h.device}")
    _check_bias(h, bias, row_expert)
    alpha, beta, limit, has_limit = resolve_params(act, params)
    return op_or_impl(act_mul_group_quant_fp8_op, act_mul_group_quant_fp8_impl)(
        h, act.value, alpha, beta, limit, has_limit, group_size, column_major_scales, use_ue8m0,
        rows_in_use, bias, row_expert,
    )  # fmt: skip


def _check_bias(h: torch.Tensor, bias: torch.Tensor | None, row_expert: torch.Tensor | None):
    if (bias is None) != (row_expert is None):
        raise ValueError("bias and row_expert come together (the expert of each row of h)")
    if bias is None:
        return
    for name, t in (("bias", bias), ("row_expert", row_expert)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != h.device:
            raise ValueError(f"{name} is on {t.device}, h on {h.device}")
    if bias.dim() != 2 or bias.shape[1] != h.shape[1]:
        raise ValueError(f"bias must be [E, {h.shape[1]}] (h's width), got {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise TypeError(f"bias must be floating point, got {bias.dtype}")
    if row_expert.dtype != torch.int32 or row_expert.shape != (h.shape[0],):
        raise ValueError(
            f"row_expert must be int32 [{h.shape[0]}] (a row of h each), got {row_expert.dtype} "
            f"of shape {tuple(row_expert.shape)}"
        )
    if not row_expert.is_contiguous():
        raise ValueError("row_expert must be contiguous")


# ---------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------
def _quantize_mxfp8_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_group_quant(x, _MX_GROUP, False, _E8M0.value)


_quantize_mxfp8_op = torch.library.custom_op("fusedmoe::quantize_mxfp8_triton", mutates_args=())(
    _quantize_mxfp8_impl
)


@_quantize_mxfp8_op.register_fake
def _(x):
    m, k = x.shape
    return _alloc_group_outputs(x, m, k, _MX_GROUP, False, torch.uint8)


def quantize_mxfp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (q e4m3 [M, K], scales uint8 E8M0 [M, K/32]):

    exponent = clamp(floor(log2(amax)) - 8, -127, 127)     (all-zero block: -127)
    q        = e4m3(clamp(x / 2**exponent, -448, 448)),    stored code exponent + 127
    """
    _check_matrix("x", x)
    if x.shape[1] % _MX_GROUP != 0:
        raise ValueError(f"x: MXFP8 needs K % 32 == 0, got shape {tuple(x.shape)}")
    return op_or_impl(_quantize_mxfp8_op, _quantize_mxfp8_impl)(x)
