"""Fused routing: router logits -> (topk_weights, topk_ids) in one launch per router kind.

Legend: M tokens, E experts, k top-k, G expert groups of S = E / G experts, BM rows per program.
The torch twins, which are the spec, are fusedmoe.router.topk.topk_route (plain top-k, with or
without a correction bias) and fusedmoe.router.grouped.grouped_topk (DeepSeek grouped top-k):

    scores  = score(logits)                           # [M, E] float32 (softmax / sigmoid / ...)
    choice  = scores + bias; -inf where logit == -inf # the bias only changes the choice
    (grouped)  group_score = top-2 sum (bias) or max (no bias) of choice per group   # [M, G]
               keep the topk_group best groups; choice = -inf outside them
    ids     = topk(choice, k)                         # int32 [M, k], descending choice
    weights = scores[ids], / sum if renormalize, * routed_scaling_factor     # float32 [M, k]

The kernel: each program loads BM rows as a [BM, G, S] tile (E padded to powers of two G_PAD x
S_PAD; plain top-k is G = 1), computes the scores in float32 and takes the top k in k rounds of
(the largest choice among the experts not yet taken, the smallest expert id attaining it), as
torch.topk orders them. NaN choices compare above everything (as in torch.topk); a round that
finds no expert equal to the maximum (NaN rows, on hardware whose max drops NaN) takes the
smallest expert not yet taken, so ids are always distinct and in [0, E) and the expert kernels
downstream never read out of bounds. Groups are kept the same way, in topk_group rounds.
Rows with NaN or with fewer than k finite logits get NaN or zero weights, as in the twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedmoe._checks import check_positive_int, check_shape, check_tensor
from fusedmoe._pdl import pdl_args, pdl_start
from fusedmoe._triton import cdiv, device_guard, launch, next_power_of_2, op_or_impl, triton_runs_on
from fusedmoe.router.base import ScoringFunc
from fusedmoe.router.checks import check_groups, check_scaling_factor

__all__ = ["FUSED_ROUTING_DTYPES", "RoutingKernelConfig", "fused_grouped_topk", "fused_topk"]

#: logit dtypes the kernels take (float64 stays on the torch path: the reference backend's)
FUSED_ROUTING_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Compile-time codes of the scoring functions (Triton kernels only read constexpr globals).
_SOFTMAX, _SIGMOID, _SQRTSOFTPLUS = (tl.constexpr(i) for i in range(3))
_SCORING_CODE = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
_SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's F.softplus default: x above it is returned


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sum_experts(x):
    """[BM, G_PAD, S_PAD] -> [BM]"""
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _scores(x, valid, SCORING: tl.constexpr):
    """logits x fp32 [BM, G_PAD, S_PAD] (-inf on padding lanes) -> scores fp32, torch's formulas.
    Padding lanes score 0 (exp(-inf) = 0), so they drop out of the softmax sum. Divisions and
    the square root are rounded as IEEE (torch's); a GPU's exp is ex2.approx, within ~2 ulps
    plus the rounding of x * log2(e)."""
    if SCORING == _SOFTMAX:
        row_max = tl.max(tl.max(x, axis=2), axis=1)  # [BM]
        e = tl.exp(x - row_max[:, None, None])
        e = tl.where(valid, e, 0.0)
        return tl.math.div_rn(e, _sum_experts(e)[:, None, None])
    if SCORING == _SIGMOID:
        return tl.math.div_rn(1.0, 1.0 + tl.exp(-x))
    # sqrt(softplus(x)), softplus(x) = x above the threshold, else log1p(exp(x)); log1p(y) as
    # log(1 + y) * y / ((1 + y) - 1), exact to a few ulps where 1 + y rounds (Goldberg)
    y = tl.exp(tl.where(x > _SOFTPLUS_THRESHOLD, 0.0, x))  # not tl.minimum: it drops NaN
    u = 1.0 + y
    exact = u == 1.0
    log1p = tl.where(exact, y, tl.log(u) * tl.math.div_rn(y, tl.where(exact, 1.0, u - 1.0)))
    return tl.sqrt_rn(tl.where(x > _SOFTPLUS_THRESHOLD, x, log1p))


@triton.jit
def _largest(key, available, lane, NO_LANE: tl.constexpr):
    """key fp32 [BM, A, B] without NaN, available bool, lane int32 ids (< NO_LANE) -> [BM] lane
    ids: the largest key among the available lanes, the smallest lane id on ties; the smallest
    available lane if no key equals the maximum (a max that drops NaN); NO_LANE if none is
    available. One min-reduction ranks the lanes: hits (lane), other available lanes
    (NO_LANE + lane), the rest (2 * NO_LANE)."""
    masked = tl.where(available, key, float("-inf"))
    best = tl.max(tl.max(masked, axis=2), axis=1)  # [BM]
    hit = available & (masked == best[:, None, None])
    rank = tl.where(hit, lane, tl.where(available, NO_LANE + lane, 2 * NO_LANE))
    pick = tl.min(tl.min(rank, axis=2), axis=1)
    return tl.where(pick >= NO_LANE, pick - NO_LANE, pick)


@triton.jit
def _nan_to_inf(x):
    """NaN -> +inf: torch.topk ranks NaN above every number."""
    return tl.where(x != x, float("inf"), x)


@triton.jit
def _kept_groups(
    key, valid, num_groups, topk_group,
    TOP2: tl.constexpr, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr,
):  # fmt: skip
    """key [BM, G_PAD, S_PAD] (-inf on padding lanes) -> bool [BM, G_PAD]: the topk_group
    groups of largest score, the max of the group (TOP2 False) or the sum of its top two."""
    member = tl.arange(0, S_PAD)[None, None, :]
    group_max = tl.max(key, axis=2)  # [BM, G_PAD]
    group_score = group_max
    if TOP2:
        # take out one lane holding the max (the first), so that a repeated max counts twice
        at_max = valid & (key == group_max[:, :, None])
        first = tl.min(tl.where(at_max, member, S_PAD), axis=2)  # [BM, G_PAD]
        rest = tl.where(member == first[:, :, None], float("-inf"), key)
        group_score = _nan_to_inf(group_max + tl.max(rest, axis=2))  # inf + -inf is NaN
    group = tl.arange(0, G_PAD)
    available = tl.broadcast_to((group < num_groups)[None, :, None], (BLOCK_M, G_PAD, 1))
    kept = tl.zeros((BLOCK_M, G_PAD), dtype=tl.int1)
    for _ in range(topk_group):
        pick = _largest(group_score[:, :, None], available, group[None, :, None], G_PAD)  # [BM]
        taken = group[None, :] == pick[:, None]  # [BM, G_PAD]
        kept = kept | taken
        available = available & ~taken[:, :, None]
    return kept


@triton.jit
def _route_kernel(
    logits_ptr, stride_lm, stride_le,  # [M, E] bf16 / fp16 / fp32
    bias_ptr, stride_b,  # [E] float, read only if HAS_BIAS
    weights_ptr, stride_wm, stride_wk,  # [M, k] fp32
    ids_ptr, stride_im, stride_ik,  # [M, k] int32
    M, top_k, num_groups, group_size, topk_group, routed_scaling_factor,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    TOP2_GROUP_SCORE: tl.constexpr,  # group score = sum of the top two (bias and S >= 2)
    RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    G_PAD: tl.constexpr,  # next power of two >= G (1 for plain top-k)
    S_PAD: tl.constexpr,  # next power of two >= S
    K_PAD: tl.constexpr,  # next power of two >= k
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < M
    rows = rows.to(tl.int64)
    group = tl.arange(0, G_PAD)[:, None]
    member = tl.arange(0, S_PAD)[None, :]
    expert = group * group_size + member  # [G_PAD, S_PAD]; padding lanes alias real ids
    valid = ((group < num_groups) & (member < group_size))[None, :, :]  # [1, G_PAD, S_PAD]
    expert = expert[None, :, :]

    # rows past M load zeros (finite): they are computed and never stored
    x = tl.load(
        logits_ptr + rows[:, None, None] * stride_lm + expert * stride_le,
        mask=row_ok[:, None, None] & valid,
        other=0.0,
    ).to(tl.float32)
    x = tl.where(valid, x, float("-inf"))  # [BM, G_PAD, S_PAD]
    scores = _scores(x, valid, SCORING)
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_b, mask=valid, other=0.0).to(tl.float32)
        choice = scores + bias
    # a -inf logit is never chosen while k finite experts remain (router/base.py)
    key = tl.where(x == float("-inf"), float("-inf"), _nan_to_inf(choice))
    available = tl.broadcast_to(valid, (BLOCK_M, G_PAD, S_PAD))  # experts not yet taken
    if GROUPED:
        kept = _kept_groups(
            key, valid, num_groups, topk_group, TOP2_GROUP_SCORE, BLOCK_M, G_PAD, S_PAD
        )
        available = available & kept[:, :, None]

    slot = tl.arange(0, K_PAD)[None, :]  # [1, K_PAD]
    out_ids = tl.zeros((BLOCK_M, K_PAD), dtype=tl.int32)
    out_weights = tl.zeros((BLOCK_M, K_PAD), dtype=tl.float32)
    for j in range(top_k):
        pick = _largest(key, available, expert, G_PAD * S_PAD)  # [BM]
        at_pick = valid & (expert == pick[:, None, None])
        weight = _sum_experts(tl.where(at_pick, scores, 0.0))  # the unbiased score
        out_ids = tl.where(slot == j, pick[:, None], out_ids)
        out_weights = tl.where(slot == j, weight[:, None], out_weights)
        available = available & ~at_pick

    if RENORMALIZE:
        out_weights = tl.math.div_rn(out_weights, tl.sum(out_weights, axis=1)[:, None])
    out_weights = out_weights * routed_scaling_factor
    out_mask = row_ok[:, None] & (slot < top_k)
    tl.store(weights_ptr + rows[:, None] * stride_wm + slot * stride_wk, out_weights, mask=out_mask)
    tl.store(ids_ptr + rows[:, None] * stride_im + slot * stride_ik, out_ids, mask=out_mask)


# ---------------------------------------------------------------------------------------------
# launch configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingKernelConfig:
    block_m: int  # rows per program (a power of two)
    num_warps: int


#: On a GPU, from this many (padded) experts a row is one program of one warp: its reductions
#: stay a warp's shuffles, and rows do not wait for each other (H200, deepseek-v3's grouped
#: routing at 4096 tokens: 15.6 us against 25.0 in 4 rows of 4 warps; docs/performance.md)
_GPU_ROW_PROGRAM_EXPERTS = 128
_GPU_TILE = 128  # logits per program on a GPU below that: one per thread at 4 warps
_INTERPRETER_TILE = 1 << 14  # the CPU interpreter: cost per program and op, not per element


def routing_kernel_config(
    num_tokens: int, padded_experts: int, on_gpu: bool
) -> RoutingKernelConfig:
    """BM rows of G_PAD * S_PAD logits per program: on a GPU one row in one warp from
    _GPU_ROW_PROGRAM_EXPERTS experts, else rows of about _GPU_TILE logits; on the interpreter
    as many rows as fit _INTERPRETER_TILE (few programs)."""
    if on_gpu and padded_experts >= _GPU_ROW_PROGRAM_EXPERTS:
        return RoutingKernelConfig(block_m=1, num_warps=1)
    tile = _GPU_TILE if on_gpu else _INTERPRETER_TILE
    block_m = min(next_power_of_2(max(num_tokens, 1)), max(1, tile // padded_experts))
    per_warp = 32 if on_gpu else 256  # logits a warp
    num_warps = max(1, min(4, block_m * padded_experts // per_warp))
    return RoutingKernelConfig(block_m=block_m, num_warps=num_warps)


# ---------------------------------------------------------------------------------------------
# launcher and custom ops
# ---------------------------------------------------------------------------------------------
def _alloc_outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [M, k], ids int32 [M, k])"""
    num_tokens = logits.shape[0]
    weights = logits.new_empty((num_tokens, top_k), dtype=torch.float32)
    ids = logits.new_empty((num_tokens, top_k), dtype=torch.int32)
    return weights, ids


def _launch(
    logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    scoring: str,
    renormalize: bool,
    bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = _alloc_outputs(logits, top_k)
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        return weights, ids
    group_size = num_experts // num_groups
    g_pad, s_pad = next_power_of_2(num_groups), next_power_of_2(group_size)
    cfg = routing_kernel_config(num_tokens, g_pad * s_pad, logits.is_cuda)
    with device_guard(logits):
        args = (
            logits, logits.stride(0), logits.stride(1),
            logits if bias is None else bias,  # unread without a bias
            0 if bias is None else bias.stride(0),
            weights, weights.stride(0), weights.stride(1),
            ids, ids.stride(0), ids.stride(1),
            num_tokens, top_k, num_groups, group_size, topk_group, routed_scaling_factor,
        )  # fmt: skip
        constexprs = dict(
            SCORING=_SCORING_CODE[scoring],
            HAS_BIAS=bias is not None,
            GROUPED=topk_group < num_groups,  # all groups kept: plain top-k
            TOP2_GROUP_SCORE=bias is not None and group_size >= 2,  # top min(2, S) with a bias
            RENORMALIZE=renormalize,
            BLOCK_M=cfg.block_m,
            G_PAD=g_pad,
            S_PAD=s_pad,
            K_PAD=next_power_of_2(top_k),
            num_warps=cfg.num_warps,
            **pdl_args(logits),
        )
        launch(
            _route_kernel, (cdiv(num_tokens, cfg.block_m),), args, constexprs,
            logits.is_cuda,
        )  # fmt: skip
    return weights, ids


def _fused_topk_impl(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(
        logits, top_k, 1, 1, scoring, renormalize, e_score_correction_bias, routed_scaling_factor
    )


_fused_topk_op = torch.library.custom_op("fusedmoe::fused_topk", mutates_args=())(_fused_topk_impl)


@_fused_topk_op.register_fake
def _(logits, top_k, scoring, renormalize, e_score_correction_bias, routed_scaling_factor):
    return _alloc_outputs(logits, top_k)


def _fused_grouped_topk_impl(
    logits: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    scoring: str,
    renormalize: bool,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(
        logits, top_k, num_expert_group, topk_group, scoring, renormalize,
        e_score_correction_bias, routed_scaling_factor,
    )  # fmt: skip


_fused_grouped_topk_op = torch.library.custom_op("fusedmoe::fused_grouped_topk", mutates_args=())(
    _fused_grouped_topk_impl
)


@_fused_grouped_topk_op.register_fake
def _(logits, top_k, num_expert_group, topk_group, scoring, renormalize, e_score_correction_bias,
      routed_scaling_factor):  # fmt: skip
    return _alloc_outputs(logits, top_k)


# ---------------------------------------------------------------------------------------------
# public entry points: checks (shapes and dtypes only, no value reads), then the op
# ---------------------------------------------------------------------------------------------
def _check_common(
    logits: object,
    top_k: object,
    renormalize: object,
    bias: object,
    routed_scaling_factor: object,
) -> torch.Tensor:
    x = check_tensor("logits", logits, ndim=2, dtypes=FUSED_ROUTING_DTYPES)
    if not triton_runs_on(x):
        raise ValueError(
            f"logits are on {x.device}: the routing kernels need a CUDA tensor "
            "(or a CPU tensor under TRITON_INTERPRET=1)"
        )
    check_positive_int("top_k", top_k)
    if top_k > x.shape[1]:
        raise ValueError(f"top_k ({top_k}) must be <= the number of experts ({x.shape[1]})")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if bias is not None:
        check_tensor("e_score_correction_bias", bias, ndim=1, dtypes=_BIAS_DTYPES, device=x.device)
        check_shape("e_score_correction_bias", bias, (x.shape[1],))
    check_scaling_factor(routed_scaling_factor)
    return x


def fused_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: ScoringFunc | str = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> (weights float32 [M, k], ids int32 [M, k]) in one launch.

    The semantics of fusedmoe.router.topk.topk_route (its twin): ids = topk(score(logits) +
    bias, k), a -inf logit never chosen while k finite ones remain; weights = the unbiased
    scores of ids, renormalized if asked, times routed_scaling_factor.
    """
    scoring = ScoringFunc.parse(scoring)
    _check_common(logits, top_k, renormalize, e_score_correction_bias, routed_scaling_factor)
    return op_or_impl(_fused_topk_op, _fused_topk_impl)(
        logits, top_k, scoring.value, renormalize, e_score_correction_bias,
        float(routed_scaling_factor),
    )  # fmt: skip


def fused_grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    *,
    scoring: ScoringFunc | str = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> (weights float32 [M, k], ids int32 [M, k]) in one launch.

    The semantics of fusedmoe.router.grouped.grouped_topk (its twin): G = num_expert_group
    groups of E / G experts; group score = the sum of the top two choices of the group with a
    bias, its max without; the topk_group best groups kept; then top-k inside them as fused_topk.
    """
    scoring = ScoringFunc.parse(scoring)
    x = _check_common(logits, top_k, renormalize, e_score_correction_bias, routed_scaling_factor)
    check_groups(x.shape[1], top_k, num_expert_group, topk_group)
    return op_or_impl(_fused_grouped_topk_op, _fused_grouped_topk_impl)(
        logits, top_k, num_expert_group, topk_group, scoring.value, renormalize,
        e_score_correction_bias, float(routed_scaling_factor),
    )  # fmt: skip
