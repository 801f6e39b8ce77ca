"""The weight-only expert GEMM: 4- and 8-bit weights dequantized in the load path, activations
in bf16 / fp16, for GPUs without a tensor-core instruction for these formats (Hopper and older).

Legend: S = M * k slots, E_l local experts, K the reduced width, N_w the rows of w per expert,
N the output width (N_w / 2 for a gated activation fused in, else N_w), BN x BM x BK the tile.

Operands are swapped: a program computes a BN x BM tile of the transposed output, BN weight
rows (output channels) by BM routed rows (slots),

    rows   = sorted_token_ids[block * BM : (block + 1) * BM]      # slots; S = padding
    e      = expert_ids[block]
    acc    = sum over K tiles of  deq(w[e, cols, k_tile]) @ A[rows // A_ROW_DIV, k_tile].T

so the weights, dequantized in registers, are the left operand of the tensor-core product (on
Hopper, wgmma reads its left operand from registers: the dequantized tile does not go back
through shared memory) and the slots the right one, as narrow as 16 columns (decode: one to a
few slots per expert, where a token-major tile would pad each expert's rows to 16 or 64).

Weight formats (W_FORMAT) and deq(w) per element, in float32, rounded once to the dot dtype:

    MXFP4  uint8 [E_l, N_w, K/2]: two E2M1 codes per byte along K, the even k in the low nibble;
           E8M0 scales uint8 [E_l, N_w, K/32]:           e2m1(code) * 2 ** (s - 127)
    NVFP4  the same packing; e4m3 scales [E_l, N_w, K/16] and a float32 global scale [E_l]:
                                                         e2m1(code) * (s * g)
    INT4   the same packing of unsigned codes q; float scales [E_l, N_w, K/G] (float32, float16
           or bfloat16) and zero points uint8 [E_l, N_w, K/G], or 8:  (q - zero) * s
    INT8   int8 [E_l, N_w, K]; float scales [E_l, N_w, K/G]:  q * s;  or per channel [E_l, N_w]:
           q (exact in bf16 and fp16), the scale applied to the accumulator

E2M1 codes are decoded with two integer ops and one multiply: the code's 3 magnitude bits are
placed in the exponent's low bits and the mantissa's top bit of a float32, which then holds
e2m1 * 2 ** -126 (the zero exponent makes 0.5 the subnormal it must be), times 2 ** 126. The MX
and NVFP4 products are exact in float32, and so is the MX value in bf16 (at most 2 significant
bits times a power of two); NVFP4 and INT rounded to bf16 lose what the torch twin keeps
(float64 throughout), within the documented bound of each format.

Then the triton backend's epilogues (fusedmoe.kernels.moe_gemm), on the transposed tile:

    GEMM1:  h = round(acc + bias) to the activation dtype, a = act(h_gate, h_up), stored as the
            activation dtype at row `slot` of a2 [S, N]
    GEMM2:  y = round(acc + bias) * topk_weights[slot], stored at row `slot` of [S, N]

and moe_sum adds each token's k rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedmoe._pdl import pdl_wait
from fusedmoe.kernels.moe_gemm import _activation, _e8m0_to_float, _round_to

# weight formats
WF_MXFP4, WF_NVFP4, WF_INT4, WF_INT8 = 0, 1, 2, 3
_WF_MXFP4 = tl.constexpr(WF_MXFP4)
_WF_NVFP4 = tl.constexpr(WF_NVFP4)
_WF_INT4 = tl.constexpr(WF_INT4)
_WF_INT8 = tl.constexpr(WF_INT8)
_ACT_NONE = tl.constexpr(-1)
_ACT_SWIGLUOAI = tl.constexpr(2)  # interleaved gate / up rows


@triton.jit
def _e2m1_to_float(code):
    """4-bit E2M1 codes (int32 in [0, 16)) -> float32 values, exactly (see the module doc)."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2 ** 126


@triton.jit
def _group_scales(
    s_ptrs_base, stride_sk, z_ptrs_base, stride_zk, g_scale, k0, K, n_mask,
    W_FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """(scales, zeros) of the COLS groups from k0 // GROUP, float32 [BN, COLS] each (zeros:
    INT4 only, else 0)."""
    groups = k0 // GROUP + tl.arange(0, COLS)
    mask = n_mask[:, None] & (groups < tl.cdiv(K, GROUP))[None, :]
    s_ptrs = s_ptrs_base[:, None] + groups[None, :] * stride_sk
    if W_FORMAT == _WF_MXFP4:
        scale = _e8m0_to_float(tl.load(s_ptrs, mask=mask, other=127))
    elif W_FORMAT == _WF_NVFP4:
        scale = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32) * g_scale
    else:
        scale = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    zero = tl.zeros_like(scale)
    if W_FORMAT == _WF_INT4:
        if HAS_ZERO:
            zero = tl.load(z_ptrs_base[:, None] + groups[None, :] * stride_zk, mask=mask, other=0)
            zero = zero.to(tl.float32)
        else:
            zero = zero + 8.0
    return scale, zero


@triton.jit
def _dequant_tile(
    w_rows_ptr, stride_wk, s_rows_ptr, stride_sk, z_rows_ptr, stride_zk, g_scale, k0, K, n_mask,
    W_FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """deq(w) of rows `w_rows_ptr` [BN] (pointers to each row's start) and logical columns
    k0 .. k0 + BK: [BN, BK] in DOT_DTYPE (columns past K read as 0)."""
    PACKED: tl.constexpr = W_FORMAT != _WF_INT8
    PER_CHANNEL: tl.constexpr = GROUP == 0
    if PACKED:
        HALF: tl.constexpr = BLOCK_K // 2
        cols = k0 // 2 + tl.arange(0, HALF)
        ptrs = w_rows_ptr[:, None] + cols[None, :] * stride_wk
        if EVEN_K:
            packed = tl.load(ptrs, mask=n_mask[:, None], other=0)
        else:
            packed = tl.load(ptrs, mask=n_mask[:, None] & (cols < K // 2)[None, :], other=0)
        packed = packed.to(tl.int32)
        low = packed & 15
        high = (packed >> 4) & 15
        if W_FORMAT == _WF_INT4:
            low = low.to(tl.float32)
            high = high.to(tl.float32)
        else:
            low = _e2m1_to_float(low)
            high = _e2m1_to_float(high)
        # the pairs (low, high) of logical columns 2c, 2c + 1: groups of GROUP / 2 pairs
        if BLOCK_K >= GROUP:
            COLS: tl.constexpr = BLOCK_K // GROUP
            scale, zero = _group_scales(
                s_rows_ptr, stride_sk, z_rows_ptr, stride_zk, g_scale, k0, K, n_mask, W_FORMAT,
                HAS_ZERO, GROUP, COLS,
            )  # fmt: skip
            low = tl.reshape(low, (BLOCK_N, COLS, GROUP // 2))
            high = tl.reshape(high, (BLOCK_N, COLS, GROUP // 2))
            if W_FORMAT == _WF_INT4:
                low = low - zero[:, :, None]
                high = high - zero[:, :, None]
            low = tl.reshape(low * scale[:, :, None], (BLOCK_N, HALF))
            high = tl.reshape(high * scale[:, :, None], (BLOCK_N, HALF))
        else:  # one group covers the tile
            scale, zero = _group_scales(
                s_rows_ptr, stride_sk, z_rows_ptr, stride_zk, g_scale, k0, K, n_mask, W_FORMAT,
                HAS_ZERO, GROUP, 1,
            )  # fmt: skip
            if W_FORMAT == _WF_INT4:
                low = low - zero
                high = high - zero
            low = low * scale
            high = high * scale
        w = tl.reshape(tl.join(low.to(DOT_DTYPE), high.to(DOT_DTYPE)), (BLOCK_N, BLOCK_K))
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        ptrs = w_rows_ptr[:, None] + cols[None, :] * stride_wk
        if EVEN_K:
            q = tl.load(ptrs, mask=n_mask[:, None], other=0)
        else:
            q = tl.load(ptrs, mask=n_mask[:, None] & (cols < K)[None, :], other=0)
        if PER_CHANNEL:
            w = q.to(DOT_DTYPE)
        elif BLOCK_K >= GROUP:
            COLS2: tl.constexpr = BLOCK_K // GROUP
            scale, zero = _group_scales(
                s_rows_ptr, stride_sk, z_rows_ptr, stride_zk, g_scale, k0, K, n_mask, W_FORMAT,
                False, GROUP, COLS2,
            )  # fmt: skip
            w = tl.reshape(q.to(tl.float32), (BLOCK_N, COLS2, GROUP)) * scale[:, :, None]
            w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(DOT_DTYPE)
        else:
            scale, zero = _group_scales(
                s_rows_ptr, stride_sk, z_rows_ptr, stride_zk, g_scale, k0, K, n_mask, W_FORMAT,
                False, GROUP, 1,
            )  # fmt: skip
            w = (q.to(tl.float32) * scale).to(DOT_DTYPE)
    return w


@triton.jit
def _mx_operand(
    w_rows_ptr, stride_wk, s_rows_ptr, stride_sk, k0, K, n_mask, EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The packed MXFP4 tile [BN, BK / 2] (uint8) and its E8M0 scales [BN, BK / 32], as
    tl.dot_scaled takes them (columns past K: code 0, scale 1)."""
    cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    ptrs = w_rows_ptr[:, None] + cols[None, :] * stride_wk
    s_ptrs = s_rows_ptr[:, None] + groups[None, :] * stride_sk
    if EVEN_K:
        packed = tl.load(ptrs, mask=n_mask[:, None], other=0)
        scales = tl.load(s_ptrs, mask=n_mask[:, None], other=127)
    else:
        packed = tl.load(ptrs, mask=n_mask[:, None] & (cols < K // 2)[None, :], other=0)
        scales = tl.load(s_ptrs, mask=n_mask[:, None] & (groups < K // 32)[None, :], other=127)
    return packed, scales


@triton.jit
def _wo_gemm_kernel(
    a_ptr, stride_am, stride_ak,  # [rows of A, K] activation dtype
    w_ptr, stride_we, stride_wn, stride_wk,  # [E_l, N_w, K / 2] uint8 | [E_l, N_w, K] int8
    s_ptr, stride_se, stride_sn, stride_sk,  # scales [E_l, N_w, K / GROUP] | [E_l, N_w]
    z_ptr, stride_ze, stride_zn, stride_zk,  # INT4 zero points uint8 [E_l, N_w, K / GROUP]
    gs_ptr,  # NVFP4 global scales float32 [E_l]
    bias_ptr, stride_be, stride_bn,  # [E_l, N_w]
    out_ptr, stride_om, stride_on,  # [S, N]
    topk_weights_ptr,  # float32 [S]
    sorted_ids_ptr, expert_ids_ptr, num_post_ptr,  # moe_align's AlignedRouting
    ids_ptr, map_ptr,  # DIRECT: topk_ids [S] and expert_map [E]
    num_ids, num_local,
    N, K, num_slots, max_blocks,
    alpha, beta, limit,
    A_ROW_DIV: tl.constexpr,  # k for GEMM1 (x is per token), 1 for GEMM2
    W_FORMAT: tl.constexpr,
    GROUP: tl.constexpr,  # scale group along K (0: INT8 per channel)
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # -1 for GEMM2
    GATED: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    H_DTYPE: tl.constexpr,  # where the reference rounds h (the activation dtype)
    DOT_DTYPE: tl.constexpr,  # the operands' dtype in the dot (fp32 on the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no tf32)
    MX_DOT: tl.constexpr,  # MXFP4 through tl.dot_scaled (A in bf16 / fp16: its A_FORMAT)
    A_FORMAT: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # slots per tile (the dot's N)
    BLOCK_N: tl.constexpr,  # weight rows per tile (the dot's M)
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DIRECT: tl.constexpr,  # one block per slot (M = 1)
    HAS_MAP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(max_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    if DIRECT:
        expert = tl.load(ids_ptr + pid_m).to(tl.int32)
        expert = tl.where(expert < num_ids, expert, -1)
        if HAS_MAP:
            expert = tl.load(map_ptr + expert, mask=expert >= 0, other=-1).to(tl.int32)
        if (expert < 0) | (expert >= num_local):
            return
        e = expert.to(tl.int64)
        slots = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_slots)
    else:
        num_post = tl.load(num_post_ptr)
        if pid_m * BLOCK_M >= num_post:
            return
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = slots < num_slots
    a_rows = (slots // A_ROW_DIV).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
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
    gate_rows = gate_rows.to(tl.int64)
    up_rows = up_rows.to(tl.int64)
    wg_rows = w_ptr + e * stride_we + gate_rows * stride_wn
    wu_rows = w_ptr + e * stride_we + up_rows * stride_wn
    sg_rows = s_ptr + e * stride_se + gate_rows * stride_sn
    su_rows = s_ptr + e * stride_se + up_rows * stride_sn
    zg_rows = z_ptr + e * stride_ze + gate_rows * stride_zn
    zu_rows = z_ptr + e * stride_ze + up_rows * stride_zn
    g_scale = 1.0
    if W_FORMAT == _WF_NVFP4:
        g_scale = tl.load(gs_ptr + e)

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None] * stride_ak  # [BK, BM]
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_mask[None, :] & (offs_k[:, None] < K - k0), other=0.0)
        if MX_DOT:  # Triton's own E2M1 upcast and scaling, in the dot operand's layout
            w_g, s_g = _mx_operand(
                wg_rows, stride_wk, sg_rows, stride_sk, k0, K, n_mask, EVEN_K, BLOCK_K
            )
            acc_g = tl.dot_scaled(w_g, s_g, "e2m1", a, None, A_FORMAT, acc_g, fast_math=True)
            if GATED:
                w_u, s_u = _mx_operand(
                    wu_rows, stride_wk, su_rows, stride_sk, k0, K, n_mask, EVEN_K, BLOCK_K
                )
                acc_u = tl.dot_scaled(w_u, s_u, "e2m1", a, None, A_FORMAT, acc_u, fast_math=True)
        else:
            a = a.to(DOT_DTYPE)
            w_g = _dequant_tile(
                wg_rows, stride_wk, sg_rows, stride_sk, zg_rows, stride_zk, g_scale, k0, K,
                n_mask, W_FORMAT, HAS_ZERO, GROUP, EVEN_K, DOT_DTYPE, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            acc_g = tl.dot(w_g, a, acc_g, input_precision=DOT_PRECISION)
            if GATED:
                w_u = _dequant_tile(
                    wu_rows, stride_wk, su_rows, stride_sk, zu_rows, stride_zk, g_scale, k0, K,
                    n_mask, W_FORMAT, HAS_ZERO, GROUP, EVEN_K, DOT_DTYPE, BLOCK_N, BLOCK_K,
                )  # fmt: skip
                acc_u = tl.dot(w_u, a, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak

    if GROUP == 0:  # INT8 per channel: the scale of each row, on the accumulator
        acc_g *= tl.load(sg_rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_u *= tl.load(su_rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        bias_base = bias_ptr + e * stride_be
        acc_g += tl.load(bias_base + gate_rows * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[
            :, None
        ]
        if GATED:
            acc_u += tl.load(bias_base + up_rows * stride_bn, mask=n_mask, other=0.0).to(
                tl.float32
            )[:, None]

    slot_rows = slots.to(tl.int64)
    out_mask = n_mask[:, None] & row_mask[None, :]
    out_ptrs = out_ptr + slot_rows[None, :] * stride_om + offs_n[:, None] * stride_on  # [BN, BM]
    if ACTIVATION == _ACT_NONE:
        y = acc_g
        if MUL_ROUTED_WEIGHT:
            # rounded where the reference stores a slot's output, then weighted by finalize
            y = _round_to(y, H_DTYPE, ROUND_IN_FP32)
            tw = tl.load(topk_weights_ptr + slot_rows, mask=row_mask, other=0.0)
            y = y * tw[None, :]
        y = _round_to(y, out_ptr.dtype.element_ty, ROUND_IN_FP32)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    h_g = _round_to(acc_g, H_DTYPE, ROUND_IN_FP32)
    h_u = _round_to(acc_u, H_DTYPE, ROUND_IN_FP32)
    act = _activation(h_g, h_u, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
    act = _round_to(act, out_ptr.dtype.element_ty, ROUND_IN_FP32)
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=out_mask)
