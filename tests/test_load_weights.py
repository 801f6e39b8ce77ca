"""FusedMoE.load_weights: checkpoint namings -> a layer that computes the checkpoint's MLPs.

Every test builds a per-expert (or fused) state dict of fresh random tensors, loads it, and
compares the layer's forward with an MLP written from those same tensors.
Legend: H hidden, I intermediate, E experts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusedmoe import FusedMoE
from tests.helpers import assert_close, assert_equal
from tests.reference import activation_ref, sigmoid64, silu64, softmax_topk_ref

H, I, E = 32, 16, 4


class GatedMLP(nn.Module):
    """A Qwen / DeepSeek style shared expert: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def checkpoint(num_experts=E, *, bias=False, gated=True) -> dict[str, list[torch.Tensor]]:
    """Fresh random per-expert tensors: gate / up [I, H], down [H, I] (+ biases)."""
    ckpt = {
        "gate": [torch.randn(I, H) * 0.3 for _ in range(num_experts)] if gated else None,
        "up": [torch.randn(I, H) * 0.3 for _ in range(num_experts)],
        "down": [torch.randn(H, I) * 0.3 for _ in range(num_experts)],
    }
    if bias:
        ckpt["gate_bias"] = [torch.randn(I) for _ in range(num_experts)] if gated else None
        ckpt["up_bias"] = [torch.randn(I) for _ in range(num_experts)]
        ckpt["down_bias"] = [torch.randn(H) for _ in range(num_experts)]
    return ckpt


def hand_moe(ckpt, x, weights, ids, activation="silu") -> torch.Tensor:
    """sum_j w * down(act(gate x + bg, up x + bu)) + bd, straight from the checkpoint tensors."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            xm = x[m].double()
            up = ckpt["up"][e].double() @ xm + (
                ckpt["up_bias"][e].double() if "up_bias" in ckpt else 0
            )
            if ckpt["gate"] is None:
                a = activation_ref(activation, up)
            else:
                gate = ckpt["gate"][e].double() @ xm
                if "gate_bias" in ckpt:
                    gate = gate + ckpt["gate_bias"][e].double()
                # the de-interleaved twin of SWIGLUOAI: the layout is the loader's business
                name = "swigluoai_uninterleave" if activation == "swigluoai" else activation
                a = activation_ref(name, torch.cat([gate, up]))
            y = ckpt["down"][e].double() @ a
            if "down_bias" in ckpt:
                y = y + ckpt["down_bias"][e].double()
            out[m] += float(weights[m, j]) * y
    return out


def per_expert_names(ckpt, prefix: str, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    items = []
    for e in range(len(ckpt["up"])):
        for role, name in (("gate", gate), ("up", up), ("down", down)):
            if ckpt[role] is not None:
                items.append((f"{prefix}experts.{e}.{name}.weight", ckpt[role][e]))
            if f"{role}_bias" in ckpt and ckpt[f"{role}_bias"] is not None:
                items.append((f"{prefix}experts.{e}.{name}.bias", ckpt[f"{role}_bias"][e]))
    return items


def check_forward(layer, ckpt, activation="silu", top_k=2, dtype=torch.float32):
    x = torch.randn(23, H, dtype=dtype)
    logits = torch.randn(23, layer.num_experts)
    weights, ids = softmax_topk_ref(logits, top_k)
    assert_close(layer(x, logits), hand_moe(ckpt, x, weights, ids, activation), dtype)


NAMINGS = [
    # (prefix, projection names)
    ("model.layers.3.mlp.", ("gate_proj", "up_proj", "down_proj")),  # Qwen, DeepSeek
    ("", ("gate_proj", "up_proj", "down_proj")),
    ("model.layers.0.block_sparse_moe.", ("w1", "w3", "w2")),  # Mixtral
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("prefix", "names"), NAMINGS)
def test_per_expert(prefix, names, bias):
    ckpt = checkpoint(bias=bias)
    layer = FusedMoE(E, 2, H, I, has_bias=bias, params_dtype=torch.float32)
    items = per_expert_names(ckpt, prefix, names)
    assert layer.load_weights(items) == [name for name, _ in items]
    check_forward(layer, ckpt)


def test_per_expert_into_bfloat16_layer():
    ckpt = checkpoint()
    layer = FusedMoE(E, 2, H, I)  # bfloat16 parameters: the checkpoint is cast
    layer.load_weights(per_expert_names(ckpt, "model.layers.1.mlp."))
    assert layer.w13_weight.dtype == torch.bfloat16
    assert_equal(layer.w2_weight[2], ckpt["down"][2].to(torch.bfloat16))
    rounded = {k: [t.to(torch.bfloat16) for t in v] for k, v in ckpt.items() if v is not None}
    check_forward(layer, rounded, dtype=torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_transformers5(bias):
    ckpt = checkpoint(bias=bias)
    gate_up = torch.stack(
        [torch.cat([g, u]) for g, u in zip(ckpt["gate"], ckpt["up"], strict=True)]
    )
    items = [
        ("model.layers.2.mlp.experts.gate_up_proj", gate_up),  # [E, 2I, H]
        ("model.layers.2.mlp.experts.down_proj", torch.stack(ckpt["down"])),  # [E, H, I]
    ]
    if bias:
        gate_up_bias = torch.stack(
            [torch.cat([g, u]) for g, u in zip(ckpt["gate_bias"], ckpt["up_bias"], strict=True)]
        )
        items += [
            ("model.layers.2.mlp.experts.gate_up_proj_bias", gate_up_bias),
            ("model.layers.2.mlp.experts.down_proj_bias", torch.stack(ckpt["down_bias"])),
        ]
    layer = FusedMoE(E, 2, H, I, has_bias=bias, params_dtype=torch.float32)
    layer.load_weights(items)
    check_forward(layer, ckpt)


@pytest.mark.parametrize("bias", [False, True])
def test_swigluoai_interleaved(bias):
    """gpt-oss: per-expert gate / up land in alternating rows, as the activation reads them."""
    ckpt = checkpoint(bias=bias)
    layer = FusedMoE(E, 2, H, I, activation="swigluoai", has_bias=bias, params_dtype=torch.float32)
    layer.load_weights(per_expert_names(ckpt, "model.layers.5.mlp."))
    assert_equal(layer.w13_weight[1, 0::2], ckpt["gate"][1], what="gate rows")
    assert_equal(layer.w13_weight[1, 1::2], ckpt["up"][1], what="up rows")
    check_forward(layer, ckpt, activation="swigluoai")


@pytest.mark.parametrize(("up_name", "down_name"), [("up_proj", "down_proj"), ("w1", "w2")])
def test_non_gated(up_name, down_name):
    ckpt = checkpoint(gated=False, bias=True)
    layer = FusedMoE(
        E, 2, H, I, activation="relu2_no_mul", has_bias=True, params_dtype=torch.float32
    )
    layer.load_weights(
        per_expert_names(ckpt, "backbone.layers.1.mixer.", (None, up_name, down_name))
    )
    check_forward(layer, ckpt, activation="relu2_no_mul")


@pytest.mark.parametrize("name", ["gate_proj", "w3"])
def test_non_gated_refuses_a_gate(name):
    layer = FusedMoE(E, 2, H, I, activation="relu2_no_mul", params_dtype=torch.float32)
    full = f"model.layers.1.mlp.experts.0.{name}.weight"
    with pytest.raises(ValueError, match=f"{full}.*non-gated"):
        layer.load_weights([(full, torch.randn(I, H))])


def test_e_score_correction_bias():
    layer = FusedMoE(E, 2, H, I, e_score_correction_bias=torch.zeros(E), params_dtype=torch.float32)
    bias = torch.randn(E)
    layer.load_weights([("model.layers.3.mlp.gate.e_score_correction_bias", bias)])
    assert_equal(layer.e_score_correction_bias, bias)
    no_bias = FusedMoE(E, 2, H, I, params_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"mlp\.gate\.e_score_correction_bias: .* without"):
        no_bias.load_weights([("mlp.gate.e_score_correction_bias", bias)])


@pytest.mark.parametrize("prefix", ["shared_expert", "shared_experts"])
@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts(prefix, gated):
    ckpt = checkpoint()
    shared = GatedMLP(H, 24)
    gate = nn.Linear(H, 1, bias=False) if gated else None
    layer = FusedMoE(
        E, 2, H, I, shared_experts=shared, shared_expert_gate=gate, params_dtype=torch.float32
    )
    s_gate, s_up, s_down = (
        torch.randn(24, H) * 0.3,
        torch.randn(24, H) * 0.3,
        torch.randn(H, 24) * 0.3,
    )
    items = [
        *per_expert_names(ckpt, "model.layers.4.mlp."),
        (f"model.layers.4.mlp.{prefix}.gate_proj.weight", s_gate),
        (f"model.layers.4.mlp.{prefix}.up_proj.weight", s_up),
        (f"model.layers.4.mlp.{prefix}.down_proj.weight", s_down),
    ]
    s_g = torch.randn(1, H)
    if gated:
        items.append(("model.layers.4.mlp.shared_expert_gate.weight", s_g))
    layer.load_weights(items)

    x = torch.randn(23, H)
    logits = torch.randn(23, E)
    weights, ids = softmax_topk_ref(logits, 2)
    x64 = x.double()
    shared_out = (silu64(x64 @ s_gate.double().T) * (x64 @ s_up.double().T)) @ s_down.double().T
    if gated:
        shared_out = sigmoid64(x64 @ s_g.double().T) * shared_out
    assert_close(layer(x, logits), hand_moe(ckpt, x, weights, ids) + shared_out)


# ---- errors -----------------------------------------------------------------------------------


def _layer(**kwargs):
    return FusedMoE(E, 2, H, I, params_dtype=torch.float32, **kwargs)


@pytest.mark.parametrize(
    ("name", "tensor", "error", "match"),
    [
        ("model.layers.0.mlp.experts.0.fc1.weight", torch.randn(I, H), ValueError, "not a weight"),
        ("model.layers.0.mlp.gate.weight", torch.randn(E, H), ValueError, "not a weight"),
        (
            "mlp.experts.0.gate_proj.weight",
            torch.randn(H, I),
            ValueError,
            r"expected shape \(16, 32\)",
        ),
        (
            "mlp.experts.1.down_proj.weight",
            torch.randn(I, H),
            ValueError,
            r"expected shape \(32, 16\)",
        ),
        ("mlp.experts.2.up_proj.weight", torch.randn(I + 1, H), ValueError, "expected shape"),
        ("mlp.experts.gate_up_proj", torch.randn(E, I, H), ValueError, r"\(4, 32, 32\)"),
        ("mlp.experts.down_proj", torch.randn(E + 1, H, I), ValueError, "expected shape"),
        ("mlp.experts.4.gate_proj.weight", torch.randn(I, H), ValueError, "out of range"),
        ("mlp.experts.0.gate_proj.bias", torch.randn(I), ValueError, "has_bias=True"),
        ("mlp.experts.0.up_proj.weight", torch.randint(0, 3, (I, H)), TypeError, "floating"),
        ("mlp.experts.0.up_proj.weight", [[0.0] * H] * I, TypeError, "torch.Tensor"),
        ("mlp.shared_experts.gate_proj.weight", torch.randn(I, H), ValueError, "not a weight"),
    ],
)
def test_bad_tensors_name_the_tensor(name, tensor, error, match):
    layer = _layer()
    with pytest.raises(error, match=match) as info:
        layer.load_weights([(name, tensor)])
    assert name in str(info.value)


def test_bad_bias_shape():
    layer = _layer(has_bias=True)
    with pytest.raises(ValueError, match=r"mlp.experts.0.down_proj.bias: expected shape \(32,\)"):
        layer.load_weights([("mlp.experts.0.down_proj.bias", torch.randn(I))])


def test_unknown_shared_expert_tensor():
    layer = _layer(shared_experts=GatedMLP(H, 8))
    with pytest.raises(ValueError, match=r"mlp\.shared_experts\.fc\.weight: .* not a tensor"):
        layer.load_weights([("mlp.shared_experts.fc.weight", torch.randn(8, H))])
    with pytest.raises(ValueError, match="expected shape"):
        layer.load_weights([("mlp.shared_experts.gate_proj.weight", torch.randn(H, 8))])


def test_stops_at_the_first_bad_tensor():
    layer = _layer()
    good = torch.randn(I, H)
    before = layer.w13_weight.detach().clone()
    with pytest.raises(ValueError, match=r"experts\.1\.gate_proj\.weight: expected shape"):
        layer.load_weights(
            [
                ("experts.0.gate_proj.weight", good),
                ("experts.1.gate_proj.weight", torch.randn(3, 3)),
                ("experts.2.gate_proj.weight", torch.randn(I, H)),
            ]
        )
    assert_equal(layer.w13_weight[0, :I], good)
    assert_equal(layer.w13_weight[2], before[2])
