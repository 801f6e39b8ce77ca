"""The MoE activations: one enum, one exact definition each.

Legend: h is the output of GEMM1 for one (token, expert) pair, [..., N].
For a gated activation N = 2 * I and the result is [..., I]; g is the gate half, u the up half:

    SILU                    silu(g) * u
                            with limit L: silu(min(g, L)) * clamp(u, -L, L)
    GELU                    gelu_erf(g) * u
    GELU_TANH               gelu_tanh(g) * u
    SWIGLUOAI               gpt-oss, gate and up interleaved: g = h[..., 0::2], u = h[..., 1::2]
                            g = min(g, limit); u = clamp(u, -limit, limit)
                            (u + 1) * g * sigmoid(alpha * g)         alpha 1.702, limit 7
    SWIGLUOAI_UNINTERLEAVE  the same on halves, with beta in place of the + 1:
                            (u + beta) * g * sigmoid(alpha * g)      defaults 1.702, 1, 7
    SWIGLUSTEP              min(silu(g), limit) * clamp(u, -limit, limit)   limit 7

Non-gated activations keep the width (w13 is [E, I, H]):

    SILU_NO_MUL   silu(h)      GELU_NO_MUL   gelu_erf(h)      RELU2_NO_MUL   relu(h) ** 2

`apply_activation` is the torch twin of every fused activation kernel: it computes in float32
(float64 for float64 input) and returns that; callers round to their storage dtype.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusedmoe._checks import parse_enum

__all__ = ["ActivationParams", "MoEActivation", "apply_activation"]


class MoEActivation(enum.Enum):
    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    SWIGLUOAI = "swigluoai"
    SWIGLUOAI_UNINTERLEAVE = "swigluoai_uninterleave"
    SWIGLUSTEP = "swiglustep"
    SILU_NO_MUL = "silu_no_mul"
    GELU_NO_MUL = "gelu_no_mul"
    RELU2_NO_MUL = "relu2_no_mul"

    @classmethod
    def parse(cls, value: MoEActivation | str) -> MoEActivation:
        return parse_enum(cls, value, "activation")

    @property
    def is_gated(self) -> bool:
        return self not in _NON_GATED

    def output_size(self, gemm1_out: int) -> int:
        """Width of the activation output for a GEMM1 output of width `gemm1_out`."""
        return gemm1_out // 2 if self.is_gated else gemm1_out

    def gemm1_out_size(self, intermediate_size: int) -> int:
        """Rows of w13 per expert: 2 * I when gated, I otherwise."""
        return 2 * intermediate_size if self.is_gated else intermediate_size


_NON_GATED = frozenset(
    {MoEActivation.SILU_NO_MUL, MoEActivation.GELU_NO_MUL, MoEActivation.RELU2_NO_MUL}
)


@dataclass(frozen=True)
class ActivationParams:
    """Optional parameters of the clamped / gpt-oss activations. None means the default.

    alpha: sigmoid slope of SWIGLUOAI*            (default 1.702)
    beta:  offset added to u in SWIGLUOAI_UNINTERLEAVE (default 1.0; SWIGLUOAI is always 1)
    limit: clamp limit of SILU (default: no clamp), SWIGLUOAI* and SWIGLUSTEP (default 7.0)
    """

    alpha: float | None = None
    beta: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "limit"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"ActivationParams.{name} must be a finite number, got {value!r}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"ActivationParams.limit must be > 0, got {self.limit}")

    def check_for(self, activation: MoEActivation) -> None:
        """Refuse parameters that the activation does not take, rather than ignore them."""
        takes = _TAKES.get(activation, frozenset())
        for name in ("alpha", "beta", "limit"):
            if getattr(self, name) is not None and name not in takes:
                raise ValueError(f"activation {activation.value!r} takes no {name} parameter")


_TAKES = {
    MoEActivation.SILU: frozenset({"limit"}),
    MoEActivation.SWIGLUOAI: frozenset({"alpha", "limit"}),
    MoEActivation.SWIGLUOAI_UNINTERLEAVE: frozenset({"alpha", "beta", "limit"}),
    MoEActivation.SWIGLUSTEP: frozenset({"limit"}),
}

OAI_ALPHA = 1.702
OAI_LIMIT = 7.0
STEP_LIMIT = 7.0


def apply_activation(
    activation: MoEActivation | str,
    h: torch.Tensor,
    params: ActivationParams | None = None,
) -> torch.Tensor:
    """The exact definition of every activation. h [..., N] -> [..., N/2 or N], float32 or wider."""
    act = MoEActivation.parse(activation)
    if params is not None and not isinstance(params, ActivationParams):
        raise TypeError(f"params must be an ActivationParams, got {type(params).__name__}")
    p = params or ActivationParams()
    p.check_for(act)
    h = h.to(torch.promote_types(h.dtype, torch.float32))
    if act.is_gated and h.shape[-1] % 2 != 0:
        raise ValueError(f"gated activation {act.value!r} needs an even width, got {h.shape[-1]}")
    if act is MoEActivation.SWIGLUOAI:
        g, u = h[..., 0::2], h[..., 1::2]
    elif act.is_gated:
        g, u = h.chunk(2, dim=-1)

    if act is MoEActivation.SILU:
        if p.limit is not None:
            g = g.clamp(max=p.limit)
            u = u.clamp(-p.limit, p.limit)
        return F.silu(g) * u
    if act is MoEActivation.GELU:
        return F.gelu(g) * u
    if act is MoEActivation.GELU_TANH:
        return F.gelu(g, approximate="tanh") * u
    if act in (MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUOAI_UNINTERLEAVE):
        alpha = OAI_ALPHA if p.alpha is None else p.alpha
        beta = 1.0 if p.beta is None else p.beta
        limit = OAI_LIMIT if p.limit is None else p.limit
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
        return (u + beta) * g * torch.sigmoid(alpha * g)
    if act is MoEActivation.SWIGLUSTEP:
        limit = STEP_LIMIT if p.limit is None else p.limit
        return F.silu(g).clamp(max=limit) * u.clamp(-limit, limit)
    if act is MoEActivation.SILU_NO_MUL:
        return F.silu(h)
    if act is MoEActivation.GELU_NO_MUL:
        return F.gelu(h)
    if act is MoEActivation.RELU2_NO_MUL:
        return F.relu(h).square()
    raise AssertionError(f"unhandled activation {act}")
