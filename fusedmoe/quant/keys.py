"""Quant keys: what a quantized operand is (element format, scale layout, scale format,
static or dynamic). Every scheme of fusedmoe is a pair of keys (weights, activations).

Scale layouts, for an operand [..., R, K] (R rows: tokens or output channels; K reduced dim):
    TENSOR  one scale per matrix          activations [1], weights [E]
    ROW     one scale per row             activations [M, 1] (per token), weights [E, N] (channel)
    GROUP   one scale per 1 x g along K   activations [M, ceil(K/g)], weights [E, N, K/g]
    BLOCK   one scale per bn x bk tile    weights [E, ceil(N/bn), ceil(K/bk)]
FP8 GROUP and BLOCK layouts accept sizes they do not divide (the last group or block is
partial and has its own scale); the MX, NVFP4 and INT4 layouts (g = 32, 16; 32, 64, 128)
require K % g == 0.

INT4 weights (the weight-only int4_w4a16 scheme, GPTQ / AWQ checkpoints) store unsigned codes
q in [0, 16), two per uint8 (the element of even index in the low nibble), and dequantize as
(q - zero) * scale per 1 x g group: zero is 8 (symmetric) unless the operand stores zero points.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ElementFormat(enum.Enum):
    FP8 = "fp8_e4m3"
    INT8 = "int8"
    FP4 = "fp4_e2m1"  # packed two per uint8
    INT4 = "int4"  # unsigned codes with a zero point, packed two per uint8


class ScaleLayout(enum.Enum):
    TENSOR = "tensor"
    ROW = "row"
    GROUP = "group"
    BLOCK = "block"


class ScaleFormat(enum.Enum):
    FLOAT32 = "float32"
    UE8M0 = "ue8m0"  # float32 rounded up to a power of two
    E8M0 = "e8m0"  # uint8 exponents (MX)
    E4M3_GLOBAL = "e4m3_global"  # e4m3 block scales times a float32 global scale (NVFP4)


@dataclass(frozen=True)
class QuantKey:
    element: ElementFormat
    layout: ScaleLayout
    scale_format: ScaleFormat = ScaleFormat.FLOAT32
    group: tuple[int, int] | None = None  # (rows, cols) of a group or block; None otherwise
    static: bool = False  # the scale is given (calibrated), not computed from the data

    def __post_init__(self) -> None:
        needs_group = self.layout in (ScaleLayout.GROUP, ScaleLayout.BLOCK)
        if needs_group != (self.group is not None):
            raise ValueError(
                f"{self.layout.value} layout {'needs' if needs_group else 'takes no'} group"
            )
        if self.layout is ScaleLayout.GROUP and self.group[0] != 1:
            raise ValueError(f"a GROUP layout spans one row, got group {self.group}")
        if self.static and self.layout is not ScaleLayout.TENSOR:
            raise ValueError("static scales are per-tensor")

    @property
    def exact_groups(self) -> bool:
        """Whether K (and N) must be multiples of the group: the MX and NVFP4 layouts."""
        return (
            self.scale_format in (ScaleFormat.E8M0, ScaleFormat.E4M3_GLOBAL)
            or self.element is ElementFormat.INT4
        )

    @property
    def packed(self) -> bool:
        """Two 4-bit elements per stored byte (FP4, INT4): K / 2 bytes per row."""
        return self.element in (ElementFormat.FP4, ElementFormat.INT4)

    @property
    def name(self) -> str:
        group = "" if self.group is None else "x".join(map(str, self.group))
        static = "static" if self.static else "dynamic"
        return f"{self.element.value}/{self.layout.value}{group}/{self.scale_format.value}/{static}"


_FP8, _INT8, _FP4 = ElementFormat.FP8, ElementFormat.INT8, ElementFormat.FP4
_INT4 = ElementFormat.INT4
_T, _R, _G, _B = ScaleLayout.TENSOR, ScaleLayout.ROW, ScaleLayout.GROUP, ScaleLayout.BLOCK

# activations
FP8_STATIC_TENSOR = QuantKey(_FP8, _T, static=True)
FP8_DYNAMIC_TENSOR = QuantKey(_FP8, _T)
FP8_DYNAMIC_TOKEN = QuantKey(_FP8, _R)
FP8_DYNAMIC_GROUP128 = QuantKey(_FP8, _G, group=(1, 128))
FP8_DYNAMIC_GROUP128_UE8M0 = QuantKey(_FP8, _G, ScaleFormat.UE8M0, group=(1, 128))
MXFP8 = QuantKey(_FP8, _G, ScaleFormat.E8M0, group=(1, 32))
NVFP4 = QuantKey(_FP4, _G, ScaleFormat.E4M3_GLOBAL, group=(1, 16))
INT8_DYNAMIC_TOKEN = QuantKey(_INT8, _R)
# weights
FP8_TENSOR = QuantKey(_FP8, _T)
FP8_CHANNEL = QuantKey(_FP8, _R)
FP8_BLOCK128 = QuantKey(_FP8, _B, group=(128, 128))
MXFP4 = QuantKey(_FP4, _G, ScaleFormat.E8M0, group=(1, 32))
INT8_CHANNEL = QuantKey(_INT8, _R)
#: the group sizes along K of the int4 / int8 weight-only schemes (GPTQ / AWQ use these)
WEIGHT_ONLY_GROUPS = (32, 64, 128)
INT4_GROUP128 = QuantKey(_INT4, _G, group=(1, 128))


def int_weight_key(element: ElementFormat, group_size: int | None) -> QuantKey:
    """The key of int4 / int8 weight-only weights: group scales of 1 x group_size along K, or
    (int8, group_size None) one scale per output channel."""
    if group_size is None:
        if element is ElementFormat.INT4:
            raise ValueError(f"int4 weights need a group size, one of {WEIGHT_ONLY_GROUPS}")
        return INT8_CHANNEL
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size not in WEIGHT_ONLY_GROUPS:
        raise ValueError(f"group_size must be one of {WEIGHT_ONLY_GROUPS}, got {group_size}")
    return QuantKey(element, _G, group=(1, group_size))
