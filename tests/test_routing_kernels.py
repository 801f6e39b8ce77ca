"""The fused routing kernels (fusedmoe.router.fused) against their torch twins
(fusedmoe.router.topk.topk_route, fusedmoe.router.grouped.grouped_topk), and the routers'
choice between them.

Without a GPU the kernels run on Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes here are small; the `gpu` tests at the end run the compiled
kernels at DeepSeek-V3 sizes. Legend: M tokens, E experts, k top-k, G expert groups.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from fusedmoe.router import (
    ScoringFunc,
    compute_scores,
    create_router,
    fused_routing_on_interpreter,
    grouped_topk,
    topk_route,
    use_fused_routing,
)
from fusedmoe.router import fused as routing
from fusedmoe.router.fused import fused_grouped_topk, fused_topk
from tests.helpers import assert_close, assert_equal, poison_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
# torch's CPU exp and the interpreter's (numpy) agree to an ulp; a GPU's exp is ex2.approx
WEIGHT_TOL = 1e-6 if DEVICE == "cpu" else 4e-6

# (M, E, k, routed_scaling_factor): odd M, E not a power of two, k in (1, 2, 8, E)
TOPK_SHAPES = [
    (1, 8, 1, 1.0),
    (7, 8, 8, 2.5),
    (37, 60, 2, 1.0),
    (7, 60, 60, 1.0),
    (37, 128, 8, 2.5),
    (1, 128, 2, 1.0),
    (37, 256, 8, 2.5),
    (1, 256, 1, 1.0),
]  # k == E == 256: test_k_equals_wide_e (256 rounds are slow on the interpreter)
# (M, E, G, topk_group, k, routed_scaling_factor)
GROUPED_SHAPES = [
    (37, 64, 8, 3, 8, 2.5),  # DeepSeek-V3, scaled down
    (7, 256, 8, 4, 8, 2.5),  # DeepSeek-V3
    (1, 256, 8, 4, 8, 1.0),
    (37, 60, 4, 2, 8, 1.0),  # groups of 15: padded lanes inside every group
    (7, 12, 3, 1, 4, 1.0),  # k == the experts of the one kept group
    (7, 16, 16, 5, 4, 1.0),  # groups of one expert: the top-2 group score is the max
    (7, 8, 8, 8, 8, 1.0),  # every group kept, k == E
    (7, 6, 1, 1, 3, 1.0),  # a single group: plain top-k
]


# --------------------------------------------------------------------------------------------
# builders and checks


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """Every kernel output starts as NaN weights and out-of-range ids: a slot left unwritten
    fails the comparison."""
    alloc = routing._alloc_outputs

    def poisoned(logits, top_k):
        weights, ids = alloc(logits, top_k)
        return poison_(weights), ids.fill_(-7)

    monkeypatch.setattr(routing, "_alloc_outputs", poisoned)


def random_logits(num_tokens: int, num_experts: int, dtype=torch.float32) -> torch.Tensor:
    """Fresh random logits [M, E] on DEVICE, no two equal in a row (top-k has one answer): in
    low precision a random order of values at least a rounding step apart."""
    x = 2.0 * torch.randn(num_tokens, num_experts)
    if dtype != torch.float32:
        step = 4.0 / num_experts
        ranks = x.argsort(dim=1).argsort(dim=1).float()
        x = (ranks - num_experts / 2) * step + 0.25 * step * torch.rand(num_tokens, num_experts)
        x = x.to(dtype)
        assert not x.sort(dim=1).values.diff(dim=1).eq(0).any(), "test logits tie"
    return x.to(DEVICE)


def random_bias(num_experts: int) -> torch.Tensor:
    return (0.1 * torch.randn(num_experts)).to(DEVICE)


def check_routing(weights, ids, ref_weights, ref_ids, *, what: str = "") -> None:
    """float32 weights and int32 ids; ids exactly, weights within WEIGHT_TOL."""
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32, (weights.dtype, ids.dtype)
    assert_equal(ids, ref_ids, what=f"topk_ids {what}")
    assert_close(weights, ref_weights, tol=WEIGHT_TOL, what=f"topk_weights {what}")


def check_ids_valid(ids: torch.Tensor, num_experts: int) -> None:
    """ids in [0, E) and distinct per token (the expert kernels index with them)."""
    ids = ids.cpu()
    assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < num_experts), ids
    for row in ids.tolist():
        assert len(set(row)) == len(row), f"repeated expert in {row}"


def twin_kwargs(scoring, renormalize, bias, scale):
    return dict(
        scoring=ScoringFunc(scoring),
        renormalize=renormalize,
        e_score_correction_bias=bias,
        routed_scaling_factor=scale,
    )


@contextlib.contextmanager
def count_launches(monkeypatch):
    """Counts the launches of the routing kernel (in a one-element list)."""
    calls = [0]
    launch = routing._launch

    def counted(*args):
        calls[0] += 1
        return launch(*args)

    monkeypatch.setattr(routing, "_launch", counted)
    yield calls


# --------------------------------------------------------------------------------------------
# 1. the kernels against the twins


@pytest.mark.parametrize("num_tokens, num_experts, top_k, scale", TOPK_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_fused_topk_matches_twin(
    scoring, renormalize, with_bias, num_tokens, num_experts, top_k, scale
):
    logits = random_logits(num_tokens, num_experts)
    bias = random_bias(num_experts) if with_bias else None
    kwargs = twin_kwargs(scoring, renormalize, bias, scale)
    check_routing(*fused_topk(logits, top_k, **kwargs), *topk_route(logits, top_k, **kwargs))


@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_k_equals_wide_e(with_bias):
    logits = random_logits(7, 256)
    bias = random_bias(256) if with_bias else None
    kwargs = twin_kwargs("softmax", True, bias, 1.0)
    check_routing(*fused_topk(logits, 256, **kwargs), *topk_route(logits, 256, **kwargs))


@pytest.mark.parametrize(
    "num_tokens, num_experts, groups, topk_group, top_k, scale", GROUPED_SHAPES
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_fused_grouped_topk_matches_twin(
    scoring, renormalize, with_bias, num_tokens, num_experts, groups, topk_group, top_k, scale
):
    logits = random_logits(num_tokens, num_experts)
    bias = random_bias(num_experts) if with_bias else None
    kwargs = twin_kwargs(scoring, renormalize, bias, scale)
    check_routing(
        *fused_grouped_topk(logits, top_k, groups, topk_group, **kwargs),
        *grouped_topk(logits, top_k, groups, topk_group, **kwargs),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_low_precision_logits(scoring, with_bias, dtype):
    """bf16 / fp16 logits are scored in float32, as by the twins."""
    logits = random_logits(37, 64, dtype)
    bias = random_bias(64) if with_bias else None
    kwargs = twin_kwargs(scoring, True, bias, 2.5)
    check_routing(*fused_topk(logits, 6, **kwargs), *topk_route(logits, 6, **kwargs))
    check_routing(
        *fused_grouped_topk(logits, 8, 8, 3, **kwargs), *grouped_topk(logits, 8, 8, 3, **kwargs)
    )


def test_strided_logits_and_bias():
    """Non-contiguous logits (a column slice) and bias (a strided view)."""
    wide = random_logits(37, 128)
    logits = wide[:, ::2]
    bias = random_bias(128)[::2]
    kwargs = twin_kwargs("sigmoid", True, bias, 1.0)
    check_routing(*fused_topk(logits, 4, **kwargs), *topk_route(logits, 4, **kwargs))
    check_routing(
        *fused_grouped_topk(logits, 4, 8, 2, **kwargs), *grouped_topk(logits, 4, 8, 2, **kwargs)
    )


@pytest.mark.parametrize("num_experts", [8, 256])
def test_zero_tokens_launch_nothing(num_experts, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for M = 0")

    monkeypatch.setattr(routing, "_route_kernel", no_launch)
    logits = random_logits(0, num_experts)
    for weights, ids in (fused_topk(logits, 2), fused_grouped_topk(logits, 2, 4, 2)):
        assert weights.shape == ids.shape == (0, 2)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
        assert weights.device == ids.device == logits.device


# --------------------------------------------------------------------------------------------
# 2. non-finite logits (numpy warns of the NaN the interpreter computes, as the twin does)

NUMPY_NAN_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@NUMPY_NAN_WARNINGS
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_neg_inf_logits(scoring, renormalize, with_bias):
    """Rows with 0 .. E -inf logits. A -inf expert is never chosen while a finite one is left;
    with fewer than k finite, the finite ones come first (as in the twin), then distinct -inf
    experts (the twin's choice among those ties is torch.topk's), whose weight is 0."""
    num_tokens, num_experts, top_k = 37, 60, 8
    finite = [num_experts, num_experts - 1, 30, top_k + 1, top_k, top_k - 1, 3, 1, 0]
    finite = torch.tensor((finite * num_tokens)[:num_tokens])
    order = torch.rand(num_tokens, num_experts).argsort(dim=1)
    masked = order >= finite[:, None]  # [M, E]: -inf where True
    logits = random_logits(num_tokens, num_experts).masked_fill(masked.to(DEVICE), float("-inf"))
    bias = None
    if with_bias:  # lifts some -inf experts' scores (0) far above the finite ones without it
        bias = random_bias(num_experts)
        bias[torch.randperm(num_experts)[: num_experts // 4]] += 10.0
    kwargs = twin_kwargs(scoring, renormalize, bias, 1.0)
    weights, ids = fused_topk(logits, top_k, **kwargs)
    ref_weights, ref_ids = topk_route(logits, top_k, **kwargs)

    check_ids_valid(ids, num_experts)
    assert_close(weights, ref_weights, tol=WEIGHT_TOL, what="topk_weights")
    chosen_masked = masked.gather(1, ids.long().cpu())  # [M, k]
    for m in range(num_tokens):
        f = min(int(finite[m]), top_k)
        assert not chosen_masked[m, :f].any() and chosen_masked[m, f:].all(), (m, ids[m])
        assert_equal(ids[m, :f], ref_ids[m, :f], what=f"the finite experts of row {m}")


@NUMPY_NAN_WARNINGS
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_neg_inf_logits_grouped(scoring, with_bias):
    """Half of each group -inf (the kept groups hold k finite experts): exactly the twin. Then
    rows with fewer finite experts than k: valid ids, the finite experts of the kept groups
    before any -inf one."""
    num_tokens, num_experts, groups, topk_group, top_k = 37, 64, 8, 3, 8
    size = num_experts // groups
    masked = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    for m in range(num_tokens):
        for g in range(groups):
            masked[m, g * size + torch.randperm(size)[: size // 2]] = True
    bias = None
    if with_bias:
        bias = random_bias(num_experts)
        bias[torch.randperm(num_experts)[: num_experts // 4]] += 10.0
    kwargs = twin_kwargs(scoring, True, bias, 1.0)
    logits = random_logits(num_tokens, num_experts).masked_fill(masked.to(DEVICE), float("-inf"))
    weights, ids = fused_grouped_topk(logits, top_k, groups, topk_group, **kwargs)
    assert not masked.gather(1, ids.long().cpu()).any(), "a -inf expert was chosen"
    check_routing(weights, ids, *grouped_topk(logits, top_k, groups, topk_group, **kwargs))

    sparse = torch.rand(num_tokens, num_experts) < 0.9  # about 6 finite experts per row
    sparse[0] = True  # no finite expert at all
    logits = random_logits(num_tokens, num_experts).masked_fill(sparse.to(DEVICE), float("-inf"))
    weights, ids = fused_grouped_topk(logits, top_k, groups, topk_group, **kwargs)
    check_ids_valid(ids, num_experts)
    chosen_masked = sparse.gather(1, ids.long().cpu()).int()
    assert (chosen_masked.diff(dim=1) >= 0).all(), "a -inf expert before a finite one"


@NUMPY_NAN_WARNINGS
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("grouped", [False, True], ids=["topk", "grouped"])
def test_nan_logits(grouped, scoring, renormalize):
    """A NaN logit ranks first (as in torch.topk) and makes its token's weights NaN; a row of
    NaN still gets distinct ids in range; other tokens are unaffected."""
    num_tokens, num_experts, top_k, bad, all_nan = 37, 64, 8, 11, 20
    logits = random_logits(num_tokens, num_experts)
    expert = int(torch.randint(0, num_experts, ()))
    logits[bad, expert] = float("nan")
    logits[all_nan] = float("nan")
    bias = random_bias(num_experts)
    kwargs = twin_kwargs(scoring, renormalize, bias, 1.0)
    if grouped:
        weights, ids = fused_grouped_topk(logits, top_k, 8, 3, **kwargs)
        ref_weights, ref_ids = grouped_topk(logits, top_k, 8, 3, **kwargs)
    else:
        weights, ids = fused_topk(logits, top_k, **kwargs)
        ref_weights, ref_ids = topk_route(logits, top_k, **kwargs)
    check_ids_valid(ids, num_experts)
    if scoring != "softmax":  # (softmax: the whole row is NaN)
        assert int(ids[bad, 0]) == expert == int(ref_ids[bad, 0])
    assert weights[bad].isnan().any() and weights[all_nan].isnan().any()
    if renormalize or scoring == "softmax":
        assert weights[bad].isnan().all() and weights[all_nan].isnan().all()
    good = torch.ones(num_tokens, dtype=torch.bool, device=DEVICE)
    good[[bad, all_nan]] = False
    check_routing(weights[good], ids[good], ref_weights[good], ref_ids[good], what="clean rows")


# --------------------------------------------------------------------------------------------
# 3. the routers: fused on CUDA (and on the interpreter when asked), torch otherwise

ROUTER_KINDS = {
    "topk": (dict(), topk_route),
    "bias": (dict(e_score_correction_bias=True), topk_route),
    "grouped": (dict(use_grouped_topk=True, num_expert_group=8, topk_group=3), grouped_topk),
    "grouped_bias": (
        dict(use_grouped_topk=True, num_expert_group=8, topk_group=3, e_score_correction_bias=True),
        grouped_topk,
    ),
    "zero": (dict(zero_expert_num=4, zero_expert_type="identity"), topk_route),
}


def fused_on_this_device():
    return fused_routing_on_interpreter() if DEVICE == "cpu" else contextlib.nullcontext()


@pytest.mark.parametrize("kind", list(ROUTER_KINDS))
def test_routers_route_in_one_launch(kind, monkeypatch):
    options, twin = ROUTER_KINDS[kind]
    num_logits = 64 + options.get("zero_expert_num", 0)
    bias = random_bias(num_logits) if "e_score_correction_bias" in options else None
    options = dict(options, e_score_correction_bias=bias)
    router = create_router(8, 64, scoring_func="sigmoid", routed_scaling_factor=2.5, **options)
    logits = random_logits(37, num_logits, torch.bfloat16)
    x = torch.randn(37, 16, device=DEVICE)
    with count_launches(monkeypatch) as launches, fused_on_this_device():
        weights, ids = router.select_experts(x, logits)
    assert launches == [1]
    group_args = (8, 3) if twin is grouped_topk else ()
    ref = twin(logits, 8, *group_args, **twin_kwargs("sigmoid", True, bias, 2.5))
    check_routing(weights, ids, *ref)


@pytest.mark.skipif(DEVICE != "cpu", reason="CUDA logits always take the fused path")
def test_cpu_routing_stays_on_torch_by_default(monkeypatch):
    logits = random_logits(5, 8)
    assert not use_fused_routing(logits)
    with fused_routing_on_interpreter():
        assert use_fused_routing(logits)
        assert not use_fused_routing(logits.double())  # float64: the twin's dtype
    assert not use_fused_routing(logits)
    with count_launches(monkeypatch) as launches:
        create_router(2, 8).select_experts(torch.randn(5, 16), logits)
    assert launches == [0]


def test_hash_routing_is_not_fused(monkeypatch):
    table = torch.stack([torch.randperm(8)[:2] for _ in range(11)])
    router = create_router(2, 8, hash_indices_table=table)
    input_ids = torch.randint(0, 11, (5,), device=DEVICE)
    with count_launches(monkeypatch) as launches, fused_on_this_device():
        router.select_experts(torch.randn(5, 16, device=DEVICE), random_logits(5, 8), input_ids)
    assert launches == [0]


def test_custom_op_registration():
    """Schema, fake (meta) implementation and dispatch of both ops, as torch.compile uses them."""
    logits, bias = random_logits(7, 16), random_bias(16)
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(
        routing._fused_topk_op, (logits, 4, "sigmoid", True, bias, 2.5), test_utils=tests
    )
    torch.library.opcheck(
        routing._fused_grouped_topk_op,
        (logits, 4, 4, 2, "softmax", False, None, 1.0),
        test_utils=tests,
    )


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_router_traces_under_torch_compile(monkeypatch):
    bias = random_bias(64)
    router = create_router(
        8, 64, scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=8, topk_group=3,
        e_score_correction_bias=bias, routed_scaling_factor=2.5,
    )  # fmt: skip
    x, logits = torch.randn(7, 16, device=DEVICE), random_logits(7, 64)
    with count_launches(monkeypatch) as launches, fused_on_this_device():
        compiled = torch.compile(router.select_experts, backend="aot_eager", fullgraph=True)
        got = compiled(x, logits)
    assert launches == [1]
    check_routing(*got, *grouped_topk(logits, 8, 8, 3, **twin_kwargs("sigmoid", True, bias, 2.5)))


# --------------------------------------------------------------------------------------------
# 4. bad input: a clear error before any kernel runs

BAD_INPUT = [
    (dict(logits="float64"), TypeError, "logits must have dtype in"),
    (dict(logits="1d"), ValueError, "logits must have 2 dimensions"),
    (dict(top_k=9), ValueError, r"top_k \(9\) must be <= the number of experts \(8\)"),
    (dict(top_k=0), ValueError, "top_k must be >= 1"),
    (dict(bias="short"), ValueError, r"e_score_correction_bias must have shape \(8,\)"),
    (dict(renormalize=1), TypeError, "renormalize must be a bool"),
    (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor must be a positive"),
    (dict(scoring="relu"), ValueError, "unknown scoring_func 'relu'"),
]  # fmt: skip


@pytest.mark.parametrize("bad, error, match", BAD_INPUT)
def test_bad_input(bad, error, match, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched on bad input")

    monkeypatch.setattr(routing, "_route_kernel", no_launch)
    logits = {"float64": random_logits(5, 8).double(), "1d": random_logits(1, 8)[0]}.get(
        bad.get("logits"), random_logits(5, 8)
    )
    bias = random_bias(7) if bad.get("bias") == "short" else None
    kwargs = dict(
        scoring=bad.get("scoring", "softmax"),
        renormalize=bad.get("renormalize", True),
        e_score_correction_bias=bias,
        routed_scaling_factor=bad.get("routed_scaling_factor", 1.0),
    )
    with pytest.raises(error, match=match):
        fused_topk(logits, bad.get("top_k", 2), **kwargs)
    with pytest.raises(error, match=match):
        fused_grouped_topk(logits, bad.get("top_k", 2), 4, 2, **kwargs)


def test_bad_groups():
    with pytest.raises(ValueError, match="must be divisible by num_expert_group"):
        fused_grouped_topk(random_logits(5, 8), 2, 3, 1)
    with pytest.raises(ValueError, match=r"must be <= the experts in the kept groups"):
        fused_grouped_topk(random_logits(5, 8), 5, 4, 2)


# --------------------------------------------------------------------------------------------
# 5. GPU: compiled kernels at model sizes, under torch.compile and CUDA graphs


def ambiguous_rows(logits, bias, scoring, top_k, rel=2e-6):
    """Rows whose top 4k choices hold two within `rel` of each other: a GPU's approximate exp
    (a few 1e-7 relative) may order them either way."""
    scores = compute_scores(logits, ScoringFunc(scoring))
    choice = scores if bias is None else scores + bias
    top = choice.topk(min(4 * top_k, choice.shape[1]), dim=1).values
    gaps = (top[:, :-1] - top[:, 1:]).abs() <= rel * top[:, :-1].abs()
    return gaps.any(dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 129, 4099])
@pytest.mark.parametrize(
    "num_experts, groups, topk_group, top_k",
    # from 128 experts a row a program; below, rows of 128 logits (mixtral's 8, qwen2's 60)
    [(256, 8, 4, 8), (512, 1, 1, 10), (128, 1, 1, 128), (384, 12, 4, 8), (8, 1, 1, 2),
     (60, 1, 1, 4)],
)  # fmt: skip
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_gpu_matches_twin(scoring, with_bias, num_experts, groups, topk_group, top_k, num_tokens):
    logits = random_logits(num_tokens, num_experts, torch.bfloat16)
    bias = random_bias(num_experts) if with_bias else None
    kwargs = twin_kwargs(scoring, True, bias, 2.5)
    if groups > 1:
        got = fused_grouped_topk(logits, top_k, groups, topk_group, **kwargs)
        ref = grouped_topk(logits, top_k, groups, topk_group, **kwargs)
    else:
        got, ref = fused_topk(logits, top_k, **kwargs), topk_route(logits, top_k, **kwargs)
    check_ids_valid(got[1], num_experts)
    clear = ~ambiguous_rows(logits, bias, scoring, top_k)
    assert clear.float().mean() > 0.8
    check_routing(got[0][clear], got[1][clear], ref[0][clear], ref[1][clear])


@pytest.mark.gpu
def test_gpu_router_under_compile_and_cuda_graph():
    bias = random_bias(256)
    router = create_router(
        8, 256, scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=8, topk_group=4,
        e_score_correction_bias=bias, routed_scaling_factor=2.5,
    )  # fmt: skip
    x, logits = torch.randn(64, 16, device=DEVICE), random_logits(64, 256)
    eager = router.select_experts(x, logits)
    compiled = torch.compile(router.select_experts, fullgraph=True)(x, logits)
    check_routing(*compiled, *eager)
    router.select_experts(x, logits)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = router.select_experts(x, logits)
    logits.copy_(random_logits(64, 256))
    graph.replay()
    check_routing(*captured, *router.select_experts(x, logits))
