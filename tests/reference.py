"""Independent float64 references for the MoE tests: activations, routing, experts.

Written from the spec, not from fusedmoe: explicit formulas and plain loops over tokens and
slots, all in float64. Nothing here imports the package.

Legend: M tokens, H hidden, I intermediate, N = 2I (gated) or I, E experts, k top-k.
"""

from __future__ import annotations

import math

import torch

GATED = ("silu", "gelu", "gelu_tanh", "swigluoai", "swigluoai_uninterleave", "swiglustep")
NON_GATED = ("silu_no_mul", "gelu_no_mul", "relu2_no_mul")
ALL_ACTIVATIONS = GATED + NON_GATED


def sigmoid64(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu64(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid64(x)


def gelu_erf64(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def activation_ref(
    name: str,
    h: torch.Tensor,
    *,
    alpha: float | None = None,
    beta: float | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """h [..., N] -> float64 [..., N/2] (gated) or [..., N] (non-gated), from the spec."""
    h = h.double()
    if name == "swigluoai":
        g, u = h[..., 0::2], h[..., 1::2]
    elif name in GATED:
        half = h.shape[-1] // 2
        g, u = h[..., :half], h[..., half:]
    if name == "silu":
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return silu64(g) * u
    if name == "gelu":
        return gelu_erf64(g) * u
    if name == "gelu_tanh":
        return gelu_tanh64(g) * u
    if name in ("swigluoai", "swigluoai_uninterleave"):
        alpha = 1.702 if alpha is None else alpha
        offset = 1.0 if name == "swigluoai" or beta is None else beta
        limit = 7.0 if limit is None else limit
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (u + offset) * g * sigmoid64(alpha * g)
    if name == "swiglustep":
        limit = 7.0 if limit is None else limit
        return silu64(g).clamp(max=limit) * u.clamp(-limit, limit)
    if name == "silu_no_mul":
        return silu64(h)
    if name == "gelu_no_mul":
        return gelu_erf64(h)
    if name == "relu2_no_mul":
        return h.clamp(min=0.0) ** 2
    raise AssertionError(f"no reference for {name}")


def experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    params: dict | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """out[m] = sum_j w[m, j] * (act(x[m] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]), float64.

    Slots with id -1, or whose expert_map entry is -1, contribute nothing. With
    weight_on_input the weight scales x[m] instead of the expert's output.
    """
    params = params or {}
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float64)
    for m in range(num_tokens):
        for j in range(top_k):
            e = int(topk_ids[m, j])
            if e < 0:
                continue
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            w = float(topk_weights[m, j])
            xm = x[m].double() * (w if weight_on_input else 1.0)
            h = w13[e].double() @ xm
            if w13_bias is not None:
                h = h + w13_bias[e].double()
            a = activation_ref(activation, h, **params)
            y = w2[e].double() @ a
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[m] += y if weight_on_input else w * y
    return out


def _with_experts(fn, x, experts: dict, weights, ids, **kwargs) -> torch.Tensor:
    return fn(
        x,
        experts["w13"],
        experts["w2"],
        weights,
        ids,
        w13_bias=experts["w13_bias"],
        w2_bias=experts["w2_bias"],
        **kwargs,
    )


def run_fused_experts(x, experts: dict, weights, ids, **kwargs) -> torch.Tensor:
    """fusedmoe.fused_experts with the weights of a random_experts dict."""
    from fusedmoe import fused_experts

    return _with_experts(fused_experts, x, experts, weights, ids, **kwargs)


def reference(x, experts: dict, weights, ids, **kwargs) -> torch.Tensor:
    """experts_ref with the weights of a random_experts dict."""
    return _with_experts(experts_ref, x, experts, weights, ids, **kwargs)


def softmax_topk_ref(
    logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring: str = "softmax",
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token routing in float64: (weights [M, k], ids int64 [M, k])."""
    num_tokens, num_experts = logits.shape
    weights = torch.zeros(num_tokens, top_k, dtype=torch.float64)
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int64)
    for m in range(num_tokens):
        row = [float(v) for v in logits[m]]
        if scoring == "softmax":
            peak = max(row)
            exps = [math.exp(v - peak) for v in row]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        chosen = sorted(range(num_experts), key=lambda e, s=scores: -s[e])[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights[m] = torch.tensor([v * scale for v in w], dtype=torch.float64)
        ids[m] = torch.tensor(chosen)
    return weights, ids


def random_experts(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    activation: str = "silu",
    *,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    gain: float = 3.0,
) -> dict[str, torch.Tensor | None]:
    """Fresh random expert weights: h = x @ w13.T has std ~ gain, enough to hit the clamps."""
    gemm1_out = intermediate_size if activation in NON_GATED else 2 * intermediate_size
    w13 = torch.randn(num_experts, gemm1_out, hidden_size) * (gain / math.sqrt(hidden_size))
    w2 = torch.randn(num_experts, hidden_size, intermediate_size) / math.sqrt(intermediate_size)
    b13 = torch.randn(num_experts, gemm1_out) if bias else None
    b2 = torch.randn(num_experts, hidden_size) if bias else None

    def cast(t):
        return None if t is None else t.to(dtype)

    return {"w13": cast(w13), "w2": cast(w2), "w13_bias": cast(b13), "w2_bias": cast(b2)}
