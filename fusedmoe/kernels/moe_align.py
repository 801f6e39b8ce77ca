"""Token alignment: sort the (token, slot) rows by local expert, each expert's run padded to
BLOCK_M, as the Triton expert GEMMs read them. On the GPU, with no host synchronisation.

Legend: M tokens, k top-k, S = M * k slots (row s = token s // k, its j-th expert s % k),
E_l local experts, BM = BLOCK_M.

    local[s]        = expert_map[topk_ids[s]]  (topk_ids[s] without a map; -1: not on this rank)
    count[e]        = #{s : local[s] == e}
    padded_start[e] = sum_{e' < e} ceil(count[e'] / BM) * BM
    sorted_token_ids[padded_start[e] + r] = the r-th slot (in slot order) routed to e
    sorted_token_ids[p] = S           for the padding p of each run (the sentinel: no slot)
    expert_ids[b]       = the local expert of rows [b * BM, (b + 1) * BM)
    num_tokens_post_padded[0] = sum_e ceil(count[e] / BM) * BM

Slots not routed to this rank (id -1, or an expert of another rank) appear nowhere. The buffers
have a size fixed by (S, E_l, BM), so the launch needs no count from the device:

    max_padded = min(S * BM, S + E_l * (BM - 1)) rounded up to BM    (every run ends in a block)
    max_blocks = max_padded / BM

Blocks past num_tokens_post_padded / BM have expert_ids -1 and the GEMMs skip them.

The kernel: each program takes CHUNK slots, counts them per expert (tl.histogram) and sorts
them by (expert, slot) (tl.sort); one program then turns the counts into offsets (a scan over
programs, then over experts) and the block -> expert table; each program scatters its sorted
slots. Up to _SINGLE_MAX slots (decode and small batches) one program does all three phases in
one launch; above, three launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedmoe._pdl import pdl_args, pdl_start
from fusedmoe._triton import cdiv, device_guard, launch, next_power_of_2

__all__ = ["AlignedRouting", "aligned_sizes", "moe_align_block_size", "moe_align_block_size_torch"]

# Slots per program. One program sorts its chunk in registers (tl.sort), and the sort's cost
# grows fast with its length: on an H100 a chunk of 256 slots took ~2 us, 1024 ~6 us and 4096
# ~40 us. So up to _SINGLE_MAX slots one program does the whole alignment in one launch, and
# above, programs of _CHUNK_MIN slots (more where there would be over _MAX_PROGRAMS of them:
# the scan reads every program's counts) run the three phases in three launches.
_SINGLE_MAX = 512
_CHUNK_MIN = 256
_CHUNK_MAX = 4096
_MAX_PROGRAMS = 64


@dataclass
class AlignedRouting:
    """The rows of the expert GEMMs: slots sorted by local expert, runs padded to block_m."""

    sorted_token_ids: torch.Tensor  # int32 [max_padded]: slot ids; S marks padding
    expert_ids: torch.Tensor  # int32 [max_blocks]: local expert per block, -1 past the end
    num_tokens_post_padded: torch.Tensor  # int32 [1]: rows in use (a multiple of block_m)
    block_m: int


def aligned_sizes(num_slots: int, num_local_experts: int, block_m: int) -> tuple[int, int]:
    """(max_padded, max_blocks) for S slots: the most rows and blocks any routing can need."""
    rows = min(num_slots * block_m, num_slots + num_local_experts * (block_m - 1))
    blocks = cdiv(rows, block_m)
    return blocks * block_m, blocks


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def local_ids(ids_ptr, map_ptr, num_ids, offs, num_slots, num_local, HAS_MAP: tl.constexpr):
    """Local expert of each slot in `offs`; num_local for slots that are not routed here (and
    for lanes past the end), so that they count and sort into a bin of their own. An id
    outside [0, num_ids) or a map entry outside [0, num_local) is not routed here: nothing
    is read or written out of bounds whatever the ids hold (their range is checked on the host
    only in debug mode, fusedmoe.debug_checks)."""
    valid = offs < num_slots
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    ids = tl.where(ids < num_ids, ids, -1)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=valid & (ids >= 0), other=-1).to(tl.int32)
    return tl.where((ids < 0) | (ids >= num_local), num_local, ids)


@triton.jit
def _count_chunk(
    ids_ptr, map_ptr, num_ids, counts_ptr, sorted_ptr, pid, num_slots, num_local, max_padded,
    fill_per_program,
    HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """Phase 1 of program `pid`: counts[pid, e] over its chunk; fills its share of the
    sorted ids with the sentinel (the scatter of phase 3 overwrites the routed rows)."""
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    local = local_ids(ids_ptr, map_ptr, num_ids, offs, num_slots, num_local, HAS_MAP)
    counts = tl.histogram(local, E_PAD)
    tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), counts)
    start = pid * fill_per_program
    for i in range(start, start + fill_per_program, CHUNK):
        rows = i + tl.arange(0, CHUNK)
        mask = (rows < start + fill_per_program) & (rows < max_padded)
        tl.store(sorted_ptr + rows, tl.full((CHUNK,), 0, tl.int32) + num_slots, mask=mask)


@triton.jit
def _scan_counts(
    counts_ptr, base_ptr, expert_ids_ptr, num_post_ptr, num_programs, num_local, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, P_STEP: tl.constexpr, J_STEP: tl.constexpr,
):  # fmt: skip
    """Phase 2 (one program): base[p, e] = padded_start[e] + slots of e in chunks before p;
    the block -> expert table; the padded total. The counts are read P_STEP programs' rows at
    a time, and each expert writes its own blocks, J_STEP at a time (a search of every block
    among the experts' ends cost 5-12 us per call on an H100 at 256 experts)."""
    experts = tl.arange(0, E_PAD)
    is_local = experts < num_local
    progs = tl.arange(0, P_STEP)
    total = tl.zeros((E_PAD,), tl.int32)
    for p0 in range(0, num_programs, P_STEP):
        rows = p0 + progs
        mask = (rows < num_programs)[:, None]
        total += tl.sum(tl.load(counts_ptr + rows[:, None] * E_PAD + experts[None, :], mask=mask,
                                other=0), axis=0)  # fmt: skip
    total = tl.where(is_local, total, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    running = padded_start
    for p0 in range(0, num_programs, P_STEP):
        rows = p0 + progs
        mask = (rows < num_programs)[:, None]
        offs = rows[:, None] * E_PAD + experts[None, :]
        counts = tl.load(counts_ptr + offs, mask=mask, other=0)
        tl.store(base_ptr + offs, running[None, :] + tl.cumsum(counts, axis=0) - counts, mask=mask)
        running += tl.sum(counts, axis=0)
    num_post = tl.sum(padded, axis=0)
    tl.store(num_post_ptr, num_post)
    # expert e owns blocks [padded_start[e] / BM, padded_end[e] / BM); the others are -1.
    # The loop runs (the most blocks any expert has) / J_STEP times: 1 or 2 under uniform
    # routing, S / BM / J_STEP where every slot goes to one expert (not timed at large S)
    first = padded_start // BLOCK_M
    num_blocks = padded // BLOCK_M  # 0 for the bin of slots not routed here
    steps = tl.arange(0, J_STEP)
    owner = tl.zeros((J_STEP, E_PAD), tl.int32) + experts[None, :]
    for j0 in range(0, tl.max(num_blocks, axis=0), J_STEP):
        j = (j0 + steps)[:, None]
        tl.store(expert_ids_ptr + first[None, :] + j, owner, mask=j < num_blocks[None, :])
    tail = tl.arange(0, 1024)
    for b0 in range(num_post // BLOCK_M, max_blocks, 1024):
        tl.store(expert_ids_ptr + b0 + tail, tl.full((1024,), -1, tl.int32),
                 mask=b0 + tail < max_blocks)  # fmt: skip


@triton.jit
def _scatter_chunk(
    ids_ptr, map_ptr, num_ids, counts_ptr, base_ptr, shift_ptr, sorted_ptr, pid, num_slots,
    num_local, HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """Phase 3 of program `pid`: the r-th slot of expert e in this chunk goes to row
    base[pid, e] + r. Sorting by (expert, slot) keeps slot order within each expert."""
    lanes = tl.arange(0, CHUNK)
    offs = pid * CHUNK + lanes
    local = local_ids(ids_ptr, map_ptr, num_ids, offs, num_slots, num_local, HAS_MAP)
    keys = tl.sort(local * CHUNK + lanes)
    expert = keys // CHUNK
    slot = pid * CHUNK + keys % CHUNK
    # lane i of the sorted chunk holds the (i - chunk_start[e])-th slot of its expert e
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + pid * E_PAD + experts)
    chunk_start = tl.cumsum(counts, axis=0) - counts
    shift = tl.load(base_ptr + pid * E_PAD + experts) - chunk_start
    tl.store(shift_ptr + pid * E_PAD + experts, shift)
    tl.debug_barrier()  # the shifts are read back by other threads of this program
    dest = lanes + tl.load(shift_ptr + pid * E_PAD + expert, mask=expert < num_local, other=0)
    tl.store(sorted_ptr + dest, slot, mask=expert < num_local)


@triton.jit
def _align_single_kernel(
    ids_ptr, map_ptr, num_ids, counts_ptr, base_ptr, shift_ptr,
    sorted_ptr, expert_ids_ptr, num_post_ptr,
    num_slots, num_local, max_padded, max_blocks,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
    J_STEP: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_start(PDL)
    _count_chunk(
        ids_ptr, map_ptr, num_ids, counts_ptr, sorted_ptr, 0, num_slots, num_local, max_padded,
        max_padded, HAS_MAP, CHUNK, E_PAD,
    )  # fmt: skip
    tl.debug_barrier()
    _scan_counts(
        counts_ptr, base_ptr, expert_ids_ptr, num_post_ptr, 1, num_local, max_blocks,
        BLOCK_M, E_PAD, 1, J_STEP,
    )  # fmt: skip
    tl.debug_barrier()
    _scatter_chunk(
        ids_ptr, map_ptr, num_ids, counts_ptr, base_ptr, shift_ptr, sorted_ptr, 0, num_slots,
        num_local, HAS_MAP, CHUNK, E_PAD,
    )  # fmt: skip


@triton.jit
def _count_kernel(
    ids_ptr, map_ptr, num_ids, counts_ptr, sorted_ptr, num_slots, num_local, max_padded,
    fill_per_program,
    HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_start(PDL)
    _count_chunk(
        ids_ptr, map_ptr, num_ids, counts_ptr, sorted_ptr, tl.program_id(0), num_slots, num_local,
        max_padded, fill_per_program, HAS_MAP, CHUNK, E_PAD,
    )  # fmt: skip


@triton.jit
def _scan_kernel(
    counts_ptr, base_ptr, expert_ids_ptr, num_post_ptr, num_programs, num_local, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, P_STEP: tl.constexpr, J_STEP: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_start(PDL)
    _scan_counts(
        counts_ptr, base_ptr, expert_ids_ptr, num_post_ptr, num_programs, num_local, max_blocks,
        BLOCK_M, E_PAD, P_STEP, J_STEP,
    )  # fmt: skip


@triton.jit
def _scatter_kernel(
    ids_ptr, map_ptr, num_ids, counts_ptr, base_ptr, shift_ptr, sorted_ptr, num_slots, num_local,
    HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (fusedmoe._pdl)
):  # fmt: skip
    pdl_start(PDL)
    _scatter_chunk(
        ids_ptr, map_ptr, num_ids, counts_ptr, base_ptr, shift_ptr, sorted_ptr, tl.program_id(0),
        num_slots, num_local, HAS_MAP, CHUNK, E_PAD,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------
def _chunk_for(num_slots: int) -> int:
    """The slots per program of an alignment of num_slots (see _SINGLE_MAX)."""
    if num_slots <= _SINGLE_MAX:
        return next_power_of_2(num_slots)
    per_program = next_power_of_2(cdiv(num_slots, _MAX_PROGRAMS))
    return min(_CHUNK_MAX, max(_CHUNK_MIN, per_program))


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_m: int,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    chunk: int | None = None,
) -> AlignedRouting:
    """topk_ids [M, k] (global ids, -1 empty) -> AlignedRouting, in 1 launch (one program holds
    every slot) or 3.

    Inputs are assumed checked by the caller (ids in [-1, E), expert_map [E] of ids in
    [-1, E_l)); `chunk` (a power of two) forces the slots per program, for tests.
    """
    num_slots = topk_ids.numel()
    max_padded, max_blocks = aligned_sizes(num_slots, num_local_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    routing = AlignedRouting(sorted_ids, expert_ids, num_post, block_m)
    if num_slots == 0:
        num_post.zero_()
        return routing
    ids = topk_ids.reshape(-1)
    chunk = min(chunk or _chunk_for(num_slots), next_power_of_2(num_slots))
    num_programs = cdiv(num_slots, chunk)
    e_pad = next_power_of_2(num_local_experts + 1)  # + the bin of slots not routed here
    counts = torch.empty((num_programs, e_pad), dtype=torch.int32, device=device)
    base = torch.empty_like(counts)
    shift = torch.empty_like(counts)
    expert_map_arg = ids if expert_map is None else expert_map  # unread without a map
    num_ids = num_local_experts if expert_map is None else expert_map.shape[0]
    j_step = max(1, 1024 // e_pad)  # blocks per expert written per step of the table
    warps = max(1, min(16, chunk // 256))
    pdl = pdl_args(topk_ids)
    common = dict(HAS_MAP=expert_map is not None, CHUNK=chunk, E_PAD=e_pad, **pdl)
    guard = device_guard(topk_ids)
    on_cuda = topk_ids.is_cuda
    with guard:
        if num_programs == 1:
            args = (
                ids, expert_map_arg, num_ids, counts, base, shift, sorted_ids, expert_ids,
                num_post, num_slots, num_local_experts, max_padded, max_blocks,
            )  # fmt: skip
            constexprs = dict(BLOCK_M=block_m, J_STEP=j_step, num_warps=warps, **common)
            launch(_align_single_kernel, (1,), args, constexprs, on_cuda)
            return routing
        fill = cdiv(max_padded, num_programs)
        args = (
            ids, expert_map_arg, num_ids, counts, sorted_ids, num_slots, num_local_experts,
            max_padded, fill,
        )  # fmt: skip
        launch(_count_kernel, (num_programs,), args, dict(num_warps=warps, **common), on_cuda)
        args = (
            counts, base, expert_ids, num_post, num_programs, num_local_experts, max_blocks,
        )  # fmt: skip
        p_step = min(next_power_of_2(num_programs), max(1, 4096 // e_pad))
        constexprs = dict(
            BLOCK_M=block_m, E_PAD=e_pad, P_STEP=p_step, J_STEP=j_step, num_warps=4, **pdl
        )
        launch(_scan_kernel, (1,), args, constexprs, on_cuda)
        args = (
            ids, expert_map_arg, num_ids, counts, base, shift, sorted_ids, num_slots,
            num_local_experts,
        )  # fmt: skip
        launch(_scatter_kernel, (num_programs,), args, dict(num_warps=warps, **common), on_cuda)
    return routing


def moe_align_block_size_torch(
    topk_ids: torch.Tensor,
    block_m: int,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
) -> AlignedRouting:
    """The twin: the same AlignedRouting, in plain loops (the spec)."""
    num_slots = topk_ids.numel()
    max_padded, max_blocks = aligned_sizes(num_slots, num_local_experts, block_m)
    ids = topk_ids.reshape(-1).long().tolist()
    emap = None if expert_map is None else expert_map.long().tolist()
    rows_of = [[] for _ in range(num_local_experts)]
    num_ids = num_local_experts if emap is None else len(emap)
    for slot, gid in enumerate(ids):
        local = -1 if not 0 <= gid < num_ids else (gid if emap is None else emap[gid])
        if 0 <= local < num_local_experts:  # out of range: not routed here
            rows_of[local].append(slot)
    sorted_ids, expert_ids = [], []
    for expert, rows in enumerate(rows_of):
        blocks = cdiv(len(rows), block_m)
        sorted_ids += rows + [num_slots] * (blocks * block_m - len(rows))
        expert_ids += [expert] * blocks
    num_post = len(sorted_ids)
    sorted_ids += [num_slots] * (max_padded - num_post)
    expert_ids += [-1] * (max_blocks - len(expert_ids))

    def tensor(values):
        return torch.tensor(values, dtype=torch.int32, device=topk_ids.device)

    return AlignedRouting(tensor(sorted_ids), tensor(expert_ids), tensor([num_post]), block_m)
