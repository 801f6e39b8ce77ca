"""The FusedMoE layer's expert tensors: made, randomly initialised, and viewed as backends take
them.

    w13_weight [E_l, N, H], w2_weight [E_l, H, I] (+ w13_bias [E_l, N], w2_bias [E_l, H])
    -> ExpertWeights, zero-padded along H where a backend needs H to be a multiple of its
       alignment

Legend: E_l this rank's experts, H hidden, I intermediate (padded: padded_intermediate_size),
N = 2I for a gated activation, else I.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fusedmoe.modular.types import ExpertWeights


def as_buffer(t: torch.Tensor | None, device) -> torch.Tensor | None:
    """A caller's tensor (e_score_correction_bias, hash_indices_table) as the layer's own: a
    detached copy, on `device` when one is given."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return t.detach().clone().to(device) if device is not None else t.detach().clone()


def create_experts(layer, has_bias: bool, dtype: torch.dtype, device) -> None:
    """The layer's expert parameters, allocated (reset_experts fills them): w13_weight
    [E_l, N, H], w2_weight [E_l, H, I], and with has_bias w13_bias [E_l, N], w2_bias [E_l, H]
    (else registered as None)."""
    factory = {"dtype": dtype, "device": device}
    num_local, hidden, inter = layer.local_num_experts, layer.hidden_size, layer.intermediate_size
    num_n = layer.activation.kind.gemm1_out_size(inter)
    layer.w13_weight = nn.Parameter(torch.empty(num_local, num_n, hidden, **factory))
    layer.w2_weight = nn.Parameter(torch.empty(num_local, hidden, inter, **factory))
    layer.has_bias = has_bias
    if has_bias:
        layer.w13_bias = nn.Parameter(torch.empty(num_local, num_n, **factory))
        layer.w2_bias = nn.Parameter(torch.empty(num_local, hidden, **factory))
    else:
        layer.register_parameter("w13_bias", None)
        layer.register_parameter("w2_bias", None)


def expert_params(layer) -> tuple[torch.Tensor, ...]:
    """The layer's expert weights and biases (those it has)."""
    params = (layer.w13_weight, layer.w2_weight, layer.w13_bias, layer.w2_bias)
    return tuple(p for p in params if p is not None)


@torch.no_grad()
def reset_experts(layer) -> None:
    """FusedMoE.reset_parameters: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as nn.Linear does."""
    if layer.quant_scheme is not None:
        raise ValueError("reset_parameters: the layer is quantized; build a new layer")
    for param, fan_in in (
        (layer.w13_weight, layer.hidden_size),
        (layer.w2_weight, layer.intermediate_size),
        (layer.w13_bias, layer.hidden_size),
        (layer.w2_bias, layer.intermediate_size),
    ):
        if param is not None:
            bound = 1.0 / math.sqrt(fan_in)
            param.uniform_(-bound, bound)


def expert_weights(layer, alignment: int) -> ExpertWeights:
    """The weights as the backend consumes them.

    When the backend needs H to be a multiple of `alignment`, zero-padded copies are made on
    every call: correct whatever wrote the parameters (in place, through .data), at the cost
    of a copy. Backends built for speed keep alignment 1 and lay out their own weights.
    """
    pad = -layer.hidden_size % alignment
    packing = 2 if layer.w13_weight.dtype == torch.uint8 else 1  # packed FP4
    if pad == 0:
        return ExpertWeights(
            layer.w13_weight, layer.w2_weight, layer.w13_bias, layer.w2_bias, k_packing=packing
        )
    if layer.quant_scheme is not None:
        raise ValueError(
            f"the backend needs hidden_size % {alignment} == 0; quantized weights "
            f"({layer.quant_scheme}) are not padded here"
        )
    return ExpertWeights(
        w13=nn.functional.pad(layer.w13_weight, (0, pad)),
        w2=nn.functional.pad(layer.w2_weight, (0, 0, 0, pad)),
        w13_bias=layer.w13_bias,
        w2_bias=None if layer.w2_bias is None else nn.functional.pad(layer.w2_bias, (0, pad)),
    )
