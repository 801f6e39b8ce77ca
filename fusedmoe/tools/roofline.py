"""The roofline floor of one MoE expert computation, as in ../shared/PERFORMANCE.md.

Legend: M tokens, k top-k, H hidden, I intermediate, E experts, D distinct experts that the
routing touches (the only ones whose weights must be read).

    bytes  = D * 3 * H * I * weight_bytes            w13 [D, 2I, H] and w2 [D, H, I]
           + scale_bytes                             FP8 128 x 128 blocks (float32):
                                                       D * 4 * (ceil(2I/128) * ceil(H/128)
                                                              + ceil(H/128) * ceil(I/128))
           + 2 * M * H * act_bytes                   x read, output written
    flops  = 2 * M * k * 3 * H * I                   GEMM1 is 2I x H, GEMM2 is H x I per slot
    floor  = max(bytes / HBM bandwidth, flops / matrix peak)   (the FP8 peak for FP8 weights)

Report a timing as floor / time (percent of the roofline). Plain arithmetic: no GPU, no Triton.

`moe_floor` is the whole sum for one weight format (every scheme of fusedmoe.quant and the
unquantized dtypes): its bytes per weight value and scale bytes (`weight_bytes`), and which
matmul peak bounds it (`uses_fp8_peak`: 8-bit or narrower activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "H100",
    "H200",
    "Ceilings",
    "MoEFloor",
    "ceilings_for",
    "distinct_experts",
    "floor_seconds",
    "fp8_block_scale_bytes",
    "moe_bytes",
    "moe_floor",
    "moe_flops",
    "scale_bytes",
    "uses_fp8_peak",
    "weight_bytes",
]


@dataclass(frozen=True)
class Ceilings:
    """What one GPU can do at best: the two roofs of the floor."""

    hbm_gbps: float  # HBM read bandwidth, GB/s (1e9 bytes)
    bf16_tflops: float  # dense bf16 matmul peak, TFLOP/s
    fp8_tflops: float  # dense fp8 e4m3 matmul peak, TFLOP/s
    name: str


# Measured on the lent H200 (PERFORMANCE.md), HBM from the datasheet.
H200 = Ceilings(hbm_gbps=4800.0, bf16_tflops=779.0, fp8_tflops=1410.0, name="NVIDIA H200")
# Approximate: HBM3 3.35 TB/s from the H100 SXM datasheet; bf16 800 TFLOP/s as measured on the
# lent H100 (8192^3), well under the datasheet's 989 dense; fp8 taken as twice that, not measured.
H100 = Ceilings(hbm_gbps=3350.0, bf16_tflops=800.0, fp8_tflops=1600.0, name="NVIDIA H100")


def ceilings_for(device_name: str) -> Ceilings:
    """The ceilings of a GPU named like torch.cuda.get_device_name() ("NVIDIA H200", ...)."""
    upper = device_name.upper()
    for ceilings, tag in ((H200, "H200"), (H100, "H100")):
        if tag in upper:
            return ceilings
    raise ValueError(
        f"no known ceilings for device {device_name!r} (known: H200, H100); "
        "pass Ceilings(hbm_gbps=..., bf16_tflops=..., fp8_tflops=..., name=...) explicitly"
    )


def distinct_experts(topk_ids: torch.Tensor, num_experts: int) -> int:
    """D: how many distinct experts in [0, num_experts) the routing [M, k] touches (-1 skipped)."""
    ids = topk_ids.flatten()
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return int(ids.unique().numel())


def fp8_block_scale_bytes(
    num_experts: int, hidden_size: int, intermediate_size: int, block: int = 128
) -> float:
    """Float32 scales of FP8 block-quantized w13 [D, 2I, H] and w2 [D, H, I]."""
    h_blocks = math.ceil(hidden_size / block)
    w13_cells = math.ceil(2 * intermediate_size / block) * h_blocks
    w2_cells = h_blocks * math.ceil(intermediate_size / block)
    return float(num_experts * 4 * (w13_cells + w2_cells))


def moe_bytes(
    num_distinct: int,
    num_tokens: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    weight_bytes: float,
    act_bytes: float,
    scale_bytes: float = 0.0,
) -> float:
    """Bytes that must cross HBM at least: the touched experts' weights, x in, output out.

    top_k does not change the floor's bytes (the per-slot intermediates can stay on chip); it is
    taken so that moe_bytes and moe_flops read alike.
    """
    del top_k
    weights = num_distinct * 3 * hidden_size * intermediate_size * weight_bytes
    activations = num_tokens * hidden_size * act_bytes * 2
    return float(weights + scale_bytes + activations)


def moe_flops(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int) -> float:
    """2 * M * k * 3 * H * I: GEMM1 (2I x H) and GEMM2 (H x I) for each of the M * k slots."""
    return 2.0 * num_tokens * top_k * 3 * hidden_size * intermediate_size


def floor_seconds(num_bytes: float, flops: float, ceilings: Ceilings, fp8: bool) -> float:
    """max(bytes / HBM bandwidth, flops / matmul peak): no implementation can beat it."""
    peak_tflops = ceilings.fp8_tflops if fp8 else ceilings.bf16_tflops
    return max(num_bytes / (ceilings.hbm_gbps * 1e9), flops / (peak_tflops * 1e12))


# ---------------------------------------------------------------------------------------------
# one weight format: bytes per value, scale bytes, which peak

#: unquantized formats: bytes per value
_PLAIN_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0}
#: quantized schemes: bytes per weight value (4-bit formats pack two values a byte)
_SCHEME_BYTES = {
    "fp8_tensor": 1.0,
    "fp8_channel": 1.0,
    "fp8_block": 1.0,
    "mxfp8": 1.0,
    "mxfp4_w4a8": 0.5,
    "mxfp4_w4a16": 0.5,
    "nvfp4": 0.5,
    "nvfp4_w4a16": 0.5,
    "int8": 1.0,
    "int4_w4a16": 0.5,
    "int8_w8a16": 1.0,
}
#: schemes whose activations stay 16-bit: their GEMMs run at the bf16 peak
_A16_SCHEMES = frozenset({"mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16", "int8_w8a16"})


def _check_format(quant: str) -> str:
    if quant not in _PLAIN_BYTES and quant not in _SCHEME_BYTES:
        known = [*_PLAIN_BYTES, *_SCHEME_BYTES]
        raise ValueError(f"unknown weight format {quant!r}; expected one of {known}")
    return quant


def weight_bytes(quant: str) -> float:
    """Bytes of one weight value: 2 for bf16, 1 for FP8 / INT8, 0.5 for FP4, ..."""
    quant = _check_format(quant)
    return _PLAIN_BYTES.get(quant) or _SCHEME_BYTES[quant]


def uses_fp8_peak(quant: str) -> bool:
    """Whether the GEMMs run on 8-bit (or narrower) operands: the FP8 matmul peak bounds them.

    INT8 and the 4-bit formats with 8- or 4-bit activations are given the FP8 peak too (Hopper's
    INT8 peak equals its FP8 one and it has no FP4 tensor cores); fp32 is given the bf16 peak.
    """
    return _check_format(quant) in _SCHEME_BYTES and quant not in _A16_SCHEMES


def scale_bytes(
    quant: str, num_distinct: int, hidden_size: int, intermediate_size: int, gemm1_rows: int
) -> float:
    """Bytes of the weight scales of D experts: w13 [D, N1, H] and w2 [D, H, I], N1 = gemm1_rows.

    fp8_tensor             float32 per expert and tensor          D * 4 * 2
    fp8_channel, int8,     float32 per output row                 D * 4 * (N1 + H)
    int8_w8a16 (default)
    fp8_block              float32 per 128 x 128 block            (fp8_block_scale_bytes)
    mxfp8, mxfp4_*         one E8M0 byte per 32 values along K    D * (N1 H + H I) / 32
    nvfp4, nvfp4_w4a16     one E4M3 byte per 16 values, plus a     D * (N1 H + H I) / 16
                           float32 global scale per tensor           + D * 4 * 2
    int4_w4a16             float32 per 128 values (the default     D * (N1 H + H I) / 32
                           group; zero points, if any, not counted)
    """
    quant = _check_format(quant)
    d, h, i, n1 = num_distinct, hidden_size, intermediate_size, gemm1_rows
    values = d * (n1 * h + h * i)
    if quant == "fp8_tensor":
        return float(d * 4 * 2)
    if quant in ("fp8_channel", "int8", "int8_w8a16"):
        return float(d * 4 * (n1 + h))
    if quant == "fp8_block":
        h_blocks = math.ceil(h / 128)
        return float(d * 4 * (math.ceil(n1 / 128) * h_blocks + h_blocks * math.ceil(i / 128)))
    if quant in ("mxfp8", "mxfp4_w4a8", "mxfp4_w4a16"):
        return values / 32
    if quant in ("nvfp4", "nvfp4_w4a16"):
        return values / 16 + d * 4 * 2
    if quant == "int4_w4a16":
        return values * 4 / 128
    return 0.0


@dataclass(frozen=True)
class MoEFloor:
    """The floor of one MoE expert computation and the two sums it is the larger of."""

    num_bytes: float  # weights of the D touched experts + their scales + x in and out
    flops: float  # 2 * M * k * (N1 + I) * H
    seconds: float  # max(num_bytes / HBM, flops / peak)


def moe_floor(
    quant: str,
    *,
    num_distinct: int,
    num_tokens: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    ceilings: Ceilings,
    gated: bool = True,
    act_bytes: float = 2.0,
) -> MoEFloor:
    """The floor for weights in format `quant` (a scheme, or "bf16" / "fp16" / "fp32").

    gated: w13 has 2I rows per expert (I for a non-gated activation), so the weights are
    3 * H * I values per expert gated and 2 * H * I otherwise; act_bytes: of x and the output.
    """
    h, i = hidden_size, intermediate_size
    n1 = 2 * i if gated else i
    weights = num_distinct * (n1 + i) * h * weight_bytes(quant)
    scales = scale_bytes(quant, num_distinct, h, i, n1)
    num_bytes = float(weights + scales + 2 * num_tokens * h * act_bytes)
    flops = 2.0 * num_tokens * top_k * (n1 + i) * h
    seconds = floor_seconds(num_bytes, flops, ceilings, uses_fp8_peak(quant))
    return MoEFloor(num_bytes, flops, seconds)
