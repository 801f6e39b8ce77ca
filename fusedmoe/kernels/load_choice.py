"""How concentrated a call's routing is, read on the GPU: whether its slots sit on few enough
experts for the contiguous-layout GEMMs (deep_gemm's wgmma engine) to beat the
triton backend's gather GEMMs.

Legend: S slots (M tokens x k), E_l local experts, count[e] the slots routed to local expert
e, touched = #{e : count[e] > 0}, routed = sum_e count[e].

    engine  = touched > 0 and routed >= min_per_expert * touched
    flags   = uint8 [2]: (engine, not engine)

routed / touched is the mean load of the experts the call touches. Under uniform routing it is
close to the mean over all experts (S / E_l), which the host knows; under skewed routing a few
experts take most slots and it is many times larger, which only the ids on the GPU tell.
fusedmoe.experts.deep_gemm branches on the flags inside a CUDA graph (one conditional node per
branch), so the choice costs no host synchronisation.

Two launches above _SINGLE_MAX slots (per-chunk histograms, then one program sums them and
decides), one below. The ids are read as the alignment reads them (moe_align.local_ids): an id
outside [0, E) or mapped off this rank counts nowhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedmoe._pdl import pdl_args, pdl_start
from fusedmoe._triton import cdiv, device_guard, launch, next_power_of_2
from fusedmoe.kernels.moe_align import local_ids

__all__ = ["engine_flags", "engine_flags_torch"]

# Slots per program of the counting launch; one program up to _SINGLE_MAX.
_SINGLE_MAX = 2048
_CHUNK = 1024


@triton.jit
def _count_kernel(
    ids_ptr, map_ptr, num_ids, counts_ptr, num_slots, num_local,
    HAS_MAP: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """counts[pid, e] over the program's chunk of slots (bin num_local: not routed here)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    local = local_ids(ids_ptr, map_ptr, num_ids, offs, num_slots, num_local, HAS_MAP)
    tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), tl.histogram(local, E_PAD))


@triton.jit
def _choose_kernel(
    ids_ptr, map_ptr, num_ids, counts_ptr, flags_ptr, num_slots, num_local, num_programs,
    min_per_expert,
    HAS_MAP: tl.constexpr, SINGLE: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
    P_STEP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """flags = (engine, not engine) from the counts: of every slot (SINGLE: CHUNK covers them
    all) or summed over the counting launch's programs."""
    pdl_start(PDL)
    bins = tl.arange(0, E_PAD)
    if SINGLE:
        offs = tl.arange(0, CHUNK)
        local = local_ids(ids_ptr, map_ptr, num_ids, offs, num_slots, num_local, HAS_MAP)
        total = tl.histogram(local, E_PAD)
    else:
        total = tl.zeros((E_PAD,), tl.int32)
        for p in range(0, num_programs, P_STEP):
            rows = p + tl.arange(0, P_STEP)
            mask = (rows < num_programs)[:, None]
            block = tl.load(counts_ptr + rows[:, None] * E_PAD + bins[None, :], mask=mask, other=0)
            total += tl.sum(block, axis=0)
    here = bins < num_local
    routed = tl.sum(tl.where(here, total, 0))
    touched = tl.sum(tl.where(here & (total > 0), 1, 0))
    engine = (touched > 0) & (routed >= min_per_expert * touched)
    tl.store(flags_ptr, engine.to(tl.uint8))
    tl.store(flags_ptr + 1, (1 - engine.to(tl.int32)).to(tl.uint8))


def engine_flags(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    min_per_expert: int,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """topk_ids [M, k] (global ids, -1 empty) -> uint8 [2] on its device: (engine, not engine)
    (module docstring). Inputs are assumed checked by the caller, as for moe_align."""
    num_slots = topk_ids.numel()
    device = topk_ids.device
    flags = torch.empty(2, dtype=torch.uint8, device=device)
    ids = topk_ids.reshape(-1)
    e_pad = next_power_of_2(num_local_experts + 1)  # + the bin of slots not routed here
    single = num_slots <= _SINGLE_MAX
    chunk = max(16, next_power_of_2(num_slots)) if single else _CHUNK
    num_programs = 1 if single else cdiv(num_slots, chunk)
    counts = flags  # unread by one program
    if not single:
        counts = torch.empty((num_programs, e_pad), dtype=torch.int32, device=device)
    map_arg = ids if expert_map is None else expert_map  # unread without a map
    num_ids = num_local_experts if expert_map is None else expert_map.shape[0]
    pdl = pdl_args(topk_ids)
    common = dict(HAS_MAP=expert_map is not None, CHUNK=chunk, E_PAD=e_pad, **pdl)
    on_cuda = topk_ids.is_cuda
    with device_guard(topk_ids):
        if not single:
            args = (ids, map_arg, num_ids, counts, num_slots, num_local_experts)
            launch(_count_kernel, (num_programs,), args, dict(num_warps=4, **common), on_cuda)
        args = (
            ids, map_arg, num_ids, counts, flags, num_slots, num_local_experts, num_programs,
            min_per_expert,
        )  # fmt: skip
        p_step = max(1, min(next_power_of_2(num_programs), 4096 // e_pad))
        constexprs = dict(SINGLE=single, P_STEP=p_step, num_warps=4, **common)
        launch(_choose_kernel, (1,), args, constexprs, on_cuda)
    return flags


def engine_flags_torch(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    min_per_expert: int,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin of engine_flags, in plain torch (the spec)."""
    ids = topk_ids.reshape(-1).long()
    num_ids = num_local_experts if expert_map is None else expert_map.shape[0]
    ids = torch.where((ids >= 0) & (ids < num_ids), ids, -1)
    if expert_map is not None:
        ids = torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], -1)
    ids = ids[(ids >= 0) & (ids < num_local_experts)]
    counts = torch.bincount(ids, minlength=num_local_experts)
    touched, routed = int((counts > 0).sum()), int(counts.sum())
    engine = touched > 0 and routed >= min_per_expert * touched
    return torch.tensor([engine, not engine], dtype=torch.uint8, device=topk_ids.device)
