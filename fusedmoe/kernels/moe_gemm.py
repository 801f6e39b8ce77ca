"""The expert GEMMs of the Triton backend: a grouped GEMM over the aligned rows (moe_align),
reading its A rows through the sorted slot ids, with the MoE epilogues fused in.

Legend: S = M * k slots, E_l local experts, K the reduced width, N_w the rows of w per
expert, N the output width (N = N_w / 2 for a gated activation fused in, else N_w),
BM / BN / BK the tile. Each program computes one BM x BN output tile of one block of rows:

    rows   = sorted_token_ids[block * BM : (block + 1) * BM]      # slots; S = padding
    e      = expert_ids[block]
    a      = A[rows // A_ROW_DIV]             GEMM1: x [M, K] (token = slot // k); GEMM2: a2 [S, K]
    acc    = sum over K tiles of  a_tile @ w[e, cols, k_tile].T  (* a_scale * w_scale per tile
                                                                  for 128-block scales)
    acc   *= a_scale * w_scale                (per-tensor / per-token / per-channel scales)
    acc   += bias[e, cols]

then one of the epilogues:

    GEMM1, gated:      two accumulators, gate rows and up rows of w13 (halves: c and c + N;
                       gpt-oss interleaved: 2c and 2c + 1);  h = round(acc) to the activation
                       dtype (where the reference stores h);  a = act(h_gate, h_up) in fp32
    GEMM1, non-gated:  a = act(round(acc))
        a is stored as the activation dtype, or as FP8 with the static a2 scale, or as FP8 with
        a scale per 1 x 128 group computed here (the tile holds whole groups), or as fp32 for a
        quantization that needs the whole row or tensor (done after the kernel)
    GEMM2:             y = acc * topk_weights[slot] (unless applied on the input), stored at
                       row `slot` of [S, H]

moe_sum then adds each token's k rows (skipping slots not routed to this rank).

Variants the other backends switch on (compile-time, so the triton backend's code is unchanged):

    CONTIGUOUS   DeepGEMM-style: A is already permuted into expert-aligned runs, so block b
                 reads rows [b * BM, (b + 1) * BM) of A (TMA loads on Hopper) and writes the
                 same rows of out; its expert is expert_ids[b * BM // ALIGN]
    A_QUANT      HPC-style: A arrives in the activation dtype and each K tile is quantized to
                 FP8 here (static per-tensor scale, or a 1 x 128 group scale computed from the
                 tile), as prepare would have: no separate quantization launch
    W_MX / A_MX  MX operands (E8M0 scale per 1 x 32 along K; FP8, or FP4 E2M1 packed two per
                 byte for w): dequantized to bf16 in the load path (exact: the elements have
                 at most 4 significant bits and the scales are powers of two), since Hopper has
                 no MX tensor-core instruction; with 1 x 128 FP8 activations the activation
                 group scale is promoted per K block as for 128-block weights
    OUT_ATOMIC   GEMM2 of the HPC path: y * topk_weight is added atomically into a float32
                 [M, H] accumulator at row slot // k (the top-k reduce fused in); GEMM1 zeroes
                 that accumulator first (ZERO_OUT), so no memset launch is needed
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedmoe._pdl import pdl_start, pdl_wait
from fusedmoe.quant.kernels import (
    FP8_MAX_TL,
    divide_by_group_scale,
    gated_activation,
    quantize_groups,
    round_to_e4m3_grid,
)

# Scale layouts of the A operand (activations) and of w.
A_NONE, A_TENSOR, A_ROW, A_GROUP, A_MX = 0, 1, 2, 3, 4
W_NONE, W_TENSOR, W_CHANNEL, W_BLOCK, W_MX = 0, 1, 2, 3, 4
# A quantized in the kernel (A_QUANT): not, FP8 with a static per-tensor scale, FP8 per 1 x 128
# group with a float32 or a UE8M0 scale.
AQ_NONE, AQ_STATIC, AQ_GROUP, AQ_GROUP_UE8M0 = 0, 1, 2, 3
# What GEMM1 stores (OUT_*) and its activation codes (ACT_NONE: GEMM2, no activation).
OUT_PLAIN, OUT_FP8_STATIC, OUT_FP8_GROUP, OUT_FP8_GROUP_UE8M0, OUT_FP32 = 0, 1, 2, 3, 4
OUT_ATOMIC = 5  # GEMM2: atomically added (float32) into row slot // OUT_ROW_DIV
MX_GROUP = 32  # elements per E8M0 scale along K
ACT_NONE = -1
# the gated codes are those of fusedmoe.quant.kernels (0..4), then:
ACT_GELU_TANH, ACT_SILU_NO_MUL, ACT_GELU_NO_MUL, ACT_RELU2_NO_MUL = 5, 6, 7, 8
QUANT_GROUP = 128  # the 1 x 128 activation groups and 128 x 128 weight blocks

_A_GROUP = tl.constexpr(A_GROUP)
_A_TENSOR = tl.constexpr(A_TENSOR)
_A_ROW = tl.constexpr(A_ROW)
_A_MX = tl.constexpr(A_MX)
_W_MX = tl.constexpr(W_MX)
_AQ_STATIC = tl.constexpr(AQ_STATIC)
_AQ_GROUP = tl.constexpr(AQ_GROUP)
_AQ_GROUP_UE8M0 = tl.constexpr(AQ_GROUP_UE8M0)
_OUT_ATOMIC = tl.constexpr(OUT_ATOMIC)
_MX = tl.constexpr(MX_GROUP)
_W_TENSOR = tl.constexpr(W_TENSOR)
_W_CHANNEL = tl.constexpr(W_CHANNEL)
_W_BLOCK = tl.constexpr(W_BLOCK)
_OUT_PLAIN = tl.constexpr(OUT_PLAIN)
_OUT_FP8_STATIC = tl.constexpr(OUT_FP8_STATIC)
_OUT_FP8_GROUP = tl.constexpr(OUT_FP8_GROUP)
_OUT_FP8_GROUP_UE8M0 = tl.constexpr(OUT_FP8_GROUP_UE8M0)
_ACT_NONE = tl.constexpr(ACT_NONE)
_ACT_SWIGLUOAI = tl.constexpr(2)  # interleaved gate / up rows
_ACT_GELU_TANH = tl.constexpr(ACT_GELU_TANH)
_ACT_SILU_NO_MUL = tl.constexpr(ACT_SILU_NO_MUL)
_ACT_GELU_NO_MUL = tl.constexpr(ACT_GELU_NO_MUL)
_ACT_RELU2_NO_MUL = tl.constexpr(ACT_RELU2_NO_MUL)
_GROUP = tl.constexpr(QUANT_GROUP)
_SCALE_FLOAT32, _SCALE_UE8M0 = tl.constexpr(0), tl.constexpr(1)  # codes of quant.kernels


@triton.jit
def _silu(z):
    return z / (1.0 + tl.exp(-z))


@triton.jit
def epilogue_activation(
    gate, up, alpha, beta, limit, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr
):
    """fp32 -> act in fp32, as fusedmoe.activation defines it (`up` unused when non-gated)."""
    if ACTIVATION == _ACT_GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))
        out = 0.5 * gate * (1.0 + tanh) * up
    elif ACTIVATION == _ACT_SILU_NO_MUL:
        out = _silu(gate)
    elif ACTIVATION == _ACT_GELU_NO_MUL:
        out = gate * 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    elif ACTIVATION == _ACT_RELU2_NO_MUL:
        r = tl.maximum(gate, 0.0)
        out = r * r
    else:
        out = gated_activation(gate, up, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
    return out


@triton.jit
def grouped_tile(pid, N, BLOCK_N: tl.constexpr, max_blocks, GROUP_M: tl.constexpr):
    """Grouped launch order: program pid's (row block, column tile), GROUP_M row blocks sharing
    each column tile of w while it is in L2."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(max_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def gate_up_rows(offs_n, N, GATED: tl.constexpr, ACTIVATION: tl.constexpr):
    """The w13 rows of output columns offs_n: gate and up (halves, or gpt-oss's interleaved
    pairs); a non-gated weight's rows twice."""
    if GATED:
        if ACTIVATION == _ACT_SWIGLUOAI:
            gate_rows = 2 * offs_n
            up_rows = 2 * offs_n + 1
        else:
            gate_rows = offs_n
            up_rows = offs_n + N
    else:
        gate_rows = offs_n
        up_rows = offs_n
    return gate_rows, up_rows


@triton.jit
def round_to(x, DTYPE: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """fp32 x rounded to DTYPE (nearest, ties to even), as fp32. The interpreter's fp32 -> bf16
    cast truncates, so there the rounding is done on the bits (then the cast is exact)."""
    if ROUND_IN_FP32 and tl.bfloat16 == DTYPE:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _load_w_tile(ptrs, offs_k, k_remaining, n_mask, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """The [BK, BN] tile of w at `ptrs` (w[e, cols, k0:k0+BK] transposed)."""
    if EVEN_K:
        w = tl.load(ptrs, mask=n_mask[None, :], other=0.0)
    else:
        w = tl.load(ptrs, mask=n_mask[None, :] & (offs_k[:, None] < k_remaining), other=0.0)
    if UPCAST:
        w = w.to(tl.float32)
    return w


@triton.jit
def _w_tile(
    desc, ptrs, row0, k0, offs_k, k_remaining, n_mask, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    """The [BK, BN] tile of w whose rows start at row0 of w viewed as [E_l * N_w, K]: a TMA
    load through `desc` (rows and columns past the end read as zeros), or pointer loads."""
    if USE_TMA:
        return desc.load([row0, k0]).T
    return _load_w_tile(ptrs, offs_k, k_remaining, n_mask, EVEN_K, UPCAST)


@triton.jit
def _w_scale_vector(
    w_scale_ptr, stride_wse, stride_wsn, stride_wsk, e, w_rows, k_block, n_mask,
    W_SCALE: tl.constexpr,
):  # fmt: skip
    """Scales of w's rows `w_rows` [BN]: per channel, or of their 128 x 128 block k_block."""
    base = w_scale_ptr + e * stride_wse
    if W_SCALE == _W_BLOCK:
        ptrs = base + (w_rows // _GROUP) * stride_wsn + k_block * stride_wsk
    else:
        ptrs = base + w_rows * stride_wsn
    return tl.load(ptrs, mask=n_mask, other=0.0).to(tl.float32)


@triton.jit
def _block_scaled_dot(
    a, w, a_s, w_scale_ptr, stride_wse, stride_wsn, stride_wsk, e, w_rows, first_row, k_block,
    n_mask, DOT_PRECISION: tl.constexpr, UNIFORM: tl.constexpr,
):  # fmt: skip
    """dot(a, w) over one 128-wide K block, times its scales: a_s [BM] per row, and w's of the
    128 x 128 blocks its rows lie in (UNIFORM: all in the block of first_row, one scalar)."""
    part = tl.dot(a, w, input_precision=DOT_PRECISION)
    if UNIFORM:  # fold the one weight scale into a_s: a multiply per row, not per element
        w_s = tl.load(
            w_scale_ptr + e * stride_wse + (first_row // _GROUP) * stride_wsn
            + k_block * stride_wsk
        )  # fmt: skip
        return part * (a_s * w_s)[:, None]
    w_s = _w_scale_vector(
        w_scale_ptr, stride_wse, stride_wsn, stride_wsk, e, w_rows, k_block, n_mask, _W_BLOCK
    )
    return part * a_s[:, None] * w_s[None, :]


@triton.jit
def _store_group_quant(
    act, out_ptrs, out_mask, out_scale_ptr, stride_osm, stride_osn, out_rows, row_mask, pid_n,
    N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_FORMAT: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):  # fmt: skip
    """FP8 per 1 x 128 group of the [BM, BN] activation tile (BN holds whole groups)."""
    GROUPS: tl.constexpr = BLOCK_N // _GROUP
    q, scales = quantize_groups(
        tl.reshape(act, (BLOCK_M, GROUPS, _GROUP)), SCALE_FORMAT, ROUND_IN_FP32
    )
    q = tl.reshape(q, (BLOCK_M, BLOCK_N))
    tl.store(out_ptrs, q.to(out_ptrs.dtype.element_ty), mask=out_mask)
    groups = pid_n * GROUPS + tl.arange(0, GROUPS)
    s_ptrs = out_scale_ptr + out_rows[:, None] * stride_osm + groups[None, :] * stride_osn
    tl.store(s_ptrs, scales, mask=row_mask[:, None] & (groups * _GROUP < N)[None, :])


@triton.jit
def e8m0_to_float(code):
    """uint8 E8M0 codes -> float32 2 ** (code - 127), exactly (code 0: the subnormal 2**-127)."""
    c = code.to(tl.int32)
    normal = (c << 23).to(tl.float32, bitcast=True)
    return tl.where(c == 0, 5.877471754111438e-39, normal)


@triton.jit
def _mx_a_tile(
    a, a_scale_ptr, stride_asm, stride_ask, a_rows, row_mask, k0, K, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """MXFP8 A tile [BM, BK] (e4m3) -> values in DOT_DTYPE, times its 1 x 32 E8M0 scales."""
    groups = k0 // _MX + tl.arange(0, BLOCK_K // _MX)
    codes = tl.load(
        a_scale_ptr + a_rows[:, None] * stride_asm + groups[None, :] * stride_ask,
        mask=row_mask[:, None] & (groups < K // _MX)[None, :], other=127,
    )  # fmt: skip
    x = tl.reshape(a.to(tl.float32), (BLOCK_M, BLOCK_K // _MX, _MX))
    x = x * e8m0_to_float(codes)[:, :, None]
    return tl.reshape(x, (BLOCK_M, BLOCK_K)).to(DOT_DTYPE)


@triton.jit
def e2m1_to_float(code):
    """4-bit E2M1 codes (int32) -> float32: sign, 2 exponent bits, 1 mantissa bit."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    power = tl.where(exponent == 1, 1.0, tl.where(exponent == 2, 2.0, 4.0))  # 2 ** (e - 1)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, power * (1.0 + 0.5 * mantissa))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _mx_w_tile(
    w_base, stride_wn, stride_wk, ws_base, stride_wsn, stride_wsk, w_rows, n_mask, k0, K,
    W_FP4: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The [BK, BN] tile of an MX weight (rows w_rows, logical columns k0 .. k0 + BK) times its
    1 x 32 E8M0 scales, in DOT_DTYPE. FP4: w stores two E2M1 codes per byte along K, the low
    nibble first (logical column 2c in byte c's low nibble)."""
    rows = w_rows.to(tl.int64)[None, :]
    if W_FP4:
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(
            w_base + rows * stride_wn + half[:, None] * stride_wk,
            mask=n_mask[None, :] & (half[:, None] < K // 2), other=0,
        ).to(tl.int32)  # fmt: skip
        low = e2m1_to_float(packed & 0xF)
        high = e2m1_to_float(packed >> 4)
        w = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BLOCK_K, BLOCK_N))
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(
            w_base + rows * stride_wn + cols[:, None] * stride_wk,
            mask=n_mask[None, :] & (cols[:, None] < K), other=0.0,
        ).to(tl.float32)  # fmt: skip
    groups = k0 // _MX + tl.arange(0, BLOCK_K // _MX)
    codes = tl.load(
        ws_base + rows * stride_wsn + groups[:, None] * stride_wsk,
        mask=n_mask[None, :] & (groups[:, None] < K // _MX), other=127,
    )  # fmt: skip
    w = tl.reshape(w, (BLOCK_K // _MX, _MX, BLOCK_N)) * e8m0_to_float(codes)[:, None, :]
    return tl.reshape(w, (BLOCK_K, BLOCK_N)).to(DOT_DTYPE)


@triton.jit
def _quantize_a_tile(
    a, a_scale_ptr, A_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):  # fmt: skip
    """A tile [BM, BK] in the activation dtype -> (FP8 values as fp32, per-row scale [BM]),
    exactly as fusedmoe.quant.quantize makes them: a static per-tensor scale (read from
    a_scale_ptr), or one 1 x 128 group per row (BK == 128) with its scale computed here."""
    x = a.to(tl.float32)
    if A_QUANT == _AQ_STATIC:
        scale = tl.load(a_scale_ptr)
        # x / scale as IEEE division, from one correctly rounded reciprocal: div_rn per element
        # is a long instruction sequence, and these tiles are quantized once per column tile
        y = divide_by_group_scale(x, scale, tl.math.div_rn(1.0, scale))
        y = tl.minimum(tl.maximum(y, -FP8_MAX_TL), FP8_MAX_TL)
        if ROUND_IN_FP32:
            y = round_to_e4m3_grid(y)
        return y, tl.zeros((BLOCK_M,), tl.float32) + scale
    x = tl.reshape(x, (BLOCK_M, 1, BLOCK_K))
    if A_QUANT == _AQ_GROUP_UE8M0:
        y, scale = quantize_groups(x, _SCALE_UE8M0, ROUND_IN_FP32)
    else:
        y, scale = quantize_groups(x, _SCALE_FLOAT32, ROUND_IN_FP32)
    return tl.reshape(y, (BLOCK_M, BLOCK_K)), tl.reshape(scale, (BLOCK_M,))


@triton.jit
def _zero_slice(ptr, numel, BLOCK: tl.constexpr):
    """Zero this program's share of the float32 ptr[0:numel): whole BLOCKs, split over the grid."""
    share = tl.cdiv(tl.cdiv(numel, BLOCK), tl.num_programs(0)) * BLOCK
    start = tl.program_id(0).to(tl.int64) * share
    for off in range(0, share, BLOCK):
        offs = start + off + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros((BLOCK,), tl.float32), mask=offs < numel)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, stride_am, stride_ak,  # [rows of A, K]
    a_desc,  # USE_TMA_A: a TMA descriptor of A (CONTIGUOUS / A_IN_ORDER rows), block [BM, BK]
    a_scale_ptr, stride_asm, stride_ask,  # [1] | [rows of A, 1] | [rows of A, ceil(K/g)]
    w_ptr, stride_we, stride_wn, stride_wk,  # [E_l, N_w, K] (FP4: [E_l, N_w, K/2])
    w_desc,  # USE_TMA: a TMA descriptor of w as [E_l * N_w, K], block [BN, BK]
    w_scale_ptr, stride_wse, stride_wsn, stride_wsk,  # [E_l] | [E_l, N_w] | [E_l, N_w/128, K/128]
                                                      # | MX: uint8 [E_l, N_w, K/32]
    bias_ptr, stride_be, stride_bn,  # [E_l, N_w]
    out_ptr, stride_om, stride_on,  # [S, N] | OUT_ATOMIC: float32 [M, N]
    out_scale_ptr, stride_osm, stride_osn,  # static a2 scale [1] | group scales [S, ceil(N/128)]
    topk_weights_ptr,  # float32 [S]
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr,  # moe_align's AlignedRouting
    ids_ptr, map_ptr,  # DIRECT: topk_ids [S] and expert_map [E] (global -> local, -1 elsewhere)
    num_ids, num_local,  # DIRECT: ids outside [0, num_ids) / map entries outside [0, E_l): skipped
    zero_ptr, zero_numel,  # ZERO_OUT: float32 buffer this launch zeroes (GEMM2's accumulator)
    row_map_ptr,  # A_IN_ORDER / OUT_IN_ORDER: int32 [layout rows]: a slot's row in expert order
    N, K, num_slots, max_blocks,
    alpha, beta, limit,  # activation parameters, defaults resolved
    A_ROW_DIV: tl.constexpr,  # k for GEMM1 (x is per token), 1 for GEMM2 (a2 is per slot)
    A_SCALE: tl.constexpr,
    A_QUANT: tl.constexpr,  # AQ_*: quantize A's tiles here (A in the activation dtype)
    W_SCALE: tl.constexpr,
    W_FP4: tl.constexpr,  # W_MX: w packs two E2M1 codes per byte
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # ACT_NONE for GEMM2
    GATED: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    OUT_MODE: tl.constexpr,
    OUT_ROW_DIV: tl.constexpr,  # OUT_ATOMIC: slot -> output row (k)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    H_DTYPE: tl.constexpr,  # where the reference rounds h (the activation dtype)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no tf32), else the default
    ROUND_IN_FP32: tl.constexpr,  # the interpreter's fp8 casts (see quant.kernels)
    UPCAST: tl.constexpr,  # the interpreter: its tl.dot is wrong for bf16, so dot in fp32
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DIRECT: tl.constexpr,  # one block per slot, no alignment (M = 1: k distinct experts)
    CONTIGUOUS: tl.constexpr,  # A permuted into expert-aligned runs (rows = block rows)
    A_IN_ORDER: tl.constexpr,  # aligned layout: A's rows in expert order (row_map), not slots
    OUT_IN_ORDER: tl.constexpr,  # aligned layout: the output's rows in expert order (row_map)
    ALIGN: tl.constexpr,  # CONTIGUOUS: rows per entry of expert_ids (a multiple of BLOCK_M)
    HAS_MAP: tl.constexpr,
    USE_TMA: tl.constexpr,  # w contiguous with halves (not interleaved) gate / up rows
    USE_TMA_A: tl.constexpr,  # CONTIGUOUS or A_IN_ORDER: TMA loads of A
    W_BLOCK_UNIFORM: tl.constexpr,  # 128-block w: each tile's rows lie in one block of 128
    ZERO_OUT: tl.constexpr,
    MX_DTYPE: tl.constexpr,  # what MX operands are dequantized to: bf16 (fp32 on the interpreter)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_wait(PDL)
    if ZERO_OUT:  # before any early return: every program zeroes its share
        _zero_slice(zero_ptr, zero_numel, 1024)
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, BLOCK_N, max_blocks, GROUP_M)

    if DIRECT:  # block pid_m is slot pid_m alone, in row 0 (the alignment launch is saved)
        expert = tl.load(ids_ptr + pid_m).to(tl.int32)
        expert = tl.where(expert < num_ids, expert, -1)  # never read out of bounds
        if HAS_MAP:
            expert = tl.load(map_ptr + expert, mask=expert >= 0, other=-1).to(tl.int32)
        if (expert < 0) | (expert >= num_local):
            return
        e = expert.to(tl.int64)
        slots = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_slots)
    elif CONTIGUOUS:  # rows of A are the aligned layout's rows; padding rows compute garbage
        num_post = tl.load(num_post_ptr)
        if pid_m * BLOCK_M >= num_post:
            return
        e = tl.load(expert_ids_ptr + pid_m * BLOCK_M // ALIGN).to(tl.int64)
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        num_post = tl.load(num_post_ptr)
        if pid_m * BLOCK_M >= num_post:
            return
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = slots < num_slots
    # A_IN_ORDER / OUT_IN_ORDER (training): buffers of S rows in expert order, no padding. A
    # block's first row is always a slot (padding ends a run), and its slots are consecutive
    # rows from row_map's entry; its padding rows read zeros (masked loads) or, through TMA,
    # the rows after (zeros past the end), and are never stored.
    if A_IN_ORDER or OUT_IN_ORDER:
        first_row = tl.load(row_map_ptr + pid_m * BLOCK_M)
    else:
        first_row = pid_m * BLOCK_M
    in_order = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    a_rows = in_order if A_IN_ORDER else (slots // A_ROW_DIV).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    gate_rows, up_rows = gate_up_rows(offs_n, N, GATED, ACTIVATION)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_base = w_ptr + e * stride_we
    ws_base = w_scale_ptr + e * stride_wse
    k_offsets = offs_k[:, None] * stride_wk
    wg_ptrs = w_base + gate_rows.to(tl.int64)[None, :] * stride_wn + k_offsets  # [BK, BN]
    wu_ptrs = w_base + up_rows.to(tl.int64)[None, :] * stride_wn + k_offsets
    gate_row0 = (e * (stride_we // stride_wn) + pid_n * BLOCK_N).to(tl.int32)  # TMA coordinates
    up_row0 = gate_row0 + N
    # a scale per K block, promoted to fp32 tile by tile (the sum over K does not factor)
    PER_K_BLOCK: tl.constexpr = (W_SCALE == _W_BLOCK) | ((W_SCALE == _W_MX) & (A_SCALE == _A_GROUP))

    acc_dtype = tl.int32 if (a_ptr.dtype.element_ty == tl.int8 and not UPCAST) else tl.float32
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    scaled_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scaled_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_remaining = K - k0
        if USE_TMA_A:
            a = a_desc.load([first_row.to(tl.int32), k0])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            a_mask = row_mask[:, None] & (offs_k[None, :] < k_remaining)
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        k_block = k0 // _GROUP
        if A_QUANT != 0:  # HPC: the FP8 quantization prepare would do, on this tile
            a, a_s = _quantize_a_tile(a, a_scale_ptr, A_QUANT, BLOCK_M, BLOCK_K, ROUND_IN_FP32)
            if not UPCAST:
                a = a.to(tl.float8e4nv)
        elif PER_K_BLOCK:
            a_s = tl.load(
                a_scale_ptr + a_rows * stride_asm + k_block * stride_ask, mask=row_mask, other=0.0
            )
        if A_SCALE == _A_MX:
            a = _mx_a_tile(
                a, a_scale_ptr, stride_asm, stride_ask, a_rows, row_mask, k0, K, MX_DTYPE, BLOCK_M,
                BLOCK_K,
            )  # fmt: skip
        elif W_SCALE == _W_MX:  # FP8 (or bf16) activations against dequantized MX weights
            a = a.to(MX_DTYPE)
        elif UPCAST:
            a = a.to(tl.float32)
        if W_SCALE == _W_MX:
            w_g = _mx_w_tile(
                w_base, stride_wn, stride_wk, ws_base, stride_wsn, stride_wsk, gate_rows, n_mask,
                k0, K, W_FP4, MX_DTYPE, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        else:
            w_g = _w_tile(
                w_desc, wg_ptrs, gate_row0, k0, offs_k, k_remaining, n_mask, EVEN_K, UPCAST,
                USE_TMA,
            )  # fmt: skip
        if W_SCALE == _W_BLOCK:
            scaled_g += _block_scaled_dot(
                a, w_g, a_s, w_scale_ptr, stride_wse, stride_wsn, stride_wsk, e, gate_rows,
                pid_n * BLOCK_N, k_block, n_mask, DOT_PRECISION, W_BLOCK_UNIFORM,
            )  # fmt: skip
        elif PER_K_BLOCK:
            scaled_g += tl.dot(a, w_g, input_precision=DOT_PRECISION) * a_s[:, None]
        else:
            acc_g = tl.dot(a, w_g, acc_g, input_precision=DOT_PRECISION, out_dtype=acc_dtype)
        if GATED:
            if W_SCALE == _W_MX:
                w_u = _mx_w_tile(
                    w_base, stride_wn, stride_wk, ws_base, stride_wsn, stride_wsk, up_rows,
                    n_mask, k0, K, W_FP4, MX_DTYPE, BLOCK_N, BLOCK_K,
                )  # fmt: skip
            else:
                w_u = _w_tile(
                    w_desc, wu_ptrs, up_row0, k0, offs_k, k_remaining, n_mask, EVEN_K, UPCAST,
                    USE_TMA,
                )  # fmt: skip
            if W_SCALE == _W_BLOCK:
                scaled_u += _block_scaled_dot(
                    a, w_u, a_s, w_scale_ptr, stride_wse, stride_wsn, stride_wsk, e, up_rows,
                    N + pid_n * BLOCK_N, k_block, n_mask, DOT_PRECISION, W_BLOCK_UNIFORM,
                )  # fmt: skip
            elif PER_K_BLOCK:
                scaled_u += tl.dot(a, w_u, input_precision=DOT_PRECISION) * a_s[:, None]
            else:
                acc_u = tl.dot(a, w_u, acc_u, input_precision=DOT_PRECISION, out_dtype=acc_dtype)
        a_ptrs += BLOCK_K * stride_ak
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk

    if PER_K_BLOCK:
        h_g = scaled_g
        h_u = scaled_u
    else:
        h_g = acc_g.to(tl.float32)
        h_u = acc_u.to(tl.float32)
        # per-tensor / per-token / per-channel scales factor out of the sum over K
        if A_SCALE == _A_TENSOR:
            a_s = tl.load(a_scale_ptr)
            h_g *= a_s
            h_u *= a_s
        elif A_SCALE == _A_ROW:
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_mask, other=0.0)
            h_g *= a_s[:, None]
            h_u *= a_s[:, None]
        if W_SCALE == _W_TENSOR:
            w_s = tl.load(w_scale_ptr + e * stride_wse)
            h_g *= w_s
            h_u *= w_s
        elif W_SCALE == _W_CHANNEL:
            w_s = _w_scale_vector(
                w_scale_ptr, stride_wse, stride_wsn, stride_wsk, e, gate_rows, 0, n_mask, W_SCALE
            )
            h_g *= w_s[None, :]
            if GATED:
                w_su = _w_scale_vector(
                    w_scale_ptr, stride_wse, stride_wsn, stride_wsk, e, up_rows, 0, n_mask,
                    W_SCALE,
                )  # fmt: skip
                h_u *= w_su[None, :]
    if HAS_BIAS:
        bias_base = bias_ptr + e * stride_be
        bias_g = tl.load(bias_base + gate_rows * stride_bn, mask=n_mask, other=0.0)
        h_g += bias_g.to(tl.float32)[None, :]
        if GATED:
            bias_u = tl.load(bias_base + up_rows * stride_bn, mask=n_mask, other=0.0)
            h_u += bias_u.to(tl.float32)[None, :]

    slot_rows = slots.to(tl.int64)
    out_rows = in_order if OUT_IN_ORDER else slot_rows
    out_mask = row_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    if ACTIVATION == _ACT_NONE:
        y = h_g
        if OUT_MODE == _OUT_ATOMIC:  # the top-k sum: each slot adds into its token's row
            # rounded where the reference stores a slot's output, weighted as finalize does
            y = round_to(y, H_DTYPE, ROUND_IN_FP32)
        if MUL_ROUTED_WEIGHT:
            w = tl.load(topk_weights_ptr + slot_rows, mask=row_mask, other=0.0)
            y = y * w[:, None]
        if OUT_MODE == _OUT_ATOMIC:
            token_ptrs = (
                out_ptr + (slot_rows // OUT_ROW_DIV)[:, None] * stride_om
                + offs_n[None, :] * stride_on
            )  # fmt: skip
            tl.atomic_add(token_ptrs, y, mask=out_mask, sem="relaxed")
            return
        y = round_to(y, out_ptr.dtype.element_ty, ROUND_IN_FP32)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
        return

    # GEMM1: the reference stores h in the activation dtype before the activation reads it
    h_g = round_to(h_g, H_DTYPE, ROUND_IN_FP32)
    h_u = round_to(h_u, H_DTYPE, ROUND_IN_FP32)
    act = epilogue_activation(h_g, h_u, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
    act = tl.where(out_mask, act, 0.0)  # padding must not count in a group's amax
    if OUT_MODE == _OUT_FP8_STATIC:
        scale = tl.load(out_scale_ptr)
        q = divide_by_group_scale(act, scale, tl.math.div_rn(1.0, scale))
        q = tl.minimum(tl.maximum(q, -FP8_MAX_TL), FP8_MAX_TL)
        if ROUND_IN_FP32:
            q = round_to_e4m3_grid(q)
        tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif OUT_MODE == _OUT_FP8_GROUP:
        _store_group_quant(
            act, out_ptrs, out_mask, out_scale_ptr, stride_osm, stride_osn, out_rows, row_mask,
            pid_n, N, BLOCK_M, BLOCK_N, _SCALE_FLOAT32, ROUND_IN_FP32,
        )  # fmt: skip
    elif OUT_MODE == _OUT_FP8_GROUP_UE8M0:
        _store_group_quant(
            act, out_ptrs, out_mask, out_scale_ptr, stride_osm, stride_osn, out_rows, row_mask,
            pid_n, N, BLOCK_M, BLOCK_N, _SCALE_UE8M0, ROUND_IN_FP32,
        )  # fmt: skip
    else:  # OUT_PLAIN (activation dtype) or OUT_FP32 (quantized after the kernel)
        act = round_to(act, out_ptr.dtype.element_ty, ROUND_IN_FP32)
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _moe_sum_kernel(
    y_ptr, stride_ys, stride_yh,  # [S, H] per-slot outputs | HAS_INV: [rows, H] permuted
    out_ptr, stride_om, stride_oh,  # [M, H]
    ids_ptr, stride_im, stride_ik,  # [M, k] global expert ids
    map_ptr,  # [E] global -> local (-1: another rank)
    inv_ptr,  # HAS_INV: int32 [S], the row of y of each slot routed here
    w_ptr, stride_wm, stride_wk,  # MUL_WEIGHT: float32 [M, k] router weights
    b_ptr, stride_be, stride_bh,  # HAS_BIAS: [E_l, H] GEMM2 biases, added to each slot's row
    gate_ptr,  # HAS_GATE: uint8 [1]; 0: write nothing (the launch's path was not chosen)
    H,
    num_ids, num_local,  # ids outside [0, num_ids), map entries outside [0, E_l): not routed
    TOP_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    HAS_INV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    """out[m] = sum_j (w[m, j] *) (y[row(m * k + j)] (+ b[e_j])) over the slots routed to this
    rank, in fp32; row(s) = s, or inv[s] for a permuted y (the DeepGEMM-style contiguous
    layout); e_j the slot's local expert. HAS_GATE: nothing at all where the gate reads 0."""
    pdl_start(PDL)
    if HAS_GATE:  # noqa: SIM102 (a constexpr guard: nothing loaded without it)
        if tl.load(gate_ptr) == 0:
            return
    m = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        gid = tl.load(ids_ptr + m * stride_im + j * stride_ik)
        routed = (gid >= 0) & (gid < num_ids)
        local = gid
        if HAS_MAP:
            local = tl.load(map_ptr + gid, mask=routed, other=-1)
            routed = (local >= 0) & (local < num_local)
        row = m * TOP_K + j
        if HAS_INV:  # entries of slots not routed here are never written: not followed; a
            # row of -1: the layout has no row for the slot (the masked layout's overflow)
            row = tl.where(routed, tl.load(inv_ptr + row), 0).to(tl.int64)
            routed = routed & (row >= 0)
        mask = h_mask & ((tl.zeros((BLOCK_H,), tl.int32) + routed.to(tl.int32)) != 0)
        y = tl.load(y_ptr + row * stride_ys + offs_h * stride_yh, mask=mask, other=0.0)
        y = y.to(tl.float32)
        if HAS_BIAS:
            b_row = b_ptr + tl.where(routed, local, 0).to(tl.int64) * stride_be
            y += tl.load(b_row + offs_h * stride_bh, mask=mask, other=0.0).to(tl.float32)
        if MUL_WEIGHT:
            y *= tl.load(w_ptr + m * stride_wm + j * stride_wk)
        acc += y
    acc = round_to(acc, out_ptr.dtype.element_ty, ROUND_IN_FP32)
    out_ptrs = out_ptr + m * stride_om + offs_h * stride_oh
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=h_mask)
