"""load_weights of GPTQ and AWQ checkpoints into int4_w4a16 / int8_w8a16 layers.

Every test quantizes fresh random float experts with the reference GPTQ / AWQ convention
written here (integer codes, scales and zero points per 1 x g group along K), packs them as
AutoGPTQ / GPTQModel ("gptq" v1 with zero - 1, "gptq_v2") or AutoAWQ (GEMM, interleaved
nibbles) store them, loads them, and checks that the layer's tensors dequantize to exactly
(q - zero) * scale of those codes, and that the layer's forward is the MLP of those weights.
Nothing of fusedmoe packs or unpacks here: the packers are the formats' own rules.
Legend: H hidden, I intermediate, E experts, K input and N output size of a projection, g group.
"""

from __future__ import annotations

import random

import pytest
import torch

from fusedmoe import FusedMoE, ParallelConfig
from fusedmoe.quant import dequantize
from tests.helpers import assert_close, assert_equal
from tests.reference import silu64, softmax_topk_ref

E, H = 4, 128
QWEN = ("model.layers.5.mlp.", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL = ("model.layers.0.block_sparse_moe.", ("w1", "w3", "w2"))
#: AutoAWQ's pack order: nibble j of a word holds column AWQ_ORDER[j] of the word's 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ---- the reference convention: quantize, pack --------------------------------------------------
def quantize_ref(w: torch.Tensor, bits: int, group: int, sym: bool):
    """GPTQ / AWQ's rule for w [N, K]: -> codes q [N, K], scales float16 [N, G], zeros [N, G]
    (int64); w ~= (q - zero) * scale per 1 x group cell."""
    maxq = (1 << bits) - 1
    n, k = w.shape
    cells = w.view(n, k // group, group)
    if sym:  # GPTQ sym=True: zero 2^(bits-1), scale from the absolute max
        amax = cells.abs().amax(-1).clamp(min=1e-4)
        scale = (2 * amax / maxq).half()
        zero = torch.full_like(amax, 1 << (bits - 1))
    else:  # asymmetric: the range [min(0, x), max(0, x)] over the cell
        low, high = cells.amin(-1).clamp(max=0), cells.amax(-1).clamp(min=0)
        scale = ((high - low).clamp(min=1e-4) / maxq).half()
        zero = (-low / scale.float()).round().clamp(0, maxq)
    q = ((cells / scale.float()[..., None]).round() + zero[..., None]).clamp(0, maxq)
    return q.view(n, k).long(), scale, zero.long()


def dequant_ref(q, scale, zero, group):
    """(q - zero) * scale, float32 [N, K], straight from the codes."""
    return (q - zero.repeat_interleave(group, dim=1)).float() * scale.float().repeat_interleave(
        group, dim=1
    )


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 (any integer, taken mod 2^32) -> the int32 they are."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight: [K, N] -> int32 [K / p, N]; value k at bits (k % p) * bits of word k // p."""
    p = 32 // bits
    words = torch.zeros(values.shape[0] // p, values.shape[1], dtype=torch.int64)
    for j in range(p):
        words |= values[j::p] << (bits * j)
    return as_int32(words)


def pack_cols(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """GPTQ's qzeros (order None) or AWQ's qweight / qzeros (order AWQ_ORDER): [R, N] ->
    int32 [R, N / p]; nibble j of word c holds column c * p + order[j]."""
    p = 32 // bits
    order = order or tuple(range(p))
    words = torch.zeros(values.shape[0], values.shape[1] // p, dtype=torch.int64)
    for j in range(p):
        words |= values[:, order[j] :: p] << (bits * j)
    return as_int32(words)


def gptq_tensors(q, scale, zero, bits, group, *, v1=True, g_idx=None):
    """One linear's GPTQ tensors. v1: qzeros hold zero - 1, the words minus 0x11111111 /
    0x01010101 as int32 (GPTQModel's v2 -> v1 conversion: a zero of 0 borrows)."""
    qzeros = pack_cols(zero.t(), bits)
    if v1:
        ones = sum(1 << (bits * j) for j in range(32 // bits))
        qzeros = as_int32(qzeros.long() - ones)
    k = q.shape[1]
    return {
        "qweight": pack_rows(q.t(), bits),
        "qzeros": qzeros,
        "scales": scale.t().contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32) // group if g_idx is None else g_idx,
    }


def awq_tensors(q, scale, zero, order=AWQ_ORDER):
    return {
        "qweight": pack_cols(q.t(), 4, order),
        "qzeros": pack_cols(zero.t(), 4, order),
        "scales": scale.t().contiguous(),
    }


def make_checkpoint(fmt, bits, group, inter, *, sym, naming=QWEN, order=AWQ_ORDER, v1=None):
    """-> (items [(name, tensor)], float32 dequantized w13 [E, 2I, H] and w2 [E, H, I])."""
    prefix, (gate, up, down) = naming
    v1 = fmt == "gptq" if v1 is None else v1
    items, w13, w2 = [], [], []
    for e in range(E):
        deq = {}
        for proj, (n, k) in ((gate, (inter, H)), (up, (inter, H)), (down, (H, inter))):
            w = torch.randn(n, k)
            if not sym:  # cells of one sign: zeros of 0 and 2^bits - 1 (v1 borrows)
                w[0, :group] = w[0, :group].abs()
                w[1, :group] = -w[1, :group].abs()
            q, scale, zero = quantize_ref(w, bits, group, sym)
            deq[proj] = dequant_ref(q, scale, zero, group)
            if fmt == "awq":
                tensors = awq_tensors(q, scale, zero, order)
            else:
                tensors = gptq_tensors(q, scale, zero, bits, group, v1=v1)
            items += [(f"{prefix}experts.{e}.{proj}.{kind}", t) for kind, t in tensors.items()]
        w13.append(torch.cat([deq[gate], deq[up]]))
        w2.append(deq[down])
    return items, torch.stack(w13), torch.stack(w2)


def gptq_layer(bits=4, group=32, inter=64, *, zero_points=False, fmt="gptq", **kwargs):
    options = {"group_size": group, "checkpoint_format": fmt}
    if bits == 4:
        options["zero_points"] = zero_points
    return FusedMoE(
        E,
        2,
        H,
        inter,
        quant_config="int4_w4a16" if bits == 4 else "int8_w8a16",
        quant_options=options,
        params_dtype=torch.float32,
        backend="torch",
        **kwargs,
    )


def layer_dequantized(layer):
    """The layer's w13 / w2 dequantized by fusedmoe.quant.dequantize (the spec)."""
    qc = layer.quant_config
    return tuple(
        dequantize(
            getattr(layer, f"{p}_weight"),
            getattr(layer, f"{p}_weight_scale"),
            operand.key,
            zero_point=getattr(layer, f"{p}_weight_zero_point", None),
        )
        for p, operand in (("w13", qc.w1), ("w2", qc.w2))
    )


def check_forward(layer, w13, w2):
    """The layer's forward (torch backend) against silu-gated MLPs of w13 / w2 in float64."""
    x, logits = torch.randn(19, H), torch.randn(19, E)
    weights, ids = softmax_topk_ref(logits, 2)
    inter = w2.shape[2]
    expected = torch.zeros(19, H, dtype=torch.float64)
    for m in range(19):
        for j in range(2):
            e = int(ids[m, j])
            h = w13[e].double() @ x[m].double()
            a = silu64(h[:inter]) * h[inter:]
            expected[m] += float(weights[m, j]) * (w2[e].double() @ a)
    with torch.no_grad():
        assert_close(layer(x, logits), expected, torch.float32)


# ---- the packers are the formats' ------------------------------------------------------------
def test_the_test_packers_follow_the_formats():
    codes = torch.arange(8).view(1, 8)
    # GPTQ: the lowest bits hold the smallest index
    assert pack_rows(codes.t(), 4).item() == 0x76543210
    assert pack_cols(codes, 4).item() == 0x76543210
    # AWQ: nibbles hold columns 0 2 4 6 1 3 5 7 (vLLM / AutoAWQ undo it with 0 4 1 5 2 6 3 7)
    assert pack_cols(codes, 4, AWQ_ORDER).item() == 0x75316420
    # GPTQ v1: zero - 1 per value, borrowing across a zero of 0
    zeros = torch.tensor([[0, 1, 8, 8, 8, 8, 8, 15]])
    qzeros = gptq_tensors(torch.zeros(8, 32).long(), torch.ones(8, 1).half(), zeros.t(), 4, 32)
    assert qzeros["qzeros"].item() == as_int32(torch.tensor(0xF8888810 - 0x11111111)).item()


# ---- loads exactly -----------------------------------------------------------------------------
@pytest.mark.parametrize("naming", [QWEN, MIXTRAL], ids=["qwen3", "mixtral"])
@pytest.mark.parametrize(
    ("fmt", "bits", "group", "inter", "sym", "zero_points"),
    [
        ("gptq", 4, 32, 64, False, True),
        ("gptq", 4, 64, 128, True, False),  # sym=True into a symmetric layer
        ("gptq", 4, 32, 128, True, True),  # sym=True into a layer with zero points
        ("gptq_v2", 4, 64, 64, False, True),
        ("gptq", 8, 32, 64, True, False),
        ("gptq_v2", 8, 64, 128, True, False),
        ("awq", 4, 32, 64, False, True),
        ("awq", 4, 64, 128, False, True),
    ],
)
def test_loads_exactly(naming, fmt, bits, group, inter, sym, zero_points):
    items, w13, w2 = make_checkpoint(fmt, bits, group, inter, sym=sym, naming=naming)
    layer = gptq_layer(bits, group, inter, zero_points=zero_points, fmt=fmt)
    assert layer.load_weights(items) == [name for name, _ in items]
    assert layer.missing_weights() == []
    if not sym:  # the checkpoint exercises the extreme zeros (v1: a borrowing zero of 0)
        assert int(layer.w13_weight_zero_point.min()) == 0
        assert int(layer.w13_weight_zero_point.max()) == 15
    got13, got2 = layer_dequantized(layer)
    assert_equal(got13, w13, what="w13 dequantized")
    assert_equal(got2, w2, what="w2 dequantized")
    check_forward(layer, w13, w2)


def test_int8_per_channel():
    """GPTQ group_size -1 (one group spanning K): scales [1, N] into per-channel scales."""
    inter = 64
    items, w13, w2 = [], [], []
    for e in range(E):
        deq = {}
        for proj, (n, k) in (("gate_proj", (inter, H)), ("up_proj", (inter, H)),
                             ("down_proj", (H, inter))):  # fmt: skip
            q, scale, zero = quantize_ref(torch.randn(n, k), 8, k, sym=True)
            deq[proj] = dequant_ref(q, scale, zero, k)
            tensors = gptq_tensors(q, scale, zero, 8, k)
            items += [(f"mlp.experts.{e}.{proj}.{kind}", t) for kind, t in tensors.items()]
        w13.append(torch.cat([deq["gate_proj"], deq["up_proj"]]))
        w2.append(deq["down_proj"])
    layer = FusedMoE(E, 2, H, inter, quant_config="int8_w8a16",
                     quant_options={"checkpoint_format": "gptq"},
                     params_dtype=torch.float32, backend="torch")  # fmt: skip
    assert layer.w13_weight_scale.shape == (E, 2 * inter)
    layer.load_weights(items)
    got13, got2 = layer_dequantized(layer)
    assert_equal(got13, torch.stack(w13))
    assert_equal(got2, torch.stack(w2))
    check_forward(layer, torch.stack(w13), torch.stack(w2))


def test_tensors_load_in_any_order_and_in_parts():
    items, w13, w2 = make_checkpoint("gptq", 4, 32, 64, sym=False)
    random.Random(1).shuffle(items)
    layer = gptq_layer(zero_points=True)
    no_zeros = [(n, t) for n, t in items if not n.endswith("qzeros")]
    layer.load_weights(no_zeros, strict=False)
    assert layer.missing_weights() == [
        "w13_weight_zero_point of experts [0-3]",
        "w2_weight_zero_point of experts [0-3]",
    ]
    with pytest.raises(ValueError, match=r"unwritten: w13_weight_zero_point up rows of experts"):
        layer.load_weights(
            [(n, t) for n, t in items if n.endswith("qzeros") and ".up_proj." not in n]
        )
    layer.load_weights([(n, t) for n, t in items if n.endswith("up_proj.qzeros")])
    assert layer.missing_weights() == []
    got13, got2 = layer_dequantized(layer)
    assert_equal(got13, w13)
    assert_equal(got2, w2)


# ---- the checks can fail -----------------------------------------------------------------------
def test_a_wrong_awq_order_or_gptq_version_would_show():
    """The exact comparison sees a checkpoint packed in plain (GPTQ) column order read as AWQ,
    and v2 zeros read as v1 (each value one more)."""
    items, w13, _ = make_checkpoint("awq", 4, 32, 64, sym=False, order=tuple(range(8)))
    layer = gptq_layer(zero_points=True, fmt="awq")
    layer.load_weights(items)
    assert not torch.equal(layer_dequantized(layer)[0], w13)

    items, w13, _ = make_checkpoint("gptq", 4, 32, 64, sym=False, v1=False)
    layer = gptq_layer(zero_points=True, fmt="gptq")
    layer.load_weights(items)
    assert not torch.equal(layer_dequantized(layer)[0], w13)


# ---- refused -----------------------------------------------------------------------------------
def _one_linear(fmt="gptq", bits=4, group=32, *, sym=False, n=64, k=H, **kwargs):
    q, scale, zero = quantize_ref(torch.randn(n, k), bits, group, sym)
    if fmt == "awq":
        return awq_tensors(q, scale, zero)
    return gptq_tensors(q, scale, zero, bits, group, **kwargs)


def test_act_order_is_refused():
    g_idx = (torch.randperm(H) // 32).to(torch.int32)  # desc_act: a permuted group assignment
    tensors = _one_linear(g_idx=g_idx)
    layer = gptq_layer(zero_points=True)
    name = "model.layers.1.mlp.experts.2.gate_proj.g_idx"
    with pytest.raises(
        ValueError,
        match=rf"{name}: act-order \(desc_act\) GPTQ checkpoints are not supported: g_idx is "
        r"not k // group_size",
    ):
        layer.load_weights([(name, tensors["g_idx"])], strict=False)
    # the trivial g_idx is checked and kept nowhere
    layer.load_weights([(name, torch.arange(H, dtype=torch.int32) // 32)], strict=False)


def test_zero_points_into_a_symmetric_layer_are_refused():
    layer = gptq_layer(zero_points=False)
    name = "mlp.experts.0.up_proj.qzeros"
    asym = _one_linear(sym=False)["qzeros"]
    with pytest.raises(ValueError, match=rf"{name}: zero point .*'zero_points': True"):
        layer.load_weights([(name, asym)], strict=False)
    # v2 zeros of a sym=True checkpoint read as v1: 9, not 8
    sym_v2 = _one_linear(sym=True, v1=False)["qzeros"]
    with pytest.raises(ValueError, match=r"zero point 9 .* 'gptq_v2'"):
        layer.load_weights([(name, sym_v2)], strict=False)
    layer.load_weights([(name, _one_linear(sym=True)["qzeros"])], strict=False)


def test_int8_zero_points_other_than_128_are_refused():
    layer = gptq_layer(bits=8)
    q, scale, zero = quantize_ref(torch.randn(64, H), 8, 32, sym=True)
    zero[3, 1] = 100
    tensors = gptq_tensors(q, scale, zero, 8, 32)
    with pytest.raises(ValueError, match=r"zero point 100 \(row 3, group 1\).*int8_w8a16 is sym"):
        layer.load_weights([("mlp.experts.1.gate_proj.qzeros", tensors["qzeros"])], strict=False)


def test_awq_into_int8_is_refused():
    with pytest.raises(ValueError, match="AWQ checkpoints are 4-bit"):
        FusedMoE(E, 2, H, 64, quant_config="int8_w8a16", quant_options={"checkpoint_format": "awq"})


@pytest.mark.parametrize(
    ("kind", "tensors", "match"),
    [
        # K = 2H: the wrong projection's tensor
        ("qweight", _one_linear(k=2 * H), r"expected shape \(16, 64\) \(GPTQ 4-bit qweight"),
        # a checkpoint of group 64 into a layer of group 32
        ("scales", _one_linear(group=64), r"expected shape \(4, 64\) .*groups are 32 wide"),
        ("qzeros", _one_linear(n=128), r"expected shape \(4, 8\) \(GPTQ 4-bit qzeros"),
        ("g_idx", _one_linear(k=64), r"expected shape \(128,\)"),
        # 8-bit words into an int4 layer
        ("qweight", _one_linear(bits=8, sym=True), r"expected shape \(16, 64\)"),
    ],
)
def test_wrong_shapes_name_the_tensor(kind, tensors, match):
    layer = gptq_layer(zero_points=True)
    name = f"model.layers.0.block_sparse_moe.experts.3.w3.{kind}"
    with pytest.raises(ValueError, match=rf"{name}: {match}"):
        layer.load_weights([(name, tensors[kind])], strict=False)
    assert layer.missing_weights()[0] == "w13_weight of experts [0-3]"  # nothing written


def test_wrong_dtypes_and_layers_are_refused():
    tensors = _one_linear()
    layer = gptq_layer(zero_points=True)
    with pytest.raises(TypeError, match=r"experts.0.w1.qweight: expected int32 GPTQ"):
        layer.load_weights([("experts.0.w1.qweight", tensors["qweight"].long())], strict=False)
    with pytest.raises(TypeError, match=r"experts.0.w1.scales: expected float"):
        layer.load_weights([("experts.0.w1.scales", tensors["qzeros"])], strict=False)
    awq = gptq_layer(zero_points=True, fmt="awq")
    with pytest.raises(ValueError, match=r"experts.0.w1.g_idx: AWQ checkpoints have no g_idx"):
        awq.load_weights([("experts.0.w1.g_idx", tensors["g_idx"])], strict=False)
    # a layer not built for a GPTQ / AWQ checkpoint
    for plain in (
        FusedMoE(E, 2, H, 64, quant_config="int4_w4a16", quant_options={"group_size": 32}),
        FusedMoE(E, 2, H, 64),
    ):
        with pytest.raises(ValueError, match=r"experts.0.w1.qweight: a GPTQ / AWQ tensor.*"
                           "checkpoint_format"):  # fmt: skip
            plain.load_weights([("experts.0.w1.qweight", tensors["qweight"])], strict=False)
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        gptq_layer(fmt="exl2")
    with pytest.raises(ValueError, match=r"checkpoint_format \(gptq\) applies to int4_w4a16"):
        FusedMoE(
            E, 2, H, 64, quant_config="fp8_channel", quant_options={"checkpoint_format": "gptq"}
        )


# ---- expert parallelism ------------------------------------------------------------------------
@pytest.mark.parametrize(("placement", "redundant"), [("linear", 0), ("round_robin", 2)])
@pytest.mark.parametrize("ep_rank", [0, 1])
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_ep_loads_its_local_experts(fmt, ep_rank, placement, redundant):
    """AWQ with zero points; GPTQ sym=True into a symmetric layer (qzeros and g_idx checked)."""
    sym = fmt == "gptq"
    items, w13, w2 = make_checkpoint(fmt, 4, 32, 64, sym=sym, naming=MIXTRAL)
    pc = ParallelConfig(
        ep_size=2, ep_rank=ep_rank, placement=placement, num_redundant_experts=redundant
    )
    layer = gptq_layer(zero_points=not sym, fmt=fmt, parallel_config=pc)
    local = layer.placement.local_logical(ep_rank)

    def expert(name):
        return int(name.split("experts.")[1].split(".")[0])

    loaded = layer.load_weights(items)  # the whole checkpoint: only local experts are kept
    assert loaded == [n for n, _ in items if expert(n) in set(local)]
    assert layer.missing_weights() == []
    got13, got2 = layer_dequantized(layer)
    assert_equal(got13, w13[list(local)])
    assert_equal(got2, w2[list(local)])
