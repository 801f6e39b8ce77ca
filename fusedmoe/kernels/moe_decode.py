"""One-launch decode: the MoE computation of one token in one persistent kernel.

At M = 1 the triton backend's chain is quantize x, GEMM1, act + quant, GEMM2 and the top-k sum:
five launches, each with its start and its tail, around GEMMs that only stream weights. Here a
prologue (one program: it zeroes the counters and, for FP8, quantizes x) and one kernel of at
most one program per SM do the whole computation:

    phase 1  items (slot j, activation columns t), j-major:
                 act_j[t] = act(round(x @ w13[e_j][gate rows of t].T + b13),
                                round(x @ w13[e_j][up rows of t].T + b13))
             stored in fp32 under 1 x 128 group FP8 (the groups span items), else rounded to the
             activation dtype (a2 itself); then ready[j] += 1 (release)
    phase 2  items (column tile t, slot j), t-major: load the tile's first K block of w2, wait
             until ready[j] counts every phase-1 item of slot j (acquire), then
                 y_j[t] = round(((quant(act_j) @ w2[e_j][rows of t].T) + b2) * weight_j)
             and arrived[t] += 1 (acq_rel); the last of the k slots to arrive sums y[:, t] in
             slot order, in fp32, into out[t]

The arithmetic is the chain's: h is rounded to the activation dtype before the activation, a2 is
quantized per 1 x 128 group as the act + quant kernel does, and each slot's output is rounded
before the top-k sum. The products are summed in another order than the chain's GEMMs (other
tiles), so the results agree with it to the accumulation's rounding, not bit for bit.

Why it cannot hang: a program runs all of its phase-1 items before any of its phase-2 items, and
phase-1 items wait on nothing; the grid is at most one program per SM (launched as a cooperative
grid on the GPU, which the driver refuses rather than run partly resident), so every program is
resident and every wait ends. On the CPU interpreter one program runs every item in order.

The counters live in the call's workspace and the prologue zeroes them, so calls on other
streams (other workspaces) or captured in CUDA graphs never share them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedmoe._pdl import pdl_args, pdl_start, pdl_wait
from fusedmoe._triton import cdiv, launch, next_power_of_2
from fusedmoe.kernels.moe_gemm import QUANT_GROUP, _activation, _round_to
from fusedmoe.quant.formats import FP8_DTYPE
from fusedmoe.quant.kernels import quantize_groups

__all__ = ["DecodeConfig", "decode_config", "decode_workspace_bytes", "moe_decode"]

_GROUP = tl.constexpr(QUANT_GROUP)
_ALIGN = 256  # byte alignment of each part of the workspace


@dataclass(frozen=True)
class DecodeConfig:
    block_n1: int  # activation columns per phase-1 item (gate and up rows: twice that)
    block_k1: int  # K per step of phase 1 (128 under block-scaled FP8: one scale block)
    block_n2: int  # output columns per phase-2 item
    block_k2: int  # I per step of phase 2 (128 under FP8: one quantization group)
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4  # resident programs per SM at most (the grid is resident whole)

    def __post_init__(self):
        for field in ("block_n1", "block_k1", "block_n2", "block_k2"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(
                    f"DecodeConfig.{field} must be a power of two >= 16, got {value!r}"
                )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"DecodeConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}"
            )
        if self.programs_per_sm not in (1, 2, 3, 4, 5, 6, 7, 8):
            raise ValueError(
                f"DecodeConfig.programs_per_sm must be 1 to 8, got {self.programs_per_sm!r}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"DecodeConfig.num_stages must be >= 1, got {self.num_stages!r}")


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _slot_expert(ids_ptr, map_ptr, j, num_ids, num_local, HAS_MAP: tl.constexpr):
    """Slot j's local expert, or -1 when the slot is not routed to this rank (an id outside
    [0, num_ids), or mapped outside [0, num_local)), as the GEMMs decide."""
    e = tl.load(ids_ptr + j).to(tl.int32)
    e = tl.where((e >= 0) & (e < num_ids), e, -1)
    if HAS_MAP:
        e = tl.load(map_ptr + tl.maximum(e, 0), mask=e >= 0, other=-1).to(tl.int32)
    return tl.where((e >= 0) & (e < num_local), e, -1)


@triton.jit
def _decode_prologue_kernel(
    x_ptr,  # [K] activation dtype (QUANT_X)
    xq_ptr, xs_ptr,  # QUANT_X: [K] e4m3, [G] fp32
    cnt_ptr, num_cnt,  # int32 counters, zeroed
    K, G,
    QUANT_X: tl.constexpr,
    SCALE_FORMAT: tl.constexpr,  # quant.kernels' code: float32 or UE8M0 (as float32)
    GROUPS: tl.constexpr,  # groups per step
    BLOCK_C: tl.constexpr,  # counters per step
    ROUND_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_start(PDL)
    offs_c = tl.arange(0, BLOCK_C)
    for c0 in range(0, num_cnt, BLOCK_C):
        tl.store(cnt_ptr + c0 + offs_c, tl.zeros((BLOCK_C,), tl.int32), mask=c0 + offs_c < num_cnt)
    if QUANT_X:
        _quantize_row(x_ptr, xq_ptr, xs_ptr, K, G, SCALE_FORMAT, GROUPS, ROUND_IN_FP32, "")


@triton.jit
def _a_row_tile(ptr, k0, K, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, CACHE: tl.constexpr = ""):
    """[16, BLOCK_K]: row 0 holds ptr[k0 : k0 + BLOCK_K] (zeros past K), the others zeros (the
    smallest tile a tensor-core dot takes)."""
    rows = tl.arange(0, 16)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] == 0) & (offs_k[None, :] < K)
    a = tl.load(ptr + offs_k[None, :] + 0 * rows[:, None], mask=mask, other=0.0,
                cache_modifier=CACHE)  # fmt: skip
    if UPCAST:
        a = a.to(tl.float32)
    return a


@triton.jit
def _w_tile(
    w_row_ptr, rows, row_mask, stride_n, k0, K, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr
):
    """[BLOCK_K, BN] = w[rows, k0 : k0 + BLOCK_K].T (zeros outside)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_row_ptr + rows.to(tl.int64)[None, :] * stride_n + offs_k[:, None]
    w = tl.load(ptrs, mask=row_mask[None, :] & (offs_k[:, None] < K), other=0.0)
    if UPCAST:
        w = w.to(tl.float32)
    return w


@triton.jit
def _gemv_rows(
    a_ptr, a_scale_ptr, w_row_ptr, ws_ptr, stride_wn, stride_wsn, stride_wsk, rows, row_mask, K,
    W_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """sum over K of a[k] * w[rows, k] (w's rows contiguous in K), fp32 [BLOCK_N]; under
    block-scaled FP8 each 128-wide K block is scaled (a's group scale times w's block scale)
    before it is added, as the GEMMs promote."""
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    blocks = rows // _GROUP
    for k0 in range(0, K, BLOCK_K):
        a = _a_row_tile(a_ptr, k0, K, BLOCK_K, UPCAST, "")
        w = _w_tile(w_row_ptr, rows, row_mask, stride_wn, k0, K, BLOCK_K, UPCAST)
        if W_BLOCK:
            kb = k0 // _GROUP
            s = tl.load(a_scale_ptr + kb) * tl.load(
                ws_ptr + blocks * stride_wsn + kb * stride_wsk, mask=row_mask, other=0.0
            )
            acc += tl.dot(a, w, input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return tl.sum(acc, axis=0)  # row 0: the other rows are zeros


@triton.jit
def _quantize_row(
    src_ptr, q_ptr, s_ptr, n, num_groups, SCALE_FORMAT: tl.constexpr, GROUPS: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """q[:n], s[:num_groups] = the 1 x 128 group FP8 quantization of src[:n] (quant.kernels'
    arithmetic, GROUPS groups a step)."""
    groups = tl.arange(0, GROUPS)
    lane = tl.arange(0, _GROUP)
    for g0 in range(0, num_groups, GROUPS):
        cols = (g0 + groups)[:, None] * _GROUP + lane[None, :]  # [GROUPS, 128]
        mask = cols < n
        v = tl.load(src_ptr + cols, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
        y, scale = quantize_groups(v[None, :, :], SCALE_FORMAT, ROUND_IN_FP32)
        tl.store(q_ptr + cols[None, :, :], y.to(q_ptr.dtype.element_ty), mask=mask[None, :, :])
        tl.store(s_ptr + (g0 + groups)[None, :], scale, mask=((g0 + groups) < num_groups)[None, :])


@triton.jit
def _wait_until(cnt_ptr, target):
    """Spin until the counter reaches target: relaxed polls (no L1 invalidation each time), then
    one acquire, and a barrier so that no thread reads what it guards before it."""
    seen = tl.load(cnt_ptr, volatile=True)
    while seen < target:
        seen = tl.load(cnt_ptr, volatile=True)
    # the acquire; its value is read (else the compiler drops it), and never below the polled
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _gemm2_step(
    acc, a, a_scale_ptr, w, ws_ptr, stride_wsn, stride_wsk, blocks, col_mask, kb,
    W_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc + a @ w, the K block kb scaled (a's group scale, w's block scales) under FP8."""
    if W_BLOCK:
        s_a = tl.load(a_scale_ptr + kb, cache_modifier=".cg")
        s = s_a * tl.load(ws_ptr + blocks * stride_wsn + kb * stride_wsk, mask=col_mask, other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION) * s[None, :]
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _moe_decode_kernel(
    a_ptr, a_scale_ptr,  # [K] x (quantized: e4m3, with [K / 128] fp32 group scales)
    w1_ptr, stride_w1e, stride_w1n,  # [E_l, N1, K], K contiguous
    w1s_ptr, stride_w1se, stride_w1sn, stride_w1sk,  # W_BLOCK: [E_l, N1 / 128, K / 128]
    b1_ptr, stride_b1e,  # HAS_B1: [E_l, N1]
    w2_ptr, stride_w2e, stride_w2n,  # [E_l, H, I], I contiguous
    w2s_ptr, stride_w2se, stride_w2sn, stride_w2sk,  # W_BLOCK: [E_l, H / 128, I / 128]
    b2_ptr, stride_b2e,  # HAS_B2: [E_l, H]
    ids_ptr, map_ptr, tw_ptr,  # [k] ids, [E] global -> local (HAS_MAP), [k] fp32 router weights
    act_ptr,  # [k, I]: fp32 activations (A2_QUANT) or a2 in the activation dtype
    a2_ptr, a2s_ptr,  # A2_QUANT: [k, I] e4m3 and [k, ceil(I / 128)] fp32, from act
    y_ptr,  # [k, H] activation dtype: each slot's output
    out_ptr,  # [H]
    cnt_ptr,  # int32 [2k + T2], zero: ready[j] (items done), quantized[j], arrived[t]
    K, I, H, num_ids, num_local,  # noqa: E741 (I: the intermediate size of the legend)
    alpha, beta, limit,
    TOP_K: tl.constexpr,
    ACTIVATION: tl.constexpr,  # fused_moe's codes (moe_gemm._activation)
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,  # gate / up rows interleaved (gpt-oss) rather than halves
    HAS_LIMIT: tl.constexpr,
    W_BLOCK: tl.constexpr,  # 128 x 128 block-scaled FP8 weights, 1 x 128 group FP8 activations
    A2_QUANT: tl.constexpr,
    A2_SCALE_FORMAT: tl.constexpr,
    HAS_B1: tl.constexpr,
    HAS_B2: tl.constexpr,
    HAS_MAP: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    H_DTYPE: tl.constexpr,  # the activation dtype (where the reference rounds h and y)
    DOT_PRECISION: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N1: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    QUANT_GROUPS: tl.constexpr,  # groups per step of a slot's quantization
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_wait(PDL)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    t1 = tl.cdiv(I, BLOCK_N1)
    t2 = tl.cdiv(H, BLOCK_N2)
    g2 = tl.cdiv(I, _GROUP)

    # phase 1: activation columns of each slot
    for item in range(pid, TOP_K * t1, num_programs):
        j = item // t1
        e = _slot_expert(ids_ptr, map_ptr, j, num_ids, num_local, HAS_MAP)
        if e >= 0:
            offs_n = (item % t1) * BLOCK_N1 + tl.arange(0, BLOCK_N1)
            n_mask = offs_n < I
            if INTERLEAVED:
                gate_rows = 2 * offs_n
                up_rows = 2 * offs_n + 1
            else:
                gate_rows = offs_n
                up_rows = offs_n + I
            w_row = w1_ptr + e.to(tl.int64) * stride_w1e
            ws = w1s_ptr + e.to(tl.int64) * stride_w1se
            b_row = b1_ptr + e.to(tl.int64) * stride_b1e
            if GATED:  # gate and up rows side by side in one tile: one dot, one K loop
                rows = tl.reshape(tl.join(gate_rows, up_rows), (2 * BLOCK_N1,))
                mask = tl.reshape(tl.join(n_mask, n_mask), (2 * BLOCK_N1,))
                h = _gemv_rows(
                    a_ptr, a_scale_ptr, w_row, ws, stride_w1n, stride_w1sn, stride_w1sk, rows,
                    mask, K, W_BLOCK, 2 * BLOCK_N1, BLOCK_K1, DOT_PRECISION, UPCAST,
                )  # fmt: skip
                if HAS_B1:
                    h += tl.load(b_row + rows, mask=mask, other=0.0).to(tl.float32)
                h_g, h_u = tl.split(tl.reshape(h, (BLOCK_N1, 2)))
                h_g = _round_to(h_g, H_DTYPE, ROUND_IN_FP32)
                h_u = _round_to(h_u, H_DTYPE, ROUND_IN_FP32)
            else:
                h_g = _gemv_rows(
                    a_ptr, a_scale_ptr, w_row, ws, stride_w1n, stride_w1sn, stride_w1sk,
                    gate_rows, n_mask, K, W_BLOCK, BLOCK_N1, BLOCK_K1, DOT_PRECISION, UPCAST,
                )  # fmt: skip
                if HAS_B1:
                    h_g += tl.load(b_row + gate_rows, mask=n_mask, other=0.0).to(tl.float32)
                h_g = _round_to(h_g, H_DTYPE, ROUND_IN_FP32)
                h_u = h_g
            act = _activation(h_g, h_u, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
            if not A2_QUANT:  # a2 itself: the activation rounded to the activation dtype
                act = _round_to(act, H_DTYPE, ROUND_IN_FP32)
            tl.store(act_ptr + j.to(tl.int64) * I + offs_n, act.to(act_ptr.dtype.element_ty),
                     mask=n_mask)  # fmt: skip
        tl.debug_barrier()  # every thread's stores before the release
        done = tl.atomic_add(cnt_ptr + j, 1, sem="acq_rel", scope="gpu")
        if A2_QUANT:  # noqa: SIM102 (a constexpr guard)
            if (done == t1 - 1) & (e >= 0):  # the slot's last item: quantize its activations
                tl.debug_barrier()
                _quantize_row(
                    act_ptr + j.to(tl.int64) * I, a2_ptr + j.to(tl.int64) * I,
                    a2s_ptr + j.to(tl.int64) * g2, I, g2, A2_SCALE_FORMAT, QUANT_GROUPS,
                    ROUND_IN_FP32, ".cg",
                )  # fmt: skip
                tl.debug_barrier()
                tl.atomic_add(cnt_ptr + TOP_K + j, 1, sem="release", scope="gpu")

    # phase 2: output columns of each slot, then the top-k sum by the last slot to arrive
    # the items continue one count over both phases, dealt round robin: the programs left
    # without a GEMM1 item take the first GEMM2 items and load their weights while GEMM1 runs
    n1 = TOP_K * t1
    first = pid + tl.cdiv(tl.maximum(n1 - pid, 0), num_programs) * num_programs - n1
    for item in range(first, TOP_K * t2, num_programs):
        j = item % TOP_K
        t = item // TOP_K
        e = _slot_expert(ids_ptr, map_ptr, j, num_ids, num_local, HAS_MAP)
        offs_h = t * BLOCK_N2 + tl.arange(0, BLOCK_N2)
        h_mask = offs_h < H
        if e >= 0:
            w_row = w2_ptr + e.to(tl.int64) * stride_w2e
            ws = w2s_ptr + e.to(tl.int64) * stride_w2se
            blocks = offs_h // _GROUP
            # the first K block of w2 is on its way before the wait
            w = _w_tile(w_row, offs_h, h_mask, stride_w2n, 0, I, BLOCK_K2, UPCAST)
            if A2_QUANT:
                _wait_until(cnt_ptr + TOP_K + j, 1)
                a_row = a2_ptr + j.to(tl.int64) * I
            else:
                _wait_until(cnt_ptr + j, t1)
                a_row = act_ptr + j.to(tl.int64) * I
            s_row = a2s_ptr + j.to(tl.int64) * g2
            acc = tl.zeros((16, BLOCK_N2), dtype=tl.float32)
            a = _a_row_tile(a_row, 0, I, BLOCK_K2, UPCAST, ".cg")
            acc = _gemm2_step(
                acc, a, s_row, w, ws, stride_w2sn, stride_w2sk, blocks, h_mask, 0, W_BLOCK,
                DOT_PRECISION,
            )  # fmt: skip
            for k0 in range(BLOCK_K2, I, BLOCK_K2):
                w = _w_tile(w_row, offs_h, h_mask, stride_w2n, k0, I, BLOCK_K2, UPCAST)
                a = _a_row_tile(a_row, k0, I, BLOCK_K2, UPCAST, ".cg")
                acc = _gemm2_step(
                    acc, a, s_row, w, ws, stride_w2sn, stride_w2sk, blocks, h_mask,
                    k0 // _GROUP, W_BLOCK, DOT_PRECISION,
                )  # fmt: skip
            y = tl.sum(acc, axis=0)
            if HAS_B2:
                b_row = b2_ptr + e.to(tl.int64) * stride_b2e
                y += tl.load(b_row + offs_h, mask=h_mask, other=0.0).to(tl.float32)
            if MUL_WEIGHT:
                y = y * tl.load(tw_ptr + j)
            y = _round_to(y, H_DTYPE, ROUND_IN_FP32)
            tl.store(y_ptr + j.to(tl.int64) * H + offs_h, y.to(y_ptr.dtype.element_ty), mask=h_mask)
        tl.debug_barrier()  # every thread's stores before the release
        arrived = tl.atomic_add(cnt_ptr + 2 * TOP_K + t, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K - 1:  # the last of the tile's k slots: the top-k sum, in slot order
            tl.debug_barrier()
            total = tl.zeros((BLOCK_N2,), dtype=tl.float32)
            for jj in tl.static_range(TOP_K):
                routed = _slot_expert(ids_ptr, map_ptr, jj, num_ids, num_local, HAS_MAP) >= 0
                # (a scalar mask broadcast through int32: the interpreter's masks are vectors)
                mask = h_mask & ((tl.zeros((BLOCK_N2,), tl.int32) + routed.to(tl.int32)) != 0)
                v = tl.load(y_ptr + jj * H + offs_h, mask=mask, other=0.0, cache_modifier=".cg")
                total += v.to(tl.float32)
            total = _round_to(total, out_ptr.dtype.element_ty, ROUND_IN_FP32)
            tl.store(out_ptr + offs_h, total.to(out_ptr.dtype.element_ty), mask=h_mask)


# ---------------------------------------------------------------------------------------------
# configs and the launcher
# ---------------------------------------------------------------------------------------------
_INTERPRETER_PROGRAMS = 1  # one program runs every item in order (the waits then never spin)

_override: contextvars.ContextVar = contextvars.ContextVar("fusedmoe_decode", default=None)


@contextlib.contextmanager
def use_decode_config(config: DecodeConfig | bool) -> Iterator[None]:
    """Within the block: the one-launch decode with this config (True: the default config), or
    never (False: the five-launch chain), wherever it applies; for benchmarks and tests."""
    if not isinstance(config, (bool, DecodeConfig)):
        raise TypeError(f"config must be a DecodeConfig or a bool, got {type(config).__name__}")
    token = _override.set(config)
    try:
        yield
    finally:
        _override.reset(token)


def decode_enabled() -> bool:
    """Whether calls of one token take the one-launch decode: on unless FUSEDMOE_DECODE=0 or a
    use_decode_config(False) block."""
    override = _override.get()
    if override is not None:
        return override is not False
    return _ENV_ON


_ENV_ON = os.environ.get("FUSEDMOE_DECODE", "1") != "0"


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_config(top_k: int, intermediate: int, hidden: int, quantized: bool) -> DecodeConfig:
    """The default config (benchmarks/probe_decode_kernel.py)."""
    return DecodeConfig(block_n1=16, block_k1=QUANT_GROUP, block_n2=64, block_k2=QUANT_GROUP)


def _aligned(n: int) -> int:
    return cdiv(n, _ALIGN) * _ALIGN


def decode_workspace_bytes(
    top_k: int, intermediate: int, hidden: int, k_dim: int, act_dtype: torch.dtype, quantized: bool
) -> int:
    """Bytes of scratch the one-launch decode needs: each slot's activations (fp32 under FP8),
    each slot's output, the counters (for the narrowest output items) and x's FP8 copy."""
    elem = torch.empty((), dtype=act_dtype).element_size()
    act = top_k * intermediate * (4 if quantized else elem)
    y = top_k * hidden * elem
    counters = 4 * (2 * top_k + cdiv(hidden, 16))
    parts = [act, y, counters]
    if quantized:  # a2 and its scales; x's FP8 copy and its scales
        parts += [top_k * intermediate, 4 * top_k * cdiv(intermediate, QUANT_GROUP)]
        parts += [k_dim, 4 * cdiv(k_dim, QUANT_GROUP)]
    return sum(_aligned(n) for n in parts) + _ALIGN


def _carve(workspace: torch.Tensor, sizes: list[tuple[tuple[int, ...], torch.dtype]]):
    """Views of the given shapes and dtypes over the workspace's bytes, each 256-byte aligned."""
    raw = workspace.view(-1).view(torch.uint8)
    start = (-raw.data_ptr()) % _ALIGN
    views = []
    for shape, dtype in sizes:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        views.append(raw[start : start + nbytes].view(dtype).view(shape))
        start += _aligned(nbytes)
    return views


# (device, the launch's constexprs) -> programs per SM that can be resident together
_RESIDENT: dict[tuple, int] = {}


def _resident_per_sm(kernel, grid, args, constexprs, index: int) -> int:
    """How many programs of this compiled kernel one SM holds at once (registers, shared memory,
    threads), from the binary: the cooperative launch is refused beyond it."""
    compiled = kernel.warmup(*args, grid=grid, **constexprs)
    compiled._init_handles()  # loads the binary: n_regs is known from then on
    props = torch.cuda.get_device_properties(index)
    threads = 32 * compiled.metadata.num_warps
    regs = max(compiled.n_regs, 1)
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    by_regs = props.regs_per_multiprocessor // (per_warp * compiled.metadata.num_warps)
    smem = compiled.metadata.shared + 1024  # the driver reserves 1 KB per block
    by_smem = props.shared_memory_per_multiprocessor // smem if smem else 32
    by_threads = props.max_threads_per_multi_processor // threads
    return max(1, min(by_regs, by_smem, by_threads, 32))


def moe_decode(
    output: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    workspace: torch.Tensor,
    *,
    activation_code: int,
    gated: bool,
    interleaved: bool,
    params: tuple[float, float, float, bool],
    a1_scale: torch.Tensor | None = None,
    x_scale_format: int | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    a2_scale_format: int | None = None,
    mul_routed_weight: bool = True,
    config: DecodeConfig | None = None,
) -> None:
    """output [1, H] = the experts' (weighted) top-k sum for one token, by a prologue and one
    persistent kernel. Inputs are assumed checked by the caller (fused_experts_triton).

    x: [1, K] in the activation dtype, or already FP8 with a1_scale [1, K / 128];
    x_scale_format: quantize x in the prologue with this scale format (quant.kernels' code);
    a2_scale_format: quantize the activations per 1 x 128 group (None: unquantized weights);
    workspace: at least decode_workspace_bytes(...) bytes."""
    top_k = topk_ids.shape[1]
    num_local, _, k_dim = w13.shape
    hidden, intermediate = w2.shape[1], w2.shape[2]
    quantized = a2_scale_format is not None
    on_gpu = x.is_cuda
    programs = _sm_count(x.device.index or 0) if on_gpu else _INTERPRETER_PROGRAMS
    if config is None:
        override = _override.get()
        if isinstance(override, DecodeConfig):
            config = override
        else:
            config = decode_config(top_k, intermediate, hidden, quantized)
    if quantized and (config.block_k1, config.block_k2) != (QUANT_GROUP, QUANT_GROUP):
        raise ValueError(
            "block-scaled FP8 takes block_k1 = block_k2 = 128 (a weight block, an activation "
            f"group), got {config.block_k1} and {config.block_k2}"
        )
    t2 = cdiv(hidden, config.block_n2)
    num_cnt = 2 * top_k + t2
    groups = cdiv(k_dim, QUANT_GROUP)
    groups2 = cdiv(intermediate, QUANT_GROUP)
    act_dtype = torch.float32 if quantized else output.dtype
    parts = [
        ((top_k, intermediate), act_dtype),
        ((top_k, hidden), output.dtype),
        ((2 * top_k + cdiv(hidden, 16),), torch.int32),
    ]
    if quantized:
        parts += [((top_k, intermediate), FP8_DTYPE), ((top_k, groups2), torch.float32)]
        parts += [((k_dim,), FP8_DTYPE), ((groups,), torch.float32)]
    views = _carve(workspace, parts)
    act, y, counters = views[:3]
    a2, a2_scale = (views[3], views[4]) if quantized else (act, act)
    if x_scale_format is not None:
        a, a_scale = views[5], views[6]
    else:
        a, a_scale = x.view(-1), (a1_scale.view(-1) if a1_scale is not None else x.view(-1))
    ids = topk_ids.view(-1)
    round_in_fp32 = not on_gpu
    pdl = pdl_args(x)
    launch(
        _decode_prologue_kernel,
        (1,),
        (x.view(-1), a, a_scale, counters, num_cnt, k_dim, groups),
        dict(
            QUANT_X=x_scale_format is not None,
            SCALE_FORMAT=0 if x_scale_format is None else x_scale_format,
            GROUPS=min(8, next_power_of_2(groups)),
            BLOCK_C=min(1024, next_power_of_2(num_cnt)),
            ROUND_IN_FP32=round_in_fp32,
            num_warps=4,
            **pdl,
        ),
        on_gpu,
    )
    dummy = ids
    alpha, beta, limit, has_limit = params
    w_block = w13_scale is not None
    items = top_k * (cdiv(intermediate, config.block_n1) + t2)
    args = (
        a, a_scale,
        w13, w13.stride(0), w13.stride(1),
        *((w13_scale, *w13_scale.stride()) if w_block else (dummy, 0, 0, 0)),
        *((w13_bias, w13_bias.stride(0)) if w13_bias is not None else (dummy, 0)),
        w2, w2.stride(0), w2.stride(1),
        *((w2_scale, *w2_scale.stride()) if w_block else (dummy, 0, 0, 0)),
        *((w2_bias, w2_bias.stride(0)) if w2_bias is not None else (dummy, 0)),
        ids, ids if expert_map is None else expert_map, topk_weights.view(-1),
        act, a2, a2_scale, y, output.view(-1), counters,
        k_dim, intermediate, hidden,
        num_local if expert_map is None else expert_map.shape[0], num_local,
        alpha, beta, limit,
    )  # fmt: skip
    constexprs = dict(
        TOP_K=top_k,
        ACTIVATION=activation_code,
        GATED=gated,
        INTERLEAVED=interleaved,
        HAS_LIMIT=has_limit,
        W_BLOCK=w_block,
        A2_QUANT=quantized,
        A2_SCALE_FORMAT=0 if a2_scale_format is None else a2_scale_format,
        HAS_B1=w13_bias is not None,
        HAS_B2=w2_bias is not None,
        HAS_MAP=expert_map is not None,
        MUL_WEIGHT=mul_routed_weight,
        H_DTYPE=_TL_DTYPE[output.dtype],
        DOT_PRECISION="ieee" if (x.dtype == torch.float32 or not on_gpu) else "tf32",
        ROUND_IN_FP32=round_in_fp32,
        UPCAST=not on_gpu,
        BLOCK_N1=config.block_n1,
        BLOCK_K1=config.block_k1,
        BLOCK_N2=config.block_n2,
        BLOCK_K2=config.block_k2,
        QUANT_GROUPS=min(8, next_power_of_2(groups2)),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl,
    )
    if not on_gpu:
        launch(_moe_decode_kernel, (_INTERPRETER_PROGRAMS,), args, constexprs, False)
        return
    constexprs["launch_cooperative_grid"] = True
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    key = (index, *constexprs.values())
    per_sm = _RESIDENT.get(key)
    if per_sm is None:
        per_sm = _resident_per_sm(_moe_decode_kernel, (1,), args, constexprs, index)
        _RESIDENT[key] = per_sm
    grid = (min(programs * min(per_sm, config.programs_per_sm), items),)
    launch(_moe_decode_kernel, grid, args, constexprs, True)


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
