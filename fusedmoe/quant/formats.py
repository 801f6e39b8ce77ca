"""Number formats: FP8 E4M3, E2M1 (FP4) with nibble packing, E8M0 scales, INT8.

Every scale in fusedmoe is a *dequantization multiplier*: x ~= q * scale.

    E4M3 (torch.float8_e4m3fn)  max 448, no inf; values beyond +-448 saturate (we clamp first)
    E2M1 (FP4)                  {0, 0.5, 1, 1.5, 2, 3, 4, 6} and negatives; 4-bit code
                                sign << 3 | index into that list; two codes per uint8, the
                                element of even index in the low nibble
    E8M0 (uint8)                2 ** (code - 127); 255 is NaN (never produced here)
    UE8M0                       a float32 scale rounded up to a power of two
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_EMAX = 8  # 448 = 1.75 * 2**8
FP8_MIN_SUBNORMAL = 2.0**-9  # the smallest positive e4m3 value
FP4_MAX = 6.0
FP4_EMAX = 2  # 6 = 1.5 * 2**2
INT8_MAX = 127.0
E8M0_BIAS = 127
#: smallest amax used to form a scale: an all-zero block gets a tiny scale, never 0 or NaN
AMAX_EPS = 1e-10

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbours, and whether a tie there rounds up (to the even code).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                   (3.5, True), (5.0, False))  # fmt: skip


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit E2M1 code (uint8 in [0, 16)), round to nearest, ties to even, saturating."""
    mag = x.float().abs()
    index = torch.zeros_like(mag, dtype=torch.uint8)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        index += (mag >= midpoint if tie_up else mag > midpoint).to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3
    return sign | index


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 code (uint8) -> float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    value = table[(code & 0x7).long()]
    return torch.where((code & 0x8) != 0, -value, value)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] uint8; the code of even index goes in the low nibble."""
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] codes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def e8m0_encode_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponent e (float or int tensor) -> E8M0 code e + 127, clamped to [0, 254]."""
    return (exponent + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """E8M0 code (uint8) -> float32 2 ** (code - 127)."""
    return torch.exp2(code.float() - E8M0_BIAS)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) for x > 0, exactly: read from the exponent (a float32 log2 can be off by
    one within a few ulps of a power of two)."""
    _, exponent = torch.frexp(x.float())  # x = m * 2**exponent with 0.5 <= m < 1
    return (exponent - 1).float()


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0: the smallest power of two >= scale (scale > 0), exactly."""
    mantissa, exponent = torch.frexp(scale.float())
    return torch.ldexp(torch.ones_like(mantissa), exponent - (mantissa == 0.5).int())


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float -> E4M3, saturating at +-448 (a plain cast would give NaN beyond it)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def mx_shared_exponent(amax: torch.Tensor, element_emax: int) -> torch.Tensor:
    """OCP MX shared exponent of a block: floor(log2(amax)) - emax of the element format,
    clamped to the E8M0 range; an all-zero block gets the smallest exponent."""
    exponent = floor_log2(amax.clamp(min=torch.finfo(torch.float32).tiny)) - element_emax
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
