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
    "ceilings_for",
    "distinct_experts",
    "floor_seconds",
    "fp8_block_scale_bytes",
    "moe_bytes",
    "moe_flops",
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
