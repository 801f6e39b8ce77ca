"""The prefill form of wo_hopper's MXFP4 x bf16 expert GEMMs (Gluon, Hopper): tiles of 128 slots
by 256 weight rows, each K step's weights decoded once into shared memory as wgmma's right
operand, the slots' activations its left (fusedmoe.kernels.wo_hopper's module docstring,
"Prefill"; the k order, the scale trick and the epilogues are that module's). Launched by
wo_hopper.launch_mx_hopper."""

from __future__ import annotations

import triton.language as tl

from fusedmoe.kernels.moe_gemm import gate_up_rows, grouped_tile
from fusedmoe.kernels.wo_hopper import (
    PREFILL_ROWS,
    async_copy,
    fence_async_shared,
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
    def _tile_rows(r, n0, N, GATED: gl.constexpr, ACTIVATION: gl.constexpr):
        """The w13 rows of a tile's operand rows r and whether their output column is < N:
        for GATED, gate and up rows of output column n0 + r // 2 alternate (so that each
        thread's accumulator holds both of a column); else the rows n0 + r."""
        if GATED:
            col = n0 + r // 2
            gate, up = gate_up_rows(col, N, GATED, ACTIVATION)
            return gl.where(r % 2 == 0, gate, up), col < N
        col = n0 + r
        return col, col < N

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
        BLOCK_M: gl.constexpr,  # slots of the tile: 128, 64 to each warpgroup
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
    ):  # fmt: skip
        """The prefill form (module docstring): 256 weight rows (GATED: the gate and up rows of
        128 output columns, alternating; else 256 output columns) decoded once per 64-column K
        step into shared memory, wgmma's right operand; the slots' activations its left, 64
        slots to each warpgroup; the accumulator [slots, weight rows]."""
        R: gl.constexpr = _ROWS
        BN: gl.constexpr = R // 2 if GATED else R  # output columns of the tile
        BK: gl.constexpr = 64  # a K step: one 64-column block
        gl.static_assert(R == 256, "the decode layouts below are for 256 rows on 8 warps")
        gl.static_assert(STAGES >= 3, "the ring refills the stage of step kb - 1")
        gl.static_assert(BLOCK_M == 128, "tiles of 128 slots: 64 a warpgroup")
        pid_m, pid_n = grouped_tile(gl.program_id(0), N, BN, max_blocks, GROUP_M)
        n0 = pid_n * BN
        num_post = gl.load(num_post_ptr)
        if pid_m * BLOCK_M < num_post:
            e = gl.load(expert_ids_ptr + pid_m).to(gl.int64)

            # the accumulator [BLOCK_M slots, R weight rows]: warpgroup g has slots 64 g ..
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, R, 16]
            )
            # the weight bytes of a step [256 rows, 32 bytes]: two threads a row, 16 bytes (one
            # E8M0 group) each, rows r and r + 128; copied and read in the same layout
            w_layout: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [128, 0]],
                lane_bases=[[0, 16], [1, 0], [2, 0], [4, 0], [8, 0]],
                warp_bases=[[16, 0], [32, 0], [64, 0]],
                block_bases=[],
                shape=[R, 32],
            )
            s_layout: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [128, 0, 0]],
                lane_bases=[[0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0], [8, 0, 0]],
                warp_bases=[[16, 0, 0], [32, 0, 0], [64, 0, 0]],
                block_bases=[],
                shape=[R, 2, 16],
            )
            s2: gl.constexpr = gl.SliceLayout(2, s_layout)  # [row, half]: a byte a thread
            x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
            w_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            nvmma: gl.constexpr = gl.NVMMASharedLayout(
                swizzle_byte_width=128, element_bitwidth=16, rank=2
            )
            w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, R, 32], w_shared)
            x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], nvmma)
            b_smem = gl.allocate_shared_memory(gl.bfloat16, [2, R, BK], nvmma)

            r_w = gl.arange(0, R, gl.SliceLayout(1, w_layout))
            row_w, valid_w = _tile_rows(r_w, n0, N, GATED, ACTIVATION)
            byte = gl.arange(0, 32, gl.SliceLayout(0, w_layout))
            w_ptrs = w_ptr + e * stride_we + row_w.to(gl.int64)[:, None] * stride_wn + byte[None, :]
            w_mask = (gl.zeros([R, 32], gl.int32, w_layout) + valid_w.to(gl.int32)[:, None]) != 0

            r_s = gl.arange(0, R, gl.SliceLayout(1, s2))
            row_s, valid_s = _tile_rows(r_s, n0, N, GATED, ACTIVATION)
            half = gl.arange(0, 2, gl.SliceLayout(0, s2))
            s_ptrs = s_ptr + e * stride_se + row_s.to(gl.int64)[:, None] * stride_sn + half[None, :]
            s_mask = (gl.zeros([R, 2], gl.int32, s2) + valid_s.to(gl.int32)[:, None]) != 0
            num_groups = K // 32

            slot_x = gl.load(
                sorted_ids_ptr + pid_m * BLOCK_M
                + gl.arange(0, BLOCK_M, gl.SliceLayout(1, x_layout))
            )  # fmt: skip
            t = gl.arange(0, BK, gl.SliceLayout(0, x_layout))
            x_ptrs = a_ptr + (slot_x // A_ROW_DIV).to(gl.int64)[:, None] * stride_am + t[None, :]
            x_mask = (gl.zeros([BLOCK_M, BK], gl.int32, x_layout) + slot_x[:, None]) < num_slots

            num_k = K // BK  # K is a multiple of 64
            for i in gl.static_range(STAGES - 1):
                _copy_step(i, num_k, w_smem, x_smem, w_ptrs, w_mask, x_ptrs, x_mask)
            # the scale codes load a step before their decode and are converted there (plain
            # loads: the fence before each wgmma waits for them, so they are kept small)
            code = _step_codes(s_ptrs, s_mask, half, 0, num_groups)
            async_copy.wait_group(STAGES - 2)  # step 0 landed
            gl.thread_barrier()
            _decode_step(w_smem.index(0).load(w_layout), code, b_smem.index(0), s_layout)
            code = _step_codes(s_ptrs, s_mask, half, 1, num_groups)
            fence_async_shared()
            gl.thread_barrier()

            acc = gl.zeros([BLOCK_M, R], gl.float32, mma)
            for kb in range(num_k):
                acc = warpgroup_mma(
                    x_smem.index(kb % STAGES), b_smem.index(kb % 2).permute((1, 0)), acc,
                    is_async=True,
                )  # fmt: skip
                code_next = _step_codes(s_ptrs, s_mask, half, kb + 2, num_groups)
                # step kb - 1's wgmma done (this warpgroup's; the barrier: both); step kb + 1's
                # copies landed (STAGES - 3 younger ones may not have). Step kb's wgmma stays in
                # flight while step kb + 1 is decoded, and until step kb + 1's wgmma is queued
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                async_copy.wait_group(STAGES - 3)
                gl.thread_barrier()
                # refill the stage of step kb - 1 (its wgmma and its decode are done)
                _copy_step(kb + STAGES - 1, num_k, w_smem, x_smem, w_ptrs, w_mask, x_ptrs, x_mask)
                # decode step kb + 1 into the buffer step kb - 1 read (past the last step: zeros
                # into a buffer nobody reads)
                w_next = w_smem.index((kb + 1) % STAGES).load(w_layout)
                _decode_step(w_next, code, b_smem.index((kb + 1) % 2), s_layout)
                code = code_next
                fence_async_shared()
                gl.thread_barrier()  # every warp's decode stored before step kb + 1's wgmma
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            async_copy.wait_group(0)

            if GATED:  # alternating gate and up columns: a register pair of each thread
                acc_g, acc_u = gl.split(gl.reshape(acc, [BLOCK_M, BN, 2]))
            else:
                acc_g = acc
                acc_u = acc
            out_layout: gl.constexpr = acc_g.type.layout
            mx_epilogue(
                acc_g, acc_u, n0, e, pid_m, bias_ptr, stride_be, stride_bn, out_ptr,
                stride_om, topk_weights_ptr, sorted_ids_ptr, N, num_slots, alpha, beta,
                limit, out_layout, BN, BLOCK_M, HAS_BIAS, ACTIVATION, GATED, HAS_LIMIT,
                MUL_ROUTED_WEIGHT, H_DTYPE, PERMUTE_OUT, True,
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
    def _step_codes(s_ptrs, s_mask, half, step, num_groups):
        """This thread's E8M0 scale codes of K step `step` [R, 2]; 127 past the last group."""
        g = 2 * step + half[None, :]
        return gl.load(s_ptrs + 2 * step, mask=s_mask & (g < num_groups), other=127)

    @gluon.jit
    def _decode_step(w, code, dst, s_layout: gl.constexpr):
        """A step's weight bytes [R, 32] and scale codes [R, 2] -> bf16 [R, 64] in the module
        docstring's k order (stored byte j = 8c + 2s + b, nibble h -> tensor column 16s + 8h +
        2c + b), stored into the operand buffer dst."""
        R: gl.constexpr = w.shape[0]
        w_layout: gl.constexpr = w.type.layout
        sc = scale_pair(code)
        s_rep = gl.full([R, 2, 16], 0, gl.int32, s_layout)
        s_rep = gl.broadcast(gl.expand_dims(sc, 2), s_rep)[0]
        s_rep = gl.convert_layout(gl.reshape(s_rep, [R, 32]), w_layout, assert_trivial=True)
        low, high = fp4_scaled(w, s_rep)
        v = gl.reshape(gl.join(low, high), [R, 4, 4, 2, 2])
        dst.store(gl.reshape(gl.permute(v, (0, 2, 4, 1, 3)), [R, 64]))
