"""Hopper grouped GEMM over the contiguous expert-aligned layout, written in Gluon (Triton's
lower-level dialect): the DeepGEMM-style FP8 128-block GEMM of the deep_gemm backend's "wgmma"
engine, and a bf16 variant.

    out[r, :] = sum over K blocks kb of  (a[r, kb] @ w[e(r), :, kb].T) * a_scale[r, kb]
                                                                      * w_scale[e(r), n // 128, kb]

a [M_sum, K] FP8 in runs of 128 rows of one expert (deep_gemm_moe's contiguous layout; FP8
also runs of 64),
w [E_l, N, K] FP8 with 128 x 128 block scales, a_scale [M_sum, K / 128] float32 (column-major,
as the layout writes it: TMA reads a row block's scales as one line; other strides are copied
to it first), out [M_sum, N] bf16 / fp16. Unscaled (bf16 / fp16 a and w): the same without
the scales. Row blocks past num_rows or of expert -1 are skipped; padding
rows inside a run are computed from whatever a holds and never read back.

Why Gluon: with the per-128-K scales, DeepGEMM forms each K block's product apart (a wgmma with
a zero accumulator) and then scales it into a float32 sum (the promotion). Plain Triton waits
for that wgmma before scaling, with all warps in lock step, and the tensor cores idle through
the scaling (the Triton GEMM stops at 40-55% of the FP8 peak). Here, per program (persistent:
one per SM, tiles in grouped order):

    producer warp        for each (tile, K block): wait until the stage is free, TMA-load the
                         A and w tiles into it, and (FP8) the A tile's row scales of the K
                         block as one line (a ring of STAGES stages, mbarrier-tracked)
    consumer warpgroups  two, rows [0, 64) and [64, 128) of the tile; per K block: wait for
    (4 warps each)       the stage, wgmma, acc += part * a_s[:, None] * w_s (FP8), release
                         the stage; then the tile through shared memory and a TMA store

On runs of 64 rows (FP8, short runs: half the padding) a tile is 64 x 256 and the two consumers
take its 64 rows, each 128 of the columns; each row's sums are formed as on 128-row tiles.

The two consumers are not in lock step, so one's promotion overlaps the other's wgmma (a
second accumulator in flight within one warpgroup makes ptxas serialize the wgmmas). The row
scales come with the stage: a consumer's own global load of them stalled it (deepseek-v3's
GEMM1 went from 651 to 877 TFLOP/s on an H200 when they moved). Gluon partitions take no
constexpr arguments (they arrive as run-time values): each reads its constants off the
descriptors' and buffers' types.

FP8 tiles 256 wide (block_n=256: the fast_accum path) do not promote: the product and two
128-wide accumulators would spill. Each half keeps one accumulator in units of the last K
block's scale s, rescaled by s_prev / s before the block's wgmma adds to it, and leaves as
acc * s. The tensor cores then sum all of K at their FP8 accumulation precision: against the
exact result the GEMM's error grows with K (1.05x the promotion's at K = 768, 2.8x at K =
14336; the layer's RMS error 2.4-3.4x), for -1% to +10% speed per GEMM at M = 16384 on an
H100 (benchmarks/results/fast_accum_h100/). Row and weight scales must be positive: the
quantizers' are (amax is floored), a zero weight block scale is read as _MIN_W_SCALE, and
padding rows (any scale) give rows never read.
"""

from __future__ import annotations

import functools

import torch
import triton

from fusedmoe.kernels.deep_gemm_lib import device_capability

try:  # Gluon's Hopper API; without it the Triton GEMMs run
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_IMPORT_ERROR = ""
except Exception as e:  # an older or newer Triton with another Gluon API
    gluon = None
    GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

__all__ = ["gluon_unusable_reason", "wgmma_grouped_gemm", "wgmma_status"]

#: Triton versions (major.minor) whose Gluon API the kernel was built, checked and measured
#: with: Gluon is experimental and moves between releases, so other versions run the Triton GEMMs
TESTED_TRITON = ("3.6",)


def gluon_unusable_reason(device: torch.device) -> str | None:
    """None where the Gluon GEMM runs on `device`, else why not."""
    if gluon is None:
        return f"Triton's Gluon Hopper API is not importable ({GLUON_IMPORT_ERROR})"
    if ".".join(triton.__version__.split(".")[:2]) not in TESTED_TRITON:
        return (
            f"the Gluon GEMM is tested with Triton {', '.join(TESTED_TRITON)}, "
            f"this is {triton.__version__}"
        )
    if device.type != "cuda":
        return f"the Gluon GEMM runs on CUDA GPUs, not {device.type}"
    index = torch.cuda.current_device() if device.index is None else device.index
    major, minor = device_capability(index)
    if major != 9:
        return f"the Gluon GEMM uses Hopper's wgmma (sm90), this GPU is sm{major}{minor}"
    return None


if gluon is not None:
    _GROUP_M = gl.constexpr(8)  # row blocks that sweep the n blocks together (L2 reuse)
    #: the least weight block scale the 256-wide FP8 kernel divides by (2^-60; real scales are
    #: amax / 448). With row scales >= 2.2e-13 (the quantizer's floor) the accumulator holds at
    #: most |partial sum| / 1.9e-31: fp32 overflows only for partial sums near 6e7 at both floors
    _MIN_W_SCALE = gl.constexpr(8.673617379884035e-19)

    @gluon.jit
    def _tile_of(tile, num_m_blocks, num_n_blocks, GROUP_M: gl.constexpr):
        """Tile index -> (m block, n block): GROUP_M row blocks sweep all n blocks together,
        so the weight tiles they share stay in L2."""
        per_group = GROUP_M * num_n_blocks
        group = tile // per_group
        first_m = group * GROUP_M
        rows_in_group = gl.minimum(num_m_blocks - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % rows_in_group
        pid_n = (tile % per_group) // rows_in_group
        return pid_m, pid_n

    @gluon.jit
    def _tiles_in_use(num_rows, BLOCK_M: gl.constexpr, num_m_blocks, num_n_blocks):
        """The tiles a program walks: those of the groups of _GROUP_M row blocks that hold
        rows in use. Tile t maps to the same (m block, n block) as over all num_m_blocks (the
        last group walked is whole or the last one), and every tile left out lies past the
        rows in use: no tile at all where none is in use (a gated call, closed)."""
        used = gl.cdiv(gl.cdiv(num_rows, BLOCK_M), _GROUP_M) * _GROUP_M
        return gl.minimum(used, num_m_blocks) * num_n_blocks

    @gluon.jit
    def _tile_expert(tile, num_m_blocks, num_n_blocks, num_rows, expert_ids_ptr,
                     BLOCK_M: gl.constexpr):  # fmt: skip
        """(off_m, n block, expert) of a tile; expert -1: nothing to compute (past the rows
        in use, or a block no expert owns). A block is one run block (BLOCK_M == ALIGN)."""
        pid_m, pid_n = _tile_of(tile, num_m_blocks, num_n_blocks, _GROUP_M)
        off_m = pid_m * BLOCK_M
        expert = gl.load(expert_ids_ptr + pid_m, mask=off_m < num_rows, other=-1)
        return off_m, pid_n, expert

    @gluon.jit
    def _producer(a_desc, w_desc, as_desc, a_smem, w_smem, as_smem, full, empty, expert_ids_ptr,
                  num_rows_ptr, N, K, num_m_blocks):  # fmt: skip
        """One warp: TMA loads of every (tile, K block) of this program into the stage ring:
        the A and w tiles and, FP8, the A tile's row scales of the K block."""
        SCALED: gl.constexpr = a_desc.dtype.primitive_bitwidth == 8
        STAGE_BYTES: gl.constexpr = (
            a_desc.block_type.nbytes + w_desc.block_type.nbytes
            + SCALED * as_desc.block_type.nbytes
        )  # fmt: skip
        STAGES: gl.constexpr = a_smem.shape[0]
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        num_n_blocks = gl.cdiv(N, BLOCK_N)
        num_k = gl.cdiv(K, BLOCK_K)
        num_rows = gl.load(num_rows_ptr)
        it = 0
        for tile in range(
            gl.program_id(0),
            _tiles_in_use(num_rows, BLOCK_M, num_m_blocks, num_n_blocks),
            gl.num_programs(0),
        ):
            off_m, pid_n, expert = _tile_expert(
                tile, num_m_blocks, num_n_blocks, num_rows, expert_ids_ptr, BLOCK_M
            )
            if expert >= 0:
                w_row = expert * N + pid_n * BLOCK_N
                for kb in range(num_k):
                    stage = it % STAGES
                    # wait until both consumers released the stage (its previous use)
                    mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
                    bar = full.index(stage)
                    mbarrier.expect(bar, STAGE_BYTES)
                    tma.async_copy_global_to_shared(
                        a_desc, [off_m, kb * BLOCK_K], bar, a_smem.index(stage)
                    )
                    tma.async_copy_global_to_shared(
                        w_desc, [w_row, kb * BLOCK_K], bar, w_smem.index(stage)
                    )
                    if SCALED:
                        line = as_smem.index(stage)._reinterpret(
                            as_desc.dtype, as_desc.block_type.shape, as_desc.layout
                        )
                        tma.async_copy_global_to_shared(as_desc, [kb, off_m], bar, line)
                    it += 1

    @gluon.jit
    def _scaled_block(a_tile, w_tile, acc, scale):
        """acc + (a_tile @ w_tile.T) * scale[:, None]: one 128-wide K block's product formed
        apart (a wgmma from zero, waited for: the other warpgroup's wgmma fills the gap) and
        promoted into the float32 sum."""
        part = warpgroup_mma(a_tile, w_tile.permute((1, 0)), acc, use_acc=False, is_async=True)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        return acc + part * scale[:, None]

    @gluon.jit
    def _rescaled_mma(a_tile, w_tile, acc, ratio, outstanding: gl.constexpr):
        """acc * ratio[:, None] + a_tile @ w_tile.T, the wgmma left running: acc (waited for
        by the caller) leaves as a tensor whose wgmma must be waited for before acc is read
        again (`outstanding`: the wgmmas then in flight, this one included; waiting for that
        many retires none)."""
        acc = acc * ratio[:, None]
        acc = warpgroup_mma(a_tile, w_tile.permute((1, 0)), acc, is_async=True)
        return warpgroup_mma_wait(num_outstanding=outstanding, deps=(acc,))

    @gluon.jit
    def _store_tile(out_desc, out_smem, slot, tile, off_m, off_n):
        tma.store_wait(pendings=0)  # the previous tile's store has left this buffer
        buf = out_smem.index(slot)
        buf.store(tile.to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [off_m, off_n], buf)

    @gluon.jit
    def _consumer(a_desc, w_desc, out_desc, a_smem, w_smem, out_smem, as_smem, full, empty,
                  w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                  expert_ids_ptr, num_rows_ptr, N, K, num_m_blocks,
                  HALF: gl.constexpr):  # fmt: skip
        """One warpgroup: rows [HALF * 64, HALF * 64 + 64) of every 128-row tile of this
        program; of a 64-row tile (SPLIT), its 64 rows and columns [HALF * 128, HALF * 128 +
        128).

        SCALED (FP8, 128-block scales), 128 wide: each K block's product is scaled into the
        accumulator (the promotion); 256 wide: two 128-wide halves, each one rescaled
        accumulator with its own weight scale (the module docstring). Unscaled: one
        accumulator over K, the wgmma of block kb still running while block kb - 1's stage is
        released."""
        STAGES: gl.constexpr = a_smem.shape[0]
        SCALED: gl.constexpr = a_desc.dtype.primitive_bitwidth == 8
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        OUT_N: gl.constexpr = out_desc.block_type.shape[1]
        # 64-row tiles (SPLIT): both warpgroups take all 64 rows, each its 128 of the 256
        # columns; 128-row tiles: each its 64 rows of all the columns
        SPLIT: gl.constexpr = BLOCK_M == 64
        ROWS: gl.constexpr = BLOCK_M if SPLIT else BLOCK_M // 2
        FIRST_ROW: gl.constexpr = 0 if SPLIT else HALF * ROWS
        INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, OUT_N, INSTR_K]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        # SCALED, a 128-row tile 256 wide (fast_accum)
        TWO: gl.constexpr = BLOCK_N // OUT_N == 2 and not SPLIT
        # 64-row tiles are FP8 and two halves wide (the launcher's contract)
        gl.static_assert(not SPLIT or (SCALED and BLOCK_N == 2 * OUT_N))
        num_n_blocks = gl.cdiv(N, BLOCK_N)
        num_k = gl.cdiv(K, BLOCK_K)
        num_rows = gl.load(num_rows_ptr)
        it = 0
        for tile in range(
            gl.program_id(0),
            _tiles_in_use(num_rows, BLOCK_M, num_m_blocks, num_n_blocks),
            gl.num_programs(0),
        ):
            off_m, pid_n, expert = _tile_expert(
                tile, num_m_blocks, num_n_blocks, num_rows, expert_ids_ptr, BLOCK_M
            )
            if expert >= 0:
                off_n = pid_n * BLOCK_N
                row0 = off_m + FIRST_ROW
                col0 = off_n + HALF * OUT_N if SPLIT else off_n  # this warpgroup's columns
                acc = gl.zeros([ROWS, OUT_N], gl.float32, mma_layout)
                if SCALED and not TWO:
                    # 128 wide: each K block's product is promoted into the sum, as DeepGEMM
                    w_scale_0 = w_scale_ptr + expert * stride_wse + (col0 // 128) * stride_wsn
                    for kb in range(num_k):
                        stage = it % STAGES
                        # the weight scale first: its latency hides behind the wait and the
                        # wgmma (the row scales came with the stage)
                        if SPLIT:  # the last tile's second half may lie past N: no scale to
                            # read there, and its columns are never stored
                            w_s0 = gl.load(w_scale_0 + kb * stride_wsk, mask=col0 < N, other=0.0)
                        else:
                            w_s0 = gl.load(w_scale_0 + kb * stride_wsk)
                        mbarrier.wait(full.index(stage), (it // STAGES) & 1)
                        a_s = as_smem.index(stage).slice(FIRST_ROW, ROWS).load(row_layout)
                        a_tile = a_smem.index(stage).slice(FIRST_ROW, ROWS)
                        w_tile = w_smem.index(stage)
                        if SPLIT:
                            w_tile = w_tile.slice(HALF * OUT_N, OUT_N)
                        acc = _scaled_block(a_tile, w_tile, acc, a_s * w_s0)
                        mbarrier.arrive(empty.index(stage), count=1)
                        it += 1
                    _store_tile(out_desc, out_smem, HALF, acc, row0, col0)
                elif SCALED:
                    # 256 wide, the rescaled accumulator: acc holds the sum in units of the
                    # last K block's scale s (row scale x weight scale). A block's product
                    # adds to acc * s_prev / s in the same wgmma, and the tile leaves as
                    # acc * s: one accumulator per 128-wide half and no product beside it,
                    # so the 256-wide tile fits the registers (with the promotion it
                    # spills). The tensor cores then sum all of K in the accumulator, at
                    # their FP8 accumulation precision, not 128 at a time.
                    w_scale_0 = w_scale_ptr + expert * stride_wse + (off_n // 128) * stride_wsn
                    acc1 = gl.zeros([ROWS, OUT_N], gl.float32, mma_layout)
                    s0 = gl.full([ROWS], 1.0, gl.float32, row_layout)
                    s1 = gl.full([ROWS], 1.0, gl.float32, row_layout)
                    has_1 = off_n + OUT_N < N  # the last tile may end mid-way
                    for kb in range(num_k):
                        stage = it % STAGES
                        # A zero weight block scale (an all-zero block) is taken as
                        # _MIN_W_SCALE: s_prev / s stays finite, and the block adds its
                        # product times that (next to nothing)
                        w_s0 = gl.maximum(gl.load(w_scale_0 + kb * stride_wsk), _MIN_W_SCALE)
                        w_s1 = gl.load(w_scale_0 + stride_wsn + kb * stride_wsk, mask=has_1,
                                       other=1.0)  # fmt: skip
                        w_s1 = gl.maximum(w_s1, _MIN_W_SCALE)
                        mbarrier.wait(full.index(stage), (it // STAGES) & 1)
                        a_s = as_smem.index(stage).slice(FIRST_ROW, ROWS).load(row_layout)
                        a_tile = a_smem.index(stage).slice(FIRST_ROW, ROWS)
                        w_tile = w_smem.index(stage)
                        # both halves' wgmmas of block kb - 1 done, the second half is
                        # rescaled while the first's wgmma runs (waiting for one half at a
                        # time makes ptxas serialize the wgmmas)
                        acc, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc1))
                        prev = (it + STAGES - 1) % STAGES
                        mbarrier.arrive(empty.index(prev), count=1, pred=kb > 0)
                        n0 = a_s * w_s0
                        n1 = a_s * w_s1
                        acc = _rescaled_mma(a_tile, w_tile.slice(0, OUT_N), acc, s0 / n0, 1)
                        acc1 = _rescaled_mma(a_tile, w_tile.slice(OUT_N, OUT_N), acc1, s1 / n1, 2)
                        s0 = n0
                        s1 = n1
                        it += 1
                    acc, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc1))
                    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
                    _store_tile(out_desc, out_smem, HALF, acc * s0[:, None], row0, off_n)
                    _store_tile(out_desc, out_smem, HALF, acc1 * s1[:, None], row0, off_n + OUT_N)
                else:
                    for kb in range(num_k):
                        stage = it % STAGES
                        mbarrier.wait(full.index(stage), (it // STAGES) & 1)
                        acc = warpgroup_mma(
                            a_smem.index(stage).slice(FIRST_ROW, ROWS),
                            w_smem.index(stage).permute((1, 0)), acc, is_async=True,
                        )  # fmt: skip
                        # the previous K block's wgmma is done: release its stage
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                        prev = (it + STAGES - 1) % STAGES
                        mbarrier.arrive(empty.index(prev), count=1, pred=kb > 0)
                        it += 1
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
                    _store_tile(out_desc, out_smem, HALF, acc, row0, off_n)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_gemm_kernel(
        a_desc,  # [M_sum, K], blocks [BLOCK_M, BLOCK_K]
        w_desc,  # [E_l * N, K], blocks [BLOCK_N, BLOCK_K]
        out_desc,  # [M_sum, N], blocks [64, OUT_N]: one warpgroup's part of a tile
        as_desc,  # a_scale.T [K / 128, M_sum] float32, blocks [1, BLOCK_M] (SCALED)
        w_scale_ptr, stride_wse, stride_wsn, stride_wsk,  # [E_l, N / 128, K / 128] (SCALED)
        expert_ids_ptr,  # int32 [M_sum / BLOCK_M]: expert of each run block, -1 past the end
        num_rows_ptr,  # int32 [1]: rows in use
        N, K, num_m_blocks,
        STAGES: gl.constexpr,
    ):  # fmt: skip
        # partitions take no constexpr arguments (they arrive as run-time values): each reads
        # what it needs off the descriptors' types
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        OUT_N: gl.constexpr = out_desc.block_type.shape[1]
        # one epilogue buffer per warpgroup: a 256-wide FP8 tile stores its halves in turn
        out_smem = gl.allocate_shared_memory(
            out_desc.dtype, [2, out_desc.block_type.shape[0], OUT_N], out_desc.layout
        )
        as_smem = gl.allocate_shared_memory(  # one line of BLOCK_M row scales per stage
            as_desc.dtype, [STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        first = (
            a_desc, w_desc, out_desc, a_smem, w_smem, out_smem, as_smem, full, empty,
            w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
            expert_ids_ptr, num_rows_ptr, N, K, num_m_blocks,
        )  # fmt: skip
        second = (  # the same again: one tuple given to two partitions breaks the lowering
            a_desc, w_desc, out_desc, a_smem, w_smem, out_smem, as_smem, full, empty,
            w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
            expert_ids_ptr, num_rows_ptr, N, K, num_m_blocks,
        )  # fmt: skip
        producer = (
            a_desc, w_desc, as_desc, a_smem, w_smem, as_smem, full, empty, expert_ids_ptr,
            num_rows_ptr, N, K, num_m_blocks,
        )  # fmt: skip
        gl.warp_specialize(
            [(_first_half, first), (_second_half, second), (_producer, producer)],
            [4, 1],  # the second consumer warpgroup, the producer warp
            [232, 40],  # their registers (the first consumer's: the rest)
        )

    @gluon.jit
    def _first_half(a_desc, w_desc, out_desc, a_smem, w_smem, out_smem, as_smem, full, empty,
                    w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                    expert_ids_ptr, num_rows_ptr, N, K, num_m_blocks):  # fmt: skip
        _consumer(
            a_desc, w_desc, out_desc, a_smem, w_smem, out_smem, as_smem, full, empty,
            w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
            expert_ids_ptr, num_rows_ptr, N, K, num_m_blocks, 0,
        )  # fmt: skip

    @gluon.jit
    def _second_half(a_desc, w_desc, out_desc, a_smem, w_smem, out_smem, as_smem, full, empty,
                     w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
                     expert_ids_ptr, num_rows_ptr, N, K, num_m_blocks):  # fmt: skip
        _consumer(
            a_desc, w_desc, out_desc, a_smem, w_smem, out_smem, as_smem, full, empty,
            w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
            expert_ids_ptr, num_rows_ptr, N, K, num_m_blocks, 1,
        )  # fmt: skip


def _descriptor(t: torch.Tensor, block: list[int], swizzle: int | None = None):
    """A TMA descriptor of t in blocks of `block`, in the widest swizzle the block allows (or
    `swizzle` bytes: 0 lays a block out plainly, row after row)."""
    gl_dtype = {
        torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
        torch.float16: gl.float16, torch.float32: gl.float32,
    }[t.dtype]  # fmt: skip
    if swizzle is None:
        layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    else:
        layout = gl.NVMMASharedLayout(swizzle, gl_dtype.primitive_bitwidth, rank=len(block))
    return TensorDescriptor.from_tensor(t, block, layout)


@functools.cache
def _dummy_scales(device: torch.device) -> torch.Tensor:
    """The unscaled kernel's stand-in for the row scales' descriptor."""
    return torch.zeros(1, 128, dtype=torch.float32, device=device)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def wgmma_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    expert_ids: torch.Tensor,
    num_rows: torch.Tensor,
    alignment: int,
    *,
    block_n: int | None = None,
    stages: int | None = None,
) -> None:
    """out [M_sum, N] = a @ w[e].T over the contiguous layout's runs (see the module
    docstring): FP8 with 128-block scales, or bf16 / fp16 with a_scale = w_scale = None.
    Inputs are assumed checked by the caller. The tile (block_n x 128 rows, `stages` deep)
    defaults to what measured best (probe_wgmma_gemm.py at ab63d6f): FP8 128 wide, 4 stages,
    each K block promoted as DeepGEMM does; bf16 256 wide, 3 stages (5-10% faster than 128 on
    an H200). FP8 at block_n=256 (3 stages) is the fast-accumulation kernel (module
    docstring): -1% to +10% per GEMM against 128 at M = 16384 on an H100, less precise; its row
    scales must be positive. FP8 on runs of 64 rows (`alignment=64`): 64 x 256 tiles, each
    warpgroup 128 of the columns, 4 stages, promoted. At least 2 stages (a consumer holds a
    stage until the next one has arrived)."""
    m_sum, k = a.shape
    num_experts, n, _ = w.shape
    scaled = a_scale is not None
    block_m = 64 if alignment == 64 and scaled else 128
    if block_n is None:
        block_n = 128 if scaled and block_m == 128 else 256
    if stages is None:
        stages = 4 if block_n == 128 or block_m == 64 else 3
    block_k = 128 if scaled else 64  # 128-byte rows: the widest swizzle
    if stages < 2:
        raise ValueError(f"stages must be at least 2, got {stages}")
    if alignment != block_m:
        raise ValueError(
            f"alignment {alignment}: the runs must be of 128 rows (FP8 also of 64 rows)"
        )
    if block_n not in (128, 256):
        raise ValueError(f"block_n {block_n}: the tiles are 128 or 256 wide")
    if block_m == 64 and block_n != 256:
        raise ValueError(f"block_n {block_n}: runs of 64 rows take 256-wide tiles")
    a_desc = _descriptor(a, [block_m, block_k])
    w_desc = _descriptor(w.view(num_experts * n, k), [block_n, block_k])
    out_desc = _descriptor(out, [64, 128 if scaled else block_n])  # one warpgroup's part
    num_m_blocks = triton.cdiv(m_sum, block_m)
    tiles = num_m_blocks * triton.cdiv(n, block_n)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    grid = (max(1, min(tiles, _num_sms(index))),)
    if scaled:
        if a_scale.stride() != (1, m_sum):  # TMA reads a row block's scales as one line
            lines = torch.empty(a_scale.shape[1], m_sum, dtype=a_scale.dtype, device=a.device)
            a_scale = lines.copy_(a_scale.t()).t()
        as_desc = _descriptor(a_scale.t(), [1, block_m], swizzle=0)
        w_scale_args = (w_scale, *w_scale.stride())
    else:  # never read
        as_desc = _descriptor(_dummy_scales(a.device), [1, block_m], swizzle=0)
        w_scale_args = (expert_ids, 0, 0, 0)
    _grouped_gemm_kernel[grid](
        a_desc, w_desc, out_desc, as_desc, *w_scale_args, expert_ids, num_rows,
        n, k, num_m_blocks,
        STAGES=stages,
        num_warps=4,
    )  # fmt: skip


def wgmma_status() -> str:
    """One line: whether the Gluon GEMMs run on this machine's GPU, and why not."""
    if gluon is None:
        return f"fusedmoe Triton GEMMs (no Gluon Hopper API: {GLUON_IMPORT_ERROR})"
    if not torch.cuda.is_available():
        return "fusedmoe Gluon wgmma GEMMs on sm90 GPUs, Triton GEMMs elsewhere"
    why = gluon_unusable_reason(torch.device("cuda"))
    if why is not None:
        return f"fusedmoe Triton GEMMs ({why})"
    return "fusedmoe Gluon wgmma GEMMs"
