"""The inputs of one benchmark row: expert weights in each format, and a routing.

Every contender of a row gets the same inputs; the same (shape, routing, M) gets the same
inputs in every run (generators seeded from a hash of their names).

Weights: w13 [E, N, H] and w2 [E, H, I] drawn N(0, 1 / fan_in) in the activation dtype, in
place (no float32 copy of the whole: deepseek-v3's bf16 experts are 22 GB); for a shape with
expert biases (gpt-oss), w13_bias [E, N] and w2_bias [E, H] drawn N(0, 1), never quantized.
A scheme's weights are quantized a few experts at a time (quantize makes several float32
temporaries), and the baselines, which only run 16-bit GEMMs, read the dequantized values back
in the activation dtype: every contender computes the same function.

Routing: logits [M, E] ~ N(0, 1) (uniform: every expert equally popular), or skewed (a few
experts take most tokens, as real routers do). The skew law:

    popularity(r) ~ 1 / r ** SKEW_EXPONENT        r = 1 .. E, the rank of an expert, over a
                                                  random ranking (experts shuffled)
    logits[:, e]  += strength * log(popularity(rank(e)))
                   = -strength * SKEW_EXPONENT * log(rank(e))     (+ a constant)

"skewed" is strength SKEW_STRENGTH = 3 (the law of the skewed-routing issue: at E = 256, k = 8
the most popular expert is in every token's top 8, 32x its uniform share, and ~15 to 22 experts
take all the slots from M = 64 to 4096); "skewed:<s>" another strength
(s = 1 is the milder law of the earlier benchmarks, bias -1.2 log r; 0 is uniform with a
shuffle). Then topk = softmax, top-k, renormalize (fusedmoe's plain TopKRouter). The logits are
kept for backends that route inside: they route them to the same ids. Every draw is seeded from
the routing's name, the shape and M: the same inputs in every run.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from fusedmoe.activation import MoEActivation
from fusedmoe.quant import dequantize, make_quant_config, quantize_experts
from fusedmoe.quant.config import INT_WEIGHT_ONLY, FusedMoEQuantConfig
from fusedmoe.quant.keys import WEIGHT_ONLY_GROUPS
from fusedmoe.router import create_router

__all__ = [
    "ROUTINGS",
    "ExpertSet",
    "RoutingInputs",
    "make_expert_biases",
    "make_expert_weights",
    "make_routing",
    "quantize_expert_set",
    "seeded",
    "skew_bias",
    "skew_strength",
]

ROUTINGS = ("uniform", "skewed")
SKEW_EXPONENT = 1.2
SKEW_STRENGTH = 3.0
# elements of one float32 copy of a chunk of experts while (de)quantizing
_CHUNK_ELEMENTS = 1 << 28


def seeded(device: torch.device, *key: object) -> torch.Generator:
    """A generator seeded by `key`: the same numbers in every run and for every contender."""
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32("/".join(map(str, key)).encode()))
    return gen


@dataclass
class ExpertSet:
    """The experts of one row, in the format the backends read and as the baselines read them."""

    w13: torch.Tensor  # [E, N, H] (FP4: [E, N, H/2] uint8), the scheme's storage dtype
    w2: torch.Tensor  # [E, H, I] (FP4: [E, H, I/2])
    quant_config: FusedMoEQuantConfig | None  # None: unquantized
    w13_plain: torch.Tensor | None  # [E, N, H] the values of w13 in the activation dtype
    w2_plain: torch.Tensor | None  # [E, H, I]
    w13_bias: torch.Tensor | None = None  # [E, N] in the activation dtype (every contender's)
    w2_bias: torch.Tensor | None = None  # [E, H]


def make_expert_weights(
    name: str,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    activation: str,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, N, H] and w2 [E, H, I] in `dtype`, N(0, 1 / fan_in), drawn in place."""
    e, h, i = num_experts, hidden_size, intermediate_size
    n = MoEActivation.parse(activation).gemm1_out_size(i)
    gen = seeded(device, name, e, h, i, "weights")
    w13 = torch.empty(e, n, h, dtype=dtype, device=device).normal_(0.0, h**-0.5, generator=gen)
    w2 = torch.empty(e, h, i, dtype=dtype, device=device).normal_(0.0, i**-0.5, generator=gen)
    return w13, w2


def make_expert_biases(name: str, w13: torch.Tensor, w2: torch.Tensor):
    """(w13_bias [E, N], w2_bias [E, H]) for the experts w13 [E, N, H], w2 [E, H, I], in their
    dtype and on their device, N(0, 1): as large as h's and y's values, so that a contender
    that drops one is far off the reference."""
    (e, n, h), i = w13.shape, w2.shape[2]
    gen = seeded(w13.device, name, e, h, i, "biases")
    b13 = torch.empty(e, n, dtype=w13.dtype, device=w13.device).normal_(generator=gen)
    b2 = torch.empty(e, h, dtype=w13.dtype, device=w13.device).normal_(generator=gen)
    return b13, b2


def _chunks(w13: torch.Tensor, w2: torch.Tensor) -> list[slice]:
    per_expert = (w13[0].numel() + w2[0].numel()) * 4  # quantize holds several fp32 copies
    step = max(1, _CHUNK_ELEMENTS // max(per_expert, 1))
    return [slice(s, s + step) for s in range(0, w13.shape[0], step)]


def quantize_expert_set(
    w13: torch.Tensor,
    w2: torch.Tensor,
    scheme: str | None,
    *,
    with_plain: bool = True,
    fast_accum: bool = False,
) -> ExpertSet:
    """The experts in `scheme` (None: as they are), quantized a few experts at a time (int4_w4a16:
    in the widest group of 32 / 64 / 128 that divides both K; the key's name says which), with the
    dequantized values for the baselines (with_plain=False: w13_plain and w2_plain are None);
    fast_accum: that of the quant config (fp8_block)."""
    if scheme is None:
        return ExpertSet(w13, w2, None, w13, w2)
    options = {}
    if scheme == "int4_w4a16":  # the widest group that divides both K (gpt-oss's 2880: 64)
        fits = [g for g in WEIGHT_ONLY_GROUPS if w13.shape[-1] % g == 0 and w2.shape[-1] % g == 0]
        if not fits:
            raise ValueError(
                f"int4_w4a16 needs H = {w13.shape[-1]} and I = {w2.shape[-1]} to be multiples of "
                f"one of the groups {WEIGHT_ONLY_GROUPS}"
            )
        options["group_size"] = max(fits)
    parts = [quantize_experts(w13[c], w2[c], scheme, **options) for c in _chunks(w13, w2)]
    q13 = torch.cat([p[0] for p in parts])
    q2 = torch.cat([p[1] for p in parts])

    configs = [p[2] for p in parts]
    del parts

    def cat(values: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if values[0] is None else torch.cat(values)

    group = configs[0].w1.key.group
    int_group = {"group_size": None if group is None else group[1]}
    config = make_quant_config(
        scheme,
        cat([qc.w1.scale for qc in configs]),
        cat([qc.w2.scale for qc in configs]),
        w1_global_scale=cat([qc.w1.global_scale for qc in configs]),
        w2_global_scale=cat([qc.w2.global_scale for qc in configs]),
        w1_zero_point=cat([qc.w1.zero_point for qc in configs]),
        w2_zero_point=cat([qc.w2.zero_point for qc in configs]),
        fast_accum=fast_accum,
        **(int_group if scheme in INT_WEIGHT_ONLY else {}),
    )
    plain13 = torch.empty_like(w13)
    plain2 = torch.empty_like(w2)
    for c in _chunks(w13, w2):
        for out, q, operand in ((plain13, q13, config.w1), (plain2, q2, config.w2)):
            g = None if operand.global_scale is None else operand.global_scale[c]
            z = None if operand.zero_point is None else operand.zero_point[c]
            out[c] = dequantize(q[c], operand.scale[c], operand.key, g, z).to(out.dtype)
    return ExpertSet(q13, q2, config, plain13, plain2)


@dataclass
class RoutingInputs:
    """One row's tokens and routing."""

    x: torch.Tensor  # [M, H] activation dtype
    router_logits: torch.Tensor  # float32 [M, E]
    topk_weights: torch.Tensor  # float32 [M, k], rows sum to 1
    topk_ids: torch.Tensor  # int32 [M, k]


def skew_strength(kind: str) -> float | None:
    """The strength of a routing name: None for "uniform", SKEW_STRENGTH for "skewed", s for
    "skewed:<s>" (a finite s >= 0); a ValueError for anything else."""
    if kind == "uniform":
        return None
    if kind == "skewed":
        return SKEW_STRENGTH
    base, _, value = kind.partition(":")
    try:
        strength = float(value) if base == "skewed" else math.nan
    except ValueError:
        strength = math.nan
    if not (math.isfinite(strength) and strength >= 0):
        raise ValueError(
            f"routing must be 'uniform', 'skewed' or 'skewed:<strength >= 0>', got {kind!r}"
        )
    return strength


def skew_bias(
    num_experts: int, strength: float, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """float32 [E]: strength * log(popularity) of each expert, popularity ~ 1 / rank**1.2 over
    a random ranking drawn from `gen` (the module docstring's law)."""
    rank = torch.randperm(num_experts, device=device, generator=gen).float() + 1.0
    return -strength * SKEW_EXPONENT * torch.log(rank)


def make_routing(
    name: str,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    kind: str,
    dtype: torch.dtype,
    device: torch.device,
) -> RoutingInputs:
    """x and a `kind` routing ("uniform", "skewed" or "skewed:<strength>") of M tokens over E
    experts."""
    strength = skew_strength(kind)
    gen = seeded(device, name, kind, num_tokens, num_experts, hidden_size)
    x = torch.randn(num_tokens, hidden_size, device=device, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, num_experts, device=device, generator=gen)
    if strength is not None:
        logits = logits + skew_bias(num_experts, strength, gen, device)
    router = create_router(top_k, num_experts, renormalize=True, scoring_func="softmax")
    topk_weights, topk_ids = router.select_experts(x, logits)
    return RoutingInputs(x, logits, topk_weights, topk_ids)
