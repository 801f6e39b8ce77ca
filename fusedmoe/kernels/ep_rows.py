"""Row movers of the symmetric-memory EP dispatch (fusedmoe.parallel.symm_mem_ep): each token's
row scattered to one slot per destination rank, the rows that come back summed per token, and
a barrier of the ranks on the GPU. Their torch twins, the spec, are in fusedmoe.parallel.rows.

Legend: M tokens of this rank, R ranks, W bytes (or elements) of a row, H hidden, C the value of
pos where a token does not go (trash).

    dispatch_positions: pos [M, R] and counts [R] of fusedmoe.parallel.rows (a program a block
                     of tokens, then one a block adding the earlier blocks' counts); the
                     counts also stored into one slot per rank (a peer's, over NVLink)
    scatter_rows:    dst_r[pos[m, r], col:col + W] = src[m, :W]  for every r with pos[m, r] != C
    pack_meta / unpack_meta: a token's ids | weights (| scales) as int32 words into its rows;
                     the received words back, the rows past what arrived as empty slots
    gather_sum_rows: out[m, :H] = sum over r with pos[m, r] != C of src_r[pos[m, r], :H]
                     (accumulated in float32, rounded once to out's dtype)
    barrier:         every rank signals every rank, then waits for every rank's signal

A destination (or source) per rank, dst_r: one tensor for all (a send buffer grouped by rank),
or R tensors of one dtype and strides, each at its own address (peers' buffers mapped into
this process by symmetric memory, written with plain stores). A kernel takes
the first as its pointer and the others as element offsets from it, kept on the GPU (one small
tensor per set of addresses, made once): the launch is the same whatever the routing, and can
be captured in a CUDA graph. A program's item is one token (or row) and one column block, so a
token's row is read once however many ranks it goes to; on a GPU the scatter launches at most
2 programs a SM and the gather one program an item (or at most max_programs), striding over
the items.
"""

from __future__ import annotations

import functools
import math
import os
import threading

import torch
import triton
import triton.language as tl

from fusedmoe._triton import cdiv, device_guard, launch, next_power_of_2

__all__ = [
    "RankTensors",
    "barrier_timeout_s",
    "barrier_triton",
    "dispatch_positions_triton",
    "gather_sum_rows_triton",
    "pack_meta_triton",
    "scatter_rows_triton",
    "unpack_meta_triton",
]

_BLOCK_BYTES = 4096  # columns of a program, in bytes: one 16-byte vector per thread of 8 warps
_ALIGN_ELEMENTS = 16  # offsets that are multiples of this keep the kernels' 16-byte vectors


# ---- per-rank addresses -----------------------------------------------------------------
#: (device, offsets) -> the offsets on the device; never evicted (a CUDA graph captured with one
#: reads its address at every replay), a handful per set of buffers and row size
_OFFSETS: dict[tuple, torch.Tensor] = {}
_OFFSETS_LOCK = threading.Lock()


class RankTensors(tuple):
    """One tensor per rank (a tuple) that keeps what rank_offsets found for it: a caller that
    passes the same set at every call (symm_mem's plans) pays for the checks once. Its tensors
    must keep their addresses (views of buffers that live as long as it)."""

    def __new__(cls, tensors):
        return super().__new__(cls, tensors)

    def __init__(self, tensors) -> None:
        self.resolved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, bool]] = {}


def rank_offsets(
    targets: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
    num_ranks: int,
    base_index: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """-> (base = targets[base_index], offsets int64 [R] on base's device, aligned): target r
    is at base + offsets[r] elements. One tensor: offsets 0. Several: each at its own address,
    one dtype and strides (unit along a row). aligned: every offset a multiple of _ALIGN_ELEMENTS
    (the kernels then keep their vector accesses). The offsets tensor is made once per set of
    addresses (a host copy: the first use of a set of addresses must not be inside a CUDA graph
    capture; the symm_mem layer's first call is eager, and resolves the sets of its dtype and
    row sizes: capture another dtype only after an eager call with it). RankTensors: found
    once per (R, base_index)."""
    if isinstance(targets, RankTensors):
        found = targets.resolved.get((num_ranks, base_index))
        if found is None:
            found = targets.resolved[num_ranks, base_index] = _rank_offsets(
                targets, num_ranks, base_index
            )
        return found
    return _rank_offsets(targets, num_ranks, base_index)


def _rank_offsets(targets, num_ranks: int, base_index: int):
    # the same rule as fusedmoe.parallel.rows.per_rank (a higher layer: not imported here)
    if isinstance(targets, torch.Tensor):
        targets = (targets,) * num_ranks
    if len(targets) != num_ranks:
        raise ValueError(f"{len(targets)} per-rank targets for {num_ranks} ranks")
    base = targets[base_index]
    if base.dim() > 1 and base.stride(-1) != 1:
        raise ValueError(f"per-rank targets need unit stride along a row, got {base.stride()}")
    for t in targets:
        if t.dtype != base.dtype or t.device != base.device or t.stride() != base.stride():
            raise ValueError(
                "per-rank targets need one dtype, device and row stride, got "
                f"{[(t.dtype, t.device, t.stride()) for t in targets]}"
            )
    item = base.element_size()
    deltas = []
    for t in targets:
        delta = t.data_ptr() - base.data_ptr()
        if delta % item:
            raise ValueError(f"per-rank targets {delta} bytes apart: not whole {base.dtype}s")
        deltas.append(delta // item)
    aligned = all(d % _ALIGN_ELEMENTS == 0 for d in deltas)
    key = (base.device, tuple(deltas))
    with _OFFSETS_LOCK:
        offsets = _OFFSETS.get(key)
        if offsets is None:
            offsets = _OFFSETS[key] = torch.tensor(deltas, dtype=torch.int64, device=base.device)
    return base, offsets, aligned


@triton.jit
def _rank_offset(offsets_ptr, r, ALIGNED: tl.constexpr):
    delta = tl.load(offsets_ptr + r)
    if ALIGNED:
        delta = tl.multiple_of(delta, 16)
    return delta


@triton.jit
def _scatter_rows_kernel(
    src_ptr, stride_src,
    dst_ptr, offsets_ptr, stride_dst, col,
    pos_ptr,
    num_tokens, width, trash,
    NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """Items (token, column block), strided over the programs (_programs)."""
    blocks = tl.cdiv(width, BLOCK)
    for item in range(tl.program_id(0), num_tokens * blocks, tl.num_programs(0)):
        token = (item // blocks).to(tl.int64)
        cols = (item % blocks) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        row = tl.load(src_ptr + token * stride_src + cols, mask=mask)
        for r in tl.static_range(NUM_RANKS):
            slot = tl.load(pos_ptr + token * NUM_RANKS + r)
            if slot != trash:
                base = dst_ptr + _rank_offset(offsets_ptr, r, ALIGNED)
                tl.store(base + slot * stride_dst + col + cols, row, mask=mask)


@triton.jit
def _gather_sum_rows_kernel(
    src_ptr, offsets_ptr, stride_src,
    out_ptr, stride_out,
    pos_ptr,
    hidden, trash,
    num_tokens,
    NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """Items (token, column block), strided over the programs (one item each uncapped)."""
    blocks = tl.cdiv(hidden, BLOCK)
    for item in range(tl.program_id(0), num_tokens * blocks, tl.num_programs(0)):
        token = (item // blocks).to(tl.int64)
        cols = (item % blocks) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        # every rank's row requested before any is added (predicated loads, no branches): the
        # rows may be a peer's (loads over NVLink), whose latency then overlaps
        for r in tl.static_range(NUM_RANKS):
            slot = tl.load(pos_ptr + token * NUM_RANKS + r)
            base = src_ptr + _rank_offset(offsets_ptr, r, ALIGNED)
            live = cols < tl.where(slot != trash, hidden, 0)  # none of a trash slot's row
            row = tl.load(base + slot * stride_src + cols, mask=live, other=0.0)
            acc += row.to(tl.float32)
        out = out_ptr + token * stride_out + cols
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


#: dispatch_positions' block, tokens x ranks (padded to a power of two), of one program: the
#: programs run at once, then a second launch adds each block's offsets. At 4096 tokens of k = 8
#: over 4 ranks on an H200: 4.3 + 1.7 us in blocks of 256 tokens, against 29 us for one program
#: walking blocks of 1024 (docs/performance.md)
POSITIONS_TILE = 1024
_COUNTS_CHUNK = 64  # blocks' counts the second launch reads at a time


@triton.jit
def _store_counts(
    counts, counts_ptr, post_ptr, post_offsets_ptr, ranks, rank_ok, POST: tl.constexpr
):
    """counts [RANKS_PAD] into counts_ptr and, POST, each also at post + post_offsets[r]."""
    tl.store(counts_ptr + ranks, counts, mask=rank_ok)
    if POST:
        post = tl.load(post_offsets_ptr + ranks, mask=rank_ok, other=0)
        tl.store(post_ptr + post, counts, mask=rank_ok)


@triton.jit
def _dispatch_positions_kernel(
    ids_ptr, stride_ids_m, stride_ids_k,
    owner_ptr,
    pos_ptr, counts_ptr, post_ptr, post_offsets_ptr, block_counts_ptr,
    num_tokens, num_slots,
    TOP_K: tl.constexpr, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, GROUPED: tl.constexpr, POST: tl.constexpr, SINGLE: tl.constexpr,
):  # fmt: skip
    """A program a block of BLOCK_M tokens: each sent pair's index among the block's tokens
    going to its rank. SINGLE (one block): pos as it stays (GROUPED: the ranks' starts added)
    and the counts (POST: also each at post + post_offsets[r]). Else pos holds the index (-1
    where not sent) and block_counts[block] the block's count per rank, for
    _positions_offsets_kernel."""
    block = tl.program_id(0)
    ranks = tl.arange(0, RANKS_PAD)
    rank_ok = ranks < NUM_RANKS
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    goes = tl.zeros((BLOCK_M, RANKS_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(
            ids_ptr + rows.to(tl.int64) * stride_ids_m + j * stride_ids_k, mask=row_ok, other=-1
        )  # fmt: skip
        dest = tl.load(owner_ptr + expert, mask=expert >= 0, other=-1)
        goes = tl.maximum(goes, (dest[:, None] == ranks[None, :]).to(tl.int32))
    within = tl.cumsum(goes, axis=0) - goes
    sent = tl.sum(goes, axis=0).to(tl.int64)  # [RANKS_PAD]
    ptrs = pos_ptr + rows.to(tl.int64)[:, None] * NUM_RANKS + ranks[None, :]
    mask = row_ok[:, None] & rank_ok[None, :]
    if SINGLE:
        starts = tl.zeros((RANKS_PAD,), dtype=tl.int64)
        if GROUPED:
            starts = tl.cumsum(sent, axis=0) - sent
        tl.store(ptrs, tl.where(goes > 0, within + starts[None, :], num_slots), mask=mask)
        _store_counts(sent, counts_ptr, post_ptr, post_offsets_ptr, ranks, rank_ok, POST)
    else:
        tl.store(ptrs, tl.where(goes > 0, within, -1), mask=mask)
        tl.store(block_counts_ptr + block * RANKS_PAD + ranks, sent)


@triton.jit
def _positions_offsets_kernel(
    pos_ptr, counts_ptr, post_ptr, post_offsets_ptr, block_counts_ptr,
    num_tokens, num_slots, num_blocks,
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr, GROUPED: tl.constexpr, POST: tl.constexpr,
):  # fmt: skip
    """A program a block: its pairs' indices offset by the earlier blocks' counts (GROUPED:
    and the ranks' starts), num_slots where not sent; program 0 stores the counts. The
    blocks' counts are read CHUNK blocks at a time (one compiled variant whatever M)."""
    block = tl.program_id(0)
    ranks = tl.arange(0, RANKS_PAD)
    rank_ok = ranks < NUM_RANKS
    totals = tl.zeros((RANKS_PAD,), dtype=tl.int64)
    before = tl.zeros((RANKS_PAD,), dtype=tl.int64)
    for start in range(0, num_blocks, CHUNK):
        b = start + tl.arange(0, CHUNK)[:, None]
        per_block = tl.load(
            block_counts_ptr + b * RANKS_PAD + ranks[None, :], mask=b < num_blocks, other=0
        )  # [CHUNK, RANKS_PAD]
        totals += tl.sum(per_block, axis=0)
        before += tl.sum(tl.where(b < block, per_block, 0), axis=0)
    if GROUPED:
        before += tl.cumsum(totals, axis=0) - totals
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    ptrs = pos_ptr + rows.to(tl.int64)[:, None] * NUM_RANKS + ranks[None, :]
    mask = (rows < num_tokens)[:, None] & rank_ok[None, :]
    slot = tl.load(ptrs, mask=mask, other=-1)
    tl.store(ptrs, tl.where(slot >= 0, slot + before[None, :], num_slots), mask=mask)
    if block == 0:
        _store_counts(totals, counts_ptr, post_ptr, post_offsets_ptr, ranks, rank_ok, POST)


def dispatch_positions_triton(
    topk_ids: torch.Tensor,
    owner: torch.Tensor,
    num_ranks: int,
    num_slots: int,
    counts: torch.Tensor,
    *,
    grouped: bool = True,
    post: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """fusedmoe.parallel.rows.dispatch_positions_torch: -> pos int64 [M, R], the counts written
    into `counts` (int64 [R]) and, where given, count r into post[r] (a one-element int64
    tensor: a peer's). One launch where the tokens fit one block, else two (the blocks, then
    their offsets)."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    pos = torch.empty(num_tokens, num_ranks, dtype=torch.int64, device=device)
    post_base, post_offsets = counts, counts
    if post is not None:
        post_base, post_offsets, _ = rank_offsets(post, num_ranks)
    ranks_pad = max(next_power_of_2(num_ranks), 2)
    block_m = max(16, POSITIONS_TILE // ranks_pad)  # not from M: the variants follow R
    num_blocks = max(cdiv(num_tokens, block_m), 1)
    single = num_blocks == 1
    block_counts = counts if single else torch.empty(
        num_blocks, ranks_pad, dtype=torch.int64, device=device
    )  # fmt: skip
    warps = 8 if block_m * ranks_pad >= 2048 else 4
    common = dict(NUM_RANKS=num_ranks, RANKS_PAD=ranks_pad, BLOCK_M=block_m, GROUPED=grouped,
                  POST=post is not None, num_warps=warps)  # fmt: skip
    args = (
        topk_ids, topk_ids.stride(0), topk_ids.stride(1), owner, pos, counts, post_base,
        post_offsets, block_counts, num_tokens, num_slots,
    )  # fmt: skip
    with device_guard(topk_ids):
        launch(_dispatch_positions_kernel, (num_blocks,), args,
               dict(common, TOP_K=top_k, SINGLE=single), topk_ids.is_cuda)  # fmt: skip
        if not single:
            args = (pos, counts, post_base, post_offsets, block_counts, num_tokens, num_slots,
                    num_blocks)  # fmt: skip
            constexprs = dict(common, CHUNK=_COUNTS_CHUNK)
            launch(_positions_offsets_kernel, (num_blocks,), args, constexprs, topk_ids.is_cuda)
    return pos


@triton.jit
def _pack_meta_kernel(
    ids_ptr, stride_ids_m, stride_ids_k,
    w_ptr, stride_w_m, stride_w_k,
    scale_ptr, stride_scale_m, stride_scale_g,
    pos_ptr,
    dst_ptr, offsets_ptr, stride_dst, col,
    trash,
    TOP_K: tl.constexpr, NUM_SCALES: tl.constexpr, NUM_RANKS: tl.constexpr,
    BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """One token's ids | weights | scales as int32 words, stored at each of its rows."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    is_id = cols < TOP_K
    is_w = (cols >= TOP_K) & (cols < 2 * TOP_K)
    ids = tl.load(ids_ptr + token * stride_ids_m + cols * stride_ids_k, mask=is_id, other=0)
    w = tl.load(w_ptr + token * stride_w_m + (cols - TOP_K) * stride_w_k, mask=is_w, other=0.0)
    words = tl.where(is_id, ids.to(tl.int32), w.to(tl.float32).to(tl.int32, bitcast=True))
    if NUM_SCALES > 0:
        is_s = (cols >= 2 * TOP_K) & (cols < 2 * TOP_K + NUM_SCALES)
        sc = tl.load(
            scale_ptr + token * stride_scale_m + (cols - 2 * TOP_K) * stride_scale_g,
            mask=is_s, other=0.0,
        )  # fmt: skip
        words = tl.where(is_s, sc.to(tl.float32).to(tl.int32, bitcast=True), words)
    mask = cols < 2 * TOP_K + NUM_SCALES
    for r in tl.static_range(NUM_RANKS):
        slot = tl.load(pos_ptr + token * NUM_RANKS + r)
        if slot != trash:
            base = dst_ptr + _rank_offset(offsets_ptr, r, ALIGNED)
            tl.store(base + slot * stride_dst + col + cols, words, mask=mask)


@triton.jit
def _unpack_meta_kernel(
    src_ptr, stride_src, col,
    received_ptr,
    ids_ptr, w_ptr, scale_ptr,
    capacity, region_rows,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, NUM_SCALES: tl.constexpr,
    S_PAD: tl.constexpr, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, REGIONS: tl.constexpr,
):  # fmt: skip
    """Rows that arrived -> ids, weights (and scales); the others empty slots: id -1, weight 0,
    scale 1. Grouped (REGIONS false): rows [0, n) arrived, n the sum of the received counts.
    REGIONS: rank s's rows are [s * region_rows, s * region_rows + received[s])."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < capacity
    if REGIONS:
        source = rows // region_rows
        arrived = tl.load(received_ptr + source, mask=row_ok, other=0)
        live = (rows - source * region_rows < arrived)[:, None]
    else:
        ranks = tl.arange(0, RANKS_PAD)
        received = tl.sum(tl.load(received_ptr + ranks, mask=ranks < NUM_RANKS, other=0), axis=0)
        live = (rows < received)[:, None]
    base = src_ptr + rows.to(tl.int64)[:, None] * stride_src + col
    k = tl.arange(0, K_PAD)[None, :]
    k_ok = row_ok[:, None] & (k < TOP_K)
    ids = tl.load(base + k, mask=k_ok & live, other=-1)
    w = tl.load(base + TOP_K + k, mask=k_ok & live, other=0).to(tl.float32, bitcast=True)
    out = rows.to(tl.int64)[:, None] * TOP_K + k
    tl.store(ids_ptr + out, ids, mask=k_ok)
    tl.store(w_ptr + out, tl.where(live, w, 0.0), mask=k_ok)
    if NUM_SCALES > 0:
        g = tl.arange(0, S_PAD)[None, :]
        g_ok = row_ok[:, None] & (g < NUM_SCALES)
        sc = tl.load(base + 2 * TOP_K + g, mask=g_ok & live, other=0).to(tl.float32, bitcast=True)
        tl.store(scale_ptr + rows.to(tl.int64)[:, None] * NUM_SCALES + g,
                 tl.where(live, sc, 1.0), mask=g_ok)  # fmt: skip


def pack_meta_triton(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    scale: torch.Tensor | None,
    pos: torch.Tensor,
    dst,
    col: int,
    trash: int,
) -> None:
    """fusedmoe.parallel.rows.pack_meta_torch in one launch (dst: int32 words, one tensor or
    one per rank)."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return
    num_ranks = pos.shape[1]
    base, offsets, aligned = rank_offsets(dst, num_ranks)
    num_scales = 0 if scale is None else scale.shape[1]
    sc = topk_weights if scale is None else scale
    args = (
        topk_ids, *topk_ids.stride(), topk_weights, *topk_weights.stride(), sc, *sc.stride(),
        pos, base, offsets, base.stride(0), col, trash,
    )  # fmt: skip
    constexprs = dict(
        TOP_K=top_k, NUM_SCALES=num_scales, NUM_RANKS=num_ranks,
        BLOCK=next_power_of_2(2 * top_k + num_scales), ALIGNED=aligned, num_warps=1,
    )  # fmt: skip
    with device_guard(topk_ids):
        launch(_pack_meta_kernel, (num_tokens,), args, constexprs, topk_ids.is_cuda)


def unpack_meta_triton(
    src: torch.Tensor,
    col: int,
    received: torch.Tensor,
    capacity: int,
    top_k: int,
    num_scales: int,
    region_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fusedmoe.parallel.rows.unpack_meta_torch in one launch."""
    if region_rows is not None and capacity > received.shape[0] * region_rows:
        raise ValueError(
            f"{capacity} rows in regions of {region_rows} for {received.shape[0]} ranks"
        )
    device = src.device
    ids = torch.empty(capacity, top_k, dtype=torch.int32, device=device)
    weights = torch.empty(capacity, top_k, dtype=torch.float32, device=device)
    scale = None
    if num_scales:
        scale = torch.empty(capacity, num_scales, dtype=torch.float32, device=device)
    block_rows = 64
    args = (src, src.stride(0), col, received, ids, weights, weights if scale is None else scale,
            capacity, region_rows or 1)  # fmt: skip
    constexprs = dict(
        TOP_K=top_k, K_PAD=max(next_power_of_2(top_k), 2), NUM_SCALES=num_scales,
        S_PAD=max(next_power_of_2(num_scales), 2), NUM_RANKS=received.shape[0],
        RANKS_PAD=max(next_power_of_2(received.shape[0]), 2), BLOCK_ROWS=block_rows,
        REGIONS=region_rows is not None, num_warps=4,
    )  # fmt: skip
    with device_guard(src):
        launch(_unpack_meta_kernel, (cdiv(capacity, block_rows),), args, constexprs, src.is_cuda)
    return ids, weights, scale


#: programs per SM of the scatter on a GPU, 4 warps each, over blocks of 8 KiB: they stride
#: over their items and leave room on every SM for the kernels that run beside the
#: activations' stores (symm_mem_ep.routing_first). On 4 H200s, 130 MB to the peers with a
#: barrier: 2 a SM of 4 warps in 0.463 ms, 8 of 8 warps over 4 KiB (before) 0.478-0.514 in
#: the same run (docs/performance.md)
_PROGRAMS_PER_SM = 2
_SCATTER_WARPS = 4
_SCATTER_BLOCK_BYTES = 8192
_SMS: dict[int, int] = {}


def _programs(items: int, t: torch.Tensor) -> int:
    """The grid of a row mover over `items` (token or row, column block): on a GPU at most
    _PROGRAMS_PER_SM a SM, each striding over the items; one program per item elsewhere."""
    if not t.is_cuda:
        return max(items, 1)
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(items, _PROGRAMS_PER_SM * sms))


def _block(width: int, element_size: int, block_bytes: int = _BLOCK_BYTES) -> int:
    return min(next_power_of_2(max(width, 1)), max(block_bytes // element_size, 16))


def scatter_rows_triton(src: torch.Tensor, pos: torch.Tensor, dst, col: int, trash: int) -> None:
    """src [M, W] (unit stride along W) -> rows pos[m, r] of dst_r (one tensor, or one per
    rank), columns [col, col + W), for pos[m, r] != trash (the module docstring). One dtype."""
    num_tokens, width = src.shape
    if num_tokens == 0 or width == 0:
        return
    base, offsets, aligned = rank_offsets(dst, pos.shape[1])
    block = _block(width, src.element_size(), _SCATTER_BLOCK_BYTES)
    grid = (_programs(num_tokens * cdiv(width, block), src),)
    args = (src, src.stride(0), base, offsets, base.stride(0), col, pos, num_tokens, width, trash)
    constexprs = dict(NUM_RANKS=pos.shape[1], BLOCK=block, ALIGNED=aligned,
                      num_warps=_SCATTER_WARPS)  # fmt: skip
    with device_guard(src):
        launch(_scatter_rows_kernel, grid, args, constexprs, src.is_cuda)


def gather_sum_rows_triton(
    src, pos: torch.Tensor, out: torch.Tensor, trash: int, max_programs: int | None = None
) -> None:
    """out [M, H] = the sum of rows pos[m, r] of src_r [>= H columns] (one tensor, or one per
    rank), over pos[m, r] != trash. max_programs: at most that many programs, each striding
    over (token, column block) items (a sum that runs beside other kernels leaves them most
    SMs); None: one program an item."""
    num_tokens, hidden = out.shape
    if num_tokens == 0 or hidden == 0:
        return
    base, offsets, aligned = rank_offsets(src, pos.shape[1])
    block = _block(hidden, base.element_size())  # a 16-byte vector a thread of each row
    items = num_tokens * cdiv(hidden, block)
    grid = (items if max_programs is None else max(1, min(items, max_programs)),)
    args = (base, offsets, base.stride(0), out, out.stride(0), pos, hidden, trash, num_tokens)
    constexprs = dict(NUM_RANKS=pos.shape[1], BLOCK=block, ALIGNED=aligned, num_warps=8)
    with device_guard(out):
        launch(_gather_sum_rows_kernel, grid, args, constexprs, out.is_cuda)


# ---- barrier ----------------------------------------------------------------------------
#: FUSEDMOE_EP_BARRIER_TIMEOUT_S: seconds a rank waits on the GPU in barrier_triton for a peer
#: that never arrives before the kernel fails with a device-side assert (0: no limit); the
#: default is NCCL's own collective timeout in torch.distributed (10 minutes)
BARRIER_TIMEOUT_ENV = "FUSEDMOE_EP_BARRIER_TIMEOUT_S"
BARRIER_TIMEOUT_S = 600.0


@triton.jit
def _globaltimer(dummy):
    """The GPU's global timer in ns (dummy: any int32 scalar, for the asm's operand list)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64, is_pure=False, pack=1
    )


# debug: device_assert on, for this kernel only (it also checks its int32 arithmetic for
# overflow: nothing here can overflow, the poll counter wraps at 1024)
@triton.jit(debug=True)
def _barrier_kernel(
    pad_ptr, offsets_ptr, rank, timeout_s,
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, TIMED: tl.constexpr,
):  # fmt: skip
    """Epochs, one writer per word: pad[s] on each rank is the last epoch rank s reached,
    written by rank s alone; pad[R] this rank's own count of its barriers, written by this
    kernel alone. The epoch e = pad[R] + 1 goes into every rank's pad[rank] (release: what this
    rank wrote before is seen by whoever reads e), then this rank waits until each pad[s] >= e
    (acquire). No word has two writers, so no count can be lost to two ranks racing on one
    word; the store to a peer is an atomic exchange at system scope, for its release order
    (measured over NVLink; a PCIe host without native peer atomics has not been tried). Every
    rank makes the same barriers on a pad, so the epochs match. TIMED (on an NVIDIA GPU,
    timeout_s > 0, float32 seconds): a wait past timeout_s fails a device_assert, checked
    every 1024 polls (the timer is slow to read); rank s is element s of a RANKS_PAD vector,
    so a thread whose index is s modulo RANKS_PAD reports the rank that did not arrive."""
    ranks = tl.arange(0, RANKS_PAD)
    ok = ranks < NUM_RANKS
    epoch = tl.load(pad_ptr + NUM_RANKS) + 1
    tl.store(pad_ptr + NUM_RANKS, epoch)
    peer = tl.load(offsets_ptr + ranks, mask=ok, other=0)
    tl.atomic_xchg(pad_ptr + peer + rank, epoch + ranks * 0, mask=ok, sem="release", scope="sys")
    waiting = ok
    if TIMED:
        start = _globaltimer(rank)
    polls = 0
    while tl.max(waiting.to(tl.int32), axis=0) > 0:
        seen = tl.atomic_add(pad_ptr + ranks, 0, mask=waiting, sem="acquire", scope="sys")
        waiting = waiting & (seen < epoch)
        if TIMED:
            polls = (polls + 1) % 1024
            if polls == 0:
                late = (_globaltimer(rank) - start).to(tl.float32) > timeout_s * 1e9
                tl.device_assert(
                    ~(waiting & late),
                    "fusedmoe symm_mem barrier timed out (FUSEDMOE_EP_BARRIER_TIMEOUT_S): the "
                    "rank that never arrived is the thread index modulo the ranks padded to a "
                    "power of two",
                )


@functools.lru_cache(maxsize=16)
def _parse_timeout(raw: str | None) -> float:
    if raw is None:
        return BARRIER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"{BARRIER_TIMEOUT_ENV} must be a finite number of seconds >= 0 (0: no limit), "
            f"got {raw!r}"
        )
    return value


def barrier_timeout_s() -> float:
    """FUSEDMOE_EP_BARRIER_TIMEOUT_S, else BARRIER_TIMEOUT_S (0: no limit); ValueError if the
    variable is not a finite number >= 0. Read at every barrier (a test or a long warm-up may
    change it between calls)."""
    return _parse_timeout(os.environ.get(BARRIER_TIMEOUT_ENV))


def barrier_triton(pads: list[torch.Tensor], rank: int) -> None:
    """Every rank of the group signals every rank and waits for all their signals, on the
    current stream. pads[r]: rank r's pad (int64 [R + 1], zero at start, symmetric memory,
    mapped here), pads[rank] this rank's own. A rank that never arrives (it died, or it raised
    between a dispatch and its combine and went on) leaves the others waiting on the GPU, as in
    any collective: the launcher (torchrun) ends the job when a rank dies; a rank still alive
    fails after barrier_timeout_s() (a device-side assert naming the variable; the CUDA context
    is then lost, as after any device assert). The interpreter waits without a limit."""
    num_ranks = len(pads)
    mine, offsets, _ = rank_offsets(pads, num_ranks, base_index=rank)
    if mine.dtype != torch.int64 or mine.shape != (num_ranks + 1,):
        raise ValueError(
            f"barrier pads must be int64 [R + 1], got {mine.dtype} {tuple(mine.shape)}"
        )
    timeout_s = barrier_timeout_s()
    timed = mine.is_cuda and torch.version.cuda is not None and timeout_s > 0
    constexprs = dict(NUM_RANKS=num_ranks, RANKS_PAD=max(next_power_of_2(num_ranks), 2),
                      TIMED=timed, num_warps=1)  # fmt: skip
    with device_guard(mine):
        launch(_barrier_kernel, (1,), (mine, offsets, rank, timeout_s), constexprs, mine.is_cuda)
