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
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fusedmoe.activation import MoEActivation

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

    param: str  # "w13_weight", "w2_weight", "w13_bias", "w2_bias"
    index: tuple  # index into the parameter
    shape: tuple[int, ...]  # the shape the tensor must have


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
        return WeightTarget(param, (expert, rows), shape)

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
