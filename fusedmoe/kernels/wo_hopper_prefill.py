"""The prefill form of wo_hopper's MXFP4 x bf16 expert GEMMs (Gluon, Hopper): tiles of 256
weight rows by 128 slots, each K step's weights decoded straight into wgmma's left operand in
registers, the slots' activations its right operand in shared memory
(fusedmoe.kernels.wo_hopper's module docstring, "Prefill"; the k order, the scale trick and the
epilogues are that module's). Launched by wo_hopper.launch_mx_hopper."""

from __future__ import annotations

import triton.language as tl

from fusedmoe.kernels.moe_gemm import gate_up_rows, grouped_tile
from fusedmoe.kernels.wo_hopper import (
    PREFILL_ROWS,
    async_copy,
    fp4_scaled,
    gl,
    gluon,
    mx_epilogue,
    scale_pair,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = ["wo_mx_hopper_prefill_kernel"]

_ROWS = tl.constexpr(PREFILL_ROWS)  # weight rows a program (wo_hopper.PREFILL_ROWS)

if gluon is not None:

    @gluon.jit
    def wo_mx_hopper_prefill_kernel(
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
        PERMUTE_OUT: gl.constexpr,
        BLOCK_M: gl.constexpr,  # slots of the tile: wgmma's right operand, 128 wide
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
    ):  # fmt: skip
        """The prefill form (module docstring): 256 weight rows in two sets of 128 (GATED: the
        gate and the up rows of 128 output columns; else rows n0 .. n0 + 127 and the next 128),
        each set decoded per 64-column K step straight into wgmma's left operand in registers,
        64 rows a warpgroup; the slots' activations the right operand, in shared memory; an
        accumulator [128 rows, BLOCK_M slots] a set. Each set's decode overlaps the other
        set's wgmma."""
        RS: gl.constexpr = _ROWS // 2  # weight rows of a set: 64 a warpgroup
        BN: gl.constexpr = RS if GATED else 2 * RS  # output columns of the tile
        BK: gl.constexpr = 64  # a K step: one 64-column block
        gl.static_assert(RS == 128, "the layouts below are for sets of 128 rows on 8 warps")
        gl.static_assert(BLOCK_M == 128, "two accumulators [128, BLOCK_M]: the register budget")
        gl.static_assert(STAGES >= 3, "the ring refills the stage of step kb - 2")
        pid_m, pid_n = grouped_tile(gl.program_id(0), N, BN, max_blocks, GROUP_M)
        n0 = pid_n * BN
        num_post = gl.load(num_post_ptr)
        if pid_m * BLOCK_M < num_post:
            e = gl.load(expert_ids_ptr + pid_m).to(gl.int64)

            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_M, 16]
            )
            a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
            # a set's weight bytes of a step [128 rows, 32 bytes] as wgmma's left operand needs
            # them: thread c of row c' (lane 4 c' + c) of warp w has bytes 8c .. 8c + 7 of rows
            # 16 w + c' and 16 w + c' + 8 (one E8M0 group: group c // 2 of the step)
            w_layout: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                warp_bases=[[16, 0], [32, 0], [64, 0]],
                block_bases=[],
                shape=[RS, 32],
            )
            s_layout: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]],
                lane_bases=[[0, 0, 8], [0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                warp_bases=[[16, 0, 0], [32, 0, 0], [64, 0, 0]],
                block_bases=[],
                shape=[RS, 2, 16],
            )
            s2: gl.constexpr = gl.SliceLayout(2, s_layout)  # [row, group of the step]
            # the copies, 16 bytes a thread: both sets' weight bytes [256 rows, 32], x [slots, 64]
            wc_layout: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [8, 1], [1, 0])
            x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
            w_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            nvmma: gl.constexpr = gl.NVMMASharedLayout(
                swizzle_byte_width=128, element_bitwidth=16, rank=2
            )
            w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 2 * RS, 32], w_shared)
            x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], nvmma)

            r_c = gl.arange(0, 2 * RS, gl.SliceLayout(1, wc_layout))
            row_c, valid_c = _set_rows(r_c, n0, N, GATED, ACTIVATION)
            byte = gl.arange(0, 32, gl.SliceLayout(0, wc_layout))
            w_ptrs = w_ptr + e * stride_we + row_c.to(gl.int64)[:, None] * stride_wn + byte[None, :]
            zero_w = gl.zeros([2 * RS, 32], gl.int32, wc_layout)
            w_mask = (zero_w + valid_c.to(gl.int32)[:, None]) != 0

            r_s = gl.arange(0, RS, gl.SliceLayout(1, s2))
            half = gl.arange(0, 2, gl.SliceLayout(0, s2))
            zero_s = gl.zeros([RS, 2], gl.int32, s2)
            row_g, valid_g = _set_rows(r_s, n0, N, GATED, ACTIVATION)
            row_u, valid_u = _set_rows(r_s + RS, n0, N, GATED, ACTIVATION)
            s_base = s_ptr + e * stride_se + half[None, :]
            sg_ptrs = s_base + row_g.to(gl.int64)[:, None] * stride_sn
            su_ptrs = s_base + row_u.to(gl.int64)[:, None] * stride_sn
            sg_mask = (zero_s + valid_g.to(gl.int32)[:, None]) != 0
            su_mask = (zero_s + valid_u.to(gl.int32)[:, None]) != 0
            num_groups = K // 32

            slot_x = gl.load(
                sorted_ids_ptr + pid_m * BLOCK_M
                + gl.arange(0, BLOCK_M, gl.SliceLayout(1, x_layout))
            )  # fmt: skip
            t = gl.arange(0, BK, gl.SliceLayout(0, x_layout))
            x_ptrs = a_ptr + (slot_x // A_ROW_DIV).to(gl.int64)[:, None] * stride_am + t[None, :]
            x_mask = (gl.zeros([BLOCK_M, BK], gl.int32, x_layout) + slot_x[:, None]) < num_slots

            num_k = K // BK  # K is a multiple of 64
            for i in gl.static_range(STAGES - 2):
                _copy_step(i, num_k, w_smem, x_smem, w_ptrs, w_mask, x_ptrs, x_mask)
            # the scale codes: plain loads two steps ahead of their decode
            cg0 = _step_codes(sg_ptrs, sg_mask, half, 0, num_groups)
            cu0 = _step_codes(su_ptrs, su_mask, half, 0, num_groups)
            cg1 = _step_codes(sg_ptrs, sg_mask, half, 1, num_groups)
            cu1 = _step_codes(su_ptrs, su_mask, half, 1, num_groups)

            acc_g = gl.zeros([RS, BLOCK_M], gl.float32, mma)
            acc_u = gl.zeros([RS, BLOCK_M], gl.float32, mma)
            for kb in range(num_k):
                # step kb's copies landed (this thread's; the barrier: every thread's). No
                # proxy fence between cp.async and wgmma, relying on what Triton's own
                # pipelines rely on (wo_hopper's module docstring); a fence here compiles to
                # MEMBAR.ALL.CTA, which waits for every load in flight. Every warpgroup is past
                # step kb - 1's first wait, so step kb - 2's wgmma are done: its stage is
                # refilled (step kb - 1's second wgmma may still be reading its x)
                async_copy.wait_group(STAGES - 3)
                gl.thread_barrier()
                _copy_step(kb + STAGES - 2, num_k, w_smem, x_smem, w_ptrs, w_mask, x_ptrs, x_mask)
                cg2 = _step_codes(sg_ptrs, sg_mask, half, kb + 2, num_groups)
                cu2 = _step_codes(su_ptrs, su_mask, half, kb + 2, num_groups)
                w_step = w_smem.index(kb % STAGES)
                x_t = x_smem.index(kb % STAGES).permute((1, 0))
                a_g = _decode_rows(w_step.slice(0, RS, 0).load(w_layout), cg0, s_layout, a_layout)
                acc_g = warpgroup_mma(a_g, x_t, acc_g, is_async=True)
                # the other set's wgmma of step kb - 1 done; this one runs while the second set
                # is decoded. Each set's operand registers are written again (the next step)
                # only after the wait that retires its wgmma: in PTX they are the same registers
                # every step, and a register operand must not change while its wgmma is in
                # flight (the wait's deps keep values alive, not the packed registers wgmma reads)
                acc_g, acc_u, a_g = warpgroup_mma_wait(num_outstanding=1, deps=(acc_g, acc_u, a_g))
                a_u = _decode_rows(w_step.slice(RS, RS, 0).load(w_layout), cu0, s_layout, a_layout)
                acc_u = warpgroup_mma(a_u, x_t, acc_u, is_async=True)
                acc_g, acc_u, a_u = warpgroup_mma_wait(num_outstanding=1, deps=(acc_g, acc_u, a_u))
                cg0 = cg1
                cu0 = cu1
                cg1 = cg2
                cu1 = cu2
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            async_copy.wait_group(0)

            if GATED:
                mx_epilogue(
                    acc_g, acc_u, n0, e, pid_m, bias_ptr, stride_be, stride_bn, out_ptr,
                    stride_om, topk_weights_ptr, sorted_ids_ptr, N, num_slots, alpha, beta,
                    limit, mma, RS, BLOCK_M, HAS_BIAS, ACTIVATION, GATED, HAS_LIMIT,
                    MUL_ROUTED_WEIGHT, H_DTYPE, PERMUTE_OUT,
                )  # fmt: skip
            else:  # two sets of output columns
                for j in gl.static_range(2):
                    acc = acc_g if j == 0 else acc_u
                    mx_epilogue(
                        acc, acc, n0 + j * RS, e, pid_m, bias_ptr, stride_be, stride_bn,
                        out_ptr, stride_om, topk_weights_ptr, sorted_ids_ptr, N, num_slots,
                        alpha, beta, limit, mma, RS, BLOCK_M, HAS_BIAS, ACTIVATION, GATED,
                        HAS_LIMIT, MUL_ROUTED_WEIGHT, H_DTYPE, PERMUTE_OUT,
                    )  # fmt: skip

    @gluon.jit
    def _copy_step(step, num_k, w_smem, x_smem, w_ptrs, w_mask, x_ptrs, x_mask):
        """The cp.async copies of 64-column K step `step` into its stage (zeros past the last
        step), committed as one group."""
        STAGES: gl.constexpr = x_smem.shape[0]
        live = step < num_k
        async_copy.async_copy_global_to_shared(
            w_smem.index(step % STAGES), w_ptrs + step * 32, mask=w_mask & live
        )
        async_copy.async_copy_global_to_shared(
            x_smem.index(step % STAGES), x_ptrs + step * 64, mask=x_mask & live
        )
        async_copy.commit_group()

    @gluon.jit
    def _set_rows(r, n0, N, GATED: gl.constexpr, ACTIVATION: gl.constexpr):
        """The w13 rows of the prefill form's operand rows r (< 256: two sets of 128) and
        whether their output column is < N: GATED, set 0 the gate rows and set 1 the up rows
        of output columns n0 + r % 128; else the rows n0 + r."""
        if GATED:
            col = n0 + r % 128
            gate, up = gate_up_rows(col, N, GATED, ACTIVATION)
            return gl.where(r < 128, gate, up), col < N
        col = n0 + r
        return col, col < N

    @gluon.jit
    def _decode_rows(w, code, s_layout: gl.constexpr, a_layout: gl.constexpr):
        """A set's weight bytes of a step [128, 32] and scale codes [128, 2] -> wgmma's left
        operand [128, 64] bf16 in registers, in the module docstring's k order (stored byte j =
        8c + 2s + b, nibble h -> tensor column 16s + 8h + 2c + b)."""
        R: gl.constexpr = w.shape[0]
        w_layout: gl.constexpr = w.type.layout
        sc = scale_pair(code)
        s_rep = gl.full([R, 2, 16], 0, gl.int32, s_layout)
        s_rep = gl.broadcast(gl.expand_dims(sc, 2), s_rep)[0]
        s_rep = gl.convert_layout(gl.reshape(s_rep, [R, 32]), w_layout, assert_trivial=True)
        low, high = fp4_scaled(w, s_rep)
        v = gl.reshape(gl.join(low, high), [R, 4, 4, 2, 2])
        v = gl.reshape(gl.permute(v, (0, 2, 4, 1, 3)), [R, 64])
        return gl.convert_layout(v, a_layout, assert_trivial=True)

    @gluon.jit
    def _step_codes(s_ptrs, s_mask, half, step, num_groups):
        """This thread's E8M0 scale codes of K step `step` [128, 2]; 127 past the last group."""
        g = 2 * step + half[None, :]
        return gl.load(s_ptrs + 2 * step, mask=s_mask & (g < num_groups), other=127)
