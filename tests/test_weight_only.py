"""The weight-only schemes on the triton backend (fusedmoe.kernels.wo_moe): MXFP4, NVFP4, INT4
(symmetric or with zero points) and INT8 (per channel or group) weights dequantized inside the
GEMMs, against the float64 torch backend on the same quantized weights.

Without a GPU the kernels run on Triton's CPU interpreter (small shapes: K not a multiple of
the K tile, one token (direct rows) and several, empty slots, an expert_map); the `gpu` tests
run the compiled kernels at gpt-oss-120b's size, in CUDA graphs and under torch.compile, and
check that no dequantized copy of the weights is ever made.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from fusedmoe import FusedMoE, fused_experts, select_backend
from fusedmoe.activation import MoEActivation
from fusedmoe.kernels import wo_moe
from fusedmoe.kernels.wo_moe import WoConfig, WoGemmConfig, use_wo_config, wo_kernel_config
from fusedmoe.quant import quantize_experts
from tests.helpers import assert_close, random_routing
from tests.reference import random_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: (scheme, quantize_experts options)
VARIANTS = [
    ("mxfp4_w4a16", {}),
    ("nvfp4_w4a16", {}),
    ("int4_w4a16", {"group_size": 32}),
    ("int4_w4a16", {"group_size": 64, "zero_points": True}),
    ("int4_w4a16", {"group_size": 128, "zero_points": True}),
    ("int8_w8a16", {}),
    ("int8_w8a16", {"group_size": 32}),
]
IDS = [f"{s}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for s, o in VARIANTS]


def _experts(scheme, options, e, h, i, activation, bias, device=DEVICE):
    ex = random_experts(e, h, i, activation, dtype=torch.float32, bias=bias)
    q13, q2, qc = quantize_experts(ex["w13"].to(device), ex["w2"].to(device), scheme, **options)

    def b(t):
        return None if t is None else t.to(device, torch.bfloat16)

    return q13, q2, qc, b(ex["w13_bias"]), b(ex["w2_bias"])


def _both(x, q13, q2, weights, ids, qc, **kw):
    out = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="triton", **kw)
    ref = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="torch", **kw)
    return out, ref


@pytest.mark.parametrize(("scheme", "options"), VARIANTS, ids=IDS)
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_matches_reference(scheme, options, num_tokens):
    """silu, K = 192 (not a multiple of the 128-wide K tile; 256 for 128-wide groups), one
    token (direct rows) and 9."""
    e, i, k = 5, 128, 2
    h = 256 if options.get("group_size") == 128 else 192
    q13, q2, qc, _, _ = _experts(scheme, options, e, h, i, "silu", False)
    x = torch.randn(num_tokens, h, device=DEVICE).to(torch.bfloat16)
    weights, ids = random_routing(num_tokens, e, k, device=DEVICE)
    out, ref = _both(x, q13, q2, weights, ids, qc)
    assert_close(out, ref, torch.bfloat16, tol=1e-2)


@pytest.mark.parametrize(("scheme", "options"), VARIANTS[:4], ids=IDS[:4])
def test_gpt_oss_activation_biases_and_gaps(scheme, options):
    """swigluoai (interleaved gate / up rows) with both biases, empty slots and an expert_map
    that leaves some experts to another rank."""
    e, h, i, k, m = 6, 128, 64, 3, 11
    q13, q2, qc, b13, b2 = _experts(scheme, options, e, h, i, "swigluoai", True)
    x = torch.randn(m, h, device=DEVICE).to(torch.bfloat16)
    weights, ids = random_routing(m, 8, k, empty=0.2, device=DEVICE)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5], dtype=torch.int32, device=DEVICE)
    kw = dict(activation="swigluoai", w13_bias=b13, w2_bias=b2, expert_map=expert_map)
    out, ref = _both(x, q13, q2, weights, ids, qc, **kw)
    assert ref.abs().max() > 0
    assert_close(out, ref, torch.bfloat16, tol=1e-2)


GEMV = WoConfig(16, WoGemmConfig(64, 64, 1, 4, 2), WoGemmConfig(64, 64, 1, 4, 2),
                gemv=WoGemmConfig(16, 64, 1, 4, 1))  # fmt: skip
TILES = WoConfig(16, WoGemmConfig(32, 64, 2, 4, 2), WoGemmConfig(32, 128, 2, 8, 2))
#: 64 x 128 tiles, 4 warps: the weights reach wgmma in the load's registers (MMA_ORDER)
MMA_TILES = WoConfig(16, WoGemmConfig(64, 128, 2, 4, 2), WoGemmConfig(64, 128, 2, 4, 2))


@pytest.mark.parametrize(
    "config", [GEMV, TILES, MMA_TILES], ids=["decode-kernel", "tensor-cores", "mma-order"]
)
@pytest.mark.parametrize(("scheme", "options"), [VARIANTS[0], VARIANTS[3], VARIANTS[5]],
                         ids=[IDS[0], IDS[3], IDS[5]])  # fmt: skip
def test_both_kernels(config, scheme, options, monkeypatch):
    """Each kernel on the same call, whatever the heuristic would pick: the decode kernel (one
    slot per program; for MXFP4 x bf16 on Hopper the one-slot form in its place) and the
    tensor-core one, swigluoai with biases, empty slots and an expert_map, K = 192 (not a
    multiple of the 128-wide K step)."""
    e, h, i, k, m = 6, 192, 64, 3, 9
    q13, q2, qc, b13, b2 = _experts(scheme, options, e, h, i, "swigluoai", True)
    x = torch.randn(m, h, device=DEVICE).to(torch.bfloat16)
    weights, ids = random_routing(m, 8, k, empty=0.2, device=DEVICE)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5], dtype=torch.int32, device=DEVICE)
    kw = dict(activation="swigluoai", w13_bias=b13, w2_bias=b2, expert_map=expert_map)
    monkeypatch.setattr(wo_moe, "_MMA_ORDER", config is MMA_TILES)  # opt-in path, checked here
    with use_wo_config(config):
        out = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="triton", **kw)
    ref = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="torch", **kw)
    assert_close(out, ref, torch.bfloat16, tol=1e-2)


def test_tuned_tables(tmp_path, monkeypatch):
    """A table of the shape and GPU (the moe_config layout, dtype wo_<format>) gives the entry
    of the nearest token count; without one, the heuristic; a malformed one, a clear error.
    Every shipped weight-only table parses."""
    from fusedmoe.kernels.moe_config import SHIPPED_DIR, TUNED_CONFIGS_ENV, table_path

    for shipped in SHIPPED_DIR.glob("*/E=*,dtype=wo_*.json"):
        assert wo_moe._load_wo_table(str(shipped))
    monkeypatch.setenv(TUNED_CONFIGS_ENV, str(tmp_path))
    path = table_path(tmp_path, "GPU X", 8, 256, 128, wo_moe.table_dtype("int4"))
    path.parent.mkdir(parents=True)
    small, large = GEMV, TILES
    path.write_text(json.dumps({"1": small.to_json(), "4096": large.to_json()}))
    assert wo_kernel_config(3, 2, 8, 256, 128, "int4", "GPU X") == small
    assert wo_kernel_config(3000, 2, 8, 256, 128, "int4", "GPU X") == large
    assert wo_kernel_config(3, 2, 8, 256, 128, "int4", "GPU Y") == wo_moe.heuristic_wo_config(
        3, 2, 8
    )
    path.write_text(json.dumps({"1": {"block_m": 16}}))
    wo_moe._load_wo_table.cache_clear()
    wo_moe._resolved.cache_clear()
    with pytest.raises(ValueError, match="not a weight-only kernel config"):
        wo_kernel_config(5, 2, 8, 256, 128, "int4", "GPU X")
    wo_moe._load_wo_table.cache_clear()
    wo_moe._resolved.cache_clear()


@pytest.mark.parametrize(
    ("scheme", "options"), [("int4_w4a16", {"group_size": 32}), ("mxfp4_w4a16", {})]
)
def test_fp16_and_non_gated(scheme, options):
    """fp16 activations (on the GPU: Triton-op decoding, MXFP4 through tl.dot_scaled), a
    non-gated activation (one accumulator)."""
    e, h, i, k, m = 4, 128, 96, 2, 6
    q13, q2, qc, _, _ = _experts(scheme, options, e, h, i, "relu2_no_mul", False)
    x = torch.randn(m, h, device=DEVICE).to(torch.float16)
    weights, ids = random_routing(m, e, k, device=DEVICE)
    out, ref = _both(x, q13, q2, weights, ids, qc, activation="relu2_no_mul")
    assert_close(out, ref, torch.float16, tol=1e-2)


def test_nibble_order_matters():
    """The check can fail: the same codes with the nibbles of each byte swapped give another
    function, which the reference sees and the comparison rejects."""
    e, h, i, k, m = 3, 64, 64, 2, 4
    q13, q2, qc, _, _ = _experts("mxfp4_w4a16", {}, e, h, i, "silu", False)
    swapped = (q13 >> 4) | (q13 << 4)
    x = torch.randn(m, h, device=DEVICE).to(torch.bfloat16)
    weights, ids = random_routing(m, e, k, device=DEVICE)
    out = fused_experts(x, swapped, q2, weights, ids, quant_config=qc, backend="triton")
    ref = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="torch")
    with pytest.raises(AssertionError):
        assert_close(out, ref, torch.bfloat16, tol=1e-2)


def test_oracle_runs_weight_only_on_triton_on_cuda():
    *_, qc, _, _ = _experts("mxfp4_w4a16", {}, 4, 64, 64, "silu", False, device="cpu")
    kw = dict(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2, quant_config=qc)
    assert select_backend(device="cuda", **kw).name == "triton"
    assert select_backend(device="cpu", **kw).name == "torch"


# ---- GPU: full size, graphs, compile, memory ----------------------------------------------------


def _gpt_oss_layer(scheme, **options):
    torch.manual_seed(0)
    layer = FusedMoE(
        num_experts=128, top_k=4, hidden_size=2880, intermediate_size=2880,
        activation="swigluoai", has_bias=True, params_dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    with torch.no_grad():
        for p in (layer.w13_weight, layer.w2_weight):
            p.normal_(0, p.shape[-1] ** -0.5)
        layer.w13_bias.normal_(0, 0.1)
        layer.w2_bias.normal_(0, 0.1)
    return layer.quantize_(scheme, **options)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("mxfp4_w4a16", {}),
        ("nvfp4_w4a16", {}),
        ("int4_w4a16", {"group_size": 64, "zero_points": True}),
    ],
)
def test_gpt_oss_size_graph_and_memory(scheme, options):
    """gpt-oss-120b's shape: the oracle picks triton; 1, 64 and 2048 tokens equal the torch
    backend; a CUDA-graph replay with new inputs equals eager; a decode call allocates far less
    than a dequantized copy of one expert's weights would take."""
    layer = _gpt_oss_layer(scheme, **options)
    assert layer.backend_choice().name == "triton", layer.backend_choice().explain()
    with torch.no_grad():
        for m in (1, 64, 2048):
            x = torch.randn(m, 2880, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(m, 128, device="cuda")
            out = layer(x, logits)
            layer.set_backend("torch")
            ref = layer(x, logits)
            layer.set_backend("auto")
            assert_close(out, ref, torch.bfloat16, tol=2e-2)

        x = torch.randn(8, 2880, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(8, 128, device="cuda")
        layer(x, logits)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        static_x, static_logits = x.clone(), logits.clone()
        with torch.cuda.graph(graph):
            static_out = layer(static_x, static_logits)
        static_x.copy_(torch.randn_like(x))
        static_logits.copy_(torch.randn_like(logits))
        graph.replay()
        assert_close(static_out, layer(static_x, static_logits), torch.bfloat16, tol=1e-6)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        layer(x[:1], logits[:1])
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        one_expert_bf16 = 3 * 2880 * 2880 * 2
        assert extra < one_expert_bf16 / 4, f"a decode call allocated {extra} bytes"


@pytest.mark.gpu
def test_compiles():
    e, h, i, k, m = 8, 256, 128, 2, 33
    q13, q2, qc, b13, b2 = _experts("mxfp4_w4a16", {}, e, h, i, "swigluoai", True)
    x = torch.randn(m, h, device="cuda").to(torch.bfloat16)
    weights, ids = random_routing(m, e, k, device="cuda")

    def f(x, weights, ids):
        return fused_experts(
            x, q13, q2, weights, ids, quant_config=qc, backend="triton",
            activation="swigluoai", w13_bias=b13, w2_bias=b2,
        )  # fmt: skip

    eager = f(x, weights, ids)
    compiled = torch.compile(f, fullgraph=True)(x, weights, ids)
    assert_close(compiled, eager, torch.bfloat16, tol=1e-6)


@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("int4_w4a16", {"group_size": 32, "zero_points": True}),
        ("int4_w4a16", {"group_size": 64}),
        ("int8_w8a16", {"group_size": 32}),
    ],
)
def test_fused_checkpoint_names_round_trip(scheme, options):
    """A layer's own tensors, under transformers 5's fused names, load back into a layer of the
    same group size (4-bit packed, zero points included) and leave its output unchanged."""
    from fusedmoe import FusedMoE

    layer = FusedMoE(8, 2, 128, 64, quant_config=scheme, quant_options=options)
    names = {"gate_up_proj": "w13", "down_proj": "w2"}
    state = []
    for name, prefix in names.items():
        state.append((f"experts.{name}", getattr(layer, f"{prefix}_weight").clone()))
        state.append((f"experts.{name}_scale", getattr(layer, f"{prefix}_weight_scale").clone()))
        if options.get("zero_points"):
            zero = getattr(layer, f"{prefix}_weight_zero_point").clone()
            state.append((f"experts.{name}_zero_point", zero))
    x, logits = torch.randn(3, 128).to(torch.bfloat16), torch.randn(3, 8)
    with torch.no_grad():
        before = layer(x, logits)
        for param in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
            getattr(layer, param).zero_()
        layer.load_weights(state)
        assert torch.equal(layer(x, logits), before)


def test_zero_points_refused_where_they_do_not_fit():
    """Zero points into a symmetric layer, and zero points past 15, are refused clearly."""
    from fusedmoe import FusedMoE
    from fusedmoe.quant import make_quant_config

    layer = FusedMoE(8, 2, 128, 64, quant_config="int4_w4a16", quant_options={"group_size": 32})
    zero = torch.zeros(8, 128, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="has no zero points"):
        layer.load_weights([("experts.gate_up_proj_zero_point", zero)])
    s13, s2 = torch.ones(8, 128, 4), torch.ones(8, 128, 2)
    bad = torch.full((8, 128, 4), 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"lie in \[0, 15\], got 16"):
        make_quant_config("int4_w4a16", s13, s2, group_size=32, w1_zero_point=bad)


def test_reference_on_a_gpu_warns_once():
    """A quantized scheme that no GPU backend runs (nvfp4: FP4 activations) goes to the torch
    reference on CUDA with a ReferenceFallbackWarning, shown once under the default filters."""
    import warnings

    from fusedmoe import oracle

    *_, qc, _, _ = _experts("nvfp4", {}, 4, 64, 64, "gelu", False, device="cpu")
    kw = dict(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2, quant_config=qc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # once per message and place, as users see it
        for _ in range(3):
            choice = select_backend(device="cuda", activation="gelu", **kw)
        select_backend(device="cpu", activation="gelu", **kw)  # the CPU: no warning
    assert choice.name == "torch"
    found = [w for w in caught if issubclass(w.category, oracle.ReferenceFallbackWarning)]
    assert len(found) == 1 and "nvfp4" in str(found[0].message)


@pytest.mark.gpu
def test_reference_refuses_graph_capture():
    """The reference cannot be captured (it groups rows on the host): a clear error, not a
    copy error from deep inside torch."""
    q13, q2, qc, _, _ = _experts("nvfp4", {}, 4, 64, 64, "silu", False)
    x = torch.randn(4, 64, device="cuda").to(torch.bfloat16)
    weights, ids = random_routing(4, 4, 2, device="cuda")
    fused_experts(x, q13, q2, weights, ids, quant_config=qc)  # eager: runs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"),
        torch.cuda.graph(graph),
    ):
        fused_experts(x, q13, q2, weights, ids, quant_config=qc)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h", "i", "m", "activation", "skew"),
    [
        (2880, 2880, 2, "swigluoai", False),  # gpt-oss: K = 2880, not a multiple of 128
        (2880, 2880, 37, "swigluoai", True),
        (192, 320, 300, "silu", False),  # K = 192: one and a half K steps
        (64, 64, 1000, "swigluoai", True),  # K < one K step
        (256, 320, 64, "gelu", False),
        (256, 320, 64, "relu2_no_mul", True),  # not gated
        (256, 320, 300, "relu2_no_mul", False),  # not gated, in the prefill form too
        (160, 256, 33, "silu", False),  # K not a multiple of 64: the Triton kernels run
    ],
)
@pytest.mark.parametrize("block_m", [None, 16, 128])
def test_mx_hopper_kernel(h, i, m, activation, skew, block_m, monkeypatch):
    """MXFP4 x bf16 on Hopper: wo_hopper's Gluon kernel against the Triton kernels and the
    float64 torch twin on the same call, with biases, empty slots, an expert_map, K and N not
    multiples of the 256-wide step, 2 tokens and many, uniform and skewed routing (most slots
    on one expert); a hidden size it cannot take goes to the Triton kernels."""
    from fusedmoe.kernels import wo_hopper

    dev = torch.zeros(1, device="cuda")
    if wo_hopper.gluon is None or wo_hopper._device_reason(dev.device.index or 0) is not None:
        pytest.skip("the Gluon kernel needs Hopper and Triton 3.6")
    e, k = 8, 4
    q13, q2, qc, b13, b2 = _experts("mxfp4_w4a16", {}, e, h, i, activation, True)
    x = torch.randn(m, h, device="cuda").to(torch.bfloat16)
    weights, ids = random_routing(m, 10, k, empty=0.1, device="cuda")
    if skew:
        hot = ids[: m * 3 // 4]
        hot[:, 1:] = torch.where(hot[:, 1:] == 3, 9, hot[:, 1:])
        hot[:, 0] = 3
    expert_map = torch.tensor([0, 1, -1, 2, 3, 4, -1, 5, 6, 7], dtype=torch.int32, device="cuda")
    kw = dict(activation=activation, w13_bias=b13, w2_bias=b2, expert_map=expert_map)
    ran = []  # the tile of each launch
    launch = wo_hopper.launch_mx_hopper
    monkeypatch.setattr(
        wo_hopper, "launch_mx_hopper", lambda *a, **k: ran.append(a[9]) or launch(*a, **k)
    )
    if block_m is None:  # the table's tile
        out = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="triton", **kw)
    else:  # both forms of the kernel: decode (<= 64 slots a tile), prefill (128)
        gemm = WoGemmConfig(64, 128, 8, 4, 2)
        with use_wo_config(WoConfig(block_m, gemm, gemm)):
            out = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="triton", **kw)
    assert bool(ran) == (h % 64 == 0), "the Gluon kernel ran where it should not, or did not"
    if ran and block_m == 128:  # the prefill form where experts see 128 slots on average
        assert (128 in ran) == (m * k >= 128 * 8), ran
    monkeypatch.setattr(wo_hopper, "_ENABLED", False)
    triton_out = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="triton", **kw)
    ref = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="torch", **kw)
    assert ref.abs().max() > 0
    assert_close(out, ref, torch.bfloat16, tol=1e-2)
    assert_close(out, triton_out, torch.bfloat16, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("h", "i", "m", "activation", "extras"),
    [
        (2880, 2880, 1, "swigluoai", True),  # gpt-oss at one token
        (192, 320, 1, "silu", True),  # K = 192: a step and a half
        (64, 64, 2, "swigluoai", True),  # K < one step; two tokens: a program a slot
        (256, 320, 2, "relu2_no_mul", False),  # not gated; no expert_map, no biases
        (64, 128, 3, "swigluoai", False),  # three tokens: blocks of slots
        (256, 320, 5, "relu2_no_mul", True),  # not gated, in blocks
        (192, 320, 11, "silu", True),  # every token on the same experts: blocks of 8 and of 3
        # K = 832: unmasked rounds (CB 16), then a masked tail; tiles 2: GEMM2's last tile
        # half past N (832 = 6.5 x 128); the last: blocks, both GEMMs with unmasked rounds
        (832, 320, 1, "swigluoai", True),
        (832, 320, 5, "silu", True),
        (832, 832, 5, "swigluoai", True),
    ],
)
@pytest.mark.parametrize(("tiles", "cb"), [(1, 16), (2, 16), (1, 32)])
def test_mx_gemv_kernel(h, i, m, activation, extras, tiles, cb, monkeypatch):
    """MXFP4 x bf16 on Hopper at decode: wo_hopper_gemv's one-slot form (mma.sync) against what
    runs without it (the CUDA-core GEMV at one token, the decode form from two) and the
    float64 torch twin on the same call, for each of its tiles: a program a slot up to
    wo_moe.GEMV_DIRECT_MAX_TOKENS tokens, blocks of an expert's slots above (an expert every
    token shares included); empty slots; biases and an expert_map or neither; x a view whose
    rows are not 4-byte aligned (the launcher copies it). The shared workspaces are poisoned
    before each call, so that no result can come from an earlier one."""
    from fusedmoe.kernels import wo_hopper
    from fusedmoe.modular import shared_workspaces
    from tests.helpers import poison_

    dev = torch.zeros(1, device="cuda")
    if wo_hopper.gluon is None or wo_hopper._device_reason(dev.device.index or 0) is not None:
        pytest.skip("the Gluon kernel needs Hopper and Triton 3.6")
    e, k = 8, 4
    q13, q2, qc, b13, b2 = _experts("mxfp4_w4a16", {}, e, h, i, activation, extras)
    x = torch.randn(m, h + 1, device="cuda").to(torch.bfloat16)[:, 1:]  # misaligned rows
    weights, ids = random_routing(m, 10 if extras else e, k, empty=0.1, device="cuda")
    if m > 8:  # every token on the first token's experts
        ids[:] = ids[0]
    kw = dict(activation=activation)
    if extras:
        emap = torch.tensor([0, 1, -1, 2, 3, 4, -1, 5, 6, 7], dtype=torch.int32, device="cuda")
        kw.update(w13_bias=b13, w2_bias=b2, expert_map=emap)
    modes = []  # per launch: a program a slot (None) or blocks (the routing)
    launch = wo_hopper.launch_mx_gemv
    monkeypatch.setattr(
        wo_hopper, "launch_mx_gemv", lambda *a, **kw_: modes.append(a[11]) or launch(*a, **kw_)
    )

    def call():
        for buf in shared_workspaces().buffers.values():
            poison_(buf)
        return fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="triton", **kw)

    gemm = WoGemmConfig(64, 64, 8, 4, 2)
    config = WoConfig(16, gemm, gemm, gemv=WoGemmConfig(8, 256, 1, 4, 1))
    with use_wo_config(config), wo_hopper.use_one_slot_tile(tiles, cb):
        out = call()
        assert len(modes) == 2, "the one-slot form did not run both GEMMs"
        direct = m <= wo_moe.GEMV_DIRECT_MAX_TOKENS
        assert all((mode is None) == direct for mode in modes), modes
        monkeypatch.setattr(wo_moe, "_GEMV_MMA", False)
        without = call()
    assert len(modes) == 2
    ref = fused_experts(x, q13, q2, weights, ids, quant_config=qc, backend="torch", **kw)
    assert ref.abs().max() > 0
    assert_close(out, ref, torch.bfloat16, tol=1e-2)
    assert_close(out, without, torch.bfloat16, tol=1e-2)


def test_one_slot_tile_override():
    """wo_hopper.use_one_slot_tile: the tile it sets holds in its scope only, nested scopes
    restore the outer one, and a tile the kernel does not take is refused before any launch."""
    from fusedmoe.kernels import wo_hopper

    assert wo_hopper._one_slot_tile.get() is None
    with wo_hopper.use_one_slot_tile(2, 16):
        assert wo_hopper._one_slot_tile.get() == (2, 16)
        with wo_hopper.use_one_slot_tile(1, 32):
            assert wo_hopper._one_slot_tile.get() == (1, 32)
        assert wo_hopper._one_slot_tile.get() == (2, 16)
    assert wo_hopper._one_slot_tile.get() is None
    for tiles, cb in ((3, 16), (1, 8), (0, 32)):
        with pytest.raises(ValueError, match="tiles 1 or 2 and cb 16 or 32"):
            wo_hopper.use_one_slot_tile(tiles, cb).__enter__()
    assert wo_hopper._one_slot_tile.get() is None


def test_permute_k_round_trip():
    """wo_hopper.permute_k: a permutation of each 64-column block, k(t) = 16c + 4s + 2b + h, and
    the form that writes into a given tensor agrees."""
    from fusedmoe.kernels import wo_hopper

    x = torch.arange(3 * 128, dtype=torch.float32).view(3, 128)
    p = wo_hopper.permute_k(x)
    for t in range(64):
        s, h, c, b = t // 16, (t // 8) % 2, (t // 2) % 4, t % 2
        assert p[1, 64 + t] == x[1, 64 + 16 * c + 4 * s + 2 * b + h]
    assert sorted(p[2].tolist()) == x[2].tolist()
    out = torch.empty_like(x)
    assert torch.equal(wo_hopper.permute_k(x, out), p) and torch.equal(out, p)
    strided = torch.arange(3 * 256, dtype=torch.float32).view(128, 6).t()[:, :128]
    assert torch.equal(wo_hopper.permute_k(strided), wo_hopper.permute_k(strided.contiguous()))


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("width", [256, 320, 96])  # whole groups, a partial last one, < 128
def test_fp8_round_trip_of_a2(width, use_ue8m0):
    """wo_moe._fp8_round_trip (mxfp4_w4a8's intermediate on wo_hopper): each 1 x 128 group
    quantized to FP8 and read back, the partial last group included, float32 or UE8M0 scales;
    and it is the identity on values already on that grid."""
    from fusedmoe.quant.activation import per_token_group_quant_fp8_torch

    a = (torch.randn(5, width) * torch.logspace(-3, 2, width)).to(torch.bfloat16)
    q, scale = per_token_group_quant_fp8_torch(a, 128, use_ue8m0=use_ue8m0)
    want = torch.empty(5, width)
    for g in range(scale.shape[1]):
        cols = slice(128 * g, min(128 * (g + 1), width))
        want[:, cols] = q[:, cols].float() * scale[:, g : g + 1]
    got = a.clone()
    wo_moe._fp8_round_trip(got, 128, use_ue8m0)
    assert torch.equal(got, want.to(torch.bfloat16))
    assert not torch.equal(got, a)  # the round trip changed something
    again = got.clone()
    wo_moe._fp8_round_trip(again, 128, use_ue8m0)
    if use_ue8m0:  # power-of-two scales: the grid is closed under the round trip
        assert torch.equal(again, got)
    colmajor = scale.t().contiguous().t()
    assert torch.equal(wo_moe.dequantize_groups(q, colmajor, 128), want)


def test_a2_fp8_group_is_checked():
    """a2_fp8_group must be a multiple of 64 and needs wo_hopper's kernel: on the CPU it raises."""
    x = torch.randn(4, 64).to(torch.bfloat16)
    q13, q2, qc, _, _ = _experts("mxfp4_w4a16", {}, 2, 64, 64, "silu", False, device="cpu")
    weights, ids = random_routing(4, 2, 1)
    common = dict(
        w_format="mxfp4", group=32, w13_scale=qc.w1.scale, w2_scale=qc.w2.scale,
        activation=MoEActivation("silu"), params=(1.0, 0.0, 0.0, False),
        workspace13=torch.empty(4, 64, dtype=torch.bfloat16),
        workspace2=torch.empty(4, 64, dtype=torch.bfloat16),
    )  # fmt: skip
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        wo_moe.fused_experts_weight_only(out, x, q13, q2, weights, ids, a2_fp8_group=32, **common)
    with pytest.raises(ValueError, match="wo_hopper's kernel only"):
        wo_moe.fused_experts_weight_only(out, x, q13, q2, weights, ids, a2_fp8_group=128, **common)


def _run_ptx(asm: str, inputs: dict[int, int]) -> dict[int, int]:
    """A bit-exact model of the few PTX instructions the decode strings use (mov, prmt with a
    zero second word, shl, and, min.u32, mul.lo.u32, mad.lo.u32, lop3, fma.rn.bf16x2): 32-bit
    registers by name, $n operands from `inputs`; returns the $n registers written."""
    regs: dict[str, int] = {f"${n}": v for n, v in inputs.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    def bf16(bits: int) -> torch.Tensor:
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    def bf16x2_fma(a: int, b: int, c: int) -> int:
        out = 0
        for half in (0, 16):
            x, y, z = (bf16((v >> half) & 0xFFFF).float() for v in (a, b, c))
            r = (x * y + z).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF  # 1 rounding
            out |= r << half
        return out

    for line in asm.strip().splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        m = 0xFFFFFFFF
        if op == "mov.b32":
            r = val(src[0])
        elif op == "prmt.b32":
            assert val(src[1]) == 0
            word, sel = val(src[0]), val(src[2])
            r = 0
            for i in range(4):
                s = (sel >> (4 * i)) & 0xF
                assert s < 8  # no sign-replicating selectors
                r |= ((word >> (8 * s)) & 0xFF if s < 4 else 0) << (8 * i)
        elif op == "shl.b32":
            r = (val(src[0]) << val(src[1])) & m
        elif op == "and.b32":
            r = val(src[0]) & val(src[1])
        elif op == "mul.lo.u32":
            r = (val(src[0]) * val(src[1])) & m
        elif op == "mad.lo.u32":
            r = (val(src[0]) * val(src[1]) + val(src[2])) & m
        elif op == "min.u32":
            r = min(val(src[0]), val(src[1]))
        elif op == "lop3.b32":
            a, b, c, lut = (val(t) for t in src)
            r = 0
            for bit in range(32):
                idx = ((a >> bit & 1) << 2) | ((b >> bit & 1) << 1) | (c >> bit & 1)
                r |= ((lut >> idx) & 1) << bit
        elif op == "fma.rn.bf16x2":
            r = bf16x2_fma(*(val(t) for t in src))
        else:
            raise AssertionError(f"instruction not modelled: {op}")
        regs[d] = r
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


@pytest.mark.parametrize("times_2_126, word_scale", [(True, False), (False, False), (False, True)])
def test_fp4_decode_ptx_is_exact(times_2_126, word_scale):
    """The E2M1 decode strings shared by the Triton and Gluon kernels (wo_gemm.fp4_asm), run on a
    bit-exact model of their instructions: every byte value in every position, fresh scales."""
    from fusedmoe.kernels.wo_gemm import fp4_asm
    from fusedmoe.quant.formats import E2M1_VALUES

    asm = fp4_asm(times_2_126, word_scale)
    table = [v for sign in (1.0, -1.0) for v in (sign * m for m in E2M1_VALUES)]
    gen = torch.Generator().manual_seed(11)
    words = list(range(256)) + torch.randint(0, 2**32, (200,), generator=gen).tolist()
    # every byte value in byte positions 1..3 too
    words += [b << 8 for b in range(256)] + [b << 16 | 0x5A for b in range(256)]
    words += [b << 24 | 0xA5 << 8 for b in range(256)]
    for word in words:
        if times_2_126:  # the scale 2^(c - 127) of E8M0 code c
            codes = torch.randint(100, 150, (4,), generator=gen)
            scales = [2.0 ** (int(c) - 127) for c in codes]
        else:  # wo_hopper's 2^(c - 65), the product e2m1 * 2^(c - 191), for codes 59 .. 192
            codes = torch.randint(59, 193, (4,), generator=gen)
            if word_scale:  # bytes 0, 1 share a scale, as do 2, 3
                codes[1], codes[3] = codes[0], codes[2]
            scales = [2.0 ** (int(c) - 65) for c in codes]
        bits = [
            torch.tensor([s]).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF for s in scales
        ]
        if word_scale:  # $6 and $8 must not be read: garbage there
            regs = {4: word, 5: bits[0] * 0x10001, 6: 0x7FC07FC0, 7: bits[2] * 0x10001}
            regs[8] = 0x7FC07FC0
        else:
            regs = {4: word, 5: bits[0] | bits[1] << 16, 6: bits[2] | bits[3] << 16}
        out = _run_ptx(asm, regs)
        nib = [(word >> (8 * byte + 4 * high)) & 0xF for high in (0, 1) for byte in range(4)]
        shift = 127 if times_2_126 else 191
        want = [table[n] * 2.0 ** (int(codes[i % 4]) - shift) for i, n in enumerate(nib)]
        got = [(out[reg] >> half) & 0xFFFF for reg in range(4) for half in (0, 16)]
        # (low of 0, 1), (low of 2, 3), (high of 0, 1), (high of 2, 3), compared as bits (-0.0)
        want_bits = [
            torch.tensor([w]).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF for w in want
        ]
        assert got == want_bits, (hex(word), got, want_bits)


def test_scale_pair_ptx():
    """wo_hopper's E8M0 code -> bf16 2^(code - 65) twice in an int32, on the PTX model: every
    code; exact for 59 .. 192 (the kernel's documented range), infinity above."""
    from fusedmoe.kernels.wo_hopper import SCALE_PAIR_ASM

    for code in range(256):
        r = _run_ptx(SCALE_PAIR_ASM.value, {1: code})[0]
        assert r >> 16 == r & 0xFFFF
        value = torch.tensor([r & 0xFFFF], dtype=torch.int32).to(torch.int16)
        value = value.view(torch.bfloat16).double().item()
        if 59 <= code <= 192:
            assert value == 2.0 ** (code - 65), code
        elif code > 192:
            assert value == float("inf"), code


def test_hopper_block_m():
    """The tile for a weight-only config on Hopper: the config's up to 64 slots; above 64, 128
    (the prefill form) where experts see 128 slots or more on average, else 64;
    launch_mx_hopper refuses any other tile before it reads its tensors."""
    from fusedmoe.kernels.wo_hopper import hopper_block_m, launch_mx_hopper

    assert hopper_block_m(16, 10_000, 8) == 16
    assert hopper_block_m(64, 10_000, 8) == 64
    assert hopper_block_m(128, 128 * 8, 8) == 128
    assert hopper_block_m(128, 128 * 8 - 1, 8) == 64
    assert hopper_block_m(512, 10_000, 8) == 128
    assert hopper_block_m(96, 10_000, 8) == 128
    for block_m in (96, 256):
        with pytest.raises(ValueError, match=f"block_m {block_m}"):
            launch_mx_hopper(*[None] * 9, block_m, 8, {}, False)
