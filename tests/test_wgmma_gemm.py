"""The Gluon (wgmma) grouped GEMM and the deep_gemm backend's "wgmma" engine.

On the CPU: where the engine is chosen and refused (it never runs there). On a Hopper GPU
(`gpu` marker): the GEMM against a float32 reference over the contiguous layout (empty experts,
one expert taking every slot, M and N not multiples of any tile, K with a partial 128 block),
and the whole backend against the torch backend, as the library's tests do.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import fused_experts
from fusedmoe.experts.deep_gemm import DeepGemmExperts
from fusedmoe.kernels import wgmma_gemm
from fusedmoe.modular.kernel import FusedMoEModularKernel
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.modular.types import ActivationSpec, ExpertWeights
from fusedmoe.quant.formats import FP8_DTYPE
from tests.helpers import assert_close, poison_, preset_problem, quant_tol, random_routing


def test_the_engine_is_refused_off_hopper():
    why = wgmma_gemm.gluon_unusable_reason(torch.device("cpu"))
    assert why is not None and ("CUDA" in why or "Gluon" in why)
    assert "Gluon" in wgmma_gemm.wgmma_status() or "Triton" in wgmma_gemm.wgmma_status()


def test_engine_wgmma_is_a_known_engine():
    assert DeepGemmExperts(engine="wgmma").engine == "wgmma"
    with pytest.raises(ValueError, match="engine must be one of"):
        DeepGemmExperts(engine="cutlass")


def test_the_launcher_refuses_other_alignments():
    t = torch.empty(256, 128, dtype=torch.bfloat16)
    w = torch.empty(2, 128, 128, dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="runs must be of 128 rows"):
        wgmma_gemm.wgmma_grouped_gemm(t, None, w, None, t, ids, ids[:1], 64)
    with pytest.raises(ValueError, match="128 or 256 wide"):
        wgmma_gemm.wgmma_grouped_gemm(t, None, w, None, t, ids, ids[:1], 128, block_n=64)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
def _hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    why = wgmma_gemm.gluon_unusable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


def _reference(a, a_s, w, w_s, m_indices):
    """float32 out [M_sum, N] of the grouped GEMM; rows of m_indices -1 left NaN."""
    out = torch.full((a.shape[0], w.shape[1]), float("nan"), device=a.device)
    for e in m_indices.unique().tolist():
        if e < 0:
            continue
        rows = (m_indices == e).nonzero().flatten()
        x, we = a[rows].float(), w[e].float()
        if a_s is not None:
            x = x * a_s[rows].repeat_interleave(128, 1)[:, : x.shape[1]]
            blocks = w_s[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            we = we * blocks[: we.shape[0], : we.shape[1]]
        out[rows] = x @ we.T
    return out


CASES = {  # name: (M, E, k, N, K, routing)
    "uniform": (300, 6, 2, 384, 512, None),
    "odd_n_partial_k": (77, 5, 3, 320, 400, None),  # N % 256, K % 128 != 0
    "one_expert_takes_all": (260, 4, 1, 256, 256, "hot"),
    "empty_experts": (150, 9, 2, 512, 384, "empty"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [True, False], ids=["fp8_block", "bf16"])
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_gemm_matches_reference(case, block_n, scaled):
    _hopper()
    from fusedmoe.kernels.deep_gemm_moe import compute_aligned_M_and_alignment, permute_contiguous

    m, e, k, n, kk, routing = CASES[case]
    torch.manual_seed(hash(case) % 1000)
    _, ids = random_routing(m, e, k, device="cuda")
    if routing == "hot":
        ids = torch.full_like(ids, e - 1)
    elif routing == "empty":
        ids = ids % 3 * 3  # experts 0, 3 and 6 only
    groups = -(-kk // 128)
    dev = "cuda"
    if scaled:
        x = (torch.randn(m, kk, device=dev) * 2).to(FP8_DTYPE)
        x_s = torch.rand(m, groups, device=dev) * 0.1 + 0.01
        w = (torch.randn(e, n, kk, device=dev) * 2).to(FP8_DTYPE)
        w_s = torch.rand(e, -(-n // 128), groups, device=dev) * 0.1 + 0.01
    else:
        x = torch.randn(m, kk, device=dev, dtype=torch.bfloat16)
        w = torch.randn(e, n, kk, device=dev, dtype=torch.bfloat16) * 0.1
        x_s = w_s = None
    m_sum, _ = compute_aligned_M_and_alignment(m, k, e, 128)
    scale_out = torch.empty(groups, m_sum, device=dev).t() if scaled else None
    layout = permute_contiguous(x, x_s, ids, e, 128, m_sum, scale_out=scale_out)
    out = poison_(torch.empty(m_sum, n, device=dev, dtype=torch.bfloat16))
    wgmma_gemm.wgmma_grouped_gemm(
        layout.a, layout.a_scale, w, w_s, out, layout.expert_ids, layout.num_rows, 128,
        block_n=block_n,
    )  # fmt: skip
    ref = _reference(layout.a, layout.a_scale, w, w_s, layout.m_indices)
    rows = layout.m_indices >= 0
    assert rows.any()
    assert_close(out[rows], ref[rows], torch.bfloat16, what=case)


def _run(experts, x, w13, w2, weights, ids, qc, **kwargs):
    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), experts)
    return kernel.forward(
        x, ExpertWeights(w13, w2), weights, ids, activation=ActivationSpec(),
        global_num_experts=kwargs.pop("global_num_experts", w13.shape[0]), quant_config=qc,
        **kwargs,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_gpu_wgmma_engine_matches_torch_backend(preset, monkeypatch):
    _hopper()
    monkeypatch.setenv("FUSEDMOE_DEEP_GEMM", "0")  # the wgmma engine, not the library
    from fusedmoe.kernels import deep_gemm_lib

    deep_gemm_lib.find_library(refresh=True)
    try:
        _, x, experts, weights, ids, qc = preset_problem(preset, 1030, "fp8_block")
        backend = DeepGemmExperts(strict=True, engine="wgmma")
        for num_tokens in (1, 129, 1030):
            sl = slice(num_tokens)
            args = (x[sl], experts["w13"], experts["w2"], weights[sl], ids[sl])
            out = _run(backend, *args, qc)
            ref = fused_experts(*args, quant_config=qc, backend="torch")
            assert_close(out, ref, torch.bfloat16, what=f"M = {num_tokens}", **quant_tol("cuda"))
    finally:
        monkeypatch.delenv("FUSEDMOE_DEEP_GEMM")
        deep_gemm_lib.find_library(refresh=True)


@pytest.mark.gpu
def test_gpu_wgmma_runs_by_name_only(monkeypatch):
    _hopper()
    monkeypatch.setenv("FUSEDMOE_DEEP_GEMM", "0")
    from fusedmoe.kernels import deep_gemm_lib, deep_gemm_moe

    deep_gemm_lib.find_library(refresh=True)
    seen = []
    real = deep_gemm_moe.wgmma_grouped_gemm
    monkeypatch.setattr(
        deep_gemm_moe, "wgmma_grouped_gemm", lambda *a, **k: seen.append(1) or real(*a, **k)
    )
    try:
        _, x, experts, weights, ids, qc = preset_problem("qwen3-30b-a3b", 2048, "fp8_block")
        args = (x, experts["w13"], experts["w2"], weights, ids)
        ref = fused_experts(*args, quant_config=qc, backend="torch")
        out = _run(DeepGemmExperts(strict=True), *args, qc)  # auto: the Triton GEMMs
        assert seen == []
        assert_close(out, ref, torch.bfloat16, **quant_tol("cuda"))
        out = _run(DeepGemmExperts(strict=True, engine="wgmma"), *args, qc)
        assert len(seen) == 2  # both GEMMs
        assert_close(out, ref, torch.bfloat16, **quant_tol("cuda"))
    finally:
        monkeypatch.delenv("FUSEDMOE_DEEP_GEMM")
        deep_gemm_lib.find_library(refresh=True)
