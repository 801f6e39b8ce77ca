"""Where each token's row goes in a dispatch that keeps its counts on the device, and the row
movers that put it there and sum what comes back (fusedmoe.parallel.symm_mem_ep uses them).

Legend: M tokens of this rank, k top-k, R ranks, P physical experts, C send slots (the send
buffer's rows; slot C is no slot), H hidden.

    dest[m, j]     = owner[topk_ids[m, j]], or none for an empty slot (id < 0)
    goes[m, r]     = any_j dest[m, j] == r                     a token goes once to each rank
    counts[r]      = sum_m goes[m, r]                           rows sent to rank r
    pos[m, r]      = sum_{r' < r} counts[r'] + #{m' < m : goes[m', r]}   where goes[m, r]
                   = C                                                    elsewhere

so the send rows are grouped by destination rank, in token order within a rank: the layout of
an all-to-all with split sizes `counts`. Everything is computed on the device with fixed
shapes ([M, R]): no host synchronisation, the same launches whatever the routing.

scatter_rows / gather_sum_rows run the Triton kernels of fusedmoe.kernels.ep_rows where Triton
runs (CUDA, or the CPU under its interpreter), else their torch twins here, which are the spec.
"""

from __future__ import annotations

import torch

from fusedmoe._triton import triton_runs_on

__all__ = [
    "dispatch_positions",
    "dispatch_positions_torch",
    "gather_sum_rows",
    "gather_sum_rows_torch",
    "pack_meta",
    "pack_meta_torch",
    "scatter_rows",
    "scatter_rows_torch",
    "unpack_meta",
    "unpack_meta_torch",
]


def dispatch_positions_torch(
    topk_ids: torch.Tensor, owner: torch.Tensor, num_ranks: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] (physical ids, -1 for an empty slot), owner [P] (the rank of each
    physical expert) -> (pos int64 [M, R], counts int64 [R]) as the module docstring says;
    num_slots = C, the value of pos where a token does not go."""
    num_tokens = topk_ids.shape[0]
    ids = topk_ids.long()
    dest = torch.where(ids >= 0, owner[ids.clamp(min=0)], num_ranks)  # [M, k], R: none
    goes = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.int64, device=ids.device)
    goes.scatter_(1, dest, 1)
    goes = goes[:, :num_ranks]  # [M, R] 0 / 1
    counts = goes.sum(dim=0)  # [R]
    starts = torch.cumsum(counts, 0) - counts  # [R] exclusive
    within = torch.cumsum(goes, dim=0) - goes  # [M, R] tokens before m going to r
    pos = torch.where(goes.bool(), starts + within, num_slots)
    return pos, counts


def dispatch_positions(
    topk_ids: torch.Tensor,
    owner: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    counts: torch.Tensor,
) -> torch.Tensor:
    """dispatch_positions_torch, the counts written into `counts` (int64 [R]): -> pos. One
    Triton program where Triton runs (fusedmoe.kernels.ep_rows; on an H100, 4 ranks, 4096
    tokens of k = 8: 93 us, the twin's dozen torch ops 745 us), the twin elsewhere."""
    if triton_runs_on(topk_ids):
        from fusedmoe.kernels.ep_rows import dispatch_positions_triton

        return dispatch_positions_triton(topk_ids, owner, num_ranks, num_slots, counts)
    pos, sent = dispatch_positions_torch(topk_ids, owner, num_ranks, num_slots)
    counts.copy_(sent)
    return pos


def scatter_rows_torch(
    src: torch.Tensor, pos: torch.Tensor, dst: torch.Tensor, col: int, trash: int
) -> None:
    """dst[pos[m, r], col:col + W] = src[m] where pos[m, r] != trash = C (dst has more than C
    rows: row C takes what goes nowhere here, and is never read)."""
    num_ranks, width = pos.shape[1], src.shape[1]
    dst[pos.reshape(-1), col : col + width] = src.repeat_interleave(num_ranks, dim=0)


def gather_sum_rows_torch(
    src: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, trash: int
) -> None:
    """out[m] = sum over r with pos[m, r] != trash of src[pos[m, r], :H], in float32 (float64
    for float64), rounded once."""
    hidden = out.shape[1]
    acc = torch.promote_types(src.dtype, torch.float32)
    rows = src[:, :hidden][pos.clamp(max=trash - 1)].to(acc)  # [M, R, H]
    rows = rows.masked_fill((pos == trash).unsqueeze(-1), 0)  # stale rows may hold NaN
    out.copy_(rows.sum(dim=1))


def scatter_rows(
    src: torch.Tensor, pos: torch.Tensor, dst: torch.Tensor, col: int, trash: int
) -> None:
    if triton_runs_on(src) and src.dtype != torch.float64:
        from fusedmoe.kernels.ep_rows import scatter_rows_triton

        scatter_rows_triton(src, pos, dst, col, trash)
    else:
        scatter_rows_torch(src, pos, dst, col, trash)


def gather_sum_rows(src: torch.Tensor, pos: torch.Tensor, out: torch.Tensor, trash: int) -> None:
    if triton_runs_on(src) and src.dtype != torch.float64:
        from fusedmoe.kernels.ep_rows import gather_sum_rows_triton

        gather_sum_rows_triton(src, pos, out, trash)
    else:
        gather_sum_rows_torch(src, pos, out, trash)


def pack_meta_torch(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    scale: torch.Tensor | None,
    pos: torch.Tensor,
    dst: torch.Tensor,
    col: int,
    trash: int,
) -> None:
    """Token m's row of int32 words, ids [k] | weights [k] as float32 bits | scales [G] as
    float32 bits, into columns [col, col + 2k + G) of rows pos[m, r] of dst (int32)."""
    words = [topk_ids.to(torch.int32), topk_weights.float().view(torch.int32)]
    if scale is not None:
        words.append(scale.float().view(torch.int32))
    scatter_rows_torch(torch.cat(words, dim=1), pos, dst, col, trash)


def unpack_meta_torch(
    src: torch.Tensor,
    col: int,
    received: torch.Tensor,
    capacity: int,
    top_k: int,
    num_scales: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows [0, C) of the received words (src int32, from column col) -> (ids int32 [C, k],
    weights float32 [C, k], scales float32 [C, G] or None); rows from n = sum(received) on are
    stale: id -1, weight 0, scale 1."""
    words = src[:capacity, col : col + 2 * top_k + num_scales]
    stale = (torch.arange(capacity, device=src.device) >= received.sum())[:, None]  # [C, 1]
    ids = words[:, :top_k].masked_fill(stale, -1)
    weights = words[:, top_k : 2 * top_k].view(torch.float32).masked_fill(stale, 0)
    scale = None
    if num_scales:
        scale = words[:, 2 * top_k :].view(torch.float32).masked_fill(stale, 1)
    return ids, weights, scale


def pack_meta(topk_ids, topk_weights, scale, pos, dst, col: int, trash: int) -> None:
    if triton_runs_on(topk_ids):
        from fusedmoe.kernels.ep_rows import pack_meta_triton

        pack_meta_triton(topk_ids, topk_weights, scale, pos, dst, col, trash)
    else:
        pack_meta_torch(topk_ids, topk_weights, scale, pos, dst, col, trash)


def unpack_meta(src, col: int, received, capacity: int, top_k: int, num_scales: int):
    if triton_runs_on(src):
        from fusedmoe.kernels.ep_rows import unpack_meta_triton

        return unpack_meta_triton(src, col, received, capacity, top_k, num_scales)
    return unpack_meta_torch(src, col, received, capacity, top_k, num_scales)
