"""Training through the triton backend: the experts' forward that autograd records, and its
backward, as GPU kernels. Under torch.compile: two torch.library custom ops
(`fusedmoe::experts_train_fwd`, its backward `fusedmoe::experts_train_bwd`) joined by
register_autograd, so the graph holds one op with its backward. In eager mode: an
autograd.Function over the same implementations (the dispatcher's round trip cost about 0.25 ms
a call on the lent GPU's host).

Legend: M tokens, k top-k, S = M * k slots (slot s: token t(s) = s // k, local expert e(s),
router weight w_s), E_l local experts, H hidden, N_w rows of w13 per expert (2I gated, I
otherwise), I the activation width.

Forward (the slots aligned into 128-row blocks per expert for large calls, as inference does;
the per-slot buffers h, a, g, dh are kept in expert order, S rows without padding: row r(s)):
    h[r(s)]  = x[t(s)] @ w13[e(s)].T + b13[e(s)]              GEMM1 -> [S, N_w]   (saved)
    a[r(s)]  = act(h[r(s)])                                    act kernel -> [S, I]
    y[s]     = (a[r(s)] @ w2[e(s)].T + b2[e(s)]) * w_s         GEMM2 -> [S, H]
    out[t]   = sum over the slots of t routed here of y[s]     moe_sum -> [M, H]

Backward, from dout [M, H]:
    g[r(s)]  = dout[t(s)] @ w2[e(s)]                           dgrad GEMM (w2 read transposed)
    dw_s     = <a[r(s)], g[r(s)]> + <b2[e(s)], dout[t(s)]>      = <y[s] / w_s, dout[t(s)]>
    dh[r(s)] = act'(h[r(s)]) * (w_s * g[r(s)])                 act kernel, which also writes
                                                               w_s * a over g
    dw2[e]   = sum_{s of e} dout[t(s)].T (w_s * a[r(s)])        weight gradient -> [E_l, H, I]
    db2[e]   = sum_{s of e} w_s * dout[t(s)]                    wgrad kernel, one column
    dx[t]    = sum_j dh[r(s)] @ w13[e(s)]                      dgrad GEMM (w13 transposed) + sum
    dw13[e]  = sum_{s of e} dh[r(s)].T x[t(s)]                  weight gradient -> [E_l, N_w, H]
    db13[e]  = sum_{s of e} dh[r(s)]                            wgrad kernel, one column

Expert order is what the weight gradients want: each expert's rows are one run. Where
torch._grouped_mm runs (bf16 on an sm90 GPU), dw2 and dw13 are one K-grouped GEMM each over
dout and x gathered into the same order (two [S, H] buffers, one at a time, freed at once):
CUTLASS's grouped GEMMs were 1.1x to 1.7x our kernel on an H100. Elsewhere (fp16, fp32, other
GPUs) the Triton wgrad kernel runs: one program per (expert, 128 x 128 tile of dW), reducing
over the expert's run of the aligned layout 64 rows a step, its run's bounds read from a
table made once per backward, the other operand gathered by token. The router weight is folded
into w * a by the act kernel, and the bias gradients are one-column weight gradients (right
operand w or 1) rather than sums in every tile. The GEMMs and kernels find a slot's row from a
per-position map of the aligned layout (a cumulative count of its slots); the layout's padding
never reaches the buffers.

What the forward saves, and why: h [S, N_w], the one value the backward could only get back by
redoing GEMM1, and the slot alignment (a few int32 per slot; recomputing it cost launches on
the host). a is recomputed from h (one elementwise pass, which act' makes anyway), and y is
never needed: dw_s only asks for <y[s] / w_s, dout>, which the identity above takes from a and
g. So a recorded call keeps S * N_w elements alive (plus its inputs), where a torch pipeline
keeps the gathered x, h, a and y. The backward frees each of its buffers (g / w * a, the
per-slot dx, the gathered operands) as soon as it is consumed, and in eager mode writes dh over
h, whose last reader is the act kernel that makes dh (a torch pipeline's activation node frees
what it saved at that point; one node cannot, so it reuses the memory). The price: no second
backward through the same graph (retain_graph=True), which autograd's saved-tensor check
refuses.

Slots not routed to this rank (expert_map -1, ids out of range) are skipped everywhere: they
are not in the aligned layout, so they have no row in expert order (the buffers' last rows,
as many as such slots, are never written nor read), and their dw_s is 0. With
apply_router_weight_on_input (mul_routed_weight False) the weight was applied to x before this
op (prepare), so autograd differentiates that multiply and this op returns no dw.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedmoe._triton import cdiv, device_guard, launch, next_power_of_2
from fusedmoe.activation import MoEActivation
from fusedmoe.kernels import moe_gemm as g
from fusedmoe.kernels.fused_moe import (
    TL_DTYPE,
    GemmRows,
    GemmVariant,
    device_name,
    launch_gemm,
    moe_sum,
)
from fusedmoe.kernels.moe_align import AlignedRouting, aligned_sizes, moe_align_block_size
from fusedmoe.kernels.moe_config import moe_kernel_config
from fusedmoe.quant.kernels import ACTIVATION_CODE

__all__ = ["TRAIN_DTYPES", "experts_train"]

#: activation dtypes that train on the GPU kernels
TRAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_CODES = {
    **ACTIVATION_CODE,
    MoEActivation.GELU_TANH: g.ACT_GELU_TANH,
    MoEActivation.SILU_NO_MUL: g.ACT_SILU_NO_MUL,
    MoEActivation.GELU_NO_MUL: g.ACT_GELU_NO_MUL,
    MoEActivation.RELU2_NO_MUL: g.ACT_RELU2_NO_MUL,
}
_SILU, _GELU, _SWIGLUOAI, _SWIGLUOAI_UNINTERLEAVE, _SWIGLUSTEP = (
    tl.constexpr(ACTIVATION_CODE[a])
    for a in (
        MoEActivation.SILU,
        MoEActivation.GELU,
        MoEActivation.SWIGLUOAI,
        MoEActivation.SWIGLUOAI_UNINTERLEAVE,
        MoEActivation.SWIGLUSTEP,
    )
)
_GELU_TANH = tl.constexpr(g.ACT_GELU_TANH)
_SILU_NO_MUL = tl.constexpr(g.ACT_SILU_NO_MUL)
_GELU_NO_MUL = tl.constexpr(g.ACT_GELU_NO_MUL)
_RELU2_NO_MUL = tl.constexpr(g.ACT_RELU2_NO_MUL)

_ROWS_BLOCK_R = 16  # rows per program of the act kernel (divides every block_m: whole blocks)
_ROWS_BLOCK_C = 128  # activation columns per step
#: wgrad output tile (BN, BK), warps, stages, L loaded transposed; the reduction step is the
#: alignment's BM
_WGRAD_TILE = (128, 128, 4, 2, False)
_WGRAD_STEP = 64  # rows reduced per step of the weight gradient (64 beat 128 on an H200)
#: torch._grouped_mm takes the weight gradients where it runs (_grouped_mm_ok); False: always
#: the Triton kernel (tests switch it)
_GROUPED_MM_WGRAD = True
_TORCH_VERSION = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _gelu_erf_parts(z):
    """(Phi(z), phi(z)): the normal CDF and density, for gelu(z) = z Phi(z), gelu' = Phi + z phi."""
    cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
    return cdf, pdf


@triton.jit
def _act_and_grad(gate, up, da, alpha, beta, limit, ACTIVATION: tl.constexpr,
                  HAS_LIMIT: tl.constexpr):  # fmt: skip
    """fp32 (act(gate, up), d act / d gate * da, d act / d up * da), as fusedmoe.activation
    defines act; a clamp passes the gradient where its input lies inside the clamp, bounds
    included (as torch.clamp's backward). `up` and d_up are unused when non-gated. The forward
    alone calls this with da = 0: the compiler drops the derivative."""
    d_up = da * 0.0
    if ACTIVATION == _SILU:
        g_in = gate <= limit
        u_in = (up >= -limit) & (up <= limit)
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = _sigmoid(gate)
        silu = gate * sig
        out = silu * up
        d_gate = da * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = da * silu
        if HAS_LIMIT:
            d_gate = tl.where(g_in, d_gate, 0.0)
            d_up = tl.where(u_in, d_up, 0.0)
    elif ACTIVATION == _GELU:
        cdf, pdf = _gelu_erf_parts(gate)
        out = gate * cdf * up
        d_gate = da * up * (cdf + gate * pdf)
        d_up = da * gate * cdf
    elif ACTIVATION == _GELU_TANH:
        c = 0.7978845608028654
        inner = c * (gate + 0.044715 * gate * gate * gate)
        t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))
        gelu = 0.5 * gate * (1.0 + t)
        out = gelu * up
        d_gelu = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * c * (1.0 + 0.134145 * gate * gate)
        d_gate = da * up * d_gelu
        d_up = da * gelu
    elif ACTIVATION == _SWIGLUSTEP:
        sig = _sigmoid(gate)
        silu = gate * sig
        u_in = (up >= -limit) & (up <= limit)
        up_c = tl.minimum(tl.maximum(up, -limit), limit)
        step = tl.minimum(silu, limit)
        out = step * up_c
        d_gate = tl.where(silu <= limit, da * up_c * sig * (1.0 + gate * (1.0 - sig)), 0.0)
        d_up = tl.where(u_in, da * step, 0.0)
    elif (ACTIVATION == _SWIGLUOAI) | (ACTIVATION == _SWIGLUOAI_UNINTERLEAVE):
        g_in = gate <= limit
        u_in = (up >= -limit) & (up <= limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = _sigmoid(alpha * gate)
        glu = gate * sig
        out = (up + beta) * glu
        d_gate = tl.where(g_in, da * (up + beta) * (sig + alpha * glu * (1.0 - sig)), 0.0)
        d_up = tl.where(u_in, da * glu, 0.0)
    elif ACTIVATION == _SILU_NO_MUL:
        sig = _sigmoid(gate)
        out = gate * sig
        d_gate = da * sig * (1.0 + gate * (1.0 - sig))
    elif ACTIVATION == _GELU_NO_MUL:
        cdf, pdf = _gelu_erf_parts(gate)
        out = gate * cdf
        d_gate = da * (cdf + gate * pdf)
    else:  # RELU2_NO_MUL
        r = tl.maximum(gate, 0.0)
        out = r * r
        d_gate = da * 2.0 * r
    return out, d_gate, d_up


@triton.jit
def _act_rows_kernel(
    h_ptr, stride_hm, stride_hn,  # [S, N_w] GEMM1's output (the activation dtype)
    ga_ptr, stride_gm, stride_gn,  # [S, I]: forward, a written; backward, g read, w * a written
    dh_ptr, stride_dm, stride_dn,  # STORE_DH: [S, N_w] dL/dh
    w_ptr,  # MUL_WEIGHT: float32 [S] router weights
    dw_ptr,  # STORE_DW: float32 [S] <a[s], g[s]>
    sorted_ids_ptr, num_post_ptr, row_map_ptr,  # the aligned layout, each position's row
    S, N,  # N = I, the activation width
    alpha, beta, limit,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,  # gate / up rows of w13 alternate (gpt-oss)
    HAS_LIMIT: tl.constexpr,
    BACKWARD: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,  # backward: the router weight multiplied the expert's output
    STORE_DW: tl.constexpr,
    STORE_DH: tl.constexpr,  # backward: dh is wanted (dx, dw13 or db13 asked for)
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """forward: a = act(h).  backward: dh = act'(h) * (w * g), dw = <a, g>, and w * a written
    over g (the right operand of w2's weight gradient: the weight is applied once, here).
    The buffers' rows are in expert order; programs walk the aligned layout (BLOCK_R of its
    positions each) to find each row's slot."""
    pos0 = tl.program_id(0) * BLOCK_R
    if pos0 >= tl.load(num_post_ptr):
        return
    positions = pos0 + tl.arange(0, BLOCK_R)
    slots = tl.load(sorted_ids_ptr + positions)  # the grid covers whole blocks of the layout
    row_mask = slots < S  # padding: a sentinel >= S
    slots64 = tl.where(row_mask, slots, 0).to(tl.int64)
    rows = tl.load(row_map_ptr + positions).to(tl.int64)
    if BACKWARD and MUL_WEIGHT:
        w = tl.load(w_ptr + slots64, mask=row_mask, other=0.0)
    dot = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = (cols < N)[None, :]
        mask = row_mask[:, None] & col_mask
        h_row = h_ptr + rows[:, None] * stride_hm
        if INTERLEAVED:  # gate / up pairs: one contiguous run of 2 x BLOCK_C, split in registers
            pair = 2 * cols[None, :, None] + tl.arange(0, 2)[None, None, :]
            gate, up = tl.split(
                tl.load(h_row[:, :, None] + pair * stride_hn, mask=mask[:, :, None], other=0.0)
            )
            gate = gate.to(tl.float32)
            up = up.to(tl.float32)
        else:
            gate = tl.load(h_row + cols[None, :] * stride_hn, mask=mask, other=0.0)
            gate = gate.to(tl.float32)
            if GATED:
                up = tl.load(h_row + (cols + N)[None, :] * stride_hn, mask=mask, other=0.0)
                up = up.to(tl.float32)
            else:
                up = gate
        ga_ptrs = ga_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn
        if BACKWARD:
            grad_a = tl.load(ga_ptrs, mask=mask, other=0.0).to(tl.float32)
            da = grad_a * w[:, None] if MUL_WEIGHT else grad_a
            act, d_gate, d_up = _act_and_grad(
                gate, up, da, alpha, beta, limit, ACTIVATION, HAS_LIMIT
            )
            act = act.to(ga_ptr.dtype.element_ty).to(tl.float32)  # a as GEMM2 read it
            if STORE_DW:
                dot += tl.sum(tl.where(mask, act * grad_a, 0.0), axis=1)
            if MUL_WEIGHT:
                act = act * w[:, None]
            if STORE_DH:
                dh_row = dh_ptr + rows[:, None] * stride_dm
                dh_ty = dh_ptr.dtype.element_ty
                if INTERLEAVED:  # the pairs back as one contiguous run
                    d_pair = tl.join(d_gate.to(dh_ty), d_up.to(dh_ty))
                    tl.store(dh_row[:, :, None] + pair * stride_dn, d_pair, mask=mask[:, :, None])
                else:
                    tl.store(dh_row + cols[None, :] * stride_dn, d_gate.to(dh_ty), mask=mask)
                    if GATED:
                        tl.store(
                            dh_row + (cols + N)[None, :] * stride_dn, d_up.to(dh_ty), mask=mask
                        )
            tl.store(ga_ptrs, act.to(ga_ptr.dtype.element_ty), mask=mask)
        else:
            act, _, _ = _act_and_grad(gate, up, 0.0, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
            tl.store(ga_ptrs, act.to(ga_ptr.dtype.element_ty), mask=mask)
    if STORE_DW:
        tl.store(dw_ptr + slots64, dot, mask=row_mask)


@triton.jit
def _moe_wgrad_kernel(
    l_ptr, stride_lm, stride_ln,  # L [rows, N]: row of slot s is s // L_ROW_DIV (0: its row
                                  # in expert order, row_map)
    r_ptr, stride_rm, stride_rk,  # R [rows, K]: row of slot s is s // R_ROW_DIV (0: as L)
    out_ptr, stride_oe, stride_on, stride_ok,  # [E_l, N, K]
    sorted_ids_ptr,  # moe_align's sorted slot ids (BM rows a block)
    row_map_ptr,  # int32: the row in expert order of each position of the layout
    bounds_ptr,  # int32 [E_l + 1]: expert e owns blocks bounds[e] .. bounds[e + 1]
    N, K, num_slots,
    L_ROW_DIV: tl.constexpr,
    R_ROW_DIV: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter; operands of two dtypes)
    DOT_PRECISION: tl.constexpr,
    TRANS_LOAD: tl.constexpr,  # load L's tile as [BN, BM] (else [BM, BN], transposed for the dot)
    ALIGN: tl.constexpr,  # rows per block of the aligned layout (a multiple of BLOCK_M)
    BLOCK_M: tl.constexpr,  # rows reduced per step
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[e] = sum over the slots s of expert e of L[row(s)].T @ R[row(s)]: the grouped weight
    gradient. One program per (expert, N tile, K tile); it reduces over its expert's run of the
    aligned layout, BLOCK_M rows a step (the GEMMs prefer taller blocks than this reduction
    does); a last step made only of the run's padding is skipped. An expert with no slot gets
    zeros."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    e = pid // (num_n * num_k)
    pid_n = (pid % (num_n * num_k)) // num_k
    pid_k = pid % num_k
    STEPS: tl.constexpr = ALIGN // BLOCK_M  # steps per block of the layout
    first = tl.load(bounds_ptr + e) * STEPS
    last = tl.load(bounds_ptr + e + 1) * STEPS
    if STEPS > 1 and last > first:  # the run's padding is < ALIGN rows: at most STEPS - 1 steps
        for _ in tl.static_range(STEPS - 1):
            if tl.load(sorted_ids_ptr + (last - 1) * BLOCK_M) >= num_slots:
                last -= 1

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_mask = offs_k < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for step in range(first, last):
        positions = step * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_ids_ptr + positions)
        row_mask = slots < num_slots
        if L_ROW_DIV == 0 or R_ROW_DIV == 0:
            in_order = tl.load(row_map_ptr + positions)
        l_rows = (in_order if L_ROW_DIV == 0 else slots // L_ROW_DIV).to(tl.int64)
        r_rows = (in_order if R_ROW_DIV == 0 else slots // R_ROW_DIV).to(tl.int64)
        if TRANS_LOAD:
            left_t = tl.load(
                l_ptr + l_rows[None, :] * stride_lm + offs_n[:, None] * stride_ln,
                mask=row_mask[None, :] & n_mask[:, None], other=0.0,
            )  # fmt: skip
        else:
            left = tl.load(
                l_ptr + l_rows[:, None] * stride_lm + offs_n[None, :] * stride_ln,
                mask=row_mask[:, None] & n_mask[None, :], other=0.0,
            )  # fmt: skip
            left_t = tl.trans(left)
        right = tl.load(
            r_ptr + r_rows[:, None] * stride_rm + offs_k[None, :] * stride_rk,
            mask=row_mask[:, None] & k_mask[None, :], other=0.0,
        )  # fmt: skip
        if UPCAST:
            left_t = left_t.to(tl.float32)
            right = right.to(tl.float32)
        acc = tl.dot(left_t, right, acc, input_precision=DOT_PRECISION)
    out_ptrs = (
        out_ptr + e.to(tl.int64) * stride_oe + offs_n[:, None] * stride_on
        + offs_k[None, :] * stride_ok
    )  # fmt: skip
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Act:
    """The activation of one call, as the kernels take it."""

    kind: MoEActivation
    alpha: float
    beta: float
    limit: float
    has_limit: bool


def _act_rows(h, ga, act: _Act, routing: AlignedRouting, row_map, *, backward=False, dh=None,
              weights=None, dw=None) -> None:  # fmt: skip
    """Rows in expert order: forward, ga = act(h); backward, ga holds g, (w *) a is written
    over it, and dh and dw filled when given (dh may be h itself)."""
    num_slots, width = ga.shape
    mul = backward and weights is not None
    assert routing.block_m % _ROWS_BLOCK_R == 0  # a program's positions lie in one block
    grid = (cdiv(routing.sorted_token_ids.shape[0], _ROWS_BLOCK_R),)
    args = (
        h, h.stride(0), h.stride(1),
        ga, ga.stride(0), ga.stride(1),
        *((dh, dh.stride(0), dh.stride(1)) if dh is not None else (h, 0, 0)),
        weights if mul else ga,
        ga if dw is None else dw,
        routing.sorted_token_ids, routing.num_tokens_post_padded, row_map,
        num_slots, width,
        act.alpha, act.beta, act.limit,
    )  # fmt: skip
    constexprs = dict(
        ACTIVATION=_CODES[act.kind],
        GATED=act.kind.is_gated,
        INTERLEAVED=act.kind is MoEActivation.SWIGLUOAI,
        HAS_LIMIT=act.has_limit,
        BACKWARD=backward,
        MUL_WEIGHT=mul,
        STORE_DW=dw is not None,
        STORE_DH=dh is not None,
        BLOCK_R=_ROWS_BLOCK_R,
        BLOCK_C=min(_ROWS_BLOCK_C, next_power_of_2(width)),
        num_warps=4,
    )
    launch(_act_rows_kernel, grid, args, constexprs, h.is_cuda)


def expert_block_bounds(rows: GemmRows) -> torch.Tensor:
    """int32 [E_l + 1]: local expert e owns blocks bounds[e] .. bounds[e + 1] of the aligned
    layout (the block table is ascending up to its end, then -1). Found once per backward, so
    that each weight-gradient program reads two numbers instead of searching the table (a
    chain of dependent loads that cost more than its tile's math at small expert loads)."""
    expert_ids = rows.routing.expert_ids
    table = torch.where(expert_ids >= 0, expert_ids, rows.num_local)
    experts = torch.arange(rows.num_local + 1, device=table.device, dtype=table.dtype)
    return torch.searchsorted(table, experts, out_int32=True)


def _wgrad(left, l_row_div, right, r_row_div, rows: GemmRows, num_slots, out, bounds, *,
           row_map=None, tile=None) -> None:  # fmt: skip
    """out [E_l, N, K] = per local expert, the sum over its slots of left rows.T @ right rows
    (row of slot s: s // l_row_div of left, s // r_row_div of right, or its row in expert
    order, row_map's, where the divisor is 0; a right with row stride 0 is one row for every
    slot, e.g. ones for a bias gradient)."""
    num_local, n, k = out.shape
    routing = rows.routing
    block_n, block_k, warps, stages, trans = tile or _WGRAD_TILE
    if k < block_k:  # a bias gradient: one narrow column tile
        block_k, trans = max(16, next_power_of_2(k)), False
    grid = (num_local * cdiv(n, block_n) * cdiv(k, block_k),)
    upcast = not left.is_cuda or left.dtype != right.dtype
    args = (
        left, left.stride(0), left.stride(1),
        right, right.stride(0), right.stride(1),
        out, out.stride(0), out.stride(1), out.stride(2),
        routing.sorted_token_ids, routing.sorted_token_ids if row_map is None else row_map,
        bounds,
        n, k, num_slots,
    )  # fmt: skip
    constexprs = dict(
        L_ROW_DIV=l_row_div,
        R_ROW_DIV=r_row_div,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast or left.dtype == torch.float32 else "tf32",
        TRANS_LOAD=trans,
        ALIGN=rows.block_m,
        BLOCK_M=min(rows.block_m, _WGRAD_STEP),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    launch(_moe_wgrad_kernel, grid, args, constexprs, left.is_cuda)


@triton.jit
def _gather_rows_kernel(
    src_ptr, stride_sm, stride_sc,  # [rows, C]
    out_ptr, stride_om, stride_oc,  # [S, C]: the slots' rows in expert order
    sorted_ids_ptr, num_post_ptr, row_map_ptr, S, C,
    ROW_DIV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out[row of s] = src[s // ROW_DIV] for each slot s of the aligned layout."""
    pos0 = tl.program_id(0) * BLOCK_R
    if pos0 >= tl.load(num_post_ptr):
        return
    positions = pos0 + tl.arange(0, BLOCK_R)
    slots = tl.load(sorted_ids_ptr + positions)
    valid = slots < S
    rows = tl.load(row_map_ptr + positions).to(tl.int64)
    src_rows = (tl.where(valid, slots, 0) // ROW_DIV).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = valid[:, None] & (cols < C)[None, :]
    vals = tl.load(src_ptr + src_rows[:, None] * stride_sm + cols[None, :] * stride_sc, mask=mask)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_oc, vals, mask=mask)


def _gather_rows(src, row_div, routing: AlignedRouting, row_map, num_slots) -> torch.Tensor:
    """[S, C]: the rows src[s // row_div] of the slots in expert order."""
    cols = src.shape[1]
    out = src.new_empty(num_slots, cols)
    block_c = min(_ROWS_BLOCK_C * 2, next_power_of_2(cols))
    assert routing.block_m % _ROWS_BLOCK_R == 0  # a program's positions lie in one block
    grid = (cdiv(routing.sorted_token_ids.shape[0], _ROWS_BLOCK_R), cdiv(cols, block_c))
    args = (
        src, src.stride(0), src.stride(1), out, out.stride(0), out.stride(1),
        routing.sorted_token_ids, routing.num_tokens_post_padded, row_map, num_slots, cols,
    )  # fmt: skip
    constexprs = dict(ROW_DIV=row_div, BLOCK_R=_ROWS_BLOCK_R, BLOCK_C=block_c, num_warps=4)
    launch(_gather_rows_kernel, grid, args, constexprs, src.is_cuda)
    return out


def _in_order(routing: AlignedRouting, num_slots) -> torch.Tensor:
    """int32 [rows of the layout]: the row of each position's slot when the slots are stored in
    expert order, without padding (a padding position gets the row before it: never used)."""
    return torch.cumsum(routing.sorted_token_ids < num_slots, 0, dtype=torch.int32) - 1


def _grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes the weight gradients: bf16 on an NVIDIA sm90 GPU (CUTLASS
    grouped GEMMs, 1.1x to 1.7x our Triton kernel's speed on an H100 for the five presets at
    4096 and 16384 tokens; other GPUs were not measured), rows 16-byte aligned. The CPU (the
    interpreter's tests) runs torch's own implementation, in every training dtype, from torch
    2.9 (2.8 has none)."""
    first = tensors[0]
    if getattr(torch, "_grouped_mm", None) is None or not _GROUPED_MM_WGRAD:
        return False
    if any(t.shape[1] * t.element_size() % 16 for t in tensors):
        return False
    if not first.is_cuda:
        return _TORCH_VERSION >= (2, 9)
    if torch.version.hip is not None:
        return False
    major = torch.cuda.get_device_capability(first.device)[0]
    return first.dtype == torch.bfloat16 and major == 9


def _grouped_wgrad(left, right, row_map, bounds, block_m) -> torch.Tensor:
    """[E_l, N, K]: per local expert, left.T @ right over its slots (both [S, .] in expert
    order; an expert with no slot gets zeros). One K-grouped GEMM: the groups split the
    reduced dimension where each expert's slots end."""
    ends = torch.nn.functional.pad(row_map + 1, (1, 0))[bounds[1:] * block_m]
    return torch._grouped_mm(left.t(), right, offs=ends)


def _train_block_m(num_slots: int) -> int:
    """Rows per block of a training call's alignment, shared by its forward and backward: 128
    for large calls (the GEMMs ran 10-30% faster than on 64-row blocks on an H200, mixtral and
    qwen3 shapes at 4096 and 16384 tokens), smaller ones where a block is mostly padding."""
    if num_slots >= 8192:
        return 128
    return 64 if num_slots >= 1024 else 16


def _empty_routing(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.empty(n, dtype=torch.int32, device=device) for n in (0, 0, 1))


def _config(x, topk_ids, w13, width):
    num_tokens, top_k = topk_ids.shape
    num_local, gemm1_rows, hidden = w13.shape
    key = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    return moe_kernel_config(
        num_tokens, top_k, num_local, gemm1_rows, hidden, width, key[x.dtype], device_name(x)
    )


def _aligned(topk_ids, expert_map, block_m, num_local) -> GemmRows:
    """The aligned layout (never the direct one: the weight gradient reduces over its runs)."""
    routing = moe_align_block_size(topk_ids, block_m, num_local, expert_map)
    return _rows(routing, topk_ids, expert_map, num_local)


def _rows(routing: AlignedRouting, topk_ids, expert_map, num_local) -> GemmRows:
    ids = topk_ids.reshape(-1)
    return GemmRows(routing.block_m, routing.expert_ids.shape[0], routing, ids, expert_map,
                    num_local)  # fmt: skip


def _train_fwd_impl(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    alpha: float,
    beta: float,
    limit: float,
    has_limit: bool,
    mul_routed_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [M, H], h [S, N_w], the aligned layout's three tensors): the experts' weighted sum,
    and what the backward reads: GEMM1's output (rows in expert order) and the slot
    alignment."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    num_local, gemm1_rows, hidden = w13.shape
    act = _Act(MoEActivation(activation), alpha, beta, limit, has_limit)
    width = act.kind.output_size(gemm1_rows)
    out = x.new_empty(num_tokens, hidden)
    if num_tokens == 0:
        return out, x.new_empty(0, gemm1_rows), *_empty_routing(x.device)
    config = _config(x, topk_ids, w13, width)
    params = (alpha, beta, limit, has_limit)
    h_dtype = TL_DTYPE[x.dtype]
    with device_guard(x):
        rows = _aligned(topk_ids, expert_map, _train_block_m(num_slots), num_local)
        row_map = _in_order(rows.routing, num_slots)
        h = x.new_empty(num_slots, gemm1_rows)  # rows in expert order
        launch_gemm(
            x, None, g.A_NONE, top_k, w13, None, g.W_NONE, w13_bias, h, None, topk_weights,
            rows, num_slots, config.gemm1, activation=None, params=params, out_mode=g.OUT_PLAIN,
            mul_routed_weight=False, h_dtype=h_dtype,
            variant=GemmVariant(out_in_order=True, row_map=row_map),
        )  # fmt: skip
        a = x.new_empty(num_slots, width)
        _act_rows(h, a, act, rows.routing, row_map)
        y = x.new_empty(num_slots, hidden)
        launch_gemm(
            a, None, g.A_NONE, 1, w2, None, g.W_NONE, w2_bias, y, None, topk_weights.reshape(-1),
            rows, num_slots, config.gemm2, activation=None, params=params, out_mode=g.OUT_PLAIN,
            mul_routed_weight=mul_routed_weight, h_dtype=h_dtype,
            variant=GemmVariant(a_in_order=True, row_map=row_map),
        )  # fmt: skip
        moe_sum(y, out, topk_ids, expert_map, num_local)
    r = rows.routing
    return out, h, r.sorted_token_ids, r.expert_ids, r.num_tokens_post_padded


def _grad_buffers(x, w13, w2, topk_ids, w13_bias, w2_bias, need_x, need_w13, need_w2,
                  need_topk_weights, need_b13, need_b2) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The backward op's outputs, uninitialised (its fake; the real op asks for dx and dw13
    later, where they are written): (dx [M, H], dw13, dw2, d topk_weights float32 [M, k],
    db13, db2); a gradient not asked for (or without an input: no bias) is a distinct empty
    tensor (a custom op's outputs may not alias)."""

    def like(t, needed):  # contiguous, whatever t's strides (torch._grouped_mm's output is)
        return t.new_empty(t.shape) if needed and t is not None else x.new_empty(0)

    return (
        x.new_empty(x.shape) if need_x else x.new_empty(0),  # contiguous, whatever x's strides
        like(w13, need_w13),
        like(w2, need_w2),
        x.new_empty(topk_ids.shape if need_topk_weights else (0,), dtype=torch.float32),
        like(w13_bias, need_b13),
        like(w2_bias, need_b2),
    )


def _train_bwd(
    dout: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    h: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    activation: str,
    alpha: float,
    beta: float,
    limit: float,
    has_limit: bool,
    mul_routed_weight: bool,
    need_x: bool,
    need_w13: bool,
    need_w2: bool,
    need_topk_weights: bool,
    need_b13: bool,
    need_b2: bool,
    *,
    dh_over_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [M, H], dw13, dw2, d topk_weights [M, k] float32, db13, db2); a gradient that was not
    asked for (or has no input: no bias) is an empty tensor, and costs nothing. dh_over_h: dh
    is written over h, which the backward reads for the last time there (the eager backward;
    see _backward)."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    num_local, gemm1_rows, hidden = w13.shape
    act = _Act(MoEActivation(activation), alpha, beta, limit, has_limit)
    width = act.kind.output_size(gemm1_rows)
    mul = mul_routed_weight and need_topk_weights
    if num_tokens == 0:
        grads = _grad_buffers(
            x, w13, w2, topk_ids, w13_bias, w2_bias, need_x, need_w13, need_w2, mul, need_b13,
            need_b2,
        )  # fmt: skip
        return tuple(t.zero_() for t in grads)
    # Every element is written below (an expert without slots gets zeros from the weight
    # gradients; a slot not routed here, a zero dw). The weight gradients and dx are allocated
    # where they are first written, not here: while g / w * a is alive, dx and dw13 do not
    # exist yet (dw13 is as large as h at mixtral-8x7b's shape).
    dx, dw13, dw2, dweights, db13, db2 = _grad_buffers(
        x, w13, w2, topk_ids, w13_bias, w2_bias, False, False, False, mul, need_b13, need_b2
    )
    dweights.zero_()  # the act kernel writes the routed slots' only
    dout = dout.contiguous()
    config = _config(x, topk_ids, w13, width)
    params = (alpha, beta, limit, has_limit)
    h_dtype = TL_DTYPE[x.dtype]
    weights_flat = topk_weights.reshape(-1)
    with device_guard(x):
        routing = AlignedRouting(
            sorted_token_ids, expert_ids, num_tokens_post_padded, _train_block_m(num_slots)
        )
        rows = _rows(routing, topk_ids, expert_map, num_local)
        row_map = _in_order(routing, num_slots)
        out_in_order = GemmVariant(out_in_order=True, row_map=row_map)
        a_in_order = GemmVariant(a_in_order=True, row_map=row_map)
        ga = x.new_empty(num_slots, width)  # g, then w * a (rows in expert order)
        launch_gemm(
            dout, None, g.A_NONE, top_k, w2.transpose(1, 2), None, g.W_NONE, None, ga, None,
            weights_flat, rows, num_slots, config.gemm1, activation=None, params=params,
            out_mode=g.OUT_PLAIN, mul_routed_weight=False, h_dtype=h_dtype, variant=out_in_order,
        )  # fmt: skip
        # dh feeds dx, dw13 and db13 only. Each act program reads its rows' h before it writes
        # their dh, and no two programs share a row: dh may take h's memory.
        dh = None
        if need_x or need_w13 or db13.numel():
            dh = h if dh_over_h else torch.empty_like(h)
            if dh_over_h:  # what autograd saved has changed (see _backward)
                torch.autograd.graph.increment_version(h)
        dw_slots = dweights.view(-1) if mul else None
        _act_rows(
            h, ga, act, routing, row_map, dh=dh, backward=True,
            weights=weights_flat if mul_routed_weight else None, dw=dw_slots,
        )  # fmt: skip
        if mul and w2_bias is not None:  # <b2[e(s)], dout[t(s)]>: y's bias part
            dweights += _bias_dot(dout, w2_bias, topk_ids, expert_map, num_local)
        # In the order that frees each buffer soonest (the peak memory of a step): w2's
        # gradients while w * a is alive, then dx, then w13's from dh.
        bounds = (
            expert_block_bounds(rows) if need_w13 or need_w2 or db13.numel() + db2.numel() else None
        )
        if need_w2:
            if _grouped_mm_ok(dout, ga):
                dout_in_order = _gather_rows(dout, top_k, routing, row_map, num_slots)
                dw2 = _grouped_wgrad(dout_in_order, ga, row_map, bounds, routing.block_m)
                del dout_in_order
            else:
                dw2 = w2.new_empty(w2.shape)  # contiguous, as the fake says
                _wgrad(dout, top_k, ga, 0, rows, num_slots, dw2, bounds, row_map=row_map)
        del ga
        if db2.numel():  # the sums of w * dout over each expert's slots
            slot_weights = weights_flat.view(num_slots, 1)
            if not mul_routed_weight:
                slot_weights = torch.ones_like(slot_weights)
            _wgrad(
                dout, top_k, slot_weights, 1, rows, num_slots, db2.view(num_local, -1, 1), bounds
            )
        if need_x:
            dx = x.new_empty(x.shape)  # contiguous, whatever x's strides
            dx_slots = x.new_empty(num_slots, hidden)
            launch_gemm(
                dh, None, g.A_NONE, 1, w13.transpose(1, 2), None, g.W_NONE, None, dx_slots, None,
                weights_flat, rows, num_slots, config.gemm2, activation=None, params=params,
                out_mode=g.OUT_PLAIN, mul_routed_weight=False, h_dtype=h_dtype,
                variant=a_in_order,
            )  # fmt: skip
            moe_sum(dx_slots, dx, topk_ids, expert_map, num_local)
            del dx_slots
        if need_w13:
            if _grouped_mm_ok(dh, x):
                x_in_order = _gather_rows(x, top_k, routing, row_map, num_slots)
                dw13 = _grouped_wgrad(dh, x_in_order, row_map, bounds, routing.block_m)
                del x_in_order
            else:
                dw13 = w13.new_empty(w13.shape)
                _wgrad(dh, 0, x, top_k, rows, num_slots, dw13, bounds, row_map=row_map)
        if db13.numel():  # the column sums of dh over each expert's slots
            ones = x.new_ones(1, 1, dtype=torch.float32).expand(num_slots, 1)
            db13_3d = db13.view(num_local, -1, 1)
            _wgrad(dh, 0, ones, 1, rows, num_slots, db13_3d, bounds, row_map=row_map)
    return dx, dw13, dw2, dweights, db13, db2


def _train_bwd_impl(
    dout: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    h: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    activation: str,
    alpha: float,
    beta: float,
    limit: float,
    has_limit: bool,
    mul_routed_weight: bool,
    need_x: bool,
    need_w13: bool,
    need_w2: bool,
    need_topk_weights: bool,
    need_b13: bool,
    need_b2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered backward op (torch.compile's): it writes none of its inputs, as its
    schema says, so dh has a buffer of its own."""
    return _train_bwd(
        dout, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, h,
        sorted_token_ids, expert_ids, num_tokens_post_padded, activation, alpha, beta, limit,
        has_limit, mul_routed_weight, need_x, need_w13, need_w2, need_topk_weights, need_b13,
        need_b2, dh_over_h=False,
    )  # fmt: skip


def _bias_dot(dout, w2_bias, topk_ids, expert_map, num_local) -> torch.Tensor:
    """float32 [M, k]: <b2[e], dout[t]> for each slot routed here, 0 for the others."""
    per_expert = dout.float() @ w2_bias.float().t()  # [M, E_l]
    ids = topk_ids.long()
    num_ids = num_local if expert_map is None else expert_map.shape[0]
    routed = (ids >= 0) & (ids < num_ids)
    local = ids.clamp(0, num_ids - 1)
    if expert_map is not None:
        local = expert_map.long()[local]
        routed &= (local >= 0) & (local < num_local)
    picked = per_expert.gather(1, local.clamp(0, num_local - 1))
    return torch.where(routed, picked, torch.zeros_like(picked))


_train_fwd_op = torch.library.custom_op("fusedmoe::experts_train_fwd", mutates_args=())(
    _train_fwd_impl
)
_train_bwd_op = torch.library.custom_op("fusedmoe::experts_train_bwd", mutates_args=())(
    _train_bwd_impl
)


@_train_fwd_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, activation, alpha,
      beta, limit, has_limit, mul_routed_weight):  # fmt: skip
    num_slots = topk_ids.shape[0] * topk_ids.shape[1]
    if num_slots == 0:
        routing = _empty_routing(x.device)
    else:
        padded, blocks = aligned_sizes(num_slots, w13.shape[0], _train_block_m(num_slots))
        routing = (
            x.new_empty(padded, dtype=torch.int32),
            x.new_empty(blocks, dtype=torch.int32),
            x.new_empty(1, dtype=torch.int32),
        )
    out = x.new_empty(topk_ids.shape[0], w13.shape[2])
    return out, x.new_empty(num_slots, w13.shape[1]), *routing


@_train_bwd_op.register_fake
def _(dout, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, h,
      sorted_token_ids, expert_ids, num_tokens_post_padded, activation, alpha, beta, limit,
      has_limit, mul_routed_weight, need_x, need_w13, need_w2, need_topk_weights, need_b13,
      need_b2):  # fmt: skip
    mul = mul_routed_weight and need_topk_weights
    return _grad_buffers(
        x, w13, w2, topk_ids, w13_bias, w2_bias, need_x, need_w13, need_w2, mul, need_b13,
        need_b2,
    )  # fmt: skip


def _setup_context(ctx, inputs, output):
    x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, *rest = inputs
    ctx.save_for_backward(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map,
                          *output[1:])  # fmt: skip
    ctx.params = tuple(rest)  # activation, alpha, beta, limit, has_limit, mul_routed_weight
    ctx.mark_non_differentiable(*output[1:])
    # the saved outputs get no gradient: without this, autograd passes a zeros tensor of each,
    # and the one of h [S, N_w] sat beside dh at the backward's peak
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, *_saved_outputs, eager: bool = False):
    if dout is None:  # grads are not materialised: no gradient reached the output
        return (None,) * len(ctx.needs_input_grad)
    x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, *saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    # the registered op's backward runs the registered backward op: AOTAutograd traces it with
    # fake tensors (where torch.compiler.is_compiling() may be False)
    # The eager backward writes dh over the saved h (its last reader): at the step's peak one
    # [S, N_w] buffer fewer, as many bytes as a torch pipeline frees when its activation's
    # backward node releases what it saved. A second backward through this graph
    # (retain_graph=True) then fails autograd's saved-tensor check ("modified by an inplace
    # operation") instead of reading dh as h. The registered op writes none of its inputs.
    bwd = functools.partial(_train_bwd, dh_over_h=True) if eager else _train_bwd_op
    dx, dw13, dw2, dweights, db13, db2 = bwd(
        dout, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, *saved,
        *ctx.params, needs[0], needs[1], needs[2], needs[3], needs[5], needs[6],
    )  # fmt: skip
    return (
        dx if needs[0] else None,
        dw13 if needs[1] else None,
        dw2 if needs[2] else None,
        dweights if needs[3] and dweights.numel() else None,
        None,
        db13 if needs[5] else None,
        db2 if needs[6] else None,
        None, None, None, None, None, None, None,
    )  # fmt: skip


_train_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _ExpertsTrain(torch.autograd.Function):
    """The same forward and backward as the registered op, for eager mode: the custom op's
    dispatch (Python -> C++ -> Python, dynamo's disable wrapper, its autograd wrapper) cost
    about 0.25 ms a call on the lent GPU's host, and a training step makes two."""

    @staticmethod
    def forward(*inputs):
        return _train_fwd_impl(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        # no double backward (the registered op has none either): create_graph=True raises
        # rather than returning first-order gradients that silently drop the second order
        return _backward(ctx, *grads, eager=True)


def experts_train(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: MoEActivation,
    params: tuple[float, float, float, bool],
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    mul_routed_weight: bool = True,
) -> torch.Tensor:
    """out [M, H] = the experts' (weighted) top-k sum, differentiable in x, w13, w2, the
    biases and topk_weights (float32 [M, k]) on the GPU kernels. Inputs are assumed checked by
    the caller (TritonExperts); params are (alpha, beta, limit, has_limit), defaults resolved."""
    alpha, beta, limit, has_limit = params
    # torch.compile traces the registered op (one op and its backward); eager mode calls the
    # autograd.Function twin (same implementation, no dispatcher round trip)
    train = _train_fwd_op if torch.compiler.is_compiling() else _ExpertsTrain.apply
    out, *_ = train(
        x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, activation.value,
        alpha, beta, limit, has_limit, mul_routed_weight,
    )  # fmt: skip
    return out
