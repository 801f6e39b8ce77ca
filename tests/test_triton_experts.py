"""The triton backend (fusedmoe.experts.triton): token alignment, the fused expert GEMMs and
their kernel configs, against the torch twins and the float64 torch backend.

Without a GPU the kernels run on Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) and only when asked for by name, so the shapes here are small; the `gpu`
tests at the end run the compiled kernels at the presets' sizes, under CUDA graphs and
torch.compile. Legend: M tokens, k top-k, S = M * k slots, E experts (E_l local), H hidden,
I intermediate, N = 2I (gated) or I, BM rows per aligned block.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

pytest.importorskip("triton")

from fusedmoe import ActivationParams, FusedMoE, fused_experts, select_backend
from fusedmoe.activation import MoEActivation
from fusedmoe.experts.torch_ref import TorchExperts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.kernels import moe_align as ma
from fusedmoe.kernels import moe_config as mc
from fusedmoe.kernels.fused_moe import _tma_rows, fused_experts_triton
from fusedmoe.kernels.moe_align import (
    aligned_sizes,
    moe_align_block_size,
    moe_align_block_size_torch,
)
from fusedmoe.kernels.moe_config import (
    GemmConfig,
    MoEKernelConfig,
    heuristic_config,
    moe_kernel_config,
    table_path,
    use_moe_kernel_config,
)
from fusedmoe.modular.kernel import FusedMoEModularKernel, shared_workspaces
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.modular.types import ActivationSpec, ExpertWeights, MoEProblem, OutputColumns
from fusedmoe.quant import make_quant_config, quantize_experts
from fusedmoe.quant.kernels import resolve_params
from fusedmoe.tools.presets import PRESETS
from tests.helpers import (
    assert_close,
    assert_equal,
    poison_,
    preset_problem,
    quant_tol,
    random_routing,
)
from tests.reference import (
    ALL_ACTIVATIONS,
    NON_GATED,
    random_experts,
    run_fused_experts,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, E = 64, 48, 8  # I = 48: GEMM1's and GEMM2's tiles have masked tails

QUANT_TOL = quant_tol(DEVICE)


# ---------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------
_routing = functools.partial(random_routing, device=DEVICE)


def _experts(num_experts, hidden, inter, activation="silu", *, dtype, bias=False, device=DEVICE):
    experts = random_experts(num_experts, hidden, inter, activation, dtype=dtype, bias=bias)
    return {k: None if v is None else v.to(device) for k, v in experts.items()}


def _expert_map(local: list[int], num_global: int, device: str = DEVICE) -> torch.Tensor:
    """int32 [E]: global id -> local id for the experts in `local`, -1 for the others."""
    expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(len(local), dtype=torch.int32)
    return expert_map.to(device)


def _run(x, experts, weights, ids, backend, **kwargs):
    return run_fused_experts(x, experts, weights, ids, backend=backend, **kwargs)


def _both(x, experts, weights, ids, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton output, torch backend output) of one call."""
    out = _run(x, experts, weights, ids, "triton", **kwargs)
    return out, _run(x, experts, weights, ids, "torch", **kwargs)


# ---------------------------------------------------------------------------------------------
# token alignment: the kernel == its twin, and the twin keeps the invariants of the docstring
# ---------------------------------------------------------------------------------------------
def _check_aligned(routing, ids: torch.Tensor, num_local: int, expert_map) -> None:
    """The AlignedRouting invariants, from moe_align's docstring (checked on the twin)."""
    block_m = routing.block_m
    num_slots = ids.numel()
    flat = ids.reshape(-1).long().cpu()
    local = flat.clone()
    if expert_map is not None:
        local = torch.where(flat >= 0, expert_map.long().cpu()[flat.clamp(min=0)], -1)
    num_post = int(routing.num_tokens_post_padded[0])
    assert num_post % block_m == 0
    max_padded, max_blocks = aligned_sizes(num_slots, num_local, block_m)
    assert routing.sorted_token_ids.shape == (max_padded,)
    assert routing.expert_ids.shape == (max_blocks,)
    rows = routing.sorted_token_ids.long().cpu()
    experts = routing.expert_ids.long().cpu()
    assert bool((rows[num_post:] == num_slots).all()), "rows past the end hold the sentinel"
    assert bool((experts[num_post // block_m :] == -1).all()), "blocks past the end are -1"
    used = rows[:num_post]
    real = used[used < num_slots]
    # every slot routed here exactly once, and no other
    assert sorted(real.tolist()) == (local >= 0).nonzero().flatten().tolist()
    block_of_row = experts[: num_post // block_m].repeat_interleave(block_m)
    assert bool((local[real] == block_of_row[used < num_slots]).all()), "row in a wrong block"
    assert bool((block_of_row.diff() >= 0).all()), "experts in ascending order"
    assert bool((real.diff()[local[real].diff() == 0] > 0).all()), "slot order within an expert"
    counts = torch.bincount(local[local >= 0], minlength=num_local)
    assert num_post == int(((counts + block_m - 1) // block_m).sum()) * block_m, "padding"


# (M, k, E_l, map): the routings of the grid; map: E > E_l global experts, half elsewhere
ALIGN_SHAPES = [(1, 1, 1, False), (1, 2, 8, True), (37, 3, 8, False), (37, 3, 8, True),
                (37, 8, 8, False), (64, 4, 16, True)]  # fmt: skip


def _align_ids(num_tokens, top_k, num_local, use_map, *, empty=0.1):
    num_global = 2 * num_local + 1 if use_map else num_local
    num_choices = max(num_global, top_k)
    _, ids = _routing(num_tokens, num_choices, top_k, empty=empty)
    ids = ids.masked_fill(ids >= num_global, -1)
    expert_map = None
    if use_map:
        local = torch.randperm(num_global)[:num_local].sort().values.tolist()
        expert_map = _expert_map(local, num_global)
    return ids, expert_map


def _assert_align_matches_twin(ids, block_m, num_local, expert_map, **kwargs):
    got = moe_align_block_size(ids, block_m, num_local, expert_map, **kwargs)
    want = moe_align_block_size_torch(ids, block_m, num_local, expert_map)
    _check_aligned(want, ids, num_local, expert_map)
    assert got.block_m == block_m
    assert_equal(got.num_tokens_post_padded, want.num_tokens_post_padded, what="num_post")
    assert_equal(got.expert_ids, want.expert_ids, what="expert_ids")
    assert_equal(got.sorted_token_ids, want.sorted_token_ids, what="sorted_token_ids")


@pytest.mark.parametrize(("num_tokens", "top_k", "num_local", "use_map"), ALIGN_SHAPES)
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_matches_twin(num_tokens, top_k, num_local, use_map, block_m):
    ids, expert_map = _align_ids(num_tokens, top_k, num_local, use_map)
    _assert_align_matches_twin(ids, block_m, num_local, expert_map)


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_local", "use_map", "chunk"),
    [(37, 3, 8, False, 32), (37, 3, 8, True, 16), (64, 4, 16, True, 32)],
)
def test_align_several_programs(num_tokens, top_k, num_local, use_map, chunk):
    """More slots than `chunk`: count, scan and scatter as three launches, one program per
    chunk (a partial last chunk included)."""
    ids, expert_map = _align_ids(num_tokens, top_k, num_local, use_map)
    assert ids.numel() > chunk
    _assert_align_matches_twin(ids, 16, num_local, expert_map, chunk=chunk)


@pytest.mark.parametrize(
    ("case", "chunk"),
    [("all_to_one", 4096), ("all_to_one", 16), ("all_empty", 4096), ("all_elsewhere", 16),
     ("last_expert", 4096), ("int64_ids", 4096)],
)  # fmt: skip
def test_align_degenerate(case, chunk):
    num_tokens, top_k, num_local = 37, 2, 6
    ids = torch.randint(0, num_local, (num_tokens, top_k), dtype=torch.int32)
    expert_map = None
    if case == "all_to_one":
        ids.fill_(3)
    elif case == "all_empty":
        ids.fill_(-1)
    elif case == "all_elsewhere":  # every id is an expert of another rank
        expert_map = _expert_map([0, 2, 4], 2 * num_local)
        ids = torch.randint(0, 2 * num_local, (num_tokens, top_k), dtype=torch.int32)
        ids = ids // 2 * 2 + 1  # odd ids: not placed here
        num_local = 3
    elif case == "last_expert":
        ids.fill_(num_local - 1)
        ids[::3, 0] = 0
    else:
        ids = ids.long()
    ids = ids.to(DEVICE)
    for block_m in (16, 64):
        _assert_align_matches_twin(ids, block_m, num_local, expert_map, chunk=chunk)


@pytest.mark.parametrize("case", ["random", "all_to_one", "one_hot_expert"])
def test_align_many_experts_several_steps(case):
    """600 local experts (1024 bins): the scan reads the programs' counts 4 rows at a time and
    writes the block table one block per expert at a time, so a run of several programs and
    an expert of several blocks each take several steps of those loops."""
    num_tokens, top_k, num_local = 40, 3, 600
    ids = torch.randint(0, num_local, (num_tokens, top_k), dtype=torch.int32)
    if case == "all_to_one":
        ids.fill_(599)
    elif case == "one_hot_expert":  # expert 7 in every token: 40 slots, 3 blocks of 16
        ids[:, 0] = 7
    ids = ids.to(DEVICE)
    for chunk in (16, None):  # 8 programs (two steps of 4 rows), and one program
        _assert_align_matches_twin(ids, 16, num_local, None, chunk=chunk)


def test_align_default_chunks(monkeypatch):
    """Above _SINGLE_MAX slots the default alignment runs programs of _CHUNK_MIN slots (the
    three-launch path), and never more than _MAX_PROGRAMS programs short of _CHUNK_MAX."""
    assert ma._chunk_for(1) == 1 and ma._chunk_for(300) == 512
    assert ma._chunk_for(ma._SINGLE_MAX) == ma._SINGLE_MAX  # one program holds every slot
    assert ma._chunk_for(ma._SINGLE_MAX + 1) == ma._CHUNK_MIN
    for slots in (10_000, 131_072, 10**6):
        chunk = ma._chunk_for(slots)
        assert -(-slots // chunk) <= ma._MAX_PROGRAMS or chunk == ma._CHUNK_MAX
    grids = []
    launch = ma.launch
    monkeypatch.setattr(ma, "launch", lambda kernel, grid, *a: grids.append(grid) or launch(
        kernel, grid, *a))  # fmt: skip
    ids, expert_map = _align_ids(150, 4, 16, True)  # 600 slots: 3 programs of 256
    _assert_align_matches_twin(ids, 16, 16, expert_map)
    assert grids == [(3,), (1,), (3,)]  # count, scan, scatter


def test_align_no_tokens():
    ids = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    got = moe_align_block_size(ids, 16, 4)
    want = moe_align_block_size_torch(ids, 16, 4)
    assert int(got.num_tokens_post_padded[0]) == 0
    assert_equal(got.num_tokens_post_padded, want.num_tokens_post_padded)
    assert got.sorted_token_ids.shape == want.sorted_token_ids.shape == (0,)
    assert got.expert_ids.shape == want.expert_ids.shape == (0,)


@pytest.mark.parametrize(
    ("slots", "num_local", "block_m", "expected"),
    [(1, 8, 16, (16, 1)), (8, 8, 16, (128, 8)), (74, 8, 64, (640, 10)), (10, 1, 64, (128, 2))],
)
def test_aligned_sizes(slots, num_local, block_m, expected):
    # min(S * BM, S + E_l * (BM - 1)) rounded up to BM
    assert aligned_sizes(slots, num_local, block_m) == expected


# ---------------------------------------------------------------------------------------------
# the fused experts against the torch backend
# ---------------------------------------------------------------------------------------------
PARAM_CASES = [
    ("silu", {"limit": 2.0}),
    ("swigluoai", {"alpha": 1.0, "limit": 3.0}),
    ("swigluoai_uninterleave", {"alpha": 2.0, "beta": 0.5, "limit": 4.0}),
    ("swiglustep", {"limit": 3.0}),
]


@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
def test_every_activation(activation):
    assert {a.value for a in MoEActivation} == set(ALL_ACTIVATIONS)
    experts = _experts(E, H, I, activation, dtype=torch.float32, bias=True)
    assert experts["w13"].shape[1] == (I if activation in NON_GATED else 2 * I)
    x = torch.randn(19, H, device=DEVICE)
    weights, ids = _routing(19, E, 2, empty=0.1)
    out, ref = _both(x, experts, weights, ids, activation=activation)
    assert out.dtype == torch.float32 and out.shape == (19, H)
    assert_close(out, ref)


@pytest.mark.parametrize(("activation", "params"), PARAM_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_params(activation, params, dtype):
    experts = _experts(E, H, I, activation, dtype=dtype, bias=True)
    x = torch.randn(11, H, device=DEVICE, dtype=dtype)
    weights, ids = _routing(11, E, 2)
    kwargs = dict(activation=activation, activation_params=ActivationParams(**params))
    out, ref = _both(x, experts, weights, ids, **kwargs)
    assert_close(out, ref, dtype)
    # the parameters matter: the defaults give a clearly different answer
    default = _run(x, experts, weights, ids, "torch", activation=activation).double()
    assert (default - ref.double()).abs().max() > 0.1 * ref.double().abs().max()


# name -> (M, E, k, routing keywords, bias)
ROUTING_CASES = {
    "one_token": (1, E, 2, {}, False),
    "odd_M_empty_slots": (37, E, 2, {"empty": 0.2}, True),
    "k_equals_E": (19, 4, 4, {}, False),
    "dense_ffn": (23, 1, 1, {}, True),  # one expert: a dense MLP
    "all_to_one_expert": (37, E, 1, {"hot": 5}, False),
    "top_1_many_tokens": (64, 4, 1, {"empty": 0.1}, True),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_routing_cases(case, dtype):
    num_tokens, num_experts, top_k, routing, bias = ROUTING_CASES[case]
    experts = _experts(num_experts, H, I, dtype=dtype, bias=bias)
    x = torch.randn(num_tokens, H, device=DEVICE, dtype=dtype)
    weights, ids = _routing(num_tokens, num_experts, top_k, **routing)
    out, ref = _both(x, experts, weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, H)
    assert_close(out, ref, dtype)
    empty_tokens = (ids < 0).all(dim=1)
    if bool(empty_tokens.any()):
        assert_equal(out[empty_tokens], torch.zeros_like(out[empty_tokens]), what="no expert")


def test_biases_and_router_weights_matter():
    """The two terms a wrong kernel could silently drop change the answer by far more than the
    tolerance (so test_routing_cases would catch their loss)."""
    experts = _experts(E, H, I, dtype=torch.float32, bias=True)
    x = torch.randn(9, H, device=DEVICE)
    weights, ids = _routing(9, E, 2)
    out = _run(x, experts, weights, ids, "triton")
    no_bias = dict(experts, w13_bias=None, w2_bias=None)
    scale = out.abs().max()
    assert (out - _run(x, no_bias, weights, ids, "triton")).abs().max() > 0.1 * scale
    unit = _run(x, experts, torch.ones_like(weights), ids, "triton")
    assert (out - unit).abs().max() > 0.1 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_map(dtype):
    """Experts of other ranks contribute zero; the ranks' outputs sum to the unsharded one."""
    num_global = 8
    experts = _experts(num_global, H, I, dtype=dtype, bias=True)
    x = torch.randn(19, H, device=DEVICE, dtype=dtype)
    weights, ids = _routing(19, num_global, 3, empty=0.1)
    ids[0] = torch.tensor([1, 3, -1])  # a token with no expert on the first rank
    ranks = [[0, 2, 5, 6], [1, 3, 4, 7]]
    total = torch.zeros(19, H, dtype=torch.float64, device=DEVICE)
    for group in ranks:
        local = {k: v[group].contiguous() for k, v in experts.items()}
        kwargs = dict(expert_map=_expert_map(group, num_global), global_num_experts=num_global)
        out, ref = _both(x, local, weights, ids, **kwargs)
        assert_close(out, ref, dtype, what=f"rank of experts {group}")
        if group is ranks[0]:
            assert_equal(out[0], torch.zeros_like(out[0]), what="token routed elsewhere")
        total += out.double()
    unsharded = _run(x, experts, weights, ids, "torch")
    assert_close(total, unsharded.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_on_input(dtype):
    experts = _experts(E, H, I, dtype=dtype, bias=True)
    x = torch.randn(23, H, device=DEVICE, dtype=dtype)
    weights, ids = _routing(23, E, 1, empty=0.1)
    out, ref = _both(x, experts, weights, ids, apply_router_weight_on_input=True)
    assert_close(out, ref, dtype)
    on_output = _run(x, experts, weights, ids, "torch")
    assert (on_output.double() - ref.double()).abs().max() > 0.1 * ref.double().abs().max()


def test_no_tokens():
    experts = _experts(E, H, I, dtype=torch.bfloat16)
    x = torch.randn(0, H, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(0, E, 2)
    out = _run(x, experts, weights, ids, "triton")
    assert out.shape == (0, H) and out.dtype == torch.bfloat16


def test_op_with_no_tokens():
    """The custom op itself returns at M = 0, before it sizes anything from the workspaces."""
    experts = _experts(E, H, I, dtype=torch.float32)
    output = torch.empty(0, H, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    fused_experts_triton(
        output, torch.empty(0, H, device=DEVICE), experts["w13"], experts["w2"],
        torch.empty(0, 2, device=DEVICE), ids, activation=MoEActivation.SILU,
        params=resolve_params(MoEActivation.SILU, None), workspace13=torch.empty(1, device=DEVICE),
        workspace2=torch.empty(1, device=DEVICE), dtype_key="float32",
    )  # fmt: skip


def test_inputs_need_not_be_fresh():
    """Non-contiguous x and weights (views), int64 ids and float64 router weights."""
    experts = _experts(E, H, I, dtype=torch.float32, bias=True)
    wide = torch.randn(21, 2 * H, device=DEVICE)
    x = wide[:, ::2]
    weights, ids = _routing(21, E, 2)
    w13_t = experts["w13"].transpose(1, 2).contiguous().transpose(1, 2)  # column-major experts
    strided = dict(experts, w13=w13_t)
    out = _run(x, strided, weights.double(), ids.long(), "triton")
    assert_close(out, _run(x.contiguous(), experts, weights, ids, "torch"))


# ---------------------------------------------------------------------------------------------
# the output and workspaces the backend gets are poisoned: every element of the output is
# written, and nothing unwritten is read
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", [None, "fp8_block", "fp8_tensor"])
def test_poisoned_buffers(monkeypatch, scheme):
    real_apply = TritonExperts.apply
    poisoned = []

    def poisoned_apply(self, call):
        for buf in (call.output, call.workspace13, call.workspace2):
            poisoned.append(poison_(buf))
        real_apply(self, call)

    monkeypatch.setattr(TritonExperts, "apply", poisoned_apply)
    hidden, inter, num_global = (256, 128, 8) if scheme == "fp8_block" else (H, I, 8)
    experts = _experts(num_global, hidden, inter, dtype=torch.bfloat16, bias=True)
    x = torch.randn(19, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(19, num_global, 2, empty=0.2)
    ids[:2] = -1  # tokens with no expert: their rows are zeros, never left unwritten
    group = [0, 1, 3, 4, 6]
    local = {k: v[group].contiguous() for k, v in experts.items()}
    kwargs = dict(expert_map=_expert_map(group, num_global))
    tol = {}
    if scheme is not None:
        local["w13"], local["w2"], kwargs["quant_config"] = quantize_experts(
            local["w13"].float(), local["w2"].float(), scheme
        )
        tol = QUANT_TOL
    out = _run(x, local, weights, ids, "triton", **kwargs)
    assert len(poisoned) == 3
    assert not bool(out.isnan().any()), f"{int(out.isnan().sum())} NaN in the output"
    assert_equal(out[:2], torch.zeros(2, hidden, dtype=out.dtype))
    assert_close(out, _run(x, local, weights, ids, "torch", **kwargs), torch.bfloat16, **tol)


# ---------------------------------------------------------------------------------------------
# quantized experts
# ---------------------------------------------------------------------------------------------
def _static_scales(x: torch.Tensor, experts: dict) -> dict:
    """a1_scale, a2_scale covering amax(x) and amax(act(x @ w13.T)) over every expert."""
    h = torch.einsum("mh,enh->emn", x.float(), experts["w13"].float())
    inter = h.shape[-1] // 2
    a = torch.nn.functional.silu(h[..., :inter]) * h[..., inter:]
    return dict(
        a1_scale=(x.float().abs().max() / 448).reshape(1),
        a2_scale=(a.abs().max() / 448).reshape(1),
    )


# label -> (scheme, quantize_experts keywords, H, I, bias, activation)
QUANT_CASES = {
    "fp8_tensor": ("fp8_tensor", {}, H, I, False, "silu"),
    "fp8_tensor_per_token": ("fp8_tensor", {"per_token_activations": True}, H, I, False, "silu"),
    "fp8_tensor_static": ("fp8_tensor", "static", H, I, False, "silu"),
    "fp8_channel_bias": ("fp8_channel", {}, H, I, True, "silu"),
    "fp8_block": ("fp8_block", {}, 256, 128, False, "silu"),
    "fp8_block_ue8m0": ("fp8_block", {"use_ue8m0": True}, 256, 128, False, "silu"),
    "fp8_block_column_major": ("fp8_block", {"column_major_scales": True}, 256, 128, True, "silu"),
    "fp8_block_partial_groups": ("fp8_block", {}, 256, 192, False, "silu"),  # I = 1.5 groups
    "fp8_block_swigluoai": ("fp8_block", {}, 256, 128, True, "swigluoai"),  # gpt-oss
    "fp8_block_non_gated": ("fp8_block", {}, 256, 128, False, "relu2_no_mul"),
    "int8": ("int8", {}, H, I, False, "silu"),
    "int8_bias_gelu": ("int8", {}, H, I, True, "gelu"),
}


def _quantized(case: str, num_experts: int = 4, num_tokens: int = 13):
    """(x, quantized experts, quant config, activation) of QUANT_CASES[case]."""
    scheme, kwargs, hidden, inter, bias, activation = QUANT_CASES[case]
    experts = _experts(num_experts, hidden, inter, activation, dtype=torch.bfloat16, bias=bias)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    if kwargs == "static":
        kwargs = _static_scales(x, experts)
    w13, w2, qc = quantize_experts(experts["w13"].float(), experts["w2"].float(), scheme, **kwargs)
    return x, dict(experts, w13=w13, w2=w2), qc, activation


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantized(case):
    x, experts, qc, activation = _quantized(case)
    weights, ids = _routing(13, 4, 2, empty=0.1)
    assert select_backend(backend="triton", device=DEVICE, hidden_size=x.shape[1],
                          intermediate_size=experts["w2"].shape[2], num_experts=4, top_k=2,
                          activation=activation, quant_config=qc).name == "triton"  # fmt: skip
    out, ref = _both(x, experts, weights, ids, quant_config=qc, activation=activation)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


def test_ue8m0_scales_are_used():
    """UE8M0 a2 scales (powers of two) against float32 ones: within the tolerance of each other,
    so the output must be clearly closer to the reference of its own scale format."""
    x, experts, qc_ue8m0, _ = _quantized("fp8_block_ue8m0")
    # the same weights and weight scales, float32 activation scales
    qc_float = make_quant_config("fp8_block", qc_ue8m0.w1.scale, qc_ue8m0.w2.scale)
    weights, ids = _routing(13, 4, 2)
    out = _run(x, experts, weights, ids, "triton", quant_config=qc_ue8m0)
    own = _run(x, experts, weights, ids, "torch", quant_config=qc_ue8m0).double()
    other = _run(x, experts, weights, ids, "torch", quant_config=qc_float).double()

    def rms(a, b):
        return float((a - b).square().mean().sqrt())

    assert rms(out.double(), own) < 0.6 * rms(out.double(), other)


@pytest.mark.parametrize(
    ("case", "num_tokens"),
    [("fp8_tensor", 19), ("fp8_tensor_per_token", 1), ("fp8_block", 1), ("fp8_block", 19),
     ("int8", 19)],
)  # fmt: skip
def test_quantized_expert_map(case, num_tokens):
    """Three of E experts on this rank: dynamic a2 scales span this rank's rows only."""
    x, local, qc, activation = _quantized(case, num_experts=3, num_tokens=num_tokens)
    weights, ids = _routing(num_tokens, E, 3, empty=0.1)
    kwargs = dict(quant_config=qc, expert_map=_expert_map([1, 2, 6], E), activation=activation)
    out, ref = _both(x, local, weights, ids, **kwargs)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


# ---------------------------------------------------------------------------------------------
# the output by column blocks (OutputColumns: an EP combine overlapped with GEMM2)
# ---------------------------------------------------------------------------------------------
class _ColumnsPF(NoEPPrepareFinalize):
    """Offers the experts a poisoned output buffer of its own and column blocks of it; keeps
    a copy of the buffer at each report (on a GPU, after the current stream's work)."""

    def __init__(self, bounds):
        self.bounds, self.seen, self.buf = bounds, [], None

    def experts_may_write_output(self):
        return False  # so that the modular kernel asks for expert_output_buffer

    def expert_output_buffer(self, shape, dtype, device):
        self.buf = poison_(torch.empty(shape, dtype=dtype, device=device))
        return self.buf

    def output_columns(self, output, expert_output):
        assert expert_output is self.buf
        return OutputColumns(self.bounds, lambda j: self.seen.append((j, self.buf.clone())))


# label -> (QUANT_CASES case or None for bf16 with biases, bounds)
COLUMN_CASES = {
    "bf16_uneven": (None, (0, 24, 40, 64)),
    "bf16_one_block": (None, (0, 64)),
    "fp8_block": ("fp8_block", (0, 128, 256)),
    "fp8_block_bias_swigluoai": ("fp8_block_swigluoai", (0, 128, 256)),
    "fp8_channel_bias": ("fp8_channel_bias", (0, 16, 64)),
    "fp8_tensor": ("fp8_tensor", (0, 32, 48, 64)),
    "int8": ("int8", (0, 40, 64)),
}


COLUMN_TOKENS = [13, pytest.param(300, marks=pytest.mark.skipif(DEVICE != "cuda", reason="GPU"))]


@pytest.mark.parametrize("num_tokens", COLUMN_TOKENS)  # 300: 64-row blocks, TMA weight loads
@pytest.mark.parametrize("label", list(COLUMN_CASES))
def test_output_columns_written_block_by_block(label, num_tokens):
    """GEMM2 and the sum by column blocks: at report j, columns [0, bounds[j + 1]) of the
    output are final and the rest untouched (still the poison); the whole equals one call
    without blocks, and the torch backend."""
    case, bounds = COLUMN_CASES[label]
    num_experts = 4
    if case is None:
        experts = _experts(num_experts, H, I, dtype=torch.bfloat16, bias=True)
        x = torch.randn(num_tokens, H, device=DEVICE, dtype=torch.bfloat16)
        qc, activation = None, "silu"
    else:
        x, experts, qc, activation = _quantized(case, num_experts, num_tokens)
    hidden = x.shape[1]
    assert bounds[-1] == hidden
    weights, ids = _routing(num_tokens, num_experts, 2, empty=0.1)
    pf = _ColumnsPF(bounds)
    kernel = FusedMoEModularKernel(pf, TritonExperts())
    assert kernel.experts.writes_output_columns(qc)
    ew = ExpertWeights(experts["w13"], experts["w2"], experts["w13_bias"], experts["w2_bias"])
    spec = ActivationSpec.make(activation)
    out = kernel.forward(
        x, ew, weights, ids, activation=spec, global_num_experts=num_experts, quant_config=qc
    )
    assert [j for j, _ in pf.seen] == list(range(len(bounds) - 1))
    for j, snapshot in pf.seen:
        done, rest = snapshot[:, : bounds[j + 1]], snapshot[:, bounds[j + 1] :]
        assert_equal(done, out[:, : bounds[j + 1]], what=f"block {j}: the columns written")
        assert bool(rest.isnan().all()), f"block {j}: a later block was written early"
    whole = _run(x, experts, weights, ids, "triton", quant_config=qc, activation=activation)
    assert_equal(out, whole, what="by blocks vs in one piece")
    ref = _run(x, experts, weights, ids, "torch", quant_config=qc, activation=activation)
    assert_close(out, ref, torch.bfloat16, **(QUANT_TOL if qc is not None else {}))


def test_output_columns_bad_bounds_refused_before_anything_is_written():
    with pytest.raises(ValueError, match="rise from 0"):
        OutputColumns((0, 32, 32, 64), lambda j: None)
    with pytest.raises(ValueError, match="rise from 0"):
        OutputColumns((8, 64), lambda j: None)
    for case, bounds, match in (
        (None, (0, 32, 48), "end at 48"),
        ("fp8_block", (0, 64, 256), "multiples of 128"),
    ):
        if case is None:
            experts = _experts(4, H, I, dtype=torch.bfloat16)
            x = torch.randn(5, H, device=DEVICE, dtype=torch.bfloat16)
            qc, activation = None, "silu"
        else:
            x, experts, qc, activation = _quantized(case, 4, 5)
        weights, ids = _routing(5, 4, 2)
        pf = _ColumnsPF(bounds)
        kernel = FusedMoEModularKernel(pf, TritonExperts())
        ew = ExpertWeights(experts["w13"], experts["w2"], experts["w13_bias"], experts["w2_bias"])
        with pytest.raises(ValueError, match=match):
            kernel.forward(
                x, ew, weights, ids, activation=ActivationSpec.make(activation),
                global_num_experts=4, quant_config=qc,
            )  # fmt: skip
        assert pf.seen == [] and bool(pf.buf.isnan().all())  # nothing reported nor written


class _LatePF(NoEPPrepareFinalize):
    """Hands the experts poisoned activations (and scales) and an input_ready that writes the
    real ones in: an EP dispatch whose activations arrive after the routing. `events` records
    the order of the slots' alignment (gemm_rows, patched by the test) and input_ready."""

    def __init__(self, events):
        self.events = events

    def num_tokens_across_ranks(self, num_tokens, device):
        return max(num_tokens, 1)  # as if a peer had tokens: a rank without any still prepares

    def prepare(self, a1, *args, **kwargs):
        self.events.append("prepare")
        prepared = super().prepare(a1, *args, **kwargs)
        real = (prepared.a1q, prepared.a1q_scale)
        late = [None if t is None else _poisoned_like(t) for t in real]

        def ready():  # a second call does nothing (the contract)
            if "ready" in self.events:
                return
            self.events.append("ready")
            for dst, src in zip(late, real, strict=True):
                if dst is not None:
                    dst.copy_(src)

        return dataclasses.replace(prepared, a1q=late[0], a1q_scale=late[1], input_ready=ready)


def _poisoned_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    if out.dtype.itemsize == 1 and out.is_floating_point():  # FP8: its NaN byte
        out.view(torch.uint8).fill_(0x7F)
        return out
    return poison_(out)


@pytest.mark.parametrize("num_tokens", [13, 0])
@pytest.mark.parametrize("case", [None, "fp8_block", "torch"])
def test_input_ready_called_after_the_alignment_before_the_input_is_read(
    monkeypatch, case, num_tokens
):
    """ExpertsCall.input_ready: the triton backend's fused path aligns its slots, then calls
    it, then reads x (the poison it replaces would reach the output); a backend that does not
    read its input late (the torch reference) gets it called by the modular kernel first.
    Called once, also without tokens."""
    import fusedmoe.kernels.fused_moe as fm

    events = []
    aligned = fm.gemm_rows

    def gemm_rows(*args, **kwargs):
        events.append("align")
        return aligned(*args, **kwargs)

    monkeypatch.setattr(fm, "gemm_rows", gemm_rows)
    if case in (None, "torch"):
        experts = _experts(4, H, I, dtype=torch.bfloat16, bias=True)
        x = torch.randn(num_tokens, H, device=DEVICE, dtype=torch.bfloat16)
        qc, activation = None, "silu"
    else:
        x, experts, qc, activation = _quantized(case, 4, num_tokens)
    weights, ids = _routing(num_tokens, 4, 2, empty=0.1)
    backend = TorchExperts() if case == "torch" else TritonExperts()
    ew = ExpertWeights(experts["w13"], experts["w2"], experts["w13_bias"], experts["w2_bias"])
    call = dict(activation=ActivationSpec.make(activation), global_num_experts=4,
                quant_config=qc)  # fmt: skip
    expected = FusedMoEModularKernel(NoEPPrepareFinalize(), backend).forward(
        x, ew, weights, ids, **call
    )
    events.clear()
    out = FusedMoEModularKernel(_LatePF(events), backend).forward(x, ew, weights, ids, **call)
    assert_equal(out, expected, what="activations that arrive late")
    if case == "torch" or num_tokens == 0:
        assert events == ["prepare", "ready"]
    else:
        assert backend.reads_input_late(qc) and events == ["prepare", "align", "ready"]


def test_input_ready_joined_where_the_experts_raise():
    """A backend that reads its input late and raises first: the modular kernel still calls
    input_ready (what the dispatch left in flight is joined; a CUDA graph capture must end with
    its streams joined), then the error goes on."""

    class Raises(TritonExperts):
        def apply(self, call, gate=None):
            raise ValueError("raised before reading the input")

    events = []
    experts = _experts(4, H, I, dtype=torch.bfloat16)
    weights, ids = _routing(5, 4, 2)
    ew = ExpertWeights(experts["w13"], experts["w2"])
    x = torch.randn(5, H, device=DEVICE, dtype=torch.bfloat16)
    kernel = FusedMoEModularKernel(_LatePF(events), Raises())
    with pytest.raises(ValueError, match="before reading"):
        kernel.forward(x, ew, weights, ids, activation=ActivationSpec.make("silu"),
                       global_num_experts=4)  # fmt: skip
    assert events == ["prepare", "ready"]


def test_tma_rows_of_a_column_block():
    """A weight's block of rows w[:, lo:hi] as the TMA descriptor walks it: row n of expert e
    at e * H + n (the GEMM's coordinates), a view of the weight's own memory."""
    w = torch.randn(3, 40, 16)
    for lo, hi in ((0, 40), (8, 24), (32, 40)):
        block = w[:, lo:hi]
        rows = _tma_rows(block)
        assert rows.data_ptr() == block.data_ptr() and rows.shape[1] == 16
        for e in range(3):
            assert_equal(rows[e * 40 : e * 40 + hi - lo], w[e, lo:hi], what=f"expert {e}")
    assert _tma_rows(w[:, :, :8]) is None  # rows not dense: no descriptor


@pytest.mark.parametrize("scheme", ["mxfp4_w4a16", "int4_w4a16"])
def test_output_columns_not_taken_by_the_weight_only_kernels(scheme):
    experts = _experts(2, 128, 128, dtype=torch.float32, device="cpu")
    _, _, qc = quantize_experts(experts["w13"], experts["w2"], scheme)
    assert not TritonExperts().writes_output_columns(qc)


@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4_w4a8", "nvfp4"])
def test_unsupported_schemes_are_refused(scheme):
    """(mxfp4_w4a16 and the other weight-only schemes run: tests/test_weight_only.py.)"""
    experts = _experts(4, 64, 32, dtype=torch.float32)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], scheme)
    problem = dict(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2)
    choice = select_backend(device=DEVICE, quant_config=qc, **problem)
    assert choice.name != "triton"
    assert "does not support quant config" in choice.refused["triton"]
    assert scheme in choice.refused["triton"]
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=DEVICE)
    weights, ids = _routing(3, 4, 2)
    with pytest.raises(ValueError, match=rf"backend 'triton' cannot run.*{scheme}"):
        fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="triton")


# ---------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------
PROBLEM = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ["silu", "swigluoai", "relu2_no_mul"])
def test_oracle_on_cpu_never_picks_triton(dtype, activation):
    choice = select_backend(device="cpu", dtype=dtype, activation=activation, **PROBLEM)
    assert choice.name != "triton"
    why = choice.refused["triton"]
    if DEVICE == "cpu":  # the interpreter is on: it could run, but only by name
        assert why == "runs on cpu only when requested by name"
        explicit = select_backend(backend="triton", device="cpu", dtype=dtype, **PROBLEM)
        assert explicit.name == "triton" and explicit.reason == "requested explicitly"
    else:
        assert why


def test_oracle_refuses_float64_and_quantized_autograd():
    choice = select_backend(device=DEVICE, dtype=torch.float64, **PROBLEM)
    assert choice.name == "torch" and "float64" in choice.refused["triton"]
    experts = _experts(E, H, I, dtype=torch.float64)
    x = torch.randn(3, H, dtype=torch.float64, device=DEVICE)
    weights, ids = _routing(3, E, 2)
    with pytest.raises(ValueError, match=r"backend 'triton' cannot run.*float64"):
        _run(x, experts, weights, ids, "triton")
    # training: unquantized runs (tests/test_train_triton.py), quantized is inference only
    qc = make_quant_config("fp8_tensor", torch.ones(E), torch.ones(E))
    problem = MoEProblem(
        device=torch.device(DEVICE), dtype=torch.bfloat16, **PROBLEM, quant_config=qc,
        requires_grad=True,
    )  # fmt: skip
    assert "inference only" in select_backend(problem).refused["triton"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_custom_op_schema_and_fake(dtype):
    experts = _experts(4, H, I, dtype=dtype, bias=True)
    x = torch.randn(5, H, dtype=dtype, device=DEVICE)
    weights, ids = _routing(5, 4, 2, empty=0.2)
    alpha, beta, limit, has_limit = resolve_params(MoEActivation.SILU, None)
    args = (
        torch.empty(5, H, dtype=dtype, device=DEVICE), x, None, experts["w13"], experts["w2"],
        None, None, experts["w13_bias"], experts["w2_bias"], weights, ids, None, None,
        torch.empty(5 * 2 * H, dtype=dtype, device=DEVICE),
        torch.empty(5 * 2 * I, dtype=dtype, device=DEVICE),
        "silu", alpha, beta, limit, has_limit, "none", "none", "none", True, str(dtype)[6:],
    )  # fmt: skip
    op = torch.ops.fusedmoe.fused_experts_triton.default
    result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in result.values()), result


def _call_op(x, experts, weights, ids, activation=MoEActivation.SILU):
    """The launcher, as TritonExperts calls it: the custom op on fresh buffers."""
    num_slots = ids.numel()
    output = torch.empty_like(x)
    fused_experts_triton(
        output, x, experts["w13"], experts["w2"], weights, ids, activation=activation,
        params=resolve_params(activation, None),
        workspace13=torch.empty(num_slots, x.shape[1], dtype=x.dtype, device=x.device),
        workspace2=torch.empty(num_slots, experts["w2"].shape[2], dtype=x.dtype, device=x.device),
        w13_bias=experts["w13_bias"], w2_bias=experts["w2_bias"], dtype_key=str(x.dtype)[6:],
    )  # fmt: skip
    return output


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_op_traces_under_torch_compile():
    experts = _experts(E, H, I, dtype=torch.float32, bias=True)
    x = torch.randn(11, H, device=DEVICE)
    weights, ids = _routing(11, E, 2, empty=0.1)

    def op(x, weights, ids):
        return _call_op(x * 0.5, experts, weights, ids) + 1

    torch._dynamo.reset()
    compiled = torch.compile(op, backend="aot_eager", fullgraph=True)
    assert_close(compiled(x, weights, ids), op(x, weights, ids))
    assert_close(compiled(x, weights, ids), _run(x * 0.5, experts, weights, ids, "torch") + 1)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize("entry", ["fused_experts", "layer"])
def test_fused_experts_fullgraph(entry):
    """fused_experts and FusedMoE with the triton backend compile in one graph: the id range
    check is skipped while tracing, the backend choice is host code, the op is opaque."""
    experts = _experts(E, H, I, dtype=torch.float32)
    x = torch.randn(11, H, device=DEVICE)
    weights, ids = _routing(11, E, 2)
    torch._dynamo.reset()
    if entry == "layer":
        layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32, device=DEVICE, backend="triton")
        layer.requires_grad_(False)  # an inference forward: the triton backend has no backward
        logits = torch.randn(11, E, device=DEVICE)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        assert_close(compiled(x, logits), layer(x, logits))
        return

    def moe(x, weights, ids):
        return _run(x, experts, weights, ids, "triton")

    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    assert_close(compiled(x, weights, ids), moe(x, weights, ids))


# ---------------------------------------------------------------------------------------------
# kernel configs: override, heuristic, tuned tables
# ---------------------------------------------------------------------------------------------
def _nan_padded(t: torch.Tensor) -> torch.Tensor:
    """t as a view of a buffer with NaN past its last dimension: a K-tail read that is not
    masked turns the output NaN."""
    buf = torch.full((*t.shape[:-1], t.shape[-1] + 64), float("nan"), dtype=t.dtype,
                     device=t.device)  # fmt: skip
    buf[..., : t.shape[-1]] = t
    return buf[..., : t.shape[-1]]


# (block_m, gemm1, gemm2): K tails (H = 80, I = 48 are not multiples of block_k 32), N tails
OVERRIDES = [
    MoEKernelConfig(32, GemmConfig(32, 32, 2, 4, 2), GemmConfig(16, 32, 1, 4, 1)),
    MoEKernelConfig(16, GemmConfig(16, 16, 1, 2, 1), GemmConfig(64, 64, 4, 4, 2)),
    MoEKernelConfig(64, GemmConfig(64, 128, 8, 4, 3), GemmConfig(128, 16, 8, 8, 2)),
]


@pytest.mark.parametrize(
    ("config", "activation"),
    [(OVERRIDES[0], "silu"), (OVERRIDES[1], "swigluoai"), (OVERRIDES[2], "gelu_no_mul")],
    ids=["bm32_bk32", "bm16_bk16_interleaved", "bm64_bk128_non_gated"],
)
def test_config_override_gives_the_same_result(config, activation):
    experts = {k: None if v is None else _nan_padded(v) for k, v in
               _experts(E, 80, I, activation, dtype=torch.float32, bias=True).items()}  # fmt: skip
    x = _nan_padded(torch.randn(19, 80, device=DEVICE))
    weights, ids = _routing(19, E, 2, empty=0.1)
    with use_moe_kernel_config(config):
        assert moe_kernel_config(19, 2, E, 2 * I, 80, I, "float32", None) is config
        out = _run(x, experts, weights, ids, "triton", activation=activation)
    assert moe_kernel_config(19, 2, E, 2 * I, 80, I, "float32", None) != config
    assert_close(out, _run(x, experts, weights, ids, "torch", activation=activation))


def test_config_override_fp8_block():
    x, experts, qc, _ = _quantized("fp8_block")
    weights, ids = _routing(13, 4, 2)
    config = MoEKernelConfig(32, GemmConfig(128, 128, 1, 4, 2), GemmConfig(32, 128, 4, 4, 2))
    with use_moe_kernel_config(config):
        out, ref = _both(x, experts, weights, ids, quant_config=qc)
    assert_close(out, ref, torch.bfloat16, **QUANT_TOL)


@pytest.mark.parametrize("activation", ["silu", "swigluoai", "gelu_tanh"])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_unfused_activation_matches_fused(activation, use_ue8m0):
    """fuse_activation=False: GEMM1 stores h and the act + group quant kernel makes a2 (gelu_tanh
    has no such kernel: it stays fused, with a 64-wide gemm1 tile widened to a whole group)."""
    num_tokens, num_experts, hidden, inter = 21, 4, 256, 192  # I = 192: a partial group
    experts = _experts(num_experts, hidden, inter, activation, dtype=torch.float32)
    w13, w2, qc = quantize_experts(experts["w13"], experts["w2"], "fp8_block", use_ue8m0=use_ue8m0)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = _routing(num_tokens, num_experts, 2)

    def run(backend):
        return fused_experts(
            x, w13, w2, weights, ids, activation=activation, quant_config=qc, backend=backend
        )

    fused = run("triton")
    unfused_config = MoEKernelConfig(
        32, GemmConfig(64, 128, 2, 4, 2), GemmConfig(64, 128, 2, 4, 2), fuse_activation=False
    )
    with use_moe_kernel_config(unfused_config):
        unfused = run("triton")
    assert_close(unfused, run("torch"), torch.bfloat16, **QUANT_TOL)
    assert_close(unfused, fused, torch.bfloat16, tol=1e-2, what="unfused vs fused")


def test_override_is_checked():
    bad = MoEKernelConfig(24, GemmConfig(32, 32, 1, 4, 2), GemmConfig(32, 32, 1, 4, 2))
    with pytest.raises(ValueError, match="powers of two"), use_moe_kernel_config(bad):
        pass
    # group_m 0 would divide by zero in the launch order; no stages, no pipeline
    for gemm1, gemm2 in ((GemmConfig(32, 32, 0, 4, 2), GemmConfig(32, 32, 1, 4, 2)),
                         (GemmConfig(32, 32, 1, 4, 2), GemmConfig(32, 32, 8, 4, 0))):  # fmt: skip
        bad = MoEKernelConfig(32, gemm1, gemm2)
        with pytest.raises(ValueError, match="group_m and num_stages"):
            bad.check()
        with pytest.raises(ValueError, match=r"table \[64\]: gemm. group_m"):
            MoEKernelConfig.from_json(bad.to_json(), "table [64]")


@pytest.mark.parametrize("scheme", [None, "fp8_block"])
def test_launch_order_changes_no_bit(scheme):
    """group_m only orders the programs: 1, a group that leaves a partial last group, the
    shipped 8 and the columns-first 1024 give the same bits, under a routing where one expert
    takes every token (its rows span many row blocks) and under a spread one."""
    num_tokens, num_experts, hidden, inter = 37, 6, 256, 128
    experts = _experts(num_experts, hidden, inter, dtype=torch.bfloat16)
    kwargs, w13, w2 = {}, experts["w13"], experts["w2"]
    if scheme is not None:
        w13, w2, kwargs["quant_config"] = quantize_experts(w13.float(), w2.float(), scheme)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    weights, spread = _routing(num_tokens, num_experts, 2)
    other = torch.randint(0, num_experts - 1, (num_tokens,), device=DEVICE)
    hot = torch.stack([torch.full_like(other, 2), other + (other >= 2)], 1).to(torch.int32)
    gemm2_n = 64 if scheme is None else 128
    outs = {}
    for routing_ids in (hot, spread):  # expert 2 in every token's top 2; spread
        for group_m in (1, 3, 8, 1024):  # 11 row blocks of 16: groups of 3 leave 2
            config = MoEKernelConfig(
                16, GemmConfig(128, 128 if scheme else 64, group_m, 4, 2),
                GemmConfig(gemm2_n, 128 if scheme else 64, group_m, 4, 2),
            )  # fmt: skip
            for retain in (False, True):  # a tile never computed must not read as stale
                for buf in shared_workspaces(retain).buffers.values():
                    if buf.is_floating_point():
                        poison_(buf)
            with use_moe_kernel_config(config):
                outs[group_m] = fused_experts(
                    x, w13, w2, weights, routing_ids, backend="triton", **kwargs
                )
        for group_m, out in outs.items():
            assert_equal(out, outs[8], what=f"group_m {group_m}")
        ref = fused_experts(x, w13, w2, weights, routing_ids, backend="torch", **kwargs)
        tol = {} if scheme is None else QUANT_TOL
        assert_close(outs[8], ref, torch.bfloat16, **tol)


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


HEURISTIC_DTYPES = ["bfloat16", "float16", "float32", "fp8_tensor", "fp8_channel", "fp8_block",
                    "int8"]  # fmt: skip


@pytest.mark.parametrize("preset", list(PRESETS))
def test_heuristic_configs_are_valid(preset):
    spec = PRESETS[preset]
    gemm1_rows = MoEActivation(spec.activation).gemm1_out_size(spec.intermediate_size)
    for num_local in (spec.num_experts, spec.num_experts // 8):  # one rank, 8-way EP
        for tokens in (1, 2, 7, 16, 33, 64, 200, 1000, 4096, 16384):
            for dtype in HEURISTIC_DTYPES:
                where = (num_local, tokens, dtype)
                config = heuristic_config(tokens, spec.top_k, num_local, spec.hidden_size,
                                          spec.intermediate_size, dtype)  # fmt: skip
                config.check()
                assert config.block_m in (16, 32, 64, 128), where
                for gemm in (config.gemm1, config.gemm2):
                    assert _power_of_two(gemm.block_n) and gemm.block_n >= 16, where
                    assert _power_of_two(gemm.block_k) and gemm.block_k >= 16, where
                    assert gemm.group_m >= 1 and gemm.num_stages >= 1, where
                    assert _power_of_two(gemm.num_warps), where
                if dtype == "fp8_block":  # whole 128 x 128 weight blocks and a2 groups
                    assert config.gemm1.block_n % 128 == 0, where
                    assert config.gemm1.block_k == config.gemm2.block_k == 128, where
                # the table lookup falls back to it when no table exists
                assert moe_kernel_config(tokens, spec.top_k, num_local, gemm1_rows,
                                         spec.hidden_size, spec.intermediate_size, dtype,
                                         None) == config  # fmt: skip


def test_heuristic_grows_block_m_with_tokens():
    block_ms = [heuristic_config(m, 8, 128, 2048, 768, "bfloat16").block_m
                for m in (1, 64, 512, 4096, 16384)]  # fmt: skip
    assert block_ms == sorted(block_ms) and block_ms[0] == 16 and block_ms[-1] == 128


def _entry(block_m: int, block_n: int = 64) -> dict:
    return MoEKernelConfig(
        block_m, GemmConfig(block_n, 64, 8, 4, 3), GemmConfig(128, 64, 8, 4, 3)
    ).to_json()


DEVICE_NAME = "NVIDIA H100 80GB HBM3"  # spaces: sanitised in the file name


def _write_table(root, content, e=8, n=2 * I, k=H, dtype="bfloat16"):
    path = table_path(root, DEVICE_NAME, e, n, k, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_tuned_table_nearest_m(tmp_path, monkeypatch):
    monkeypatch.setenv(mc.TUNED_CONFIGS_ENV, str(tmp_path))
    path = _write_table(tmp_path, {"1": _entry(16), "64": _entry(32), "1024": _entry(128)})
    assert " " not in path.parent.name and path.name == f"E=8,N={2 * I},K={H},dtype=bfloat16.json"

    def lookup(tokens, dtype="bfloat16", device_name=DEVICE_NAME, e=8):
        return moe_kernel_config(tokens, 2, e, 2 * I, H, I, dtype, device_name)

    assert lookup(1).block_m == 16
    assert lookup(20).block_m == 16
    assert lookup(40).block_m == 32
    assert lookup(544).block_m == 32  # halfway between 64 and 1024: the smaller M
    assert lookup(545).block_m == 128
    assert lookup(10**6).block_m == 128
    assert lookup(64) == MoEKernelConfig.from_json(_entry(32), "entry")
    # another dtype, expert count or device, or the interpreter (no name): the heuristic
    for other in (lookup(64, "float16"), lookup(64, e=4), lookup(64, device_name="Other GPU"),
                  lookup(64, device_name=None)):  # fmt: skip
        assert other != lookup(64)
    assert lookup(64, device_name=None) == heuristic_config(64, 2, 8, H, I, "bfloat16")
    # the scoped override wins over the table
    config = MoEKernelConfig(64, GemmConfig(32, 32, 1, 4, 2), GemmConfig(32, 32, 1, 4, 2))
    with use_moe_kernel_config(config):
        assert lookup(64) is config


def test_tuned_table_from_the_environment_only(tmp_path, monkeypatch):
    _write_table(tmp_path, {"1": _entry(64)})
    monkeypatch.delenv(mc.TUNED_CONFIGS_ENV, raising=False)
    assert moe_kernel_config(1, 2, 8, 2 * I, H, I, "bfloat16", DEVICE_NAME).block_m == 16
    monkeypatch.setenv(mc.TUNED_CONFIGS_ENV, str(tmp_path))
    assert moe_kernel_config(1, 2, 8, 2 * I, H, I, "bfloat16", DEVICE_NAME).block_m == 64


MALFORMED = {
    "not_json": "{'1': oops",
    "empty": {},
    "a_list": [_entry(16)],
    "key_not_a_count": {"many": _entry(16)},
    "missing_gemm2": {"1": {"block_m": 16, "gemm1": _entry(16)["gemm1"]}},
    "missing_field": {"1": {**_entry(16), "gemm1": {"block_n": 64, "block_k": 64}}},
    "not_a_number": {"1": {**_entry(16), "block_m": "big"}},
    "block_m_not_a_power_of_two": {"1": _entry(48)},
    "block_m_too_small": {"1": _entry(8)},
    "block_n_not_a_power_of_two": {"1": _entry(16, block_n=96)},
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_tables_raise(case, tmp_path, monkeypatch):
    monkeypatch.setenv(mc.TUNED_CONFIGS_ENV, str(tmp_path))
    path = _write_table(tmp_path, MALFORMED[case])
    with pytest.raises(ValueError, match=path.name.replace("(", r"\(")):
        moe_kernel_config(1, 2, 8, 2 * I, H, I, "bfloat16", DEVICE_NAME)


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernels at the presets' sizes, CUDA graphs, torch.compile, the layer
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [None, "fp8_block"])
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"])
def test_gpu_presets_match_torch_backend(preset, scheme):
    """The tables' entries at the presets' sizes (mixtral-8x7b's M = 256 and 1024 launch their
    columns first, or in groups of 32 and 64 row blocks, on an H100)."""
    spec, x, experts, weights, ids, qc = preset_problem(preset, 1000, scheme)
    tol = {} if qc is None else QUANT_TOL
    kwargs = dict(activation=spec.activation, quant_config=qc)
    for num_tokens in (1, 64, 256, 1000):
        assert num_tokens * spec.top_k <= 8192  # the torch backend's float64 stays small
        args = (x[:num_tokens], experts, weights[:num_tokens], ids[:num_tokens])
        out = _run(*args, "triton", **kwargs)
        assert out.is_cuda and out.shape == (num_tokens, spec.hidden_size)
        ref = _run(*args, "torch", **kwargs)
        assert_close(out, ref, torch.bfloat16, what=f"M = {num_tokens}", **tol)


def _sync_run(*args, **kwargs):
    out = _run(*args, **kwargs)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [None, "fp8_block"])
def test_gpu_cuda_graph_replay(scheme):
    spec, x, experts, weights, ids, qc = preset_problem("qwen3-30b-a3b", 64, scheme)
    eager = _sync_run(x, experts, weights, ids, "triton", quant_config=qc)
    static_ids = ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        _run(x, experts, weights, static_ids, "triton", quant_config=qc)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(x, experts, weights, static_ids, "triton", quant_config=qc)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(captured, eager, what="replay")
    # new routing written in place: the replay follows it (no host-side copy of the ids)
    new_ids = torch.rand(64, spec.num_experts, device="cuda").argsort(1)[:, : spec.top_k]
    static_ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    expected = _sync_run(x, experts, weights, static_ids, "triton", quant_config=qc)
    assert_equal(captured, expected, what="replay with new ids")
    tol = {} if qc is None else QUANT_TOL
    reference = _run(x, experts, weights, static_ids, "torch", quant_config=qc)
    assert_close(captured, reference, torch.bfloat16, **tol)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_gpu_torch_compile():
    """Inductor: the custom op, and fused_experts around it, each in one graph."""
    spec, x, experts, weights, ids, _ = preset_problem("qwen3-30b-a3b", 64, None)

    def op(x, weights, ids):
        return _call_op(x * 0.5, experts, weights, ids) + 1

    def moe(x, weights, ids):
        return _run(x * 0.5, experts, weights, ids, "triton") + 1

    torch._dynamo.reset()
    compiled_op = torch.compile(op, fullgraph=True)
    compiled_moe = torch.compile(moe, fullgraph=True)
    new_ids = torch.rand(64, spec.num_experts, device="cuda").argsort(1)[:, : spec.top_k].int()
    for routing in (ids, new_ids):  # same shapes, new routing: no stale specialisation
        eager = moe(x, weights, routing)
        assert_close(compiled_op(x, weights, routing), eager, torch.bfloat16)
        assert_close(compiled_moe(x, weights, routing), eager, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_layer_picks_triton(monkeypatch):
    spec = PRESETS["qwen3-30b-a3b"].scaled(4)
    layer = spec.build(dtype=torch.bfloat16, device="cuda")
    choice = layer.backend_choice()
    assert choice.name == "triton", choice.explain()
    assert layer.backend_choice(requires_grad=True).name == "triton"  # training: GPU kernels
    calls = []
    real_apply = TritonExperts.apply

    def spy(self, *args, **kwargs):
        calls.append(1)
        real_apply(self, *args, **kwargs)

    monkeypatch.setattr(TritonExperts, "apply", spy)
    x = torch.randn(37, spec.hidden_size, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(37, spec.num_experts, device="cuda")
    with torch.inference_mode():
        out = layer(x, logits)
        assert calls, "the layer did not run the triton backend"
        layer.set_backend("torch")
        assert_close(out, layer(x, logits), torch.bfloat16)
