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

On the PTX path, E2M1 codes are decoded by placing the code's 3 magnitude bits in the exponent's
low bits and the mantissa's top bit of a bf16, which then holds e2m1 * 2 ** -126 (the zero
exponent makes 0.5 the subnormal it must be), times 2 ** 126; elsewhere by
moe_gemm.e2m1_to_float. The MX products are exact in float32 and in bf16 (at most 2
significant bits times a power of two); NVFP4 and INT4 are rounded to bf16 (on the PTX path
twice: each group's scale, then each product), which the torch twin (float64 throughout)
does not do.

Then the triton backend's epilogues (fusedmoe.kernels.moe_gemm), on the transposed tile:

    GEMM1:  h = round(acc + bias) to the activation dtype, a = act(h_gate, h_up), stored as the
            activation dtype at row `slot` of a2 [S, N]
    GEMM2:  y = round(acc + bias) * topk_weights[slot], stored at row `slot` of [S, N]

and moe_sum adds each token's k rows.

Variants (constexpr):
    USE_ASM     CUDA, bf16 activations, 4-bit weights: the codes decoded in PTX on packed words,
                two bf16 values per instruction (_FP4_ASM, _INT4_ASM); elsewhere Triton ops
    MX_DOT      MXFP4 x fp16 on CUDA (or FUSEDMOE_WO_DOT_SCALED=1): tl.dot_scaled
    MMA_ORDER   opt-in (FUSEDMOE_WO_MMA_ORDER=1), 64 x 128 tiles on 4 warps: rows and k relabelled
                so that the coalesced load's registers are wgmma's left operand (no shared-memory
                round trip for the weights), scales loaded one per byte; slower as it stands
    _wo_gemv_kernel   decode: one slot x BN rows per program on the CUDA cores, no tensor cores

The loads of K step k + 1 are issued before the math of step k: Triton does not pipeline loads
whose values are decoded in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedmoe._pdl import pdl_wait
from fusedmoe.kernels.moe_gemm import (
    e2m1_to_float,
    e8m0_to_float,
    epilogue_activation,
    gate_up_rows,
    grouped_tile,
    round_to,
)

# weight formats
WF_MXFP4, WF_NVFP4, WF_INT4, WF_INT8 = 0, 1, 2, 3
_WF_MXFP4 = tl.constexpr(WF_MXFP4)
_WF_NVFP4 = tl.constexpr(WF_NVFP4)
_WF_INT4 = tl.constexpr(WF_INT4)
_WF_INT8 = tl.constexpr(WF_INT8)
_ACT_NONE = tl.constexpr(-1)


# 4-bit decoding in PTX on 32-bit words, two bf16 values per instruction (USE_ASM: CUDA, bf16
# activations). Each word holds 4 packed bytes; prmt spreads bytes 0, 1 (and 2, 3) into the low
# byte of the two 16-bit halves of a register x (its bytes 1 and 3 zero), where both halves take
# the same shifts and masks.
#   E2M1: bf16 bits = sign << 15 | magnitude << 6, which is e2m1 * 2 ** -126 (the module
#   docstring), then times 2 ** 126 and the scale. Low nibbles: ((x << 6) | (x << 12)) & mask,
#   exact because x << 6 is zero at the sign bits and x << 12 zero at the magnitude bits. High
#   nibbles: (x & 0x00F000F0) * 260 & mask (x << 2 and x << 8 of the isolated nibbles do not
#   overlap, so the product is their union). Per 8 values: 8 integer-pipe instructions (2 prmt,
#   6 lop3) and 6 multiply-adds (shifts and the multiply), before the 4 products.
#   INT4: bf16 bits = 0x4300 | q, which is 128 + q exactly; plus the offset -(128 + zero) (exact),
#   times the scale.
# Products use fma.rn.bf16x2 with -0.0 added (sm_80 on; mul.bf16x2 needs sm_90).


def fp4_asm(times_2_126: bool, word_scale: bool = False) -> str:
    """The E2M1 decode above on a word of 4 bytes -> 4 registers of bf16 pairs (low nibbles of
    bytes 0, 1), (of 2, 3), (high nibbles of 0, 1), (of 2, 3), each times the scale ($5 for
    bytes 0, 1, $6 for 2, 3: bf16 scales, packed two a register); times_2_126: first times 2 **
    126 (the values are then e2m1 * scale; without it, e2m1 * 2 ** -126 * scale, for a scale
    that carries the 2 ** 126). word_scale: the scales are 32-bit, one register a byte ($5 ..
    $8), each the scale twice as a bf16 pair, and bytes 0, 1 share one, as do 2, 3 ($5 and $7
    are read): no packing of scales into pairs per call."""
    bias = ", bias" if times_2_126 else ""
    scale_regs = (5, 7) if word_scale else (5, 6)
    low = "\n".join(
        f"shl.b32 t, {r}, 6;\nshl.b32 u, {r}, 12;\nlop3.b32 ${out}, t, u, keep, 0xA8;"
        for out, r in ((0, "x"), (1, "y"))
    )
    high = "\n".join(
        f"and.b32 t, {r}, 0x00F000F0;\nmul.lo.u32 t, t, 260;\nand.b32 ${out}, t, keep;"
        for out, r in ((2, "x"), (3, "y"))
    )
    products = [f"fma.rn.bf16x2 ${i}, ${i}, bias, nzero;" for i in range(4)] if times_2_126 else []
    products += [f"fma.rn.bf16x2 ${i}, ${i}, ${scale_regs[i % 2]}, nzero;" for i in range(4)]
    return "\n".join([
        "", "{",
        f".reg .b32 x, y, t, u, keep{bias}, nzero;",
        "mov.b32 keep, 0x81C081C0;",
        *(["mov.b32 bias, 0x7E807E80;"] if times_2_126 else []),
        "mov.b32 nzero, 0x80008000;",
        "prmt.b32 x, $4, 0, 0x5140;",
        "prmt.b32 y, $4, 0, 0x7362;",
        low,
        high,
        *products,
        "}", "",
    ])  # fmt: skip


_FP4_ASM = tl.constexpr(fp4_asm(True))
_INT4_ASM = tl.constexpr("""
{
.reg .b32 x, y, t, low, magic, one, nzero;
mov.b32 low, 0x000F000F;
mov.b32 magic, 0x43004300;
mov.b32 one, 0x3F803F80;
mov.b32 nzero, 0x80008000;
prmt.b32 x, $4, 0, 0x5140;
prmt.b32 y, $4, 0, 0x7362;
lop3.b32 $0, x, low, magic, 0xEA;
lop3.b32 $1, y, low, magic, 0xEA;
shr.b32 t, x, 4;
lop3.b32 $2, t, low, magic, 0xEA;
shr.b32 t, y, 4;
lop3.b32 $3, t, low, magic, 0xEA;
fma.rn.bf16x2 $0, $0, one, $5;
fma.rn.bf16x2 $1, $1, one, $6;
fma.rn.bf16x2 $2, $2, one, $5;
fma.rn.bf16x2 $3, $3, one, $6;
fma.rn.bf16x2 $0, $0, $7, nzero;
fma.rn.bf16x2 $1, $1, $8, nzero;
fma.rn.bf16x2 $2, $2, $7, nzero;
fma.rn.bf16x2 $3, $3, $8, nzero;
}
""")


@triton.jit
def _fp4_pairs_bf16(packed, scale):
    """uint8 E2M1 pairs [...] and a bf16 scale per byte -> (even-k values, odd-k values), bf16."""
    return tl.inline_asm_elementwise(
        _FP4_ASM, "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _int4_pairs_bf16(packed, offset, scale):
    """uint8 INT4 pairs, bf16 -(128 + zero) and scale per byte -> (even-k, odd-k values)."""
    return tl.inline_asm_elementwise(
        _INT4_ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, offset, scale],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _per_byte(values, BLOCK_N: tl.constexpr, COLS: tl.constexpr, HALF: tl.constexpr):
    """[BN, COLS] group values -> [BN, HALF], each repeated over its group's bytes."""
    per = tl.broadcast_to(values[:, :, None], (BLOCK_N, COLS, HALF // COLS))
    return tl.reshape(per, (BLOCK_N, HALF))


@triton.jit
def _mma_rows_bytes(t):
    """[64, 64] tile (row rho = 32a + 8b + j, byte c = 16q + t) -> rows i = 16b + 8a + j and
    bytes 4t + q: the order in which a coalesced load's registers (4 warps, 16 bytes a thread)
    already hold wgmma's left operand for 4 warps (see MMA_ORDER), so that no data moves."""
    t = tl.reshape(t, (2, 4, 8, 4, 16))
    t = tl.permute(t, (1, 0, 2, 4, 3))
    return tl.reshape(t, (64, 64))


@triton.jit
def _mma_k(a, BLOCK_M: tl.constexpr):
    """[128, BM] activations, k = 32q + 2t + h -> the tensor order 8t + 2q + h of the weights'
    k after _mma_rows_bytes and the nibble join (the dot sums over k: any common order)."""
    a = tl.reshape(a, (4, 16, 2, BLOCK_M))
    a = tl.permute(a, (1, 0, 2, 3))
    return tl.reshape(a, (128, BLOCK_M))


@triton.jit
def _load_tile(
    w_rows_ptr, stride_wk, s_rows_ptr, stride_sk, z_rows_ptr, stride_zk, k0, K, n_mask,
    W_FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_BYTE: tl.constexpr = False,
):  # fmt: skip
    """The stored bytes of the weight tile of logical columns k0 .. k0 + BK, as loaded (nothing
    reads them until the next K step: the loads of one step overlap the math of the previous):
    (w [BN, BK / 2] uint8 or [BN, BK] int8, scales [BN, COLS], zero points [BN, COLS] or the
    scales again where there are none), COLS = max(BK / GROUP, 1). Columns past K read as code
    0, scale code 127 / 0.0, zero 0."""
    PACKED: tl.constexpr = W_FORMAT != _WF_INT8
    WIDTH: tl.constexpr = BLOCK_K // 2 if PACKED else BLOCK_K
    cols = (k0 // 2 if PACKED else k0) + tl.arange(0, WIDTH)
    w = tl.load(
        w_rows_ptr[:, None] + cols[None, :] * stride_wk,
        mask=n_mask[:, None] & (cols < (K // 2 if PACKED else K))[None, :], other=0,
    )  # fmt: skip
    if GROUP == 0:  # per channel: applied to the accumulator
        scale = w
        zero = w
    else:
        G: tl.constexpr = max(GROUP, 1)  # (GROUP 0 never reaches here; the compiler folds it)
        COLS: tl.constexpr = BLOCK_K // G if BLOCK_K >= G else 1
        groups = k0 // G + tl.arange(0, COLS)
        mask = n_mask[:, None] & (groups < tl.cdiv(K, G))[None, :]
        if PER_BYTE:  # one scale (and zero) per stored byte: the weights' own layout
            byte_groups = (k0 + 2 * tl.arange(0, WIDTH)) // G
            groups = byte_groups
            mask = n_mask[:, None] & (byte_groups < tl.cdiv(K, G))[None, :]
        s_ptrs = s_rows_ptr[:, None] + groups[None, :] * stride_sk
        if W_FORMAT == _WF_MXFP4:
            scale = tl.load(s_ptrs, mask=mask, other=127)
        else:
            scale = tl.load(s_ptrs, mask=mask, other=0.0)
        zero = scale
        if HAS_ZERO:
            zero = tl.load(z_rows_ptr[:, None] + groups[None, :] * stride_zk, mask=mask, other=0)
    return w, scale, zero


@triton.jit
def _decode_tile(
    w, scale, zero, g_scale, W_FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr,
    GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr, MMA_ORDER: tl.constexpr = False,
):  # fmt: skip
    """deq(w) [BN, BK] in DOT_DTYPE from _load_tile's (w, scale, zero); MMA_ORDER (BN 64, BK
    128, 4 warps, USE_ASM): rows and k in _mma_rows_bytes' order."""
    PACKED: tl.constexpr = W_FORMAT != _WF_INT8
    HALF: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = max(GROUP, 1)
    COLS: tl.constexpr = BLOCK_K // G if BLOCK_K >= G else 1
    if GROUP == 0:  # INT8 per channel: the scale goes on the accumulator
        out = w.to(DOT_DTYPE)
    else:
        # scales (and INT4 zero points) of the groups, float32 [BN, COLS]
        if W_FORMAT == _WF_MXFP4:
            s = e8m0_to_float(scale)
        elif W_FORMAT == _WF_NVFP4:
            s = scale.to(tl.float32) * g_scale
        else:
            s = scale.to(tl.float32)
        if HAS_ZERO:  # noqa: SIM108 (a constexpr branch: one side is never built)
            z = zero.to(tl.float32)
        else:
            z = tl.zeros_like(s) + 8.0
        if not PACKED:  # INT8 groups
            if BLOCK_K >= G:
                v = tl.reshape(w.to(tl.float32), (BLOCK_N, COLS, G)) * s[:, :, None]
                out = tl.reshape(v, (BLOCK_N, BLOCK_K)).to(DOT_DTYPE)
            else:
                out = (w.to(tl.float32) * s).to(DOT_DTYPE)
        elif MMA_ORDER:  # scales (and zeros) were loaded one per byte
            w = _mma_rows_bytes(w)
            if USE_ASM:
                s_b = _mma_rows_bytes(s.to(tl.bfloat16))
                if W_FORMAT == _WF_INT4:
                    offset = _mma_rows_bytes((-128.0 - z).to(tl.bfloat16))
                    low, high = _int4_pairs_bf16(w, offset, s_b)
                else:
                    low, high = _fp4_pairs_bf16(w, s_b)
            else:  # the same order in Triton ops (the interpreter checks the permutations)
                s = _mma_rows_bytes(s)
                codes = w.to(tl.int32)
                low = codes & 15
                high = (codes >> 4) & 15
                if W_FORMAT == _WF_INT4:
                    z = _mma_rows_bytes(z)
                    low = (low.to(tl.float32) - z) * s
                    high = (high.to(tl.float32) - z) * s
                else:
                    low = e2m1_to_float(low) * s
                    high = e2m1_to_float(high) * s
                low = low.to(DOT_DTYPE)
                high = high.to(DOT_DTYPE)
            out = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
        elif USE_ASM:
            s_b = _per_byte(s.to(tl.bfloat16), BLOCK_N, COLS, HALF)
            if W_FORMAT == _WF_INT4:
                offset = _per_byte((-128.0 - z).to(tl.bfloat16), BLOCK_N, COLS, HALF)
                low, high = _int4_pairs_bf16(w, offset, s_b)
            else:
                low, high = _fp4_pairs_bf16(w, s_b)
            out = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
        else:
            codes = w.to(tl.int32)
            low = codes & 15
            high = (codes >> 4) & 15
            if W_FORMAT == _WF_INT4:
                low = low.to(tl.float32)
                high = high.to(tl.float32)
            else:
                low = e2m1_to_float(low)
                high = e2m1_to_float(high)
            # the pairs (low, high) of logical columns 2c, 2c + 1: groups of G / 2 pairs
            if BLOCK_K >= G:
                low = tl.reshape(low, (BLOCK_N, COLS, G // 2))
                high = tl.reshape(high, (BLOCK_N, COLS, G // 2))
                if W_FORMAT == _WF_INT4:
                    low = low - z[:, :, None]
                    high = high - z[:, :, None]
                low = tl.reshape(low * s[:, :, None], (BLOCK_N, HALF))
                high = tl.reshape(high * s[:, :, None], (BLOCK_N, HALF))
            else:  # one group covers the tile
                if W_FORMAT == _WF_INT4:
                    low = low - z
                    high = high - z
                low = low * s
                high = high * s
            out = tl.reshape(tl.join(low.to(DOT_DTYPE), high.to(DOT_DTYPE)), (BLOCK_N, BLOCK_K))
    return out


@triton.jit
def _int64_rows(offs_n, N, GATED: tl.constexpr, ACTIVATION: tl.constexpr):
    """moe_gemm.gate_up_rows as int64 (pointer offsets into [E_l, N_w, ...] tensors)."""
    gate_rows, up_rows = gate_up_rows(offs_n, N, GATED, ACTIVATION)
    return gate_rows.to(tl.int64), up_rows.to(tl.int64)


@triton.jit
def _row_pointers(ptr, stride_e, stride_n, e, gate_rows, up_rows):
    """Pointers to the gate rows and the up rows of expert e of a [E_l, N_w, ...] tensor."""
    base = ptr + e * stride_e
    return base + gate_rows * stride_n, base + up_rows * stride_n


@triton.jit
def _load_gate_up(
    wg_rows, sg_rows, zg_rows, wu_rows, su_rows, zu_rows, stride_wk, stride_sk, stride_zk, k0, K,
    n_mask, W_FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr, GATED: tl.constexpr, PER_BYTE: tl.constexpr,
):  # fmt: skip
    """_load_tile of the gate rows and of the up rows (the gate's again when not gated)."""
    wg, sg, zg = _load_tile(
        wg_rows, stride_wk, sg_rows, stride_sk, zg_rows, stride_zk, k0, K, n_mask, W_FORMAT,
        HAS_ZERO, GROUP, BLOCK_K, PER_BYTE,
    )  # fmt: skip
    wu, su, zu = wg, sg, zg
    if GATED:
        wu, su, zu = _load_tile(
            wu_rows, stride_wk, su_rows, stride_sk, zu_rows, stride_zk, k0, K, n_mask, W_FORMAT,
            HAS_ZERO, GROUP, BLOCK_K, PER_BYTE,
        )  # fmt: skip
    return wg, sg, zg, wu, su, zu


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
    USE_ASM: tl.constexpr,  # 4-bit decoding in PTX (CUDA, bf16 activations)
    MMA_ORDER: tl.constexpr,  # 4-bit, BN 64, BK 128, 4 warps: the tile goes to wgmma in place
    A_FORMAT: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # slots per tile (the dot's N)
    BLOCK_N: tl.constexpr,  # weight rows per tile (the dot's M)
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DIRECT: tl.constexpr,  # one block per slot (M = 1)
    HAS_MAP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, BLOCK_N, max_blocks, GROUP_M)

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
    gate_rows, up_rows = _int64_rows(offs_n, N, GATED, ACTIVATION)
    wg_rows, wu_rows = _row_pointers(w_ptr, stride_we, stride_wn, e, gate_rows, up_rows)
    sg_rows, su_rows = _row_pointers(s_ptr, stride_se, stride_sn, e, gate_rows, up_rows)
    zg_rows, zu_rows = _row_pointers(z_ptr, stride_ze, stride_zn, e, gate_rows, up_rows)
    g_scale = 1.0
    if W_FORMAT == _WF_NVFP4:
        g_scale = tl.load(gs_ptr + e)

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None] * stride_ak  # [BK, BM]
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # software pipelining by hand: the loads of step k0 + BK are issued before the math of step
    # k0 (Triton does not pipeline loads whose values are decoded in registers)
    a = tl.load(a_ptrs, mask=row_mask[None, :] & (offs_k[:, None] < K), other=0.0)
    wg, sg, zg, wu, su, zu = _load_gate_up(
        wg_rows, sg_rows, zg_rows, wu_rows, su_rows, zu_rows, stride_wk, stride_sk, stride_zk, 0,
        K, n_mask, W_FORMAT, HAS_ZERO, GROUP, BLOCK_K, GATED, MMA_ORDER,
    )  # fmt: skip
    for k0 in range(0, K, BLOCK_K):
        k1 = k0 + BLOCK_K
        a_next = tl.load(
            a_ptrs + BLOCK_K * stride_ak, mask=row_mask[None, :] & (offs_k[:, None] < K - k1),
            other=0.0,
        )  # fmt: skip
        wg_next, sg_next, zg_next, wu_next, su_next, zu_next = _load_gate_up(
            wg_rows, sg_rows, zg_rows, wu_rows, su_rows, zu_rows, stride_wk, stride_sk,
            stride_zk, k1, K, n_mask, W_FORMAT, HAS_ZERO, GROUP, BLOCK_K, GATED, MMA_ORDER,
        )  # fmt: skip
        if MX_DOT:  # Triton's own E2M1 upcast and scaling
            acc_g = tl.dot_scaled(wg, sg, "e2m1", a, None, A_FORMAT, acc_g, fast_math=True)
            if GATED:
                acc_u = tl.dot_scaled(wu, su, "e2m1", a, None, A_FORMAT, acc_u, fast_math=True)
        else:
            a_dot = a.to(DOT_DTYPE)
            if MMA_ORDER:
                a_dot = _mma_k(a_dot, BLOCK_M)
            w_g = _decode_tile(
                wg, sg, zg, g_scale, W_FORMAT, HAS_ZERO, GROUP, DOT_DTYPE, BLOCK_N, BLOCK_K,
                USE_ASM, MMA_ORDER,
            )  # fmt: skip
            acc_g = tl.dot(w_g, a_dot, acc_g, input_precision=DOT_PRECISION)
            if GATED:
                w_u = _decode_tile(
                    wu, su, zu, g_scale, W_FORMAT, HAS_ZERO, GROUP, DOT_DTYPE, BLOCK_N, BLOCK_K,
                    USE_ASM, MMA_ORDER,
                )  # fmt: skip
                acc_u = tl.dot(w_u, a_dot, acc_u, input_precision=DOT_PRECISION)
        a = a_next
        wg, sg, zg = wg_next, sg_next, zg_next
        wu, su, zu = wu_next, su_next, zu_next
        a_ptrs += BLOCK_K * stride_ak

    if MMA_ORDER:  # the accumulator's row i is the tile's row 32a + 8b + j, i = 16b + 8a + j
        i = tl.arange(0, BLOCK_N)
        offs_n = pid_n * BLOCK_N + (i % 8) + 8 * (i // 16) + 32 * ((i // 8) % 2)
        n_mask = offs_n < N
        gate_rows, up_rows = _int64_rows(offs_n, N, GATED, ACTIVATION)
        sg_rows, su_rows = _row_pointers(s_ptr, stride_se, stride_sn, e, gate_rows, up_rows)
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
            y = round_to(y, H_DTYPE, ROUND_IN_FP32)
            tw = tl.load(topk_weights_ptr + slot_rows, mask=row_mask, other=0.0)
            y = y * tw[None, :]
        y = round_to(y, out_ptr.dtype.element_ty, ROUND_IN_FP32)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    h_g = round_to(acc_g, H_DTYPE, ROUND_IN_FP32)
    h_u = round_to(acc_u, H_DTYPE, ROUND_IN_FP32)
    act = epilogue_activation(h_g, h_u, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
    act = round_to(act, out_ptr.dtype.element_ty, ROUND_IN_FP32)
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _wo_gemv_kernel(
    a_ptr, stride_am, stride_ak,  # [rows of A, K] activation dtype
    w_ptr, stride_we, stride_wn, stride_wk,
    s_ptr, stride_se, stride_sn, stride_sk,
    z_ptr, stride_ze, stride_zn, stride_zk,
    gs_ptr,
    bias_ptr, stride_be, stride_bn,
    out_ptr, stride_om, stride_on,  # [S, N]
    topk_weights_ptr,  # float32 [S]
    ids_ptr, map_ptr,  # topk_ids [S], expert_map [E]
    num_ids, num_local,
    N, K,
    alpha, beta, limit,
    A_ROW_DIV: tl.constexpr,
    W_FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    H_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # what the weights are decoded to before the float32 products
    ROUND_IN_FP32: tl.constexpr,
    USE_ASM: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Decode: one slot x BN weight rows per program, no tensor cores. Each weight element is
    decoded once and multiplied into a float32 partial sum per (row, k lane), summed over k at
    the end: nothing goes through shared memory, so nothing waits on a barrier, and the loads
    of step k + 1 are in flight during the math of step k. For calls whose experts see about
    one slot each (a slot of an expert hit twice reads its weights again)."""
    pdl_wait(PDL)
    slot = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int32)
    expert = tl.where(expert < num_ids, expert, -1)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert, mask=expert >= 0, other=-1).to(tl.int32)
    if (expert < 0) | (expert >= num_local):
        return
    e = expert.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    gate_rows, up_rows = _int64_rows(offs_n, N, GATED, ACTIVATION)
    wg_rows, wu_rows = _row_pointers(w_ptr, stride_we, stride_wn, e, gate_rows, up_rows)
    sg_rows, su_rows = _row_pointers(s_ptr, stride_se, stride_sn, e, gate_rows, up_rows)
    zg_rows, zu_rows = _row_pointers(z_ptr, stride_ze, stride_zn, e, gate_rows, up_rows)
    g_scale = 1.0
    if W_FORMAT == _WF_NVFP4:
        g_scale = tl.load(gs_ptr + e)

    offs_k = tl.arange(0, BLOCK_K)
    a_row = a_ptr + (slot // A_ROW_DIV) * stride_am
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    a = tl.load(a_row + offs_k * stride_ak, mask=offs_k < K, other=0.0)
    wg, sg, zg, wu, su, zu = _load_gate_up(
        wg_rows, sg_rows, zg_rows, wu_rows, su_rows, zu_rows, stride_wk, stride_sk, stride_zk, 0,
        K, n_mask, W_FORMAT, HAS_ZERO, GROUP, BLOCK_K, GATED, False,
    )  # fmt: skip
    for k0 in range(0, K, BLOCK_K):
        k1 = k0 + BLOCK_K
        a_next = tl.load(a_row + (k1 + offs_k) * stride_ak, mask=k1 + offs_k < K, other=0.0)
        wg_next, sg_next, zg_next, wu_next, su_next, zu_next = _load_gate_up(
            wg_rows, sg_rows, zg_rows, wu_rows, su_rows, zu_rows, stride_wk, stride_sk,
            stride_zk, k1, K, n_mask, W_FORMAT, HAS_ZERO, GROUP, BLOCK_K, GATED, False,
        )  # fmt: skip
        a_f = a.to(tl.float32)[None, :]
        w_g = _decode_tile(
            wg, sg, zg, g_scale, W_FORMAT, HAS_ZERO, GROUP, DOT_DTYPE, BLOCK_N, BLOCK_K, USE_ASM
        )
        acc_g += w_g.to(tl.float32) * a_f
        if GATED:
            w_u = _decode_tile(
                wu, su, zu, g_scale, W_FORMAT, HAS_ZERO, GROUP, DOT_DTYPE, BLOCK_N, BLOCK_K,
                USE_ASM,
            )  # fmt: skip
            acc_u += w_u.to(tl.float32) * a_f
        a = a_next
        wg, sg, zg = wg_next, sg_next, zg_next
        wu, su, zu = wu_next, su_next, zu_next

    h_g = tl.sum(acc_g, axis=1)
    h_u = tl.sum(acc_u, axis=1)
    if GROUP == 0:  # INT8 per channel
        h_g *= tl.load(sg_rows, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            h_u *= tl.load(su_rows, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias_base = bias_ptr + e * stride_be
        h_g += tl.load(bias_base + gate_rows * stride_bn, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            h_u += tl.load(bias_base + up_rows * stride_bn, mask=n_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + slot * stride_om + offs_n * stride_on
    if ACTIVATION == _ACT_NONE:
        y = h_g
        if MUL_ROUTED_WEIGHT:
            y = round_to(y, H_DTYPE, ROUND_IN_FP32) * tl.load(topk_weights_ptr + slot)
        y = round_to(y, out_ptr.dtype.element_ty, ROUND_IN_FP32)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        h_g = round_to(h_g, H_DTYPE, ROUND_IN_FP32)
        h_u = round_to(h_u, H_DTYPE, ROUND_IN_FP32)
        act = epilogue_activation(h_g, h_u, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
        act = round_to(act, out_ptr.dtype.element_ty, ROUND_IN_FP32)
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=n_mask)
