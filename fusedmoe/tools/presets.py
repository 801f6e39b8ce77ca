"""MoE shapes and routing of real models, for the demo and the benchmarks.

Shapes as in ../shared/PERFORMANCE.md; routing as each model's own MoE block does it.
`scaled(factor)` shrinks hidden and intermediate sizes (experts, top-k and routing stay) so a
CPU run finishes in seconds; they stay multiples of 32, as the MX and NVFP4 formats need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from fusedmoe.layer import FusedMoE


@dataclass(frozen=True)
class MoEPreset:
    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    has_bias: bool = False
    #: FusedMoE router keywords (bias tensors are made by `build`)
    routing: dict = field(default_factory=dict)
    #: whether the router has a DeepSeek-style e_score_correction_bias
    correction_bias: bool = False
    scale: int = 1  # hidden and intermediate sizes were divided by this

    def scaled(self, factor: int) -> MoEPreset:
        if factor == 1:
            return self
        return dataclasses.replace(
            self,
            hidden_size=_round_up(self.hidden_size // factor, 32),
            intermediate_size=_round_up(self.intermediate_size // factor, 32),
            scale=self.scale * factor,
        )

    @property
    def label(self) -> str:
        return self.name if self.scale == 1 else f"{self.name} (H, I / {self.scale})"

    def build(self, *, dtype: torch.dtype, device: torch.device | str, **kwargs) -> FusedMoE:
        """A FusedMoE layer of this shape and routing, with random weights."""
        routing = dict(self.routing)
        if self.correction_bias:
            routing["e_score_correction_bias"] = 0.1 * torch.randn(self.num_experts)
        return FusedMoE(
            self.num_experts,
            self.top_k,
            self.hidden_size,
            self.intermediate_size,
            activation=self.activation,
            has_bias=self.has_bias,
            params_dtype=dtype,
            device=device,
            **routing,
            **kwargs,
        )


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


PRESETS: dict[str, MoEPreset] = {
    p.name: p
    for p in (
        MoEPreset("mixtral-8x7b", 8, 2, 4096, 14336),
        MoEPreset("qwen3-30b-a3b", 128, 8, 2048, 768),
        MoEPreset("qwen3-235b-a22b", 128, 8, 4096, 1536),
        MoEPreset(
            "deepseek-v3",
            256,
            8,
            7168,
            2048,
            routing=dict(
                scoring_func="sigmoid",
                use_grouped_topk=True,
                num_expert_group=8,
                topk_group=4,
                routed_scaling_factor=2.5,
            ),
            correction_bias=True,
        ),
        # gpt-oss routes by softmax over the top-k logits: the same as softmax + renormalize
        MoEPreset("gpt-oss-120b", 128, 4, 2880, 2880, activation="swigluoai", has_bias=True),
    )
}


def get_preset(name: str) -> MoEPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {list(PRESETS)}") from None
