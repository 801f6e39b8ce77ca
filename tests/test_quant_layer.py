"""FusedMoE with quantized experts: quantize_, the quant_config property, device / dtype moves,
and load_weights of quantized checkpoints (gpt-oss MXFP4 blocks, DeepSeek FP8 per-expert
block scales, fused FP8 / NVFP4 tensors with their scales).

Checkpoints are fresh random bits; each test dequantizes them by hand (tests/quant_reference.py)
and compares the layer's forward with a float64 computation from those values. Layers run in
float64 where the comparison is tight (only the quantization rounds), bfloat16 elsewhere.

Legend: T tokens, H hidden, I intermediate, E experts, k top-k.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import FusedMoE, fused_experts
from fusedmoe.quant.config import SCHEMES, make_quant_config, quantize_experts
from tests.helpers import assert_close, assert_equal
from tests.quant_reference import (
    dequant_fp8_block,
    dequant_mxfp4,
    dequant_nvfp4,
    dequant_rows,
    fake_quant_fp8_group,
    fake_quant_fp8_rows,
    fake_quant_nvfp4,
    pipeline_by_hand,
)
from tests.reference import experts_ref, softmax_topk_ref

E, K, H, I, T = 4, 2, 256, 128, 11
FP8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for exact comparison of any dtype (fp8 included)."""
    return t.contiguous().view(torch.uint8)


def routing(logits: torch.Tensor, top_k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = softmax_topk_ref(logits.double(), top_k)
    return weights.float(), ids


def inputs(dtype: torch.dtype, num_experts: int = E, hidden: int = H):
    x = torch.randn(T, hidden).to(dtype)
    logits = torch.randn(T, num_experts).to(dtype)
    return x, logits


def float_layer(dtype=torch.float64, **kwargs) -> FusedMoE:
    layer = FusedMoE(E, K, H, I, params_dtype=dtype, **kwargs)
    with torch.no_grad():  # weights large enough that the activations are not all tiny
        layer.w13_weight.normal_(0.0, 3.0 / H**0.5)
        layer.w2_weight.normal_(0.0, 1.0 / I**0.5)
    return layer


# ---- quantize_ and the constructor's quant_config ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_matches_fused_experts_with_the_same_weights(scheme, dtype):
    layer = float_layer(dtype)
    w13, w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
    assert layer.quantize_(scheme) is layer
    w13_q, w2_q, qc = quantize_experts(w13, w2, scheme)
    assert_equal(bits(layer.w13_weight), bits(w13_q), what="w13")
    assert_equal(bits(layer.w2_weight), bits(w2_q), what="w2")
    assert not layer.w13_weight.requires_grad
    config = layer.quant_config
    assert config.scheme == scheme and config.w1.key == qc.w1.key and config.a1.key == qc.a1.key
    assert_equal(bits(config.w1.scale), bits(qc.w1.scale), what="w13 scale")
    assert_equal(bits(config.w2.scale), bits(qc.w2.scale), what="w2 scale")
    assert layer.params_dtype == dtype

    x, logits = inputs(dtype)
    out = layer(x, logits)
    assert out.dtype == dtype and out.shape == (T, H)
    weights, ids = routing(logits)
    expected = fused_experts(x, w13_q, w2_q, weights, ids, quant_config=qc)
    # the router's float32 weights against float64 ones rounded: only the final sum differs
    assert_close(out, expected, tol=1e-6 if dtype == torch.float64 else None)


def test_constructor_quant_config():
    layer = FusedMoE(E, K, H, I, quant_config="fp8_block")
    assert layer.quant_scheme == "fp8_block"
    assert layer.w13_weight.dtype == FP8 and layer.w13_weight.shape == (E, 2 * I, H)
    assert layer.w13_weight_scale.shape == (E, 2, 2)
    assert layer.w2_weight_scale.shape == (E, 2, 1)
    assert layer.params_dtype == torch.bfloat16
    names = dict(layer.named_buffers())
    assert {"w13_weight_scale", "w2_weight_scale"} <= set(names)
    x, logits = inputs(torch.bfloat16)
    weights, ids = routing(logits)
    expected = fused_experts(
        x, layer.w13_weight, layer.w2_weight, weights, ids, quant_config=layer.quant_config
    )
    assert_close(layer(x, logits), expected, torch.bfloat16)
    # the quantized random init dequantizes to the nn.Linear range U(-1/sqrt(H), 1/sqrt(H))
    w13 = dequant_fp8_block(layer.w13_weight, layer.w13_weight_scale)
    assert float(w13.abs().max()) <= 1.0 / H**0.5 * (1 + 2**-4)


def test_quantize_options_reach_the_config():
    layer = float_layer()
    layer.quantize_("fp8_block", use_ue8m0=True, column_major_scales=True)
    config = layer.quant_config
    assert config.a1.key.scale_format.value == "ue8m0" and config.a1.column_major_scales
    assert not config.fast_accum
    assert float_layer().quantize_("fp8_block", fast_accum=True).quant_config.fast_accum
    static = float_layer()
    static.quantize_("fp8_tensor", a1_scale=torch.tensor([0.01]), a2_scale=torch.tensor([0.02]))
    assert static.a1_scale.tolist() == torch.tensor([0.01]).tolist()
    assert static.quant_config.a2.scale.tolist() == torch.tensor([0.02]).tolist()
    assert "a1_scale" in dict(static.named_buffers())


def test_constructor_quant_options():
    """A layer built quantized (for a pre-quantized checkpoint) takes the scheme's options."""
    layer = FusedMoE(E, K, H, I, quant_config="fp8_block", quant_options={"fast_accum": True})
    assert layer.quant_config.fast_accum and layer.quant_config.a1.key.group == (1, 128)
    assert not FusedMoE(E, K, H, I, quant_config="fp8_block").quant_config.fast_accum
    with pytest.raises(ValueError, match="quant_options needs quant_config"):
        FusedMoE(E, K, H, I, quant_options={"fast_accum": True})
    with pytest.raises(TypeError, match="quant_options must be a dict, got list"):
        FusedMoE(E, K, H, I, quant_config="fp8_block", quant_options=["fast_accum"])
    with pytest.raises(ValueError, match="fast_accum applies to fp8_block"):
        FusedMoE(E, K, H, I, quant_config="int8", quant_options={"fast_accum": True})


def test_quantize_twice_and_bad_schemes():
    layer = float_layer()
    layer.quantize_("fp8_channel")
    with pytest.raises(ValueError, match=r"already quantized \(fp8_channel\)"):
        layer.quantize_("fp8_block")
    with pytest.raises(ValueError, match="unknown quantization scheme 'fp4'"):
        float_layer().quantize_("fp4")
    with pytest.raises(ValueError, match="unknown quantization scheme 'int4'"):
        FusedMoE(E, K, H, I, quant_config="int4")
    with pytest.raises(ValueError, match="gemm1_alpha: a layer takes its activation parameters"):
        float_layer().quantize_("fp8_block", gemm1_alpha=1.0)
    with pytest.raises(ValueError, match="static activation scales: fp8_tensor only"):
        float_layer().quantize_("int8", a1_scale=torch.ones(1), a2_scale=torch.ones(1))


def test_a_failed_quantize_leaves_the_layer_float():
    layer = FusedMoE(E, K, 40, I, params_dtype=torch.float32)  # H = 40: no whole 32-groups
    with pytest.raises(ValueError, match="w13: K = 40 is not a multiple"):
        layer.quantize_("mxfp4_w4a16")
    assert layer.quant_scheme is None and layer.w13_weight.dtype == torch.float32
    layer.quantize_("fp8_block")  # FP8 blocks accept partial blocks
    assert layer.w13_weight_scale.shape == (E, 2, 1)


def test_reset_parameters_on_a_quantized_layer():
    layer = FusedMoE(E, K, H, I, quant_config="int8")
    with pytest.raises(ValueError, match="reset_parameters: the layer is quantized"):
        layer.reset_parameters()


# ---- device and dtype moves ---------------------------------------------------------------------
def snapshot(layer: FusedMoE) -> dict[str, tuple[torch.dtype, torch.Tensor]]:
    return {name: (t.dtype, bits(t).clone()) for name, t in layer.state_dict().items()}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_layer_refuses_dtype_changes(scheme):
    layer = FusedMoE(E, K, H, I, has_bias=True, quant_config=scheme)
    x, logits = inputs(torch.bfloat16)
    before, out_before = snapshot(layer), layer(x, logits)
    for move in (
        lambda m: m.to(torch.float32),
        lambda m: m.to("cpu", torch.float16),
        lambda m: m.float(),
        lambda m: m.double(),
        lambda m: m.half(),
    ):
        with pytest.raises(TypeError, match=f"a {scheme}-quantized FusedMoE moves between devices"):
            move(layer)
        after = snapshot(layer)
        assert after.keys() == before.keys()
        for name, (dtype, data) in before.items():
            assert after[name][0] == dtype, f"{name}: {dtype} -> {after[name][0]}"
            assert torch.equal(after[name][1], data), f"{name} changed"
        assert layer.params_dtype == torch.bfloat16
    assert torch.equal(layer(x, logits), out_before)


@pytest.mark.parametrize("scheme", ["fp8_block", "mxfp4_w4a16", "int8"])
def test_a_quantized_layer_moves_to_cpu(scheme):
    layer = FusedMoE(E, K, H, I, has_bias=True, quant_config=scheme)
    x, logits = inputs(torch.bfloat16)
    before, out_before = snapshot(layer), layer(x, logits)
    assert layer.to("cpu") is layer
    assert layer.to(torch.device("cpu")).cpu() is layer
    after = snapshot(layer)
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}
    assert torch.equal(layer(x, logits), out_before)


def test_an_unquantized_layer_still_changes_dtype():
    layer = FusedMoE(E, K, H, I, has_bias=True, params_dtype=torch.bfloat16)
    layer.to(torch.float32)
    assert layer.params_dtype == torch.float32 and layer.w13_bias.dtype == torch.float32


@pytest.mark.parametrize("scheme", ["fp8_block", "mxfp4_w4a8", "nvfp4"])
def test_state_dict_round_trip(scheme):
    layer = FusedMoE(E, K, H, I, quant_config=scheme)
    other = FusedMoE(E, K, H, I, quant_config=scheme)
    other.load_state_dict(layer.state_dict())
    x, logits = inputs(torch.bfloat16)
    assert torch.equal(other(x, logits), layer(x, logits))


# ---- quantized checkpoints ----------------------------------------------------------------------
def gpt_oss_checkpoint(num_experts: int, hidden: int, inter: int, prefix: str) -> dict:
    """gpt-oss MXFP4: *_blocks [E, N, K/32, 16] uint8, *_scales [E, N, K/32] uint8 E8M0,
    *_bias [E, N] bfloat16; gate and up rows interleaved in gate_up_proj."""

    def blocks(rows, k):
        return torch.randint(0, 256, (num_experts, rows, k // 32, 16), dtype=torch.uint8)

    def scales(rows, k):  # 2**-7 .. 2**-5: weights up to 6 * 2**-5
        return torch.randint(120, 123, (num_experts, rows, k // 32), dtype=torch.uint8)

    return {
        f"{prefix}.gate_up_proj_blocks": blocks(2 * inter, hidden),
        f"{prefix}.gate_up_proj_scales": scales(2 * inter, hidden),
        f"{prefix}.gate_up_proj_bias": torch.randn(num_experts, 2 * inter).bfloat16(),
        f"{prefix}.down_proj_blocks": blocks(hidden, inter),
        f"{prefix}.down_proj_scales": scales(hidden, inter),
        f"{prefix}.down_proj_bias": torch.randn(num_experts, hidden).bfloat16(),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gpt_oss_mxfp4_checkpoint(dtype):
    num_e, hidden, inter = 4, 128, 96
    prefix = "model.layers.0.mlp.experts"
    ckpt = gpt_oss_checkpoint(num_e, hidden, inter, prefix)
    layer = FusedMoE(
        num_e, K, hidden, inter, activation="swigluoai", has_bias=True,
        quant_config="mxfp4_w4a16", params_dtype=dtype,
    )  # fmt: skip
    assert layer.load_weights(ckpt.items()) == list(ckpt)
    w13_packed = ckpt[f"{prefix}.gate_up_proj_blocks"].reshape(num_e, 2 * inter, hidden // 2)
    w2_packed = ckpt[f"{prefix}.down_proj_blocks"].reshape(num_e, hidden, inter // 2)
    assert_equal(layer.w13_weight, w13_packed, what="w13 blocks")
    assert_equal(layer.w2_weight_scale, ckpt[f"{prefix}.down_proj_scales"], what="w2 scales")

    # by hand: nibbles (low first) -> E2M1 values * 2 ** (scale - 127)
    w13 = dequant_mxfp4(w13_packed, ckpt[f"{prefix}.gate_up_proj_scales"])
    w2 = dequant_mxfp4(w2_packed, ckpt[f"{prefix}.down_proj_scales"])
    x, logits = inputs(dtype, num_e, hidden)
    weights, ids = routing(logits)
    expected = experts_ref(
        x, w13, w2, weights, ids, activation="swigluoai",
        w13_bias=ckpt[f"{prefix}.gate_up_proj_bias"], w2_bias=ckpt[f"{prefix}.down_proj_bias"],
    )  # fmt: skip
    out = layer(x, logits)
    assert_close(out, expected, tol=1e-6 if dtype == torch.float64 else None)
    assert float(expected.abs().max()) > 1.0  # not a comparison of near-zeros


def deepseek_checkpoint(num_experts: int, hidden: int, inter: int, prefix: str) -> dict:
    """DeepSeek-V3 FP8: per expert gate / up [I, H] and down [H, I] float8_e4m3fn, each with
    float32 weight_scale_inv of its 128 x 128 blocks."""
    ckpt = {}
    for e in range(num_experts):
        for proj, (rows, k) in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            q = (torch.randn(rows, k) * 100).clamp(-448, 448).to(FP8)
            scale = torch.rand(-(-rows // 128), -(-k // 128)) * 1e-3 + 5e-4
            ckpt[f"{prefix}.{e}.{proj}.weight"] = q
            ckpt[f"{prefix}.{e}.{proj}.weight_scale_inv"] = scale
    return ckpt


def test_deepseek_fp8_block_checkpoint():
    prefix = "model.layers.3.mlp.experts"
    ckpt = deepseek_checkpoint(E, H, I, prefix)
    layer = FusedMoE(E, K, H, I, quant_config="fp8_block", params_dtype=torch.float64)
    assert sorted(layer.load_weights(ckpt.items())) == sorted(ckpt)

    def cat(e, what, *projs):
        return torch.cat([ckpt[f"{prefix}.{e}.{p}.{what}"] for p in projs])

    w13_q = torch.stack([cat(e, "weight", "gate_proj", "up_proj") for e in range(E)])
    s13 = torch.stack([cat(e, "weight_scale_inv", "gate_proj", "up_proj") for e in range(E)])
    w2_q = torch.stack([cat(e, "weight", "down_proj") for e in range(E)])
    s2 = torch.stack([cat(e, "weight_scale_inv", "down_proj") for e in range(E)])
    assert_equal(bits(layer.w13_weight), bits(w13_q), what="w13")
    assert_equal(layer.w13_weight_scale, s13, what="w13 scale")
    assert_equal(bits(layer.w2_weight), bits(w2_q), what="w2")
    assert_equal(layer.w2_weight_scale, s2, what="w2 scale")

    x, logits = inputs(torch.float64)
    weights, ids = routing(logits)
    w13, w2 = dequant_fp8_block(w13_q, s13), dequant_fp8_block(w2_q, s2)
    expected = pipeline_by_hand(x, w13, w2, weights, ids, fake_quant_fp8_group)
    assert_close(layer(x, logits), expected, tol=1e-6)


def test_fused_fp8_channel_checkpoint():
    prefix = "experts"
    w13_q = (torch.randn(E, 2 * I, H) * 100).clamp(-448, 448).to(FP8)  # a plain cast: NaN past 448
    w2_q = (torch.randn(E, H, I) * 100).clamp(-448, 448).to(FP8)
    ckpt = {
        f"{prefix}.gate_up_proj": w13_q,
        f"{prefix}.gate_up_proj_scale": torch.rand(E, 2 * I, 1) * 1e-3 + 5e-4,  # [E, N, 1] too
        f"{prefix}.down_proj": w2_q,
        f"{prefix}.down_proj_scale": (torch.rand(E, H) * 1e-3 + 5e-4).bfloat16(),  # cast: float
    }
    layer = FusedMoE(E, K, H, I, quant_config="fp8_channel", params_dtype=torch.float64)
    layer.load_weights(ckpt.items())
    s13 = ckpt[f"{prefix}.gate_up_proj_scale"].squeeze(-1)
    s2 = ckpt[f"{prefix}.down_proj_scale"].float()
    assert_equal(layer.w13_weight_scale, s13, what="w13 scale")
    assert_equal(layer.w2_weight_scale, s2, what="w2 scale")
    assert layer.w2_weight_scale.dtype == torch.float32

    x, logits = inputs(torch.float64)
    weights, ids = routing(logits)
    w13, w2 = dequant_rows(w13_q, s13), dequant_rows(w2_q, s2)
    expected = pipeline_by_hand(x, w13, w2, weights, ids, fake_quant_fp8_rows)
    assert_close(layer(x, logits), expected, tol=1e-6)


def test_fused_nvfp4_checkpoint():
    w13_q = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8)
    w2_q = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8)
    ckpt = {
        "experts.gate_up_proj": w13_q,
        "experts.gate_up_proj_scale": (torch.rand(E, 2 * I, H // 16) * 400 + 16).to(FP8),
        "experts.gate_up_proj_global_scale": torch.rand(E) * 1e-4 + 1e-4,
        "experts.down_proj": w2_q,
        "experts.down_proj_scale": (torch.rand(E, H, I // 16) * 400 + 16).to(FP8),
        "experts.down_proj_global_scale": torch.rand(E) * 1e-4 + 1e-4,
    }
    layer = FusedMoE(E, K, H, I, quant_config="nvfp4", params_dtype=torch.float64)
    layer.load_weights(ckpt.items())
    assert_equal(layer.w13_weight_global_scale, ckpt["experts.gate_up_proj_global_scale"])
    x, logits = inputs(torch.float64)
    weights, ids = routing(logits)
    w13 = dequant_nvfp4(
        w13_q, ckpt["experts.gate_up_proj_scale"], ckpt["experts.gate_up_proj_global_scale"]
    )
    w2 = dequant_nvfp4(
        w2_q, ckpt["experts.down_proj_scale"], ckpt["experts.down_proj_global_scale"]
    )
    expected = pipeline_by_hand(x, w13, w2, weights, ids, fake_quant_nvfp4)
    assert_close(layer(x, logits), expected, tol=1e-6)


# ---- checkpoint errors --------------------------------------------------------------------------
def load_one(layer: FusedMoE, name: str, tensor: torch.Tensor):
    return layer.load_weights([(name, tensor)], strict=False)  # one tensor: a part


@pytest.mark.parametrize(
    ("scheme", "name", "tensor", "error", "match"),
    [
        # float weights into a quantized layer: never cast silently
        ("fp8_channel", "experts.gate_up_proj", torch.randn(E, 2 * I, H), TypeError,
         r"experts.gate_up_proj: expected torch.float8_e4m3fn \(quantized data is not cast\), "
         "got torch.float32"),
        ("fp8_block", "experts.0.gate_proj.weight", torch.randn(I, H), TypeError,
         "expected torch.float8_e4m3fn"),
        ("fp8_block", "experts.0.w2.weight", torch.randn(H, I).bfloat16(), TypeError,
         "got torch.bfloat16"),
        ("mxfp4_w4a16", "experts.gate_up_proj", torch.randn(E, 2 * I, H), ValueError,
         r"expected shape \(4, 256, 128\), got \(4, 256, 256\)"),
        ("mxfp4_w4a16", "experts.0.w1.weight", torch.randn(I, H), ValueError,
         "per-expert mxfp4_w4a16 checkpoints are not supported"),
        # quantized data of the wrong dtype
        ("fp8_channel", "experts.down_proj", torch.zeros(E, H, I, dtype=torch.int8), TypeError,
         "expected torch.float8_e4m3fn"),
        ("int8", "experts.down_proj", torch.zeros(E, H, I, dtype=FP8), TypeError,
         "expected torch.int8"),
        ("mxfp4_w4a16", "experts.down_proj_blocks",
         torch.zeros(E, H, I // 32, 16, dtype=torch.int8), TypeError, "expected torch.uint8"),
        ("mxfp4_w4a16", "experts.down_proj_scales", torch.zeros(E, H, I // 32), TypeError,
         r"expected torch.uint8 \(quantized data is not cast\), got torch.float32"),
        ("nvfp4", "experts.down_proj_scale", torch.ones(E, H, I // 16), TypeError,
         "expected torch.float8_e4m3fn"),
        # scales whose shape does not match the weights
        ("fp8_block", "experts.1.up_proj.weight_scale_inv", torch.ones(2, 2), ValueError,
         r"experts.1.up_proj.weight_scale_inv: expected shape \(1, 2\), got \(2, 2\)"),
        ("fp8_block", "experts.gate_up_proj_scale", torch.ones(E, 2, 1), ValueError,
         r"expected shape \(4, 2, 2\), got \(4, 2, 1\)"),
        ("fp8_channel", "experts.2.down_proj.weight_scale", torch.ones(I), ValueError,
         r"expected shape \(256,\), got \(128,\)"),
        ("mxfp4_w4a16", "experts.gate_up_proj_scales", torch.zeros(E, 2 * I, 4, dtype=torch.uint8),
         ValueError, r"expected shape \(4, 256, 8\), got \(4, 256, 4\)"),
        ("nvfp4", "experts.gate_up_proj_global_scale", torch.ones(1), ValueError,
         r"expected shape \(4,\), got \(1,\)"),
        # blocks / global scales into a layer of another scheme
        ("fp8_block", "model.experts.gate_up_proj_blocks",
         torch.zeros(E, 2 * I, H // 32, 16, dtype=torch.uint8), ValueError,
         r"\*_blocks / \*_scales are MXFP4 tensors; the layer is fp8_block"),
        ("nvfp4", "experts.down_proj_scales", torch.zeros(E, H, I // 32, dtype=torch.uint8),
         ValueError, "MXFP4 tensors; the layer is nvfp4"),
        ("fp8_channel", "experts.gate_up_proj_global_scale", torch.ones(E), ValueError,
         "only NVFP4 weights have a global scale"),
        ("fp8_block", "experts.9.gate_proj.weight", torch.zeros(I, H, dtype=FP8), ValueError,
         "expert 9 out of range"),
    ],
)  # fmt: skip
def test_bad_quantized_checkpoints(scheme, name, tensor, error, match):
    layer = FusedMoE(E, K, H, I, quant_config=scheme)
    before = snapshot(layer)
    with pytest.raises(error, match=match):
        load_one(layer, name, tensor)
    after = snapshot(layer)
    assert all(torch.equal(after[k][1], v[1]) for k, v in before.items()), "nothing loaded"


@pytest.mark.parametrize("proj", ["gate_proj", "up_proj"])
def test_per_expert_block_scales_need_whole_blocks_of_intermediate(proj):
    inter = 192  # gate rows [0, 192) and up rows [192, 384) would share the block [128, 256)
    layer = FusedMoE(E, K, H, inter, quant_config="fp8_block")
    with pytest.raises(ValueError, match="intermediate_size 192 is not a multiple of 128"):
        load_one(layer, f"experts.0.{proj}.weight_scale_inv", torch.ones(2, 2))
    # the fused names carry one scale tensor for both: those load
    load_one(layer, "experts.gate_up_proj_scale", torch.ones(E, 3, 2))
    # and the down projection's K = 192 is a partial block: [H/128, ceil(192/128)]
    load_one(layer, "experts.0.down_proj.weight_scale_inv", torch.ones(2, 2))


def test_per_expert_checkpoints_of_swigluoai_are_refused():
    layer = FusedMoE(E, K, H, I, activation="swigluoai", quant_config="fp8_channel")
    with pytest.raises(ValueError, match="per-expert fp8_channel checkpoints are not supported"):
        load_one(layer, "experts.0.gate_proj.weight", torch.zeros(I, H, dtype=FP8))


@pytest.mark.parametrize(
    ("name", "tensor"),
    [
        ("experts.gate_up_proj_blocks", torch.zeros(E, 2 * I, H // 32, 16, dtype=torch.uint8)),
        ("experts.0.gate_proj.weight_scale_inv", torch.ones(1, 2)),
        ("experts.down_proj_scale", torch.ones(E, H)),
    ],
)
def test_quantized_checkpoints_into_an_unquantized_layer(name, tensor):
    layer = FusedMoE(E, K, H, I)
    with pytest.raises(ValueError, match=f"{name}: not a weight of this FusedMoE layer"):
        load_one(layer, name, tensor)


def test_make_quant_config_of_loaded_scales_matches_the_layer():
    """The layer's quant_config is make_quant_config of its buffers (the checkpoint's scales)."""
    ckpt = deepseek_checkpoint(E, H, I, "experts")
    layer = FusedMoE(E, K, H, I, quant_config="fp8_block", params_dtype=torch.float32)
    layer.load_weights(ckpt.items())
    qc = make_quant_config("fp8_block", layer.w13_weight_scale, layer.w2_weight_scale)
    x, logits = inputs(torch.float32)
    weights, ids = routing(logits)
    expected = fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids, quant_config=qc)
    assert_close(layer(x, logits), expected, torch.float32)
