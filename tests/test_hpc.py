"""The hpc backend (fusedmoe.experts.hpc): the fully fused FP8 path with the top-k reduce in
GEMM2, against the float64 torch backend on the same quantized weights.

Without a GPU the kernels run on Triton's CPU interpreter (small shapes; H a multiple of 128);
the `gpu` tests run them at the presets' sizes, under CUDA graphs and torch.compile.
Legend: M tokens, k top-k, E experts (E_l local), H hidden, I intermediate.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from fusedmoe import FusedMoE, fused_experts, select_backend
from fusedmoe.experts.hpc import HPCExperts
from fusedmoe.kernels.hpc_moe import fused_moe_hpc
from fusedmoe.modular.kernel import FusedMoEModularKernel
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.modular.reduce import TopKWeightAndReduceNoOp
from fusedmoe.modular.types import ActivationSpec, ExpertWeights
from fusedmoe.quant import quantize_experts
from tests.helpers import (
    assert_close,
    assert_equal,
    poison_,
    preset_problem,
    quant_config_to,
    quant_tol,
    random_routing,
)
from tests.reference import random_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, E = 256, 192, 6  # I = 192: a partial 1 x 128 group of a2 and a masked GEMM1 tail
QUANT_TOL = quant_tol(DEVICE)
STATIC = dict(a1_scale=torch.tensor([0.02]), a2_scale=torch.tensor([0.004]))
# (scheme, make_quant_config keywords)
SCHEMES = {
    "fp8_block": ("fp8_block", {}),
    "fp8_block_ue8m0": ("fp8_block", {"use_ue8m0": True}),
    "fp8_tensor_static": ("fp8_tensor", STATIC),
}


def _problem(scheme: str, num_experts: int = E, hidden: int = H, inter: int = I):
    name, kwargs = SCHEMES[scheme]
    experts = random_experts(num_experts, hidden, inter, dtype=torch.bfloat16)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], name, **kwargs)
    if DEVICE == "cuda":
        w13, w2 = w13.cuda(), w2.cuda()
        qc = quant_config_to(qc, DEVICE)
    return w13, w2, qc


_routing = functools.partial(random_routing, device=DEVICE)


def _x(num_tokens, hidden=H):
    return torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# against the torch backend
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_matches_torch_backend(scheme, num_tokens):
    w13, w2, qc = _problem(scheme)
    weights, ids = _routing(num_tokens, E, 3, empty=0.1)
    x = _x(num_tokens)
    out = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="hpc")
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, H)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


@pytest.mark.parametrize(
    "case", ["all_to_one_expert", "k_equals_E", "one_expert", "all_slots_empty"]
)
def test_degenerate_routings(case):
    num_experts, top_k, hot = {
        "all_to_one_expert": (E, 1, 4),
        "k_equals_E": (4, 4, None),
        "one_expert": (1, 1, None),
        "all_slots_empty": (E, 2, None),
    }[case]
    w13, w2, qc = _problem("fp8_block", num_experts)
    weights, ids = _routing(9, num_experts, top_k, hot=hot)
    if case == "all_slots_empty":
        ids = torch.full_like(ids, -1)
    x = _x(9)
    out = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="hpc")
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)
    if case == "all_slots_empty":
        assert_equal(out, torch.zeros_like(out), what="no slot routed")


def test_zero_tokens():
    w13, w2, qc = _problem("fp8_block")
    weights, ids = _routing(0, E, 2)
    out = fused_experts(_x(0), w13, w2, weights, ids, quant_config=qc, backend="hpc")
    assert out.shape == (0, H)


@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_tensor_static"])
@pytest.mark.parametrize("num_tokens", [1, 11])
@pytest.mark.parametrize("how", ["ep_rank", "expert_map"])
def test_ep_rank_skips_experts_of_other_ranks(scheme, num_tokens, how):
    """Rank 1 of 3 of 3E + 1 experts holds global experts [E + 1, 2E + 1) (the first rank takes
    the extra one): its output is the torch backend's with an expert_map over the same local
    weights; routed experts elsewhere contribute zero. The rank is given by ep_rank / ep_size,
    or by the expert_map a caller (the layer under EP) passes."""
    w13, w2, qc = _problem(scheme)
    num_global = 3 * E + 1
    weights, ids = _routing(num_tokens, num_global, 4, empty=0.1)
    x = _x(num_tokens)
    expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    expert_map[E + 1 : 2 * E + 1] = torch.arange(E, dtype=torch.int32)
    expert_map = expert_map.to(DEVICE)
    ref = fused_experts(
        x, w13, w2, weights, ids, quant_config=qc, backend="torch",
        expert_map=expert_map, global_num_experts=num_global,
    )  # fmt: skip
    experts = HPCExperts(ep_rank=1, ep_size=3) if how == "ep_rank" else HPCExperts()
    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), experts)
    out = kernel.forward(
        x, ExpertWeights(w13, w2), weights, ids, activation=ActivationSpec(),
        global_num_experts=num_global, quant_config=qc,
        expert_map=expert_map if how == "expert_map" else None,
    )  # fmt: skip
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)
    assert float(out.float().abs().max()) > 0  # some experts are local: not trivially zero


def test_ep_rank_must_match_the_local_experts():
    w13, w2, qc = _problem("fp8_block")
    weights, ids = _routing(3, 3 * E, 2)
    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), HPCExperts(ep_rank=0, ep_size=2))
    with pytest.raises(ValueError, match="rank 0 of 2 holds 9 of the 18 experts"):
        kernel.forward(
            _x(3), ExpertWeights(w13, w2), weights, ids, activation=ActivationSpec(),
            global_num_experts=3 * E, quant_config=qc,
        )  # fmt: skip


def test_op_adds_shared_output_and_overwrites_accumulator():
    w13, w2, qc = _problem("fp8_block")
    weights, ids = _routing(7, E, 2)
    x = _x(7)
    shared = torch.randn(7, H, dtype=torch.bfloat16, device=DEVICE)
    accumulator = poison_(torch.empty(7 * H + 5, dtype=torch.float32, device=DEVICE))
    out = poison_(torch.empty(7, H, dtype=torch.bfloat16, device=DEVICE))
    fused_moe_hpc(
        out, x, w13, w2, weights, ids, w13_scale=qc.w1.scale, w2_scale=qc.w2.scale,
        accumulator=accumulator, shared_output=shared,
    )  # fmt: skip
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(
        out, (ref.float() + shared.float()).to(torch.bfloat16), torch.bfloat16, **QUANT_TOL
    )


# ---------------------------------------------------------------------------------------------
# contract and oracle
# ---------------------------------------------------------------------------------------------
def test_contract():
    experts = HPCExperts()
    shapes = experts.workspace_shapes(5, 2 * I, H, 2, E, E, ActivationSpec().kind)
    assert (shapes.workspace13, shapes.workspace2, shapes.output) == ((5, H), (0,), (5, H))
    assert isinstance(experts.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOp)
    assert experts.workspace_dtype(torch.bfloat16) == torch.float32
    assert experts.wants_unquantized_input()
    with pytest.raises(ValueError, match="ep_rank"):
        HPCExperts(ep_rank=-1)
    with pytest.raises(ValueError, match=r"ep_rank must be in \[0, 2\)"):
        HPCExperts(ep_rank=2, ep_size=2)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(quant_config=None), "quant config"),
        (dict(activation="gelu"), "no gelu activation"),
        (dict(hidden_size=200), "hidden_size 200"),
        (dict(has_bias=True), "no expert biases"),
        (dict(has_expert_map=True), "no expert_map"),
        (dict(dtype=torch.float32), "no torch.float32"),
        (dict(scheme="fp8_tensor_dynamic"), "quant config"),
        (dict(activation_params="clamp"), "clamped SiLU"),
    ],
)
def test_oracle_refuses_with_reason(change, reason):
    from fusedmoe import ActivationParams
    from fusedmoe.quant import make_quant_config

    _, _, qc = _problem("fp8_block")
    if change.pop("scheme", None):
        qc = make_quant_config("fp8_tensor", qc.w1.scale[:, 0, 0], qc.w2.scale[:, 0, 0])
    if change.pop("activation_params", None):
        change["activation_params"] = ActivationParams(limit=7.0)
    kwargs = dict(
        device=DEVICE, dtype=torch.bfloat16, hidden_size=H, intermediate_size=I,
        num_experts=E, top_k=2, quant_config=qc,
    )  # fmt: skip
    kwargs.update(change)
    with pytest.raises(ValueError, match=reason):
        select_backend(backend="hpc", **kwargs)


def test_layer_runs_hpc_by_name():
    layer = FusedMoE(E, 2, H, I, params_dtype=torch.bfloat16, device=DEVICE)
    layer.reset_parameters()
    layer.quantize_("fp8_block")
    layer.set_backend("hpc")
    assert layer.backend_choice().name == "hpc"
    x = _x(13)
    logits = torch.randn(13, E, device=DEVICE)
    with torch.inference_mode():
        out = layer(x, logits)
        layer.set_backend("torch")
        ref = layer(x, logits)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


# ---------------------------------------------------------------------------------------------
# GPU: preset sizes, CUDA graphs, torch.compile
# ---------------------------------------------------------------------------------------------
GPU_CASES = [
    ("deepseek-v3", "fp8_block", {}),
    ("qwen3-235b-a22b", "fp8_block", {}),
    ("qwen3-30b-a3b", "fp8_tensor", {"a1_scale": 0.05, "a2_scale": 0.01}),
]


def _gpu_problem(preset, scheme, scales, num_tokens):
    kwargs = {k: torch.tensor([v], device="cuda") for k, v in scales.items()}
    return preset_problem(preset, num_tokens, scheme, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize(("preset", "scheme", "scales"), GPU_CASES)
def test_gpu_presets_match_torch_backend(preset, scheme, scales):
    _, x, experts, weights, ids, qc = _gpu_problem(preset, scheme, scales, 512)
    for num_tokens in (1, 8, 64, 512):
        args = (x[:num_tokens], experts["w13"], experts["w2"], weights[:num_tokens])
        out = fused_experts(*args, ids[:num_tokens], quant_config=qc, backend="hpc")
        ref = fused_experts(*args, ids[:num_tokens], quant_config=qc, backend="torch")
        assert_close(out, ref, torch.bfloat16, what=f"M = {num_tokens}", **QUANT_TOL)


@pytest.mark.gpu
def test_gpu_cuda_graph_and_compile():
    spec, x, experts, weights, ids, qc = _gpu_problem("qwen3-30b-a3b", "fp8_block", {}, 64)

    def run(x, ids):
        return fused_experts(x, experts["w13"], experts["w2"], weights, ids, quant_config=qc,
                             backend="hpc")  # fmt: skip

    eager = run(x, ids)
    static_ids = ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x, static_ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(x, static_ids)
    new_ids = torch.rand(64, spec.num_experts, device="cuda").argsort(1)[:, : spec.top_k]
    static_ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    expected = run(x, static_ids)
    assert not torch.equal(expected, eager)
    assert_close(captured, expected, torch.bfloat16, tol=1e-2)  # atomics: order may differ
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, ids: run(x * 0.5, ids) + 1)
    assert_close(compiled(x, ids), run(x * 0.5, ids) + 1, torch.bfloat16, tol=1e-2)
