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
    int8          3.1e-2        6.0e-2         4.7e-3        1.0e-2

The max error is that of the worst of M * H outputs (e4m3 keeps 3 mantissa bits: a rounding
is up to 2**-4 relative; E2M1 keeps 1: up to 1/5, more for the small values of a block); the
RMS error is the typical one.

The pipeline by hand (float64 input, so that nothing but the quantization rounds): weights
dequantized here from their stored bits, x and the intermediate fake-quantized by the
per-element quantizers of tests/quant_reference.py, float64 GEMMs, the activation in float64
and quantized from float32, the weighted sum in float64. It must agree to float64 precision.

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
    "int8": (6.0e-2, 1.0e-2),
}

E, K, H, I, M = 8, 2, 256, 96, 33


def random_routing(num_tokens: int, num_experts: int = E, top_k: int = K):
    ids = torch.rand(num_tokens, num_experts).argsort(dim=1)[:, :top_k].to(torch.int32)
    return torch.rand(num_tokens, top_k) + 0.1, ids


def test_every_scheme_has_a_bound():
    assert set(SCHEME_TOLERANCE) == set(SCHEMES)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_against_float64_unquantized(scheme, bias):
    experts = random_experts(E, H, I, bias=bias)
    b13 = None if experts["w13_bias"] is None else experts["w13_bias"].bfloat16()
    b2 = None if experts["w2_bias"] is None else experts["w2_bias"].bfloat16()
    x = torch.randn(M, H, dtype=torch.bfloat16)
    weights, ids = random_routing(M)
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], scheme)
    out = fused_experts(x, w13_q, w2_q, weights, ids, w13_bias=b13, w2_bias=b2, quant_config=qc)
    assert out.dtype == torch.bfloat16 and out.shape == (M, H)
    expected = experts_ref(x, experts["w13"], experts["w2"], weights, ids, w13_bias=b13, w2_bias=b2)
    max_tol, rms_tol = SCHEME_TOLERANCE[scheme]
    assert_close(out, expected, tol=max_tol, rms_tol=rms_tol, what=scheme)


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
    "int8": (torch.int8, (8, 192, 256), (8, 192), F32, (8, 256)),
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_experts_storage(scheme):
    experts = random_experts(E, H, I)
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], scheme)
    dtype, w13_shape, s13_shape, s_dtype, s2_shape = STORAGE[scheme]
    packed_i = I // 2 if dtype == U8 else I
    assert w13_q.dtype == dtype and w13_q.shape == w13_shape
    assert w2_q.dtype == dtype and w2_q.shape == (E, H, packed_i)
    assert qc.w1.scale.shape == s13_shape and qc.w1.scale.dtype == s_dtype
    assert qc.w2.scale.shape == s2_shape and qc.w2.scale.dtype == s_dtype
    if scheme == "nvfp4":
        assert qc.w1.global_scale.shape == (E,) and qc.w2.global_scale.shape == (E,)
    else:
        assert qc.w1.global_scale is None and qc.w2.global_scale is None
    assert qc.scheme == scheme and (qc.a1.key is None) == (scheme == "mxfp4_w4a16")
    assert qc.a1.key == qc.a2.key


# ---- the pipeline by hand ----------------------------------------------------------------------
def dequantized_weights(scheme: str, w13_q, w2_q, qc) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 weights the quantized experts stand for, from their stored bits."""

    def one(q, operand):
        if scheme == "fp8_tensor":
            return dequant_fp8_tensor(q, operand.scale)
        if scheme in ("fp8_channel", "int8"):
            return dequant_rows(q, operand.scale)
        if scheme == "fp8_block":
            return dequant_fp8_block(q, operand.scale)
        if scheme == "mxfp8":
            return dequant_mxfp8(q, operand.scale)
        if scheme.startswith("mxfp4"):
            return dequant_mxfp4(q, operand.scale)
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
    "int8": ("int8", {}, fake_quant_int8_rows),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_by_hand(name):
    scheme, kwargs, fake_quant = PIPELINES[name]
    num_tokens = 9
    experts = random_experts(E, H, I)
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
    "int8": (torch.int8, (5, 256), (5, 1), F32),
}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prepare_quantizes_the_input_as_the_scheme_says(scheme):
    experts = random_experts(E, H, I)
    *_, qc = quantize_experts(experts["w13"], experts["w2"], scheme)
    x = torch.randn(5, H, dtype=torch.bfloat16)
    weights, ids = random_routing(5)
    prepared = NoEPPrepareFinalize().prepare(x, weights, ids, E, None, False, qc)
    dtype, shape, scale_shape, scale_dtype = PREPARED[scheme]
    assert prepared.a1q.dtype == dtype and prepared.a1q.shape == shape
    if scale_shape is None:  # w4a16: the activations stay as they are
        assert prepared.a1q is x and prepared.a1q_scale is None
        assert quantize_input(x, qc).q is x
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


@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4_w4a8", "mxfp4_w4a16", "nvfp4"])
def test_quantize_experts_refuses_k_the_groups_do_not_divide(scheme):
    bad_h = random_experts(2, 40, 32)  # H = 40: w13's K
    with pytest.raises(ValueError, match="w13: K = 40 is not a multiple"):
        quantize_experts(bad_h["w13"], bad_h["w2"], scheme)
    bad_i = random_experts(2, 64, 40)  # I = 40: w2's K
    with pytest.raises(ValueError, match="w2: K = 40 is not a multiple"):
        quantize_experts(bad_i["w13"], bad_i["w2"], scheme)


def _with_scale(qc, operand: str, scale):
    return dataclasses.replace(
        qc, **{operand: dataclasses.replace(getattr(qc, operand), scale=scale)}
    )


@pytest.mark.parametrize("operand", ["w1", "w2"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scales_that_do_not_fit_the_weights(experts, scheme, operand):
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], scheme)
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
    w13_q, w2_q, qc = quantize_experts(experts["w13"], experts["w2"], scheme)
    x = torch.randn(3, H, dtype=torch.bfloat16)
    weights, ids = random_routing(3)
    float_w13 = experts["w13"].bfloat16()
    if w13_q.dtype == torch.uint8:  # packed FP4: keep the packed shape
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
    ],
)
def test_config_options_the_scheme_does_not_take(experts, scheme, kwargs, match):
    kwargs = {
        k: torch.tensor(v if isinstance(v, list) else [v]) if k.endswith("_scale") else v
        for k, v in kwargs.items()
    }
    with pytest.raises(ValueError, match=match):
        quantize_experts(experts["w13"], experts["w2"], scheme, **kwargs)


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


@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_tensor", "mxfp4_w4a8", "nvfp4", "int8"])
def test_quantize_experts_in_chunks_equals_at_once(scheme, monkeypatch):
    """Large layers are quantized a few experts at a time: the same bytes and scales."""
    from fusedmoe.quant import config as qconfig

    w13, w2 = torch.randn(7, 64, 256), torch.randn(7, 256, 32)
    whole = quantize_experts(w13, w2, scheme)
    monkeypatch.setattr(qconfig, "_CHUNK_ELEMENTS", 2 * 64 * 256)  # chunks of 2 experts
    chunked = quantize_experts(w13, w2, scheme)
    for a, b in ((whole[0], chunked[0]), (whole[1], chunked[1])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in ((whole[2].w1, chunked[2].w1), (whole[2].w2, chunked[2].w2)):
        assert torch.equal(a.scale.float(), b.scale.float())
        assert (a.global_scale is None) == (b.global_scale is None)
        if a.global_scale is not None:
            assert torch.equal(a.global_scale, b.global_scale)
