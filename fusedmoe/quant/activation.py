"""Activation quantizers: the functions prepare/finalize and the experts call.

Each has a torch twin (`*_torch`, built on fusedmoe.quant.reference, the spec) and, where it is
hot, a Triton kernel (fusedmoe.quant.kernels) used on CUDA tensors when Triton is installed.
Shapes: x [M, K] -> q [M, K] (FP4: [M, K/2] uint8), scales as fusedmoe.quant.keys says.
"""

from __future__ import annotations

import torch

from fusedmoe._triton import triton_runs_on
from fusedmoe.activation import ActivationParams, MoEActivation, apply_activation
from fusedmoe.quant import keys
from fusedmoe.quant.reference import Quantized, quantize


def _group_key(group_size: int, use_ue8m0: bool) -> keys.QuantKey:
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    fmt = keys.ScaleFormat.UE8M0 if use_ue8m0 else keys.ScaleFormat.FLOAT32
    return keys.QuantKey(keys.ElementFormat.FP8, keys.ScaleLayout.GROUP, fmt, group=(1, group_size))


def _check_2d(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be [M, K], got shape {tuple(x.shape)}")
    return x


# ---- FP8 per-token-group (1 x group_size), the DeepSeek-V3 activation format ----
def per_token_group_quant_fp8_torch(
    x: torch.Tensor,
    group_size: int = 128,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8 [M, K], scales float32 [M, ceil(K/g)]), column-major if asked."""
    qx = quantize(
        _check_2d("x", x),
        _group_key(group_size, use_ue8m0),
        column_major_scales=column_major_scales,
    )
    return qx.q, qx.scale


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8 [M, K], scales float32 [M, ceil(K/g)]), column-major if asked."""
    _check_2d("x", x)
    _group_key(group_size, use_ue8m0)
    if triton_runs_on(x):
        from fusedmoe.quant.kernels import per_token_group_quant_fp8_triton

        return per_token_group_quant_fp8_triton(x, group_size, column_major_scales, use_ue8m0)
    return per_token_group_quant_fp8_torch(x, group_size, column_major_scales, use_ue8m0)


# ---- fused gated activation + FP8 per-token-group quantization ----
def act_mul_per_token_group_quant_fp8_torch(
    h: torch.Tensor,
    activation: MoEActivation | str = "silu",
    params: ActivationParams | None = None,
    group_size: int = 128,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, 2I] -> quantize(act(h)) with act computed in float32 (never rounded before)."""
    a = apply_activation(activation, _check_2d("h", h), params)
    qx = quantize(a, _group_key(group_size, use_ue8m0), column_major_scales=column_major_scales)
    return qx.q, qx.scale


def act_mul_per_token_group_quant_fp8(
    h: torch.Tensor,
    activation: MoEActivation | str = "silu",
    params: ActivationParams | None = None,
    group_size: int = 128,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, 2I] -> (q fp8 [M, I], scales [M, ceil(I/g)]): activation and quantization fused."""
    act = MoEActivation.parse(activation)
    _check_2d("h", h)
    _group_key(group_size, use_ue8m0)
    if triton_runs_on(h):
        from fusedmoe.quant.kernels import act_mul_per_token_group_quant_fp8_triton, fused_supports

        if fused_supports(act, params):
            return act_mul_per_token_group_quant_fp8_triton(
                h, act, params, group_size, column_major_scales, use_ue8m0
            )
    return act_mul_per_token_group_quant_fp8_torch(
        h, act, params, group_size, column_major_scales, use_ue8m0
    )


# ---- MXFP8: e4m3 values, one E8M0 scale per 1 x 32 ----
def quantize_mxfp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (q fp8 [M, K], scales uint8 E8M0 [M, K/32])."""
    qx = quantize(_check_2d("x", x), keys.MXFP8)
    return qx.q, qx.scale


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (q fp8 [M, K], scales uint8 E8M0 [M, K/32])."""
    _check_2d("x", x)
    if x.shape[1] % 32 != 0:
        raise ValueError(f"MXFP8 needs K % 32 == 0, got K = {x.shape[1]}")
    if triton_runs_on(x):
        from fusedmoe.quant.kernels import quantize_mxfp8_triton

        return quantize_mxfp8_triton(x)
    return quantize_mxfp8_torch(x)


# ---- the others: torch (they are not on a hot path of the backends here) ----
def quantize_fp8_per_tensor(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8, scale float32 [1]); static when `scale` is given, else dynamic."""
    key = keys.FP8_STATIC_TENSOR if scale is not None else keys.FP8_DYNAMIC_TENSOR
    qx = quantize(_check_2d("x", x), key, scale)
    return qx.q, qx.scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q fp8, scales float32 [M, 1])."""
    qx = quantize(_check_2d("x", x), keys.FP8_DYNAMIC_TOKEN)
    return qx.q, qx.scale


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8, scales float32 [M, 1])."""
    qx = quantize(_check_2d("x", x), keys.INT8_DYNAMIC_TOKEN)
    return qx.q, qx.scale


def quantize_nvfp4(x: torch.Tensor) -> Quantized:
    """x [M, K] (K % 16 == 0) -> q uint8 [M, K/2], e4m3 scales [M, K/16], global float32 [1]."""
    return quantize(_check_2d("x", x), keys.NVFP4)


# ---- the dispatcher prepare/finalize and the experts use ----
def quantize_activation(x: torch.Tensor, operand) -> Quantized:
    """x [M, K] quantized as `operand` (an OperandQuant) says; unquantized: q is x itself."""
    key = operand.key
    if key is None:
        return Quantized(q=x, scale=None)
    if key.element is keys.ElementFormat.FP8 and key.layout is keys.ScaleLayout.GROUP:
        if key.scale_format in (keys.ScaleFormat.FLOAT32, keys.ScaleFormat.UE8M0):
            use_ue8m0 = key.scale_format is keys.ScaleFormat.UE8M0
            q, scale = per_token_group_quant_fp8(
                x, key.group[1], operand.column_major_scales, use_ue8m0
            )
            return Quantized(q=q, scale=scale)
        if key == keys.MXFP8:
            q, scale = quantize_mxfp8(x)
            return Quantized(q=q, scale=scale)
    return quantize(x, key, operand.scale, column_major_scales=operand.column_major_scales)


def quantize_input(x: torch.Tensor, quant_config) -> Quantized:
    """The input of GEMM1 as the quant config's a1 says (unquantized without a config)."""
    if quant_config is None:
        return Quantized(q=x, scale=None)
    return quantize_activation(x, quant_config.a1)
