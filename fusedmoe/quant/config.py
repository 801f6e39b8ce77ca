"""FusedMoEQuantConfig: how each operand of the MoE is quantized, and the named schemes.

    operand  what                         layout of its scale (fusedmoe.quant.keys)
    a1       input of GEMM1  [M, H]       set by prepare (static scale given, or dynamic)
    w1       w13             [E, N, H]    scale tensors stored with the weights
    a2       input of GEMM2  [M*k, I]     quantized between the GEMMs (static or dynamic)
    w2       w2              [E, H, I]

Schemes (weights x activations), each a name for `quantize_experts` and `FusedMoE.quantize_`:
    fp8_tensor    FP8 per-expert tensor scale    x FP8 per-tensor (static a1/a2, or dynamic)
                                                   or per-token (per_token_activations=True)
    fp8_channel   FP8 per-channel [E, N]         x FP8 dynamic per-token [M, 1]
    fp8_block     FP8 128x128 blocks             x FP8 dynamic 1x128 groups (UE8M0 optional)
    mxfp8         MXFP8 1x32 E8M0                x MXFP8
    mxfp4_w4a8    MXFP4 (E2M1 packed) 1x32 E8M0  x FP8 dynamic 1x128 groups
    mxfp4_w4a16   MXFP4                          x unquantized (bf16/fp16/fp32)
    nvfp4         NVFP4 1x16 e4m3 + global       x NVFP4 dynamic
    nvfp4_w4a16   NVFP4                          x unquantized
    int8          INT8 per-channel               x INT8 dynamic per-token
    int4_w4a16    INT4 1 x g groups (g 32, 64, 128; 128 by default), symmetric or with zero
                  points (GPTQ / AWQ)            x unquantized
    int8_w8a16    INT8 per-channel, or 1 x g groups  x unquantized

The weight-only schemes (*_w4a16, *_w8a16) leave the activations in the layer's dtype: the
weights are dequantized inside the GEMM. INT4 / INT8 weight-only scales may be float32, float16
or bfloat16 (checkpoints store float16); the group size follows from the scale's shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fusedmoe.activation import ActivationParams
from fusedmoe.quant import keys
from fusedmoe.quant.formats import FP8_DTYPE
from fusedmoe.quant.keys import ElementFormat, QuantKey, ScaleFormat, ScaleLayout
from fusedmoe.quant.reference import Quantized, quantize

SCHEMES = (
    "fp8_tensor",
    "fp8_channel",
    "fp8_block",
    "mxfp8",
    "mxfp4_w4a8",
    "mxfp4_w4a16",
    "nvfp4",
    "nvfp4_w4a16",
    "int8",
    "int4_w4a16",
    "int8_w8a16",
)

#: scheme -> (weight key, activation key); None activation key: activations stay unquantized
_SCHEME_KEYS: dict[str, tuple[QuantKey, QuantKey | None]] = {
    "fp8_tensor": (keys.FP8_TENSOR, keys.FP8_DYNAMIC_TENSOR),
    "fp8_channel": (keys.FP8_CHANNEL, keys.FP8_DYNAMIC_TOKEN),
    "fp8_block": (keys.FP8_BLOCK128, keys.FP8_DYNAMIC_GROUP128),
    "mxfp8": (keys.MXFP8, keys.MXFP8),
    "mxfp4_w4a8": (keys.MXFP4, keys.FP8_DYNAMIC_GROUP128),
    "mxfp4_w4a16": (keys.MXFP4, None),
    "nvfp4": (keys.NVFP4, keys.NVFP4),
    "nvfp4_w4a16": (keys.NVFP4, None),
    "int8": (keys.INT8_CHANNEL, keys.INT8_DYNAMIC_TOKEN),
    "int4_w4a16": (keys.INT4_GROUP128, None),
    "int8_w8a16": (keys.INT8_CHANNEL, None),
}
#: the weight-only integer schemes: group size and zero points chosen per config
INT_WEIGHT_ONLY = {"int4_w4a16": ElementFormat.INT4, "int8_w8a16": ElementFormat.INT8}
_INT_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_STORAGE_DTYPE = {
    ElementFormat.FP8: FP8_DTYPE,
    ElementFormat.INT8: torch.int8,
    ElementFormat.FP4: torch.uint8,
    ElementFormat.INT4: torch.uint8,
}


def weight_key(scheme: str, group_size: int | str | None = "default") -> QuantKey:
    """The scheme's weight key; for int4_w4a16 / int8_w8a16, of the given group size (None:
    int8 per channel; "default": 128 for int4, per channel for int8)."""
    key = _SCHEME_KEYS[check_scheme(scheme)][0]
    if scheme in INT_WEIGHT_ONLY and group_size != "default":
        return keys.int_weight_key(INT_WEIGHT_ONLY[scheme], group_size)
    if group_size not in ("default", None) and scheme not in INT_WEIGHT_ONLY:
        raise ValueError(f"group_size applies to int4_w4a16 / int8_w8a16, not {scheme}")
    return key


def check_scheme(scheme: object) -> str:
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
    if scheme not in _SCHEME_KEYS:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {list(SCHEMES)}")
    return scheme


def check_inference_only(
    quant_config: FusedMoEQuantConfig | None,
    expert_tensors: Iterable[torch.Tensor | None],
    x: torch.Tensor,
) -> None:
    """Refuse a recorded forward that quantized experts cannot differentiate: no scheme has a
    backward through its quantized weights, and a scheme that quantizes the activations cuts
    the input's gradient (rounding has none). What remains runs on the reference backend, which
    differentiates through the dequantized weights: frozen experts of a weight-only scheme with
    gradients for the input and the router (adapters trained around the layer), or any scheme
    with a gradient for the router logits alone."""
    if quant_config is None or not torch.is_grad_enabled():
        return
    scheme = quant_config.scheme
    if any(t is not None and t.requires_grad for t in expert_tensors):
        why = "a weight or bias of the experts requires grad"
    elif x.requires_grad and quant_config.a1.quantized:
        why = f"the input requires grad, and {scheme} quantizes it (rounding has no gradient)"
    else:
        return
    raise ValueError(
        f"{scheme}-quantized experts are inference only: {why}. FP8 and the other quantized "
        "schemes (MXFP8, MXFP4, NVFP4, INT8) have no backward. Run under torch.no_grad() or "
        "torch.inference_mode(), freeze the experts of a weight-only scheme to train what lies "
        "around them, or train an unquantized (bf16 / fp16 / fp32) layer and quantize it "
        "afterwards (quantize_)."
    )


@dataclass(frozen=True)
class OperandQuant:
    """How one operand is quantized. key None: the operand stays in the activation dtype."""

    key: QuantKey | None = None
    scale: torch.Tensor | None = None  # weights: always; activations: static keys only
    global_scale: torch.Tensor | None = None  # NVFP4 weights: float32 [E]
    column_major_scales: bool = False  # activations with a GROUP layout
    zero_point: torch.Tensor | None = None  # INT4 weights with zero points: uint8 [E, N, K/g]

    @property
    def quantized(self) -> bool:
        return self.key is not None


#: the schemes whose configs take fast_accum (FusedMoEQuantConfig.fast_accum)
FAST_ACCUM_SCHEMES = ("fp8_block",)


@dataclass(frozen=True)
class FusedMoEQuantConfig:
    scheme: str
    a1: OperandQuant = field(default_factory=OperandQuant)
    a2: OperandQuant = field(default_factory=OperandQuant)
    w1: OperandQuant = field(default_factory=OperandQuant)
    w2: OperandQuant = field(default_factory=OperandQuant)
    gemm1_alpha: float | None = None
    gemm1_beta: float | None = None
    gemm1_clamp_limit: float | None = None
    #: fp8_block (FAST_ACCUM_SCHEMES): the FP8 GEMMs may sum all of K in the tensor cores'
    #: accumulator, rescaled from one 128-wide K block's scale to the next, where that is
    #: faster, instead of promoting each block's product to float32 (what DeepGEMM does). A
    #: permission, like torch._scaled_mm(use_fast_accum=True): GEMMs without such a path (the
    #: Triton GEMMs, the DeepGEMM library) promote as before. Taken by the deep_gemm backend's
    #: wgmma engine from deep_gemm.FAST_ACCUM_MIN_SLOTS_PER_EXPERT. The layer's error against
    #: the exact quantized computation is 2-3x (docs/performance.md, "Fast accumulation");
    #: against the unquantized layer it did not move in the measured presets.
    fast_accum: bool = False

    @property
    def rows_independent(self) -> bool:
        """Whether each token's quantized activations depend on that token alone: False where a
        scale is taken over the whole batch at run time (dynamic per-tensor FP8, NVFP4's global
        scale), so that other tokens in the batch change a token's result."""
        for operand in (self.a1, self.a2):
            key = operand.key
            if key is None or key.static:
                continue
            if key.layout is ScaleLayout.TENSOR or key.scale_format is ScaleFormat.E4M3_GLOBAL:
                return False
        return True

    def cache_key(self) -> tuple:
        """What identifies this config for a cache of kernels: its scheme, keys and parameters,
        and its tensors by identity (a holder of the key must hold the config too, so that
        those ids are not reused)."""
        tensors = (
            t
            for operand in (self.a1, self.a2, self.w1, self.w2)
            for t in (operand.scale, operand.global_scale, operand.zero_point)
        )
        return (
            self.scheme,
            *((o.key, o.column_major_scales) for o in (self.a1, self.a2, self.w1, self.w2)),
            self.gemm1_alpha, self.gemm1_beta, self.gemm1_clamp_limit, self.fast_accum,
            *(None if t is None else id(t) for t in tensors),
        )  # fmt: skip

    @property
    def weight_only(self) -> bool:
        """The weights are quantized and the activations are not (dequantized in the GEMM)."""
        return self.w1.quantized and not self.a1.quantized

    @property
    def w1_scale(self) -> torch.Tensor | None:
        return self.w1.scale

    @property
    def w2_scale(self) -> torch.Tensor | None:
        return self.w2.scale

    @property
    def a1_scale(self) -> torch.Tensor | None:
        return self.a1.scale

    @property
    def a2_scale(self) -> torch.Tensor | None:
        return self.a2.scale

    @property
    def block_shape(self) -> tuple[int, int] | None:
        return self.w1.key.group if self.w1.key is not None else None

    def activation_params(self) -> ActivationParams | None:
        """gemm1_alpha / beta / clamp_limit as activation parameters (None when all unset)."""
        if self.gemm1_alpha is None and self.gemm1_beta is None and self.gemm1_clamp_limit is None:
            return None
        return ActivationParams(self.gemm1_alpha, self.gemm1_beta, self.gemm1_clamp_limit)

    def __repr__(self) -> str:
        a1 = self.a1.key.name if self.a1.key else "unquantized"
        fast = ", fast_accum" if self.fast_accum else ""
        return f"FusedMoEQuantConfig({self.scheme}: w {self.w1.key.name}, a {a1}{fast})"

    def hidden_size(self, w13: torch.Tensor) -> int:
        """The logical hidden size of w13 (FP4 stores two values per byte)."""
        return logical_k(w13, self.w1.key)

    def check_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """The quantized weights and their scales fit each other and this config."""
        for name, w, operand in (("w13", w13, self.w1), ("w2", w2, self.w2)):
            check_quantized_weight(name, w, operand, self.scheme in INT_WEIGHT_ONLY)


def logical_k(w: torch.Tensor, key: QuantKey | None) -> int:
    k = w.shape[-1]
    return 2 * k if key is not None and key.packed else k


def expected_scale_shape(key: QuantKey, e: int, n: int, k: int) -> tuple[int, ...]:
    if key.layout is ScaleLayout.TENSOR:
        return (e,)
    if key.layout is ScaleLayout.ROW:
        return (e, n)
    bn, bk = key.group
    return (e, math.ceil(n / bn), math.ceil(k / bk))


def check_quantized_weight(
    name: str, w: torch.Tensor, operand: OperandQuant, int_weight_only: bool = False
) -> None:
    """int_weight_only: an int4_w4a16 / int8_w8a16 weight, whose scales may be float32, float16
    or bfloat16 (checkpoints store float16); every other scheme's scales are as quantize makes
    them."""
    key = operand.key
    expected_dtype = _STORAGE_DTYPE[key.element]
    if w.dtype != expected_dtype:
        raise TypeError(f"{name}: {key.name} weights are stored as {expected_dtype}, got {w.dtype}")
    e, n, k = w.shape[0], w.shape[1], logical_k(w, key)
    if key.exact_groups and k % key.group[1] != 0:
        raise ValueError(f"{name}: K = {k} is not a multiple of the {key.group[1]}-wide groups")
    scale = operand.scale
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{name}: {key.name} weights need a scale tensor")
    shape = expected_scale_shape(key, e, n, k)
    if tuple(scale.shape) != shape:
        raise ValueError(
            f"{name} scale must have shape {shape} for {key.name}, got {tuple(scale.shape)}"
        )
    scale_dtype = {ScaleFormat.E8M0: torch.uint8, ScaleFormat.E4M3_GLOBAL: FP8_DTYPE}.get(
        key.scale_format, torch.float32
    )
    int_weight_only = int_weight_only or key.element is ElementFormat.INT4
    if int_weight_only and scale.dtype not in _INT_SCALE_DTYPES:
        raise TypeError(
            f"{name} scale must be float32, float16 or bfloat16 for {key.name}, got {scale.dtype}"
        )
    if not int_weight_only and scale.dtype != scale_dtype:
        raise TypeError(f"{name} scale must be {scale_dtype} for {key.name}, got {scale.dtype}")
    if scale.device != w.device:
        raise ValueError(f"{name} scale is on {scale.device}, the weights on {w.device}")
    zero = operand.zero_point
    if zero is not None:
        if key.element is not ElementFormat.INT4:
            raise ValueError(f"{name}: only int4 weights take zero points, not {key.name}")
        if not isinstance(zero, torch.Tensor) or zero.dtype != torch.uint8:
            got = zero.dtype if isinstance(zero, torch.Tensor) else type(zero).__name__
            raise TypeError(f"{name} zero points must be a uint8 tensor, got {got}")
        if tuple(zero.shape) != shape or zero.device != w.device:
            raise ValueError(
                f"{name} zero points must have the scale's shape {shape} on {w.device}, got "
                f"{tuple(zero.shape)} on {zero.device}"
            )
    if key.scale_format is ScaleFormat.E4M3_GLOBAL:
        g = operand.global_scale
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != (e,):
            got = None if g is None else tuple(g.shape)
            raise ValueError(f"{name}: NVFP4 weights need a float32 global scale [{e}], got {got}")


def make_quant_config(
    scheme: str,
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    w1_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    per_token_activations: bool = False,
    column_major_scales: bool = False,
    use_ue8m0: bool = False,
    gemm1_alpha: float | None = None,
    gemm1_beta: float | None = None,
    gemm1_clamp_limit: float | None = None,
    fast_accum: bool = False,
    w1_zero_point: torch.Tensor | None = None,
    w2_zero_point: torch.Tensor | None = None,
    group_size: int | None = None,
) -> FusedMoEQuantConfig:
    """The config of `scheme` for weights already quantized (scales as quantize_experts makes).

    int4_w4a16 / int8_w8a16: group_size is the scales' group along K (32, 64 or 128; int8 may
    omit it for per-channel [E, N] scales); zero points (int4) are uint8 of the scales' shape."""
    weight_key, act_key = _SCHEME_KEYS[check_scheme(scheme)]
    if scheme in INT_WEIGHT_ONLY:
        weight_key = _int_key(scheme, group_size, w1_scale)
    elif group_size is not None:
        raise ValueError(f"group_size applies to int4_w4a16 / int8_w8a16, not {scheme}")
    if (w1_zero_point is not None or w2_zero_point is not None) and scheme != "int4_w4a16":
        raise ValueError(f"zero points apply to int4_w4a16, not {scheme}")
    for name, zero in (("w1_zero_point", w1_zero_point), ("w2_zero_point", w2_zero_point)):
        # checked once here (a host read), as the static scales are: int4 codes lie in [0, 16)
        usable = isinstance(zero, torch.Tensor) and zero.dtype == torch.uint8 and zero.numel()
        if usable and int(zero.max()) > 15:
            raise ValueError(f"{name}: int4 zero points lie in [0, 15], got {int(zero.max())}")
    if not isinstance(fast_accum, bool):
        raise TypeError(f"fast_accum must be a bool, got {type(fast_accum).__name__}")
    if fast_accum and scheme not in FAST_ACCUM_SCHEMES:
        raise ValueError(f"fast_accum applies to fp8_block (FP8 128-block GEMMs), not {scheme}")
    static = a1_scale is not None or a2_scale is not None
    if static:
        if scheme != "fp8_tensor" or a1_scale is None or a2_scale is None:
            raise ValueError(
                "static activation scales: fp8_tensor only, with both a1_scale and a2_scale"
            )
        if per_token_activations:
            raise ValueError("per_token_activations and static scales exclude each other")
        act_key = keys.FP8_STATIC_TENSOR
    if per_token_activations:
        if scheme != "fp8_tensor":
            raise ValueError("per_token_activations applies to fp8_tensor (fp8_channel has them)")
        act_key = keys.FP8_DYNAMIC_TOKEN
    if use_ue8m0:
        if act_key != keys.FP8_DYNAMIC_GROUP128:
            raise ValueError(
                "use_ue8m0 applies to the 1x128 group scales of fp8_block / mxfp4_w4a8"
            )
        act_key = keys.FP8_DYNAMIC_GROUP128_UE8M0
    if column_major_scales and (act_key is None or act_key.layout is not ScaleLayout.GROUP):
        raise ValueError("column_major_scales applies to group-scaled activations")
    for name, value in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if value is not None and (not isinstance(value, torch.Tensor) or value.numel() != 1):
            raise ValueError(f"{name} must be a one-element float32 tensor")
        # checked once here (a host read): quantize does not read device scales per call
        if value is not None and not float(value.reshape(())) > 0:
            raise ValueError(f"{name} must be positive, got {float(value.reshape(()))}")

    def act(scale):
        return OperandQuant(act_key, scale, column_major_scales=column_major_scales)

    return FusedMoEQuantConfig(
        scheme=scheme,
        a1=act(a1_scale),
        a2=act(a2_scale),
        w1=OperandQuant(weight_key, w1_scale, w1_global_scale, zero_point=w1_zero_point),
        w2=OperandQuant(weight_key, w2_scale, w2_global_scale, zero_point=w2_zero_point),
        gemm1_alpha=gemm1_alpha,
        gemm1_beta=gemm1_beta,
        gemm1_clamp_limit=gemm1_clamp_limit,
        fast_accum=fast_accum,
    )


def _int_key(scheme: str, group_size, w1_scale) -> QuantKey:
    """The int4 / int8 weight-only key: group_size along K, or (int8, per-channel [E, N]
    scales) none."""
    if group_size is None and isinstance(w1_scale, torch.Tensor) and w1_scale.dim() == 3:
        raise ValueError(f"{scheme}: [E, N, K / g] group scales need group_size=g")
    if group_size is None and scheme == "int4_w4a16":
        raise ValueError(f"int4_w4a16 needs group_size, one of {keys.WEIGHT_ONLY_GROUPS}")
    return keys.int_weight_key(INT_WEIGHT_ONLY[scheme], group_size)


#: elements of w quantized at once: the spec holds a few float32 copies of what it quantizes,
#: so a whole DeepSeek-V3 layer (3.8e9 elements per weight) goes a few experts at a time
_CHUNK_ELEMENTS = 1 << 28


def quantize_weight(
    w: torch.Tensor,
    scheme: str,
    what: str = "w",
    *,
    group_size: int | str | None = "default",
    zero_points: bool = False,
):
    """One expert weight [E, N, K] -> Quantized in the scheme's weight format, a few experts at
    a time (every weight scale layout is per expert, so the chunks concatenate along E).
    group_size / zero_points: int4_w4a16 / int8_w8a16 (see weight_key; zero points int4)."""
    key = weight_key(scheme, group_size)
    step = max(1, _CHUNK_ELEMENTS // max(w[0].numel(), 1)) if w.dim() == 3 else len(w)
    if w.dim() != 3 or w.shape[0] <= step:
        return quantize(w, key, what=what, zero_point=zero_points)
    parts = [
        quantize(w[e : e + step], key, what=what, zero_point=zero_points)
        for e in range(0, w.shape[0], step)
    ]

    def cat(name):
        first = getattr(parts[0], name)
        return None if first is None else torch.cat([getattr(p, name) for p in parts])

    return Quantized(
        q=cat("q"), scale=cat("scale"), global_scale=cat("global_scale"),
        zero_point=cat("zero_point"),
    )  # fmt: skip


def first_nonfinite_expert(w: torch.Tensor) -> tuple[int, str] | None:
    """(the first expert e of w [E, ...] holding a NaN or an Inf, "NaN" or "Inf"), or None.

    Reads a value on the host (a sync): for one-time steps such as quantization. Per-expert
    max and min (NaN propagates through both) rather than isfinite(w): no copy the size of w.
    """
    if w.numel() == 0:
        return None
    dims = tuple(range(1, w.dim()))
    high, low = w.detach().amax(dim=dims), w.detach().amin(dim=dims)  # [E]
    bad = (~(torch.isfinite(high) & torch.isfinite(low))).nonzero()
    if bad.numel() == 0:
        return None
    e = int(bad[0, 0])
    return e, "NaN" if bool(torch.isnan(high[e])) else "Inf"


def quantize_experts(
    w13: torch.Tensor, w2: torch.Tensor, scheme: str, **config_kwargs
) -> tuple[torch.Tensor, torch.Tensor, FusedMoEQuantConfig]:
    """Online quantization of float experts: (w13 [E, N, H], w2 [E, H, I]) -> (w13_q, w2_q, config).

    int4_w4a16 / int8_w8a16 take group_size= (32, 64 or 128; int8 per channel without it) and
    int4 zero_points=True (asymmetric, with uint8 zero points as GPTQ / AWQ store them).
    MXFP4 weights come back as uint8 [E, N, K/2] with uint8 E8M0 scales [E, N, K/32]; FP8
    block weights as float8_e4m3fn [E, N, K] with float32 scales [E, ceil(N/128), ceil(K/128)].
    `config_kwargs` go to make_quant_config (static a1/a2 scales, per-token, UE8M0, ...).
    Weights holding NaN or Inf are refused (ValueError naming the tensor and the expert).
    """
    check_scheme(scheme)
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if w.dim() != 3:
            raise ValueError(f"{name} must be a 3-D [E, N, K] tensor, got shape {tuple(w.shape)}")
        if not w.is_floating_point() or w.dtype == FP8_DTYPE:
            raise TypeError(f"{name} must be float weights to quantize, got {w.dtype}")
    for name, w in (("w13", w13), ("w2", w2)):
        bad = first_nonfinite_expert(w)
        if bad is not None:
            raise ValueError(
                f"{name} holds {bad[1]} (first in expert {bad[0]}); quantizing would poison its "
                "scales"
            )
    group_size = config_kwargs.pop("group_size", "default")
    zero_points = config_kwargs.pop("zero_points", False)
    if not isinstance(zero_points, bool):
        raise TypeError(f"zero_points must be a bool, got {type(zero_points).__name__}")
    if zero_points and scheme != "int4_w4a16":
        raise ValueError(f"zero_points applies to int4_w4a16, not {scheme}")
    key = weight_key(scheme, group_size)
    if scheme in INT_WEIGHT_ONLY:
        config_kwargs["group_size"] = None if key.group is None else key.group[1]
    q13 = quantize_weight(w13, scheme, "w13", group_size=group_size, zero_points=zero_points)
    q2 = quantize_weight(w2, scheme, "w2", group_size=group_size, zero_points=zero_points)
    config = make_quant_config(
        scheme,
        q13.scale,
        q2.scale,
        w1_global_scale=q13.global_scale,
        w2_global_scale=q2.global_scale,
        w1_zero_point=q13.zero_point,
        w2_zero_point=q2.zero_point,
        **config_kwargs,
    )
    return q13.q, q2.q, config
