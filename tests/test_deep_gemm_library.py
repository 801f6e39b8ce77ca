"""The deep_gemm backend's library engine (fusedmoe.kernels.deep_gemm_lib): finding DeepGEMM,
the masked layout, and the whole pipeline around the library's two GEMM entry points.

On the CPU there is no DeepGEMM: a stand-in module implements the library's contract in torch
(_FakeDeepGemm: rows of m_indices -1 and masked rows past masked_m left unwritten, the layouts
asserted) so that everything fusedmoe does around the GEMMs -- permutes, scale layouts,
workspace carving, the act + quant, the unpermute -- runs on the interpreter against the torch
backend. The `gpu` tests run the real library where it is importable (carried under .vendor on
the lent GPUs) and skip elsewhere.
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch

import fusedmoe

pytest.importorskip("triton")

from fusedmoe import ActivationParams, fused_experts
from fusedmoe.experts.deep_gemm import DeepGemmExperts
from fusedmoe.kernels import deep_gemm_lib
from fusedmoe.kernels.deep_gemm_moe import (
    compute_aligned_M_and_alignment,
    library_layout,
    masked_max_m,
    permute_masked,
    permute_masked_torch,
    unpermute_reduce,
    unpermute_reduce_torch,
)
from fusedmoe.modular.types import ActivationSpec
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
    run_experts,
)
from tests.reference import random_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANT_TOL = quant_tol(DEVICE)
H, I, E = 256, 128, 6  # the library's contract: N = 2I, K and I multiples of 128
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

_routing = functools.partial(random_routing, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# the masked layout against its twin
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_local", "use_map", "max_m"),
    [(1, 1, 1, False, 64), (37, 3, 8, False, 64), (37, 3, 8, True, 64), (70, 2, 3, False, 128),
     (90, 2, 2, False, 16)],  # the last: more slots than max_m on an expert
)  # fmt: skip
def test_permute_masked_matches_twin(num_tokens, top_k, num_local, use_map, max_m):
    num_global = 2 * num_local + 1 if use_map else num_local
    weights, ids = _routing(num_tokens, max(num_global, top_k), top_k, empty=0.1)
    expert_map = None
    if use_map:  # the odd global experts are local
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[1::2][:num_local] = torch.arange(num_local, dtype=torch.int32)
        expert_map = expert_map.to(DEVICE)
    x = torch.randn(num_tokens, 160, device=DEVICE)  # K = 160: a partial group
    q, scales = per_token_group_quant_fp8(x, 128)
    rows = num_local * max_m
    scale_out = torch.empty(scales.shape[1], rows, device=DEVICE).t()  # column-major
    layout = permute_masked(q, scales, ids, num_local, max_m, expert_map, scale_out=scale_out)
    a_ref, s_ref, counts, where = permute_masked_torch(q, scales, ids, num_local, max_m, expert_map)
    assert layout.a.shape == (num_local, max_m, 160)
    assert layout.a_scale.stride() == (max_m, 1, rows), "scales keep the buffer's layout"
    assert layout.masked_m.tolist() == counts
    for e, count in enumerate(counts):
        assert_equal(layout.a[e, :count].view(torch.uint8), a_ref[e].view(torch.uint8))
        assert_equal(layout.a_scale[e, :count], s_ref[e], what="scales")
    for slot, row in where.items():
        assert int(layout.inv_perm[slot]) == row

    dropped = [
        s for s, e in enumerate(_local(ids, expert_map, num_local)) if e >= 0 and s not in where
    ]
    assert all(int(layout.inv_perm[s]) == -1 for s in dropped), "no row: -1"
    y = torch.randn(rows, 96, device=DEVICE).to(torch.bfloat16)
    out = poison_(torch.empty(num_tokens, 96, dtype=torch.bfloat16, device=DEVICE))
    unpermute_reduce(y, out, weights, ids, layout.inv_perm, num_local, expert_map)
    assert_close(out, unpermute_reduce_torch(y, weights, ids, where), torch.bfloat16)


def _local(ids, expert_map, num_local):
    """The local expert of each slot, -1 where it is not routed here."""
    flat = ids.reshape(-1).tolist()
    if expert_map is not None:
        emap = expert_map.tolist()
        flat = [emap[i] if 0 <= i < len(emap) else -1 for i in flat]
    return [i if 0 <= i < num_local else -1 for i in flat]


def test_masked_layout_sizes():
    assert masked_max_m(1) == 64 and masked_max_m(64) == 64 and masked_max_m(65) == 128
    # deepseek-v3 (E = 256, k = 8): masked while E * max_m <= the contiguous bound
    assert library_layout(64, 8, 256, 128) == ("masked", 256 * 64)
    assert library_layout(128, 8, 256, 128)[0] == "masked"
    assert library_layout(256, 8, 256, 128)[0] == "contiguous"
    assert library_layout(1, 8, 8, 128)[0] == "masked"  # 8 * 64 rows < 8 * 128
    assert library_layout(4096, 2, 8, 128)[0] == "contiguous"
    # the workspaces are sized for the contiguous layout: the masked one never has more rows
    for m in (1, 3, 64, 100, 128, 200, 1000):
        for top_k, experts in ((1, 4), (2, 8), (8, 128), (8, 256), (6, 64)):
            m_sum = compute_aligned_M_and_alignment(m, top_k, experts, 128)[0]
            assert library_layout(m, top_k, experts, 128)[1] <= m_sum


# ---------------------------------------------------------------------------------------------
# finding the library
# ---------------------------------------------------------------------------------------------
class _FakeDeepGemm(types.ModuleType):
    """DeepGEMM's two grouped FP8 GEMMs, in torch, with the contract's layouts asserted."""

    def __init__(self, name="deep_gemm"):
        super().__init__(name)
        self.__version__ = "9.9.9-test"
        self.calls: list[str] = []

    @staticmethod
    def _deq_a(a, s):  # [.., R, K] FP8, [.., R, K / 128]
        assert s.dtype == torch.float32 and s.shape[-1] == a.shape[-1] // 128
        assert s.stride(-2) == 1, "activation scales MN-major (strides (1, rows))"
        return (a.float().unflatten(-1, (-1, 128)) * s.unsqueeze(-1)).flatten(-2)

    @staticmethod
    def _deq_w(w, s):  # [E, N, K], [E, N / 128, K / 128]
        assert s.dtype == torch.float32 and s.shape[1:] == (w.shape[1] // 128, w.shape[2] // 128)
        blocks = w.float().unflatten(1, (-1, 128)).unflatten(-1, (-1, 128))
        return (blocks * s[:, :, None, :, None]).flatten(3, 4).flatten(1, 2)

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, m_indices):
        self.calls.append("contiguous")
        (a, sa), (w, sw) = a, b
        assert a.dtype == w.dtype == torch.float8_e4m3fn and d.dtype == torch.bfloat16
        assert m_indices.dtype == torch.int32 and m_indices.shape[0] == a.shape[0] == d.shape[0]
        assert a.shape[0] % 128 == 0, "M_sum aligned to the library's 128"
        for block in m_indices.view(-1, 128).tolist():  # the kernel reads a block's first id
            used = [i for i in block if i >= 0]
            assert used == block[: len(used)] and len(set(used)) <= 1, "one expert per block"
        deq_a, deq_w = self._deq_a(a, sa), self._deq_w(w, sw)
        rows = (m_indices >= 0).nonzero().flatten()
        experts = m_indices[rows].long()
        out = torch.einsum("rk,rnk->rn", deq_a[rows], deq_w[experts])
        d[rows] = out.to(d.dtype)

    def m_grouped_fp8_gemm_nt_masked(self, a, b, d, masked_m, expected_m):
        self.calls.append("masked")
        (a, sa), (w, sw) = a, b
        assert a.dim() == 3 and a.shape[1] % deep_gemm_lib.MASKED_ROWS == 0
        assert masked_m.dtype == torch.int32 and 1 <= expected_m <= a.shape[1]
        assert d.dtype == torch.bfloat16 and d.shape[:2] == a.shape[:2]
        deq_a, deq_w = self._deq_a(a, sa), self._deq_w(w, sw)
        for e, count in enumerate(masked_m.tolist()):
            if count:
                d[e, :count] = (deq_a[e, :count] @ deq_w[e].T).to(d.dtype)


@pytest.fixture
def fresh_search(monkeypatch):
    """Every module name "installed", the search not yet made; the state restored after."""
    monkeypatch.setattr(deep_gemm_lib.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(deep_gemm_lib, "_found", deep_gemm_lib._UNSEARCHED)
    monkeypatch.setattr(deep_gemm_lib, "_why_not", "")
    return monkeypatch


@pytest.fixture
def fake_library(fresh_search):
    """The stand-in as `deep_gemm`, usable on any device."""
    fake = _FakeDeepGemm()
    fresh_search.setitem(sys.modules, "deep_gemm", fake)
    fresh_search.setattr(deep_gemm_lib, "library_unusable_reason", _usable_anywhere)
    return fake


def _usable_anywhere(device):
    return None if deep_gemm_lib.find_library() is not None else "no library"


def test_finds_and_describes_the_library(fake_library):
    lib = deep_gemm_lib.find_library()
    assert lib is not None and lib.module is fake_library
    assert lib.describe() == "DeepGEMM 9.9.9-test (import deep_gemm)"
    assert "DeepGEMM 9.9.9-test" in DeepGemmExperts.engine_description()


def test_env_turns_the_library_off(fake_library, monkeypatch):
    monkeypatch.setenv("FUSEDMOE_DEEP_GEMM", "0")
    assert deep_gemm_lib.find_library(refresh=True) is None
    assert "turned off by FUSEDMOE_DEEP_GEMM=0" in deep_gemm_lib.library_status()


def test_a_module_without_the_entry_points_is_refused(fresh_search):
    fresh_search.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    fresh_search.setenv("FUSEDMOE_DEEP_GEMM", "deep_gemm")
    assert deep_gemm_lib.find_library() is None
    assert "has no m_grouped_fp8_gemm_nt_contiguous" in deep_gemm_lib.library_status()


def test_a_broken_install_is_reported_not_raised(fresh_search):
    def broken(name):
        raise OSError("libcuda.so.1: cannot open shared object file")

    fresh_search.setattr(deep_gemm_lib.importlib, "import_module", broken)
    assert deep_gemm_lib.find_library() is None
    assert "import failed (OSError: libcuda.so.1" in deep_gemm_lib.library_status()


def test_the_oracle_names_the_engine(fake_library):
    from fusedmoe import select_backend

    _, _, qc = _quantized()
    choice = select_backend(
        backend="deep_gemm", device=DEVICE, hidden_size=H, intermediate_size=I, num_experts=E,
        top_k=2, quant_config=qc,
    )  # fmt: skip
    assert "GEMM engine: DeepGEMM 9.9.9-test" in choice.explain()


# ---------------------------------------------------------------------------------------------
# the pipeline around the library, against the torch backend
# ---------------------------------------------------------------------------------------------
@functools.cache
def _quantized_cpu(num_experts, ue8m0=False, activation="silu"):
    experts = random_experts(num_experts, H, I, activation, dtype=torch.bfloat16)
    kwargs = dict(use_ue8m0=True, column_major_scales=True) if ue8m0 else {}
    return quantize_experts(experts["w13"], experts["w2"], "fp8_block", **kwargs)


def _quantized(num_experts=E, ue8m0=False, activation="silu"):
    w13, w2, qc = _quantized_cpu(num_experts, ue8m0, activation)
    return w13.to(DEVICE), w2.to(DEVICE), quant_config_to(qc, DEVICE)


@pytest.mark.parametrize(
    ("num_tokens", "layout"), [(1, "contiguous"), (5, "masked"), (130, "contiguous")]
)
def test_library_engine_matches_torch_backend(fake_library, num_tokens, layout):
    w13, w2, qc = _quantized()
    weights, ids = _routing(num_tokens, E, 2, empty=0.05)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device=DEVICE)
    out = run_experts(DeepGemmExperts(engine="library"), x, w13, w2, weights, ids, qc)
    assert fake_library.calls == [layout, layout]
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


def test_fast_accum_leaves_the_library_promoting(fake_library, monkeypatch):
    """fast_accum is a permission: where the library runs a call, auto keeps it (it promotes
    each 128 block) even when the wgmma engine, which would take the permission, could run."""
    import dataclasses

    from fusedmoe.experts.deep_gemm import FAST_ACCUM_MIN_SLOTS_PER_EXPERT
    from fusedmoe.kernels import deep_gemm_moe, wgmma_gemm

    monkeypatch.setattr(wgmma_gemm, "gluon_unusable_reason", lambda device: None)

    def no_wgmma(*args, **kwargs):
        raise AssertionError("the wgmma engine ran")

    monkeypatch.setattr(deep_gemm_moe, "wgmma_grouped_gemm", no_wgmma)
    w13, w2, qc = _quantized()
    fast = dataclasses.replace(qc, fast_accum=True)
    tokens = FAST_ACCUM_MIN_SLOTS_PER_EXPERT * E // 2
    weights, ids = _routing(tokens, E, 2)
    x = torch.randn(tokens, H, dtype=torch.bfloat16, device=DEVICE)
    out = run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, fast)
    assert fake_library.calls == ["contiguous", "contiguous"]
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


@pytest.mark.parametrize("num_tokens", [5, 130])  # masked, contiguous
def test_library_engine_ue8m0_scales_and_swigluoai(fake_library, num_tokens):
    """UE8M0 (power-of-two) group scales, prepare's column-major scales, and the activation
    with parameters through the library engine."""
    params = ActivationParams(alpha=1.5, beta=0.5, limit=6.0)
    w13, w2, qc = _quantized(ue8m0=True, activation="swigluoai_uninterleave")
    weights, ids = _routing(num_tokens, E, 2)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device=DEVICE)
    spec = ActivationSpec.make("swigluoai_uninterleave", params)
    out = run_experts(
        DeepGemmExperts(engine="library"), x, w13, w2, weights, ids, qc, activation=spec
    )
    assert len(fake_library.calls) == 2
    ref = fused_experts(
        x, w13, w2, weights, ids, quant_config=qc, backend="torch",
        activation="swigluoai_uninterleave", activation_params=params,
    )  # fmt: skip
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


@pytest.mark.parametrize(("num_tokens", "layout"), [(5, "masked"), (130, "contiguous")])
def test_library_engine_biases_and_interleaved_swiglu(fake_library, num_tokens, layout):
    """gpt-oss's expert biases on both layouts: the masked one gives each row of its batch
    the expert of its slab (row // max_m), the contiguous one the expert of its run."""
    w13, w2, qc = _quantized(activation="swigluoai")
    b13 = (torch.randn(E, w13.shape[1], device=DEVICE) * 3).to(torch.bfloat16)
    b2 = torch.randn(E, H, device=DEVICE).to(torch.bfloat16)
    weights, ids = _routing(num_tokens, E, 2)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device=DEVICE)
    out = run_experts(
        DeepGemmExperts(engine="library"), x, w13, w2, weights, ids, qc,
        activation=ActivationSpec.make("swigluoai"), w13_bias=b13, w2_bias=b2,
    )  # fmt: skip
    assert fake_library.calls == [layout, layout]
    ref = fused_experts(
        x, w13, w2, weights, ids, quant_config=qc, backend="torch", activation="swigluoai",
        w13_bias=b13, w2_bias=b2,
    )  # fmt: skip
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


@pytest.mark.parametrize("case", ["all_to_one_expert", "expert_map", "empty_experts"])
def test_library_engine_odd_loads(fake_library, case):
    w13, w2, qc = _quantized()
    kwargs = {}
    if case == "all_to_one_expert":  # 150 slots on one expert: contiguous, one 256-row run
        weights, ids = _routing(150, E, 1, hot=4)
    elif case == "empty_experts":  # only experts 0 and 5 get tokens, masked
        weights, ids = _routing(9, 2, 2)
        ids = ids * 5
    else:  # rank 1 of 2 under EP: global experts [E, 2E) are local
        weights, ids = _routing(40, 2 * E, 3)
        expert_map = torch.full((2 * E,), -1, dtype=torch.int32, device=DEVICE)
        expert_map[E:] = torch.arange(E, dtype=torch.int32, device=DEVICE)
        kwargs = dict(expert_map=expert_map, global_num_experts=2 * E)
    x = torch.randn(ids.shape[0], H, dtype=torch.bfloat16, device=DEVICE)
    out = run_experts(DeepGemmExperts(engine="library"), x, w13, w2, weights, ids, qc, **kwargs)
    assert len(fake_library.calls) == 2
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch", **kwargs)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


def test_fp16_layers_stay_on_triton_gemms(fake_library):
    """The library writes bf16 only: an fp16 layer runs our GEMMs (auto) or is refused."""
    w13, w2, qc = _quantized()
    weights, ids = _routing(390, E, 2)  # 130 slots per expert: bf16 would take the library
    x = torch.randn(390, H, dtype=torch.float16, device=DEVICE)
    out = run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert fake_library.calls == []
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.float16, **QUANT_TOL)
    with pytest.raises(ValueError, match=r"write bf16, the layer runs in torch\.float16"):
        run_experts(DeepGemmExperts(engine="library"), x, w13, w2, weights, ids, qc)


def test_the_oracle_puts_deep_gemm_first_where_the_library_runs(fake_library, monkeypatch):
    from fusedmoe import select_backend
    from fusedmoe.experts.triton import TritonExperts

    for cls in (DeepGemmExperts, TritonExperts):  # as on a GPU (the CPU runs them by name)
        monkeypatch.setattr(cls, "preferred_on", classmethod(lambda cls, device: True))
    _, _, qc = _quantized()
    problem = dict(
        device=DEVICE, hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, quant_config=qc
    )
    choice = select_backend(**problem)
    assert choice.name == "deep_gemm", choice.explain()
    assert "ahead of triton where the DeepGEMM library" in choice.reason
    assert "supported, but deep_gemm is preferred" in choice.refused["triton"]
    assert select_backend(**problem, dtype=torch.float16).name == "triton"  # bf16 only
    assert select_backend(**{**problem, "intermediate_size": 192}).name == "triton"
    monkeypatch.setattr(deep_gemm_lib, "library_unusable_reason", lambda device: "none here")
    assert select_backend(**problem).name == "triton"


def test_masked_layout_refuses_repeated_ids(fake_library):
    w13, w2, qc = _quantized()
    weights, ids = _routing(5, E, 2)
    ids[3, 1] = ids[3, 0]
    x = torch.randn(5, H, dtype=torch.bfloat16, device=DEVICE)
    with fusedmoe.debug_checks(), pytest.raises(ValueError, match="repeats an expert in row 3"):
        run_experts(DeepGemmExperts(engine="library"), x, w13, w2, weights, ids, qc)
    assert fake_library.calls == []


def test_engines_choose_and_refuse(fake_library):
    w13, w2, qc = _quantized()
    weights, ids = _routing(3, E, 2)
    x = torch.randn(3, H, dtype=torch.bfloat16, device=DEVICE)
    run_experts(
        DeepGemmExperts(engine="triton"), x, w13, w2, weights, ids, qc
    )  # falls back to triton
    assert fake_library.calls == []
    run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)  # auto, chosen by the oracle:
    assert fake_library.calls == []  # 1 slot per expert runs on triton
    run_experts(DeepGemmExperts(strict=True), x, w13, w2, weights, ids, qc)  # by name: the library
    assert fake_library.calls == ["masked", "masked"]
    big_w, big_ids = _routing(384, E, 2)  # 128 slots per expert: the library
    big_x = torch.randn(384, H, dtype=torch.bfloat16, device=DEVICE)
    run_experts(DeepGemmExperts(), big_x, w13, w2, big_w, big_ids, qc)
    assert fake_library.calls[2:] == ["contiguous", "contiguous"]
    experts = random_experts(E, H, 64, "silu", dtype=torch.bfloat16)  # I = 64: N = 128
    w13s, w2s, qcs = quantize_experts(experts["w13"], experts["w2"], "fp8_block")
    with pytest.raises(ValueError, match="intermediate size 64 must be"):
        run_experts(
            DeepGemmExperts(engine="library"), x, w13s.to(DEVICE), w2s.to(DEVICE), weights, ids,
            quant_config_to(qcs, DEVICE),
        )  # fmt: skip
    with pytest.raises(ValueError, match="engine must be one of"):
        DeepGemmExperts(engine="cutlass")


# ---------------------------------------------------------------------------------------------
# GPU: the real library, where it is importable
# ---------------------------------------------------------------------------------------------
def _real_library():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    why = deep_gemm_lib.library_unusable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-30b-a3b"])
def test_gpu_real_library_matches_torch_backend(preset):
    _real_library()
    _, x, experts, weights, ids, qc = preset_problem(preset, 4099, "fp8_block")
    backend = DeepGemmExperts(strict=True, engine="library")
    for num_tokens in (1, 7, 64, 130, 1024, 4099):  # deepseek-v3: 64 and 130 masked
        sl = slice(num_tokens)
        args = (x[sl], experts["w13"], experts["w2"], weights[sl], ids[sl])
        out = run_experts(backend, *args, qc)
        ref = fused_experts(*args, quant_config=qc, backend="torch")
        assert_close(out, ref, torch.bfloat16, what=f"M = {num_tokens}", **QUANT_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["all_to_one_expert", "expert_map", "empty_experts"])
def test_gpu_real_library_odd_loads(case):
    _real_library()
    _, x, experts, weights, ids, qc = preset_problem("qwen3-30b-a3b", 600, "fp8_block")
    num_experts = experts["w13"].shape[0]
    kwargs = {}
    if case == "all_to_one_expert":
        weights, ids = _routing(600, num_experts, 1, hot=17)
    elif case == "empty_experts":  # 3 of 128 experts get tokens (masked at M = 40)
        weights, ids = _routing(40, 3, 2)
        ids = ids * 50
        x = x[:40]
    else:  # rank 1 of 2: the upper half of the experts is local
        half = num_experts // 2
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=DEVICE)
        expert_map[half:] = torch.arange(half, dtype=torch.int32, device=DEVICE)
        kwargs = dict(expert_map=expert_map, global_num_experts=num_experts)
        experts = {k: v[half:] for k, v in experts.items() if v is not None}
        qc = _shard(qc, half)
    args = (x, experts["w13"], experts["w2"], weights, ids)
    out = run_experts(DeepGemmExperts(strict=True, engine="library"), *args, qc, **kwargs)
    ref = fused_experts(*args, quant_config=qc, backend="torch", **kwargs)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


def _shard(qc, start):
    """The quant config of experts [start, E)."""
    from dataclasses import replace

    w1 = replace(qc.w1, scale=qc.w1.scale[start:])
    return replace(qc, w1=w1, w2=replace(qc.w2, scale=qc.w2.scale[start:]))


@pytest.mark.gpu
def test_gpu_auto_layer_runs_the_library_from_cuda_graphs():
    """backend="auto" with the library: the oracle puts deep_gemm first; decode sizes go to
    triton, prefill sizes to the library, graphed calls equal eager ones, and no host sync."""
    _real_library()
    from fusedmoe import FusedMoE

    layer = FusedMoE(16, 4, 512, 256, params_dtype=torch.bfloat16, device="cuda")
    layer.quantize_("fp8_block")
    calls = []
    real = deep_gemm_lib.DeepGemmLibrary.contiguous

    def spy(self, *args):
        calls.append(args[4].shape[0])
        return real(self, *args)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(deep_gemm_lib.DeepGemmLibrary, "contiguous", spy)
        for num_tokens in (1, 37, 600, 5000):  # 600 * 4 / 16 = 150 slots per expert: library
            x = torch.randn(num_tokens, 512, dtype=torch.bfloat16, device="cuda")
            logits = torch.randn(num_tokens, 16, device="cuda")
            out = layer(x, logits)
            assert layer.backend_choice().name == "deep_gemm", layer.backend_choice().explain()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                again = layer(x, logits)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert torch.equal(again, out)
            layer.cuda_graph_max_tokens = 0
            eager = layer(x, logits)
            layer.cuda_graph_max_tokens = 4096
            assert_close(out.float(), eager.float(), torch.bfloat16, **QUANT_TOL)
        assert layer._graph_state is not None and layer._graph_state[1].replays > 0
    assert calls, "the library ran the prefill sizes"


# ---------------------------------------------------------------------------------------------
# the engine measured faster: where the library and the wgmma engine both run a call, "auto"
# takes the one `fusedmoe tune` recorded for the nearest token count
# ---------------------------------------------------------------------------------------------
def _engine_table(root, device_name, entries: dict[int, str], num_experts=E) -> None:
    import json

    from fusedmoe.kernels.moe_config import engine_table_path

    path = engine_table_path(root, device_name, num_experts, 2 * I, H, "fp8_block")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(m): {"engine": e} for m, e in entries.items()}))


@pytest.fixture
def both_engines(fake_library, monkeypatch, tmp_path):
    """The stand-in library and the wgmma engine's torch stand-in, both usable, on a pretend
    GPU ("Pretend GPU") whose tables live under tmp_path. -> the wgmma stand-in's calls."""
    from fusedmoe.kernels import deep_gemm_moe, fused_moe, wgmma_gemm
    from tests.test_wgmma_gemm import _stand_in

    monkeypatch.setattr(wgmma_gemm, "gluon_unusable_reason", lambda device: None)
    calls = []
    monkeypatch.setattr(deep_gemm_moe, "wgmma_grouped_gemm", _stand_in(calls))
    monkeypatch.setattr(fused_moe, "device_name", lambda t: "Pretend GPU")
    monkeypatch.setenv("FUSEDMOE_TUNED_CONFIGS", str(tmp_path))
    return calls


@pytest.mark.parametrize(
    ("num_tokens", "table", "engine"),
    [
        (64, {64: "wgmma", 1024: "library"}, "wgmma"),
        (700, {64: "wgmma", 1024: "library"}, "library"),  # nearer 1024
        (500, {64: "wgmma", 1024: "library"}, "wgmma"),
        (64, {}, "library"),  # no table: the library
        (64, {64: "library"}, "library"),
    ],
)
def test_auto_takes_the_engine_measured_faster(
    fake_library, both_engines, tmp_path, num_tokens, table, engine
):
    if table:
        _engine_table(tmp_path, "Pretend GPU", table)
    w13, w2, qc = _quantized()
    weights, ids = _routing(num_tokens, E, 2)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16, device=DEVICE)
    out = run_experts(DeepGemmExperts(strict=True), x, w13, w2, weights, ids, qc)
    ran = {"wgmma": bool(both_engines), "library": bool(fake_library.calls)}
    assert ran == {name: name == engine for name in ran}, ran
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


def test_a_measured_engine_that_cannot_run_the_call_leaves_it_to_the_library(
    fake_library, both_engines, tmp_path, monkeypatch
):
    _engine_table(tmp_path, "Pretend GPU", {64: "wgmma"})
    monkeypatch.setattr(DeepGemmExperts, "wgmma_reason", lambda self, *args: "not here")
    w13, w2, qc = _quantized()
    weights, ids = _routing(64, E, 2)
    x = torch.randn(64, H, dtype=torch.bfloat16, device=DEVICE)
    run_experts(DeepGemmExperts(strict=True), x, w13, w2, weights, ids, qc)
    assert not both_engines and fake_library.calls


def test_explain_says_which_engine_takes_which_token_counts(both_engines, tmp_path):
    from fusedmoe import select_backend

    _, _, qc = _quantized()
    ask = functools.partial(
        select_backend, backend="deep_gemm", device=DEVICE, hidden_size=H, intermediate_size=I,
        num_experts=E, top_k=2, quant_config=qc,
    )  # fmt: skip
    assert "no engine table for E_l, N, K = (6, 256, 256) on Pretend GPU" in ask().explain()
    _engine_table(tmp_path, "Pretend GPU", {64: "wgmma", 256: "wgmma", 4096: "library"})
    explained = ask().explain()
    assert "library at M = 4096" in explained and "wgmma at M = 64, 256" in explained, explained


def test_engine_tables_refuse_what_they_cannot_mean(tmp_path):
    from fusedmoe.kernels import moe_config
    from fusedmoe.kernels.moe_config import engine_table_path, measured_engine

    path = engine_table_path(tmp_path, "Pretend GPU", 5, 256, 256, "fp8_block")
    path.parent.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSEDMOE_TUNED_CONFIGS", str(tmp_path))
        for bad in ('{"64": {"engine": "cutlass"}}', '{"many": {"engine": "wgmma"}}', "[1]", "{"):
            path.write_text(bad)
            moe_config._measured_engine.cache_clear()  # resolved once per signature
            with pytest.raises(ValueError, match="engine table"):
                measured_engine(64, 5, 256, 256, "fp8_block", "Pretend GPU")
        assert measured_engine(64, 5, 256, 256, "fp8_block", None) is None  # the interpreter


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["wgmma", "library"])
def test_gpu_auto_takes_the_measured_engine_bit_for_bit(engine, tmp_path, monkeypatch):
    """With the real library and an engine table naming `engine` for the shape, "auto" gives
    that engine's output bit for bit."""
    _real_library()
    from fusedmoe.kernels import wgmma_gemm
    from fusedmoe.kernels.fused_moe import device_name

    if wgmma_gemm.gluon_unusable_reason(torch.device("cuda")) is not None:
        pytest.skip("the wgmma engine does not run here")
    _, x, experts, weights, ids, qc = preset_problem("qwen3-30b-a3b", 4096, "fp8_block")
    w13, w2 = experts["w13"], experts["w2"]
    monkeypatch.setenv("FUSEDMOE_TUNED_CONFIGS", str(tmp_path))
    from fusedmoe.kernels.moe_config import engine_table_path

    path = engine_table_path(tmp_path, device_name(x), w13.shape[0], w13.shape[1], w13.shape[2],
                             "fp8_block")  # fmt: skip
    path.parent.mkdir(parents=True)
    path.write_text(f'{{"4096": {{"engine": "{engine}"}}}}')
    args = (x, w13, w2, weights, ids, qc)
    want = run_experts(DeepGemmExperts(strict=True, engine=engine), *args)
    got = run_experts(DeepGemmExperts(strict=True), *args)
    assert torch.equal(got, want)
