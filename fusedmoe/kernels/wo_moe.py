"""The weight-only fused-experts op: align, GEMM1 + activation, GEMM2 x router weight, top-k
sum, with 4- and 8-bit weights dequantized inside the GEMMs (fusedmoe.kernels.wo_gemm).

    routing = moe_align_block_size(topk_ids, BM)          # none for M = 1 (direct rows)
    a2      = act(x[rows // k] @ deq(w13[e]).T + b13)     # GEMM1, a2 in the activation dtype
    y       = round(a2[rows] @ deq(w2[e]).T + b2) * topk_weights
    output  = sum over the k slots of each token          # moe_sum

Registered as a custom op (it writes `output` and the workspaces only), so a layer that calls
it traces under torch.compile; no host synchronisation, so it captures in a CUDA graph. The
weights stay in their stored format: no dequantized copy is ever made.

Kernels and tiles (WoConfig): at most GEMV_MAX_SLOTS_PER_EXPERT slots per expert (decode, each
expert about one slot), both GEMMs run the decode kernel (one slot x BN rows per program on the
CUDA cores, no alignment); above, the tensor-core kernel on the aligned layout, BM slots x BN
weight rows x BK per GEMM. wo_kernel_config takes, in order: the scoped override
(`use_wo_config`, for sweeps), the tuned table of the shape and GPU (moe_config's table layout,
dtype "wo_<format>"; an H100 table ships for gpt-oss MXFP4), the heuristic by slots per expert
(heuristic_wo_config: 16-slot tiles while experts see a few tokens, then 64 and 128).

MXFP4 x bf16 on Hopper (wo_hopper.weights_unusable_reason says where) runs both GEMMs through
wo_hopper's Gluon kernels instead: where the config is a decode one (gemv), the one-slot form
(wo_hopper_gemv, mma.sync: a program a slot up to GEMV_DIRECT_MAX_TOKENS, without alignment,
else a block of up to 8 slots of one expert; FUSEDMOE_WO_GEMV_MMA=0 turns it off);
otherwise, from 2 tokens on (one token then stays on the decode kernel, faster there) and at
any token count when a2_fp8_group is set (which the one-slot form does not run):

    x'      = permute_k(x)                                # the kernel's k order
    a2      = GEMM1 on x', stored in the same k order     # tiles of BM slots (<= 128)
    a2      = dequantize(fp8_quantize(a2, 1 x a2_fp8_group))   # a2_fp8_group only (w4a8)
    y, output as above

Only BM and GROUP_M of the config apply there (wo_hopper.hopper_block_m: up to 64 slots the
decode form; 128 the prefill form, where experts see 128 slots or more on average);
the tables were tuned for the Triton kernels. Where each variant stands: docs/performance.md,
"4-bit weight-only experts" (H100) and "MXFP4 x bf16 on Hopper in Gluon" (H200).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton.language as tl

from fusedmoe._paths import CACHE_ENV
from fusedmoe._pdl import pdl_args
from fusedmoe._triton import cdiv, device_guard, launch, op_or_impl
from fusedmoe.activation import MoEActivation
from fusedmoe.kernels import wo_gemm as wg
from fusedmoe.kernels import wo_hopper
from fusedmoe.kernels.fused_moe import (
    ACT_CODES,
    TL_DTYPE,
    GemmRows,
    device_name,
    gemm_rows,
    moe_sum,
)
from fusedmoe.kernels.moe_align import moe_align_block_size
from fusedmoe.kernels.moe_config import (
    SHIPPED_DIR,
    TUNED_CONFIGS_ENV,
    table_path,
    user_tables_dir,
)

__all__ = [
    "W_FORMATS",
    "WoConfig",
    "WoGemmConfig",
    "fused_experts_weight_only",
    "heuristic_wo_config",
    "table_dtype",
    "use_wo_config",
    "wo_kernel_config",
]

_A_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: calls of at most this many slots per expert (uniform routing: each expert about one slot)
#: run the decode kernel
GEMV_MAX_SLOTS_PER_EXPERT = 0.25
#: MXFP4 x bf16 on Hopper: the decode configs (gemv) run wo_hopper_gemv's one-slot form on the
#: tensor cores; FUSEDMOE_WO_GEMV_MMA=0 runs what ran before it (the CUDA-core GEMV at one
#: token, wo_hopper's decode form from two), for the A/B
_GEMV_MMA = os.environ.get("FUSEDMOE_WO_GEMV_MMA", "1") != "0"
#: the one-slot form's program a slot up to this many tokens, blocks of slots above: at 2
#: gpt-oss tokens on an H200 0.052-0.058 ms against 0.062 uniform, 0.051 against 0.047 when
#: both tokens pick the same experts; at 4 and 8 the blocks win (0.053 against 0.083 and 0.066
#: against 0.148 skewed), docs/performance.md "The one-slot form"
GEMV_DIRECT_MAX_TOKENS = 2
_DOT_SCALED = os.environ.get("FUSEDMOE_WO_DOT_SCALED", "0") == "1"
#: FUSEDMOE_WO_MMA_ORDER=1: 64 x 128 tiles on 4 warps take the register-direct path (wo_gemm,
#: MMA_ORDER). Off by default: 3x slower on an H100 as it stands (docs/performance.md)
_MMA_ORDER = os.environ.get("FUSEDMOE_WO_MMA_ORDER", "0") == "1"
#: the PTX decoding needs NVIDIA's backend (a ROCm build's tensors are "cuda" too)
_PTX = torch.version.cuda is not None
#: the weight formats by name (the quant config's weight element)
W_FORMATS = {"mxfp4": wg.WF_MXFP4, "nvfp4": wg.WF_NVFP4, "int4": wg.WF_INT4, "int8": wg.WF_INT8}


@dataclass(frozen=True)
class WoGemmConfig:
    block_n: int  # weight rows per program (GEMM1 gated: of gate and of up each)
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name, low in (("block_n", 8), ("block_k", 32), ("num_warps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {low}, got {value!r}")
        for name in ("group_m", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class WoConfig:
    block_m: int  # slots per tile (the aligned layout's block height)
    gemm1: WoGemmConfig
    gemm2: WoGemmConfig
    #: decode: both GEMMs one slot per program on the CUDA cores (wo_gemm._wo_gemv_kernel),
    #: BN rows x BK per step (block_m, gemm1 and gemm2 unused); for MXFP4 x bf16 on Hopper its
    #: presence selects wo_hopper_gemv's one-slot form instead, whose tile is its own
    #: (wo_hopper.GEMV_TILE)
    gemv: WoGemmConfig | None = None

    def __post_init__(self) -> None:
        m = self.block_m
        if not isinstance(m, int) or m < 16 or m & (m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {m!r}")
        if any(not isinstance(g, WoGemmConfig) for g in (self.gemm1, self.gemm2)):
            raise TypeError("gemm1 and gemm2 must be WoGemmConfig")
        if self.gemv is not None and not isinstance(self.gemv, WoGemmConfig):
            raise TypeError("gemv must be a WoGemmConfig or None")

    def to_json(self) -> dict:
        return {
            "block_m": self.block_m,
            "gemm1": asdict(self.gemm1),
            "gemm2": asdict(self.gemm2),
            "gemv": None if self.gemv is None else asdict(self.gemv),
        }

    @classmethod
    def from_json(cls, entry: object, where: str = "config") -> WoConfig:
        try:
            gemv = entry["gemv"]
            return cls(
                int(entry["block_m"]),
                WoGemmConfig(**entry["gemm1"]),
                WoGemmConfig(**entry["gemm2"]),
                None if gemv is None else WoGemmConfig(**gemv),
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"{where}: not a weight-only kernel config ({exc!r})") from None


_override: contextvars.ContextVar[WoConfig | None] = contextvars.ContextVar(
    "fusedmoe_wo_config", default=None
)


@contextlib.contextmanager
def use_wo_config(config: WoConfig | None) -> Iterator[None]:
    """Run the weight-only op with `config` in this scope (None: the heuristic)."""
    token = _override.set(config)
    try:
        yield
    finally:
        _override.reset(token)


def table_dtype(w_format: str) -> str:
    """The dtype field of a weight-only table's name (fusedmoe.kernels.moe_config.table_path)."""
    return f"wo_{w_format}"


def wo_kernel_config(
    num_tokens: int,
    top_k: int,
    num_local_experts: int,
    gemm1_rows: int = 0,
    hidden_size: int = 0,
    w_format: str = "",
    device_name: str | None = None,
) -> WoConfig:
    """The scoped override, else the tuned table of this shape and GPU (the tables of
    fusedmoe.kernels.moe_config, dtype "wo_<format>"), else the heuristic."""
    override = _override.get()
    if override is not None:
        return override
    return _resolved(
        num_tokens, top_k, num_local_experts, gemm1_rows, hidden_size, w_format, device_name,
        os.environ.get(TUNED_CONFIGS_ENV), os.environ.get(CACHE_ENV),
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _resolved(num_tokens, top_k, e, n, k, w_format, device_name, _env1, _env2) -> WoConfig:
    if device_name is not None and w_format:
        for root in (user_tables_dir(), SHIPPED_DIR):
            table = _load_wo_table(
                str(table_path(root, device_name, e, n, k, table_dtype(w_format)))
            )
            if table:
                return table[min(table, key=lambda key: (abs(key - num_tokens), key))]
    return heuristic_wo_config(num_tokens, top_k, e)


@functools.lru_cache(maxsize=64)
def _load_wo_table(path: str) -> dict[int, WoConfig] | None:
    p = Path(path)
    if not p.is_file():
        return None
    raw = json.loads(p.read_text())
    if not isinstance(raw, dict) or not all(str(m).isdigit() for m in raw):
        raise ValueError(f"weight-only config table {p}: expected token counts -> configs")
    return {int(m): WoConfig.from_json(v, f"{p} [{m}]") for m, v in raw.items()}


def heuristic_wo_config(num_tokens: int, top_k: int, num_local_experts: int) -> WoConfig:
    """The tiles by slots per expert (the module docstring)."""
    slots_per_expert = num_tokens * top_k / max(num_local_experts, 1)
    if slots_per_expert <= GEMV_MAX_SLOTS_PER_EXPERT:
        gemm = WoGemmConfig(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=2)
        # 8 x 256: 49.8 against 52.2 us for 16 x 128 at one gpt-oss MXFP4 token (H200, the
        # sweep of benchmarks/bench_wo_tiles.py --gemv in docs/performance.md; the sweep's
        # 48.3 for 8 x 512 is within its spread); other formats and GPUs not measured
        gemv = WoGemmConfig(block_n=8, block_k=256, group_m=1, num_warps=4, num_stages=1)
        return WoConfig(16, gemm, gemm, gemv)
    if slots_per_expert <= 16:
        gemm = WoGemmConfig(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=2)
        return WoConfig(16, gemm, gemm)
    if slots_per_expert <= 64:
        gemm = WoGemmConfig(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=2)
        return WoConfig(64, gemm, gemm)
    gemm = WoGemmConfig(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=2)
    return WoConfig(128, gemm, gemm)


def _weight_args(a, w, scale, zero, global_scale, bias, out, dummy) -> tuple:
    """The arguments both kernels take first: A, w, scales, zero points, global scale, bias,
    out (with their strides; dummy where a tensor is absent)."""
    s3 = scale if scale.dim() == 3 else scale.unsqueeze(-1)  # per channel: stride_sk unused
    return (
        a, a.stride(0), a.stride(1),
        w, w.stride(0), w.stride(1), w.stride(2),
        s3, s3.stride(0), s3.stride(1), s3.stride(2),
        *((zero, *zero.stride()) if zero is not None else (dummy, 0, 0, 0)),
        dummy if global_scale is None else global_scale,
        *((bias, bias.stride(0), bias.stride(1)) if bias is not None else (dummy, 0, 0)),
        out, out.stride(0), out.stride(1),
    )  # fmt: skip


def _use_asm(a: torch.Tensor, w_format: int) -> bool:
    """4-bit weights x bf16 on an NVIDIA GPU: the codes decoded in PTX."""
    return _PTX and a.is_cuda and a.dtype == torch.bfloat16 and w_format != wg.WF_INT8


def _epilogue_constexprs(
    a, a_row_div, w_format, group, zero, bias, activation, params, mul_routed_weight, h_dtype
) -> dict:
    """The constexprs both kernels take: the operands' formats and the epilogue."""
    return dict(
        A_ROW_DIV=a_row_div,
        W_FORMAT=w_format,
        GROUP=group,
        HAS_ZERO=zero is not None,
        HAS_BIAS=bias is not None,
        ACTIVATION=-1 if activation is None else ACT_CODES[activation],
        GATED=activation is not None and activation.is_gated,
        HAS_LIMIT=params[3],
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        H_DTYPE=h_dtype,
        ROUND_IN_FP32=not a.is_cuda,
        **pdl_args(a),
    )


def _launch(
    a, a_row_div, w, scale, zero, global_scale, bias, out, topk_weights, rows, num_slots, cfg,
    block_m, *, w_format, group, activation, params, mul_routed_weight, h_dtype,
):  # fmt: skip
    n_out = out.shape[1]
    alpha, beta, limit, _ = params
    args = (
        *_weight_args(a, w, scale, zero, global_scale, bias, out, rows.ids),
        topk_weights,
        *rows.kernel_args(),
        n_out, a.shape[1], num_slots, rows.num_blocks,
        alpha, beta, limit,
    )  # fmt: skip
    on_cuda = a.is_cuda
    # 4-bit weights x bf16 on the GPU: decoded in PTX (USE_ASM); MXFP4 x fp16 (or with
    # FUSEDMOE_WO_DOT_SCALED=1) through tl.dot_scaled; the rest in Triton ops
    use_asm = _use_asm(a, w_format)
    mx_dot = (
        w_format == wg.WF_MXFP4
        and a.dtype in _A_FORMAT
        and (_DOT_SCALED or (on_cuda and not use_asm))
    )
    common = _epilogue_constexprs(
        a, a_row_div, w_format, group, zero, bias, activation, params, mul_routed_weight, h_dtype
    )
    constexprs = dict(
        **common,
        DOT_DTYPE=TL_DTYPE[a.dtype] if on_cuda and a.dtype != torch.float32 else tl.float32,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or not on_cuda else "tf32",
        MX_DOT=mx_dot,
        USE_ASM=use_asm and not mx_dot,
        # a tile shape whose coalesced load already holds wgmma's left operand (wo_gemm)
        MMA_ORDER=(
            _MMA_ORDER
            and not mx_dot
            and w_format != wg.WF_INT8
            and cfg.block_n == 64
            and cfg.block_k == 128
            and cfg.num_warps == 4
        ),
        A_FORMAT=_A_FORMAT.get(a.dtype, "bf16"),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        DIRECT=rows.routing is None,
        HAS_MAP=rows.expert_map is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    grid = (rows.num_blocks * cdiv(n_out, cfg.block_n),)
    launch(wg._wo_gemm_kernel, grid, args, constexprs, on_cuda)


def _launch_gemv(
    a, a_row_div, w, scale, zero, global_scale, bias, out, topk_weights, ids, expert_map,
    num_local, cfg, *, w_format, group, activation, params, mul_routed_weight, h_dtype,
):  # fmt: skip
    n_out = out.shape[1]
    alpha, beta, limit, _ = params
    num_ids = num_local if expert_map is None else expert_map.shape[0]
    args = (
        *_weight_args(a, w, scale, zero, global_scale, bias, out, ids),
        topk_weights,
        ids, ids if expert_map is None else expert_map,
        num_ids, num_local,
        n_out, a.shape[1],
        alpha, beta, limit,
    )  # fmt: skip
    on_cuda = a.is_cuda
    common = _epilogue_constexprs(
        a, a_row_div, w_format, group, zero, bias, activation, params, mul_routed_weight, h_dtype
    )
    constexprs = dict(
        **common,
        DOT_DTYPE=tl.bfloat16 if on_cuda and a.dtype == torch.bfloat16 else tl.float32,
        USE_ASM=_use_asm(a, w_format),
        HAS_MAP=expert_map is not None,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=1,
    )
    grid = (ids.numel(), cdiv(n_out, cfg.block_n))
    launch(wg._wo_gemv_kernel, grid, args, constexprs, on_cuda)


def _mx_hopper_reason(x, w13, w13_scale, w2, w2_scale, width, w_format, group) -> str | None:
    """None where both GEMMs can run wo_hopper's Gluon kernel (MXFP4 x bf16 on Hopper), else
    why not."""
    if w_format != "mxfp4" or group != 32:
        return f"the weights are {w_format} in groups of {group}, the kernel takes MXFP4"
    return wo_hopper.weights_unusable_reason(
        x.device, x.dtype, x.shape[1], width, w13, w13_scale, w2, w2_scale
    )


def _hopper_constexprs(common: dict) -> dict:
    """_epilogue_constexprs as wo_hopper's kernel takes them (always MXFP4, rounded on the GPU)."""
    keep = ("A_ROW_DIV", "HAS_BIAS", "ACTIVATION", "GATED", "HAS_LIMIT", "MUL_ROUTED_WEIGHT")
    return {**{k: common[k] for k in keep}, "H_DTYPE": common["H_DTYPE"]}


def _fp8_round_trip(a: torch.Tensor, group: int, use_ue8m0: bool) -> None:
    """a [S, W] bf16 <- its FP8 1 x group quantization, dequantized (in place; the last group
    may be partial). wo_hopper's k order permutes columns within 64-column blocks only, so a
    group holds the same columns in either order."""
    from fusedmoe.quant.activation import per_token_group_quant_fp8

    q, scale = per_token_group_quant_fp8(a, group, False, use_ue8m0)
    a.copy_(dequantize_groups(q, scale, group))


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """q [M, W] (FP8) times its 1 x group scales [M, ceil(W / group)] (any strides; the last
    group may be partial), as float32."""
    m, w = q.shape
    out = q.float()
    full = w // group * group
    if full:
        out[:, :full].view(m, -1, group).mul_(scale[:, : full // group].unsqueeze(2))
    if full < w:
        out[:, full:].mul_(scale[:, full // group :])
    return out


def _fused_experts_weight_only_impl(
    output: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_zero: torch.Tensor | None,
    w2_zero: torch.Tensor | None,
    w13_global_scale: torch.Tensor | None,
    w2_global_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    activation: str,
    alpha: float,
    beta: float,
    limit: float,
    has_limit: bool,
    w_format: str,
    group: int,
    mul_routed_weight: bool,
    a2_fp8_group: int = 0,
    a2_ue8m0: bool = False,
) -> None:
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return
    num_slots = num_tokens * top_k
    num_local, gemm1_rows = w13.shape[0], w13.shape[1]
    hidden = x.shape[1]
    act = MoEActivation(activation)
    width = act.output_size(gemm1_rows)
    config = wo_kernel_config(
        num_tokens, top_k, num_local, gemm1_rows, hidden, w_format, device_name(x)
    )
    fmt = W_FORMATS[w_format]
    h_dtype = TL_DTYPE[output.dtype]
    params = (alpha, beta, limit, has_limit)
    with device_guard(x):
        a2 = workspace2.view(-1)[: num_slots * width].view(num_slots, width)
        y = workspace13.view(-1)[: num_slots * hidden].view(num_slots, hidden)
        mx_reason = _mx_hopper_reason(x, w13, w13_scale, w2, w2_scale, width, w_format, group)
        if config.gemv is not None and mx_reason is None and _GEMV_MMA and not a2_fp8_group:
            # about a slot per expert, MXFP4 on Hopper: the one-slot form (wo_hopper_gemv). Up
            # to GEMV_DIRECT_MAX_TOKENS a program a slot (no alignment; an expert is read at
            # most that many times), else a block of an expert's slots (up to 8), so that an
            # expert several tokens share is read once
            ids = topk_ids.reshape(-1)
            blocks = (
                None
                if num_tokens <= GEMV_DIRECT_MAX_TOKENS
                else moe_align_block_size(topk_ids, 8, num_local, expert_map)
            )
            common = _epilogue_constexprs(
                x, top_k, fmt, group, None, w13_bias, act, params, False, h_dtype
            )
            wo_hopper.launch_mx_gemv(
                x, w13, w13_scale, w13_bias, a2, topk_weights, ids, expert_map, num_local,
                params[:3], _hopper_constexprs(common), blocks,
            )  # fmt: skip
            common = _epilogue_constexprs(
                a2, 1, fmt, group, None, w2_bias, None, params, mul_routed_weight, h_dtype
            )
            wo_hopper.launch_mx_gemv(
                a2, w2, w2_scale, w2_bias, y, topk_weights.reshape(-1), ids, expert_map,
                num_local, params[:3], _hopper_constexprs(common), blocks,
            )  # fmt: skip
            moe_sum(y, output, topk_ids, expert_map, num_local)
            return
        # one token without the one-slot form: the CUDA-core GEMV is faster, unless
        # a2_fp8_group needs the Gluon kernel
        hopper_reason = (
            mx_reason if num_tokens > 1 or a2_fp8_group else "one token runs the decode kernel"
        )
        if hopper_reason is None:
            block_m = wo_hopper.hopper_block_m(config.block_m, num_slots, num_local)
            routing = moe_align_block_size(topk_ids, block_m, num_local, expert_map)
            rows = GemmRows(
                block_m, routing.expert_ids.shape[0], routing, topk_ids.reshape(-1),
                expert_map, num_local,
            )  # fmt: skip
            group_m = config.gemm1.group_m
            common = _epilogue_constexprs(
                x, top_k, fmt, group, None, w13_bias, act, params, False, h_dtype
            )
            # both GEMMs read their activations in the kernel's k order (wo_hopper): x as a
            # permuted copy, a2 as GEMM1 stores it
            wo_hopper.launch_mx_hopper(
                wo_hopper.permute_k(x), w13, w13_scale, w13_bias, a2, topk_weights, rows,
                num_slots, params[:3], block_m, group_m, _hopper_constexprs(common), True,
            )  # fmt: skip
            if a2_fp8_group:  # an FP8 scheme's intermediate: quantized and read back
                _fp8_round_trip(a2, a2_fp8_group, a2_ue8m0)
            common = _epilogue_constexprs(
                a2, 1, fmt, group, None, w2_bias, None, params, mul_routed_weight, h_dtype
            )
            wo_hopper.launch_mx_hopper(
                a2, w2, w2_scale, w2_bias, y, topk_weights.reshape(-1), rows, num_slots,
                params[:3], block_m, group_m, _hopper_constexprs(common), False,
            )  # fmt: skip
            moe_sum(y, output, topk_ids, expert_map, num_local)
            return
        if a2_fp8_group:  # before any kernel runs
            raise ValueError(
                f"a2_fp8_group runs on wo_hopper's kernel only, not here: {hopper_reason}"
            )
        if config.gemv is not None:
            ids = topk_ids.reshape(-1)
            common = dict(w_format=fmt, group=group, params=params, h_dtype=h_dtype)
            _launch_gemv(
                x, top_k, w13, w13_scale, w13_zero, w13_global_scale, w13_bias, a2,
                topk_weights, ids, expert_map, num_local, config.gemv, activation=act,
                mul_routed_weight=False, **common,
            )  # fmt: skip
            _launch_gemv(
                a2, 1, w2, w2_scale, w2_zero, w2_global_scale, w2_bias, y,
                topk_weights.reshape(-1), ids, expert_map, num_local, config.gemv,
                activation=None, mul_routed_weight=mul_routed_weight, **common,
            )  # fmt: skip
            moe_sum(y, output, topk_ids, expert_map, num_local)
            return
        rows = gemm_rows(topk_ids, expert_map, config.block_m, num_local)
        _launch(
            x, top_k, w13, w13_scale, w13_zero, w13_global_scale, w13_bias, a2, topk_weights,
            rows, num_slots, config.gemm1, config.block_m, w_format=fmt, group=group,
            activation=act, params=params, mul_routed_weight=False, h_dtype=h_dtype,
        )  # fmt: skip
        _launch(
            a2, 1, w2, w2_scale, w2_zero, w2_global_scale, w2_bias, y, topk_weights.reshape(-1),
            rows, num_slots, config.gemm2, config.block_m, w_format=fmt, group=group,
            activation=None, params=params, mul_routed_weight=mul_routed_weight,
            h_dtype=h_dtype,
        )  # fmt: skip
        moe_sum(y, output, topk_ids, expert_map, num_local)


_fused_experts_weight_only_op = torch.library.custom_op(
    "fusedmoe::fused_experts_weight_only", mutates_args=("output", "workspace13", "workspace2")
)(_fused_experts_weight_only_impl)


@_fused_experts_weight_only_op.register_fake
def _(output, x, w13, w2, w13_scale, w2_scale, w13_zero, w2_zero, w13_global_scale,
      w2_global_scale, w13_bias, w2_bias, topk_weights, topk_ids, expert_map, workspace13,
      workspace2, activation, alpha, beta, limit, has_limit, w_format, group,
      mul_routed_weight, a2_fp8_group=0, a2_ue8m0=False):  # fmt: skip
    return None


def fused_experts_weight_only(
    output: torch.Tensor,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w_format: str,
    group: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    activation: MoEActivation,
    params: tuple[float, float, float, bool],
    workspace13: torch.Tensor,
    workspace2: torch.Tensor,
    w13_zero: torch.Tensor | None = None,
    w2_zero: torch.Tensor | None = None,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    mul_routed_weight: bool = True,
    a2_fp8_group: int = 0,
    a2_ue8m0: bool = False,
) -> None:
    """Write the experts' weighted top-k sum into output [M, H]. Inputs are assumed checked by
    the caller (TritonExperts): w_format one of W_FORMATS, group the scales' group along K (0:
    int8 per channel), topk_weights float32 [M, k]; params (alpha, beta, limit, has_limit).
    a2_fp8_group (MXFP4 on Hopper only, wo_hopper.weights_unusable_reason; else ValueError):
    the intermediate activation goes through FP8 1 x a2_fp8_group quantization (UE8M0 scales
    with a2_ue8m0) between the GEMMs, as mxfp4_w4a8 defines it."""
    if a2_fp8_group and (a2_fp8_group < 0 or a2_fp8_group % 64):
        raise ValueError(
            f"a2_fp8_group must be a positive multiple of 64 (wo_hopper permutes columns "
            f"within 64-column blocks), got {a2_fp8_group}"
        )
    alpha, beta, limit, has_limit = params
    op_or_impl(_fused_experts_weight_only_op, _fused_experts_weight_only_impl)(
        output, x, w13, w2, w13_scale, w2_scale, w13_zero, w2_zero, w13_global_scale,
        w2_global_scale, w13_bias, w2_bias, topk_weights, topk_ids, expert_map, workspace13,
        workspace2, activation.value, alpha, beta, limit, has_limit, w_format, group,
        mul_routed_weight, a2_fp8_group, a2_ue8m0,
    )  # fmt: skip
