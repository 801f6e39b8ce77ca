"""MXFP4 x bf16 expert GEMMs for Hopper, written in Gluon: the weights decoded from their 4-bit
bytes straight into wgmma's left operand in registers (both forms), the loads pipelined in
shared memory.

The weight-only GEMM of fusedmoe.kernels.wo_gemm, same operands and epilogues, in two forms
chosen by the tile's slots BM (hopper_block_m): the decode form below (BM <= 64, one
warpgroup) and the prefill form (BM 128, "Prefill" at the end). The decode form: a
program computes a 64 x BM tile of the transposed output (64 weight rows by BM routed slots of
one expert) over K in steps of 256 (two sub-steps of 128, one wgmma each),

    acc[n, m] = sum over k of  deq(w[e, row(n), k]) * A[slot(m) // A_ROW_DIV, k]

Why Gluon (docs/performance.md, "4-bit weight-only experts"): in Triton the decoded tile reaches
wgmma through shared memory and the loads whose values are decoded in registers are not
pipelined; here each thread loads exactly the weight bytes its part of wgmma's left operand
needs, and a ring of STAGES stages of cp.async copies keeps the weights in flight.

The k order. wgmma's left operand gives thread (lane = 4 c' + c) of warp w the rows 16 w + c'
and 16 w + c' + 8 and, of each 16-wide k step s, the columns 2c + b and 8 + 2c + b, one
register per (s, h) holding b = 0, 1. The product sums over k in any order common to both
operands, so each block of 64 columns is relabelled: tensor column t = 16 s + 8 h + 2 c + b
(s, c < 4; h, b < 2) holds logical column

    k(t) = 16 c + 4 s + 2 b + h,

that is nibble h of stored byte 8 c + 2 s + b (E2M1 pairs along K, the even column in the
low nibble). Thread c then reads 8 consecutive bytes of each row per block, all under one
E8M0 scale (group 32), and decoding a run of 4 bytes gives wgmma's registers as they are:
(low nibbles of bytes 0, 1), (of 2, 3), (high nibbles of 0, 1), (of 2, 3). The activations
must come in the same order: `permute_k` writes a copy of x (GEMM1's input) so, GEMM1 stores
its output so (PERMUTE_OUT), and GEMM2 reads it as it is. K and GEMM1's N must be multiples of
64 (weights_unusable_reason checks; the caller asks it before launching).

Per K step (four 64-column blocks): wait for the stage, refill the stage freed by the
previous step (cp.async, STAGES - 1 steps ahead, 16-byte copies: 128 bytes of each weight row
a step, into a shared layout whose 16-byte chunks are swizzled by row), then per sub-step read
this thread's weight bytes (8-byte runs) from the stage, decode them in PTX (fp4_scaled: sign
and magnitude bits placed into a bf16, which holds e2m1 * 2^-126, times the scale as 2^(s -
65): exact, the product e2m1 * 2^(s - 191)), and wgmma with the activation tile, each
operand's decode overlapping the previous operand's wgmma (at most two in flight; the step's
last is waited for before its stage is refilled). The accumulator leaves times 2^64. The
scales load from global memory one step ahead into registers (a byte per row and block: too
small for cp.async), each turned into its bf16 pair once (scale_pair), not per byte. Scale
codes must lie in [59, 192] (2^-68 .. 2^65; real weights' scales are near 2^-8): below,
products lose bits to bf16's subnormals; above, 2^(s - 65) overflows. The kernel is exact
inside that range.

The decode is what bounds the kernel at decode sizes (the integer and multiply-add pipes, not
the memory: docs/performance.md), hence its instruction counts are kept minimal
(wo_gemm.fp4_asm: 8 integer and 6 multiply-add instructions per 8 values, before the
scaling).

Prefill (fusedmoe.kernels.wo_hopper_prefill). With many slots per expert the decode form spends
its time decoding (each weight decoded again for every 64 slots) and waiting on it. The
prefill form decodes each weight once per tile of 128 slots: 8 warps, 256 weight rows in two
sets of 128 (GATED: the gate rows and the up rows of 128 output columns; else 256 output
columns), each set decoded per 64-column K step straight into wgmma's left operand in
registers (64 rows a warpgroup, the k order above), the slots' activations the right operand
in shared memory, 128 wide; an accumulator [128 rows, 128 slots] a set. The second set's decode
overlaps the first set's wgmma and the next step's first decode the second's; a ring of
PREFILL_STAGES steps of cp.async copies (weights and activations) runs two steps ahead, one
barrier a step. (Decoded tiles stored to shared memory as wgmma's operand, in either
orientation, cost a proxy fence and half again the shared-memory traffic a step: slower,
docs/performance.md.)

One slot (fusedmoe.kernels.wo_hopper_gemv, launch_mx_gemv). Where experts see about one slot
each (decode at a few tokens), a program multiplies the activations of one slot (no alignment)
or of a block of up to 8 slots of one expert (moe_align's, blocks of 8), in their natural
order, by 32 or 64 output columns of the expert's weights through mma.sync (m16n8k16), the
decode's bf16 pairs the instruction's left operand as they are; no shared memory, the loads
two steps ahead in registers.

Neither form fences between the cp.async copies and the wgmma that read them. The PTX memory
model counts cp.async as a generic-proxy write, which wgmma's async-proxy read formally needs a
fence.proxy.async after; Triton's own cp.async pipelines rely on the same behaviour without one
(its fence pass fences only stores from registers), and a fence there compiles to
MEMBAR.ALL.CTA, which waits for every load in flight (0.4-2% at prefill, 0.5-1.6% at decode).

Columns past K read as code 0 (weights) and 0.0 (activations). The epilogues are wo_gemm's:
GEMM1 bias, rounding to the activation dtype and the activation (gate and up rows of the
same output columns: halves, or gpt-oss's interleaved rows); GEMM2 bias, rounding, times
the routing weight.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from fusedmoe.kernels.moe_gemm import (
    epilogue_activation,
    gate_up_rows,
    grouped_tile,
    round_to,
)
from fusedmoe.kernels.wo_gemm import fp4_asm

try:  # Gluon's Hopper API (see wgmma_gemm: the same versions are supported)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    IMPORT_ERROR = ""
except Exception as exc:
    gluon = gl = async_copy = warpgroup_mma = warpgroup_mma_wait = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = [
    "BLOCK_N",
    "PREFILL_ROWS",
    "SCALE_PAIR_ASM",
    "STAGES",
    "fp4_scaled",
    "hopper_block_m",
    "launch_mx_hopper",
    "mx_epilogue",
    "permute_k",
    "scale_pair",
    "weights_unusable_reason",
]

BLOCK_N = 64  # the decode form's weight rows a program: one warpgroup's wgmma height
#: the decode form's K steps of 256 columns in shared memory (at least 2): 2 measured fastest
#: on an H200 (3 CTAs per SM at 16 slots beat deeper rings on 2)
STAGES = 2
#: the decode form's widest slot tile: at 128 slots it spills (255 registers) and ran 1.8x
#: slower on an H200
DECODE_MAX_BLOCK_M = 64
#: the prefill form (wo_hopper_prefill) takes tiles of 128 slots, and is chosen where an expert
#: sees at least that many slots on average (hopper_block_m): measured faster at 128 and 512
#: slots an expert (H200), 1.5x slower at 32
PREFILL_BLOCK_M = 128
#: the prefill form's weight rows a program: two sets of 128 (the gate and the up rows of 128
#: output columns, or 256 output columns), 64 rows of each a warpgroup
PREFILL_ROWS = 256
#: the prefill form's ring of 64-column K steps (at least 3): two in flight beyond the one
#: read, and the one whose second wgmma may still run; 4 measured fastest on an H200 (3 and 5
#: were 1-4% slower)
PREFILL_STAGES = 4
#: FUSEDMOE_WO_HOPPER=0: the Triton kernels run MXFP4 x bf16 on Hopper too (for comparisons)
_ENABLED = os.environ.get("FUSEDMOE_WO_HOPPER", "1") != "0"
_ACT_NONE = tl.constexpr(-1)
#: 2^64: the accumulator's factor (the scales are applied as 2^(s - 65), the module docstring)
_ACC_SCALE = tl.constexpr(18446744073709551616.0)

# E2M1 codes of 4 bytes -> wgmma's registers as they are (wo_gemm.fp4_asm), times a scale that
# carries the 2^126: one fma a register
_FP4_SCALED_ASM = tl.constexpr(fp4_asm(times_2_126=False, word_scale=True))


@triton.jit
def fp4_scaled(packed, scale):
    """uint8 E2M1 pairs and, per byte, its bf16 scale twice as an int32 (bytes 2i, 2i + 1 share
    one) -> (low-nibble values, high-nibble values)."""
    return tl.inline_asm_elementwise(
        _FP4_SCALED_ASM, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip


# E8M0 code s -> bf16 2^(s - 65), twice in an int32: (min(s, 193) + 62) << 7, times 0x10001.
# In PTX so that LLVM does not pack the byte arithmetic into 16-bit pairs (which costs more).
SCALE_PAIR_ASM = tl.constexpr("""
{
.reg .b32 t;
min.u32 t, $1, 193;
mad.lo.u32 $0, t, 0x00800080, 0x1F001F00;
}
""")


@triton.jit
def scale_pair(code):
    """uint8 E8M0 codes -> int32: the bf16 bits of 2^(code - 65) in both halves."""
    return tl.inline_asm_elementwise(
        SCALE_PAIR_ASM, "=r,r", [code.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1
    )


if gluon is not None:

    @gluon.jit
    def _issue(
        step, num_k, w_smem, x_smem, wg_ptrs, wu_ptrs, w_mask, w_cols, x_ptrs, x_mask, x_cols,
        K, STAGES: gl.constexpr, GATED: gl.constexpr,
    ):  # fmt: skip
        """The cp.async copies of K step `step` (256 columns) into its stage (empty ones past
        the last step); masked by whole 64-column blocks (K is a multiple of 64)."""
        stage = step % STAGES
        k0 = step * 256
        live = step < num_k
        wm = w_mask & (k0 + w_cols < K) & live
        xm = x_mask & (k0 + x_cols < K) & live
        W_PER_STAGE: gl.constexpr = 2 if GATED else 1
        first = W_PER_STAGE * stage
        async_copy.async_copy_global_to_shared(w_smem.index(first), wg_ptrs + k0 // 2, mask=wm)
        if GATED:
            async_copy.async_copy_global_to_shared(
                w_smem.index(first + 1), wu_ptrs + k0 // 2, mask=wm
            )
        async_copy.async_copy_global_to_shared(x_smem.index(stage), x_ptrs + k0, mask=xm)

    @gluon.jit
    def _load_scales(s_ptrs, s_mask, s_groups, sub, num_groups):
        """This thread's E8M0 scales of 128-column sub-step `sub` [64, 2 blocks, 2], each as a
        bf16 2^(s - 65) (the module docstring) twice in an int32; code 127 past the last group."""
        g = sub * 4 + s_groups
        s = gl.load(s_ptrs + sub * 4, mask=s_mask & (g < num_groups), other=127)
        return scale_pair(s)

    @gluon.jit
    def _operand(w_tile, scale_bits, w_layout: gl.constexpr, a_layout: gl.constexpr):
        """A sub-step's [64, 64] weight bytes in shared memory -> wgmma's left operand [64, 128]
        bf16 in the tensor order of the module docstring; scale_bits [64, 2, 2] (_load_scales)."""
        w = w_tile.load(w_layout)
        s = gl.expand_dims(scale_bits, 3)
        s = gl.broadcast(s, gl.full([64, 2, 2, 16], 0, gl.int32, s.type.layout))[0]
        s = gl.convert_layout(gl.reshape(s, [64, 64]), w_layout, assert_trivial=True)
        low, high = fp4_scaled(w, s)
        # (row, byte 32 blk + 8 c + 2 s + b, h) -> (row, blk, s, h, c, b)
        v = gl.reshape(gl.join(low, high), [64, 2, 4, 4, 2, 2])
        v = gl.reshape(gl.permute(v, (0, 1, 3, 5, 2, 4)), [64, 128])
        return gl.convert_layout(v, a_layout, assert_trivial=True)

    @gluon.jit
    def mx_epilogue(
        acc_g, acc_u, n0, e, pid_m, bias_ptr, stride_be, stride_bn, out_ptr, stride_om,
        topk_weights_ptr, sorted_ids_ptr, N, num_slots, alpha, beta, limit,
        mma: gl.constexpr, BN: gl.constexpr, BLOCK_M: gl.constexpr, HAS_BIAS: gl.constexpr,
        ACTIVATION: gl.constexpr, GATED: gl.constexpr, HAS_LIMIT: gl.constexpr,
        MUL_ROUTED_WEIGHT: gl.constexpr, H_DTYPE: gl.constexpr, PERMUTE_OUT: gl.constexpr,
        DIRECT: gl.constexpr = False,
    ):  # fmt: skip
        """Output columns n0 .. n0 + BN of the tile's slots from the accumulators [BN, BLOCK_M]
        (times 2^64; gate and up, or acc_g alone), in their layout `mma`: wo_gemm's epilogues.
        The tile's slots: BLOCK_M of the aligned routing's block pid_m, or (DIRECT) slot pid_m
        alone in the tile's first column.
        (Turned to rows of the output through shared memory and stored 16 bytes a thread, the
        prefill form ran 7-12% slower on an H200 and the decode form was unchanged.)"""
        N_AXIS: gl.constexpr = 0  # the output columns' (n) axis
        M_AXIS: gl.constexpr = 1
        acc_g = acc_g * _ACC_SCALE
        acc_u = acc_u * _ACC_SCALE
        offs_n = n0 + gl.arange(0, BN, gl.SliceLayout(M_AXIS, mma))
        n_mask = offs_n < N
        gate_rows, up_rows = gate_up_rows(offs_n, N, GATED, ACTIVATION)
        m = gl.arange(0, BLOCK_M, gl.SliceLayout(N_AXIS, mma))
        if DIRECT:
            slots = gl.where(m == 0, pid_m, num_slots)
        else:
            slots = gl.load(sorted_ids_ptr + pid_m * BLOCK_M + m)
        row_mask = slots < num_slots
        if HAS_BIAS:
            bias_base = bias_ptr + e * stride_be
            bias_g = gl.load(bias_base + gate_rows * stride_bn, mask=n_mask, other=0.0)
            acc_g += gl.expand_dims(bias_g.to(gl.float32), M_AXIS)
            if GATED:
                bias_u = gl.load(bias_base + up_rows * stride_bn, mask=n_mask, other=0.0)
                acc_u += gl.expand_dims(bias_u.to(gl.float32), M_AXIS)
        if PERMUTE_OUT:  # column n of block n // 64 -> its tensor column (module docstring)
            j = offs_n % 64
            cols = (offs_n - j) + 16 * ((j // 4) % 4) + 8 * (j % 2) + 2 * (j // 16)
            cols += (j // 2) % 2
        else:
            cols = offs_n
        slot_rows = slots.to(gl.int64)
        out_ptrs = (
            out_ptr + gl.expand_dims(slot_rows, N_AXIS) * stride_om + gl.expand_dims(cols, M_AXIS)
        )
        out_mask = gl.expand_dims(n_mask, M_AXIS) & gl.expand_dims(row_mask, N_AXIS)
        if ACTIVATION == _ACT_NONE:
            y = acc_g
            if MUL_ROUTED_WEIGHT:
                y = round_to(y, H_DTYPE, False)
                tw = gl.load(topk_weights_ptr + slot_rows, mask=row_mask, other=0.0)
                y = y * gl.expand_dims(tw, N_AXIS)
            gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            h_g = round_to(acc_g, H_DTYPE, False)
            h_u = round_to(acc_u, H_DTYPE, False)
            act = epilogue_activation(h_g, h_u, alpha, beta, limit, ACTIVATION, HAS_LIMIT)
            gl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=out_mask)

    @gluon.jit
    def _wo_mx_hopper_kernel(
        a_ptr, stride_am,  # [rows of A, K] bf16, k-permuted (permute_k), unit stride along K
        w_ptr, stride_we, stride_wn,  # [E_l, N_w, K / 2] uint8, unit stride along K
        s_ptr, stride_se, stride_sn,  # [E_l, N_w, K / 32] uint8 (E8M0), unit stride along K
        bias_ptr, stride_be, stride_bn,  # [E_l, N_w]
        out_ptr, stride_om,  # [S, N], unit stride along N
        topk_weights_ptr,  # float32 [S]
        sorted_ids_ptr, expert_ids_ptr, num_post_ptr,  # moe_align's AlignedRouting
        N, K, num_slots, max_blocks,
        alpha, beta, limit,
        A_ROW_DIV: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        ACTIVATION: gl.constexpr,
        GATED: gl.constexpr,
        HAS_LIMIT: gl.constexpr,
        MUL_ROUTED_WEIGHT: gl.constexpr,
        H_DTYPE: gl.constexpr,
        PERMUTE_OUT: gl.constexpr,  # store the output k-permuted (GEMM1: GEMM2's input)
        BLOCK_M: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
    ):  # fmt: skip
        BN: gl.constexpr = 64
        BK: gl.constexpr = 256  # a K step: two 128-column sub-steps
        pid_m, pid_n = grouped_tile(gl.program_id(0), N, BN, max_blocks, GROUP_M)
        num_post = gl.load(num_post_ptr)
        if pid_m * BLOCK_M < num_post:
            e = gl.load(expert_ids_ptr + pid_m).to(gl.int64)

            # layouts: the accumulator, wgmma's left operand, the weight bytes as loaded
            # (thread c of row c': bytes 8c .. 8c + 7 of each 32-byte block of rows 16w + c'
            # and 16w + c' + 8), and the same as [row, block, c // 2, byte of the pair of runs]
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
            )
            a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
            w_layout: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [8, 0]],
                lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                warp_bases=[[16, 0], [32, 0]],
                block_bases=[],
                shape=[64, 64],
            )
            w4: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 1, 0, 0], [8, 0, 0, 0]],
                lane_bases=[[0, 0, 0, 8], [0, 0, 1, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
                warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]],
                block_bases=[],
                shape=[64, 2, 2, 16],
            )
            s3: gl.constexpr = gl.SliceLayout(3, w4)  # [row, block, c // 2]
            x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
            # the weights' copies: 16-byte runs, 8 threads a row (128 bytes: a step)
            wc_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
            # 16-byte chunks swizzled by row: a warp's reads (8 rows x 4 threads x 8 bytes)
            # take the two wavefronts 256 bytes need
            w_shared: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, order=[1, 0])
            x_shared: gl.constexpr = gl.NVMMASharedLayout(
                swizzle_byte_width=128, element_bitwidth=16, rank=2
            )
            W_PER_STAGE: gl.constexpr = 2 if GATED else 1
            w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * W_PER_STAGE, 64, 128], w_shared)
            x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], x_shared)

            # the weight rows (gate and up) of this tile's 64 output columns
            n_w = pid_n * BN + gl.arange(0, 64, gl.SliceLayout(1, wc_layout))
            gate_w, up_w = gate_up_rows(n_w, N, GATED, ACTIVATION)
            byte = gl.arange(0, 128, gl.SliceLayout(0, wc_layout))
            w_base = w_ptr + e * stride_we
            wg_ptrs = w_base + gate_w.to(gl.int64)[:, None] * stride_wn + byte[None, :]
            wu_ptrs = w_base + up_w.to(gl.int64)[:, None] * stride_wn + byte[None, :]
            zero_w = gl.zeros([64, 128], gl.int32, wc_layout)
            w_mask = (zero_w + n_w[:, None]) < N
            w_cols = zero_w + 64 * (byte // 32)[None, :]  # each 32-byte block's first column

            # this thread's scale of each row and 64-column block: group 2 blk + c // 2
            r3 = gl.arange(0, 64, gl.SliceLayout(1, gl.SliceLayout(2, s3)))
            n_s = gl.expand_dims(gl.expand_dims(pid_n * BN + r3, 1), 2)
            blk = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(2, s3)))
            chi = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, s3)))
            s_groups = (
                gl.zeros([64, 2, 2], gl.int32, s3)
                + 2 * gl.expand_dims(gl.expand_dims(blk, 0), 2)
                + gl.expand_dims(gl.expand_dims(chi, 0), 1)
            )  # fmt: skip
            gate_s, up_s = gate_up_rows(n_s, N, GATED, ACTIVATION)
            s_base = s_ptr + e * stride_se
            sg_ptrs = s_base + gate_s.to(gl.int64) * stride_sn + s_groups
            su_ptrs = s_base + up_s.to(gl.int64) * stride_sn + s_groups
            s_mask = (s_groups * 0 + n_s) < N
            num_groups = K // 32

            # the slots of this tile and their rows of A
            slot_x = gl.load(
                sorted_ids_ptr + pid_m * BLOCK_M
                + gl.arange(0, BLOCK_M, gl.SliceLayout(1, x_layout))
            )  # fmt: skip
            t = gl.arange(0, BK, gl.SliceLayout(0, x_layout))
            zero_x = gl.zeros([BLOCK_M, BK], gl.int32, x_layout)
            x_cols = zero_x + 64 * (t // 64)[None, :]
            x_ptrs = a_ptr + (slot_x // A_ROW_DIV).to(gl.int64)[:, None] * stride_am + t[None, :]
            x_mask = (zero_x + slot_x[:, None]) < num_slots

            num_k = gl.cdiv(K, BK)
            for i in gl.static_range(STAGES - 1):
                _issue(i, num_k, w_smem, x_smem, wg_ptrs, wu_ptrs, w_mask, w_cols, x_ptrs,
                       x_mask, x_cols, K, STAGES, GATED)  # fmt: skip
                async_copy.commit_group()
            # the scales of the two sub-steps of this step (a, b), loaded a step ahead
            sga = _load_scales(sg_ptrs, s_mask, s_groups, 0, num_groups)
            sgb = _load_scales(sg_ptrs, s_mask, s_groups, 1, num_groups)
            sua = sga
            sub = sgb
            if GATED:
                sua = _load_scales(su_ptrs, s_mask, s_groups, 0, num_groups)
                sub = _load_scales(su_ptrs, s_mask, s_groups, 1, num_groups)

            acc_g = gl.zeros([64, BLOCK_M], gl.float32, mma)
            acc_u = gl.zeros([64, BLOCK_M], gl.float32, mma)
            for kb in range(num_k):
                stage = kb % STAGES
                sga_next = _load_scales(sg_ptrs, s_mask, s_groups, 2 * kb + 2, num_groups)
                sgb_next = _load_scales(sg_ptrs, s_mask, s_groups, 2 * kb + 3, num_groups)
                sua_next = sga_next
                sub_next = sgb_next
                if GATED:
                    sua_next = _load_scales(su_ptrs, s_mask, s_groups, 2 * kb + 2, num_groups)
                    sub_next = _load_scales(su_ptrs, s_mask, s_groups, 2 * kb + 3, num_groups)
                async_copy.wait_group(STAGES - 2)
                gl.thread_barrier()  # every copy of step kb landed; every warp is past kb - 1
                _issue(kb + STAGES - 1, num_k, w_smem, x_smem, wg_ptrs, wu_ptrs, w_mask, w_cols,
                       x_ptrs, x_mask, x_cols, K, STAGES, GATED)  # fmt: skip
                async_copy.commit_group()
                x_step = x_smem.index(stage)
                w_g = w_smem.index(W_PER_STAGE * stage)
                w_u = w_smem.index(W_PER_STAGE * stage + W_PER_STAGE - 1)
                # each operand's decode overlaps the previous wgmma: at most 2 in flight, the
                # step's last one waited for before the stage is refilled (and before the next
                # step writes the operand registers again: they must not change while their
                # wgmma is in flight)
                for j in gl.static_range(2):
                    x_tile = x_step.slice(128 * j, 128, 1).permute((1, 0))
                    if j == 1:
                        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=1, deps=(acc_g, acc_u))
                    a_g = _operand(
                        w_g.slice(64 * j, 64, 1), sga if j == 0 else sgb, w_layout, a_layout
                    )
                    acc_g = warpgroup_mma(a_g, x_tile, acc_g, is_async=True)
                    if GATED:
                        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=1, deps=(acc_g, acc_u))
                        a_u = _operand(
                            w_u.slice(64 * j, 64, 1), sua if j == 0 else sub, w_layout, a_layout
                        )
                        acc_u = warpgroup_mma(a_u, x_tile, acc_u, is_async=True)
                    if j == 1:
                        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
                sga = sga_next
                sgb = sgb_next
                sua = sua_next
                sub = sub_next
            async_copy.wait_group(0)

            # the epilogue, in the accumulator's layout
            mx_epilogue(
                acc_g, acc_u, pid_n * BN, e, pid_m, bias_ptr, stride_be, stride_bn, out_ptr,
                stride_om, topk_weights_ptr, sorted_ids_ptr, N, num_slots, alpha, beta, limit,
                mma, BN, BLOCK_M, HAS_BIAS, ACTIVATION, GATED, HAS_LIMIT, MUL_ROUTED_WEIGHT,
                H_DTYPE, PERMUTE_OUT,
            )  # fmt: skip


if gluon is None:  # the names wo_hopper_prefill imports
    mx_epilogue = None


def permute_k(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (K a multiple of 64) with each 64-column block in the kernel's tensor order:
    out[:, 64 i + t] = x[:, 64 i + k(t)], t = 16 s + 8 h + 2 c + b, k(t) = 16 c + 4 s + 2 b + h
    (the module docstring)."""
    m, k = x.shape
    src = x.reshape(m, k // 64, 4, 4, 2, 2).permute(0, 1, 3, 5, 2, 4)  # any strides
    if out is None:
        return src.reshape(m, k)
    out.view(m, k // 64, 4, 2, 4, 2).copy_(src)
    return out


@functools.cache
def _device_reason(index: int) -> str | None:
    from fusedmoe.kernels.wgmma_gemm import gluon_unusable_reason

    return gluon_unusable_reason(torch.device("cuda", index))


def weights_unusable_reason(
    device, dtype, hidden, width, w13, w13_scale, w2, w2_scale
) -> str | None:
    """None where both GEMMs of the weight-only op run this module's kernels: activations of this
    device and dtype, `hidden` wide, MXFP4 w13 [E_l, N_w, hidden / 2] and w2 [E_l, hidden, width
    / 2] with E8M0 scales [E_l, rows, K / 32] (`width` GEMM1's output width); else why not."""
    if not _ENABLED:
        return "FUSEDMOE_WO_HOPPER=0"
    if gluon is None:
        return f"Triton's Gluon API is not importable ({IMPORT_ERROR})"
    if device.type != "cuda":
        return "not on a CUDA GPU"
    reason = _device_reason(device.index if device.index is not None else 0)
    if reason is not None:
        return reason
    if dtype != torch.bfloat16:
        return f"activations are {dtype}, the kernel decodes to bf16"
    if hidden % 64 or width % 64:
        return f"the hidden size ({hidden}) and width ({width}) must be multiples of 64"
    for w, scale in ((w13, w13_scale), (w2, w2_scale)):
        if w.dtype != torch.uint8 or w.dim() != 3:
            return "the weights are not MXFP4 [E_l, rows, K / 2] uint8"
        if w.stride(2) != 1 or w.stride(1) % 16 or w.stride(0) % 16 or _misaligned(w):
            return "the weights' rows are not 16-byte aligned with unit stride"
        if scale is None or scale.dim() != 3 or scale.stride(2) != 1:
            return "the scales are not [E_l, rows, K / 32] with unit stride along K"
        if scale.dtype != torch.uint8 or scale.shape[:2] != w.shape[:2]:
            return "the scales are not E8M0 (uint8) with one row per weight row"
        if scale.shape[2] * 16 != w.shape[2]:
            return "the scales are not one per 32 columns of the weights"
    if w13.shape[2] * 2 != hidden or w2.shape[2] * 2 != width:
        return "the weights' widths do not match the hidden size and GEMM1's output width"
    return None


def _misaligned(t: torch.Tensor) -> bool:
    """t's first element is not 16-byte aligned from its storage's start (the allocator aligns
    storages): metadata only, so a traced call (torch.compile) can ask it."""
    return (t.storage_offset() * t.element_size()) % 16 != 0


def hopper_block_m(config_block_m: int, num_slots: int, num_experts: int) -> int:
    """The slots a tile for a weight-only config's block_m: up to 64 the decode form takes it
    as it is; above 64, the prefill form's PREFILL_BLOCK_M where experts see at least that many
    slots on average, else the decode form's widest tile."""
    if config_block_m <= DECODE_MAX_BLOCK_M:
        return config_block_m
    if num_slots >= PREFILL_BLOCK_M * num_experts:
        return PREFILL_BLOCK_M
    return DECODE_MAX_BLOCK_M


def _operand_args(a, w, scale, bias, out, topk_weights, dummy) -> tuple:
    """The arguments every kernel of this module takes first: A, the weights, their scales, the
    bias (dummy where there is none), the output (with their strides) and the routing weights."""
    return (
        a, a.stride(0),
        w, w.stride(0), w.stride(1),
        scale, scale.stride(0), scale.stride(1),
        *((bias, bias.stride(0), bias.stride(1)) if bias is not None else (dummy, 0, 0)),
        out, out.stride(0),
        topk_weights,
    )  # fmt: skip


def launch_mx_hopper(
    a, w, scale, bias, out, topk_weights, rows, num_slots, params, block_m, group_m,
    constexprs, permute_out,
):  # fmt: skip
    """One GEMM of the weight-only op through this module's kernels: a k-permuted (permute_k),
    rows the aligned routing (fused_moe.GemmRows) in tiles of block_m slots (hopper_block_m:
    up to 64 the decode form, 128 the prefill form), params (alpha, beta, limit),
    constexprs the epilogue's (wo_moe._hopper_constexprs)."""
    if block_m > DECODE_MAX_BLOCK_M and block_m != PREFILL_BLOCK_M:
        raise ValueError(
            f"block_m {block_m}: the decode form takes at most {DECODE_MAX_BLOCK_M} slots a "
            f"tile, the prefill form {PREFILL_BLOCK_M}"
        )
    n_out = out.shape[1]
    args = (
        *_operand_args(a, w, scale, bias, out, topk_weights, rows.ids),
        *rows.kernel_args()[:3],
        n_out, a.shape[1], num_slots, rows.num_blocks,
        *params,
    )  # fmt: skip
    if block_m == PREFILL_BLOCK_M:
        from fusedmoe.kernels.wo_hopper_prefill import wo_mx_hopper_prefill_kernel

        tile_n = PREFILL_ROWS // 2 if constexprs["GATED"] else PREFILL_ROWS
        grid = (rows.num_blocks * triton.cdiv(n_out, tile_n),)
        wo_mx_hopper_prefill_kernel[grid](
            *args, **constexprs, PERMUTE_OUT=permute_out, BLOCK_M=block_m,
            STAGES=PREFILL_STAGES, GROUP_M=group_m, num_warps=8,
        )  # fmt: skip
        return
    grid = (rows.num_blocks * triton.cdiv(n_out, BLOCK_N),)
    _wo_mx_hopper_kernel[grid](
        *args, **constexprs, PERMUTE_OUT=permute_out, BLOCK_M=block_m, STAGES=STAGES,
        GROUP_M=group_m, num_warps=4,
    )  # fmt: skip


#: the one-slot form's tile (wo_hopper_gemv): 16-row mma tiles a warp, bytes a lane reads per
#: row and step (use_one_slot_tile overrides it in a scope, for sweeps and tests)
GEMV_TILE = (1, 16)
#: the one-slot form's registers a thread in blocks of slots (None: the compiler's choice, 128):
#: 96 (no spills) keeps five programs an SM, which the blocks' many programs need (H200, 8
#: tokens: 0.154 against 0.176 ms); a program a slot (few programs) runs faster with 128 (one
#: token: 0.032 against 0.035 ms; docs/performance.md)
GEMV_BLOCK_MAXNREG: int | None = 96
_one_slot_tile: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "fusedmoe_one_slot_tile", default=None
)


@contextlib.contextmanager
def use_one_slot_tile(tiles: int, cb: int) -> Iterator[None]:
    """Run the one-slot form with `tiles` 16-row mma tiles a warp and `cb` bytes a lane a step
    (1 or 2; 16 or 32) in this scope."""
    if tiles not in (1, 2) or cb not in (16, 32):
        raise ValueError(f"the one-slot form takes tiles 1 or 2 and cb 16 or 32, got {tiles}, {cb}")
    token = _one_slot_tile.set((tiles, cb))
    try:
        yield
    finally:
        _one_slot_tile.reset(token)


def launch_mx_gemv(
    a, w, scale, bias, out, topk_weights, ids, expert_map, num_local, params, constexprs,
    routing=None,
):  # fmt: skip
    """One GEMM of the weight-only op through the one-slot form (wo_hopper_gemv): a program a
    slot (ids: topk_ids flattened; routing None) or a block of routing's (moe_align's
    AlignedRouting in blocks of 8), and 32 * tiles (GATED) or 64 * tiles output columns (the
    tile: GEMV_TILE or use_one_slot_tile's); a in its natural k order, read two 16-bit values
    per int32 (copied where its rows are not 4-byte aligned with unit stride); params (alpha,
    beta, limit); constexprs the epilogue's (wo_moe._hopper_constexprs)."""
    from fusedmoe.kernels.wo_hopper_gemv import gemv_layouts, wo_mx_gemv_kernel

    tiles, cb = _one_slot_tile.get() or GEMV_TILE
    if routing is not None and routing.block_m != 8:
        raise ValueError(f"the one-slot form takes blocks of 8 slots, got {routing.block_m}")
    if a.stride(1) != 1 or a.stride(0) % 2 or a.data_ptr() % 4:
        a = a.clone(memory_format=torch.contiguous_format)
    n_out = out.shape[1]
    num_ids = num_local if expert_map is None else expert_map.shape[0]
    tile_n = (32 if constexprs["GATED"] else 64) * tiles
    num_slots, num_n = ids.numel(), triton.cdiv(n_out, tile_n)
    args = (
        *_operand_args(a, w, scale, bias, out, topk_weights, ids),
        ids, ids if expert_map is None else expert_map,
        *(
            (ids, ids, ids)
            if routing is None
            else (routing.sorted_token_ids, routing.expert_ids, routing.num_tokens_post_padded)
        ),
        num_ids, num_local,
        n_out, a.shape[1], num_slots,
        *params,
    )  # fmt: skip
    num_m = num_slots if routing is None else routing.expert_ids.shape[0]
    # blocks of slots in the shipped tile: its registers capped (GEMV_BLOCK_MAXNREG)
    capped = routing is not None and (tiles, cb) == (1, 16) and GEMV_BLOCK_MAXNREG is not None
    options = {"maxnreg": GEMV_BLOCK_MAXNREG} if capped else {}
    wo_mx_gemv_kernel[(num_m, num_n)](
        *args, **constexprs, HAS_MAP=expert_map is not None, DIRECT=routing is None,
        TILES=tiles, CB=cb, **gemv_layouts(tiles, cb), num_warps=4,
        **options,
    )  # fmt: skip
