"""The DeepGEMM-style backends (fusedmoe.experts.deep_gemm): the contiguous aligned layout, the
grouped GEMMs over it, the fused activation + quantization, the unpermute-reduce, and the
"triton or deep_gemm" fallback, against their torch twins and the float64 torch backend.

Without a GPU the kernels run on Triton's CPU interpreter, so the shapes are the smallest the
DeepGEMM contract accepts (M >= 128 tokens, N = 2I > 512, N and K multiples of 128); the `gpu`
tests run the presets' sizes. Legend: M tokens, k top-k, S = M * k slots, E experts (E_l
local), H = K hidden, I intermediate, N = 2I, A the alignment.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

pytest.importorskip("triton")

from fusedmoe import ActivationParams, fused_experts, select_backend
from fusedmoe.experts.deep_gemm import DeepGemmExperts, DeepGemmFP4Experts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.kernels.deep_gemm_moe import (
    compute_aligned_M_and_alignment,
    permute_contiguous,
    permute_contiguous_torch,
    unpermute_reduce,
    unpermute_reduce_torch,
)
from fusedmoe.modular.reduce import TopKWeightAndReduceNoOp
from fusedmoe.modular.types import ActivationSpec, ExpertTokensMeta
from fusedmoe.quant import quantize_experts
from fusedmoe.quant.activation import per_token_group_quant_fp8
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
H, I, E, K_TOP = 256, 320, 4, 2  # N = 640 > 512; I = 320: a partial group of a2
QUANT_TOL = quant_tol(DEVICE)
# padding rows of the aligned layout hold whatever the workspace held: on the interpreter,
# numpy warns when the activation of such a row overflows (the row is never read back)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


_routing = functools.partial(random_routing, device=DEVICE)


def _quantized(scheme, num_experts=E, activation="silu", **kwargs):
    experts = random_experts(num_experts, H, I, activation, dtype=torch.bfloat16)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], scheme, **kwargs)
    return w13.to(DEVICE), w2.to(DEVICE), quant_config_to(qc, DEVICE)


def _biases(num_experts=E, n=2 * I):
    """GEMM1 / GEMM2 biases as large as h's and y's values, so that a lost one shows."""
    b13 = torch.randn(num_experts, n, device=DEVICE) * 3
    b2 = torch.randn(num_experts, H, device=DEVICE)
    return b13.to(torch.bfloat16), b2.to(torch.bfloat16)


def _x(num_tokens):
    return torch.randn(num_tokens, H, dtype=torch.bfloat16, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# the layout: sizes, permute and unpermute against their twins
# ---------------------------------------------------------------------------------------------
def test_compute_aligned_m():
    # worst case without counts: min(S * A, S + E_l * (A - 1)) rounded up to A
    assert compute_aligned_M_and_alignment(3, 2, 8, 128) == (768, 128)  # 6 slots, 6 runs
    assert compute_aligned_M_and_alignment(1000, 8, 4, 128) == (8576, 128)  # 8000 + 4 * 127
    counts = ExpertTokensMeta(torch.tensor([0, 5, 128, 129]), torch.tensor([0, 5, 128, 129]))
    assert compute_aligned_M_and_alignment(131, 2, 4, 128, counts) == (128 * 4, 128)
    with pytest.raises(ValueError, match="power of two"):
        compute_aligned_M_and_alignment(3, 2, 8, 96)


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_local", "use_map", "alignment"),
    [(1, 1, 1, False, 16), (37, 3, 8, False, 16), (37, 3, 8, True, 32), (130, 2, 4, False, 128)],
)
def test_permute_matches_twin(num_tokens, top_k, num_local, use_map, alignment):
    num_global = 2 * num_local + 1 if use_map else num_local
    weights, ids = _routing(num_tokens, max(num_global, top_k), top_k, empty=0.1)
    expert_map = None
    if use_map:  # the odd global experts are local
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[1::2][:num_local] = torch.arange(num_local, dtype=torch.int32)
        expert_map = expert_map.to(DEVICE)
    x = torch.randn(num_tokens, 160, device=DEVICE)  # K = 160: a partial group
    q, scales = per_token_group_quant_fp8(x, 128)
    m_sum, _ = compute_aligned_M_and_alignment(num_tokens, top_k, num_local, alignment)
    layout = permute_contiguous(q, scales, ids, num_local, alignment, m_sum, expert_map)
    a_ref, s_ref, m_ref, where = permute_contiguous_torch(
        q, scales, ids, num_local, alignment, expert_map
    )
    rows = a_ref.shape[0]
    assert int(layout.num_rows[0]) == rows
    assert_equal(layout.m_indices[:rows], m_ref, what="m_indices")
    assert bool((layout.m_indices[rows:] == -1).all()), "rows past the end are padding"
    real = m_ref >= 0
    assert_equal(layout.a[:rows].view(torch.uint8)[real], a_ref.view(torch.uint8)[real])
    assert_equal(layout.a_scale[:rows][real], s_ref[real], what="scales")
    for slot, row in where.items():
        assert int(layout.inv_perm[slot]) == row

    y = torch.randn(m_sum, 96, device=DEVICE).to(torch.bfloat16)
    out = poison_(torch.empty(num_tokens, 96, dtype=torch.bfloat16, device=DEVICE))
    unpermute_reduce(y, out, weights, ids, layout.inv_perm, num_local, expert_map)
    assert_close(out, unpermute_reduce_torch(y, weights, ids, where), torch.bfloat16)
    # with GEMM2's biases: each slot's row gets its local expert's before the weighting
    bias = torch.randn(num_local, 96, device=DEVICE) * 4
    local = ids.long().clamp(min=0) if expert_map is None else expert_map.long()[ids.long()]
    out = poison_(torch.empty(num_tokens, 96, dtype=torch.bfloat16, device=DEVICE))
    unpermute_reduce(y, out, weights, ids, layout.inv_perm, num_local, expert_map, True, bias)
    ref = unpermute_reduce_torch(y, weights, ids, where, True, bias, local)
    assert_close(out, ref, torch.bfloat16)
    if where:  # some slot routed here: its bias shows
        unbiased = unpermute_reduce_torch(y, weights, ids, where)
        assert (ref.float() - unbiased.float()).abs().max() > 1


# ---------------------------------------------------------------------------------------------
# the backends against the torch backend
# ---------------------------------------------------------------------------------------------
CASES = {  # name -> (scheme, quantize keywords, activation, activation params)
    "fp8_block": ("fp8_block", {}, "silu", None),
    "fp8_block_ue8m0_colmajor": (
        "fp8_block", {"use_ue8m0": True, "column_major_scales": True}, "silu", None
    ),
    "swiglustep": ("fp8_block", {}, "swiglustep", ActivationParams(limit=5.0)),
    "swigluoai_uninterleave": (
        "fp8_block", {}, "swigluoai_uninterleave", ActivationParams(alpha=1.5, beta=0.5, limit=6.0)
    ),
    "mxfp8": ("mxfp8", {}, "silu", None),
    "mxfp4_w4a8": ("mxfp4_w4a8", {}, "silu", None),
}  # fmt: skip
BIAS_CASES = {  # gpt-oss: gate and up interleaved, biases on both GEMMs
    "swigluoai_bias": ("fp8_block", {}, "swigluoai", ActivationParams(alpha=1.702, limit=7.0)),
    "swigluoai_uninterleave_bias": ("fp8_block", {}, "swigluoai_uninterleave", None),
    "mxfp8_bias": ("mxfp8", {}, "swigluoai", None),
    "mxfp4_w4a8_bias": ("mxfp4_w4a8", {}, "swigluoai", None),
}  # fmt: skip


def _backend(scheme):
    return "deep_gemm_fp4" if scheme == "mxfp4_w4a8" else "deep_gemm"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_backend(case):
    scheme, qkw, activation, params = CASES[case]
    w13, w2, qc = _quantized(scheme, activation=activation, **qkw)
    weights, ids = _routing(128, E, K_TOP, empty=0.05)
    x = _x(128)
    kwargs = dict(quant_config=qc, activation=activation, activation_params=params)
    out = fused_experts(x, w13, w2, weights, ids, backend=_backend(scheme), **kwargs)
    ref = fused_experts(x, w13, w2, weights, ids, backend="torch", **kwargs)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


@pytest.mark.parametrize("case", list(BIAS_CASES))
def test_biases_match_torch_backend(case):
    scheme, qkw, activation, params = BIAS_CASES[case]
    w13, w2, qc = _quantized(scheme, activation=activation, **qkw)
    b13, b2 = _biases()
    weights, ids = _routing(128, E, K_TOP, empty=0.05)
    x = _x(128)
    kwargs = dict(quant_config=qc, activation=activation, activation_params=params)
    out = fused_experts(
        x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, backend=_backend(scheme), **kwargs
    )
    ref = fused_experts(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, backend="torch",
                        **kwargs)  # fmt: skip
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)
    unbiased = fused_experts(x, w13, w2, weights, ids, backend="torch", **kwargs)
    assert (ref.float() - unbiased.float()).abs().max() > 0.5  # the biases matter here


def test_biases_with_the_router_weight_on_the_input():
    """apply_router_weight_on_input (k = 1): x is weighted before GEMM1, and neither bias is."""
    w13, w2, qc = _quantized("fp8_block", activation="swigluoai")
    b13, b2 = _biases()
    weights, ids = _routing(130, E, 1)
    x = _x(130)
    kwargs = dict(quant_config=qc, activation="swigluoai", w13_bias=b13, w2_bias=b2,
                  apply_router_weight_on_input=True)  # fmt: skip
    out = fused_experts(x, w13, w2, weights, ids, backend="deep_gemm", **kwargs)
    ref = fused_experts(x, w13, w2, weights, ids, backend="torch", **kwargs)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


@pytest.mark.parametrize("case", ["all_to_one_expert", "expert_without_tokens", "expert_map"])
def test_routings(case):
    w13, w2, qc = _quantized("fp8_block")
    kwargs = dict(quant_config=qc)
    if case == "all_to_one_expert":
        weights, ids = _routing(130, E, 1, hot=2)
    elif case == "expert_without_tokens":
        weights, ids = _routing(128, E, K_TOP)
        ids = torch.where(ids == 1, torch.full_like(ids, 3), ids)
        ids[:, 1] = torch.where(ids[:, 0] == 3, 0, ids[:, 1])  # keep the k ids distinct
    else:  # rank 1 of 2 under EP: global experts [E, 2E) are local
        weights, ids = _routing(128, 2 * E, K_TOP)
        expert_map = torch.full((2 * E,), -1, dtype=torch.int32, device=DEVICE)
        expert_map[E:] = torch.arange(E, dtype=torch.int32, device=DEVICE)
        kwargs.update(expert_map=expert_map, global_num_experts=2 * E)
    x = _x(ids.shape[0])
    out = fused_experts(x, w13, w2, weights, ids, backend="deep_gemm", **kwargs)
    ref = fused_experts(x, w13, w2, weights, ids, backend="torch", **kwargs)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)
    b13, b2 = _biases()  # a local expert's biases, under EP too
    kwargs.update(w13_bias=b13, w2_bias=b2)
    out = fused_experts(x, w13, w2, weights, ids, backend="deep_gemm", **kwargs)
    ref = fused_experts(x, w13, w2, weights, ids, backend="torch", **kwargs)
    assert_close(out, ref, torch.bfloat16, what="with biases", **QUANT_TOL)


# ---------------------------------------------------------------------------------------------
# the contract: validity, fallback, workspaces, oracle
# ---------------------------------------------------------------------------------------------
def test_requested_by_name_refuses_calls_outside_the_contract():
    w13, w2, qc = _quantized("fp8_block")
    weights, ids = _routing(5, E, K_TOP)
    with pytest.raises(ValueError, match="M = 5 < the alignment 128"):
        fused_experts(_x(5), w13, w2, weights, ids, quant_config=qc, backend="deep_gemm")


def test_unrequested_instance_falls_back_to_triton_and_logs_once(monkeypatch, caplog):
    """The instance the oracle builds when it picks deep_gemm itself (create(requested=False):
    the MX schemes, or a call with backend="auto" wherever deep_gemm is preferred)."""
    w13, w2, qc = _quantized("fp8_block")
    weights, ids = _routing(5, E, K_TOP)
    calls = []
    real = TritonExperts.apply

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TritonExperts, "apply", spy)
    from fusedmoe.modular.kernel import FusedMoEModularKernel
    from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
    from fusedmoe.modular.types import ExpertWeights

    experts = DeepGemmExperts.create(requested=False)
    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), experts)
    x = _x(5)
    with caplog.at_level(logging.INFO, logger="fusedmoe"):
        for _ in range(2):
            out = kernel.forward(
                x, ExpertWeights(w13, w2), weights, ids, activation=ActivationSpec(),
                global_num_experts=E, quant_config=qc,
            )  # fmt: skip
    assert len(calls) == 2
    assert [r.message for r in caplog.records].count(
        "deep_gemm: M = 5 < the alignment 128; this call runs on the triton backend"
    ) == 1
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


def test_mx_schemes_run_the_contiguous_path_outside_the_contract():
    """Triton has no MX path: a small call of an auto-chosen deep_gemm_fp4 runs its own."""
    from fusedmoe.modular.kernel import FusedMoEModularKernel
    from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
    from fusedmoe.modular.types import ExpertWeights

    w13, w2, qc = _quantized("mxfp4_w4a8")
    weights, ids = _routing(3, E, K_TOP)
    x = _x(3)
    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), DeepGemmFP4Experts.create())
    out = kernel.forward(
        x, ExpertWeights(w13, w2, k_packing=2), weights, ids, activation=ActivationSpec(),
        global_num_experts=E, quant_config=qc,
    )  # fmt: skip
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


def test_mx_activation_scales_of_a_k_tail_are_not_read_past_the_row():
    """K = 160: the second 128-wide K tile holds one 32-group of MX scales; the codes past it
    belong to the next row (padding rows of the workspace hold anything: 0xFF is E8M0 NaN)."""
    from fusedmoe.kernels.deep_gemm_moe import fused_experts_deep_gemm

    hidden = 160
    experts = random_experts(E, hidden, I, dtype=torch.bfloat16)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], "mxfp8")
    w13, w2, qc = w13.to(DEVICE), w2.to(DEVICE), quant_config_to(qc, DEVICE)
    weights, ids = _routing(9, E, K_TOP)
    x = torch.randn(9, hidden, dtype=torch.bfloat16, device=DEVICE)
    from fusedmoe.quant.activation import quantize_activation

    a1 = quantize_activation(x, qc.a1)
    shapes = DeepGemmExperts().workspace_shapes(
        9, 2 * I, hidden, K_TOP, E, E, ActivationSpec().kind
    )
    ws13 = torch.full(shapes.workspace13, -1, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    ws2 = torch.full(shapes.workspace2, -1, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    out = poison_(torch.empty(9, hidden, dtype=torch.bfloat16, device=DEVICE))
    fused_experts_deep_gemm(
        out, a1.q, a1.scale, w13, w2, qc.w1.scale, qc.w2.scale, weights, ids, scheme="mxfp8",
        activation=ActivationSpec(), workspace13=ws13, workspace2=ws2,
    )  # fmt: skip
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


def test_config_override_keeps_blocks_inside_a_run():
    from fusedmoe.kernels.deep_gemm_moe import use_deep_gemm_config
    from fusedmoe.kernels.moe_config import GemmConfig

    with (
        pytest.raises(ValueError, match="block_m"),
        use_deep_gemm_config(256, GemmConfig(128, 128, 8, 8, 3)),
    ):
        pass


def test_workspaces_and_reduce():
    experts = DeepGemmExperts()
    m_sum = compute_aligned_M_and_alignment(200, 8, 16, 128)[0]
    shapes = experts.workspace_shapes(200, 2 * I, H, 8, 16, 16, ActivationSpec().kind)
    assert shapes.workspace13 == (m_sum, max(I, H))
    assert shapes.workspace2 == (m_sum, max(2 * I, H))
    assert shapes.output == (200, H)
    assert isinstance(experts.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOp)


def test_valid_call_reasons():
    from fusedmoe.modular.types import ExpertWeights

    w13, w2, _ = _quantized("fp8_block")
    experts = DeepGemmExperts()
    weights = ExpertWeights(w13, w2)
    assert experts.valid_call_reason(128, weights, _x(128)) is None
    small = ExpertWeights(w13[:, :512], w2[:, :, :256])
    assert experts.valid_call_reason(128, small, _x(128)) == "N = 512 <= 512"
    bf16 = ExpertWeights(w13.to(torch.bfloat16), w2.to(torch.bfloat16))
    assert "weights are torch.bfloat16" in experts.valid_call_reason(128, bf16, _x(128))
    strided = ExpertWeights(w13.transpose(1, 2).contiguous().transpose(1, 2), w2)
    assert experts.valid_call_reason(128, strided, _x(128)) == "non-contiguous tensors"


@pytest.mark.parametrize(
    ("backend", "change", "reason"),
    [
        ("deep_gemm", dict(quant_config=None), "quant config"),
        ("deep_gemm", dict(activation="gelu"), "no gelu activation"),
        ("deep_gemm_fp4", dict(), "quant config"),  # fp8_block is not MXFP4
    ],
)
def test_oracle_refuses_with_reason(backend, change, reason):
    _, _, qc = _quantized("fp8_block")
    kwargs = dict(
        device=DEVICE, dtype=torch.bfloat16, hidden_size=H, intermediate_size=I,
        num_experts=E, top_k=2, quant_config=qc,
    )  # fmt: skip
    kwargs.update(change)
    with pytest.raises(ValueError, match=reason):
        select_backend(backend=backend, **kwargs)


def test_oracle_names_mx_backends_for_mx_schemes():
    if DEVICE == "cpu":  # the interpreter backends run only by name there
        pytest.skip("auto picks GPU backends on CUDA only")
    for scheme, name in (("mxfp8", "deep_gemm"), ("mxfp4_w4a8", "deep_gemm_fp4")):
        _, _, qc = _quantized(scheme)
        choice = select_backend(
            device=DEVICE, hidden_size=H, intermediate_size=I, num_experts=E, top_k=2,
            quant_config=qc,
        )  # fmt: skip
        assert choice.name == name, choice.explain()


# ---------------------------------------------------------------------------------------------
# GPU: preset sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-235b-a22b"])
def test_gpu_presets_match_torch_backend(preset):
    _, x, experts, weights, ids, qc = preset_problem(preset, 1024, "fp8_block")
    for num_tokens in (128, 1024):
        args = (x[:num_tokens], experts["w13"], experts["w2"], weights[:num_tokens])
        out = fused_experts(*args, ids[:num_tokens], quant_config=qc, backend="deep_gemm")
        ref = fused_experts(*args, ids[:num_tokens], quant_config=qc, backend="torch")
        assert_close(out, ref, torch.bfloat16, what=f"M = {num_tokens}", **QUANT_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4_w4a8"])
def test_gpu_mx_schemes(scheme):
    _, x, experts, weights, ids, qc = preset_problem("qwen3-30b-a3b", 512, scheme)
    args = (x, experts["w13"], experts["w2"], weights, ids)
    out = fused_experts(*args, quant_config=qc, backend=_backend(scheme))
    ref = fused_experts(*args, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hidden", "use_ue8m0", "activation", "num_tokens", "extra"),
    [
        (2880, False, "swigluoai", 1, None),  # gpt-oss's K: a partial last 1 x 128 group
        (256, True, "silu", 37, "expert_map"),
        (2880, False, "swigluoai", 300, None),
        (256, False, "silu", 64, "router_weight_on_input"),  # k = 1, GEMM2 unweighted
    ],
)
def test_gpu_mxfp4_w4a8_on_the_hopper_kernel(
    hidden, use_ue8m0, activation, num_tokens, extra, monkeypatch
):
    """On Hopper, deep_gemm_fp4 runs MXFP4 x FP8 through wo_hopper's MXFP4 x bf16 kernel (a1
    dequantized, a2 through FP8 1 x 128 between the GEMMs): both GEMMs ran there, a2 took the
    round trip with the config's scale format, and the output equals the torch twin, with
    biases, one token and many, an expert_map, the router weight on the input."""
    from fusedmoe.kernels import wo_hopper, wo_moe

    if wo_hopper.gluon is None or wo_hopper._device_reason(torch.cuda.current_device()):
        pytest.skip("the Gluon kernel needs Hopper and Triton 3.6")
    experts = random_experts(E, hidden, I, activation, dtype=torch.bfloat16)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], "mxfp4_w4a8", use_ue8m0=use_ue8m0)
    w13, w2, qc = w13.to(DEVICE), w2.to(DEVICE), quant_config_to(qc, DEVICE)
    b13 = (torch.randn(E, 2 * I, device=DEVICE) * 3).to(torch.bfloat16)
    b2 = torch.randn(E, hidden, device=DEVICE).to(torch.bfloat16)
    top_k = 1 if extra == "router_weight_on_input" else K_TOP
    weights, ids = _routing(num_tokens, 2 * E if extra == "expert_map" else E, top_k, empty=0.05)
    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    kwargs = dict(quant_config=qc, activation=activation, w13_bias=b13, w2_bias=b2)
    if extra == "expert_map":  # rank 1 of 2: global experts [E, 2E) are local
        expert_map = torch.full((2 * E,), -1, dtype=torch.int32, device=DEVICE)
        expert_map[E:] = torch.arange(E, dtype=torch.int32, device=DEVICE)
        kwargs["expert_map"] = expert_map
    if extra == "router_weight_on_input":
        kwargs["apply_router_weight_on_input"] = True
    launches, trips = [], []
    launch, trip = wo_hopper.launch_mx_hopper, wo_moe._fp8_round_trip
    monkeypatch.setattr(
        wo_hopper, "launch_mx_hopper", lambda *a, **k: launches.append(1) or launch(*a, **k)
    )
    monkeypatch.setattr(
        wo_moe, "_fp8_round_trip", lambda a, g, u: trips.append((g, u)) or trip(a, g, u)
    )
    out = fused_experts(x, w13, w2, weights, ids, backend="deep_gemm_fp4", **kwargs)
    assert len(launches) == 2, "wo_hopper's kernel did not run both GEMMs"
    assert trips == [(128, use_ue8m0)], trips
    ref = fused_experts(x, w13, w2, weights, ids, backend="torch", **kwargs)
    assert ref.abs().max() > 0
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)
