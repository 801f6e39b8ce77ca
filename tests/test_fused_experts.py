"""fused_experts / fused_moe against a dense per-token float64 reference.

Legend: M tokens, H hidden, I intermediate, E experts, k top-k.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import ActivationParams, fused_moe
from tests.helpers import assert_close, assert_equal
from tests.reference import (
    ALL_ACTIVATIONS,
    random_experts,
    reference,
    run_fused_experts,
    silu64,
    softmax_topk_ref,
)

H, I, E = 32, 16, 8

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# activation params beyond the defaults, for the activations that take them
PARAM_CASES = [
    ("silu", {"limit": 2.0}),
    ("swigluoai", {"alpha": 1.0, "limit": 3.0}),
    ("swigluoai_uninterleave", {"alpha": 2.0, "beta": 0.5, "limit": 4.0}),
    ("swiglustep", {"limit": 3.0}),
]


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, *, empty: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token, positive weights; a fraction `empty` of slots -1."""
    ids = torch.rand(num_tokens, num_experts).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.rand(num_tokens, top_k) + 0.1
    if empty:
        ids = ids.masked_fill(torch.rand(num_tokens, top_k) < empty, -1)
    return weights, ids


def run(x, experts, weights, ids, **kwargs):
    return run_fused_experts(x, experts, weights, ids, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
def test_matches_reference(activation, bias, dtype):
    experts = random_experts(E, H, I, activation, dtype=dtype, bias=bias)
    x = torch.randn(37, H, dtype=dtype)
    weights, ids = random_routing(37, E, 3, empty=0.1)
    out = run(x, experts, weights, ids, activation=activation)
    assert out.dtype == dtype and out.shape == (37, H)
    assert_close(out, reference(x, experts, weights, ids, activation=activation), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("activation", "params"), PARAM_CASES)
def test_activation_params(activation, params, dtype):
    experts = random_experts(E, H, I, activation, dtype=dtype, bias=True)
    x = torch.randn(19, H, dtype=dtype)
    weights, ids = random_routing(19, E, 2)
    out = run(
        x,
        experts,
        weights,
        ids,
        activation=activation,
        activation_params=ActivationParams(**params),
    )
    expected = reference(x, experts, weights, ids, activation=activation, params=params)
    assert_close(out, expected, dtype)
    # the parameters matter: the defaults give a clearly different answer
    default = reference(x, experts, weights, ids, activation=activation)
    assert (default - expected).abs().max() > 0.1 * expected.abs().max()


@pytest.mark.parametrize("num_tokens", [0, 1, 37])
@pytest.mark.parametrize("top_k", [1, 3, E])
def test_token_counts_and_top_k(num_tokens, top_k):
    experts = random_experts(E, H, I, bias=True)
    x = torch.randn(num_tokens, H)
    weights, ids = random_routing(num_tokens, E, top_k)
    out = run(x, experts, weights, ids)
    assert out.shape == (num_tokens, H)
    assert_close(out, reference(x, experts, weights, ids))


def test_empty_slots_contribute_zero():
    experts = random_experts(E, H, I, bias=True)
    x = torch.randn(6, H)
    weights, ids = random_routing(6, E, 2)
    ids[:3] = -1  # three tokens with no expert at all
    ids[3:, 1] = -1  # the rest with only their first slot
    out = run(x, experts, weights, ids)
    assert_equal(out[:3], torch.zeros(3, H))
    single = reference(x[3:], experts, weights[3:, :1], ids[3:, :1])
    assert_close(out[3:], single)


def test_all_tokens_to_one_expert():
    experts = random_experts(E, H, I)
    x = torch.randn(37, H)
    weights = torch.rand(37, 1)
    ids = torch.full((37, 1), 5, dtype=torch.int32)
    out = run(x, experts, weights, ids)
    # one dense gated MLP, batched over all tokens
    h = x.double() @ experts["w13"][5].double().T
    y = (silu64(h[:, :I]) * h[:, I:]) @ experts["w2"][5].double().T
    assert_close(out, weights.double() * y)


def test_int64_ids_and_float64_weights_accepted():
    experts = random_experts(E, H, I)
    x = torch.randn(9, H)
    weights, ids = random_routing(9, E, 2)
    out = run(x, experts, weights.double(), ids.long())
    assert_close(out, reference(x, experts, weights, ids))


def test_float64():
    experts = random_experts(E, H, I, "swigluoai", dtype=torch.float64, bias=True)
    x = torch.randn(11, H, dtype=torch.float64)
    weights, ids = random_routing(11, E, 2)
    out = run(x, experts, weights.double(), ids, activation="swigluoai")
    assert out.dtype == torch.float64
    expected = reference(x, experts, weights.double(), ids, activation="swigluoai")
    assert_close(out, expected, torch.float64)


def _partition(num_experts: int, num_ranks: int) -> list[list[int]]:
    """A random partition of the experts into num_ranks non-empty groups."""
    order = torch.randperm(num_experts).tolist()
    return [sorted(order[r::num_ranks]) for r in range(num_ranks)]


def _expert_map(group: list[int], num_experts: int) -> torch.Tensor:
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[group] = torch.arange(len(group), dtype=torch.int32)
    return expert_map


def _local(experts: dict, group: list[int]) -> dict:
    return {k: None if v is None else v[group].contiguous() for k, v in experts.items()}


@pytest.mark.parametrize("activation", ["silu", "swigluoai", "relu2_no_mul"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_sharded_equals_unsharded(num_ranks, bias, activation):
    experts = random_experts(E, H, I, activation, bias=bias)
    x = torch.randn(37, H)
    weights, ids = random_routing(37, E, 3, empty=0.1)
    unsharded = run(x, experts, weights, ids, activation=activation)
    total = torch.zeros(37, H, dtype=torch.float64)
    for group in _partition(E, num_ranks):
        expert_map = _expert_map(group, E)
        local = _local(experts, group)
        part = run(
            x,
            local,
            weights,
            ids,
            activation=activation,
            expert_map=expert_map,
            global_num_experts=E,
        )
        # experts of other ranks contribute nothing: each shard is the reference on its experts
        expected = reference(x, local, weights, ids, activation=activation, expert_map=expert_map)
        assert_close(part, expected, what=f"shard {group}")
        total += part.double()
    assert_close(total, unsharded.double(), torch.float32)
    assert_close(total, reference(x, experts, weights, ids, activation=activation), torch.float32)


def test_expert_map_without_global_num_experts():
    experts = random_experts(E, H, I)
    group = [1, 4, 6]
    local = _local(experts, group)
    x = torch.randn(13, H)
    weights, ids = random_routing(13, E, 2)
    expert_map = _expert_map(group, E)
    out = run(x, local, weights, ids, expert_map=expert_map)
    assert_close(out, reference(x, local, weights, ids, expert_map=expert_map))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_on_input(bias, dtype):
    experts = random_experts(E, H, I, bias=bias, dtype=dtype)
    x = torch.randn(23, H, dtype=dtype)
    weights, ids = random_routing(23, E, 1)
    weights = weights * 3  # far from 1, so that scaling x and scaling y differ
    out = run(x, experts, weights, ids, apply_router_weight_on_input=True)
    on_input = reference(x, experts, weights, ids, weight_on_input=True)
    assert_close(out, on_input, dtype)
    on_output = reference(x, experts, weights, ids)
    assert (on_input - on_output).abs().max() > 0.1 * on_input.abs().max()


def test_weight_on_input_needs_top_1():
    experts = random_experts(E, H, I)
    weights, ids = random_routing(4, E, 2)
    with pytest.raises(ValueError, match="top_k == 1"):
        run(torch.randn(4, H), experts, weights, ids, apply_router_weight_on_input=True)


@pytest.mark.parametrize(("renormalize", "top_k"), [(True, 2), (False, 3), (True, E)])
def test_fused_moe_routes_then_computes(renormalize, top_k):
    experts = random_experts(E, H, I, bias=True)
    x = torch.randn(21, H)
    logits = torch.randn(21, E)
    out = fused_moe(
        x,
        experts["w13"],
        experts["w2"],
        logits,
        top_k,
        renormalize=renormalize,
        w13_bias=experts["w13_bias"],
        w2_bias=experts["w2_bias"],
    )
    weights, ids = softmax_topk_ref(logits, top_k, renormalize=renormalize)
    assert_close(out, reference(x, experts, weights, ids))


def test_fused_moe_identity_zero_experts():
    experts = random_experts(E, H, I)
    x = torch.randn(17, H)
    logits = torch.randn(17, E + 2)
    logits[:, E] += 3.0  # make the first zero expert popular
    out = fused_moe(
        x,
        experts["w13"],
        experts["w2"],
        logits,
        2,
        zero_expert_num=2,
        zero_expert_type="identity",
        routed_scaling_factor=2.5,
    )
    weights, ids = softmax_topk_ref(logits, 2, scale=2.5)
    is_zero = ids >= E
    assert is_zero.any() and (~is_zero).any()
    routed = reference(x, experts, weights, ids.masked_fill(is_zero, -1))
    identity = (weights * is_zero).sum(dim=1, keepdim=True) * x.double()
    assert_close(out, routed + identity)
