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
from fusedmoe.quant.formats import FP8_DTYPE
from tests.helpers import (
    assert_close,
    poison_,
    preset_problem,
    quant_tol,
    random_routing,
    run_experts,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter on padding


def test_the_engine_is_refused_off_hopper():
    why = wgmma_gemm.gluon_unusable_reason(torch.device("cpu"))
    assert why is not None and ("CUDA" in why or "Gluon" in why)
    assert "Gluon" in wgmma_gemm.wgmma_status() or "Triton" in wgmma_gemm.wgmma_status()


def test_untested_triton_versions_are_refused(monkeypatch):
    if wgmma_gemm.gluon is None:
        pytest.skip("no Gluon here")
    monkeypatch.setattr(wgmma_gemm.triton, "__version__", "9.9.0")
    why = wgmma_gemm.gluon_unusable_reason(torch.device("cuda"))
    assert why is not None and "tested with Triton 3.6" in why and "9.9.0" in why


def test_engine_wgmma_is_a_known_engine():
    assert DeepGemmExperts(engine="wgmma").engine == "wgmma"
    with pytest.raises(ValueError, match="engine must be one of"):
        DeepGemmExperts(engine="cutlass")


def test_the_launcher_refuses_other_alignments():
    t = torch.empty(256, 128, dtype=torch.bfloat16)
    w = torch.empty(2, 128, 128, dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="runs must be of 128 rows"):  # bf16: no runs of 64
        wgmma_gemm.wgmma_grouped_gemm(t, None, w, None, t, ids, ids[:1], 64)
    with pytest.raises(ValueError, match="the tiles are 128 or 256 wide"):
        wgmma_gemm.wgmma_grouped_gemm(t, None, w, None, t, ids, ids[:1], 128, block_n=64)
    with pytest.raises(ValueError, match="stages must be at least 2, got 1"):
        wgmma_gemm.wgmma_grouped_gemm(t, None, w, None, t, ids, ids[:1], 128, stages=1)
    a = torch.empty(256, 128, dtype=FP8_DTYPE)
    fp8 = (a, torch.ones(256, 1), a.view(2, 128, 128), torch.ones(2, 1, 1), t, ids, ids[:1])
    with pytest.raises(ValueError, match="runs of 64 rows take 256-wide tiles"):
        wgmma_gemm.wgmma_grouped_gemm(*fp8, 64, block_n=128)
    with pytest.raises(ValueError, match="runs must be of 128 rows"):
        wgmma_gemm.wgmma_grouped_gemm(*fp8, 32)


def test_fast_accum_refuses_runs_of_64_rows():
    """The fast-accumulation tiles are 128 rows: a call on runs of 64 is refused before any
    kernel runs (the backend never pairs them: fast_accum from 256 slots per expert, runs of
    64 below 64)."""
    from fusedmoe.experts.deep_gemm import (
        FAST_ACCUM_MIN_SLOTS_PER_EXPERT,
        WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT,
    )
    from fusedmoe.kernels.deep_gemm_moe import fused_experts_deep_gemm
    from fusedmoe.modular.types import ActivationSpec

    assert FAST_ACCUM_MIN_SLOTS_PER_EXPERT >= WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT
    x, w13, w2, weights, ids, qc = _problem(8)
    a1q = x.to(FP8_DTYPE)
    a1s = torch.ones(8, H // 128)
    ws = torch.empty(1 << 16)
    with pytest.raises(ValueError, match="fast_accum needs runs of 128 rows, got runs of 64"):
        fused_experts_deep_gemm(
            torch.empty(8, H, dtype=torch.bfloat16), a1q, a1s, w13, w2, qc.w1.scale, qc.w2.scale,
            weights, ids, scheme="fp8_block", activation=ActivationSpec(), workspace13=ws,
            workspace2=ws, alignment=64, engine="wgmma", fast_accum=True,
        )  # fmt: skip


def test_the_launcher_takes_fp8_runs_of_64_rows(monkeypatch):
    """FP8 on runs of 64 rows passes the checks: 64-row A blocks, 256-wide w blocks, each
    warpgroup's [64, 128] of the output (the descriptors stand in; the third one stops it)."""
    blocks = []

    def descriptor(t, block, swizzle=None):
        blocks.append(block)
        if len(blocks) == 3:
            raise RuntimeError("past the checks")
        return object()

    monkeypatch.setattr(wgmma_gemm, "_descriptor", descriptor)
    a = torch.empty(256, 128, dtype=FP8_DTYPE)
    ids = torch.zeros(4, dtype=torch.int32)
    out = torch.empty(256, 256, dtype=torch.bfloat16)
    w = torch.empty(2, 256, 128, dtype=FP8_DTYPE)
    with pytest.raises(RuntimeError, match="past the checks"):
        wgmma_gemm.wgmma_grouped_gemm(a, torch.ones(256, 1), w, None, out, ids, ids[:1], 64)
    assert blocks == [[64, 128], [256, 128], [64, 128]]


# ---------------------------------------------------------------------------------------------
# CPU: the engine's plumbing (permute, column-major scales, act + quant, unpermute) with a torch
# stand-in for the Gluon GEMM, and where auto and the oracle take it
# ---------------------------------------------------------------------------------------------
H, I, E = 256, 128, 4


def _stand_in(calls):
    """The GEMM's contract in torch: rows of each run block (`alignment` rows) times its
    expert's dequantized weights; blocks past num_rows or of expert -1 untouched."""

    def gemm(a, a_scale, w, w_scale, out, expert_ids, num_rows, alignment, *, block_n=None):
        calls.append((tuple(a.shape), block_n, alignment))
        assert a_scale.stride(0) == 1  # column-major: the layout the kernel reads coalesced
        for b in range(int(num_rows) // alignment):
            e = int(expert_ids[b])
            if e < 0:
                continue
            r = slice(b * alignment, (b + 1) * alignment)
            x = a[r].float() * a_scale[r].repeat_interleave(128, 1)[:, : a.shape[1]]
            blocks = w_scale[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            we = w[e].float() * blocks[: w.shape[1], : w.shape[2]]
            out[r] = (x @ we.T).to(out.dtype)

    return gemm


@pytest.fixture
def no_library(monkeypatch):
    """The DeepGEMM library hidden (FUSEDMOE_DEEP_GEMM=0): the wgmma engine runs fp8_block;
    the search is redone on both sides so that no other test sees this one's."""
    from fusedmoe.kernels import deep_gemm_lib

    monkeypatch.setenv("FUSEDMOE_DEEP_GEMM", "0")
    deep_gemm_lib.find_library(refresh=True)
    yield
    monkeypatch.delenv("FUSEDMOE_DEEP_GEMM")
    deep_gemm_lib.find_library(refresh=True)


@pytest.fixture
def pretend_hopper(monkeypatch, no_library):
    """No library, Gluon usable, the kernel replaced by its torch stand-in: the calls seen."""
    from fusedmoe.experts.triton import TritonExperts
    from fusedmoe.kernels import deep_gemm_moe

    monkeypatch.setattr(wgmma_gemm, "gluon_unusable_reason", lambda device: None)
    calls = []
    monkeypatch.setattr(deep_gemm_moe, "wgmma_grouped_gemm", _stand_in(calls))
    for cls in (DeepGemmExperts, TritonExperts):  # as on a GPU (the CPU runs them by name)
        monkeypatch.setattr(cls, "preferred_on", classmethod(lambda cls, device: True))
    return calls


def _problem(num_tokens):
    from fusedmoe.quant import quantize_experts
    from tests.reference import random_experts

    experts = random_experts(E, H, I, "silu", dtype=torch.bfloat16)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], "fp8_block")
    weights, ids = random_routing(num_tokens, E, 2)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16)
    return x, w13, w2, weights, ids, qc


@pytest.mark.parametrize("num_tokens", [1, 77, 127, 128, 512])  # 128: 64 slots per expert
def test_wgmma_engine_plumbing_matches_torch_backend(pretend_hopper, num_tokens):
    x, w13, w2, weights, ids, qc = _problem(num_tokens)
    out = run_experts(DeepGemmExperts(strict=True), x, w13, w2, weights, ids, qc)  # by name: any M
    from fusedmoe.experts.deep_gemm import WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT

    runs = 64 if num_tokens * 2 / E < WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT else 128
    assert [align for _, _, align in pretend_hopper] == [runs, runs]
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **quant_tol("cpu"))


@pytest.mark.parametrize("num_tokens", [255, 256])  # 63.75 and 64 slots per expert
def test_wgmma_engine_runs_of_64_with_an_expert_map(pretend_hopper, num_tokens):
    """With an expert map (this rank: E of 2E experts) and no dispatch counts, the choice of
    64-row runs reads the mean slots per expert over all 2E experts, as on one rank: runs of 64
    below 64 (over the E local experts the mean would be 127.5: runs of 128), 128 from it; the
    result is the torch backend's on this rank's experts."""
    from fusedmoe.quant import quantize_experts
    from tests.reference import random_experts

    experts = random_experts(E, H, I, "silu", dtype=torch.bfloat16)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], "fp8_block")
    weights, ids = random_routing(num_tokens, 2 * E, 2, empty=0.05)
    x = torch.randn(num_tokens, H, dtype=torch.bfloat16)
    expert_map = torch.cat([torch.full((E,), -1), torch.arange(E)]).int()
    kwargs = dict(expert_map=expert_map, global_num_experts=2 * E)
    out = run_experts(DeepGemmExperts(strict=True), x, w13, w2, weights, ids, qc, **kwargs)
    runs = 64 if num_tokens == 255 else 128
    assert [align for _, _, align in pretend_hopper] == [runs, runs]
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch", **kwargs)
    assert_close(out, ref, torch.bfloat16, **quant_tol("cpu"))


@pytest.mark.parametrize("activation", ["swigluoai", "swigluoai_uninterleave"])
def test_wgmma_engine_plumbing_with_biases(pretend_hopper, activation):
    """gpt-oss on the engine: gate / up interleaved or not, a bias on each GEMM (added by the
    act + quant pass and by the unpermute-reduce), under EP (rank 1 of 2) too."""
    from fusedmoe.modular.types import ActivationSpec
    from fusedmoe.quant import quantize_experts
    from tests.reference import random_experts

    experts = random_experts(E, H, I, activation, dtype=torch.bfloat16, bias=True)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], "fp8_block")
    b13, b2 = experts["w13_bias"], experts["w2_bias"]
    spec = ActivationSpec.make(activation)
    weights, ids = random_routing(300, 2 * E, 2)
    x = torch.randn(300, H, dtype=torch.bfloat16)
    for expert_map in (None, torch.cat([torch.full((E,), -1), torch.arange(E)]).int()):
        kwargs = dict(w13_bias=b13, w2_bias=b2, activation=spec)
        if expert_map is None:
            kwargs["global_num_experts"] = E
            w, i = weights, ids % E
        else:
            kwargs.update(expert_map=expert_map, global_num_experts=2 * E)
            w, i = weights, ids
        pretend_hopper.clear()
        out = run_experts(DeepGemmExperts(strict=True), x, w13, w2, w, i, qc, **kwargs)
        assert len(pretend_hopper) == 2
        ref = fused_experts(
            x, w13, w2, w, i, quant_config=qc, backend="torch", w13_bias=b13, w2_bias=b2,
            activation=activation, expert_map=expert_map,
            global_num_experts=kwargs["global_num_experts"],
        )  # fmt: skip
        assert_close(out, ref, torch.bfloat16, **quant_tol("cpu"))


def test_auto_hands_small_calls_to_triton(pretend_hopper):
    from fusedmoe.experts.deep_gemm import WGMMA_MIN_SLOTS_PER_EXPERT

    tokens = WGMMA_MIN_SLOTS_PER_EXPERT * E // 2  # exactly the threshold: wgmma
    x, w13, w2, weights, ids, qc = _problem(tokens)
    run_experts(DeepGemmExperts(), x[:-1], w13, w2, weights[:-1], ids[:-1], qc)  # one slot fewer
    assert pretend_hopper == []
    run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert len(pretend_hopper) == 2
    run_experts(DeepGemmExperts(engine="triton"), x, w13, w2, weights, ids, qc)
    assert len(pretend_hopper) == 2


def test_fast_accum_takes_the_wide_tiles_from_its_slots_per_expert(pretend_hopper):
    """A quant config with fast_accum: the engine runs its 256-wide fast-accumulation tiles from
    FAST_ACCUM_MIN_SLOTS_PER_EXPERT, the promoting 128-wide ones below it and without it."""
    import dataclasses

    from fusedmoe.experts.deep_gemm import FAST_ACCUM_MIN_SLOTS_PER_EXPERT

    tokens = FAST_ACCUM_MIN_SLOTS_PER_EXPERT * E // 2  # k = 2: exactly the threshold
    x, w13, w2, weights, ids, qc = _problem(tokens)
    fast = dataclasses.replace(qc, fast_accum=True)
    cases = [(fast, tokens, 256), (fast, tokens - 1, None), (qc, tokens, None)]
    for config, m, block_n in cases:
        pretend_hopper.clear()
        out = run_experts(DeepGemmExperts(), x[:m], w13, w2, weights[:m], ids[:m], config)
        assert [b for _, b, _ in pretend_hopper] == [block_n, block_n], (m, config.fast_accum)
        ref = fused_experts(x[:m], w13, w2, weights[:m], ids[:m], quant_config=qc, backend="torch")
        assert_close(out, ref, torch.bfloat16, **quant_tol("cpu"))


def test_the_oracle_puts_deep_gemm_first_where_wgmma_runs(pretend_hopper, monkeypatch):
    from fusedmoe import select_backend

    _, _, _, _, _, qc = _problem(1)
    problem = dict(
        device="cpu", hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, quant_config=qc
    )
    choice = select_backend(**problem)
    assert choice.name == "deep_gemm", choice.explain()
    assert "wgmma" in choice.reason
    gpt_oss = select_backend(**problem, activation="swigluoai", has_bias=True)
    assert gpt_oss.name == "deep_gemm", gpt_oss.explain()  # biases, interleaved SwiGLU
    assert select_backend(**problem, dtype=torch.float32).name == "triton"
    monkeypatch.setattr(wgmma_gemm, "gluon_unusable_reason", lambda device: "not Hopper")
    assert select_backend(**problem).name == "triton"


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


def _gemm_on_layout(x, x_s, ids, num_experts, top_k, w, w_s, block_n, runs=128):
    """x (and its row scales) permuted into the contiguous layout (runs of `runs` rows), the
    Gluon GEMM with w: (out [M_sum, N] poisoned outside the runs, the float32 reference, the
    rows in runs)."""
    from fusedmoe.kernels.deep_gemm_moe import compute_aligned_M_and_alignment, permute_contiguous

    m, dev = x.shape[0], x.device
    m_sum, _ = compute_aligned_M_and_alignment(m, top_k, num_experts, runs)
    scale_out = None if x_s is None else torch.empty(x_s.shape[1], m_sum, device=dev).t()
    layout = permute_contiguous(x, x_s, ids, num_experts, runs, m_sum, scale_out=scale_out)
    out = poison_(torch.empty(m_sum, w.shape[1], device=dev, dtype=torch.bfloat16))
    wgmma_gemm.wgmma_grouped_gemm(
        layout.a, layout.a_scale, w, w_s, out, layout.expert_ids, layout.num_rows, runs,
        block_n=block_n,
    )  # fmt: skip
    ref = _reference(layout.a, layout.a_scale, w, w_s, layout.m_indices)
    return out, ref, layout.m_indices >= 0


CASES = {  # name: (M, E, k, N, K, routing)
    "uniform": (300, 6, 2, 384, 512, None),
    "odd_n_partial_k": (77, 5, 3, 320, 400, None),  # N % 256, K % 128 != 0
    "one_expert_takes_all": (260, 4, 1, 256, 256, "hot"),
    "empty_experts": (150, 9, 2, 512, 384, "empty"),
    "n448": (90, 3, 2, 448, 256, None),  # runs of 64: the second half of the last tile part live
}


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("scaled", "block_n", "runs"),
    [(True, 128, 128), (True, 256, 128), (True, 256, 64), (False, 128, 128), (False, 256, 128)],
    ids=["fp8_block-128", "fp8_block-256", "fp8_block-runs64", "bf16-128", "bf16-256"],
)
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_gemm_matches_reference(case, block_n, scaled, runs):
    """Runs of 64 rows: 64 x 256 tiles, each warpgroup 128 of the columns (odd_n_partial_k:
    the second warpgroup's columns of the last tile lie past N)."""
    _hopper()
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
    out, ref, rows = _gemm_on_layout(x, x_s, ids, e, k, w, w_s, block_n, runs)
    assert rows.any()
    assert_close(out[rows], ref[rows], torch.bfloat16, what=case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_runs_of_64_rows_give_the_bits_of_runs_of_128(case):
    """Every row's sums are formed alike in a 64 x 256 and a 128 x 128 tile: the same output
    bits for every row in a run, whichever layout it sits in."""
    _hopper()
    from fusedmoe.kernels.deep_gemm_moe import compute_aligned_M_and_alignment, permute_contiguous

    m, e, k, n, kk, routing = CASES[case]
    torch.manual_seed(hash(case) % 1000 + 1)
    _, ids = random_routing(m, e, k, device="cuda")
    if routing == "hot":
        ids = torch.full_like(ids, e - 1)
    elif routing == "empty":
        ids = ids % 3 * 3
    groups = -(-kk // 128)
    x = (torch.randn(m, kk, device="cuda") * 2).to(FP8_DTYPE)
    x_s = torch.rand(m, groups, device="cuda") * 0.1 + 0.01
    w = (torch.randn(e, n, kk, device="cuda") * 2).to(FP8_DTYPE)
    w_s = torch.rand(e, -(-n // 128), groups, device="cuda") * 0.1 + 0.01
    by_slot = {}
    for runs, block_n in ((64, 256), (128, 128)):
        m_sum, _ = compute_aligned_M_and_alignment(m, k, e, runs)
        scale_out = torch.empty(groups, m_sum, device="cuda").t()
        layout = permute_contiguous(x, x_s, ids, e, runs, m_sum, scale_out=scale_out)
        out = poison_(torch.empty(m_sum, n, device="cuda", dtype=torch.bfloat16))
        wgmma_gemm.wgmma_grouped_gemm(
            layout.a, layout.a_scale, w, w_s, out, layout.expert_ids, layout.num_rows, runs,
            block_n=block_n,
        )  # fmt: skip
        by_slot[runs] = out[layout.inv_perm.long()]  # one row per slot, in slot order
    assert by_slot[64].isfinite().all()
    assert torch.equal(by_slot[64], by_slot[128]), case


@pytest.mark.gpu
def test_gpu_gemm_row_major_scales():
    """Row scales not in the layout's column-major order are copied to it (TMA reads a row
    block's scales as one line): the same result as the reference."""
    _hopper()
    from fusedmoe.kernels.deep_gemm_moe import compute_aligned_M_and_alignment, permute_contiguous

    m, e, k, n, kk, _ = CASES["odd_n_partial_k"]
    torch.manual_seed(7)
    _, ids = random_routing(m, e, k, device="cuda")
    groups = -(-kk // 128)
    x = (torch.randn(m, kk, device="cuda") * 2).to(FP8_DTYPE)
    x_s = torch.rand(m, groups, device="cuda") * 0.1 + 0.01
    w = (torch.randn(e, n, kk, device="cuda") * 2).to(FP8_DTYPE)
    w_s = torch.rand(e, -(-n // 128), groups, device="cuda") * 0.1 + 0.01
    m_sum, _ = compute_aligned_M_and_alignment(m, k, e, 128)
    layout = permute_contiguous(x, x_s, ids, e, 128, m_sum)
    a_scale = layout.a_scale.contiguous()  # row-major
    assert a_scale.stride(1) == 1 and groups > 1
    out = poison_(torch.empty(m_sum, n, device="cuda", dtype=torch.bfloat16))
    wgmma_gemm.wgmma_grouped_gemm(
        layout.a, a_scale, w, w_s, out, layout.expert_ids, layout.num_rows, 128
    )
    ref = _reference(layout.a, a_scale, w, w_s, layout.m_indices)
    rows = layout.m_indices >= 0
    assert_close(out[rows], ref[rows], torch.bfloat16, what="row-major scales")


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [128, 256])
def test_gpu_gemm_scales_far_apart_and_zero_weight_blocks(block_n):
    """Row and weight scales nine orders of magnitude apart, and weight blocks of scale zero
    (which add nothing): the reference's result with the promotion (128 wide) and with the
    fast-accumulation kernel (256 wide), which keeps its sum in units of the last K block's
    scale and rescales it block by block."""
    _hopper()
    m, e, k, n, kk = 200, 4, 2, 640, 1040  # a half-empty last 256-wide tile, a partial K block
    torch.manual_seed(11)
    _, ids = random_routing(m, e, k, device="cuda")
    groups = -(-kk // 128)
    x = (torch.randn(m, kk, device="cuda") * 2).to(FP8_DTYPE)
    x_s = 10 ** (torch.rand(m, groups, device="cuda") * 9 - 6)
    w = (torch.randn(e, n, kk, device="cuda") * 2).to(FP8_DTYPE)
    w_s = 10 ** (torch.rand(e, -(-n // 128), groups, device="cuda") * 8 - 6)
    w_s[torch.rand_like(w_s) < 0.2] = 0.0
    w_s[:, :, 0] = 0.0  # the first K block of every tile: the sum starts after it
    assert (w_s > 0).any()
    out, ref, rows = _gemm_on_layout(x, x_s, ids, e, k, w, w_s, block_n)
    got, want = out[rows].float(), ref[rows]
    assert torch.isfinite(got).all()
    peak = want.abs().amax(dim=1, keepdim=True)  # row by row: the rows' sizes differ by 1e9
    assert (peak > 0).all()
    assert_close(got / peak, want / peak, torch.bfloat16, what="scales far apart")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_gpu_wgmma_engine_matches_torch_backend(preset, no_library, monkeypatch):
    """M = 1 and 129 (below 64 slots per expert) on runs of 64 rows, 1030 on runs of 128."""
    _hopper()
    from fusedmoe.kernels import deep_gemm_moe

    runs, real = [], deep_gemm_moe.wgmma_grouped_gemm

    def spy(a, a_scale, w, w_scale, out, expert_ids, num_rows, alignment, **kwargs):
        runs.append(alignment)
        real(a, a_scale, w, w_scale, out, expert_ids, num_rows, alignment, **kwargs)

    monkeypatch.setattr(deep_gemm_moe, "wgmma_grouped_gemm", spy)
    _, x, experts, weights, ids, qc = preset_problem(preset, 1030, "fp8_block")
    backend = DeepGemmExperts(strict=True, engine="wgmma")
    for num_tokens in (1, 129, 1030):
        sl = slice(num_tokens)
        args = (x[sl], experts["w13"], experts["w2"], weights[sl], ids[sl])
        out = run_experts(backend, *args, qc)
        ref = fused_experts(*args, quant_config=qc, backend="torch")
        assert_close(out, ref, torch.bfloat16, what=f"M = {num_tokens}", **quant_tol("cuda"))
    assert runs == [64, 64, 64, 64, 128, 128]


@pytest.mark.gpu
def test_gpu_wgmma_engine_runs_gpt_oss(no_library):
    """gpt-oss-120b (interleaved SwiGLU, biases on both GEMMs, K = 2880: a partial 128 block)
    on the engine, against the torch backend."""
    _hopper()
    from fusedmoe.modular.types import ActivationSpec

    spec, x, experts, weights, ids, qc = preset_problem("gpt-oss-120b", 2048, "fp8_block")
    backend = DeepGemmExperts(strict=True, engine="wgmma")
    bias = dict(w13_bias=experts["w13_bias"], w2_bias=experts["w2_bias"])
    for num_tokens in (129, 1030, 2048):  # 4, 32 (runs of 64 rows) and 64 slots per expert
        sl = slice(num_tokens)
        args = (x[sl], experts["w13"], experts["w2"], weights[sl], ids[sl])
        out = run_experts(
            backend, *args, qc, activation=ActivationSpec.make(spec.activation), **bias
        )
        ref = fused_experts(
            *args, quant_config=qc, backend="torch", activation=spec.activation, **bias
        )
        assert_close(out, ref, torch.bfloat16, what=f"M = {num_tokens}", **quant_tol("cuda"))


@pytest.mark.gpu
def test_gpu_fast_accum_matches_torch_backend(monkeypatch, no_library):
    """fast_accum on the engine (its 256-wide tiles from 256 slots per expert): mixtral-8x7b,
    whose GEMM2 sums the longest K of the presets (14336: 112 blocks in one accumulator,
    where the error grows most), within the quantized bounds of the torch backend."""
    _hopper()
    from fusedmoe.kernels import deep_gemm_moe

    seen = []
    real = deep_gemm_moe.wgmma_grouped_gemm

    def spy(*args, block_n=None, **kwargs):
        seen.append(block_n)
        return real(*args, block_n=block_n, **kwargs)

    monkeypatch.setattr(deep_gemm_moe, "wgmma_grouped_gemm", spy)
    _, x, experts, weights, ids, qc = preset_problem(
        "mixtral-8x7b", 1030, "fp8_block", fast_accum=True
    )
    assert qc.fast_accum
    args = (x, experts["w13"], experts["w2"], weights, ids)
    out = run_experts(DeepGemmExperts(strict=True, engine="wgmma"), *args, qc)
    assert seen == [256, 256]
    ref = fused_experts(*args, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, what="fast_accum", **quant_tol("cuda"))


@pytest.mark.gpu
def test_gpu_auto_takes_wgmma_without_the_library(monkeypatch, no_library):
    _hopper()
    from fusedmoe.kernels import deep_gemm_moe

    seen = []
    real = deep_gemm_moe.wgmma_grouped_gemm
    monkeypatch.setattr(
        deep_gemm_moe, "wgmma_grouped_gemm", lambda *a, **k: seen.append(1) or real(*a, **k)
    )
    _, x, experts, weights, ids, qc = preset_problem("qwen3-30b-a3b", 4096, "fp8_block")
    args = (x, experts["w13"], experts["w2"], weights, ids)
    ref = fused_experts(*args, quant_config=qc, backend="torch")
    run_experts(DeepGemmExperts(strict=True, engine="triton"), *args, qc)
    assert seen == []
    out = run_experts(DeepGemmExperts(strict=True), *args, qc)  # auto: wgmma
    assert len(seen) == 2  # both GEMMs
    assert_close(out, ref, torch.bfloat16, **quant_tol("cuda"))
    seen.clear()
    out = fused_experts(*args, quant_config=qc)  # the oracle: deep_gemm on wgmma
    assert len(seen) == 2
    assert_close(out, ref, torch.bfloat16, **quant_tol("cuda"))
    seen.clear()
    small = (x[:64], experts["w13"], experts["w2"], weights[:64], ids[:64])
    fused_experts(*small, quant_config=qc)  # 4 slots per expert: the triton backend
    assert seen == []
