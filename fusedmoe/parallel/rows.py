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
an all-to-all with split sizes `counts` (grouped). Ungrouped (grouped=False), the starts are
left out: pos[m, r] is token m's row among those going to rank r, the layout of a transport
that writes each rank's rows into a region of its own at the destination. Everything is
computed on the device with fixed shapes ([M, R]): no host synchronisation, the same launches
whatever the routing.

The row movers take one destination (or source) per rank: one tensor for every rank (a send
buffer grouped by rank), or a list of R tensors (a region of each peer's buffer, mapped into
this process by symmetric memory, or of a local staging buffer).

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
    topk_ids: torch.Tensor,
    owner: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    grouped: bool = True,
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
    starts = torch.cumsum(counts, 0) - counts if grouped else 0  # [R] exclusive
    within = torch.cumsum(goes, dim=0) - goes  # [M, R] tokens before m going to r
    pos = torch.where(goes.bool(), starts + within, num_slots)
    return pos, counts


def dispatch_positions(
    topk_ids: torch.Tensor,
    owner: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    counts: torch.Tensor,
    *,
    grouped: bool = True,
    post: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """dispatch_positions_torch, the counts written into `counts` (int64 [R]) and, where
    `post` is given, count r also into post[r] (a one-element int64 tensor: rank r's slot for
    this rank's count, a peer's memory): -> pos. The Triton kernels where Triton runs (a
    program a block of tokens, then the blocks' offsets: fusedmoe.kernels.ep_rows), the twin
    elsewhere."""
    if triton_runs_on(topk_ids):
        from fusedmoe.kernels.ep_rows import dispatch_positions_triton

        return dispatch_positions_triton(
            topk_ids, owner, num_ranks, num_slots, counts, grouped=grouped, post=post
        )
    pos, sent = dispatch_positions_torch(topk_ids, owner, num_ranks, num_slots, grouped)
    counts.copy_(sent)
    for r, slot in enumerate(post or ()):
        slot.copy_(sent[r : r + 1])
    return pos


RankTargets = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]


def per_rank(targets: RankTargets, num_ranks: int) -> list[torch.Tensor]:
    """One target per rank: a tensor stands for every rank."""
    if isinstance(targets, torch.Tensor):
        return [targets] * num_ranks
    if len(targets) != num_ranks:
        raise ValueError(f"{len(targets)} per-rank targets for {num_ranks} ranks")
    return list(targets)


def scatter_rows_torch(
    src: torch.Tensor, pos: torch.Tensor, dst: RankTargets, col: int, trash: int
) -> None:
    """dst_r[pos[m, r], col:col + W] = src[m] where pos[m, r] != trash = C (dst_r: dst, or
    dst[r] of a list)."""
    width = src.shape[1]
    for r, target in enumerate(per_rank(dst, pos.shape[1])):
        sent = pos[:, r] != trash
        target[pos[sent, r], col : col + width] = src[sent]


def gather_sum_rows_torch(
    src: RankTargets, pos: torch.Tensor, out: torch.Tensor, trash: int, max_programs=None
) -> None:
    """out[m] = sum over r with pos[m, r] != trash of src_r[pos[m, r], :H], in float32
    (float64 for float64), rounded once (src_r: src, or src[r] of a list). max_programs: the
    kernel's grid (nothing here)."""
    hidden = out.shape[1]
    sources = per_rank(src, pos.shape[1])
    acc = torch.zeros(out.shape, dtype=torch.promote_types(sources[0].dtype, torch.float32),
                      device=out.device)  # fmt: skip
    for r, source in enumerate(sources):
        sent = pos[:, r] != trash  # stale rows may hold NaN: never read
        acc[sent] += source[pos[sent, r], :hidden].to(acc.dtype)
    out.copy_(acc)


def scatter_rows(
    src: torch.Tensor, pos: torch.Tensor, dst: RankTargets, col: int, trash: int
) -> None:
    if triton_runs_on(src) and src.dtype != torch.float64:
        from fusedmoe.kernels.ep_rows import scatter_rows_triton

        scatter_rows_triton(src, pos, dst, col, trash)
    else:
        scatter_rows_torch(src, pos, dst, col, trash)


def gather_sum_rows(
    src: RankTargets, pos: torch.Tensor, out: torch.Tensor, trash: int, max_programs=None
) -> None:
    if triton_runs_on(out) and out.dtype != torch.float64:
        from fusedmoe.kernels.ep_rows import gather_sum_rows_triton

        gather_sum_rows_triton(src, pos, out, trash, max_programs)
    else:
        gather_sum_rows_torch(src, pos, out, trash, max_programs)


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
    float32 bits, into columns [col, col + 2k + G) of rows pos[m, r] of dst_r (int32)."""
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
    region_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows [0, C) of the received words (src int32, from column col) -> (ids int32 [C, k],
    weights float32 [C, k], scales float32 [C, G] or None); the rows that did not arrive are
    stale: id -1, weight 0, scale 1. Grouped (region_rows None): rows [0, sum(received))
    arrived. In regions: rank s's rows are [s * region_rows, s * region_rows + received[s])."""
    words = src[:capacity, col : col + 2 * top_k + num_scales]
    rows = torch.arange(capacity, device=src.device)
    if region_rows is None:
        stale = rows >= received.sum()
    else:
        if capacity > received.shape[0] * region_rows:
            raise ValueError(
                f"{capacity} rows in regions of {region_rows} for {received.shape[0]} ranks"
            )
        source = rows // region_rows
        stale = rows - source * region_rows >= received[source]
    stale = stale[:, None]  # [C, 1]
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


def unpack_meta(
    src, col: int, received, capacity: int, top_k: int, num_scales: int, region_rows=None
):
    if triton_runs_on(src):
        from fusedmoe.kernels.ep_rows import unpack_meta_triton

        return unpack_meta_triton(src, col, received, capacity, top_k, num_scales, region_rows)
    return unpack_meta_torch(src, col, received, capacity, top_k, num_scales, region_rows)
