"""The DeepGEMM-style MoE op: permute into a contiguous expert-aligned layout, two grouped
GEMMs over it, the activation + quantization between them, unpermute with the weighted top-k
reduce.

    routing  = moe_align_block_size(topk_ids, ALIGN)      expert-sorted slots, runs padded to
                                                          ALIGN rows (128 on Hopper; 64 for
                                                          short runs on the wgmma engine)
    a1_perm  = permute(a1q, a1q_scale)                    row r holds slot sorted[r]'s token;
                                                          m_indices[r] its expert, -1 padding
    h        = a1_perm @ w13[m_indices].T                 grouped GEMM, bf16 out; FP8 128-block
                                                          scales promoted per K block (MX: the
                                                          operands dequantized on load)
    a2       = quant(act(h + b13[m_indices]))             fused act + 1 x 128 group FP8 (MXFP8:
                                                          act, then quantize); the rows past
                                                          those in use skipped; the GEMM1 bias
                                                          (if any) added here
    y        = a2 @ w2[m_indices].T                       grouped GEMM, bf16 out
    output   = unpermute_reduce(y)                        out[t] = sum_j w[t, j] (y[inv[t*k + j]]
                                                          + b2[e_j]), e_j the slot's expert

Legend: M tokens, k top-k, S = M * k slots, E_l local experts, H = K hidden, N = 2I the w13
rows, M_sum the rows of the aligned layout (compute_aligned_M_and_alignment). Padding rows are
never read back: the GEMMs compute them from whatever the buffers hold (the blocks past the
last expert's run are skipped), and the unpermute only reads the rows of routed slots.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from fusedmoe._triton import cdiv, device_guard, next_power_of_2, op_or_impl
from fusedmoe.activation import ActivationParams, MoEActivation, apply_activation
from fusedmoe.kernels import moe_gemm as g
from fusedmoe.kernels.deep_gemm_lib import MASKED_ROWS, find_library
from fusedmoe.kernels.fused_moe import TL_DTYPE, GemmRows, GemmVariant, launch_gemm, moe_sum
from fusedmoe.kernels.moe_align import aligned_sizes, local_ids, moe_align_block_size
from fusedmoe.kernels.moe_config import GemmConfig
from fusedmoe.kernels.wgmma_gemm import wgmma_grouped_gemm
from fusedmoe.quant.activation import quantize_mxfp8
from fusedmoe.quant.formats import FP8_DTYPE

if TYPE_CHECKING:  # annotations only: the modular layer sits above the kernels
    from fusedmoe.modular.types import ActivationSpec, ExpertTokensMeta
from fusedmoe.quant.kernels import (
    act_mul_group_quant_fp8_impl,
    act_mul_group_quant_fp8_op,
    resolve_params,
)

__all__ = [
    "ContiguousLayout",
    "MaskedLayout",
    "compute_aligned_M_and_alignment",
    "deep_gemm_config",
    "fused_experts_deep_gemm",
    "masked_max_m",
    "permute_contiguous",
    "permute_contiguous_torch",
    "permute_masked",
    "permute_masked_torch",
    "unpermute_reduce",
    "unpermute_reduce_torch",
]

_PERMUTE_ROWS = 16  # rows per permute program
_COLS = 1024  # columns per permute / unpermute program


def compute_aligned_M_and_alignment(
    M: int,
    top_k: int,
    local_num_experts: int,
    alignment: int,
    expert_tokens_meta: ExpertTokensMeta | None = None,
) -> tuple[int, int]:
    """(M_sum, alignment): the rows of the contiguous layout for M tokens.

    With the per-expert token counts on the host (EP dispatch knows them) M_sum is exact:
    sum_e round_up(count_e, alignment). Otherwise it is the most any routing can need,
    min(S * A, S + E_l * (A - 1)) rounded up to A, so no count is read from the device.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if expert_tokens_meta is not None and expert_tokens_meta.expert_num_tokens_cpu is not None:
        counts = expert_tokens_meta.expert_num_tokens_cpu.tolist()
        return sum(-(-int(c) // alignment) * alignment for c in counts), alignment
    return aligned_sizes(M * top_k, local_num_experts, alignment)[0], alignment


@dataclass
class ContiguousLayout:
    """The permuted activations and how to undo the permutation."""

    a: torch.Tensor  # [M_sum, K] rows of a1q in expert-aligned runs
    a_scale: torch.Tensor | None  # [M_sum, G] their scales (row-major), None: unquantized
    m_indices: torch.Tensor  # int32 [M_sum]: local expert of each row, -1 for padding
    inv_perm: torch.Tensor  # int32 [S]: the row of each slot routed here (others: unread)
    expert_ids: torch.Tensor  # int32 [M_sum / A]: local expert of each run block, -1 past end
    num_rows: torch.Tensor  # int32 [1]: rows in use (a multiple of A)
    alignment: int


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _permute_kernel(
    a_ptr, stride_am, stride_ak,  # [M, K] (FP8 viewed as bytes)
    s_ptr, stride_sm, stride_sg,  # [M, G] scales
    ap_ptr, stride_apm, stride_apk,  # [M_sum, K]
    sp_ptr, stride_spm, stride_spg,  # [M_sum, G]
    sorted_ptr, expert_ids_ptr, num_post_ptr,  # moe_align's AlignedRouting at block_m = ALIGN
    m_indices_ptr, inv_ptr,  # [M_sum], [S]
    K, G, num_slots, num_rows,
    TOP_K: tl.constexpr,
    ALIGN: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < num_rows
    num_post = tl.load(num_post_ptr)
    slots = tl.load(sorted_ptr + rows, mask=in_range & (rows < num_post), other=num_slots)
    valid = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = valid[:, None] & (cols < K)[None, :]
    a = tl.load(a_ptr + tokens[:, None] * stride_am + cols[None, :] * stride_ak, mask=mask)
    dst = ap_ptr + rows.to(tl.int64)[:, None] * stride_apm + cols[None, :] * stride_apk
    tl.store(dst, a, mask=mask)
    if tl.program_id(1) == 0:
        expert = tl.load(expert_ids_ptr + rows // ALIGN, mask=valid, other=-1)
        tl.store(m_indices_ptr + rows, tl.where(valid, expert, -1), mask=in_range)
        tl.store(inv_ptr + slots, rows, mask=valid)
        if HAS_SCALE:
            groups = tl.arange(0, BLOCK_G)
            s_mask = valid[:, None] & (groups < G)[None, :]
            s = tl.load(
                s_ptr + tokens[:, None] * stride_sm + groups[None, :] * stride_sg, mask=s_mask
            )
            s_dst = sp_ptr + rows.to(tl.int64)[:, None] * stride_spm + groups[None, :] * stride_spg
            tl.store(s_dst, s, mask=s_mask)


@triton.jit
def _masked_rank_kernel(
    ids_ptr, map_ptr, num_ids, rank_ptr, masked_m_ptr,
    num_slots, num_local, max_m,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Program e: the rank of each slot routed to local expert e among e's slots, in slot
    order (rank[s]), and masked_m[e] = how many there are (at most max_m)."""
    e = tl.program_id(0)
    seen = 0
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        local = local_ids(ids_ptr, map_ptr, num_ids, offs, num_slots, num_local, HAS_MAP)
        hit = (local == e).to(tl.int32)
        rank = seen + tl.cumsum(hit, 0) - 1
        tl.store(rank_ptr + offs, rank, mask=hit > 0)
        seen += tl.sum(hit, 0)
    tl.store(masked_m_ptr + e, tl.minimum(seen, max_m))


@triton.jit
def _masked_permute_kernel(
    a_ptr, stride_am, stride_ak,  # [M, K] (FP8 viewed as bytes)
    s_ptr, stride_sm, stride_sg,  # [M, G] scales
    ap_ptr, stride_apm, stride_apk,  # [E_l * max_m, K]
    sp_ptr, stride_spm, stride_spg,  # [E_l * max_m, G]
    ids_ptr, map_ptr, num_ids, rank_ptr, inv_ptr,
    K, G, num_slots, num_local, max_m,
    TOP_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Slot s routed to local expert e with rank p: token s // k's row to row e * max_m + p."""
    slots = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    local = local_ids(ids_ptr, map_ptr, num_ids, slots, num_slots, num_local, HAS_MAP)
    routed = local < num_local
    rank = tl.load(rank_ptr + slots, mask=routed, other=0)
    valid = routed & (rank < max_m)
    rows = (local * max_m + rank).to(tl.int64)
    tokens = (slots // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = valid[:, None] & (cols < K)[None, :]
    a = tl.load(a_ptr + tokens[:, None] * stride_am + cols[None, :] * stride_ak, mask=mask)
    tl.store(ap_ptr + rows[:, None] * stride_apm + cols[None, :] * stride_apk, a, mask=mask)
    if tl.program_id(1) == 0:  # -1: no row (an expert with more than max_m slots)
        tl.store(inv_ptr + slots, tl.where(valid, rows, -1).to(tl.int32), mask=routed)
        groups = tl.arange(0, BLOCK_G)
        s_mask = valid[:, None] & (groups < G)[None, :]
        s = tl.load(s_ptr + tokens[:, None] * stride_sm + groups[None, :] * stride_sg, mask=s_mask)
        s_dst = sp_ptr + rows[:, None] * stride_spm + groups[None, :] * stride_spg
        tl.store(s_dst, s, mask=s_mask)


# ---------------------------------------------------------------------------------------------
# launchers and their torch twins
# ---------------------------------------------------------------------------------------------
def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _row_copy_args(a, a_scale, a_out, scale_out) -> tuple[tuple, int]:
    """(the leading arguments of the permute kernels, G): a and its destination (FP8 viewed as
    bytes) with their strides, each followed by its scales; without scales, dummies that no
    lane reads and G = 0."""
    ab, apb = _as_bytes(a), _as_bytes(a_out)
    if a_scale is None:
        src, dst, groups = (a, 0, 0), (a_out, 0, 0), 0
    else:
        src = (a_scale, *a_scale.stride())
        dst = (scale_out, *scale_out.stride())
        groups = a_scale.shape[1]
    return (ab, *ab.stride(), *src, apb, *apb.stride(), *dst), groups


def permute_contiguous(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    num_local_experts: int,
    alignment: int,
    m_sum: int,
    expert_map: torch.Tensor | None = None,
    *,
    a_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> ContiguousLayout:
    """a [M, K] (+ scales [M, G]) -> the contiguous expert-aligned layout of its M * k slots.
    a_out / scale_out: buffers of [m_sum, K] / [m_sum, G] to write into (workspaces). gate
    (uint8 [1] on the device): where it reads 0 the layout has no rows in use (num_rows 0), so
    that the kernels reading it after this one skip every row; no row of a is copied."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    k = a.shape[1]
    routing = moe_align_block_size(topk_ids, alignment, num_local_experts, expert_map)
    if gate is not None:
        routing.num_tokens_post_padded.mul_(gate)
    if routing.sorted_token_ids.shape[0] < m_sum:
        raise ValueError(
            f"m_sum {m_sum} exceeds the rows any routing needs "
            f"({routing.sorted_token_ids.shape[0]})"
        )
    a_perm = a.new_empty((m_sum, k)) if a_out is None else a_out
    s_perm = None
    if a_scale is not None:
        groups = a_scale.shape[1]
        s_perm = a_scale.new_empty((m_sum, groups)) if scale_out is None else scale_out
    m_indices = torch.empty(m_sum, dtype=torch.int32, device=a.device)
    inv_perm = torch.empty(max(num_slots, 1), dtype=torch.int32, device=a.device)
    if m_sum > 0:
        block_k = min(_COLS, next_power_of_2(k))
        grid = (cdiv(m_sum, _PERMUTE_ROWS), cdiv(k, block_k))
        copy_args, groups = _row_copy_args(a, a_scale, a_perm, s_perm)
        with device_guard(a):
            _permute_kernel[grid](
                *copy_args,
                routing.sorted_token_ids, routing.expert_ids, routing.num_tokens_post_padded,
                m_indices, inv_perm,
                k, groups, num_slots, m_sum,
                TOP_K=top_k,
                ALIGN=alignment,
                HAS_SCALE=a_scale is not None,
                BLOCK_R=_PERMUTE_ROWS,
                BLOCK_K=block_k,
                BLOCK_G=next_power_of_2(max(groups, 1)),
                num_warps=4,
            )  # fmt: skip
    return ContiguousLayout(
        a_perm, s_perm, m_indices, inv_perm, routing.expert_ids,
        routing.num_tokens_post_padded, alignment,
    )  # fmt: skip


def permute_contiguous_torch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    num_local_experts: int,
    alignment: int,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict[int, int]]:
    """The spec, in loops: (a_perm [R, K], scales [R, G], m_indices [R], {slot: row}) with R
    the rows in use: each local expert's slots in slot order, its run padded to `alignment`
    (padding rows of a zero and m_indices -1)."""
    ids = topk_ids.reshape(-1).tolist()
    if expert_map is not None:
        emap = expert_map.tolist()
        ids = [emap[i] if i >= 0 else -1 for i in ids]
    top_k = topk_ids.shape[1]
    rows, experts, where = [], [], {}
    for e in range(num_local_experts):
        run = [s for s, i in enumerate(ids) if i == e]
        if not run:
            continue
        for s in run:
            where[s] = len(rows)
            rows.append(s // top_k)
            experts.append(e)
        pad = -len(run) % alignment
        rows += [-1] * pad
        experts += [-1] * pad
    index = torch.tensor(rows, dtype=torch.long)
    take = index.clamp(min=0)

    def gather(t):
        out = t.cpu()[take].clone()
        out[index < 0] = 0
        return out

    a_perm = gather(a.view(torch.uint8) if a.element_size() == 1 else a).view(a.dtype)
    s_perm = None if a_scale is None else gather(a_scale)
    return a_perm, s_perm, torch.tensor(experts, dtype=torch.int32), where


@dataclass
class MaskedLayout:
    """The activations batched per local expert (DeepGEMM's masked layout)."""

    a: torch.Tensor  # [E_l, max_m, K]: expert e's slots in rows [0, masked_m[e]), slot order
    a_scale: torch.Tensor | None  # [E_l, max_m, G] their scales, None: unquantized
    masked_m: torch.Tensor  # int32 [E_l]: rows in use per expert
    inv_perm: torch.Tensor  # int32 [S]: row e * max_m + p of each slot routed here
    max_m: int


def masked_max_m(num_tokens: int) -> int:
    """Rows per expert of the masked layout for M tokens: M rounded up to MASKED_ROWS (k
    distinct experts per token put at most M slots on one expert)."""
    return max(1, cdiv(num_tokens, MASKED_ROWS)) * MASKED_ROWS


def permute_masked(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    num_local_experts: int,
    max_m: int,
    expert_map: torch.Tensor | None = None,
    *,
    a_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> MaskedLayout:
    """a [M, K] (+ scales [M, G]) -> the masked layout of its M * k slots, in two launches (the
    ranks per expert, then the copy). a_out / scale_out: [E_l * max_m, K] / [E_l * max_m, G]
    buffers of any strides to write into. Rows past masked_m[e] are left as they were.

    The ids of a token must be distinct (the routers' contract; FUSEDMOE_DEBUG_CHECKS checks
    it before the library runs): with M tokens no expert then has more than M <= max_m slots.
    Were one to have more, it keeps its first max_m rows, its other slots get inv_perm -1
    (unpermute_reduce adds nothing for them) and nothing is written out of bounds."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    k = a.shape[1]
    rows = num_local_experts * max_m
    a_flat = a.new_empty((rows, k)) if a_out is None else a_out
    s_flat = None
    if a_scale is not None:
        groups = a_scale.shape[1]
        s_flat = a_scale.new_empty((rows, groups)) if scale_out is None else scale_out
    device = a.device
    masked_m = torch.empty(num_local_experts, dtype=torch.int32, device=device)
    rank = torch.empty(max(num_slots, 1), dtype=torch.int32, device=device)
    inv_perm = torch.empty(max(num_slots, 1), dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1)
    num_ids = num_local_experts if expert_map is None else expert_map.shape[0]
    id_map = ids if expert_map is None else expert_map
    has_map = expert_map is not None
    with device_guard(a):
        _masked_rank_kernel[(num_local_experts,)](
            ids, id_map, num_ids, rank, masked_m, num_slots, num_local_experts, max_m,
            HAS_MAP=has_map, CHUNK=min(_COLS, max(16, next_power_of_2(num_slots))),
            num_warps=4,
        )  # fmt: skip
        if num_slots > 0:
            block_k = min(_COLS, next_power_of_2(k))
            copy_args, groups = _row_copy_args(a, a_scale, a_flat, s_flat)
            _masked_permute_kernel[(cdiv(num_slots, _PERMUTE_ROWS), cdiv(k, block_k))](
                *copy_args,
                ids, id_map, num_ids, rank, inv_perm,
                k, groups, num_slots, num_local_experts, max_m,
                TOP_K=top_k,
                HAS_MAP=has_map,
                BLOCK_R=_PERMUTE_ROWS,
                BLOCK_K=block_k,
                BLOCK_G=next_power_of_2(max(groups, 1)),
                num_warps=4,
            )  # fmt: skip
    s_batched = None
    if s_flat is not None:
        s_batched = _batched(s_flat, num_local_experts, max_m)
    return MaskedLayout(
        _batched(a_flat, num_local_experts, max_m), s_batched, masked_m, inv_perm, max_m
    )


def _batched(t: torch.Tensor, experts: int, max_m: int) -> torch.Tensor:
    """[E_l * max_m, C] of strides (s0, s1) -> the [E_l, max_m, C] view (max_m * s0, s0, s1)."""
    s0, s1 = t.stride()
    return t.as_strided((experts, max_m, t.shape[1]), (max_m * s0, s0, s1))


def permute_masked_torch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    num_local_experts: int,
    max_m: int,
    expert_map: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int], dict[int, int]]:
    """The spec, in loops: per local expert, its slots' rows of a (and scales) in slot order,
    their count, and {slot: e * max_m + p}."""
    ids = topk_ids.reshape(-1).tolist()
    if expert_map is not None:
        emap = expert_map.tolist()
        ids = [emap[i] if 0 <= i < len(emap) else -1 for i in ids]
    top_k = topk_ids.shape[1]
    rows, scales, counts, where = [], [], [], {}
    for e in range(num_local_experts):
        run = [s for s, i in enumerate(ids) if i == e][:max_m]
        for p, s in enumerate(run):
            where[s] = e * max_m + p
        tokens = torch.tensor([s // top_k for s in run], dtype=torch.long)
        rows.append(_as_bytes(a).cpu()[tokens].view(a.dtype))
        scales.append(None if a_scale is None else a_scale.cpu()[tokens])
        counts.append(len(run))
    return rows, scales, counts, where


def unpermute_reduce(
    y: torch.Tensor,
    output: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    inv_perm: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    mul_weight: bool = True,
    bias: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> None:
    """output [M, H] = sum_j w[m, j] * (y[inv_perm[m * k + j]] + bias[e]) over the slots
    routed here (e: the slot's local expert; bias [E_l, H], the GEMM2 biases, or None; no w
    when mul_weight is False). gate (uint8 [1] on the device): output untouched where it
    reads 0."""
    with device_guard(y):
        moe_sum(
            y, output, topk_ids, expert_map, num_local_experts, inv_perm=inv_perm,
            topk_weights=topk_weights if mul_weight else None, bias=bias, gate=gate,
        )  # fmt: skip


def unpermute_reduce_torch(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    where: dict[int, int],
    mul_weight: bool = True,
    bias: torch.Tensor | None = None,
    local_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The spec: out[m] = sum_j w[m, j] * (y[where[m * k + j]] + bias[local_ids[m, j]]) (slots
    in `where`; the bias term with a bias only), fp32 sum."""
    if (bias is None) != (local_ids is None):
        raise ValueError("bias and local_ids come together")
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32)
    for m in range(num_tokens):
        for j in range(top_k):
            row = where.get(m * top_k + j)
            if row is not None:
                w = float(topk_weights[m, j]) if mul_weight else 1.0
                y_row = y[row].float().cpu()
                if bias is not None:
                    y_row = y_row + bias[int(local_ids[m, j])].float().cpu()
                out[m] += w * y_row
    return out.to(y.dtype)


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------
_override: contextvars.ContextVar[tuple[int, GemmConfig] | None] = contextvars.ContextVar(
    "fusedmoe_deep_gemm_config", default=None
)


@contextlib.contextmanager
def use_deep_gemm_config(block_m: int, config: GemmConfig) -> Iterator[None]:
    """Scoped override of deep_gemm_config (benchmarks, sweeps): every grouped GEMM inside.
    block_m must divide the alignment (a block reads one expert's weights)."""
    if block_m < 16 or block_m & (block_m - 1) or 128 % block_m:
        raise ValueError(f"block_m must be a power of two in [16, 128], got {block_m}")
    token = _override.set((block_m, config))
    try:
        yield
    finally:
        _override.reset(token)


def deep_gemm_config(m_sum: int, n: int, k: int, alignment: int) -> tuple[int, GemmConfig]:
    """(rows per GEMM block, tile) of the grouped GEMMs: 128 x 128 x 128 FP8 tiles (a run is
    a multiple of the alignment, so every block has one expert), 8 warps, 4 stages; 64 rows
    where the alignment is 64. The sweep on an H200 (sweep_fp8_configs.py at ab63d6f,
    deepseek-v3 at M = 16384): 4 stages 17.8 ms, 3 stages 19.5 ms, 64-row blocks 18.5 ms,
    256-wide tiles 25.9 ms, 4 warps 23.9 ms."""
    override = _override.get()
    if override is not None:
        return override
    block_m = min(128, alignment)
    return block_m, GemmConfig(block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)


def _grouped_gemm(a, a_scale, a_mode, w, w_scale, w_mode, out, layout, *, w_fp4, h_dtype):
    """out [M_sum, N] = a @ w[m_indices].T over the runs (bf16 out, no epilogue)."""
    m_sum = a.shape[0]
    block_m, config = deep_gemm_config(m_sum, out.shape[1], a.shape[1], layout.alignment)
    if layout.alignment % block_m:
        raise ValueError(f"{block_m}-row GEMM blocks would span the {layout.alignment}-row runs")
    rows = GemmRows(
        block_m, m_sum // block_m, _AlignedRuns(layout), layout.m_indices, None, w.shape[0]
    )
    launch_gemm(
        a, a_scale, a_mode, 1, w, w_scale, w_mode, None, out, None, layout.m_indices, rows,
        m_sum, config, activation=None, params=(0.0, 0.0, 0.0, False), out_mode=g.OUT_PLAIN,
        mul_routed_weight=False, h_dtype=h_dtype,
        variant=GemmVariant(align=layout.alignment, w_fp4=w_fp4),
    )  # fmt: skip


@dataclass
class _AlignedRuns:
    """The AlignedRouting fields the contiguous GEMM reads (the sorted ids are unused)."""

    layout: ContiguousLayout

    @property
    def sorted_token_ids(self):
        return self.layout.m_indices

    @property
    def expert_ids(self):
        return self.layout.expert_ids

    @property
    def num_tokens_post_padded(self):
        return self.layout.num_rows


# activation scale / weight scale layouts per scheme, and how a2 is made
_A_MODE = {"fp8_block": g.A_GROUP, "mxfp8": g.A_MX, "mxfp4_w4a8": g.A_GROUP}
_W_MODE = {"fp8_block": g.W_BLOCK, "mxfp8": g.W_MX, "mxfp4_w4a8": g.W_MX}


#: engines of the op: our Triton GEMMs over the contiguous layout, our Gluon (wgmma) GEMMs over
#: it (fp8_block on Hopper), or the DeepGEMM library's GEMMs over the contiguous or the masked
#: layout
ENGINES = ("triton", "wgmma", "contiguous", "masked")


def library_layout(
    num_tokens: int, top_k: int, num_local_experts: int, alignment: int
) -> tuple[str, int]:
    """(layout, rows) the library engine runs M tokens on: "masked" ([E_l, max_m] rows) where
    that has no more rows than the contiguous layout may need (small M, many experts: the
    contiguous bound is mostly padding), else "contiguous" (M_sum rows).

    The masked layout's scales are [E_l, max_m, G] views of column-major [rows, G] buffers
    (strides (max_m, 1, rows)); the library transposes them into its per-expert layout on
    each call (a few microseconds). Only calls requested by name take it: an auto-chosen
    deep_gemm hands every call this small to triton (LIBRARY_MIN_SLOTS_PER_EXPERT)."""
    m_sum, _ = compute_aligned_M_and_alignment(num_tokens, top_k, num_local_experts, alignment)
    masked_rows = num_local_experts * masked_max_m(num_tokens)
    if masked_rows <= m_sum:
        return "masked", masked_rows
    return "contiguous", m_sum


def carve_permuted(workspace13: torch.Tensor, rows: int, hidden: int, groups: int, scale_dtype):
    """workspace13 -> (a [rows, K] FP8, scales [rows, G] column-major: strides (1, rows))."""
    raw = workspace13.view(-1).view(torch.uint8)
    a_out = raw[: rows * hidden].view(FP8_DTYPE).view(rows, hidden)
    start = (rows * hidden + 15) // 16 * 16
    size = rows * groups * torch.empty((), dtype=scale_dtype).element_size()
    scales = raw[start : start + size].view(scale_dtype).view(groups, rows).t()
    return a_out, scales


def _library():
    lib = find_library()
    if lib is None:
        raise RuntimeError("the DeepGEMM library was chosen but cannot be imported")
    return lib


def _run_fp8_block(
    engine, output, a1q, a1q_scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
    expert_map, workspace13, workspace2, act, params, alignment, m_sum, use_ue8m0,
    mul_routed_weight, w13_bias, w2_bias, fast_accum, gate,
):  # fmt: skip
    """fp8_block on the DeepGEMM library's grouped GEMMs ("contiguous" / "masked") or on our
    Gluon ones ("wgmma", contiguous layout; fast_accum: their 256-wide fast-accumulation
    tiles), between our permute, act + quant and unpermute. Activation scales are column-major
    (the layout both read coalesced)."""
    num_local, n, hidden = w13.shape
    num_tokens, top_k = topk_ids.shape
    if engine == "wgmma" and fast_accum and alignment != 128:  # its tiles are 128 rows
        raise ValueError(f"fast_accum needs runs of 128 rows, got runs of {alignment}")
    if gate is not None and engine != "wgmma":  # the library's GEMMs read no rows in use
        raise ValueError(f"a gated call runs on our GEMMs (wgmma, triton), not on {engine!r}")
    alpha, beta, limit, has_limit = resolve_params(act, params)
    act_quant = op_or_impl(act_mul_group_quant_fp8_op, act_mul_group_quant_fp8_impl)
    if engine in ("contiguous", "wgmma"):
        a_out, scale_out = carve_permuted(
            workspace13, m_sum, hidden, a1q_scale.shape[1], torch.float32
        )
        layout = permute_contiguous(
            a1q, a1q_scale, topk_ids, num_local, alignment, m_sum, expert_map,
            a_out=a_out, scale_out=scale_out, gate=gate,
        )  # fmt: skip
        if engine == "wgmma":
            block_n = 256 if fast_accum else None

            def gemm(a, a_scale, w, w_scale, out):
                wgmma_grouped_gemm(
                    a, a_scale, w, w_scale, out, layout.expert_ids, layout.num_rows, alignment,
                    block_n=block_n,
                )  # fmt: skip
        else:
            lib = _library()

            def gemm(a, a_scale, w, w_scale, out):
                lib.contiguous(a, a_scale, w, w_scale, out, layout.m_indices)

        h = workspace2.view(-1)[: m_sum * n].view(m_sum, n)
        gemm(layout.a, layout.a_scale, w13, w13_scale, h)
        a2q, a2_scale = act_quant(  # the rows of the runs only: m_sum is a bound
            h, act.value, alpha, beta, limit, has_limit, g.QUANT_GROUP, True, use_ue8m0,
            layout.num_rows, w13_bias, None if w13_bias is None else layout.m_indices,
        )  # fmt: skip
        y = workspace2.view(-1)[: m_sum * hidden].view(m_sum, hidden)
        gemm(a2q, a2_scale, w2, w2_scale, y)
        inv_perm = layout.inv_perm
    else:
        lib = _library()
        max_m = masked_max_m(num_tokens)
        rows = num_local * max_m
        a_out, scale_out = carve_permuted(
            workspace13, rows, hidden, a1q_scale.shape[1], torch.float32
        )
        layout = permute_masked(
            a1q, a1q_scale, topk_ids, num_local, max_m, expert_map,
            a_out=a_out, scale_out=scale_out,
        )  # fmt: skip
        num_ids = num_local if expert_map is None else expert_map.shape[0]
        expected_m = min(max_m, max(1, cdiv(num_tokens * top_k, num_ids)))
        h = workspace2.view(-1)[: rows * n].view(num_local, max_m, n)
        lib.masked(layout.a, layout.a_scale, w13, w13_scale, h, layout.masked_m, expected_m)
        row_expert = None
        if w13_bias is not None:  # row r of the batched layout is expert r // max_m's
            row_expert = torch.arange(rows, dtype=torch.int32, device=h.device) // max_m
        a2q, a2_scale = act_quant(
            h.view(rows, n), act.value, alpha, beta, limit, has_limit, g.QUANT_GROUP, True,
            use_ue8m0, None, w13_bias, row_expert,
        )  # fmt: skip
        y = workspace2.view(-1)[: rows * hidden].view(num_local, max_m, hidden)
        lib.masked(
            _batched(a2q, num_local, max_m), _batched(a2_scale, num_local, max_m), w2,
            w2_scale, y, layout.masked_m, expected_m,
        )  # fmt: skip
        y = y.view(rows, hidden)
        inv_perm = layout.inv_perm
    unpermute_reduce(
        y, output, topk_weights, topk_ids, inv_perm, num_local, expert_map, mul_routed_weight,
        w2_bias, gate,
    )  # fmt: skip


def _fused_experts_deep_gemm_impl(
    output: torch.Tensor,
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    scheme: str,
    activation: str,
    act_alpha: float | None,
    act_beta: float | None,
    act_limit: float | None,
    alignment: int,
    m_sum: int,
    column_major_scales: bool,
    use_ue8m0: bool,
    mul_routed_weight: bool,
    engine: str,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    fast_accum: bool = False,
    gate: torch.Tensor | None = None,
) -> None:
    num_local, n, _ = w13.shape
    hidden = a1q.shape[1]
    act = MoEActivation(activation)
    params = ActivationParams(act_alpha, act_beta, act_limit)
    if engine != "triton":
        _run_fp8_block(
            engine, output, a1q, a1q_scale, w13, w2, w13_scale, w2_scale, topk_weights,
            topk_ids, expert_map, workspace13, workspace2, act, params, alignment, m_sum,
            use_ue8m0, mul_routed_weight, w13_bias, w2_bias, fast_accum, gate,
        )  # fmt: skip
        return
    h_dtype = TL_DTYPE[output.dtype]
    w_fp4 = scheme == "mxfp4_w4a8"
    # workspace13 holds a1 permuted and its scales; workspace2 holds h, then y (a2 and its
    # scales come from the act + quantization op, which allocates them)
    raw13 = workspace13.view(-1).view(torch.uint8)
    a_out = raw13[: m_sum * hidden].view(FP8_DTYPE).view(m_sum, hidden)
    scale_bytes = (m_sum * hidden + 15) // 16 * 16
    groups = a1q_scale.shape[1]
    scale_out = (
        raw13[scale_bytes : scale_bytes + m_sum * groups * a1q_scale.element_size()]
        .view(a1q_scale.dtype)
        .view(m_sum, groups)
    )
    layout = permute_contiguous(
        a1q, a1q_scale, topk_ids, num_local, alignment, m_sum, expert_map,
        a_out=a_out, scale_out=scale_out, gate=gate,
    )  # fmt: skip
    h = workspace2.view(-1)[: m_sum * n].view(m_sum, n)
    a_mode, w_mode = _A_MODE[scheme], _W_MODE[scheme]
    _grouped_gemm(
        layout.a, layout.a_scale, a_mode, w13, w13_scale, w_mode, h, layout, w_fp4=w_fp4,
        h_dtype=h_dtype,
    )  # fmt: skip
    if scheme == "mxfp8":  # no fused MX kernel: the activation (fp32), then MXFP8
        if w13_bias is not None:  # into h, rounded once as the reference does; padding
            # rows (m_indices -1) take none
            rows_bias = w13_bias.to(h.dtype)[layout.m_indices.clamp(min=0).long()]
            h.add_(rows_bias.masked_fill_(layout.m_indices.unsqueeze(1) < 0, 0))
        a2q, a2_scale = quantize_mxfp8(apply_activation(act, h, params))
    else:
        alpha, beta, limit, has_limit = resolve_params(act, params)
        a2q, a2_scale = op_or_impl(act_mul_group_quant_fp8_op, act_mul_group_quant_fp8_impl)(
            h, act.value, alpha, beta, limit, has_limit, g.QUANT_GROUP, column_major_scales,
            use_ue8m0, layout.num_rows, w13_bias,
            None if w13_bias is None else layout.m_indices,
        )  # fmt: skip
    y = workspace2.view(-1)[: m_sum * hidden].view(m_sum, hidden)
    _grouped_gemm(a2q, a2_scale, a_mode, w2, w2_scale, w_mode, y, layout, w_fp4=w_fp4,
                  h_dtype=h_dtype)  # fmt: skip
    unpermute_reduce(
        y, output, topk_weights, topk_ids, layout.inv_perm, w2.shape[0], expert_map,
        mul_routed_weight, w2_bias, gate,
    )  # fmt: skip


_fused_experts_deep_gemm_op = torch.library.custom_op(
    "fusedmoe::fused_experts_deep_gemm", mutates_args=("output", "workspace13", "workspace2")
)(_fused_experts_deep_gemm_impl)


@_fused_experts_deep_gemm_op.register_fake
def _(output, a1q, a1q_scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map,
      workspace13, workspace2, scheme, activation, act_alpha, act_beta, act_limit, alignment,
      m_sum, column_major_scales, use_ue8m0, mul_routed_weight, engine, w13_bias=None,
      w2_bias=None, fast_accum=False, gate=None):  # fmt: skip
    return None


def fused_experts_deep_gemm(
    output: torch.Tensor,
    a1q: torch.Tensor,
    a1q_scale: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    scheme: str,
    activation: ActivationSpec,
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    alignment: int = 128,
    m_sum: int | None = None,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
    mul_routed_weight: bool = True,
    engine: str = "triton",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    fast_accum: bool = False,
    gate: torch.Tensor | None = None,
) -> None:
    """output [M, H] = the experts' weighted top-k sum (one custom op: it traces under
    torch.compile and never reads the device from the host). engine: "triton" (our Triton
    grouped GEMMs over the contiguous layout), "wgmma" (our Gluon ones, fp8_block on Hopper),
    or the DeepGEMM library's over the "contiguous" or the "masked" layout (library_layout says
    which).

    a1q [M, K] quantized by prepare (FP8, scales [M, K/128] float32, or MXFP8 with uint8 E8M0
    scales [M, K/32]); w13 / w2 FP8 with 128 x 128 block scales, MXFP8, or MXFP4 (uint8 packed,
    [E_l, N, K/2]) with E8M0 scales; workspaces of DeepGemmExperts.workspace_shapes. Inputs are
    assumed checked by the caller (the backend). Biases (w13_bias [E_l, N], w2_bias [E_l, H]):
    the activation pass adds GEMM1's to h, the unpermute-reduce GEMM2's to each slot's row, in
    fp32 (the GEMMs themselves take none). fast_accum: the wgmma engine runs its
    fast-accumulation tiles (FusedMoEQuantConfig.fast_accum; runs of 128 rows only, a
    ValueError on runs of 64); the other engines promote. gate (uint8 [1] on the device;
    the contiguous layout's engines): where it reads 0 the call writes nothing into output,
    and its permute, GEMMs and act + quant skip every row (read on the GPU: one of two paths
    chosen without a host sync; MXFP8's activation, in torch, still runs).
    """
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return
    if m_sum is None:
        m_sum = compute_aligned_M_and_alignment(num_tokens, top_k, w13.shape[0], alignment)[0]
    p = activation.params
    op_or_impl(_fused_experts_deep_gemm_op, _fused_experts_deep_gemm_impl)(
        output, a1q, a1q_scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
        expert_map, workspace13, workspace2, scheme, activation.kind.value, p.alpha, p.beta,
        p.limit, alignment, m_sum, column_major_scales, use_ue8m0, mul_routed_weight, engine,
        w13_bias, w2_bias, fast_accum, gate,
    )  # fmt: skip
