"""Every quantization scheme through fused_experts: against the float64 unquantized experts
within a stated per-scheme bound, and tightly against the quantized pipeline computed by hand.

Per-scheme bounds (SCHEME_TOLERANCE below): fused_experts in bfloat16 with
quantize_experts(float32 experts) against experts_ref in float64 on the unquantized experts;
E = 8, k = 2, H = 256, I = 96, M = 33, tests/reference.random_experts (h std ~3), with and
without biases. Measured: the largest error over 60 seeds; the bound is about twice that.

    scheme        normalised max error         normalised RMS error
                  measured      bound          measured      bound
    (bf16, unquantized: max 8.3e-3, rms 1.1e-3)
    fp8_tensor    1.06e-1       2.0e-1         1.5e-2        3.0e-2
    fp8_channel   8.6e-2        1.7e-1         1.5e-2        3.0e-2
    fp8_block     9.1e-2        1.8e-1         1.5e-2        3.0e-2
    mxfp8         1.40e-1       2.5e-1         1.9e-2        4.0e-2
    mxfp4_w4a8    3.28e-1       6.0e-1         4.9e-2        1.0e-1
    mxfp4_w4a16   3.35e-1       6.0e-1         4.8e-2        1.0e-1
    nvfp4         3.43e-1       6.0e-1         5.4e-2        1.0e-1
    nvfp4_w4a16   2.55e-1       5.0e-1         3.8e-2        8.0e-2
    int8          3.1e-2        6.0e-2         4.7e-3        1.0e-2
    int4_w4a16 *  2.51e-1       5.0e-1         3.9e-2        8.0e-2
    int8_w8a16    1.7e-2        3.5e-2         2.9e-3        6.0e-3

    * group_size=32 (SCHEME_OPTIONS): I = 96 is no multiple of int4's default 128-wide group.

The options of the integer weight-only schemes (OPTION_TOLERANCE below), the same way; I = 128
where the group is 64 or 128 (96 is no multiple of them):

    int4_w4a16 zero points, g 32    2.03e-1   4.0e-1         3.3e-2        7.0e-2
    int4_w4a16 g 64 (I = 128)       3.50e-1   7.0e-1         4.7e-2        1.0e-1
    int4_w4a16 g 128 (I = 128)      3.10e-1   6.0e-1         5.0e-2        1.0e-1
    int4_w4a16 zero points, g 128   2.43e-1   5.0e-1         4.3e-2        9.0e-2
      (I = 128)
    int8_w8a16 g 32                 1.58e-2   3.2e-2         2.4e-3        5.0e-3
    int8_w8a16 g 128 (I = 128)      1.69e-2   3.5e-2         2.9e-3        6.0e-3

The max error is that of the worst of M * H outputs (e4m3 keeps 3 mantissa bits: a rounding
is up to 2**-4 relative; E2M1 keeps 1: up to 1/5, more for the small values of a block); the
RMS error is the typical one.

The pipeline by hand (float64 input, so that nothing but the quantization rounds): weights
dequantized here from their stored bits, x and the intermediate fake-quantized by the
per-element quantizers of tests/quant_reference.py, float64 GEMMs, the activation in float64
and quantized from float32, the weighted sum in float64. It must agree to float64 precision.
The weight-only schemes (WEIGHT_ONLY) quantize neither x nor the intermediate.

Legend: M tokens, H hidden, I intermediate, E experts, k top-k.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusedmoe import ActivationParams, fused_experts
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.quant import keys
from fusedmoe.quant.activation import quantize_input
from fusedmoe.quant.config import SCHEMES, make_quant_config, quantize_experts
from tests.helpers import assert_close
from tests.quant_reference import (
    dequant_fp8_block,
    dequant_fp8_tensor,
    dequant_int4,
    dequant_int8_groups,
    dequant_mxfp4,
    dequant_mxfp8,
    dequant_nvfp4,
    dequant_rows,
    f32,
    fake_quant_fp8_group,
    fake_quant_fp8_rows,
    fake_quant_fp8_tensor,
    fake_quant_int8_rows,
    fake_quant_mxfp8,
    fake_quant_nvfp4,
    pipeline_by_hand,
)
from tests.reference import experts_ref, random_experts

# scheme -> (normalised max error, normalised RMS error) bounds, bfloat16 vs float64 unquantized
SCHEME_TOLERANCE = {
    "fp8_tensor": (2.0e-1, 3.0e-2),
    "fp8_channel": (1.7e-1, 3.0e-2),
    "fp8_block": (1.8e-1, 3.0e-2),
    "mxfp8": (2.5e-1, 4.0e-2),
    "mxfp4_w4a8": (6.0e-1, 1.0e-1),
    "mxfp4_w4a16": (6.0e-1, 1.0e-1),
    "nvfp4": (6.0e-1, 1.0e-1),
    "nvfp4_w4a16": (5.0e-1, 8.0e-2),
    "int8": (6.0e-2, 1.0e-2),
    "int4_w4a16": (5.0e-1, 8.0e-2),
    "int8_w8a16": (3.5e-2, 6.0e-3),
}

E, K, H, I, M = 8, 2, 256, 96, 33

# quantize_experts options wherever a test here quantizes a scheme at E, H, I: int4's default
# group of 128 does not divide I = 96 (w2's K), its group of 32 does
SCHEME_OPTIONS = {"int4_w4a16": {"group_size": 32}}
#: the schemes that quantize the weights alone: the activations stay in the layer's dtype
WEIGHT_ONLY = ("mxfp4_w4a16", "nvfp4_w4a16", "int4_w4a16", "int8_w8a16")

# name -> (scheme, quantize_experts options, I, max bound, RMS bound): the options of the integer
# weight-only schemes; I = 128 where 96 is no multiple of the group
OPTION_TOLERANCE = {
    "int4_w4a16-zero_points-g32": ("int4_w4a16", {"group_size": 32, "zero_points": True}, 96,
                                   4.0e-1, 7.0e-2),
    "int4_w4a16-g64": ("int4_w4a16", {"group_size": 64}, 128, 7.0e-1, 1.0e-1),
    "int4_w4a16-g128": ("int4_w4a16", {}, 128, 6.0e-1, 1.0e-1),
    "int4_w4a16-zero_points-g128": ("int4_w4a16", {"group_size": 128, "zero_points": True}, 128,
                                    5.0e-1, 9.0e-2),
    "int8_w8a16-g32": ("int8_w8a16", {"group_size": 32}, 96, 3.2e-2, 5.0e-3),
    "int8_w8a16-g128": ("int8_w8a16", {"group_size": 128}, 128, 3.5e-2, 6.0e-3),
}  # fmt: skip


def quantize(experts: dict, scheme: str):
    """quantize_experts with the scheme's options for the shapes here (SCHEME_OPTIONS)."""
    options = SCHEME_OPTIONS.get(scheme, {})
    return quantize_experts(experts["w13"], experts["w2"], scheme, **options)


def random_routing(num_tokens: int, num_experts: int = E, top_k: int = K):
    ids = torch.rand(num_tokens, num_experts).argsort(dim=1)[:, :top_k].to(torch.int32)
    return torch.rand(num_tokens, top_k) + 0.1, ids


def test_every_scheme_has_a_bound():
    assert set(SCHEME_TOLERANCE) == set(SCHEMES)


def _against_float64_unquantized(scheme, options, inter, bias, max_tol, rms_tol, what):
    experts = random_experts(E, H, inter, bias=bias)
    b13 = None if experts["w13_bias"] is None else experts["w13_bias"].bfloat16()
    b2 = None if experts["w2_bias"] is None else experts["w2_bias"].bfloat16()
    x = torch.randn(M, H, dtype=torch.bfloat16)
    weights, ids = random_routing(M)
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], scheme, **options)
    out = fused_experts(x, w13_q, w2_q, weights, ids, w13_bias=b13, w2_bias=b2, quant_config=qc)
    assert out.dtype == torch.bfloat16 and out.shape == (M, H)
    expected = experts_ref(x, experts["w13"], experts["w2"], weights, ids, w13_bias=b13, w2_bias=b2)
    assert_close(out, expected, tol=max_tol, rms_tol=rms_tol, what=what)
    return qc


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_against_float64_unquantized(scheme, bias):
    max_tol, rms_tol = SCHEME_TOLERANCE[scheme]
    options = SCHEME_OPTIONS.get(scheme, {})
    _against_float64_unquantized(scheme, options, I, bias, max_tol, rms_tol, scheme)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", list(OPTION_TOLERANCE))
def test_weight_only_options_against_float64_unquantized(name, bias):
    scheme, options, inter, max_tol, rms_tol = OPTION_TOLERANCE[name]
    qc = _against_float64_unquantized(scheme, options, inter, bias, max_tol, rms_tol, name)
    # the options took: the group along K and the zero points are those asked for
    group = options.get("group_size", 128 if scheme == "int4_w4a16" else None)
    assert qc.w1.key.group == (1, group) and qc.w2.key.group == (1, group)
    assert qc.w2.scale.shape == (E, H, inter // group)
    assert (qc.w1.zero_point is not None) == options.get("zero_points", False)


# ---- what quantize_experts stores --------------------------------------------------------------
FP8, U8, F32 = torch.float8_e4m3fn, torch.uint8, torch.float32
# scheme -> (weight dtype, w13 shape, w13 scale shape, scale dtype, w2 scale shape), E=8 H=256 I=96
STORAGE = {
    "fp8_tensor": (FP8, (8, 192, 256), (8,), F32, (8,)),
    "fp8_channel": (FP8, (8, 192, 256), (8, 192), F32, (8, 256)),
    "fp8_block": (FP8, (8, 192, 256), (8, 2, 2), F32, (8, 2, 1)),
    "mxfp8": (FP8, (8, 192, 256), (8, 192, 8), U8, (8, 256, 3)),
    "mxfp4_w4a8": (U8, (8, 192, 128), (8, 192, 8), U8, (8, 256, 3)),
    "mxfp4_w4a16": (U8, (8, 192, 128), (8, 192, 8), U8, (8, 256, 3)),
    "nvfp4": (U8, (8, 192, 128), (8, 192, 16), FP8, (8, 256, 6)),
    "nvfp4_w4a16": (U8, (8, 192, 128), (8, 192, 16), FP8, (8, 256, 6)),
    "int8": (torch.int8, (8, 192, 256), (8, 192), F32, (8, 256)),
    "int4_w4a16": (U8, (8, 192, 128), (8, 192, 8), F32, (8, 256, 3)),  # group 32 (SCHEME_OPTIONS)
    "int8_w8a16": (torch.int8, (8, 192, 256), (8, 192), F32, (8, 256)),  # per channel
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_experts_storage(scheme):
    experts = random_experts(E, H, I)
    w13_q, w2_q, qc = quantize(experts, scheme)
    dtype, w13_shape, s13_shape, s_dtype, s2_shape = STORAGE[scheme]
    packed_i = I // 2 if dtype == U8 else I
    assert w13_q.dtype == dtype and w13_q.shape == w13_shape
    assert w2_q.dtype == dtype and w2_q.shape == (E, H, packed_i)
    assert qc.w1.scale.shape == s13_shape and qc.w1.scale.dtype == s_dtype
    assert qc.w2.scale.shape == s2_shape and qc.w2.scale.dtype == s_dtype
    if scheme.startswith("nvfp4"):
        assert qc.w1.global_scale.shape == (E,) and qc.w2.global_scale.shape == (E,)
    else:
        assert qc.w1.global_scale is None and qc.w2.global_scale is None
    assert qc.w1.zero_point is None and qc.w2.zero_point is None  # symmetric by default
    assert qc.scheme == scheme and (qc.a1.key is None) == (scheme in WEIGHT_ONLY)
    assert qc.weight_only == (scheme in WEIGHT_ONLY)
    assert qc.a1.key == qc.a2.key


# (scheme, options, I) -> (w13 scale shape, w2 scale shape); H = 256, N = 2I
INT_STORAGE = [
    ("int4_w4a16", {"group_size": 32, "zero_points": True}, 96, (8, 192, 8), (8, 256, 3)),
    ("int4_w4a16", {"group_size": 64}, 128, (8, 256, 4), (8, 256, 2)),
    ("int4_w4a16", {}, 128, (8, 256, 2), (8, 256, 1)),  # the default group: 128
    ("int4_w4a16", {"zero_points": True}, 128, (8, 256, 2), (8, 256, 1)),
    ("int8_w8a16", {"group_size": 32}, 96, (8, 192, 8), (8, 256, 3)),
    ("int8_w8a16", {"group_size": 128}, 128, (8, 256, 2), (8, 256, 1)),
]


@pytest.mark.parametrize(
    ("scheme", "options", "inter", "s13_shape", "s2_shape"),
    INT_STORAGE,
    ids=[f"{s}-{o}-I{i}" for s, o, i, *_ in INT_STORAGE],
)
def test_int_weight_only_storage(scheme, options, inter, s13_shape, s2_shape):
    """int4: uint8 [E, N, K/2] with float32 scales [E, N, K/g] and, with zero points, uint8
    zero points of the scale's shape; int8 groups: int8 [E, N, K] with scales [E, N, K/g]."""
    experts = random_experts(E, H, inter)
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], scheme, **options)
    int4 = scheme == "int4_w4a16"
    dtype, pack = (U8, 2) if int4 else (torch.int8, 1)
    assert w13_q.dtype == dtype and w13_q.shape == (E, 2 * inter, H // pack)
    assert w2_q.dtype == dtype and w2_q.shape == (E, H, inter // pack)
    assert qc.w1.scale.shape == s13_shape and qc.w2.scale.shape == s2_shape
    assert qc.w1.scale.dtype == F32 and qc.w2.scale.dtype == F32
    if options.get("zero_points"):
        assert qc.w1.zero_point.dtype == U8 and qc.w1.zero_point.shape == s13_shape
        assert qc.w2.zero_point.dtype == U8 and qc.w2.zero_point.shape == s2_shape
        assert int(qc.w1.zero_point.max()) <= 15
        assert len(qc.w1.zero_point.unique()) > 1, "one zero point per group, from its range"
    else:
        assert qc.w1.zero_point is None and qc.w2.zero_point is None
    assert qc.a1.key is None and qc.a2.key is None and qc.weight_only


# ---- the pipeline by hand ----------------------------------------------------------------------
def dequantized_weights(scheme: str, w13_q, w2_q, qc) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 weights the quantized experts stand for, from their stored bits."""

    def one(q, operand):
        if scheme == "fp8_tensor":
            return dequant_fp8_tensor(q, operand.scale)
        if scheme in ("fp8_channel", "int8") or (
            scheme == "int8_w8a16" and operand.scale.dim() == 2
        ):
            return dequant_rows(q, operand.scale)
        if scheme == "int8_w8a16":
            return dequant_int8_groups(q, operand.scale)
        if scheme == "int4_w4a16":
            return dequant_int4(q, operand.scale, operand.zero_point)
        if scheme == "fp8_block":
            return dequant_fp8_block(q, operand.scale)
        if scheme == "mxfp8":
            return dequant_mxfp8(q, operand.scale)
        if scheme.startswith("mxfp4"):
            return dequant_mxfp4(q, operand.scale)
        assert scheme.startswith("nvfp4"), scheme
        return dequant_nvfp4(q, operand.scale, operand.global_scale)

    return one(w13_q, qc.w1), one(w2_q, qc.w2)


# name -> (scheme, quantize_experts keywords, fake quantizer of x and of the intermediate)
PIPELINES = {
    "fp8_tensor": ("fp8_tensor", {}, fake_quant_fp8_tensor),
    "fp8_tensor_static": (
        "fp8_tensor",
        {"a1_scale": torch.tensor([0.004]), "a2_scale": torch.tensor([0.004])},
        lambda t: fake_quant_fp8_tensor(t, f32(0.004)),
    ),
    "fp8_tensor_per_token": ("fp8_tensor", {"per_token_activations": True}, fake_quant_fp8_rows),
    "fp8_channel": ("fp8_channel", {}, fake_quant_fp8_rows),
    "fp8_block": ("fp8_block", {}, fake_quant_fp8_group),
    "fp8_block_ue8m0": (
        "fp8_block",
        {"use_ue8m0": True},
        lambda t: fake_quant_fp8_group(t, 128, ue8m0=True),
    ),
    "fp8_block_column_major": ("fp8_block", {"column_major_scales": True}, fake_quant_fp8_group),
    "mxfp8": ("mxfp8", {}, fake_quant_mxfp8),
    "mxfp4_w4a8": ("mxfp4_w4a8", {}, fake_quant_fp8_group),
    "mxfp4_w4a8_ue8m0": (
        "mxfp4_w4a8",
        {"use_ue8m0": True},
        lambda t: fake_quant_fp8_group(t, 128, ue8m0=True),
    ),
    "mxfp4_w4a16": ("mxfp4_w4a16", {}, None),
    "nvfp4": ("nvfp4", {}, fake_quant_nvfp4),
    "nvfp4_w4a16": ("nvfp4_w4a16", {}, None),
    "int8": ("int8", {}, fake_quant_int8_rows),
    "int4_w4a16": ("int4_w4a16", {"group_size": 32}, None),
    "int4_w4a16_zero_points": ("int4_w4a16", {"group_size": 32, "zero_points": True}, None),
    "int4_w4a16_zero_points_g128": ("int4_w4a16", {"zero_points": True}, None),  # I = 128
    "int8_w8a16": ("int8_w8a16", {}, None),
    "int8_w8a16_g32": ("int8_w8a16", {"group_size": 32}, None),
}
# I = 96 is no multiple of the 128-wide groups: these take I = 128
PIPELINE_INTER = {"int4_w4a16_zero_points_g128": 128}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_by_hand(name):
    scheme, kwargs, fake_quant = PIPELINES[name]
    num_tokens = 9
    experts = random_experts(E, H, PIPELINE_INTER.get(name, I))
    x = torch.randn(num_tokens, H).double()  # float32 values: quantized from float32 exactly
    weights, ids = random_routing(num_tokens)
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], scheme, **kwargs)
    out = fused_experts(x, w13_q, w2_q, weights, ids, quant_config=qc)
    assert out.dtype == torch.float64
    w13, w2 = dequantized_weights(scheme, w13_q, w2_q, qc)
    expected = pipeline_by_hand(x, w13, w2, weights, ids, fake_quant)
    assert_close(out, expected, torch.float64, what=name)
    if fake_quant is not None:
        # the quantization of x and of the intermediate shows: without it the result differs
        unquantized_acts = pipeline_by_hand(x, w13, w2, weights, ids, None)
        gap = float((unquantized_acts - expected).abs().max() / expected.abs().max())
        assert gap > 1e-3, f"{name}: activation quantization changes the output by {gap:.1e}"


def test_static_scales_are_the_ones_given():
    # the same experts with a dynamic per-tensor scale: a different result than the static one
    experts = random_experts(E, H, I)
    x = torch.randn(9, H).double()
    weights, ids = random_routing(9)
    static = {"a1_scale": torch.tensor([0.004]), "a2_scale": torch.tensor([0.004])}
    *w_static, qc_static = quantize_experts(experts["w13"], experts["w2"], "fp8_tensor", **static)
    *w_dynamic, qc_dynamic = quantize_experts(experts["w13"], experts["w2"], "fp8_tensor")
    assert qc_static.a1.key == keys.FP8_STATIC_TENSOR and qc_static.a1.scale.tolist() == [
        f32(0.004)
    ]
    assert qc_dynamic.a1.key == keys.FP8_DYNAMIC_TENSOR and qc_dynamic.a1.scale is None
    out_static = fused_experts(x, *w_static, weights, ids, quant_config=qc_static)
    out_dynamic = fused_experts(x, *w_dynamic, weights, ids, quant_config=qc_dynamic)
    assert float((out_static - out_dynamic).abs().max()) > 1e-3


def test_column_major_scales_change_nothing_but_the_layout():
    experts = random_experts(E, H, I)
    x = torch.randn(9, H, dtype=torch.bfloat16)
    weights, ids = random_routing(9)
    w13_q, w2_q, row_major = quantize_experts(experts["w13"], experts["w2"], "fp8_block")
    col_major = dataclasses.replace(
        row_major,
        a1=dataclasses.replace(row_major.a1, column_major_scales=True),
        a2=dataclasses.replace(row_major.a2, column_major_scales=True),
    )
    scale = quantize_input(x, col_major).scale
    assert scale.shape == (9, 2) and scale.stride() == (1, 9)
    out_col = fused_experts(x, w13_q, w2_q, weights, ids, quant_config=col_major)
    out_row = fused_experts(x, w13_q, w2_q, weights, ids, quant_config=row_major)
    assert torch.equal(out_col, out_row)


def test_gemm1_parameters_through_the_quant_config():
    experts = random_experts(E, H, I, "swigluoai_uninterleave")
    x = torch.randn(9, H).double()
    weights, ids = random_routing(9)
    params = {"alpha": 1.5, "beta": 0.5, "limit": 2.0}
    w13_q, w2_q, qc = quantize_experts(
        experts["w13"],
        experts["w2"],
        "fp8_block",
        gemm1_alpha=params["alpha"],
        gemm1_beta=params["beta"],
        gemm1_clamp_limit=params["limit"],
    )
    assert qc.activation_params() == ActivationParams(1.5, 0.5, 2.0)
    act = "swigluoai_uninterleave"
    out = fused_experts(x, w13_q, w2_q, weights, ids, activation=act, quant_config=qc)
    w13, w2 = dequantized_weights("fp8_block", w13_q, w2_q, qc)
    hand = pipeline_by_hand(
        x, w13, w2, weights, ids, fake_quant_fp8_group, activation=act, params=params
    )
    assert_close(out, hand, torch.float64)
    defaults = pipeline_by_hand(x, w13, w2, weights, ids, fake_quant_fp8_group, activation=act)
    assert float((defaults - hand).abs().max() / hand.abs().max()) > 1e-2, "the params apply"
    # the same parameters given directly instead give the same result
    *_, plain = quantize_experts(experts["w13"], experts["w2"], "fp8_block")
    direct = fused_experts(
        x,
        w13_q,
        w2_q,
        weights,
        ids,
        activation=act,
        activation_params=ActivationParams(1.5, 0.5, 2.0),
        quant_config=plain,
    )
    assert torch.equal(direct, out)


def test_activation_params_given_twice_are_refused():
    experts = random_experts(E, H, I, "swigluoai_uninterleave")
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], "fp8_block", gemm1_alpha=1.5)
    x = torch.randn(3, H)
    weights, ids = random_routing(3)
    with pytest.raises(ValueError, match="activation parameters given twice"):
        fused_experts(
            x,
            w13_q,
            w2_q,
            weights,
            ids,
            activation="swigluoai_uninterleave",
            activation_params=ActivationParams(alpha=1.5),
            quant_config=qc,
        )


def test_gemm1_parameters_the_activation_does_not_take_are_refused():
    experts = random_experts(E, H, I)
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], "fp8_block", gemm1_beta=0.5)
    weights, ids = random_routing(3)
    with pytest.raises(ValueError, match="'silu' takes no beta parameter"):
        fused_experts(torch.randn(3, H), w13_q, w2_q, weights, ids, quant_config=qc)


# ---- what prepare hands the experts --------------------------------------------------------------
# scheme -> (dtype of a1q, shape of a1q, shape of its scale, dtype of its scale), M=5 H=256
PREPARED = {
    "fp8_tensor": (FP8, (5, 256), (1,), F32),
    "fp8_channel": (FP8, (5, 256), (5, 1), F32),
    "fp8_block": (FP8, (5, 256), (5, 2), F32),
    "mxfp8": (FP8, (5, 256), (5, 8), U8),
    "mxfp4_w4a8": (FP8, (5, 256), (5, 2), F32),
    "mxfp4_w4a16": (torch.bfloat16, (5, 256), None, None),
    "nvfp4": (U8, (5, 128), (5, 16), FP8),
    "nvfp4_w4a16": (torch.bfloat16, (5, 256), None, None),
    "int8": (torch.int8, (5, 256), (5, 1), F32),
    "int4_w4a16": (torch.bfloat16, (5, 256), None, None),
    "int8_w8a16": (torch.bfloat16, (5, 256), None, None),
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prepare_quantizes_the_input_as_the_scheme_says(scheme):
    experts = random_experts(E, H, I)
    *_, qc = quantize(experts, scheme)
    x = torch.randn(5, H, dtype=torch.bfloat16)
    weights, ids = random_routing(5)
    prepared = NoEPPrepareFinalize().prepare(x, weights, ids, E, None, False, qc)
    dtype, shape, scale_shape, scale_dtype = PREPARED[scheme]
    assert prepared.a1q.dtype == dtype and prepared.a1q.shape == shape
    assert (scale_shape is None) == (scheme in WEIGHT_ONLY)
    if scale_shape is None:  # weight-only (w4a16, w8a16): the activations stay as they are
        assert prepared.a1q is x and prepared.a1q_scale is None
        assert quantize_input(x, qc).q is x
        assert not qc.a1.quantized and not qc.a2.quantized
    else:
        assert prepared.a1q_scale.shape == scale_shape
        assert prepared.a1q_scale.dtype == scale_dtype
    assert (prepared.a1q_global_scale is not None) == (scheme == "nvfp4")


# ---- bad input ---------------------------------------------------------------------------------
@pytest.fixture
def experts():
    return random_experts(E, H, I)


def test_unknown_scheme(experts):
    with pytest.raises(ValueError, match="unknown quantization scheme 'fp9'; expected one of"):
        quantize_experts(experts["w13"], experts["w2"], "fp9")
    with pytest.raises(ValueError, match="unknown quantization scheme 'FP8_BLOCK'"):
        make_quant_config("FP8_BLOCK", torch.ones(E), torch.ones(E))
    with pytest.raises(TypeError, match="scheme must be a str, got NoneType"):
        quantize_experts(experts["w13"], experts["w2"], None)


@pytest.mark.parametrize(
    ("which", "value", "error", "match"),
    [
        ("w13", "list", TypeError, "w13 must be a torch.Tensor, got list"),
        ("w2", "int32", TypeError, "w2 must be float weights to quantize, got torch.int32"),
        ("w13", "fp8", TypeError, "w13 must be float weights to quantize, got torch.float8"),
        ("w2", "2d", ValueError, r"w2 must be a 3-D \[E, N, K\] tensor, got shape \(256, 96\)"),
    ],
)
def test_quantize_experts_bad_weights(experts, which, value, error, match):
    w = experts[which]
    bad = {
        "list": w.tolist(),
        "int32": w.to(torch.int32),
        "fp8": w.to(torch.float8_e4m3fn),
        "2d": w[0],
    }[value]
    args = {"w13": experts["w13"], "w2": experts["w2"], which: bad}
    with pytest.raises(error, match=match):
        quantize_experts(args["w13"], args["w2"], "fp8_block")


@pytest.mark.parametrize(
    ("scheme", "options"),
    [("mxfp8", {}), ("mxfp4_w4a8", {}), ("mxfp4_w4a16", {}), ("nvfp4", {}), ("nvfp4_w4a16", {}),
     ("int4_w4a16", {}), ("int4_w4a16", {"group_size": 32, "zero_points": True})],
)  # fmt: skip
def test_quantize_experts_refuses_k_the_groups_do_not_divide(scheme, options):
    bad_h = random_experts(2, 40, 32)  # H = 40: w13's K
    with pytest.raises(ValueError, match="w13: K = 40 is not a multiple"):
        quantize_experts(bad_h["w13"], bad_h["w2"], scheme, **options)
    bad_i = random_experts(2, 128, 40)  # I = 40: w2's K (H = 128: whole groups of any size)
    with pytest.raises(ValueError, match="w2: K = 40 is not a multiple"):
        quantize_experts(bad_i["w13"], bad_i["w2"], scheme, **options)
    # int4: the default group is 128, a K of 96 takes group_size=32
    if scheme == "int4_w4a16" and not options:
        bad_96 = random_experts(2, 128, 96)
        with pytest.raises(ValueError, match="w2: K = 96 is not a multiple of the 128-wide"):
            quantize_experts(bad_96["w13"], bad_96["w2"], scheme)


def _with_scale(qc, operand: str, scale):
    return dataclasses.replace(
        qc, **{operand: dataclasses.replace(getattr(qc, operand), scale=scale)}
    )


@pytest.mark.parametrize("operand", ["w1", "w2"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scales_that_do_not_fit_the_weights(experts, scheme, operand):
    w13_q, w2_q, qc = quantize(experts, scheme)
    scale = getattr(qc, operand).scale
    wrong = torch.cat([scale, scale[..., :1]], dim=-1)  # one column too many
    name = {"w1": "w13", "w2": "w2"}[operand]
    x = torch.randn(3, H, dtype=torch.bfloat16)
    weights, ids = random_routing(3)
    with pytest.raises(ValueError, match=rf"{name} scale must have shape \(8,"):
        fused_experts(x, w13_q, w2_q, weights, ids, quant_config=_with_scale(qc, operand, wrong))
    with pytest.raises(ValueError, match=f"{name}: .* weights need a scale tensor"):
        fused_experts(x, w13_q, w2_q, weights, ids, quant_config=_with_scale(qc, operand, None))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_of_the_wrong_dtype_for_the_scheme(experts, scheme):
    w13_q, w2_q, qc = quantize(experts, scheme)
    x = torch.randn(3, H, dtype=torch.bfloat16)
    weights, ids = random_routing(3)
    float_w13 = experts["w13"].bfloat16()
    if w13_q.dtype == torch.uint8:  # packed FP4 / INT4: keep the packed shape
        float_w13 = float_w13[..., : H // 2]
    with pytest.raises(TypeError, match=f"w13: .* weights are stored as {w13_q.dtype}, got"):
        fused_experts(x, float_w13, w2_q, weights, ids, quant_config=qc)
    other = torch.int8 if w2_q.dtype != torch.int8 else torch.float8_e4m3fn
    with pytest.raises(TypeError, match=f"w2: .* weights are stored as {w2_q.dtype}, got {other}"):
        fused_experts(x, w13_q, w2_q.view(other), weights, ids, quant_config=qc)


def test_scale_of_the_wrong_dtype(experts):
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], "mxfp4_w4a16")
    x = torch.randn(3, H, dtype=torch.bfloat16)
    weights, ids = random_routing(3)
    bad = _with_scale(qc, "w1", qc.w1.scale.float())
    with pytest.raises(TypeError, match=r"w13 scale must be torch.uint8 for .*, got torch.float32"):
        fused_experts(x, w13_q, w2_q, weights, ids, quant_config=bad)


@pytest.mark.parametrize(
    ("scheme", "options"),
    [("int4_w4a16", {"group_size": 32, "zero_points": True}), ("int8_w8a16", {}),
     ("int8_w8a16", {"group_size": 32})],
)  # fmt: skip
def test_int_weight_only_scales_in_float16_and_bfloat16(experts, scheme, options):
    """Checkpoints store float16 scales: float16 and bfloat16 scales are taken as they are,
    the same result as float32 scales of the same values; other dtypes are refused."""
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], scheme, **options)
    x = torch.randn(5, H).double()
    weights, ids = random_routing(5)
    for dtype in (torch.float16, torch.bfloat16):
        low = _with_scale(_with_scale(qc, "w1", qc.w1.scale.to(dtype)), "w2", qc.w2.scale.to(dtype))
        same = _with_scale(_with_scale(qc, "w1", low.w1.scale.float()), "w2", low.w2.scale.float())
        out = fused_experts(x, w13_q, w2_q, weights, ids, quant_config=low)
        assert torch.equal(out, fused_experts(x, w13_q, w2_q, weights, ids, quant_config=same))
        full = fused_experts(x, w13_q, w2_q, weights, ids, quant_config=qc)
        assert not torch.equal(out, full), f"the {dtype} scales are read, not the float32 ones"
    for bad in (torch.float64, torch.uint8):
        wrong = _with_scale(qc, "w2", qc.w2.scale.to(bad))
        # the weight-only schemes take float16 / bfloat16 scales; the message says so
        match = rf"w2 scale must be float32, float16 or bfloat16 for int[48].*, got {bad}"
        with pytest.raises(TypeError, match=match):
            fused_experts(x, w13_q, w2_q, weights, ids, quant_config=wrong)


def _with_zero_point(qc, operand: str, zero_point):
    return dataclasses.replace(
        qc, **{operand: dataclasses.replace(getattr(qc, operand), zero_point=zero_point)}
    )


def test_zero_points_that_do_not_fit_the_weights(experts):
    w13_q, w2_q, qc = quantize_experts(
        experts["w13"], experts["w2"], "int4_w4a16", group_size=32, zero_points=True
    )
    x = torch.randn(3, H, dtype=torch.bfloat16)
    weights, ids = random_routing(3)
    z13, z2 = qc.w1.zero_point, qc.w2.zero_point
    uint8 = "zero points must be a uint8 tensor, got"
    bad = [
        ("w1", z13.to(torch.int32), TypeError, f"w13 {uint8} torch.int32"),
        ("w2", z2.to(torch.int8), TypeError, f"w2 {uint8} torch.int8"),
        ("w2", z2.float(), TypeError, f"w2 {uint8} torch.float32"),
        ("w1", z13.tolist(), TypeError, f"w13 {uint8} list"),
        ("w1", z13[..., :4], ValueError,
         r"w13 zero points must have the scale's shape \(8, 192, 8\) on cpu, got \(8, 192, 4\)"),
        ("w2", z2[:, None], ValueError,
         r"w2 zero points must have the scale's shape \(8, 256, 3\) on cpu, got \(8, 1, 256, 3\)"),
    ]  # fmt: skip
    for operand, zero_point, error, match in bad:
        with pytest.raises(error, match=match):
            wrong = _with_zero_point(qc, operand, zero_point)
            fused_experts(x, w13_q, w2_q, weights, ids, quant_config=wrong)
    # zero points on weights that take none
    *w8, qc8 = quantize_experts(experts["w13"], experts["w2"], "int8_w8a16", group_size=32)
    with pytest.raises(ValueError, match="w13: only int4 weights take zero points, not int8/"):
        fused_experts(x, *w8, weights, ids, quant_config=_with_zero_point(qc8, "w1", z13))
    with pytest.raises(ValueError, match="zero points apply to int4_w4a16, not int8_w8a16"):
        make_quant_config("int8_w8a16", qc8.w1.scale, qc8.w2.scale, group_size=32,
                          w1_zero_point=z13, w2_zero_point=z2)  # fmt: skip
    with pytest.raises(ValueError, match="zero points apply to int4_w4a16, not nvfp4_w4a16"):
        make_quant_config("nvfp4_w4a16", qc8.w1.scale, qc8.w2.scale, w2_zero_point=z2)


def test_zero_points_are_read(experts):
    """The same codes and scales with each zero point moved by one: every output moves (the
    zero points are applied, per group, to both weights)."""
    w13_q, w2_q, qc = quantize_experts(
        experts["w13"], experts["w2"], "int4_w4a16", group_size=32, zero_points=True
    )
    x = torch.randn(5, H).double()
    weights, ids = random_routing(5)
    out = fused_experts(x, w13_q, w2_q, weights, ids, quant_config=qc)
    for operand in ("w1", "w2"):
        z = getattr(qc, operand).zero_point
        moved = _with_zero_point(qc, operand, torch.where(z < 15, z + 1, z - 1))
        other = fused_experts(x, w13_q, w2_q, weights, ids, quant_config=moved)
        assert float((other - out).abs().min()) > 0, operand
    # and symmetric weights read as zero 8: the same as zero points all 8
    w13_s, w2_s, sym = quantize_experts(experts["w13"], experts["w2"], "int4_w4a16", group_size=32)
    eights = torch.full_like(qc.w1.zero_point, 8), torch.full_like(qc.w2.zero_point, 8)
    explicit = make_quant_config("int4_w4a16", sym.w1.scale, sym.w2.scale, group_size=32,
                                 w1_zero_point=eights[0], w2_zero_point=eights[1])  # fmt: skip
    assert torch.equal(
        fused_experts(x, w13_s, w2_s, weights, ids, quant_config=sym),
        fused_experts(x, w13_s, w2_s, weights, ids, quant_config=explicit),
    )


def test_make_quant_config_group_size(experts):
    *_, qc4 = quantize_experts(experts["w13"], experts["w2"], "int4_w4a16", group_size=32)
    s13, s2 = qc4.w1.scale, qc4.w2.scale
    # int4 needs its group size: from [E, N, K/g] scales, or with no scale shape to go by
    with pytest.raises(
        ValueError, match=r"int4_w4a16: \[E, N, K / g\] group scales need group_size"
    ):
        make_quant_config("int4_w4a16", s13, s2)
    with pytest.raises(ValueError, match=r"int4_w4a16 needs group_size, one of \(32, 64, 128\)"):
        make_quant_config("int4_w4a16", s13[..., 0], s2[..., 0])
    with pytest.raises(ValueError, match=r"int8_w8a16: \[E, N, K / g\] group scales need group_s"):
        make_quant_config("int8_w8a16", s13, s2)
    # only the three group sizes, as ints
    with pytest.raises(ValueError, match=r"group_size must be one of \(32, 64, 128\), got 16"):
        make_quant_config("int4_w4a16", s13, s2, group_size=16)
    with pytest.raises(TypeError, match="group_size must be an int, got bool"):
        make_quant_config("int8_w8a16", s13, s2, group_size=True)
    # and only on the schemes that take it
    for scheme in ("fp8_block", "mxfp4_w4a16", "nvfp4_w4a16", "int8"):
        with pytest.raises(
            ValueError, match=f"group_size applies to int4_w4a16 / int8_w8a16, not {scheme}"
        ):
            make_quant_config(scheme, s13, s2, group_size=32)
    # the scales of another group size than the config's are refused when the experts run
    w13_q, w2_q, _ = quantize_experts(experts["w13"], experts["w2"], "int4_w4a16", group_size=32)
    wrong = make_quant_config("int4_w4a16", s13, s2, group_size=64)
    assert wrong.w1.key.group == (1, 64)
    weights, ids = random_routing(3)
    with pytest.raises(
        ValueError, match=r"w13 scale must have shape \(8, 192, 4\) for int4/group1x64"
    ):
        fused_experts(torch.randn(3, H), w13_q, w2_q, weights, ids, quant_config=wrong)
    # int8 without a group size: per-channel [E, N] scales
    *_, qc8 = quantize_experts(experts["w13"], experts["w2"], "int8_w8a16")
    assert make_quant_config("int8_w8a16", qc8.w1.scale, qc8.w2.scale).w1.key == keys.INT8_CHANNEL


def test_nvfp4_needs_its_global_scale(experts):
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], "nvfp4")
    bad = dataclasses.replace(qc, w2=dataclasses.replace(qc.w2, global_scale=None))
    weights, ids = random_routing(3)
    with pytest.raises(ValueError, match=r"w2: NVFP4 weights need a float32 global scale \[8\]"):
        fused_experts(torch.randn(3, H), w13_q, w2_q, weights, ids, quant_config=bad)


@pytest.mark.parametrize(
    ("scheme", "kwargs", "match"),
    [
        ("fp8_block", {"a1_scale": 1.0, "a2_scale": 1.0}, "static activation scales: fp8_tensor"),
        ("fp8_channel", {"a1_scale": 1.0, "a2_scale": 1.0}, "static activation scales"),
        ("int8", {"a1_scale": 1.0, "a2_scale": 1.0}, "static activation scales"),
        ("fp8_tensor", {"a1_scale": 1.0}, "with both a1_scale and a2_scale"),
        ("fp8_tensor", {"a2_scale": 1.0}, "with both a1_scale and a2_scale"),
        ("fp8_tensor", {"a1_scale": [1.0, 2.0], "a2_scale": 1.0}, "a1_scale must be a one-element"),
        (
            "fp8_tensor",
            {"a1_scale": 1.0, "a2_scale": 1.0, "per_token_activations": True},
            "exclude each other",
        ),
        ("fp8_channel", {"per_token_activations": True}, "per_token_activations applies to"),
        ("fp8_tensor", {"use_ue8m0": True}, "use_ue8m0 applies to the 1x128 group scales"),
        ("mxfp8", {"use_ue8m0": True}, "use_ue8m0 applies"),
        ("fp8_tensor", {"column_major_scales": True}, "column_major_scales applies to group"),
        ("mxfp4_w4a16", {"column_major_scales": True}, "column_major_scales applies to group"),
        ("fp8_tensor", {"fast_accum": True}, "fast_accum applies to fp8_block"),
        ("mxfp8", {"fast_accum": True}, "fast_accum applies to fp8_block"),
        ("int4_w4a16", {"fast_accum": True, "group_size": 32}, "fast_accum applies to fp8_block"),
        ("fp8_block", {"group_size": 128}, "group_size applies to int4_w4a16 / int8_w8a16"),
        ("nvfp4_w4a16", {"group_size": 32}, "group_size applies to int4_w4a16 / int8_w8a16"),
        ("int4_w4a16", {"group_size": 16}, r"group_size must be one of \(32, 64, 128\)"),
        ("int8_w8a16", {"group_size": 256}, r"group_size must be one of \(32, 64, 128\)"),
        ("int8_w8a16", {"zero_points": True}, "zero_points applies to int4_w4a16"),
        ("mxfp4_w4a16", {"zero_points": True}, "zero_points applies to int4_w4a16"),
        ("int4_w4a16", {"group_size": 32, "a1_scale": 1.0, "a2_scale": 1.0}, "static activation"),
        ("int8_w8a16", {"per_token_activations": True}, "per_token_activations applies to"),
        ("int4_w4a16", {"group_size": 32, "use_ue8m0": True}, "use_ue8m0 applies"),
        ("int8_w8a16", {"column_major_scales": True}, "column_major_scales applies to group"),
    ],
)
def test_config_options_the_scheme_does_not_take(experts, scheme, kwargs, match):
    kwargs = {
        k: torch.tensor(v if isinstance(v, list) else [v]) if k.endswith("_scale") else v
        for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=match):
        quantize_experts(experts["w13"], experts["w2"], scheme, **kwargs)


def test_int_weight_only_option_types(experts):
    with pytest.raises(TypeError, match="zero_points must be a bool, got int"):
        quantize_experts(experts["w13"], experts["w2"], "int4_w4a16", group_size=32, zero_points=1)
    with pytest.raises(TypeError, match="group_size must be an int, got float"):
        quantize_experts(experts["w13"], experts["w2"], "int8_w8a16", group_size=32.0)


def test_fast_accum_is_a_bool_and_part_of_the_cache_key(experts):
    _, _, plain = quantize_experts(experts["w13"], experts["w2"], "fp8_block")
    with pytest.raises(TypeError, match="fast_accum must be a bool, got int"):
        make_quant_config("fp8_block", plain.w1.scale, plain.w2.scale, fast_accum=1)
    fast = make_quant_config("fp8_block", plain.w1.scale, plain.w2.scale, fast_accum=True)
    assert fast.fast_accum and not plain.fast_accum
    assert fast.cache_key() != plain.cache_key()


def test_quant_config_of_the_wrong_type_is_refused(experts):
    weights, ids = random_routing(3)
    with pytest.raises(TypeError, match="quant_config must be a FusedMoEQuantConfig"):
        fused_experts(
            torch.randn(3, H), experts["w13"], experts["w2"], weights, ids, quant_config="fp8"
        )


@pytest.mark.parametrize(
    ("scheme", "options"),
    [("fp8_block", {}), ("fp8_tensor", {}), ("mxfp4_w4a8", {}), ("nvfp4", {}), ("int8", {}),
     ("int4_w4a16", {"group_size": 32, "zero_points": True}), ("int8_w8a16", {"group_size": 32})],
)  # fmt: skip
def test_quantize_experts_in_chunks_equals_at_once(scheme, options, monkeypatch):
    """Large layers are quantized a few experts at a time: the same bytes and scales."""
    from fusedmoe.quant import config as qconfig

    w13, w2 = torch.randn(7, 64, 256), torch.randn(7, 256, 32)
    whole = quantize_experts(w13, w2, scheme, **options)
    monkeypatch.setattr(qconfig, "_CHUNK_ELEMENTS", 2 * 64 * 256)  # chunks of 2 experts
    chunked = quantize_experts(w13, w2, scheme, **options)
    for a, b in ((whole[0], chunked[0]), (whole[1], chunked[1])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in ((whole[2].w1, chunked[2].w1), (whole[2].w2, chunked[2].w2)):
        assert torch.equal(a.scale.float(), b.scale.float())
        for name in ("global_scale", "zero_point"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta is None) == (tb is None)
            if ta is not None:
                assert torch.equal(ta, tb)
    assert (whole[2].w1.zero_point is not None) == options.get("zero_points", False)
