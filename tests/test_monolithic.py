"""The monolithic backend (routes inside, per-expert weights in the activation dtype) against the
float64 reference, its routing kinds, EP shift and DP dispatch, the oracle's choice and refusals,
and the intermediate-size padding of MX / NVFP4 quantized layers.

Legend: M tokens, H hidden, I intermediate, E experts, k top-k, Z zero experts.
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fusedmoe import FusedMoE, ParallelConfig, fused_experts, select_backend
from fusedmoe.experts.monolithic import MonolithicExperts, gpt_oss_route
from fusedmoe.router import topk_route
from tests.helpers import assert_close, assert_equal
from tests.quant_reference import dequant_mxfp4, dequant_nvfp4
from tests.reference import ALL_ACTIVATIONS, experts_ref, random_experts, softmax_topk_ref
from tests.test_layer import grouped_topk_ref
from tests.test_quant_schemes import SCHEME_TOLERANCE

H, I, E = 32, 16, 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_layer(
    num_experts=E, top_k=2, activation="silu", has_bias=True, dtype=torch.float32, **kwargs
) -> FusedMoE:
    """A monolithic layer with fresh random weights large enough to reach the clamps."""
    kwargs.setdefault("backend", "monolithic")
    layer = FusedMoE(
        num_experts, top_k, H, I, activation=activation, has_bias=has_bias,
        params_dtype=dtype, **kwargs,
    )  # fmt: skip
    experts = random_experts(num_experts, H, I, activation, bias=has_bias)
    params = {"w13": layer.w13_weight, "w2": layer.w2_weight}
    params |= {"w13_bias": layer.w13_bias, "w2_bias": layer.w2_bias} if has_bias else {}
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(experts[name])
    return layer


def routed_ref(layer: FusedMoE, x, weights, ids) -> torch.Tensor:
    """The layer's experts for a given routing, float64 [M, H]."""

    def get(p):
        return None if p is None else p.detach()

    return experts_ref(
        x, get(layer.w13_weight), get(layer.w2_weight), weights, ids,
        activation=layer.activation.kind.value,
        w13_bias=get(layer.w13_bias), w2_bias=get(layer.w2_bias),
    )  # fmt: skip


def run(layer: FusedMoE, *args, **kwargs) -> torch.Tensor:
    with torch.inference_mode():  # monolithic is an inference backend
        return layer(*args, **kwargs)


# ---- against the float64 reference ------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
def test_every_activation_against_float64_reference(activation, has_bias, dtype):
    layer = make_layer(activation=activation, has_bias=has_bias, dtype=dtype)
    assert layer.backend_choice().name == "monolithic"
    x, logits = torch.randn(37, H, dtype=dtype), torch.randn(37, E)
    out = run(layer, x, logits)
    assert out.dtype == dtype and out.shape == (37, H)
    weights, ids = softmax_topk_ref(logits, 2)
    assert_close(out, routed_ref(layer, x, weights, ids), dtype)


@pytest.mark.parametrize("top_k", [1, 2, E])
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_token_counts_and_top_k(num_tokens, top_k):
    layer = make_layer(top_k=top_k)
    x, logits = torch.randn(num_tokens, H), torch.randn(num_tokens, E)
    out = run(layer, x, logits)
    assert out.shape == (num_tokens, H)
    weights, ids = softmax_topk_ref(logits, top_k)
    assert_close(out, routed_ref(layer, x, weights, ids))


@pytest.mark.parametrize("lead", [(2, 5), (1, 1, 3), (), (0, 4)])
def test_leading_dimensions(lead):
    layer = make_layer(dtype=torch.bfloat16)
    x, logits = torch.randn(*lead, H, dtype=torch.bfloat16), torch.randn(*lead, E)
    out = run(layer, x, logits)
    assert out.shape == (*lead, H)
    weights, ids = softmax_topk_ref(logits.reshape(-1, E), 2)
    expected = routed_ref(layer, x.reshape(-1, H), weights, ids)
    assert_close(out.reshape(-1, H), expected, torch.bfloat16)


def test_all_tokens_to_one_expert():
    layer = make_layer()
    x, logits = torch.randn(37, H), torch.randn(37, E)
    logits[:, 3] += 20.0
    weights, ids = softmax_topk_ref(logits, 2)
    assert (ids[:, 0] == 3).all()
    assert_close(run(layer, x, logits), routed_ref(layer, x, weights, ids))


# ---- routing inside ---------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_gpt_oss_routing_equals_softmax_topk_renormalize(scale):
    logits = torch.randn(199, 32) * 3
    weights, ids = gpt_oss_route(logits, 4, scale)
    expected_weights, expected_ids = topk_route(logits, 4, routed_scaling_factor=scale)
    assert_equal(ids, expected_ids, what="ids")
    assert_close(weights, expected_weights, tol=1e-6, what="weights")
    ref_weights, ref_ids = softmax_topk_ref(logits.double(), 4, scale=scale)
    assert_equal(ids, ref_ids, what="ids vs float64 reference")
    assert_close(weights, ref_weights, torch.float32, what="weights vs float64 reference")


def test_gpt_oss_layer():
    layer = make_layer(top_k=3, activation="swigluoai", gpt_oss_routing=True, dtype=torch.bfloat16)
    x, logits = torch.randn(37, H, dtype=torch.bfloat16), torch.randn(37, E)
    out = run(layer, x, logits)
    weights, ids = softmax_topk_ref(logits, 3)
    assert_close(out, routed_ref(layer, x, weights, ids), torch.bfloat16)
    plain = copy.deepcopy(layer)
    plain.gpt_oss_routing = False  # through the router: the same routing, computed otherwise
    assert_close(out, run(plain, x, logits), tol=1e-2)
    layer.set_backend("torch")  # other backends route through the router: the same output
    assert_close(run(layer, x, logits), out, torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scoring_func": "sigmoid"},
        {"renormalize": False},
        {"custom_routing_function": lambda x, logits, k, renorm: topk_route(logits, k)},
        {"e_score_correction_bias": torch.zeros(E)},
        {"zero_expert_num": 1, "zero_expert_type": "zero"},
    ],
)
def test_gpt_oss_routing_needs_plain_softmax_renormalize(kwargs):
    with pytest.raises(ValueError, match=r"gpt_oss_routing .* needs scoring_func='softmax'"):
        FusedMoE(E, 2, H, I, gpt_oss_routing=True, **kwargs)
    with pytest.raises(TypeError, match="gpt_oss_routing must be a bool"):
        FusedMoE(E, 2, H, I, gpt_oss_routing="yes")


@pytest.mark.parametrize(("scoring", "renormalize"), [("softmax", False), ("sigmoid", True)])
def test_plain_routers_of_other_scoring(scoring, renormalize):
    layer = make_layer(top_k=3, scoring_func=scoring, renormalize=renormalize)
    x, logits = torch.randn(37, H), torch.randn(37, E)
    weights, ids = softmax_topk_ref(logits, 3, renormalize=renormalize, scoring=scoring)
    assert_close(run(layer, x, logits), routed_ref(layer, x, weights, ids))


def test_grouped_topk_with_bias():
    bias = torch.randn(16) * 0.5
    layer = make_layer(
        num_experts=16, top_k=4, scoring_func="sigmoid", use_grouped_topk=True,
        num_expert_group=4, topk_group=2, e_score_correction_bias=bias, routed_scaling_factor=2.5,
    )  # fmt: skip
    x, logits = torch.randn(37, H), torch.randn(37, 16)
    weights, ids = grouped_topk_ref(logits, bias, 4, 4, 2, 2.5)
    assert_close(run(layer, x, logits), routed_ref(layer, x, weights, ids))


def test_custom_routing_function():
    calls = []

    def route(hidden_states, gating_output, top_k, renormalize):
        calls.append(hidden_states.shape[0])
        ids = torch.stack([gating_output.argmin(dim=1), gating_output.argmax(dim=1)], dim=1)
        return torch.full(ids.shape, 0.5), ids.to(torch.int32)

    layer = make_layer(custom_routing_function=route, routed_scaling_factor=1.5)
    x, logits = torch.randn(37, H), torch.randn(37, E)
    out = run(layer, x, logits)
    assert calls == [37]
    ids = torch.stack([logits.argmin(dim=1), logits.argmax(dim=1)], dim=1)
    assert_close(out, routed_ref(layer, x, torch.full(ids.shape, 0.75), ids))


# ---- what the layer does around it: equal to the reference backend ------------------------------
def _shared(seed: int = 1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(H, 24, bias=False), nn.SiLU(), nn.Linear(24, H, bias=False))


LAYER_FEATURES = {
    "zero_experts": dict(zero_expert_num=3, zero_expert_type="identity", top_k=3),
    "hash": dict(hash_indices_table=torch.stack([torch.randperm(E)[:2] for _ in range(50)])),
    "transforms": dict(routed_input_transform=lambda x: 2 * x, routed_output_transform=torch.tanh),
    "shared_gated": dict(shared_experts=_shared(), shared_expert_gate=nn.Linear(H, 1)),
    "sigmoid_scaled": dict(scoring_func="sigmoid", renormalize=False, routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("feature", list(LAYER_FEATURES))
def test_layer_features_match_the_reference_backend(feature):
    kwargs = dict(LAYER_FEATURES[feature])
    top_k = kwargs.pop("top_k", 2)
    layer = make_layer(top_k=top_k, **kwargs)
    x = torch.randn(3, 13, H)
    logits = torch.randn(3, 13, E + layer.zero_expert_num)
    logits[..., E:] += 1.0  # zero experts in some tokens' top-k
    extra = {"input_ids": torch.randint(0, 50, (3, 13))} if feature == "hash" else {}
    out = run(layer, x, logits, **extra)
    reference = copy.deepcopy(layer)
    reference.set_backend("torch")
    assert_close(out, run(reference, x, logits, **extra), torch.float32)


# ---- per-expert weights: views, rebuilt when replaced ----------------------------------------
def test_per_expert_weights_are_views_rebuilt_when_replaced():
    layer = make_layer()
    x, logits = torch.randn(9, H), torch.randn(9, E)
    run(layer, x, logits)
    experts = layer._kernel(x.device, x.dtype, False)[1]
    assert isinstance(experts, MonolithicExperts)
    views = experts._experts
    for e in range(E):
        assert views.w13[e].data_ptr() == layer.w13_weight[e].data_ptr()
        assert views.w2_bias[e].data_ptr() == layer.w2_bias[e].data_ptr()

    # load_weights writes in place: the same views see the new weights
    new_w2 = torch.randn(E, H, I)
    layer.load_weights([("experts.down_proj", new_w2)], strict=False)  # w2 only
    weights, ids = softmax_topk_ref(logits, 2)
    assert_close(run(layer, x, logits), routed_ref(layer, x, weights, ids))
    assert experts._experts is views

    # a replaced parameter (assignment, .to()) rebuilds them
    layer.w13_weight = nn.Parameter(torch.randn(E, 2 * I, H) * 0.3)
    assert_close(run(layer, x, logits), routed_ref(layer, x, weights, ids))
    assert experts._experts is not views
    layer.to(torch.bfloat16)  # drops the float32 backend and its views
    x16 = x.bfloat16()
    assert_close(run(layer, x16, logits), routed_ref(layer, x16, weights, ids), torch.bfloat16)
    assert layer._kernel(x.device, torch.float32, False)[1] is not experts


# ---- expert parallelism: the EP shift ---------------------------------------------------------
def checkpoint_of(layer: FusedMoE, per_expert: bool) -> list[tuple[str, torch.Tensor]]:
    """The layer's experts as a global checkpoint (fused or per-expert names)."""
    w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
    b13, b2 = layer.w13_bias.detach(), layer.w2_bias.detach()
    if not per_expert:
        return [
            ("experts.gate_up_proj", w13), ("experts.down_proj", w2),
            ("experts.gate_up_proj_bias", b13), ("experts.down_proj_bias", b2),
        ]  # fmt: skip
    items = []
    for e in range(w13.shape[0]):
        items += [
            (f"mlp.experts.{e}.gate_proj.weight", w13[e, :I]),
            (f"mlp.experts.{e}.up_proj.weight", w13[e, I:]),
            (f"mlp.experts.{e}.down_proj.weight", w2[e]),
            (f"mlp.experts.{e}.gate_proj.bias", b13[e, :I]),
            (f"mlp.experts.{e}.up_proj.bias", b13[e, I:]),
            (f"mlp.experts.{e}.down_proj.bias", b2[e]),
        ]
    return items


@pytest.mark.parametrize("per_expert", [False, True])
@pytest.mark.parametrize("ep_size", [2, 3])
def test_ep_ranks_sum_to_the_unsharded_layer(ep_size, per_expert):
    shared = _shared()
    kwargs = dict(top_k=3, zero_expert_num=2, zero_expert_type="identity")
    full = make_layer(shared_experts=shared, **kwargs)
    x, logits = torch.randn(37, H), torch.randn(37, E + 2)
    logits[:, E:] += 1.0
    expected = run(full, x, logits)

    total = torch.zeros(37, H, dtype=torch.float64)
    starts = []
    for rank in range(ep_size):
        ep = ParallelConfig(ep_size=ep_size, ep_rank=rank)
        layer = FusedMoE(E, 3, H, I, has_bias=True, params_dtype=torch.float32,
                         shared_experts=shared, parallel_config=ep, zero_expert_num=2,
                         zero_expert_type="identity")  # fmt: skip
        assert layer.backend_choice().name == "monolithic"
        loaded = layer.load_weights(checkpoint_of(full, per_expert))
        start, count = layer.expert_start, layer.local_num_experts
        starts.append((start, count))
        assert layer.w13_weight.shape == (count, 2 * I, H)
        assert_equal(layer.w13_weight, full.w13_weight[start : start + count], what="w13 share")
        assert_equal(layer.w2_bias, full.w2_bias[start : start + count], what="w2_bias share")
        if per_expert:  # other ranks' experts are skipped, not loaded
            assert {int(name.split(".")[2]) for name in loaded} == set(range(start, start + count))
        total += run(layer, x, logits).double()
    # linear placement: 8 = 4 + 4 or 3 + 3 + 2, contiguous
    assert starts == ([(0, 4), (4, 4)] if ep_size == 2 else [(0, 3), (3, 3), (6, 2)])
    assert_close(total, expected.double(), torch.float32)


def test_ep_refusals():
    ep = ParallelConfig(ep_size=2, ep_rank=1)
    with pytest.raises(ValueError, match=r"ep_size \(9\) must be <= num_experts \(8\)"):
        FusedMoE(E, 2, H, I, parallel_config=ParallelConfig(ep_size=9, ep_rank=0))
    with pytest.raises(ValueError, match="routed_output_transform with ep_size > 1 and no DP"):
        FusedMoE(E, 2, H, I, parallel_config=ep, routed_output_transform=torch.tanh)
    with pytest.raises(ValueError, match="ep_size / ep_rank must equal dp_size / dp_rank"):
        FusedMoE(E, 2, H, I, parallel_config=ParallelConfig(ep_size=2, dp_size=4))
    # quantized (on a modular backend) and autograd (the reference backend, through the
    # expert_map) run a shard too since EP prepare/finalize (tests/test_ep.py)
    FusedMoE(E, 2, H, 32, parallel_config=ep, quant_config="fp8_block")
    layer = FusedMoE(E, 2, H, I, parallel_config=ep, params_dtype=torch.float32)
    assert layer.backend_choice(requires_grad=True).name == "torch"
    assert "experts [4, 8)" in repr(layer)


# ---- data parallelism: all-gather dispatch over gloo ------------------------------------------
# tokens of rank 0 and rank 1, per call: uneven, one rank idle, both idle
DP_TOKENS = [(5, 8), (13, 0), (0, 0)]


def _dp_worker(rank: int, port: int, path: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        data = torch.load(path)
        outputs = {}
        for ep_size in (2, 1):
            for dtype in (torch.float32, torch.bfloat16):
                ep_rank = rank % ep_size
                pc = ParallelConfig(ep_size=ep_size, ep_rank=ep_rank, dp_size=2, dp_rank=rank)
                layer = FusedMoE(
                    E, 3, H, I, activation="swigluoai", has_bias=True, params_dtype=dtype,
                    parallel_config=pc, shared_experts=_shared().to(dtype), backend="monolithic",
                )  # fmt: skip
                layer.load_weights(data["checkpoint"])
                start = 0
                for call, counts in enumerate(DP_TOKENS):
                    rows = slice(start + sum(counts[:rank]), start + sum(counts[: rank + 1]))
                    start += sum(counts)
                    x, logits = data["x"][rows].to(dtype), data["logits"][rows]
                    outputs[ep_size, str(dtype), call] = run(layer, x, logits)
        torch.save(outputs, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def test_dp_needs_an_initialized_group():
    pc = ParallelConfig(ep_size=2, ep_rank=0, dp_size=2, dp_rank=0)
    layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32, parallel_config=pc)
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized here")
    with pytest.raises(ValueError, match=r"needs torch\.distributed initialized"):
        run(layer, torch.randn(3, H), torch.randn(3, E))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
def test_dp_sharded_equals_single_process():
    full = make_layer(top_k=3, activation="swigluoai", shared_experts=_shared())
    total = sum(sum(counts) for counts in DP_TOKENS)
    x, logits = torch.randn(total, H), torch.randn(total, E)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dp.pt")
        torch.save({"checkpoint": checkpoint_of(full, False), "x": x, "logits": logits}, path)
        context = mp.start_processes(
            _dp_worker, args=(_free_port(), path), nprocs=2, join=False, start_method="spawn"
        )
        for _ in range(120):  # at most 120 s
            if context.join(timeout=1):
                break
        else:
            for process in context.processes:
                process.kill()
            pytest.fail("the DP workers did not finish in 120 s")
        ranks = [torch.load(f"{path}.rank{r}") for r in range(2)]

    for ep_size in (2, 1):
        for dtype in (torch.float32, torch.bfloat16):
            layer = copy.deepcopy(full).to(dtype)
            start = 0
            for call, counts in enumerate(DP_TOKENS):
                rows = slice(start, start + sum(counts))
                start += sum(counts)
                expected = run(layer, x[rows].to(dtype), logits[rows])
                got = torch.cat([ranks[r][ep_size, str(dtype), call] for r in range(2)])
                assert got.dtype == dtype
                assert_close(got, expected, dtype, what=f"ep {ep_size} {dtype} call {call}")


# ---- the oracle: choice and refusals ----------------------------------------------------------
PROBLEM = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_oracle_prefers_monolithic_with_router_logits(dtype):
    choice = select_backend(dtype=dtype, has_router_logits=True, has_bias=True, **PROBLEM)
    assert choice.name == "monolithic"
    assert choice.refused["torch"] == "supported, but monolithic is preferred"
    assert "monolithic" in FusedMoE(E, 2, H, I, params_dtype=dtype).backend_choice().explain()


def test_oracle_refusals():
    without_logits = select_backend(**PROBLEM)
    assert without_logits.name == "torch"
    assert without_logits.refused["monolithic"].startswith("routes inside: it needs the router")
    float64 = select_backend(dtype=torch.float64, has_router_logits=True, **PROBLEM)
    assert float64.name == "torch" and "float64" in float64.refused["monolithic"]
    expert_map = select_backend(has_router_logits=True, has_expert_map=True, **PROBLEM)
    assert expert_map.refused["monolithic"] == "no expert_map"

    # training: the reference backend runs, and an explicit monolithic says why not
    layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32)
    assert layer.backend_choice(requires_grad=True).name == "torch"
    layer.set_backend("monolithic")
    with pytest.raises(ValueError, match=r"'monolithic' cannot run this call: no autograd"):
        layer(torch.randn(3, H), torch.randn(3, E))

    # a quantized layer
    quantized = FusedMoE(E, 2, H, 32, quant_config="fp8_block")
    choice = quantized.backend_choice()
    assert choice.name == "torch"
    assert choice.refused["monolithic"].startswith("does not support quant config")
    with pytest.raises(ValueError, match="'monolithic' cannot run this call: does not support"):
        quantized.set_backend("monolithic")


def test_fused_experts_refuses_monolithic():
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    weights, ids = softmax_topk_ref(torch.randn(3, E), 2)
    x = torch.randn(3, H)
    with pytest.raises(ValueError, match="'monolithic' cannot run this call: routes inside"):
        fused_experts(x, w13, w2, weights.float(), ids, backend="monolithic")
    with torch.inference_mode():  # auto never picks it there
        out = fused_experts(x, w13, w2, weights.float(), ids)
    assert_close(out, experts_ref(x, w13, w2, weights, ids))
    with pytest.raises(TypeError, match="never in the modular kernel"):
        MonolithicExperts().finalize_weight_and_reduce_impl()


# ---- intermediate-size padding of MX / NVFP4 quantized layers ---------------------------------
def _dequant(layer: FusedMoE, which: str) -> torch.Tensor:
    w, s = getattr(layer, f"{which}_weight"), getattr(layer, f"{which}_weight_scale")
    if layer.quant_scheme == "nvfp4":
        return dequant_nvfp4(w, s, getattr(layer, f"{which}_weight_global_scale"))
    return dequant_mxfp4(w, s)


@pytest.mark.parametrize(
    ("scheme", "activation", "inter", "padded"),
    [
        ("mxfp4_w4a16", "swigluoai", 40, 64),
        ("mxfp4_w4a16", "silu", 40, 64),
        ("mxfp4_w4a16", "relu2_no_mul", 72, 96),
        ("nvfp4", "gelu", 40, 48),
    ],
)
def test_intermediate_size_padding(scheme, activation, inter, padded):
    hidden, dtype = 64, torch.float64
    float_layer = FusedMoE(
        4, 2, hidden, inter, activation=activation, has_bias=True, params_dtype=dtype
    )
    with torch.no_grad():
        float_layer.w13_weight.normal_(0.0, 3.0 / hidden**0.5)
        float_layer.w2_weight.normal_(0.0, 1.0 / inter**0.5)
    layer = copy.deepcopy(float_layer).quantize_(scheme)
    assert (layer.intermediate_size, layer.padded_intermediate_size) == (inter, padded)
    assert f"padded_intermediate_size={padded}" in repr(layer)
    gated = activation != "relu2_no_mul"
    num_n, num_np = (2 * inter, 2 * padded) if gated else (inter, padded)
    assert layer.w13_weight.shape == (4, num_np, hidden // 2)
    assert layer.w2_weight.shape == (4, hidden, padded // 2)
    assert layer.w13_bias.shape == (4, num_np) and layer.w2_bias.shape == (4, hidden)

    # the zeros: exact, where the activation's layout reads the padded channels
    if activation == "swigluoai":  # (gate, up) pairs alternate: the pairs I .. Ip - 1
        real = torch.arange(num_np) < num_n
    elif gated:  # gate rows [0, I), up rows [Ip, Ip + I)
        real = (torch.arange(num_np) % padded) < inter
    else:
        real = torch.arange(num_np) < inter
    w13, w2 = _dequant(layer, "w13"), _dequant(layer, "w2")
    assert torch.equal(w13[:, ~real], torch.zeros_like(w13[:, ~real]))
    assert torch.equal(layer.w13_bias[:, ~real], torch.zeros_like(layer.w13_bias[:, ~real]))
    assert torch.equal(w2[..., inter:], torch.zeros_like(w2[..., inter:]))
    assert_equal(layer.w13_bias[:, real], float_layer.w13_bias.detach(), what="real bias rows")

    x, logits = torch.randn(37, hidden, dtype=dtype), torch.randn(37, 4)
    out = layer(x, logits)
    assert out.shape == (37, hidden)
    if scheme == "mxfp4_w4a16":  # unquantized activations: exactly the unpadded computation
        weights, ids = softmax_topk_ref(logits, 2)
        unpadded = experts_ref(
            x, w13[:, real], w2[..., :inter], weights, ids, activation=activation,
            w13_bias=layer.w13_bias[:, real].detach(), w2_bias=layer.w2_bias.detach(),
        )  # fmt: skip
        assert_close(out, unpadded, tol=1e-6)
    # the float I = inter layer, within the scheme's quantization error
    max_tol, rms_tol = SCHEME_TOLERANCE[scheme]
    assert_close(out, float_layer(x, logits), tol=max_tol, rms_tol=rms_tol, what=scheme)


def test_gpt_oss_mxfp4_layer_of_unaligned_intermediate_size():
    """The constructor pads too, and load_weights takes the padded checkpoint layout."""
    layer = FusedMoE(
        4, 2, 64, 40, activation="swigluoai", has_bias=True, quant_config="mxfp4_w4a16"
    )
    assert layer.padded_intermediate_size == 64
    blocks = torch.randint(0, 256, (4, 128, 2, 16), dtype=torch.uint8)
    scales = torch.randint(120, 123, (4, 128, 2), dtype=torch.uint8)
    down_blocks = torch.randint(0, 256, (4, 64, 2, 16), dtype=torch.uint8)
    loaded = layer.load_weights(
        [
            ("experts.gate_up_proj_blocks", blocks),
            ("experts.gate_up_proj_scales", scales),
            ("experts.gate_up_proj_bias", torch.randn(4, 128)),
            ("experts.down_proj_blocks", down_blocks),
        ],
        strict=False,  # a part of the checkpoint: the layout is what is checked
    )
    assert len(loaded) == 4
    assert_equal(layer.w13_weight, blocks.reshape(4, 128, 32), what="w13 blocks")
    with pytest.raises(ValueError, match=r"expected shape \(4, 64, 2, 16\), got \(4, 64, 1, 16\)"):
        layer.load_weights([("experts.down_proj_blocks", down_blocks[:, :, :1])])
    # schemes that take partial groups are not padded
    fp8 = FusedMoE(4, 2, 64, 40, activation="swigluoai", has_bias=True, quant_config="fp8_block")
    assert fp8.padded_intermediate_size == 40 and fp8.w2_weight.shape == (4, 64, 40)


# ---- CUDA -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda(dtype):
    layer = make_layer(top_k=3, activation="swigluoai", dtype=dtype, gpt_oss_routing=True).cuda()
    assert layer.backend_choice().name == "monolithic"
    x, logits = torch.randn(37, H, dtype=dtype), torch.randn(37, E)
    out = run(layer, x.cuda(), logits.cuda())
    assert out.device.type == "cuda" and out.dtype == dtype
    weights, ids = softmax_topk_ref(logits, 3)
    assert_close(out, routed_ref(layer.cpu(), x, weights, ids), dtype)
