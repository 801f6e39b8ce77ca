"""Row movers of the symmetric-memory EP dispatch (fusedmoe.parallel.symm_mem_ep): each token's
row scattered to one send slot per destination rank, and the rows that come back summed per
token. Their torch twins, the spec, are in fusedmoe.parallel.rows.

Legend: M tokens of this rank, R ranks, W bytes (or elements) of a row, H hidden, C send slots.

    scatter_rows:    dst[pos[m, r], col:col + W] = src[m, :W]    for every r with pos[m, r] != C
    gather_sum_rows: out[m, :H] = sum over r with pos[m, r] != C of src[pos[m, r], :H]
                     (accumulated in float32, rounded once to out's dtype)

pos [M, R] int64 holds send slots in [0, C), or C where token m does not go to rank r. Both
kernels read pos on the GPU: no host synchronisation, the same launches whatever the routing
(CUDA-graph safe). Each program takes one token and one column block, so a token's row is read
once however many ranks it goes to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedmoe._triton import cdiv, device_guard, launch, next_power_of_2

__all__ = ["gather_sum_rows_triton", "scatter_rows_triton"]

_BLOCK_BYTES = 4096  # columns of a program, in bytes: one 16-byte vector per thread of 8 warps


@triton.jit
def _scatter_rows_kernel(
    src_ptr, stride_src,
    dst_ptr, stride_dst, col,
    pos_ptr,
    width, trash,
    NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    row = tl.load(src_ptr + token * stride_src + cols, mask=mask)
    for r in tl.static_range(NUM_RANKS):
        slot = tl.load(pos_ptr + token * NUM_RANKS + r)
        if slot != trash:
            tl.store(dst_ptr + slot * stride_dst + col + cols, row, mask=mask)


@triton.jit
def _gather_sum_rows_kernel(
    src_ptr, stride_src,
    out_ptr, stride_out,
    pos_ptr,
    hidden, trash,
    NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(NUM_RANKS):
        slot = tl.load(pos_ptr + token * NUM_RANKS + r)
        if slot != trash:
            acc += tl.load(src_ptr + slot * stride_src + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block(width: int, element_size: int) -> int:
    return min(next_power_of_2(max(width, 1)), max(_BLOCK_BYTES // element_size, 16))


def scatter_rows_triton(
    src: torch.Tensor, pos: torch.Tensor, dst: torch.Tensor, col: int, trash: int
) -> None:
    """src [M, W] (unit stride along W) -> rows pos[m, r] of dst [> C, >= col + W], columns
    [col, col + W), for pos[m, r] != trash = C (the module docstring). One dtype for both."""
    num_tokens, width = src.shape
    if num_tokens == 0 or width == 0:
        return
    block = _block(width, src.element_size())
    grid = (num_tokens, cdiv(width, block))
    args = (src, src.stride(0), dst, dst.stride(0), col, pos, width, trash)
    with device_guard(src):
        launch(
            _scatter_rows_kernel, grid, args,
            dict(NUM_RANKS=pos.shape[1], BLOCK=block, num_warps=8), src.is_cuda,
        )  # fmt: skip


def gather_sum_rows_triton(
    src: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, trash: int
) -> None:
    """out [M, H] = the sum of rows pos[m, r] of src [>= C, >= H], pos[m, r] != trash = C."""
    num_tokens, hidden = out.shape
    if num_tokens == 0 or hidden == 0:
        return
    block = _block(hidden, 4)  # the float32 accumulator's bytes
    grid = (num_tokens, cdiv(hidden, block))
    args = (src, src.stride(0), out, out.stride(0), pos, hidden, trash)
    with device_guard(src):
        launch(
            _gather_sum_rows_kernel, grid, args,
            dict(NUM_RANKS=pos.shape[1], BLOCK=block, num_warps=8), src.is_cuda,
        )  # fmt: skip
