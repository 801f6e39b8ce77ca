"""The one-slot form of wo_hopper's MXFP4 x bf16 expert GEMMs (Gluon): for calls whose experts
see about one slot each (decode: gpt-oss up to 8 tokens), a program multiplies the activations
of one slot (DIRECT, up to wo_moe.GEMV_DIRECT_MAX_TOKENS tokens: no alignment) or of a block of
up to 8 slots of one expert (moe_align's blocks of 8: an expert several tokens share is read
once) by BN output columns of the expert's weights, on the tensor cores through mma.sync
(m16n8k16, a slot a column), the weights decoded from their 4-bit bytes straight into the
instruction's left operand, nothing through shared memory.

Why: at one token the weight bytes of the four experts (50 MB for gpt-oss-120b) take 10 us at
the H200's bandwidth, but they are spread over few experts, so each program must keep many
bytes in flight and spend few instructions on each. The CUDA-core GEMV (wo_gemm._wo_gemv_kernel)
spends about 9 instructions on a weight (decode, bf16 to float32, fma, the activations moved
through shared memory every step); here the decode's bf16 pairs are the mma's operand as they
are (about 3 instructions a weight, three quarters of them the decode), and each thread keeps two
steps of loads ahead in registers: rounds of three K steps, unmasked where their loads lie
inside K (the rows clamped), then masked (docs/performance.md, "The one-slot form" and "What
bounds the one-slot form": the latency of the instruction stream, not the memory).

Layout. A warp owns a 16-row mma tile (GATED: the gate rows and the up rows of 8 output
columns, in its rows 0-7 and 8-15; else 16 output columns) and TILES of them (TILES * 64 rows
a program of 4 warps). Per K step each of a row's 4 lanes t (lane = 4 g + t: rows g and g + 8)
reads CB consecutive bytes (16 or 32), CB / 16 MX groups of 32 columns, one scale each. The
mma sums over k in any order common to both operands, so the step's 8 CB columns are
relabelled: stored byte c = CB t + 4 j + 2 i1 + i0 (j < CB / 4) holds logical columns 2c + h
(h: its nibble), placed at tensor column

    32 j + 16 h + 8 i1 + 2 t + i0,

which puts the decode's registers (the low nibbles of bytes 0, 1 of a word, of 2, 3, then the
high nibbles: wo_gemm.fp4_asm) where m16n8k16 wants them: register pairs (2t, 2t + 1) and (2t +
8, 2t + 9) of k block 2 j + h. The activations take the same order: lane t of column g reads
the 2 CB consecutive values 2 CB t .. of slot g (columns without a slot read row 0, their
results unused) and the compiler pairs them in registers. The scales are applied in the decode
as 2^(s - 65) and the accumulator leaves times 2^64 (wo_hopper's module docstring: scale codes
in [59, 192]); the epilogue is wo_hopper.mx_epilogue's. Launched by wo_hopper.launch_mx_gemv."""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from fusedmoe.kernels.moe_gemm import gate_up_rows
from fusedmoe.kernels.wo_gemm import fp4_asm
from fusedmoe.kernels.wo_hopper import gl, gluon, mx_epilogue, scale_pair

# wo_gemm.fp4_asm on a word given twice ($4, $5) with its scale pair twice ($6, $7): its four
# output registers (low nibbles of bytes 0, 1; of 2, 3; high nibbles of 0, 1; of 2, 3) are the
# four outputs, each a pair of elements (fp4_word)
_FP4_WORD_ASM = tl.constexpr(
    fp4_asm(times_2_126=False, word_scale=True).replace("$7", "$6").replace("$5", "$6")
)


@triton.jit
def fp4_word(word, scale):
    """int32 words of 4 E2M1 bytes and their scale pairs (wo_hopper.scale_pair), each [..., 2]
    (the same value twice) -> (low nibbles of bytes 0, 1), (of 2, 3), (high nibbles of 0, 1),
    (of 2, 3), bf16 [..., 2]: byte 2 i + b's value at [..., b] of output i (and 2 + i)."""
    return tl.inline_asm_elementwise(
        _FP4_WORD_ASM, "=r,=r,=r,=r,r,r,r,r", [word, scale],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
    )  # fmt: skip


__all__ = ["gemv_layouts", "wo_mx_gemv_kernel"]

wo_mx_gemv_kernel = None  # (defined below where Gluon imports)

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    @gluon.jit
    def _gemv_loads(step, w_ptrs, w_cols, s_ptrs, s_groups, x_ptrs, x_k, K, CB: gl.constexpr,
                    MASKED: gl.constexpr):  # fmt: skip
        """The loads of K step `step` (8 CB columns), as int32 words (loop-carried bytes and
        16-bit values would each take a register): this thread's weight bytes and scale codes
        of its rows and its activations, two a word (the rows clamped by the caller, so only K
        can be passed). MASKED: code 0 (weights), 127 (scales) and 0.0 past K; else the step
        lies inside K (no mask)."""
        W_STEP: gl.constexpr = CB  # words of a row a step (4 CB bytes)
        G_STEP: gl.constexpr = CB // 4  # scale groups of a row a step
        c0 = step * W_STEP
        g0 = step * G_STEP
        p0 = step * 4 * CB  # activation pairs a step
        if MASKED:
            w = gl.load(w_ptrs + c0, mask=c0 + w_cols < K // 8, other=0)
            s = gl.load(s_ptrs + g0, mask=g0 + s_groups < K // 32, other=127)
            x = gl.load(x_ptrs + p0, mask=p0 + x_k < K // 2, other=0)
        else:
            w = gl.load(w_ptrs + c0)
            s = gl.load(s_ptrs + g0)
            x = gl.load(x_ptrs + p0)
        return w, s, x

    @gluon.jit
    def _gemv_a(w, s_codes, wq_layout: gl.constexpr, a_layout: gl.constexpr,
                ROWS: gl.constexpr, CB: gl.constexpr):  # fmt: skip
        """Weight words [ROWS, CB] (wq_layout) and their scale codes [ROWS, 4, CB / 16] -> the
        mma's left operand [ROWS, 8 CB] bf16 in the tensor order of the module docstring."""
        J: gl.constexpr = CB // 4
        s = gl.expand_dims(scale_pair(s_codes), 3)
        s = gl.broadcast(s, gl.full([ROWS, 4, CB // 16, 4], 0, gl.int32, s.type.layout))[0]
        s = gl.convert_layout(gl.reshape(s, [ROWS, CB]), wq_layout, assert_trivial=True)
        lo01, lo23, hi01, hi23 = fp4_word(gl.join(w, w), gl.join(s, s))
        # (row, word CB t / 4 + j, i0, i1, h): byte 4 j + 2 i1 + i0 of lane t, nibble h
        v = gl.join(gl.join(lo01, lo23), gl.join(hi01, hi23))
        v = gl.reshape(v, [ROWS, 4, J, 2, 2, 2])
        # -> (row, j, h, i1, t, i0)
        v = gl.reshape(gl.permute(v, (0, 2, 5, 4, 1, 3)), [ROWS, 8 * CB])
        return gl.convert_layout(v, a_layout, assert_trivial=True)

    @gluon.jit
    def _gemv_b(x, b_layout: gl.constexpr, CB: gl.constexpr):
        """Activation pairs [4 CB, 8 (the tile's columns)] (int32: k 2p in the low half) ->
        the mma's right operand in the tensor order of the module docstring."""
        J: gl.constexpr = CB // 4
        even = (x & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        odd = ((x >> 16) & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        x = gl.reshape(gl.permute(gl.join(even, odd), (0, 2, 1)), [8 * CB, 8])
        # k = 2 CB t + 8 j + 4 i1 + 2 i0 + h -> (j, h, i1, t, i0)
        v = gl.reshape(x, [4, J, 2, 2, 2, 8])
        v = gl.reshape(gl.permute(v, (1, 4, 2, 0, 3, 5)), [8 * CB, 8])
        return gl.convert_layout(v, b_layout, assert_trivial=True)

    @gluon.jit
    def _gemv_mma(
        acc, w, s_codes, x, wq_layout: gl.constexpr, a_layout: gl.constexpr,
        b_layout: gl.constexpr, ROWS: gl.constexpr, CB: gl.constexpr,
    ):  # fmt: skip
        """acc plus one K step's product: its weight words and scale codes (_gemv_a) times its
        activation pairs (_gemv_b)."""
        return mma_v2(
            _gemv_a(w, s_codes, wq_layout, a_layout, ROWS, CB), _gemv_b(x, b_layout, CB), acc
        )

    @gluon.jit
    def _gemv_round(
        acc, kb, w0, s0, x0, w1, s1, x1, w_ptrs, w_cols, s_ptrs, s_groups, x_ptrs, x_k, K,
        wq_layout: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr,
        ROWS: gl.constexpr, CB: gl.constexpr, MASKED: gl.constexpr,
    ):  # fmt: skip
        """Steps kb, kb + 1, kb + 2 (loaded: w0, s0, x0 and w1, s1, x1), loading steps kb + 2 ..
        kb + 4 -> (acc, the loads of kb + 3 and kb + 4)."""
        w2, s2, x2 = _gemv_loads(kb + 2, w_ptrs, w_cols, s_ptrs, s_groups, x_ptrs, x_k, K, CB,
                                 MASKED)  # fmt: skip
        acc = _gemv_mma(acc, w0, s0, x0, wq_layout, a_layout, b_layout, ROWS, CB)
        w0, s0, x0 = _gemv_loads(kb + 3, w_ptrs, w_cols, s_ptrs, s_groups, x_ptrs, x_k, K, CB,
                                 MASKED)  # fmt: skip
        acc = _gemv_mma(acc, w1, s1, x1, wq_layout, a_layout, b_layout, ROWS, CB)
        w1, s1, x1 = _gemv_loads(kb + 4, w_ptrs, w_cols, s_ptrs, s_groups, x_ptrs, x_k, K, CB,
                                 MASKED)  # fmt: skip
        acc = _gemv_mma(acc, w2, s2, x2, wq_layout, a_layout, b_layout, ROWS, CB)
        return acc, w0, s0, x0, w1, s1, x1

    @gluon.jit
    def wo_mx_gemv_kernel(
        a_ptr, stride_am,  # [rows of A, K] bf16, unit stride along K
        w_ptr, stride_we, stride_wn,  # [E_l, N_w, K / 2] uint8, unit stride along K
        s_ptr, stride_se, stride_sn,  # [E_l, N_w, K / 32] uint8 (E8M0), unit stride along K
        bias_ptr, stride_be, stride_bn,  # [E_l, N_w]
        out_ptr, stride_om,  # [S, N], unit stride along N
        topk_weights_ptr,  # float32 [S]
        ids_ptr, map_ptr,  # topk_ids [S] (flattened) and expert_map [E] (or ids again)
        sorted_ids_ptr, expert_ids_ptr, num_post_ptr,  # not DIRECT: moe_align's, blocks of 8
        num_ids, num_local,
        N, K, num_slots,
        alpha, beta, limit,
        A_ROW_DIV: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        ACTIVATION: gl.constexpr,
        GATED: gl.constexpr,
        HAS_LIMIT: gl.constexpr,
        MUL_ROUTED_WEIGHT: gl.constexpr,
        H_DTYPE: gl.constexpr,
        HAS_MAP: gl.constexpr,
        DIRECT: gl.constexpr,  # a program a slot (program_id 0); else a block of 8 slots
        TILES: gl.constexpr,  # 16-row mma tiles a warp
        CB: gl.constexpr,  # bytes of a row a lane reads a step (16 or 32)
        mma: gl.constexpr,  # gemv_layouts(TILES, CB)
        wq_layout: gl.constexpr,
        w4_layout: gl.constexpr,
        x_layout: gl.constexpr,
    ):  # fmt: skip
        ROWS: gl.constexpr = 64 * TILES  # weight rows a program (4 warps)
        BN: gl.constexpr = ROWS // 2 if GATED else ROWS  # output columns a program
        STEP_BYTES: gl.constexpr = 4 * CB  # of a row
        G_LANE: gl.constexpr = CB // 16  # scale groups of a lane's run
        pid_m = gl.program_id(0)  # DIRECT: the slot; else the block of 8 slots
        pid_n = gl.program_id(1)
        if DIRECT:
            expert = _slot_expert(pid_m, ids_ptr, map_ptr, num_ids, HAS_MAP)
        else:
            num_post = gl.load(num_post_ptr)
            expert = gl.where(pid_m * 8 < num_post, gl.load(expert_ids_ptr + pid_m), -1)
        if (expert >= 0) & (expert < num_local):
            e = expert.to(gl.int64)
            s_layout: gl.constexpr = gl.SliceLayout(3, w4_layout)
            a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
            b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)

            # the weight words [ROWS, CB] of a step: lane t holds words CB t / 4 .. of its rows
            r = gl.arange(0, ROWS, gl.SliceLayout(1, wq_layout))
            row_q = _program_rows(r, pid_n, N, BN, GATED, ACTIVATION)
            words = gl.arange(0, CB, gl.SliceLayout(0, wq_layout))
            w_ptrs = (
                w_ptr.to(gl.pointer_type(gl.int32)) + e * (stride_we // 4)
                + gl.expand_dims(row_q.to(gl.int64) * (stride_wn // 4), 1)
                + gl.expand_dims(words, 0)
            )  # fmt: skip
            zero_w = gl.zeros([ROWS, CB], gl.int32, wq_layout)
            w_cols = zero_w + gl.expand_dims(words, 0)

            # scale codes [ROWS, 4, G_LANE]: group t G_LANE + q of the step
            r3 = gl.arange(0, ROWS, gl.SliceLayout(1, gl.SliceLayout(2, s_layout)))
            row_s = _program_rows(r3, pid_n, N, BN, GATED, ACTIVATION)
            t3 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, s_layout)))
            q3 = gl.arange(0, G_LANE, gl.SliceLayout(0, gl.SliceLayout(1, s_layout)))
            s_groups = (
                gl.zeros([ROWS, 4, G_LANE], gl.int32, s_layout)
                + gl.expand_dims(gl.expand_dims(t3 * G_LANE, 0), 2)
                + gl.expand_dims(gl.expand_dims(q3, 0), 1)
            )  # fmt: skip
            row3 = gl.expand_dims(gl.expand_dims(row_s.to(gl.int64) * stride_sn, 1), 2)
            s_ptrs = s_ptr + e * stride_se + row3 + s_groups

            # the slots' activations, a slot a column (DIRECT: the first): pairs [4 CB, 8];
            # columns without a slot read row 0 (their results are not stored)
            xk = gl.arange(0, 4 * CB, gl.SliceLayout(1, x_layout))
            xn = gl.arange(0, 8, gl.SliceLayout(0, x_layout))
            if DIRECT:
                slots = gl.where(xn == 0, pid_m, num_slots)
            else:
                slots = gl.load(sorted_ids_ptr + pid_m * 8 + xn)
            rows = gl.where(slots < num_slots, slots // A_ROW_DIV, 0).to(gl.int64)
            zero_x = gl.zeros([4 * CB, 8], gl.int32, x_layout)
            x_k = zero_x + gl.expand_dims(xk, 1)
            x_ptrs = (
                a_ptr.to(gl.pointer_type(gl.int32))
                + gl.expand_dims(rows * (stride_am // 2), 0) + x_k
            )  # fmt: skip

            # loaded two steps ahead, in rounds of three steps (so that no loaded value is
            # moved between registers): first the rounds whose loads lie inside K, unmasked,
            # then the rest masked (steps past the last: weight codes 0, activations 0.0)
            num_k = gl.cdiv(K // 2, STEP_BYTES)
            num_full = (K // 2) // STEP_BYTES
            w0, s0, x0 = _gemv_loads(0, w_ptrs, w_cols, s_ptrs, s_groups, x_ptrs, x_k, K, CB,
                                     True)  # fmt: skip
            w1, s1, x1 = _gemv_loads(1, w_ptrs, w_cols, s_ptrs, s_groups, x_ptrs, x_k, K, CB,
                                     True)  # fmt: skip
            acc = gl.zeros([ROWS, 8], gl.float32, mma)
            # a round starting at kb loads up to step kb + 4
            num_inside = gl.maximum(num_full - 2, 0) // 3
            for i in range(0, num_inside):
                acc, w0, s0, x0, w1, s1, x1 = _gemv_round(
                    acc, 3 * i, w0, s0, x0, w1, s1, x1, w_ptrs, w_cols, s_ptrs, s_groups,
                    x_ptrs, x_k, K, wq_layout, a_layout, b_layout, ROWS, CB, False,
                )  # fmt: skip
            for kb in range(3 * num_inside, num_k, 3):
                acc, w0, s0, x0, w1, s1, x1 = _gemv_round(
                    acc, kb, w0, s0, x0, w1, s1, x1, w_ptrs, w_cols, s_ptrs, s_groups, x_ptrs,
                    x_k, K, wq_layout, a_layout, b_layout, ROWS, CB, True,
                )  # fmt: skip

            _gemv_epilogue(
                acc, e, pid_m, pid_n, bias_ptr, stride_be, stride_bn, out_ptr, stride_om,
                topk_weights_ptr, sorted_ids_ptr, N, num_slots, alpha, beta, limit, ROWS, BN,
                HAS_BIAS, ACTIVATION, GATED, HAS_LIMIT, MUL_ROUTED_WEIGHT, H_DTYPE, DIRECT,
            )  # fmt: skip

    @gluon.jit
    def _program_rows(r, pid_n, N, BN: gl.constexpr, GATED: gl.constexpr,
                      ACTIVATION: gl.constexpr):  # fmt: skip
        """The weight rows of the program's rows r: tile r // 64, warp (r // 16) % 4, row r % 16
        of the warp's tile (GATED: rows 0-7 the gate rows and 8-15 the up rows of its 8 output
        columns). Columns past N read column N - 1 (their results are not stored)."""
        if GATED:  # noqa: SIM108 (a constexpr branch)
            col = (r // 16) * 8 + r % 8
        else:
            col = r
        gate, up = gate_up_rows(gl.minimum(pid_n * BN + col, N - 1), N, GATED, ACTIVATION)
        if GATED:
            gate = gl.where((r // 8) % 2 == 0, gate, up)
        return gate

    @gluon.jit
    def _slot_expert(slot, ids_ptr, map_ptr, num_ids, HAS_MAP: gl.constexpr):
        """The local expert of a slot (-1: none, or another rank's)."""
        expert = gl.load(ids_ptr + slot).to(gl.int32)
        expert = gl.where(expert < num_ids, expert, -1)
        if HAS_MAP:
            expert = gl.load(map_ptr + expert, mask=expert >= 0, other=-1).to(gl.int32)
        return expert

    @gluon.jit
    def _gemv_epilogue(
        acc, e, pid_m, pid_n, bias_ptr, stride_be, stride_bn, out_ptr, stride_om,
        topk_weights_ptr, sorted_ids_ptr, N, num_slots, alpha, beta, limit, ROWS: gl.constexpr,
        BN: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
        GATED: gl.constexpr, HAS_LIMIT: gl.constexpr, MUL_ROUTED_WEIGHT: gl.constexpr,
        H_DTYPE: gl.constexpr, DIRECT: gl.constexpr,
    ):  # fmt: skip
        """The accumulator [ROWS, 8] (the program's rows by its slots: DIRECT, slot pid_m in
        column 0; else block pid_m's 8) -> the gate and up accumulators [BN, 8] of columns
        pid_n BN .. -> wo_hopper.mx_epilogue."""
        out_l: gl.constexpr = gl.BlockedLayout([1, 2, 1, 8], [4, 1, 8, 1], [4, 1, 1, 1],
                                               [3, 1, 2, 0])  # fmt: skip
        if GATED:
            acc4 = gl.convert_layout(gl.reshape(acc, [ROWS // 16, 2, 8, 8]), out_l)
            acc_g, acc_u = gl.split(gl.permute(acc4, (0, 2, 3, 1)))
            acc_g = gl.reshape(acc_g, [BN, 8])
            acc_u = gl.reshape(acc_u, [BN, 8])
        else:
            acc_g = acc
            acc_u = acc
        epi: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
        acc_g = gl.convert_layout(acc_g, epi)
        acc_u = gl.convert_layout(acc_u, epi)
        mx_epilogue(
            acc_g, acc_u, pid_n * BN, e, pid_m, bias_ptr, stride_be, stride_bn, out_ptr,
            stride_om, topk_weights_ptr, sorted_ids_ptr, N, num_slots, alpha, beta, limit, epi,
            BN, 8, HAS_BIAS, ACTIVATION, GATED, HAS_LIMIT, MUL_ROUTED_WEIGHT, H_DTYPE, False,
            DIRECT,
        )  # fmt: skip


def _bases(shape_len: int, axis: int, count: int, start: int = 1) -> list[list[int]]:
    """count bases along `axis` of a rank-shape_len layout: start, 2 start, 4 start, ..."""
    out = []
    for b in range(count):
        v = [0] * shape_len
        v[axis] = start << b
        out.append(v)
    return out


@functools.cache
def gemv_layouts(tiles: int, cb: int) -> dict:
    """The layouts wo_mx_gemv_kernel takes (module docstring), for TILES and CB."""
    rows = 64 * tiles
    log_t = tiles.bit_length() - 1
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    # weight words [rows, cb] of a step: lane 4 g + t of warp w reads words cb t / 4 .. of rows
    # 16 w + g and 16 w + g + 8 of each 64-row tile
    tile_rows = _bases(2, 0, log_t, 64)
    wq_layout = gl.DistributedLinearLayout(
        reg_bases=[*_bases(2, 1, (cb // 4).bit_length() - 1), [8, 0], *tile_rows],
        lane_bases=[[0, cb // 4], [0, cb // 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[rows, cb],
    )
    # the same as [row, t, group of the lane's run, word of the group] (the scale codes' parent)
    g_lane = cb // 16
    w4_layout = gl.DistributedLinearLayout(
        reg_bases=[*_bases(4, 3, 2), *_bases(4, 2, g_lane.bit_length() - 1), [8, 0, 0, 0],
                   *_bases(4, 0, log_t, 64)],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]],
        block_bases=[],
        shape=[rows, 4, g_lane, 4],
    )  # fmt: skip
    # activation pairs [4 cb, 8]: lane 4 g + t reads pairs cb t .. (k 2 cb t ..) of column g
    x_layout = gl.DistributedLinearLayout(
        reg_bases=_bases(2, 0, cb.bit_length() - 1),
        lane_bases=[[cb, 0], [2 * cb, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 0], [0, 0]],
        block_bases=[],
        shape=[4 * cb, 8],
    )
    return dict(mma=mma, wq_layout=wq_layout, w4_layout=w4_layout, x_layout=x_layout)
