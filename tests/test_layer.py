"""The FusedMoE layer against a dense per-token reference that routes on its own.

Legend: M tokens, H hidden, I intermediate, E experts, k top-k, Z zero experts.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fusedmoe import FusedMoE
from tests.helpers import assert_close, assert_equal
from tests.reference import (
    ALL_ACTIVATIONS,
    experts_ref,
    sigmoid64,
    silu64,
    softmax_topk_ref,
)

H, I, E = 32, 16, 8


def layer_experts(layer: FusedMoE) -> dict[str, torch.Tensor | None]:
    """The layer's expert weights, as plain tensors for the reference."""

    def get(p):
        return None if p is None else p.detach().clone()

    return {
        "w13": get(layer.w13_weight),
        "w2": get(layer.w2_weight),
        "w13_bias": get(layer.w13_bias),
        "w2_bias": get(layer.w2_bias),
    }


def routed_ref(layer: FusedMoE, x: torch.Tensor, weights, ids) -> torch.Tensor:
    """The routed experts of `layer` for a given routing, float64 [M, H]."""
    experts = layer_experts(layer)
    return experts_ref(
        x,
        experts["w13"],
        experts["w2"],
        weights,
        ids,
        activation=layer.activation.kind.value,
        w13_bias=experts["w13_bias"],
        w2_bias=experts["w2_bias"],
    )


def make_layer(num_experts=E, top_k=2, hidden=H, inter=I, dtype=torch.float32, **kwargs):
    return FusedMoE(num_experts, top_k, hidden, inter, params_dtype=dtype, **kwargs)


def mlp_ref(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """silu(x @ up.T) @ down.T in float64: the shared expert MLP of the tests."""
    return silu64(x.double() @ up.double().T) @ down.double().T


# ---- routing configurations -------------------------------------------------------------------

CONFIGS = [
    # (activation, has_bias, top_k, renormalize, scoring_func)
    *[(act, False, 2, True, "softmax") for act in ALL_ACTIVATIONS],
    *[(act, True, 2, True, "softmax") for act in ALL_ACTIVATIONS],
    ("silu", False, 3, False, "softmax"),
    ("silu", True, 2, False, "sigmoid"),
    ("swigluoai", True, 4, True, "sigmoid"),
]


@pytest.mark.parametrize(("activation", "has_bias", "top_k", "renormalize", "scoring"), CONFIGS)
def test_matches_reference(activation, has_bias, top_k, renormalize, scoring):
    layer = make_layer(
        top_k=top_k,
        activation=activation,
        has_bias=has_bias,
        renormalize=renormalize,
        scoring_func=scoring,
    )
    x = torch.randn(37, H)
    logits = torch.randn(37, E)
    out = layer(x, logits)
    weights, ids = softmax_topk_ref(logits, top_k, renormalize=renormalize, scoring=scoring)
    assert out.shape == (37, H) and out.dtype == torch.float32
    assert_close(out, routed_ref(layer, x, weights, ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "swigluoai", "gelu_no_mul"])
def test_half_precision(activation, dtype):
    layer = make_layer(activation=activation, has_bias=True, dtype=dtype)
    x = torch.randn(37, H, dtype=dtype)
    logits = torch.randn(37, E)
    out = layer(x, logits)
    assert out.dtype == dtype
    weights, ids = softmax_topk_ref(logits, 2)
    assert_close(out, routed_ref(layer, x, weights, ids), dtype)


def test_one_expert_is_a_dense_gated_mlp():
    layer = make_layer(num_experts=1, top_k=1)
    x = torch.randn(37, H)
    out = layer(x, torch.randn(37, 1))
    w13, w2 = layer.w13_weight.detach().double(), layer.w2_weight.detach().double()
    gate, up = x.double() @ w13[0, :I].T, x.double() @ w13[0, I:].T
    assert_close(out, (silu64(gate) * up) @ w2[0].T)


def test_all_tokens_to_one_expert():
    layer = make_layer(top_k=2)
    x = torch.randn(37, H)
    logits = torch.randn(37, E)
    logits[:, 5] += 20.0
    weights, ids = softmax_topk_ref(logits, 2)
    assert (ids[:, 0] == 5).all()
    assert_close(layer(x, logits), routed_ref(layer, x, weights, ids))


@pytest.mark.parametrize("top_k", [1, 2, E])
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_token_counts_and_top_k(num_tokens, top_k):
    layer = make_layer(top_k=top_k, has_bias=True)
    x = torch.randn(num_tokens, H)
    logits = torch.randn(num_tokens, E)
    out = layer(x, logits)
    assert out.shape == (num_tokens, H)
    weights, ids = softmax_topk_ref(logits, top_k)
    assert_close(out, routed_ref(layer, x, weights, ids))


@pytest.mark.parametrize("lead", [(2, 3), (1, 1, 5), (), (0, 4)])
def test_leading_dimensions(lead):
    layer = make_layer()
    x = torch.randn(*lead, H)
    logits = torch.randn(*lead, E)
    out = layer(x, logits)
    assert out.shape == (*lead, H)
    flat_x, flat_logits = x.reshape(-1, H), logits.reshape(-1, E)
    weights, ids = softmax_topk_ref(flat_logits, 2)
    assert_close(out.reshape(-1, H), routed_ref(layer, flat_x, weights, ids))


# ---- shared experts, scaling, zero experts ----------------------------------------------------


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_shared_experts_and_routed_scaling(scale, gated):
    shared = nn.Sequential(nn.Linear(H, 24, bias=False), nn.SiLU(), nn.Linear(24, H, bias=False))
    gate = nn.Linear(H, 1, bias=False) if gated else None
    layer = make_layer(shared_experts=shared, shared_expert_gate=gate, routed_scaling_factor=scale)
    x = torch.randn(37, H)
    logits = torch.randn(37, E)
    out = layer(x, logits)
    weights, ids = softmax_topk_ref(logits, 2, scale=scale)
    shared_out = mlp_ref(x, shared[0].weight.detach(), shared[2].weight.detach())
    if gated:  # Qwen2-MoE: out += sigmoid(gate(x)) * shared(x); the scale is for routed only
        shared_out = sigmoid64(x.double() @ gate.weight.detach().double().T) * shared_out
    assert_close(out, routed_ref(layer, x, weights, ids) + shared_out)


@pytest.mark.parametrize("zero_type", ["identity", "zero"])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_zero_experts(zero_type, scale):
    num_zero = 3
    layer = make_layer(
        top_k=3,
        zero_expert_num=num_zero,
        zero_expert_type=zero_type,
        routed_scaling_factor=scale,
    )
    x = torch.randn(37, H)
    logits = torch.randn(37, E + num_zero)
    logits[:, E:] += 1.0  # zero experts in many tokens' top-k, but not all
    out = layer(x, logits)
    weights, ids = softmax_topk_ref(logits, 3, scale=scale)
    is_zero = ids >= E
    assert is_zero.any() and (~is_zero).any()
    expected = routed_ref(layer, x, weights, ids.masked_fill(is_zero, -1))
    if zero_type == "identity":  # weight * x for every zero-expert slot, scaled like the rest
        expected += (weights * is_zero).sum(dim=1, keepdim=True) * x.double()
    assert_close(out, expected)


# ---- grouped top-k, hash routing, custom routing --------------------------------------------


def grouped_topk_ref(logits, bias, top_k, num_groups, topk_group, scale):
    """DeepSeek-V3 routing in float64: sigmoid scores, bias for choice, top-2 sum per group."""
    num_tokens, num_experts = logits.shape
    size = num_experts // num_groups
    weights = torch.zeros(num_tokens, top_k, dtype=torch.float64)
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int64)
    for m in range(num_tokens):
        scores = [1.0 / (1.0 + math.exp(-float(v))) for v in logits[m]]
        choice = [s + float(b) for s, b in zip(scores, bias, strict=True)]
        group_score = [
            sum(sorted(choice[g * size : (g + 1) * size])[-2:]) for g in range(num_groups)
        ]
        kept = sorted(range(num_groups), key=lambda g, s=group_score: -s[g])[:topk_group]
        candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda e, c=choice: -c[e])[:top_k]
        w = [scores[e] for e in chosen]
        weights[m] = torch.tensor([v / sum(w) * scale for v in w], dtype=torch.float64)
        ids[m] = torch.tensor(chosen)
    return weights, ids


def make_grouped_layer(bias: torch.Tensor, dtype=torch.float32) -> FusedMoE:
    return FusedMoE(
        16,
        4,
        H,
        I,
        scoring_func="sigmoid",
        use_grouped_topk=True,
        num_expert_group=4,
        topk_group=2,
        e_score_correction_bias=bias,
        routed_scaling_factor=2.5,
        params_dtype=dtype,
    )


def test_grouped_topk_with_bias():
    bias = torch.randn(16) * 0.5
    layer = make_grouped_layer(bias)
    x = torch.randn(37, H)
    logits = torch.randn(37, 16)
    weights, ids = grouped_topk_ref(logits, bias, 4, 4, 2, 2.5)
    unbiased_ids = grouped_topk_ref(logits, torch.zeros(16), 4, 4, 2, 2.5)[1]
    assert (ids.sort(dim=1).values != unbiased_ids.sort(dim=1).values).any()  # the bias matters
    assert_close(layer(x, logits), routed_ref(layer, x, weights, ids))


def test_dtype_moves_rebuild_the_routing():
    bias = torch.randn(16) * 0.5
    layer = make_grouped_layer(bias)
    x = torch.randn(37, H)
    logits = torch.randn(37, 16)
    weights, ids = grouped_topk_ref(logits, bias, 4, 4, 2, 2.5)

    layer.to(torch.float64)
    assert layer.w13_weight.dtype == torch.float64
    assert layer.e_score_correction_bias.dtype == torch.float64
    out = layer(x.double(), logits)
    assert out.dtype == torch.float64
    # the router's weights are float32 by contract: float32 accuracy end to end
    assert_close(out, routed_ref(layer, x.double(), weights, ids), torch.float32)

    # a bias loaded after the move reaches the router: it now picks 4 of experts 8..15
    new_bias = torch.zeros(16)
    new_bias[8:] = 10.0
    layer.load_weights([("model.layers.0.mlp.gate.e_score_correction_bias", new_bias)])
    weights, ids = grouped_topk_ref(logits, new_bias, 4, 4, 2, 2.5)
    assert (ids >= 8).all()
    assert_close(
        layer(x.double(), logits), routed_ref(layer, x.double(), weights, ids), torch.float32
    )

    layer.to(torch.bfloat16)
    x16 = x.to(torch.bfloat16)
    out = layer(x16, logits)
    assert out.dtype == torch.bfloat16
    assert_close(out, routed_ref(layer, x16, weights, ids), torch.bfloat16)


def test_hash_routing_with_input_ids():
    vocab, top_k = 50, 2
    table = torch.stack([torch.randperm(E)[:top_k] for _ in range(vocab)]).to(torch.int32)
    layer = make_layer(top_k=top_k, hash_indices_table=table)
    x = torch.randn(2, 3, H)
    logits = torch.randn(2, 3, E)
    input_ids = torch.randint(0, vocab, (2, 3))
    out = layer(x, logits, input_ids=input_ids)
    assert out.shape == (2, 3, H)
    ids = table[input_ids.reshape(-1)].long()
    scores = torch.softmax(logits.reshape(-1, E).double(), dim=-1).gather(1, ids)
    weights = scores / scores.sum(dim=1, keepdim=True)
    assert_close(out.reshape(-1, H), routed_ref(layer, x.reshape(-1, H), weights, ids))


def test_custom_routing_function():
    fixed_ids = torch.randint(0, E, (37, 1)).to(torch.int32)
    fixed_ids = torch.cat([fixed_ids, (fixed_ids + 3) % E], dim=1)
    fixed_weights = torch.rand(37, 2)

    def route(hidden_states, gating_output, top_k, renormalize):
        assert top_k == 2
        return fixed_weights, fixed_ids

    layer = make_layer(custom_routing_function=route, routed_scaling_factor=1.5)
    x = torch.randn(37, H)
    out = layer(x, torch.randn(37, E))
    assert_close(out, routed_ref(layer, x, fixed_weights.double() * 1.5, fixed_ids))


def test_routed_transforms_latent_moe():
    """Experts in a smaller latent space: project in before routing, back out after."""
    outer = 24
    down = nn.Linear(outer, H, bias=False)
    up = nn.Linear(H, outer, bias=False)
    shared = nn.Sequential(
        nn.Linear(outer, 8, bias=False), nn.SiLU(), nn.Linear(8, outer, bias=False)
    )
    layer = make_layer(
        routed_input_transform=down, routed_output_transform=up, shared_experts=shared
    )
    x = torch.randn(37, outer)
    logits = torch.randn(37, E)
    out = layer(x, logits)
    assert out.shape == (37, outer)
    weights, ids = softmax_topk_ref(logits, 2)
    latent = x.double() @ down.weight.detach().double().T
    routed = routed_ref(layer, latent, weights, ids) @ up.weight.detach().double().T
    shared_out = mlp_ref(x, shared[0].weight.detach(), shared[2].weight.detach())  # on x itself
    assert_close(out, routed + shared_out)


def test_forward_is_repeatable_and_leaves_inputs_alone():
    layer = make_layer(has_bias=True)
    x = torch.randn(37, H)
    logits = torch.randn(37, E)
    x_copy, logits_copy = x.clone(), logits.clone()
    first = layer(x, logits)
    second = layer(x, logits)
    assert_equal(first, second)
    assert_equal(x, x_copy, what="hidden_states")
    assert_equal(logits, logits_copy, what="router_logits")


def test_parameters_and_shapes():
    layer = make_layer(has_bias=True, activation="swigluoai")
    assert layer.w13_weight.shape == (E, 2 * I, H)
    assert layer.w2_weight.shape == (E, H, I)
    assert layer.w13_bias.shape == (E, 2 * I)
    assert layer.w2_bias.shape == (E, H)
    non_gated = make_layer(activation="relu2_no_mul")
    assert non_gated.w13_weight.shape == (E, I, H)
    assert non_gated.w13_bias is None and non_gated.w2_bias is None
    names = {name for name, _ in layer.named_parameters()}
    assert names == {"w13_weight", "w2_weight", "w13_bias", "w2_bias"}


def test_nan_logit_poisons_only_its_token():
    layer = make_layer(has_bias=True)
    x = torch.randn(7, H)
    logits = torch.randn(7, E)
    logits[3, 2] = float("nan")
    out = layer(x, logits)
    assert out[3].isnan().all()
    keep = [m for m in range(7) if m != 3]
    weights, ids = softmax_topk_ref(logits[keep], 2)
    assert_close(out[keep], routed_ref(layer, x[keep], weights, ids))


def test_no_tokens_with_shared_and_zero_experts():
    shared = nn.Sequential(nn.Linear(H, 8, bias=False), nn.SiLU(), nn.Linear(8, H, bias=False))
    layer = make_layer(
        shared_experts=shared,
        shared_expert_gate=nn.Linear(H, 1, bias=False),
        zero_expert_num=2,
        zero_expert_type="identity",
    )
    out = layer(torch.randn(0, H), torch.randn(0, E + 2))
    assert out.shape == (0, H)


@pytest.mark.parametrize("how", ["load_state_dict assign", "attribute", "in place"])
def test_the_router_follows_a_replaced_correction_bias(how):
    """The router holds the layer's correction bias: replaced (load_state_dict(assign=True), as
    after building on the meta device, or a buffer assigned anew) or changed in place, the
    layer routes with the new one, as a layer built with it does."""
    torch.manual_seed(0)
    kwargs = dict(use_grouped_topk=True, num_expert_group=2, topk_group=1,
                  scoring_func="sigmoid", params_dtype=torch.float32)  # fmt: skip
    layer = FusedMoE(E, 2, H, I, e_score_correction_bias=torch.zeros(E), **kwargs).eval()
    bias = 5 * torch.randn(E)
    state = {name: t.clone() for name, t in layer.state_dict().items()}
    state["e_score_correction_bias"] = bias.clone()
    if how == "load_state_dict assign":
        layer.load_state_dict(state, assign=True)
    elif how == "attribute":
        layer.e_score_correction_bias = bias.clone()
    else:
        layer.e_score_correction_bias.copy_(bias)
    fresh = FusedMoE(E, 2, H, I, e_score_correction_bias=bias, **kwargs).eval()
    fresh.load_state_dict(state)
    x, logits = torch.randn(7, H), torch.randn(7, E)
    with torch.no_grad():
        expected = fresh(x, logits)
        assert not torch.allclose(expected, FusedMoE(E, 2, H, I, **kwargs).eval()(x, logits))
        assert_close(layer(x, logits), expected, torch.float32)


def test_the_router_follows_a_replaced_hash_table():
    """The same for a hash router's table (load_state_dict(assign=True))."""
    torch.manual_seed(0)
    vocab = 11
    table = torch.stack([torch.randperm(E)[:2] for _ in range(vocab)])
    layer = FusedMoE(E, 2, H, I, hash_indices_table=table, params_dtype=torch.float32).eval()
    new_table = torch.stack([torch.randperm(E)[:2] for _ in range(vocab)])
    state = {name: t.clone() for name, t in layer.state_dict().items()}
    state["hash_indices_table"] = new_table
    layer.load_state_dict(state, assign=True)
    fresh = FusedMoE(E, 2, H, I, hash_indices_table=new_table, params_dtype=torch.float32).eval()
    fresh.load_state_dict(state)
    x, logits, ids = torch.randn(7, H), torch.randn(7, E), torch.randint(0, vocab, (7,))
    with torch.no_grad():
        expected = fresh(x, logits, input_ids=ids)
        assert_close(layer(x, logits, input_ids=ids), expected, torch.float32)


def test_a_layer_built_on_meta_and_loaded_with_assign_routes_with_the_loaded_bias():
    """Built on the meta device, loaded with assign=True: the router holds the loaded buffers
    right after the load (rebuilt there, not at the first forward, which a torch.compile trace
    could not do), and the layer computes what the source layer does."""
    torch.manual_seed(0)
    kwargs = dict(use_grouped_topk=True, num_expert_group=2, topk_group=1,
                  scoring_func="sigmoid", params_dtype=torch.float32)  # fmt: skip
    source = FusedMoE(E, 2, H, I, e_score_correction_bias=5 * torch.randn(E), **kwargs).eval()
    with torch.device("meta"):
        layer = FusedMoE(E, 2, H, I, e_score_correction_bias=torch.zeros(E), **kwargs).eval()
    layer.load_state_dict(source.state_dict(), assign=True)
    assert layer.router.e_score_correction_bias is layer.e_score_correction_bias
    x, logits = torch.randn(7, H), torch.randn(7, E)
    with torch.no_grad():
        assert_close(layer(x, logits), source(x, logits), torch.float32)
