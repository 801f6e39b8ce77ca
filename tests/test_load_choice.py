"""The choice between the triton backend and deep_gemm's contiguous-layout engines made from
the routing: kernels.load_choice (the flags, against their torch twin), DeepGemmExperts.apply
branching on them inside a CUDA graph, and on the host where EP dispatch counted each expert.

On the CPU: the flags kernel on the interpreter, the branching with a stand-in graph (both
branches are captured, so both run there: what is checked is which flag guards which path), and
the gated pair of calls not captured (each path's gate: closed, it writes nothing; open, the
ungated bits). On a Hopper GPU (`gpu` marker): one captured graph replayed with spread and
concentrated routings, and eager calls, give the triton backend's output, then the wgmma
engine's, bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusedmoe import fused_experts
from fusedmoe.experts import deep_gemm
from fusedmoe.experts.deep_gemm import (
    ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT,
    WGMMA_MIN_SLOTS_PER_EXPERT,
    DeepGemmExperts,
)
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.kernels.load_choice import engine_flags, engine_flags_torch
from fusedmoe.kernels.moe_config import moe_kernel_config, use_moe_kernel_config
from tests.helpers import assert_close, assert_equal, quant_tol, random_routing, run_experts
from tests.test_wgmma_gemm import E, _problem, no_library, pretend_hopper  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter on padding
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _concentrated(num_tokens, num_experts, top_k, hot_experts, device=DEVICE):
    """ids [M, k]: each token's k distinct experts drawn among the first `hot_experts`."""
    ids = torch.rand(num_tokens, hot_experts).argsort(dim=1)[:, :top_k]
    perm = torch.randperm(num_experts)[:hot_experts]  # which experts are hot
    return perm[ids].to(torch.int32).to(device)


# (tokens, k, local experts, hot experts or None for spread, with an expert map)
FLAG_CASES = [
    (0, 2, 4, None, False),  # no token: nothing touched
    (1, 1, 4, None, False),
    (50, 1, 1, None, False),  # one local expert
    (40, 6, 6, 6, True),  # k = E: every token on every expert
    (37, 3, 8, None, False),
    (37, 3, 8, 3, True),
    (300, 8, 64, None, False),  # 2400 slots: the counting launch, then the choice
    (300, 8, 64, 8, False),
    (1030, 2, 16, 2, True),
    (513, 4, 256, 6, False),
]


@pytest.mark.parametrize(("num_tokens", "top_k", "num_local", "hot", "use_map"), FLAG_CASES)
@pytest.mark.parametrize("min_per_expert", [1, 40, 140])
def test_engine_flags_match_twin(num_tokens, top_k, num_local, hot, use_map, min_per_expert):
    num_ids = 2 * num_local if use_map else num_local
    if hot is None:
        _, ids = random_routing(num_tokens, num_ids, top_k, empty=0.1, device=DEVICE)
    else:
        ids = _concentrated(num_tokens, num_ids, top_k, hot)
    if ids.numel():
        ids[0, 0] = num_ids + 3  # out of range: counts nowhere, as in the alignment
    expert_map = None
    if use_map:  # this rank holds every other expert
        local = torch.full((num_ids,), -1, dtype=torch.int32)
        local[1::2] = torch.arange(num_local, dtype=torch.int32)
        expert_map = local.to(DEVICE)
    got = engine_flags(ids, num_local, min_per_expert, expert_map)
    want = engine_flags_torch(ids, num_local, min_per_expert, expert_map)
    assert_equal(got, want, what="flags")
    assert int(got[0]) + int(got[1]) == 1


def test_engine_flags_at_the_threshold():
    """routed >= min * touched, exactly: two experts holding 2 * 140 slots -> engine; one slot
    fewer -> not; no slot routed here -> not (nothing touched)."""
    t = ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT
    ids = torch.tensor([[0, 3]] * t, dtype=torch.int32, device=DEVICE)
    engine, triton = (torch.tensor(v, dtype=torch.uint8, device=DEVICE) for v in ([1, 0], [0, 1]))
    assert_equal(engine_flags(ids, 8, t), engine, what="2 x 140 slots")
    ids[-1, 1] = -1
    assert_equal(engine_flags(ids, 8, t), triton, what="one slot fewer")
    assert_equal(engine_flags(torch.full_like(ids, -1), 8, t), triton, what="nothing touched")


_TOKENS, _BRANCH_MIN = 40, 30


def _small_gates(monkeypatch):
    """No gate: the branch for the tests' small experts and calls (the shipped gates,
    DEVICE_CHOICE_MIN_TOKENS and DEVICE_CHOICE_MIN_EXPERT_WEIGHTS, are for the presets')."""
    monkeypatch.setattr(deep_gemm, "DEVICE_CHOICE_MIN_TOKENS", 1)
    monkeypatch.setattr(deep_gemm, "DEVICE_CHOICE_MIN_EXPERT_WEIGHTS", 0)


class _StandInGraph:
    """What DeepGemmExperts asks of a capturing torch.cuda.CUDAGraph, recorded."""

    def __init__(self, log):
        self.log = log

    def begin_capture_to_if_node(self, flag):
        assert flag.dtype == torch.bool and flag.dim() == 0
        self.log.append(("if", bool(flag)))

    def end_capture_to_conditional_node(self):
        self.log.append(("end",))


@pytest.fixture
def branch_log(monkeypatch, pretend_hopper):  # noqa: F811
    """The calls of auto's deep_gemm seen as if captured into a graph that can branch: the
    flags guarding each branch, the engine's GEMMs (the stand-in's calls) and triton's runs."""
    log = []
    monkeypatch.setattr(deep_gemm, "_device_choice_graph", lambda x: _StandInGraph(log))
    _small_gates(monkeypatch)
    # small calls on the interpreter: 40 tokens of top-2 over E = 4, the engine from 30 slots
    # per expert touched (spread: 20; on 2 experts: 40)
    monkeypatch.setattr(deep_gemm, "ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT", _BRANCH_MIN)
    real_apply = TritonExperts.apply
    monkeypatch.setattr(
        TritonExperts, "apply", lambda self, call: log.append(("triton",)) or real_apply(self, call)
    )
    return log, pretend_hopper


@pytest.mark.parametrize("concentrated", [False, True], ids=["spread", "concentrated"])
def test_auto_branches_on_the_flags(branch_log, concentrated):
    """Below WGMMA_MIN_SLOTS_PER_EXPERT on the mean, a captured call holds both paths: the
    engine's behind the first flag, triton's behind the second, the flags those of the ids."""
    log, calls = branch_log
    tokens = _TOKENS  # k = 2, E = 4: 20 slots per expert on the mean
    assert tokens * 2 / E < min(WGMMA_MIN_SLOTS_PER_EXPERT, _BRANCH_MIN)
    x, w13, w2, weights, ids, qc = _problem(tokens)
    if concentrated:
        ids = _concentrated(tokens, E, 2, 2, device="cpu")  # 40 slots on each of 2 experts
    run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    engine = concentrated  # spread: 20 per expert touched, < 30
    assert log == [("if", engine), ("end",), ("if", not engine), ("triton",), ("end",)]
    assert len(calls) == 2  # the engine's two GEMMs, captured in the first branch


@pytest.mark.parametrize("gate", ["tokens", "expert_weights"])
def test_auto_does_not_branch_below_its_gates(branch_log, monkeypatch, gate):
    """Fewer tokens than DEVICE_CHOICE_MIN_TOKENS, or experts smaller than
    DEVICE_CHOICE_MIN_EXPERT_WEIGHTS: the call runs on triton without a branch (the branch
    would cost more than the engine could win), however concentrated its routing; at the
    gate, the branch."""
    log, calls = branch_log
    tokens = _TOKENS
    x, w13, w2, weights, _, qc = _problem(tokens)
    per_expert = w13[0].numel() + w2[0].numel()
    name, at_gate = {
        "tokens": ("DEVICE_CHOICE_MIN_TOKENS", tokens),
        "expert_weights": ("DEVICE_CHOICE_MIN_EXPERT_WEIGHTS", per_expert),
    }[gate]
    ids = _concentrated(tokens, E, 2, 2, device="cpu")
    monkeypatch.setattr(deep_gemm, name, at_gate)  # at the gate: the branch
    run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert log[0] == ("if", True) and len(calls) == 2
    log.clear(), calls.clear()
    monkeypatch.setattr(deep_gemm, name, at_gate + 1)  # one below it: none
    out = run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert log == [("triton",)] and calls == []
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **quant_tol("cpu"))


def test_no_branch_where_the_library_runs(branch_log, monkeypatch):
    """Where the DeepGEMM library runs the call, the host's choice stands (no branch): the
    library's kernels are never captured in a conditional node's body."""
    log, calls = branch_log
    monkeypatch.setattr(DeepGemmExperts, "library_reason", lambda self, *args: None)
    x, w13, w2, weights, _, qc = _problem(_TOKENS)
    ids = _concentrated(_TOKENS, E, 2, 2, device="cpu")
    run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert log == [("triton",)] and calls == []


def test_the_shipped_gates_keep_the_large_expert_presets_only():
    """DEVICE_CHOICE_MIN_EXPERT_WEIGHTS sits between the presets measured with and without a
    gain from the branch (the constant's comment)."""
    from fusedmoe.activation import MoEActivation
    from fusedmoe.tools.presets import PRESETS

    def weights(name):
        p = PRESETS[name]
        return p.hidden_size * p.intermediate_size + p.hidden_size * MoEActivation(
            p.activation
        ).gemm1_out_size(p.intermediate_size)

    gate = deep_gemm.DEVICE_CHOICE_MIN_EXPERT_WEIGHTS
    assert weights("deepseek-v3") >= gate and weights("gpt-oss-120b") >= gate
    assert weights("qwen3-235b-a22b") < gate and weights("qwen3-30b-a3b") < gate


def test_a_failing_branch_is_not_swallowed(branch_log, monkeypatch):
    """A body that raises still closes its conditional node (the capture can end), and the
    error reaches the caller; so does a conditional node refused: no silent fallback once a
    branch is captured."""
    log, _ = branch_log
    x, w13, w2, weights, _, qc = _problem(_TOKENS)
    ids = _concentrated(_TOKENS, E, 2, 2, device="cpu")

    def broken(self, call):
        log.append(("triton",))
        raise RuntimeError("a kernel refused")

    monkeypatch.setattr(TritonExperts, "apply", broken)
    with pytest.raises(RuntimeError, match="a kernel refused"):
        run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert log == [("if", True), ("end",), ("if", False), ("triton",), ("end",)]

    def refuse_second(self, flag):
        if any(entry[0] == "if" for entry in log):
            raise RuntimeError("no second node")
        log.append(("if", bool(flag)))

    log.clear()
    monkeypatch.setattr(_StandInGraph, "begin_capture_to_if_node", refuse_second)
    with pytest.raises(RuntimeError, match="no second node"):
        run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert log == [("if", True), ("end",)]


def test_the_branch_reads_the_expert_map(branch_log):
    """Under EP (this rank: experts E..2E-1 of 2E) the flags count this rank's experts only:
    slots concentrated on them -> the engine; the same slots on the other rank's -> nothing
    touched here, triton."""
    log, _ = branch_log
    x, w13, w2, weights, _, qc = _problem(_TOKENS)
    expert_map = torch.cat([torch.full((E,), -1), torch.arange(E)]).int()
    kwargs = dict(expert_map=expert_map, global_num_experts=2 * E)
    here = _concentrated(_TOKENS, E, 2, 2, device="cpu") + E
    run_experts(DeepGemmExperts(), x, w13, w2, weights, here, qc, **kwargs)
    assert log[0] == ("if", True)
    log.clear()
    run_experts(DeepGemmExperts(), x, w13, w2, weights, here - E, qc, **kwargs)
    assert log[0] == ("if", False)


def test_by_name_and_forced_engines_never_branch(branch_log):
    log, calls = branch_log
    x, w13, w2, weights, ids, qc = _problem(_TOKENS)
    run_experts(DeepGemmExperts(strict=True), x, w13, w2, weights, ids, qc)
    assert log == [] and len(calls) == 2
    run_experts(DeepGemmExperts(engine="wgmma"), x, w13, w2, weights, ids, qc)
    assert log == [] and len(calls) == 4  # the engine named: no hand-off, no branch
    run_experts(DeepGemmExperts(engine="triton"), x, w13, w2, weights, ids, qc)
    assert ("if", True) not in log and ("if", False) not in log


@pytest.mark.parametrize("per_expert", [ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT - 1,
                                        ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT])  # fmt: skip
@pytest.mark.parametrize("library", [False, True], ids=["wgmma", "library"])
def test_dispatch_counts_choose_on_the_host(pretend_hopper, monkeypatch, per_expert, library):  # noqa: F811
    """With EP dispatch's per-expert counts on the host the same rule runs there: tokens
    each on experts 0 and 1, so that the slots per expert touched are `per_expert`: the engine
    from ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT, triton below (and wherever the library would
    run the call: the rule was measured on the wgmma engine)."""
    from fusedmoe.modular.types import ActivationSpec, ExpertsCall, ExpertTokensMeta, ExpertWeights
    from fusedmoe.quant.kernels import per_token_group_quant_fp8_triton

    tokens = per_expert
    x, w13, w2, weights, _, qc = _problem(tokens)
    ids = torch.tensor([[0, 1]] * tokens, dtype=torch.int32)
    if library:
        monkeypatch.setattr(DeepGemmExperts, "library_reason", lambda self, *args: None)
    counts = torch.bincount(ids.flatten().long(), minlength=E).to(torch.int32)
    experts = DeepGemmExperts()
    act = ActivationSpec()
    shapes = experts.workspace_shapes(tokens, w13.shape[1], w13.shape[2], 2, E, E, act.kind)
    a1q, a1s = per_token_group_quant_fp8_triton(x, 128)
    out = torch.full((tokens, w13.shape[2]), float("nan"), dtype=torch.bfloat16)
    call = ExpertsCall(
        output=out, hidden_states=a1q, weights=ExpertWeights(w13, w2), topk_weights=weights,
        topk_ids=ids, activation=act, global_num_experts=E,
        workspace13=torch.empty(shapes.workspace13, dtype=torch.bfloat16),
        workspace2=torch.empty(shapes.workspace2, dtype=torch.bfloat16), quant_config=qc,
        a1q_scale=a1s, expert_tokens_meta=ExpertTokensMeta(counts, counts),
    )  # fmt: skip
    experts.apply(call)
    engine = per_expert >= ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT and not library
    assert len(pretend_hopper) == (2 if engine else 0)
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **quant_tol("cpu"))


# ---------------------------------------------------------------------------------------------
# CPU: the choice on the GPU without conditional nodes (eager calls, other captures, torches
# without the nodes): both paths run, each gated by its flag
# ---------------------------------------------------------------------------------------------
def _gated_run(path, gate, x, w13, w2, weights, ids, qc):
    """One path on x quantized as prepare does, into a NaN output and NaN workspaces: the
    triton backend ("triton"; "triton_unfused": GEMM1 leaves the activation to its own
    kernel), or the contiguous layout on the wgmma engine (the stand-in: "wgmma"), on its
    Triton GEMMs ("contiguous_triton") or on the library ("contiguous"); gate None, or uint8
    [1]."""
    from fusedmoe.kernels.deep_gemm_moe import fused_experts_deep_gemm
    from fusedmoe.modular.types import ActivationSpec, ExpertsCall, ExpertWeights
    from fusedmoe.quant.kernels import per_token_group_quant_fp8_triton

    tokens, top_k = ids.shape
    triton_path = path.startswith("triton")
    experts = TritonExperts() if triton_path else DeepGemmExperts()
    act = ActivationSpec()
    shapes = experts.workspace_shapes(tokens, w13.shape[1], w13.shape[2], top_k, E, E, act.kind)
    a1q, a1s = per_token_group_quant_fp8_triton(x, 128)
    out = torch.full((tokens, w13.shape[2]), float("nan"), dtype=torch.bfloat16)
    ws13 = torch.full(shapes.workspace13, float("nan"), dtype=torch.bfloat16)
    ws2 = torch.full(shapes.workspace2, float("nan"), dtype=torch.bfloat16)
    if triton_path:
        call = ExpertsCall(
            output=out, hidden_states=a1q, weights=ExpertWeights(w13, w2), topk_weights=weights,
            topk_ids=ids, activation=act, global_num_experts=E, workspace13=ws13,
            workspace2=ws2, quant_config=qc, a1q_scale=a1s,
        )  # fmt: skip
        if path == "triton_unfused":
            config = moe_kernel_config(tokens, top_k, E, w13.shape[1], w13.shape[2],
                                       w2.shape[2], "fp8_w8a8_block", None)  # fmt: skip
            with use_moe_kernel_config(dataclasses.replace(config, fuse_activation=False)):
                TritonExperts().apply(call, gate=gate)
        else:
            TritonExperts().apply(call, gate=gate)
    else:
        fused_experts_deep_gemm(
            out, a1q, a1s, w13, w2, qc.w1.scale, qc.w2.scale, weights.float(), ids,
            scheme="fp8_block", activation=act, workspace13=ws13, workspace2=ws2,
            engine={"contiguous_triton": "triton"}.get(path, path), gate=gate,
        )  # fmt: skip
    return out, ws13, ws2


@pytest.mark.parametrize("path", ["triton", "triton_unfused", "wgmma", "contiguous_triton"])
def test_a_gate_writes_all_or_nothing(pretend_hopper, path):  # noqa: F811
    """A closed gate (0): the output and the workspaces keep their NaN (no kernel of the path
    wrote a row: the permute, the GEMMs, the activation, the sum); an open one (1): the
    ungated call's bits."""
    x, w13, w2, weights, ids, qc = _problem(_TOKENS)
    ungated, _, _ = _gated_run(path, None, x, w13, w2, weights, ids, qc)
    assert not ungated.isnan().any()
    opened, _, _ = _gated_run(path, torch.ones(1, dtype=torch.uint8), x, w13, w2, weights,
                              ids, qc)  # fmt: skip
    assert_equal(opened, ungated, what=f"{path}, gate open")
    closed = _gated_run(path, torch.zeros(1, dtype=torch.uint8), x, w13, w2, weights, ids, qc)
    for name, t in zip(("the output", "workspace13", "workspace2"), closed, strict=True):
        assert t.isnan().all(), f"{path}: a closed gate wrote into {name}"


def test_a_gate_is_refused_where_it_cannot_hold(pretend_hopper, monkeypatch):  # noqa: F811
    """The library's GEMMs read no count of rows in use, and one token takes no alignment: a
    gate there is a ValueError, not a path that computes all the same."""
    from fusedmoe.kernels import deep_gemm_moe

    x, w13, w2, weights, ids, qc = _problem(_TOKENS)
    monkeypatch.setattr(deep_gemm_moe, "_library", lambda: pytest.fail("the library ran"))
    gate = torch.ones(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="gated call runs on our GEMMs"):
        _gated_run("contiguous", gate, x, w13, w2, weights, ids, qc)
    with pytest.raises(ValueError, match="needs the aligned rows"):
        _gated_run("triton", gate, x[:1], w13, w2, weights[:1], ids[:1], qc)


@pytest.fixture
def gated_pair(monkeypatch, pretend_hopper):  # noqa: F811
    """auto's deep_gemm with no graph that can branch and the gates open for the tests' small
    calls: the gate each triton run got, and the engine's GEMMs (the stand-in's calls)."""
    _small_gates(monkeypatch)
    monkeypatch.setattr(deep_gemm, "ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT", _BRANCH_MIN)
    gates = []
    real_apply = TritonExperts.apply

    def apply(self, call, gate=None):
        gates.append(None if gate is None else gate.tolist())
        return real_apply(self, call, gate=gate)

    monkeypatch.setattr(TritonExperts, "apply", apply)
    return gates, pretend_hopper


@pytest.mark.parametrize("concentrated", [False, True], ids=["spread", "concentrated"])
def test_uncaptured_calls_run_both_paths_gated(gated_pair, concentrated):
    """Not captured (eager), a call within the gates runs both paths: the engine's behind the
    first flag, triton's behind the second; the output is the flagged path's, bit for bit, and
    near the torch backend."""
    gates, calls = gated_pair
    x, w13, w2, weights, ids, qc = _problem(_TOKENS)
    if concentrated:
        ids = _concentrated(_TOKENS, E, 2, 2, device="cpu")  # 40 slots on each of 2 experts
    out = run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    engine = concentrated  # spread: 20 slots per expert touched, < 30
    assert gates == [[0 if engine else 1]]
    assert len(calls) == 2  # the engine's GEMMs are launched either way
    if engine:
        want = run_experts(DeepGemmExperts(strict=True, engine="wgmma"), x, w13, w2, weights,
                           ids, qc)  # fmt: skip
    else:
        want = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="triton")
    assert_equal(out, want, what="the flagged path")
    ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
    assert_close(out, ref, torch.bfloat16, **quant_tol("cpu"))


def test_uncaptured_calls_keep_the_hosts_choice_where_told(gated_pair, monkeypatch):
    """FUSEDMOE_LOAD_CHOICE=0, or below a gate: one path, the host's (triton), ungated."""
    gates, calls = gated_pair
    x, w13, w2, weights, _, qc = _problem(_TOKENS)
    ids = _concentrated(_TOKENS, E, 2, 2, device="cpu")
    monkeypatch.setenv(deep_gemm.LOAD_CHOICE_ENV, "0")
    run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert gates == [None] and calls == []
    monkeypatch.delenv(deep_gemm.LOAD_CHOICE_ENV)
    gates.clear()
    monkeypatch.setattr(deep_gemm, "DEVICE_CHOICE_MIN_TOKENS", _TOKENS + 1)
    run_experts(DeepGemmExperts(), x, w13, w2, weights, ids, qc)
    assert gates == [None] and calls == []


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
def _hopper_graph_branches():
    """A GPU the wgmma engine runs on. With conditional graph nodes in this torch, captured
    calls branch through them; without, both paths are captured, each gated by its flag."""
    from fusedmoe.kernels import wgmma_gemm

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    why = wgmma_gemm.gluon_unusable_reason(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("engine", "load_choice"),
    [("wgmma", "1"), ("wgmma", "0"), ("wgmma", "alloc_conf"), ("library", "1")],
)
def test_gpu_one_graph_follows_the_load(monkeypatch, engine, load_choice):
    """fused_experts (auto: deep_gemm, handing small calls to triton) captured once, replayed
    with a spread routing (100 slots per expert touched: triton) and a concentrated one (400 on
    each of 4 experts: the wgmma engine):
    each replay is that backend's output by name, bit for bit, and near the torch backend.
    Under the allocator setting torch refuses conditional nodes under, the gated pair.
    FUSEDMOE_LOAD_CHOICE=0, or the DeepGEMM library importable: triton for both (no
    branch)."""
    _hopper_graph_branches()
    from fusedmoe.kernels import deep_gemm_lib

    if engine == "wgmma":
        monkeypatch.setenv("FUSEDMOE_DEEP_GEMM", "0")
    deep_gemm_lib.find_library(refresh=True)
    try:
        _one_graph_follows_the_load(monkeypatch, engine, load_choice)
    finally:
        monkeypatch.delenv("FUSEDMOE_DEEP_GEMM", raising=False)
        deep_gemm_lib.find_library(refresh=True)


def _gpu_problem(hidden, inter):
    """16 experts of fp8_block weights, 400 tokens of top-4: x, w13, w2, the quant config,
    router weights, a spread routing (100 slots per expert touched) and a concentrated one
    (400 on each of 4 experts)."""
    from fusedmoe.quant import quantize_experts
    from tests.reference import random_experts

    num_experts, top_k, tokens = 16, 4, 400
    experts = random_experts(num_experts, hidden, inter, "silu", dtype=torch.bfloat16)
    w13, w2, qc = quantize_experts(experts["w13"].cuda(), experts["w2"].cuda(), "fp8_block")
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    weights, spread = random_routing(tokens, num_experts, top_k, device="cuda")
    hot = _concentrated(tokens, num_experts, top_k, 4)
    return x, w13, w2, qc, weights, spread, hot


def _one_graph_follows_the_load(monkeypatch, engine, load_choice):
    from fusedmoe.kernels import deep_gemm_lib

    why = deep_gemm_lib.library_unusable_reason(torch.device("cuda"))
    if engine == "library" and why is not None:
        pytest.skip(why)
    if load_choice == "alloc_conf":  # torch refuses conditional nodes with it: gated pair
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "graph_capture_record_stream_reuse:True")
    else:
        monkeypatch.setenv(deep_gemm.LOAD_CHOICE_ENV, load_choice)
    _small_gates(monkeypatch)
    x, w13, w2, qc, weights, spread, hot = _gpu_problem(512, 384)
    assert engine_flags(spread, 16, ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT).tolist() == [0, 1]
    assert engine_flags(hot, 16, ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT).tolist() == [1, 0]
    static_ids = spread.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: the host's choice (triton) compiles
        fused_experts(x, w13, w2, weights, static_ids, quant_config=qc)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the engine's kernels may first compile here
        out = fused_experts(x, w13, w2, weights, static_ids, quant_config=qc)
    by_name = {
        "triton": lambda ids: fused_experts(x, w13, w2, weights, ids, quant_config=qc,
                                            backend="triton"),
        "engine": lambda ids: run_experts(DeepGemmExperts(strict=True, engine=engine), x, w13,
                                          w2, weights, ids, qc),
    }  # fmt: skip
    for ids in (spread, hot, spread):  # the library's kernels are never captured in a branch
        chosen = "engine" if ids is hot and load_choice != "0" and engine == "wgmma" else "triton"
        static_ids.copy_(ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(out, by_name[chosen](ids), what=chosen)
        ref = fused_experts(x, w13, w2, weights, ids, quant_config=qc, backend="torch")
        assert_close(out, ref, torch.bfloat16, **quant_tol("cuda"))


@pytest.mark.gpu
def test_gpu_many_branching_calls_in_one_graph(monkeypatch, no_library):  # noqa: F811
    """20 calls captured into one graph (40 conditional nodes: more bodies than torch's pool
    has streams, so the pool comes round to the capture's own stream): each call's output is
    the engine's for a concentrated routing."""
    _hopper_graph_branches()
    _small_gates(monkeypatch)
    x, w13, w2, qc, weights, _, hot = _gpu_problem(256, 256)
    fused_experts(x, w13, w2, weights, hot, quant_config=qc)  # compiles the host's choice
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fused_experts(x, w13, w2, weights, hot, quant_config=qc) for _ in range(20)]
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = run_experts(DeepGemmExperts(strict=True, engine="wgmma"), x, w13, w2, weights, hot, qc)
    for out in outs:
        assert_equal(out, want, what="a branching call of the graph")


@pytest.mark.gpu
def test_gpu_the_layers_own_graphs_follow_the_load(monkeypatch, no_library):  # noqa: F811
    """The layer replays its eager calls from CUDA graphs of its own (one per token bucket):
    the graph of bucket 256 holds the branch, and its replays run triton for spread router
    logits and the engine for logits that send every token to experts 0-3 (rows 200-255 of the
    bucket keep the first call's concentrated inputs)."""
    _hopper_graph_branches()
    _small_gates(monkeypatch)
    from fusedmoe import FusedMoE

    layer = FusedMoE(16, 4, 512, 384, params_dtype=torch.bfloat16, device="cuda")
    layer.quantize_("fp8_block")
    x = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    spread = torch.randn(256, 16, device="cuda")
    hot = spread.clone()
    hot[:, :4] += 30.0
    with torch.inference_mode():
        layer(x, hot)  # captures bucket 256; its rows 200-255 stay concentrated
        graphed = {"spread": layer(x[:200], spread[:200]), "hot": layer(x[:200], hot[:200])}
        assert layer._graph_state is not None and layer._graph_state[1].replays >= 2
        layer.cuda_graph_max_tokens = 0  # eager, each backend by name
        layer.set_backend("triton")
        spread_triton = layer(x[:200], spread[:200])
        layer.set_backend("deep_gemm")
        hot_engine = layer(x[:200], hot[:200])
    assert_close(graphed["spread"], spread_triton, torch.bfloat16, **quant_tol("cuda"))
    assert_equal(graphed["hot"], hot_engine, what="the engine, from the layer's graph")


@pytest.mark.gpu
def test_gpu_eager_calls_follow_the_load(monkeypatch, no_library):  # noqa: F811
    """Eager calls (no graph): both paths launched, each gated by its flag, with no host sync;
    the output is triton's by name for a spread routing and the engine's for a concentrated
    one, bit for bit."""
    _hopper_graph_branches()
    _small_gates(monkeypatch)
    x, w13, w2, qc, weights, spread, hot = _gpu_problem(512, 384)
    for ids, by_name in (
        (spread, lambda: fused_experts(x, w13, w2, weights, spread, quant_config=qc,
                                       backend="triton")),
        (hot, lambda: run_experts(DeepGemmExperts(strict=True, engine="wgmma"), x, w13, w2,
                                  weights, hot, qc)),
    ):  # fmt: skip
        fused_experts(x, w13, w2, weights, ids, quant_config=qc)  # compiles both paths
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fused_experts(x, w13, w2, weights, ids, quant_config=qc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_equal(out, by_name(), what="the flagged path")
