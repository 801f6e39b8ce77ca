"""Peers of `fusedmoe bench`: other libraries' MoE kernels, timed in the same run and the same
table as fusedmoe's backends, on the same weights and the same routing (`--peers`).

    triton_kernels   OpenAI's triton_kernels: the MXFP4 MoE that gpt-oss runs on Hopper in vLLM
                     (matmul_ogs). Rows of mxfp4_w4a16 (MXFP4 weights, bf16 activations) with
                     the swigluoai or silu activation, a power-of-two top_k, on an sm90 GPU,
                     with `import triton_kernels` working (on the lent GPUs: PYTHONPATH=.vendor).

Nothing here imports triton or triton_kernels until a row has passed every other check of a
peer (scheme, activation, shape, an sm90 GPU): `fusedmoe bench` without --peers, and on a CPU
with it, never load them.

How the triton_kernels peer is called, per (shape, scheme) and per call:

    once per shape and scheme (untimed)
        weights    our w13 [E, N, H/2] and w2 [E, H, I/2] (uint8, two E2M1 codes per byte along
                   K, the even k in the low nibble) are viewed K-major: [E, K/2, N], packed
                   along K, the layout matmul_ogs takes as "w [E, K, N]", then swizzled into its
                   Hopper value layout (HopperMXValueLayout, mx_axis=1); with torch < 2.8.1
                   values and scales stay strided, as vLLM keeps them there
        scales     our E8M0 [E, N, K/32] -> [E, G, N], G = K/32 rounded up to a multiple of 4
                   with code 0 (the Hopper kernel reads the scales of BLOCK_K = 128 values,
                   4 groups, without a mask), then HopperMXScaleLayout (mx_axis=1, 8 warps:
                   the number of warps the Hopper kernel runs with that layout)
        biases     float32 [E, N] and [E, H] (matmul_ogs adds them to its float32 accumulator)
        flags      split_k pinned to 1 (a process-wide triton_kernels constraint), as vLLM pins
                   it for gpt-oss on Hopper
    every call (timed)
        routing    triton_kernels.routing.routing(router_logits, k): its top-k kernel over the
                   float32 logits, softmax over the k picked, then its sort of the M*k slots by
                   expert (gather / scatter indices, per-expert histogram and block map)
        GEMM1      matmul_ogs(x, w13, b13, gather_indx): rows of x gathered per expert, bias and
                   the fused swiglu in the epilogue -> [M*k, I] bf16, expert-sorted
        GEMM2      matmul_ogs(h, w2, b2, scatter_indx, gammas=router weights): bias, times the
                   router weight, each slot written in bf16, then its grouped reduction sums
                   the k slots of a token in float32 -> out [M, H] bf16

The activation. triton_kernels' fused swiglu (swiglu_fn) takes the GEMM1 output's columns in
pairs, the even column as the gate g and the odd one as the up value u, and computes

    g = min(g, limit); u = clamp(u, -limit, limit)       (no clamp when limit is None)
    out = (g * sigmoid(alpha * g)) * (u + 1)             written as fma(s, u, s)

which is fusedmoe's swigluoai exactly (fusedmoe.activation: gate row 2c, up row 2c + 1, the
same clamps, alpha 1.702, limit 7, the + 1 on u). What differs is precision only, against the
float64 reference of the rel_err column: the peer dequantizes the weights exactly (an E2M1
value times 2**e is a bf16; an all-zero block's code 0 reads as 0, not 2**-127), accumulates
in float32, applies the activation to the float32 accumulator plus bias, stores h in bf16,
and in GEMM2 rounds each slot's weighted output to bf16 before the float32 sum of the k slots;
the router weights stay float32.

For silu (silu(g) * u on the halves [gate | up]) there is no + 1 to turn off: the peer runs
swiglu with alpha 1 and no clamp on (g, u - 1), with w13's rows (and scales) interleaved from
halves into pairs and the - 1 folded into GEMM1's bias (a float32 [E, 2I] read the layer
itself would not need). silu(g) * ((u - 1) + 1) = silu(g) * u, up to one float32 rounding of
u - 1. (vLLM runs silu on triton_kernels unfused instead: GEMM1, a separate activation, GEMM2.)

Routing. The bench's routing is fusedmoe's plain TopKRouter: softmax over all E, top-k,
renormalize; the peer takes the top-k of the raw logits and a softmax over those k: the same
weights (renormalized softmax = softmax of the k picked), and the same ids unless two logits
round to the same softmax value at the k-th place (float32 ties: triton_kernels then keeps the
lower expert index, torch.topk promises no order). `TritonKernelsMoE.routing_mismatch` compares the
peer's ids with the row's topk_ids once per row (untimed) and the bench notes any difference;
the rel_err column shows its effect.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch

from fusedmoe.activation import OAI_ALPHA, OAI_LIMIT, MoEActivation
from fusedmoe.tools.bench.contenders import Contender
from fusedmoe.tools.bench.inputs import ExpertSet, RoutingInputs

__all__ = [
    "PEERS",
    "TritonKernelsMoE",
    "interleave_halves",
    "k_major_mxfp4",
    "peer_contenders",
    "refusal_reason",
    "swiglu_pairs",
]

PEERS = ("triton_kernels",)
#: the scheme and activations the triton_kernels peer runs
TK_SCHEME = "mxfp4_w4a16"
TK_ACTIVATIONS = (MoEActivation.SWIGLUOAI, MoEActivation.SILU)
#: the Hopper kernel reads the scales of BLOCK_K = 128 values (4 groups of 32) unmasked
TK_SCALE_GROUP_MULTIPLE = 4
#: warps of the Hopper kernel with a HopperMXScaleLayout of this many warps (they must agree)
TK_NUM_WARPS = 8
#: on Hopper, its MXFP4 GEMM takes block_n = 256 where N > 128; a smaller N has no such block
TK_MIN_N = 129
#: vLLM keeps the Hopper layouts off (strided weights) below this torch; so does this adapter
TK_SWIZZLE_MIN_TORCH = (2, 8, 1)
TK_HINT = (
    "put OpenAI's triton_kernels (its matmul_ogs / routing API, as in .vendor/triton_kernels) "
    "on the path, e.g. PYTHONPATH=.vendor"
)


# ---------------------------------------------------------------------------------------------
# pure-torch layout helpers (no triton)
# ---------------------------------------------------------------------------------------------


def k_major_mxfp4(
    w: torch.Tensor, scale: torch.Tensor, *, group_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our MXFP4 expert weight in the orientation matmul_ogs reads, w [E, K, N]:

    w      uint8 [E, N, K/2], two E2M1 codes per byte along K (even k in the low nibble)
           -> uint8 [E, K/2, N], a transposed view (stride 1 on the K/2 axis: still packed
           along K, the same bytes)
    scale  uint8 E8M0 [E, N, K/32] -> uint8 [E, G, N], G = K/32 rounded up to a multiple of
           group_multiple with code 0 (2**-127: the kernel reads whole blocks of groups)

    No value moves: value (k, n) of expert e is in byte [e, k // 2, n], nibble k % 2, with the
    scale [e, k // 32, n], as it was in byte [e, n, k // 2] and scale [e, n, k // 32]."""
    if w.dim() != 3 or scale.dim() != 3 or w.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(
            f"expected uint8 [E, N, K/2] codes and uint8 [E, N, K/32] scales, got "
            f"{w.dtype} {tuple(w.shape)} and {scale.dtype} {tuple(scale.shape)}"
        )
    if tuple(scale.shape[:2]) != tuple(w.shape[:2]) or scale.shape[2] * 16 != w.shape[2]:
        raise ValueError(f"scale {tuple(scale.shape)} does not fit w {tuple(w.shape)}")
    pad = -scale.shape[2] % group_multiple
    if pad:
        scale = torch.nn.functional.pad(scale, (0, pad))  # code 0
    return w.transpose(1, 2), scale.transpose(1, 2)


def interleave_halves(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Rows [gate_0 .. gate_{I-1} | up_0 .. up_{I-1}] along `dim` -> [gate_0, up_0, gate_1,
    up_1, ...] (silu's w13 halves into the pairs the peer's fused activation reads)."""
    dim = dim % t.dim()
    n = t.shape[dim]
    if n % 2:
        raise ValueError(f"interleave_halves needs an even size, got {n} along dim {dim}")
    halves = t.unflatten(dim, (2, n // 2))  # [..., 2, I, ...]
    return halves.transpose(dim, dim + 1).flatten(dim, dim + 1).contiguous()


def swiglu_pairs(h: torch.Tensor, alpha: float, limit: float | None) -> torch.Tensor:
    """The function of triton_kernels' fused swiglu, in torch (float32 or wider): h [..., N]
    read as pairs (gate = even column, up = odd column) -> [..., N/2]. Written from the
    kernel's definition (module docstring), for the tests and for reading."""
    h = h.to(torch.promote_types(h.dtype, torch.float32))
    g, u = h[..., 0::2], h[..., 1::2]
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    s = g * torch.sigmoid(alpha * g)
    return s * u + s


def gemm1_bias(
    activation: MoEActivation,
    w13_bias: torch.Tensor | None,
    num_experts: int,
    n: int,
    device: torch.device,
) -> torch.Tensor | None:
    """GEMM1's float32 bias [E, N] for the peer: ours as it is (swigluoai), or for silu the
    halves interleaved into pairs with 1 taken from each up entry (None: no bias)."""
    if activation is MoEActivation.SWIGLUOAI:
        return None if w13_bias is None else w13_bias.float().contiguous()
    if w13_bias is None:
        bias = torch.zeros(num_experts, n, dtype=torch.float32, device=device)
    else:
        bias = interleave_halves(w13_bias.float(), dim=1)
    bias[:, 1::2] -= 1.0
    return bias


# ---------------------------------------------------------------------------------------------
# whether a peer runs a row
# ---------------------------------------------------------------------------------------------


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def import_triton_kernels() -> types.SimpleNamespace:
    """What the adapter calls of triton_kernels (ImportError, AttributeError where it is absent
    or of another API generation)."""
    from triton_kernels.matmul_ogs import (
        FlexCtx,
        FnSpecs,
        FusedActivation,
        PrecisionConfig,
        matmul_ogs,
    )
    from triton_kernels.matmul_ogs_details.opt_flags import update_opt_flags_constraints
    from triton_kernels.numerics import InFlexData
    from triton_kernels.routing import routing
    from triton_kernels.swiglu import swiglu_fn
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details.layout import (
        HopperMXScaleLayout,
        HopperMXValueLayout,
        StridedLayout,
    )
    from triton_kernels.topk import topk

    return types.SimpleNamespace(
        FP4=FP4,
        FlexCtx=FlexCtx,
        FnSpecs=FnSpecs,
        FusedActivation=FusedActivation,
        HopperMXScaleLayout=HopperMXScaleLayout,
        HopperMXValueLayout=HopperMXValueLayout,
        InFlexData=InFlexData,
        PrecisionConfig=PrecisionConfig,
        StridedLayout=StridedLayout,
        convert_layout=convert_layout,
        matmul_ogs=matmul_ogs,
        routing=routing,
        swiglu_fn=swiglu_fn,
        topk=topk,
        update_opt_flags_constraints=update_opt_flags_constraints,
        wrap_torch_tensor=wrap_torch_tensor,
    )


def library_refusal() -> str | None:
    """None when triton_kernels imports with the API the adapter calls, else why not."""
    try:
        import_triton_kernels()
    except Exception as exc:  # ImportError, or an AttributeError of another API generation
        return f"triton_kernels is not importable ({type(exc).__name__}: {exc}); {TK_HINT}"
    return None


def refusal_reason(
    name: str,
    *,
    quant: str,
    activation: str,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    act_dtype: torch.dtype,
    device: torch.device,
    quant_config=None,
) -> str | None:
    """Why peer `name` does not run a (shape, scheme) row, or None when it does. Checks what
    the row is first (scheme, activation, dtype, top_k), then the device, then the Hopper
    kernel's sizes, and last, so that the library loads only where it could run, whether
    triton_kernels imports."""
    if name not in PEERS:
        return f"unknown peer {name!r}; expected one of {list(PEERS)}"
    if quant != TK_SCHEME:
        return f"runs {TK_SCHEME} (MXFP4 weights, bf16 activations) only; this row is {quant}"
    act = MoEActivation.parse(activation)
    if act not in TK_ACTIVATIONS:
        names = ", ".join(a.value for a in TK_ACTIVATIONS)
        return (
            f"fuses a swiglu (gate, up + 1) that gives {names} only; this row's activation is "
            f"{act.value}"
        )
    if (
        act is MoEActivation.SILU
        and quant_config is not None
        and (quant_config.gemm1_clamp_limit is not None or quant_config.gemm1_alpha is not None)
    ):
        return "silu with a clamp limit or alpha has no swiglu equivalent here"
    if act_dtype != torch.bfloat16:
        return f"its Hopper MXFP4 GEMM takes bf16 activations; this row's are {act_dtype}"
    if top_k < 1 or top_k & (top_k - 1):
        return f"its routing kernels need a power-of-two top_k; this shape's is {top_k}"
    if device.type != "cuda":
        return f"runs on a CUDA GPU only; this row is on {device.type}"
    major, minor = _cuda_capability(device)
    if major != 9:
        return (
            f"the adapter implements triton_kernels' Hopper (sm90) MXFP4 layouts only; this GPU "
            f"is sm{major}{minor}"
        )
    if min(hidden_size, 2 * intermediate_size) < TK_MIN_N:
        return (
            f"its Hopper MXFP4 GEMMs need N > {TK_MIN_N - 1} (block_n 256) in both GEMMs; "
            f"this shape has H = {hidden_size}, 2I = {2 * intermediate_size}"
        )
    return library_refusal()


# ---------------------------------------------------------------------------------------------
# the adapter
# ---------------------------------------------------------------------------------------------


def _swizzle_allowed() -> bool:
    return torch.torch_version.TorchVersion(torch.__version__) >= TK_SWIZZLE_MIN_TORCH


class TritonKernelsMoE:
    """OpenAI triton_kernels' MXFP4 MoE on one row's experts (module docstring: how).

    Built once per shape and scheme (the weight conversion); called per routing with
    RoutingInputs -> out [M, H] bf16, routing included."""

    def __init__(
        self,
        experts: ExpertSet,
        *,
        activation: str,
        top_k: int,
        tk: types.SimpleNamespace | None = None,
    ) -> None:
        self.tk = tk = tk if tk is not None else import_triton_kernels()
        qc = experts.quant_config
        if qc is None or qc.scheme != TK_SCHEME:
            raise ValueError(f"TritonKernelsMoE needs {TK_SCHEME} experts")
        self.activation = MoEActivation.parse(activation)
        self.top_k = top_k
        w13, s13 = experts.w13, qc.w1.scale
        num_experts, n = w13.shape[0], w13.shape[1]
        if self.activation is MoEActivation.SILU:
            w13, s13 = interleave_halves(w13, dim=1), interleave_halves(s13, dim=1)
            alpha, limit = 1.0, None
        else:
            alpha = OAI_ALPHA if qc.gemm1_alpha is None else qc.gemm1_alpha
            limit = OAI_LIMIT if qc.gemm1_clamp_limit is None else qc.gemm1_clamp_limit
        self.alpha, self.limit = alpha, limit
        self.swizzled = _swizzle_allowed()
        tk.update_opt_flags_constraints({"split_k": 1})
        self.w13, self.pc13 = self._convert(w13, s13)
        self.w2, self.pc2 = self._convert(experts.w2, qc.w2.scale)
        self.b13 = gemm1_bias(self.activation, experts.w13_bias, num_experts, n, w13.device)
        self.b2 = None if experts.w2_bias is None else experts.w2_bias.float().contiguous()
        self.act = tk.FusedActivation(
            tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit")), (alpha, limit), 2
        )

    def _convert(self, w: torch.Tensor, scale: torch.Tensor):
        tk = self.tk
        values, scales = k_major_mxfp4(w, scale, group_multiple=TK_SCALE_GROUP_MULTIPLE)
        if self.swizzled:
            value_layout, value_opts = tk.HopperMXValueLayout, {"mx_axis": 1}
            scale_layout = tk.HopperMXScaleLayout
            scale_opts = {"mx_axis": 1, "num_warps": TK_NUM_WARPS}
        else:
            value_layout, value_opts, scale_layout, scale_opts = tk.StridedLayout, {}, None, {}
        w_tk = tk.convert_layout(tk.wrap_torch_tensor(values, dtype=tk.FP4), value_layout,
                                 **value_opts)  # fmt: skip
        s_tk = tk.wrap_torch_tensor(scales)
        if scale_layout is not None:
            s_tk = tk.convert_layout(s_tk, scale_layout, **scale_opts)
        precision = tk.PrecisionConfig(
            weight_scale=s_tk, flex_ctx=tk.FlexCtx(rhs_data=tk.InFlexData())
        )
        return w_tk, precision

    @property
    def note(self) -> str:
        act = (
            f"swiglu(alpha {self.alpha:g}, limit {self.limit:g})"
            if self.activation is MoEActivation.SWIGLUOAI
            else "silu as swiglu(alpha 1, no clamp) on (gate, up - 1), w13 rows interleaved, "
            "the - 1 in GEMM1's bias"
        )
        layout = "Hopper-swizzled" if self.swizzled else "strided (torch < 2.8.1)"
        return (
            f"OpenAI triton_kernels matmul_ogs: its routing from the logits (timed), GEMM1 "
            f"gather + bias + {act}, GEMM2 bias + router weights + scatter-sum of the k slots; "
            f"MXFP4 weights {layout}, converted once per shape (untimed), split_k 1"
        )

    def __call__(self, r: RoutingInputs) -> torch.Tensor:
        tk = self.tk
        routing, gather, scatter = tk.routing(r.router_logits, self.top_k)
        h = tk.matmul_ogs(
            r.x, self.w13, self.b13, routing, gather_indx=gather, precision_config=self.pc13,
            fused_activation=self.act,
        )  # fmt: skip
        return tk.matmul_ogs(
            h, self.w2, self.b2, routing, scatter_indx=scatter, precision_config=self.pc2,
            gammas=routing.gate_scal,
        )  # fmt: skip

    def routing_mismatch(self, r: RoutingInputs) -> str | None:
        """None when the peer's top-k of r.router_logits picks r.topk_ids' experts for every
        token (weights within 1e-5), else what differs (untimed: once per row)."""
        weights, ids, _ = self.tk.topk(r.router_logits, self.top_k, apply_softmax=True)
        ours_ids, order = torch.sort(r.topk_ids.long(), dim=1)
        theirs_ids, their_order = torch.sort(ids.long(), dim=1)
        differ = (ours_ids != theirs_ids).any(dim=1)
        count = int(differ.sum())
        if count:
            return (
                f"its routing picked other experts than topk_ids for {count} of "
                f"{r.topk_ids.shape[0]} tokens (the expected cause: float32 ties at the k-th "
                "place); rel_err there compares two routings"
            )
        ours_w = torch.gather(r.topk_weights.float(), 1, order)
        theirs_w = torch.gather(weights.float(), 1, their_order)
        gap = float((ours_w - theirs_w).abs().max()) if ours_w.numel() else 0.0
        if gap > 1e-5:
            return f"its routing weights differ from topk_weights by up to {gap:.1e}"
        return None


def peer_contenders(
    names: Sequence[str],
    experts: ExpertSet,
    *,
    quant: str,
    activation: str,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    act_dtype: torch.dtype,
    device: torch.device,
) -> tuple[list[Contender], dict[str, str]]:
    """The peers of one (shape, scheme) that run, as contenders, and why the others do not
    (a failed weight conversion included: a peer never ends the sweep)."""
    contenders: list[Contender] = []
    refused: dict[str, str] = {}
    for name in names:
        why = refusal_reason(
            name, quant=quant, activation=activation, top_k=top_k, hidden_size=hidden_size,
            intermediate_size=intermediate_size, act_dtype=act_dtype, device=device,
            quant_config=experts.quant_config,
        )  # fmt: skip
        if why is not None:
            refused[name] = why
            continue
        try:
            peer = TritonKernelsMoE(experts, activation=activation, top_k=top_k)
        except Exception as exc:
            refused[name] = f"its weight conversion failed: {exc!r:.300}"
            continue
        contenders.append(Contender(name, quant, peer, note=peer.note, check=peer.routing_mismatch))
    return contenders, refused
