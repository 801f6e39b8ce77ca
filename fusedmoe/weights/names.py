"""Checkpoint names -> slices of the FusedMoE parameters.

Accepted names (any prefix before `experts.` is ignored, e = expert index):
    experts.{e}.gate_proj.weight  [I, H]   experts.{e}.w1.weight   (Mixtral)     -> w13[e] gate rows
    experts.{e}.up_proj.weight    [I, H]   experts.{e}.w3.weight                 -> w13[e] up rows
    experts.{e}.down_proj.weight  [H, I]   experts.{e}.w2.weight                 -> w2[e]
    (the same with .bias: [I], [I], [H] -> w13_bias / w2_bias)
    experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]   (transformers 5, fused)
    experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]
Gate rows are [0, I) and up rows [I, 2I), or alternate for the interleaved SWIGLUOAI.
Non-gated activations (w13 [E, I, H]) take up_proj / w1 for w13 and refuse gate_proj / w3.
GPTQ / AWQ tensors (experts.{e}.*.qweight / qzeros / scales / g_idx): fusedmoe.weights.gptq_awq.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusedmoe.activation import MoEActivation
from fusedmoe.quant.keys import ElementFormat, ScaleFormat, ScaleLayout

_PER_EXPERT = re.compile(
    r"(?:^|\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|bias)$"
)
_FUSED = re.compile(r"(?:^|\.)experts\.(gate_up_proj|down_proj)(_bias)?$")

_ROLE = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes."""

    #: "w13_weight", "w2_bias", "w13_weight_scale", ...; None: the tensor is checked (by
    #: convert) and not stored (a GPTQ g_idx, the qzeros of a symmetric layer)
    param: str | None
    index: tuple  # index into the parameter
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have (reshaped into the slot)
    exact_dtype: bool = False  # quantized data: copied bit for bit, never cast
    #: which rows of a w13 tensor the slot covers: "gate" or "up" (one projection of a gated
    #: activation), or None for the whole expert (w2, non-gated w13, fused names)
    part: str | None = None
    #: checkpoint layout -> the slot's (GPTQ / AWQ packed tensors, fusedmoe.weights.gptq_awq):
    #: checks the tensor (ValueError / TypeError naming it) and returns it of `shape`
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None


def resolve_expert_weight(
    name: str,
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    activation: MoEActivation,
) -> WeightTarget | None:
    """The target of a checkpoint tensor, or None when the name is not an expert weight."""
    num_i, num_h = intermediate_size, hidden_size
    match = _PER_EXPERT.search(name)
    if match is not None:
        expert, role, kind = int(match.group(1)), _ROLE[match.group(2)], match.group(3)
        if expert >= num_experts:
            raise ValueError(f"{name}: expert {expert} out of range (the layer has {num_experts})")
        is_bias = kind == "bias"
        if role == "down":
            return WeightTarget(
                "w2_bias" if is_bias else "w2_weight",
                (expert,),
                (num_h,) if is_bias else (num_h, num_i),
            )
        param = "w13_bias" if is_bias else "w13_weight"
        shape = (num_i,) if is_bias else (num_i, num_h)
        if not activation.is_gated:
            # one projection before the activation: up_proj, or w1 in Mixtral naming
            if match.group(2) in ("gate_proj", "w3"):
                raise ValueError(
                    f"{name}: the non-gated activation {activation.value!r} has one projection "
                    "before the activation (up_proj or w1), no gate_proj / w3"
                )
            return WeightTarget(param, (expert,), shape)
        if activation is MoEActivation.SWIGLUOAI:  # gate and up rows alternate
            rows = slice(0, 2 * num_i, 2) if role == "gate" else slice(1, 2 * num_i, 2)
        else:
            rows = slice(0, num_i) if role == "gate" else slice(num_i, 2 * num_i)
        return WeightTarget(param, (expert, rows), shape, part=role)

    match = _FUSED.search(name)
    if match is not None:
        is_bias = match.group(2) is not None
        num_n = activation.gemm1_out_size(num_i)
        if match.group(1) == "gate_up_proj":
            shape = (num_experts, num_n) if is_bias else (num_experts, num_n, num_h)
            return WeightTarget("w13_bias" if is_bias else "w13_weight", (), shape)
        shape = (num_experts, num_h) if is_bias else (num_experts, num_h, num_i)
        return WeightTarget("w2_bias" if is_bias else "w2_weight", (), shape)
    return None


# ---- quantized checkpoints -------------------------------------------------------------------
# gpt-oss MXFP4:   experts.gate_up_proj_blocks [E, N, H/32, 16] uint8 (loaded as is: [E, N, H/2])
#                  experts.gate_up_proj_scales [E, N, H/32] uint8 E8M0; the same for down_proj
# fused:           experts.gate_up_proj / down_proj (quantized dtype), + _scale, + _global_scale
#                  (NVFP4), + _zero_point (INT4 with zero points; 4-bit: [E, N, K/2] packed)
# per expert:      experts.{e}.gate_proj.weight (fp8 / int8) + .weight_scale_inv or .weight_scale
#                  (DeepSeek-V3 FP8 block, per-channel FP8 / INT8); gate and up scale rows must
#                  not share a block (I % 128 == 0 for 128-row blocks)
_GPT_OSS = re.compile(r"(?:^|\.)experts\.(gate_up_proj|down_proj)_(blocks|scales)$")
_FUSED_QUANT = re.compile(
    r"(?:^|\.)experts\.(gate_up_proj|down_proj)(_scale|_global_scale|_zero_point)?$"
)
_PER_EXPERT_QUANT = re.compile(
    r"(?:^|\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\."
    r"(weight|weight_scale_inv|weight_scale)$"
)


def resolve_quantized_weight(
    name: str,
    *,
    scheme: str,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    activation: MoEActivation,
    group_size: int | str | None = "default",
    zero_points: bool = False,
) -> WeightTarget | None:
    """The target of a quantized checkpoint tensor in a layer quantized to `scheme` (int4 /
    int8 weight-only: with the layer's group size, and zero points if it has them)."""
    from fusedmoe.quant.config import expected_scale_shape, weight_key

    key = weight_key(scheme, group_size)
    packing = 2 if key.packed else 1
    num_e, num_h, num_i = num_experts, hidden_size, intermediate_size
    num_n = activation.gemm1_out_size(num_i)
    # (param prefix, rows, K) of each fused operand
    operand = {"gate_up_proj": ("w13", num_n, num_h), "down_proj": ("w2", num_h, num_i)}

    match = _GPT_OSS.search(name)
    if match is not None:
        if key.element is not ElementFormat.FP4 or key.scale_format is not ScaleFormat.E8M0:
            raise ValueError(
                f"{name}: *_blocks / *_scales are MXFP4 tensors; the layer is {scheme}"
            )
        prefix, rows, k = operand[match.group(1)]
        if match.group(2) == "blocks":
            return WeightTarget(
                f"{prefix}_weight", (), (num_e, rows, k // 32, 16), exact_dtype=True
            )
        return WeightTarget(f"{prefix}_weight_scale", (), (num_e, rows, k // 32), exact_dtype=True)

    match = _FUSED_QUANT.search(name)
    if match is not None:
        prefix, rows, k = operand[match.group(1)]
        suffix = match.group(2)
        if suffix is None:
            return WeightTarget(
                f"{prefix}_weight", (), (num_e, rows, k // packing), exact_dtype=True
            )
        if suffix == "_scale":
            shape = expected_scale_shape(key, num_e, rows, k)
            return WeightTarget(f"{prefix}_weight_scale", (), shape, exact_dtype=_exact_scales(key))
        if suffix == "_zero_point":
            if not zero_points:
                raise ValueError(
                    f"{name}: the layer ({scheme}) has no zero points: build it with "
                    'quant_options={"zero_points": True} for asymmetric int4 weights'
                )
            shape = expected_scale_shape(key, num_e, rows, k)
            return WeightTarget(f"{prefix}_weight_zero_point", (), shape, exact_dtype=True)
        if key.scale_format is not ScaleFormat.E4M3_GLOBAL:
            raise ValueError(
                f"{name}: only NVFP4 weights have a global scale; the layer is {scheme}"
            )
        return WeightTarget(f"{prefix}_weight_global_scale", (), (num_e,))

    match = _PER_EXPERT_QUANT.search(name)
    if match is None:
        return None
    expert, role, kind = int(match.group(1)), _ROLE[match.group(2)], match.group(3)
    if expert >= num_e:
        raise ValueError(f"{name}: expert {expert} out of range (the layer has {num_e})")
    if (
        key.layout not in (ScaleLayout.ROW, ScaleLayout.BLOCK)
        or activation is MoEActivation.SWIGLUOAI
    ):
        raise ValueError(
            f"{name}: per-expert {scheme} checkpoints are not supported (gate and up would need "
            "one shared scale); load the fused names, or float weights and then quantize_"
        )
    if role == "gate" and not activation.is_gated:
        raise ValueError(f"{name}: the non-gated activation {activation.value!r} has no gate")
    part = role if role != "down" and activation.is_gated else None
    if role == "down":
        param, rows, k, row0 = "w2", num_h, num_i, 0
    else:
        param, rows, k = "w13", num_i, num_h
        row0 = num_i if role == "up" and activation.is_gated else 0
    if kind == "weight":
        return WeightTarget(f"{param}_weight", (expert, slice(row0, row0 + rows)), (rows, k),
                            exact_dtype=True, part=part)  # fmt: skip
    if key.layout is ScaleLayout.ROW:
        return WeightTarget(
            f"{param}_weight_scale", (expert, slice(row0, row0 + rows)), (rows,), part=part
        )
    block_rows, block_k = key.group
    if row0 % block_rows or (param == "w13" and activation.is_gated and rows % block_rows):
        raise ValueError(
            f"{name}: gate and up rows share a {block_rows}-row scale block "
            f"(intermediate_size {num_i} is not a multiple of {block_rows})"
        )
    scale_rows = math.ceil(rows / block_rows)
    start = row0 // block_rows
    shape = (scale_rows, math.ceil(k / block_k))
    index = (expert, slice(start, start + scale_rows))
    return WeightTarget(f"{param}_weight_scale", index, shape, part=part)


def _exact_scales(key) -> bool:
    """E8M0 and e4m3 scales are copied bit for bit; float32 scales accept any float."""
    return key.scale_format in (ScaleFormat.E8M0, ScaleFormat.E4M3_GLOBAL)
