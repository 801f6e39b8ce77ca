"""The prefill form of wo_hopper's MXFP4 x bf16 expert GEMMs (Gluon, Hopper): tiles of 128 or
256 slots, each K step's weights decoded once into a shared-memory operand that two
warpgroups multiply with half the slots each (fusedmoe.kernels.wo_hopper's module docstring,
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
    def _tile_rows(r, n0, N, HALF: gl.constexpr, GATED: gl.constexpr, ACTIVATION: gl.constexpr):
        """The w13 rows of a prefill tile's rows r (< 2 HALF) and whether their output column is
        < N: for GATED, rows below HALF are the gate rows of output columns n0 + r, the others
        the up rows of n0 + r - HALF; else the rows n0 + r."""
        if GATED:
            col = n0 + r % HALF
            gate, up = gate_up_rows(col, N, GATED, ACTIVATION)
            return gl.where(r < HALF, gate, up), col < N
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
        BLOCK_M: gl.constexpr,  # slots of the tile: 128 or 256, half to each warpgroup
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
    ):  # fmt: skip
        """The prefill form (module docstring, "Prefill"): 128 weight rows (GATED: the gate and
        up rows of 64 output columns; else 128 output columns) decoded once per 64-column K step
        into shared memory, where two warpgroups read them for BLOCK_M / 2 slots each."""
        R: gl.constexpr = _ROWS
        BN: gl.constexpr = R // 2 if GATED else R  # output columns of the tile
        BK: gl.constexpr = 64  # a K step: one 64-column block
        gl.static_assert(R == 128, "the decode layouts below are for 128 rows on 8 warps")
        gl.static_assert(STAGES >= 3, "the ring refills the stage of step kb - 2")
        gl.static_assert(BLOCK_M == 128 or BLOCK_M == 256, "tiles of 128 or 256 slots")
        pid_m, pid_n = grouped_tile(gl.program_id(0), N, BN, max_blocks, GROUP_M)
        n0 = pid_n * BN
        num_post = gl.load(num_post_ptr)
        if pid_m * BLOCK_M < num_post:
            e = gl.load(expert_ids_ptr + pid_m).to(gl.int64)

            # the accumulators: [64, BLOCK_M], each warpgroup half the slots
            mma: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_M // 2, 16]
            )
            # the weight bytes of a step [128 rows, 32 bytes]: two threads a row, 16 bytes
            # (one E8M0 group) each; copied and read in the same layout
            w_layout: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]],
                lane_bases=[[0, 16], [1, 0], [2, 0], [4, 0], [8, 0]],
                warp_bases=[[16, 0], [32, 0], [64, 0]],
                block_bases=[],
                shape=[R, 32],
            )
            s_layout: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
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
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, R, BK], nvmma)

            r_w = gl.arange(0, R, gl.SliceLayout(1, w_layout))
            row_w, valid_w = _tile_rows(r_w, n0, N, R // 2, GATED, ACTIVATION)
            byte = gl.arange(0, 32, gl.SliceLayout(0, w_layout))
            w_ptrs = w_ptr + e * stride_we + row_w.to(gl.int64)[:, None] * stride_wn + byte[None, :]
            w_mask = (gl.zeros([R, 32], gl.int32, w_layout) + valid_w.to(gl.int32)[:, None]) != 0

            r_s = gl.arange(0, R, gl.SliceLayout(1, s2))
            row_s, valid_s = _tile_rows(r_s, n0, N, R // 2, GATED, ACTIVATION)
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
            for i in gl.static_range(STAGES - 2):
                live = i < num_k
                async_copy.async_copy_global_to_shared(
                    w_smem.index(i), w_ptrs + i * (BK // 2), mask=w_mask & live
                )
                async_copy.async_copy_global_to_shared(
                    x_smem.index(i), x_ptrs + i * BK, mask=x_mask & live
                )
                async_copy.commit_group()
            sc = scale_pair(gl.load(s_ptrs, mask=s_mask & (half[None, :] < num_groups), other=127))

            acc_g = gl.zeros([64, BLOCK_M], gl.float32, mma)
            acc_u = gl.zeros([64, BLOCK_M], gl.float32, mma)
            for kb in range(num_k):
                stage = kb % STAGES
                g_next = 2 * kb + 2 + half[None, :]
                sc_next = scale_pair(
                    gl.load(s_ptrs + 2 * kb + 2, mask=s_mask & (g_next < num_groups), other=127)
                )
                async_copy.wait_group(STAGES - 3)
                # every copy of step kb landed; every warp waited for the wgmma of step kb - 2,
                # so its stage and its operand buffer are free
                gl.thread_barrier()
                nxt = kb + STAGES - 2
                live = nxt < num_k
                async_copy.async_copy_global_to_shared(
                    w_smem.index(nxt % STAGES), w_ptrs + nxt * (BK // 2), mask=w_mask & live
                )
                async_copy.async_copy_global_to_shared(
                    x_smem.index(nxt % STAGES), x_ptrs + nxt * BK, mask=x_mask & live
                )
                async_copy.commit_group()
                # decode the step's weights (while the previous step's wgmma runs) into the
                # operand buffer, in the k order of the module docstring: stored byte
                # j = 8c + 2s + b, nibble h -> tensor column 16s + 8h + 2c + b
                w = w_smem.index(stage).load(w_layout)
                s_rep = gl.full([R, 2, 16], 0, gl.int32, s_layout)
                s_rep = gl.broadcast(gl.expand_dims(sc, 2), s_rep)[0]
                s_rep = gl.reshape(s_rep, [R, 32])
                s_rep = gl.convert_layout(s_rep, w_layout, assert_trivial=True)
                low, high = fp4_scaled(w, s_rep)
                v = gl.reshape(gl.join(low, high), [R, 4, 4, 2, 2])
                v = gl.reshape(gl.permute(v, (0, 2, 4, 1, 3)), [R, BK])
                op = a_smem.index(kb % 2)
                op.store(v)
                fence_async_shared()
                gl.thread_barrier()
                x_t = x_smem.index(stage).permute((1, 0))
                acc_g = warpgroup_mma(op.slice(0, 64, 0), x_t, acc_g, is_async=True)
                acc_u = warpgroup_mma(op.slice(64, 64, 0), x_t, acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                sc = sc_next
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            async_copy.wait_group(0)

            if GATED:
                mx_epilogue(
                    acc_g, acc_u, n0, e, pid_m, bias_ptr, stride_be, stride_bn, out_ptr,
                    stride_om, topk_weights_ptr, sorted_ids_ptr, N, num_slots, alpha, beta,
                    limit, mma, 64, BLOCK_M, HAS_BIAS, ACTIVATION, GATED, HAS_LIMIT,
                    MUL_ROUTED_WEIGHT, H_DTYPE, PERMUTE_OUT,
                )  # fmt: skip
            else:  # rows 64 .. 127 are output columns n0 + 64 ..
                for h in gl.static_range(2):
                    acc = acc_g if h == 0 else acc_u
                    mx_epilogue(
                        acc, acc, n0 + 64 * h, e, pid_m, bias_ptr, stride_be, stride_bn,
                        out_ptr, stride_om, topk_weights_ptr, sorted_ids_ptr, N, num_slots,
                        alpha, beta, limit, mma, 64, BLOCK_M, HAS_BIAS, ACTIVATION, GATED,
                        HAS_LIMIT, MUL_ROUTED_WEIGHT, H_DTYPE, PERMUTE_OUT,
                    )  # fmt: skip
