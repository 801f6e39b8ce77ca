"""Two plain-PyTorch MoE expert computations that `fusedmoe bench` measures beside the backends.

Both take what a backend takes once the routing is known, and return out [M, H]:

    grouped_mm   what a PyTorch user writes today on Hopper: sort the M*k slots by expert,
                 gather x, torch._grouped_mm (GEMM1), activation, torch._grouped_mm (GEMM2),
                 times the router weight, un-permute, sum the k slots. No host synchronisation,
                 so it captures in a CUDA graph.
    eager        a per-expert Python loop, as Hugging Face's eager MoE blocks do it: one-hot
                 mask, the experts that got tokens, and for each of them gather, GEMM1,
                 activation, GEMM2, weight, index_add. It reads which experts were hit on the
                 host, so it is timed by plain launches, never in a CUDA graph.

Legend: M tokens, k top-k, S = M * k slots, E experts, H hidden, I intermediate, N = 2I gated.
Both run in the weights' dtype (bf16 throughout for SiLU, as a plain PyTorch layer does; other
activations through fusedmoe.apply_activation in float32, then back); topk_ids in [0, E).
`grouped_gemm(..., loop=True)` is the twin of torch._grouped_mm (one matmul per expert), used
where torch._grouped_mm does not run (`grouped_mm_unavailable` says why).

grouped_mm_experts is differentiable (every op is out of place or an autograd-aware index
copy): under autograd it is what transformers' "grouped_mm" experts implementation runs when
training, gradients to x, the weights, their biases and topk_weights included. torch._grouped_mm
has a backward on Hopper; `grouped_mm_backward_unavailable` probes, at run time, where it has
none (the CPU of some torch builds), and the loop twin differentiates there.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fusedmoe.activation import MoEActivation, apply_activation

__all__ = [
    "eager_experts",
    "grouped_gemm",
    "grouped_mm_backward_unavailable",
    "grouped_mm_experts",
    "grouped_mm_unavailable",
]


def _activation(h: torch.Tensor, activation: MoEActivation | str) -> torch.Tensor:
    """act(h) in h's dtype: SiLU(gate) * up in that dtype, others in float32 and back."""
    if MoEActivation.parse(activation) is MoEActivation.SILU:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return apply_activation(activation, h).to(h.dtype)


def grouped_gemm(
    a_sorted: torch.Tensor, w: torch.Tensor, expert_ends: torch.Tensor, loop: bool = False
) -> torch.Tensor:
    """Rows of expert e times w[e].T: a_sorted [S, K] (sorted by expert), w [E, N, K] -> [S, N].

    expert_ends int32 [E]: rows expert_ends[e-1] : expert_ends[e] belong to expert e.
    torch._grouped_mm(mat_a [S, K], mat_b [E, K, N], offs=[E] int32) wants 16-byte aligned
    strides; w.transpose(-2, -1) is the column-major [E, K, N] view it reads fastest.
    loop=True is the twin: one matmul per expert (it reads the ends on the host).
    """
    if not loop:
        return torch._grouped_mm(a_sorted, w.transpose(-2, -1), offs=expert_ends)
    out = a_sorted.new_empty(a_sorted.shape[0], w.shape[1])
    start = 0
    for expert, end in enumerate(expert_ends.tolist()):
        if end > start:
            out[start:end] = a_sorted[start:end] @ w[expert].t()
        start = end
    return out


def grouped_mm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: MoEActivation | str = "silu",
    loop: bool = False,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts around torch._grouped_mm. x [M, H], w13 [E, N, H], w2 [E, H, I] -> [M, H].

    order        = argsort(topk_ids.flatten())          [S] slots sorted by expert
    expert_ends  = #slots with id <= e, for each e      [E] int32
    h            = grouped_mm(x[order // k], w13)       [S, N]   (+ w13_bias [E, N] per row)
    a            = act(h)                               [S, I]
    y            = grouped_mm(a, w2) * topk_weights     [S, H], in sorted order (+ w2_bias [E, H]
                                                                 per row, before the weight)
    out[m]       = sum_j y[slot (m, j)]                 [M, H]
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)  # [S], [S] int64
    # searchsorted, not bincount + cumsum: bincount reads max(ids) on the host, which a CUDA
    # graph cannot capture
    experts = torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype)
    expert_ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # [E]
    x_sorted = x.index_select(0, order // top_k)  # [S, H]
    h = grouped_gemm(x_sorted, w13, expert_ends, loop)  # [S, N]
    if w13_bias is not None:
        h = h + w13_bias.index_select(0, sorted_ids)
    a = _activation(h, activation)  # [S, I]
    y = grouped_gemm(a, w2, expert_ends, loop)  # [S, H]
    if w2_bias is not None:
        y = y + w2_bias.index_select(0, sorted_ids)
    y = y * topk_weights.flatten()[order].to(y.dtype).unsqueeze(1)
    y_slots = torch.empty_like(y).index_copy_(0, order, y)  # back to slot order (m, j)
    return y_slots.view(num_tokens, top_k, -1).sum(dim=1)


def eager_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: MoEActivation | str = "silu",
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts as Hugging Face's eager MoE blocks compute them. x [M, H] -> [M, H].

    mask[e, j, m] = topk_ids[m, j] == e                 [E, k, M]
    for e with any token:
        j, m   = where(mask[e])                          the slots routed to e
        y      = (act(x[m] @ w13[e].T + b13[e]) @ w2[e].T + b2[e]) * topk_weights[m, j]
        out[m] += y                                      (index_add, in x's dtype)
    """
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)
    mask = F.one_hot(topk_ids.long(), num_classes=num_experts).permute(2, 1, 0)  # [E, k, M]
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for expert in hit:
        slot, token = torch.where(mask[expert])
        h = x[token] @ w13[expert].t()  # [c, N]
        if w13_bias is not None:
            h = h + w13_bias[expert]
        y = _activation(h, activation) @ w2[expert].t()  # [c, H]
        if w2_bias is not None:
            y = y + w2_bias[expert]
        y = y * topk_weights[token, slot, None].to(y.dtype)
        out.index_add_(0, token, y.to(x.dtype))
    return out


@functools.lru_cache(maxsize=16)
def _probe(device_type: str, index: int | None, dtype: torch.dtype, backward: bool) -> str | None:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    a = torch.ones(4, 32, dtype=dtype, device=device, requires_grad=backward)
    w = torch.ones(2, 16, 32, dtype=dtype, device=device, requires_grad=backward)
    ends = torch.tensor([2, 4], dtype=torch.int32, device=device)
    try:
        out = torch._grouped_mm(a, w.transpose(-2, -1), offs=ends)
        if backward:
            torch.autograd.grad(out, (a, w), torch.ones_like(out))
    except (RuntimeError, AttributeError, NotImplementedError, TypeError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    return None


def grouped_mm_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when torch._grouped_mm runs on `device` with `dtype` operands, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    return _probe(device.type, device.index, dtype, False)


def grouped_mm_backward_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when torch._grouped_mm runs forward and backward on `device` with `dtype`
    operands (gradients to both), else why not."""
    why = grouped_mm_unavailable(device, dtype)
    if why is not None:
        return why
    why = _probe(device.type, device.index, dtype, True)
    return None if why is None else f"no backward: {why}"
