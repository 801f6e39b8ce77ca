"""quantize / dequantize for every QuantKey: the spec every quantization kernel is checked against.

For an operand x [..., R, K] (2-D activations [M, K], or 3-D expert weights [E, N, K]):

    amax  = max |x| over each scale cell (tensor, row, 1 x g group or bn x bk block)
    scale = amax / fmt_max                        float32      (FP8: 448, INT8: 127)
          = 2 ** ceil(log2(amax / fmt_max))       UE8M0
          = 2 ** (floor(log2(amax)) - emax)       E8M0 (MX: emax 8 for E4M3, 2 for E2M1)
          = e4m3(amax / 6 / g) * g                NVFP4, g = amax_tensor / (448 * 6) global
    q     = encode(x / scale)                     saturating at the format's max
    x    ~= q * scale                             (dequantize)

INT4 (weights only, codes q in [0, 16) around a zero point):
    symmetric:   scale = amax / 7, zero = 8,     q = clamp(round(x / scale) + 8, 1, 15)
    zero points: scale = (max - min) / 15 (max >= 0 >= min over the cell),
                 zero = clamp(round(-min / scale), 0, 15) (uint8),
                 q = clamp(round(x / scale) + zero, 0, 15)   (GPTQ / AWQ's asymmetric rule)
    x ~= (q - zero) * scale

An all-zero cell gets the scale of amax = 1e-10 (float32 formats), the smallest exponent
(E8M0) or the smallest e4m3 subnormal 2**-9 times g (NVFP4), so q is 0 and no scale is 0 or NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusedmoe.quant.formats import (
    AMAX_EPS,
    FP4_EMAX,
    FP4_MAX,
    FP8_DTYPE,
    FP8_EMAX,
    FP8_MAX,
    FP8_MIN_SUBNORMAL,
    INT8_MAX,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode_exponent,
    mx_shared_exponent,
    pack_fp4,
    round_up_pow2,
    to_fp8,
    unpack_fp4,
)
from fusedmoe.quant.keys import ElementFormat, QuantKey, ScaleFormat, ScaleLayout

_FMT_MAX = {ElementFormat.FP8: FP8_MAX, ElementFormat.INT8: INT8_MAX, ElementFormat.FP4: FP4_MAX}
_FMT_EMAX = {ElementFormat.FP8: FP8_EMAX, ElementFormat.FP4: FP4_EMAX}


@dataclass
class Quantized:
    q: torch.Tensor  # fp8 / int8 [..., R, K], or uint8 [..., R, K/2] for FP4
    scale: torch.Tensor | None  # in the key's layout and format; None: q is unquantized
    global_scale: torch.Tensor | None = None  # NVFP4: float32 [1] (2-D) or [E] (3-D)
    zero_point: torch.Tensor | None = None  # INT4 with zero points: uint8, the scale's shape


def check_quantizable(x: torch.Tensor, key: QuantKey, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{what} must be [M, K] or [E, N, K], got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise TypeError(f"{what} must be a float tensor to quantize, got {x.dtype}")
    k = x.shape[-1]
    if key.group is not None and key.exact_groups and k % key.group[1] != 0:
        raise ValueError(
            f"{what}: K = {k} is not a multiple of the {key.group[1]}-wide groups of "
            f"{key.name} (MX, NVFP4 and INT4 need whole groups)"
        )
    if key.packed and k % 2 != 0:
        raise ValueError(f"{what}: 4-bit formats pack two values per byte, K = {k} must be even")


def _cells(x: torch.Tensor, key: QuantKey) -> tuple[torch.Tensor, tuple[int, ...]]:
    """|x| reduced to one amax per scale cell: [B, cells...]. x is [B, R, K] float32."""
    b, r, k = x.shape
    a = x.abs()
    if key.layout is ScaleLayout.TENSOR:
        return a.amax(dim=(1, 2)), (b,)
    if key.layout is ScaleLayout.ROW:
        return a.amax(dim=2), (b, r)
    bn, bk = key.group
    rb, kb = math.ceil(r / bn), math.ceil(k / bk)
    a = F.pad(a, (0, kb * bk - k, 0, rb * bn - r))
    return a.view(b, rb, bn, kb, bk).amax(dim=(2, 4)), (b, rb, kb)


def _expand(cell_values: torch.Tensor, key: QuantKey, shape: tuple[int, int, int]) -> torch.Tensor:
    """One value per cell -> one value per element of an operand of `shape` [B, R, K]."""
    b, r, k = shape
    if key.layout is ScaleLayout.TENSOR:
        return cell_values.view(b, 1, 1)
    if key.layout is ScaleLayout.ROW:
        return cell_values.view(b, r, 1)
    bn, bk = key.group
    full = cell_values.repeat_interleave(bn, dim=1).repeat_interleave(bk, dim=2)
    return full[:, :r, :k]


def _full_like(t: torch.Tensor, value: float) -> torch.Tensor:
    """A tensor divisor: PyTorch on CUDA divides by a Python scalar as a multiplication by its
    reciprocal, which is not the correctly rounded quotient; tensor / tensor is, everywhere."""
    return torch.full_like(t, value)


def _as_batched(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == 2 else x


def _scale_shape(key: QuantKey, x: torch.Tensor, cells: tuple[int, ...]) -> tuple[int, ...]:
    """The public shape of the scale tensor (see fusedmoe.quant.keys)."""
    if x.dim() == 3:
        return cells
    if key.layout is ScaleLayout.TENSOR:
        return (1,)
    if key.layout is ScaleLayout.ROW:
        return (cells[1], 1)
    return cells[1:]


def quantize(
    x: torch.Tensor,
    key: QuantKey,
    scale: torch.Tensor | None = None,
    *,
    column_major_scales: bool = False,
    what: str = "x",
    zero_point: bool = False,
) -> Quantized:
    """x [M, K] or [E, N, K] -> Quantized. `scale` is the given scale of a static key;
    zero_point: INT4 with a zero point per group (asymmetric), else symmetric."""
    check_quantizable(x, key, what)
    if zero_point and key.element is not ElementFormat.INT4:
        raise ValueError(f"zero points are for int4 weights, not {key.name}")
    if key.element is ElementFormat.INT4:
        return _quantize_int4(x, key, zero_point)
    if key.static and scale is None:
        raise ValueError(f"{key.name}: a static key needs its scale")
    if not key.static and scale is not None:
        raise ValueError(f"{key.name}: a dynamic key computes its own scale; pass none")
    xb = _as_batched(x).float()
    amax, cells = _cells(xb, key)
    global_scale = None
    if key.static:
        if not isinstance(scale, torch.Tensor) or scale.numel() != math.prod(cells):
            got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
            raise ValueError(
                f"{key.name}: the static scale must be a tensor of {math.prod(cells)} "
                f"element(s), one per {key.layout.value} cell, got {got}"
            )
        scale_cells = scale.float().reshape(cells).to(xb.device)
        # a device scale is not read back here (no host sync: the call stays capturable in a
        # CUDA graph); make_quant_config checks the config's scales once
        if scale_cells.device.type == "cpu" and not bool((scale_cells > 0).all()):
            raise ValueError(f"{key.name}: static scales must be positive")
        stored = scale_cells
    elif key.scale_format is ScaleFormat.E8M0:
        exponent = mx_shared_exponent(amax, _FMT_EMAX[key.element])
        stored = e8m0_encode_exponent(exponent)
        scale_cells = torch.exp2(exponent)
    elif key.scale_format is ScaleFormat.E4M3_GLOBAL:
        tensor_amax = xb.abs().amax(dim=(1, 2)).clamp(min=AMAX_EPS)  # [B]
        global_scale = tensor_amax / _full_like(tensor_amax, FP8_MAX * FP4_MAX)
        g = global_scale.view(-1, *([1] * (amax.dim() - 1)))
        # at least the smallest e4m3 subnormal: an all-zero block gets a non-zero scale too
        stored = to_fp8((amax / _full_like(amax, FP4_MAX) / g).clamp(min=FP8_MIN_SUBNORMAL))
        scale_cells = stored.float() * g
    else:
        scale_cells = amax.clamp(min=AMAX_EPS) / _full_like(amax, _FMT_MAX[key.element])
        if key.scale_format is ScaleFormat.UE8M0:
            scale_cells = round_up_pow2(scale_cells)
        stored = scale_cells

    s = _expand(scale_cells, key, tuple(xb.shape))
    scaled = torch.where(s > 0, xb / s, torch.zeros_like(xb))
    if key.element is ElementFormat.FP8:
        q = to_fp8(scaled)
    elif key.element is ElementFormat.INT8:
        q = scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = pack_fp4(e2m1_encode(scaled))
    if x.dim() == 2:
        q = q[0]
        global_scale = None if global_scale is None else global_scale.view(1)
    stored = stored.reshape(_scale_shape(key, x, cells))
    if column_major_scales:
        if x.dim() != 2 or key.layout is not ScaleLayout.GROUP:
            raise ValueError(
                "column_major_scales applies to the group scales of [M, K] activations"
            )
        stored = stored.t().contiguous().t()
    return Quantized(q=q, scale=stored, global_scale=global_scale)


def _quantize_int4(x: torch.Tensor, key: QuantKey, zero_point: bool) -> Quantized:
    """INT4 group quantization (see the module docstring); scales float32 [..., R, K/g]."""
    if key.layout is not ScaleLayout.GROUP:
        raise ValueError(f"int4 weights take group scales, got {key.name}")
    xb = _as_batched(x).float()
    b, r, k = xb.shape
    g = key.group[1]
    cells = xb.view(b, r, k // g, g)
    if zero_point:
        high = cells.amax(dim=-1).clamp(min=0.0)
        low = cells.amin(dim=-1).clamp(max=0.0)
        fifteen = _full_like(high, 15.0)
        span = high - low
        # (max - min) / 15, or max / 15 - min / 15 where the difference overflows float32
        scale = torch.where(span.isfinite(), span / fifteen, high / fifteen - low / fifteen)
        scale = scale.clamp(min=AMAX_EPS)
        zero = (-low / scale).round().clamp(0, 15)
    else:
        amax = cells.abs().amax(dim=-1)
        scale = amax.clamp(min=AMAX_EPS) / _full_like(amax, 7.0)
        zero = torch.full_like(scale, 8.0)
    codes = (cells / scale[..., None]).round() + zero[..., None]
    codes = codes.clamp(0 if zero_point else 1, 15).to(torch.uint8).view(b, r, k)
    q = pack_fp4(codes)
    zeros = zero.to(torch.uint8) if zero_point else None
    if x.dim() == 2:
        q, scale = q[0], scale[0]
        zeros = None if zeros is None else zeros[0]
    return Quantized(q=q, scale=scale, zero_point=zeros)


def decode_elements(q: torch.Tensor, key: QuantKey) -> torch.Tensor:
    """Stored elements -> float32 values before scaling (4-bit unpacked: K/2 bytes -> K; INT4:
    the unsigned codes, before the zero point is taken off)."""
    if key.element is ElementFormat.FP4:
        return e2m1_decode(unpack_fp4(q))
    if key.element is ElementFormat.INT4:
        return unpack_fp4(q).float()
    return q.float()


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    key: QuantKey,
    global_scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantized operand -> float32 x ~= q * scale (INT4: (q - zero) * scale), of the
    operand's logical shape."""
    values = _as_batched(decode_elements(q, key))
    b = values.shape[0]
    if key.element is ElementFormat.INT4:
        if zero_point is None:
            values = values - 8.0
        else:
            zeros = zero_point.float().reshape(b, *_cell_dims(key, values.shape))
            values = values - _expand(zeros, key, tuple(values.shape))
    elif zero_point is not None:
        raise ValueError(f"{key.name}: only int4 weights have zero points")
    cells = e8m0_decode(scale) if key.scale_format is ScaleFormat.E8M0 else scale.float()
    cells = cells.reshape(b, *_cell_dims(key, values.shape))
    if key.scale_format is ScaleFormat.E4M3_GLOBAL:
        if global_scale is None:
            raise ValueError(f"{key.name}: dequantize needs the global scale")
        cells = cells * global_scale.float().reshape(b, *([1] * (cells.dim() - 1)))
    return (values * _expand(cells, key, tuple(values.shape)))[0 if q.dim() == 2 else slice(None)]


def _cell_dims(key: QuantKey, shape: tuple[int, int, int]) -> tuple[int, ...]:
    _, r, k = shape
    if key.layout is ScaleLayout.TENSOR:
        return ()
    if key.layout is ScaleLayout.ROW:
        return (r,)
    bn, bk = key.group
    return (math.ceil(r / bn), math.ceil(k / bk))


def fake_quantize(
    x: torch.Tensor, key: QuantKey, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: what a quantized pipeline sees of x."""
    qx = quantize(x, key, scale)
    return dequantize(qx.q, qx.scale, key, qx.global_scale).to(x.dtype)
