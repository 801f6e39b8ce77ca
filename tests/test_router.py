"""Router tests: every router kind against the per-token loop references of the package,
hypothesis properties checked against independent float64 computations, the factory's
priority order, zero experts, routing simulation, non-finite logits and bad input.

Legend: M tokens, E experts (Z zero experts), k top-k, G expert groups, H hidden.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedmoe.router.grouped as grouped_module
import fusedmoe.router.topk as topk_module
from fusedmoe.router import (
    BiasedTopKRouter,
    CustomRoutingRouter,
    GroupedTopKRouter,
    RoutingSimulatorRouter,
    ScoringFunc,
    TopKRouter,
    ZeroExpertRouter,
    ZeroExpertType,
    create_router,
    grouped_topk_ref,
    hash_route_ref,
    split_zero_experts,
    topk_route_ref,
)
from fusedmoe.router.simulation import ENV_VAR, STRATEGIES
from tests.helpers import assert_close, assert_equal, poison_

HIDDEN = 16
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
NUM_TOKENS = (0, 1, 37)
LOW_PRECISION = (torch.bfloat16, torch.float16)

# (E, k, routed_scaling_factor): k == E, one expert (a dense FFN), DeepSeek-like scaling
TOPK_SHAPES = [(8, 2, 1.0), (64, 6, 2.5), (5, 5, 1.0), (1, 1, 0.5)]
# (E, G, topk_group, k, routed_scaling_factor)
GROUPED_SHAPES = [
    (16, 4, 2, 4, 1.0),
    (64, 8, 3, 8, 2.5),  # DeepSeek-V3 shape, scaled down
    (12, 3, 1, 4, 1.0),  # k == every expert of the one kept group
    (8, 8, 8, 8, 1.0),  # one expert per group, all groups kept, k == E
    (6, 1, 1, 3, 1.0),  # a single group: plain top-k
]
# (E, k, vocab, routed_scaling_factor)
HASH_SHAPES = [(8, 2, 11, 1.0), (6, 6, 3, 1.0), (32, 4, 50, 2.5)]


# --------------------------------------------------------------------------------------------
# builders and independent computations


def random_logits(
    num_tokens: int, num_experts: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Fresh random logits [M, E] with no two equal in a row, so top-k has one right answer.

    randn rounded to 8 or 11 mantissa bits would tie; in low precision the row is a random
    order of values a rounding step apart at least.
    """
    x = torch.randn(num_tokens, num_experts)
    if dtype == torch.float32:
        return x
    step = 4.0 / num_experts
    ranks = x.argsort(dim=1).argsort(dim=1).float()
    jitter = 0.25 * step * torch.rand(num_tokens, num_experts)
    logits = ((ranks - num_experts / 2) * step + jitter).to(dtype)
    assert not logits.sort(dim=1).values.diff(dim=1).eq(0).any(), "test logits tie"
    return logits


def random_bias(num_experts: int) -> torch.Tensor:
    return 0.1 * torch.randn(num_experts)


def random_hash_table(vocab: int, num_experts: int, top_k: int, dtype=torch.int64):
    """[vocab, k]: k distinct experts per row."""
    rows = [torch.randperm(num_experts)[:top_k] for _ in range(vocab)]
    return torch.stack(rows).to(dtype)


def route(router, logits: torch.Tensor, input_ids: torch.Tensor | None = None):
    x = torch.randn(logits.shape[0], HIDDEN, dtype=logits.dtype)
    return router.select_experts(x, logits, input_ids)


def scores64(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The scoring functions from their definitions, in float64."""
    x = logits.double()
    if scoring == "softmax":
        e = torch.exp(x - x.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-x))
    return torch.sqrt(torch.log1p(torch.exp(x)))


def check_routing(weights, ids, ref_weights, ref_ids) -> None:
    """Routing convention (float32 / int32), ids exactly (as returned and as sets), weights."""
    assert weights.dtype == torch.float32, weights.dtype
    assert ids.dtype == torch.int32, ids.dtype
    assert_equal(ids, ref_ids, what="topk_ids")
    assert_equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values, what="topk_ids as sets")
    assert_close(weights, ref_weights, torch.float32, what="topk_weights")


def check_ids_valid(ids: torch.Tensor, num_experts: int) -> None:
    """ids in [0, E) and distinct per token."""
    if ids.numel() == 0:
        return
    assert int(ids.min()) >= 0 and int(ids.max()) < num_experts, ids
    for row in ids.tolist():
        assert len(set(row)) == len(row), f"repeated expert in {row}"


# --------------------------------------------------------------------------------------------
# 1. every router kind against the per-token references


@pytest.mark.parametrize("num_experts, top_k, scale", TOPK_SHAPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_topk_matches_reference(
    scoring, renormalize, with_bias, num_tokens, num_experts, top_k, scale
):
    logits = random_logits(num_tokens, num_experts)
    bias = random_bias(num_experts) if with_bias else None
    router = create_router(
        top_k,
        num_experts,
        renormalize=renormalize,
        scoring_func=scoring,
        e_score_correction_bias=bias,
        routed_scaling_factor=scale,
    )
    assert type(router) is (BiasedTopKRouter if with_bias else TopKRouter)
    weights, ids = route(router, logits)
    ref = topk_route_ref(
        logits,
        top_k,
        scoring=ScoringFunc(scoring),
        renormalize=renormalize,
        e_score_correction_bias=bias,
        routed_scaling_factor=scale,
    )
    check_routing(weights, ids, *ref)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_topk_low_precision_logits_computed_in_float32(scoring, with_bias, dtype):
    # The reference gets the logits upcast first: a router scoring in bf16/fp16 would miss the
    # float32 tolerance.
    logits = random_logits(37, 64, dtype)
    bias = random_bias(64) if with_bias else None
    router = create_router(
        6, 64, scoring_func=scoring, e_score_correction_bias=bias, routed_scaling_factor=2.5
    )
    ref = topk_route_ref(
        logits.float(),
        6,
        scoring=ScoringFunc(scoring),
        e_score_correction_bias=bias,
        routed_scaling_factor=2.5,
    )
    check_routing(*route(router, logits), *ref)


@pytest.mark.parametrize("num_experts, groups, topk_group, top_k, scale", GROUPED_SHAPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_grouped_topk_matches_reference(
    scoring, renormalize, with_bias, num_tokens, num_experts, groups, topk_group, top_k, scale
):
    logits = random_logits(num_tokens, num_experts)
    bias = random_bias(num_experts) if with_bias else None
    router = create_router(
        top_k,
        num_experts,
        renormalize=renormalize,
        scoring_func=scoring,
        use_grouped_topk=True,
        num_expert_group=groups,
        topk_group=topk_group,
        e_score_correction_bias=bias,
        routed_scaling_factor=scale,
    )
    assert type(router) is GroupedTopKRouter
    ref = grouped_topk_ref(
        logits,
        top_k,
        groups,
        topk_group,
        scoring=ScoringFunc(scoring),
        renormalize=renormalize,
        e_score_correction_bias=bias,
        routed_scaling_factor=scale,
    )
    check_routing(*route(router, logits), *ref)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_grouped_topk_low_precision_logits_computed_in_float32(scoring, with_bias, dtype):
    logits = random_logits(37, 64, dtype)
    bias = random_bias(64) if with_bias else None
    router = create_router(
        8,
        64,
        scoring_func=scoring,
        use_grouped_topk=True,
        num_expert_group=8,
        topk_group=3,
        e_score_correction_bias=bias,
        routed_scaling_factor=2.5,
    )
    ref = grouped_topk_ref(
        logits.float(),
        8,
        8,
        3,
        scoring=ScoringFunc(scoring),
        e_score_correction_bias=bias,
        routed_scaling_factor=2.5,
    )
    check_routing(*route(router, logits), *ref)


@pytest.mark.parametrize("num_experts, top_k, vocab, scale", HASH_SHAPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_hash_routing_matches_reference(
    scoring, renormalize, num_tokens, num_experts, top_k, vocab, scale
):
    table = random_hash_table(vocab, num_experts, top_k, torch.int32)
    input_ids = torch.randint(0, vocab, (num_tokens,))
    logits = random_logits(num_tokens, num_experts)
    router = create_router(
        top_k,
        num_experts,
        renormalize=renormalize,
        scoring_func=scoring,
        hash_indices_table=table,
        routed_scaling_factor=scale,
    )
    assert type(router) is BiasedTopKRouter
    ref = hash_route_ref(
        logits,
        input_ids,
        table,
        scoring=ScoringFunc(scoring),
        renormalize=renormalize,
        routed_scaling_factor=scale,
    )
    check_routing(*route(router, logits, input_ids), *ref)
    # and from the spec: the table's row, whatever the logits
    assert_equal(ref[1], table[input_ids].long(), what="hash ids")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("scoring", SCORINGS)
def test_hash_routing_low_precision_logits(scoring, dtype):
    table = random_hash_table(11, 8, 3)
    input_ids = torch.randint(0, 11, (37,), dtype=torch.int32)
    logits = random_logits(37, 8, dtype)
    router = create_router(3, 8, scoring_func=scoring, hash_indices_table=table)
    ref = hash_route_ref(logits.float(), input_ids, table, scoring=ScoringFunc(scoring))
    check_routing(*route(router, logits, input_ids), *ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_custom_routing_function(renormalize, num_tokens, dtype):
    """The function gets (hidden_states, gating_output, topk, renormalize); its weights are
    cast to float32 and scaled after it, its ids cast to int32."""
    num_experts, top_k, scale = 10, 3, 2.5
    calls = []

    def lowest_logits(hidden_states, gating_output, topk, renorm):
        # a rule no built-in router has: the k lowest logits, float64 weights 1 / (1 + rank)
        calls.append((hidden_states, gating_output, topk, renorm))
        ids = gating_output.float().topk(topk, dim=-1, largest=False).indices
        weights = 1.0 / torch.arange(1, topk + 1, dtype=torch.float64).expand(ids.shape)
        return weights, ids

    router = create_router(
        top_k,
        num_experts,
        renormalize=renormalize,
        custom_routing_function=lowest_logits,
        routed_scaling_factor=scale,
    )
    assert type(router) is CustomRoutingRouter
    x = torch.randn(num_tokens, HIDDEN, dtype=dtype)
    logits = random_logits(num_tokens, num_experts, dtype)
    weights, ids = router.select_experts(x, logits)

    assert len(calls) == 1
    got_x, got_logits, got_k, got_renorm = calls[0]
    assert got_x is x and got_logits is logits and got_k == top_k and got_renorm is renormalize
    expected_ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for m in range(num_tokens):
        row = logits[m].float().tolist()
        expected_ids[m] = torch.tensor(sorted(range(num_experts), key=lambda e: row[e])[:top_k])
    expected_weights = torch.tensor([scale / (1 + j) for j in range(top_k)]).expand(
        num_tokens, top_k
    )
    check_routing(weights, ids, expected_weights, expected_ids)


# --------------------------------------------------------------------------------------------
# 2. properties (hypothesis), against independent float64 computations

PROPERTY = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@st.composite
def routing_cases(draw, kinds=("topk", "bias", "grouped", "grouped_bias", "hash")):
    """A router kind, its shape and parameters, and a seed for the random tensors."""
    kind = draw(st.sampled_from(kinds))
    scoring = draw(st.sampled_from(SCORINGS))
    renormalize = draw(st.booleans())
    if kind.startswith("grouped"):
        groups = draw(st.sampled_from([1, 2, 4, 8]))
        group_size = draw(st.integers(1, 4))
        topk_group = draw(st.integers(1, groups))
        top_k = draw(st.integers(1, topk_group * group_size))
        num_experts = groups * group_size
    else:
        groups = topk_group = None
        num_experts = draw(st.integers(1, 40))
        top_k = draw(st.integers(1, num_experts))
    return dict(
        kind=kind,
        scoring=scoring,
        renormalize=renormalize,
        num_experts=num_experts,
        top_k=top_k,
        groups=groups,
        topk_group=topk_group,
        num_tokens=draw(st.integers(1, 24)),
        logit_scale=draw(st.sampled_from([0.1, 1.0, 4.0])),
        bias_scale=draw(st.sampled_from([0.01, 0.1, 1.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build_case(case):
    """-> (router, logits [M, E], bias or None, input_ids or None), from the case's seed."""
    gen = torch.Generator().manual_seed(case["seed"])
    num_tokens, num_experts, top_k = case["num_tokens"], case["num_experts"], case["top_k"]
    logits = case["logit_scale"] * torch.randn(num_tokens, num_experts, generator=gen)
    bias = table = input_ids = None
    if case["kind"] in ("bias", "grouped_bias"):
        bias = case["bias_scale"] * torch.randn(num_experts, generator=gen)
    if case["kind"] == "hash":
        vocab = 7
        table = torch.stack(
            [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(vocab)]
        )
        input_ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
    grouped = case["kind"].startswith("grouped")
    router = create_router(
        top_k,
        num_experts,
        renormalize=case["renormalize"],
        scoring_func=case["scoring"],
        use_grouped_topk=grouped,
        num_expert_group=case["groups"],
        topk_group=case["topk_group"],
        e_score_correction_bias=bias,
        hash_indices_table=table,
    )
    return router, logits, bias, input_ids


@PROPERTY
@given(routing_cases())
def test_property_ids_distinct_and_in_range(case):
    router, logits, _, input_ids = build_case(case)
    weights, ids = route(router, logits, input_ids)
    assert ids.shape == weights.shape == (case["num_tokens"], case["top_k"])
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    check_ids_valid(ids, case["num_experts"])


@PROPERTY
@given(routing_cases().map(lambda case: {**case, "renormalize": True}))
def test_property_renormalized_weights_sum_to_one(case):
    router, logits, _, input_ids = build_case(case)
    weights, _ = route(router, logits, input_ids)
    sums = weights.double().sum(dim=-1)
    assert_close(sums, torch.ones_like(sums), torch.float32, what="sum of weights")
    assert (weights > 0).all()


@PROPERTY
@given(routing_cases(kinds=("grouped", "grouped_bias")))
def test_property_grouped_picks_only_from_kept_groups(case):
    """Kept groups recomputed in float64 from the spec: a group's score is the sum of its top-2
    biased scores with a bias, else its max score; then the top-k biased scores in them."""
    router, logits, bias, _ = build_case(case)
    _, ids = route(router, logits)
    groups, size = case["groups"], case["num_experts"] // case["groups"]
    scores = scores64(logits, case["scoring"])
    choice = scores if bias is None else scores + bias.double()
    per_group = choice.view(-1, groups, size).sort(dim=-1, descending=True).values
    group_score = per_group[..., :2].sum(-1) if bias is not None else per_group[..., 0]
    kept = group_score.argsort(dim=-1, descending=True)[:, : case["topk_group"]]
    for m in range(case["num_tokens"]):
        kept_groups = set(kept[m].tolist())
        chosen = ids[m].tolist()
        assert {e // size for e in chosen} <= kept_groups, (chosen, kept_groups)
        candidates = [e for e in range(case["num_experts"]) if e // size in kept_groups]
        best = sorted(candidates, key=lambda e: -float(choice[m, e]))[: case["top_k"]]
        assert set(chosen) == set(best)


@PROPERTY
@given(routing_cases(kinds=("bias", "grouped_bias")))
def test_property_bias_selects_but_weights_are_unbiased_scores(case):
    router, logits, bias, _ = build_case(case)
    weights, ids = route(router, logits)
    scores = scores64(logits, case["scoring"])
    chosen = scores.gather(1, ids.long())
    expected = chosen / chosen.sum(-1, keepdim=True) if case["renormalize"] else chosen
    assert_close(weights, expected, torch.float32, what="weights vs unbiased scores")
    if case["kind"] == "bias":  # selection is the top-k of the biased scores
        best = (scores + bias.double()).topk(case["top_k"], dim=-1).indices
        assert_equal(ids.sort(dim=1).values, best.sort(dim=1).values, what="biased top-k")


@PROPERTY
@given(routing_cases(kinds=("bias",)))
def test_property_bias_changes_selection(case):
    """A bias far above any score difference forces its favourite experts, whatever the logits;
    the weights stay the unbiased scores."""
    gen = torch.Generator().manual_seed(case["seed"])
    num_experts, top_k = case["num_experts"], case["top_k"]
    favourites = torch.randperm(num_experts, generator=gen)[:top_k]
    bias = 0.01 * torch.randn(num_experts, generator=gen)
    bias[favourites] += 100.0
    logits = case["logit_scale"] * torch.randn(case["num_tokens"], num_experts, generator=gen)
    router = create_router(
        top_k,
        num_experts,
        renormalize=False,
        scoring_func=case["scoring"],
        e_score_correction_bias=bias,
    )
    weights, ids = route(router, logits)
    for row in ids.tolist():
        assert set(row) == set(favourites.tolist())
    assert_close(weights, scores64(logits, case["scoring"]).gather(1, ids.long()), torch.float32)


# --------------------------------------------------------------------------------------------
# 3. the factory: six kinds, priority order, warnings for what gets ignored

FACTORY_E, FACTORY_K, FACTORY_Z = 16, 4, 4
# (features given, router chosen, parameters reported as ignored)
FACTORY_CASES = [
    ((), TopKRouter, ()),
    (("bias",), BiasedTopKRouter, ()),
    (("hash",), BiasedTopKRouter, ()),
    (("custom",), CustomRoutingRouter, ()),
    (("custom", "bias"), CustomRoutingRouter, ("e_score_correction_bias",)),
    (("custom", "hash"), CustomRoutingRouter, ("hash_indices_table",)),
    (("grouped",), GroupedTopKRouter, ()),
    (("grouped", "bias"), GroupedTopKRouter, ()),
    (("grouped", "custom"), GroupedTopKRouter, ("custom_routing_function",)),
    (("grouped", "hash"), GroupedTopKRouter, ("hash_indices_table",)),
    (("grouped", "custom", "bias"), GroupedTopKRouter, ("custom_routing_function",)),
    (("zero",), ZeroExpertRouter, ()),
    (("zero", "bias"), ZeroExpertRouter, ()),
    (("zero", "grouped"), ZeroExpertRouter, ("use_grouped_topk",)),
    (("zero", "custom"), ZeroExpertRouter, ("custom_routing_function",)),
    (
        ("zero", "grouped", "custom", "hash"),
        ZeroExpertRouter,
        ("use_grouped_topk", "custom_routing_function", "hash_indices_table"),
    ),
    (("simulation",), RoutingSimulatorRouter, ()),
    (("simulation", "zero"), RoutingSimulatorRouter, ()),
    (
        ("simulation", "grouped", "custom", "bias"),
        RoutingSimulatorRouter,
        ("use_grouped_topk", "custom_routing_function", "e_score_correction_bias"),
    ),
]
ALL_IGNORABLE = (
    "use_grouped_topk",
    "custom_routing_function",
    "e_score_correction_bias",
    "hash_indices_table",
)


def sigmoid_of_top_logits(hidden_states, gating_output, topk, renormalize):
    """A custom function unlike any built-in: top-k of the logits, weights = sigmoid(logit)."""
    values, ids = gating_output.float().topk(topk, dim=-1)
    return torch.sigmoid(values), ids


def factory_kwargs(features) -> dict:
    num_logits = FACTORY_E + (FACTORY_Z if "zero" in features else 0)
    kwargs = {"scoring_func": "sigmoid"}
    if "bias" in features:
        kwargs["e_score_correction_bias"] = random_bias(num_logits)
    if "hash" in features:
        kwargs["hash_indices_table"] = random_hash_table(9, FACTORY_E, FACTORY_K)
    if "custom" in features:
        kwargs["custom_routing_function"] = sigmoid_of_top_logits
    if "grouped" in features:
        kwargs.update(use_grouped_topk=True, num_expert_group=4, topk_group=2)
    if "zero" in features:
        kwargs.update(zero_expert_num=FACTORY_Z, zero_expert_type="identity")
    if "simulation" in features:
        kwargs["routing_simulation"] = "uniform_random"
    return kwargs


def expected_factory_routing(cls, kwargs, logits, input_ids):
    """What the chosen kind must compute, from its reference (None for simulation)."""
    scoring, bias = ScoringFunc.SIGMOID, kwargs.get("e_score_correction_bias")
    if cls in (TopKRouter, ZeroExpertRouter) or (
        cls is BiasedTopKRouter and "hash_indices_table" not in kwargs
    ):
        return topk_route_ref(logits, FACTORY_K, scoring=scoring, e_score_correction_bias=bias)
    if cls is BiasedTopKRouter:
        return hash_route_ref(logits, input_ids, kwargs["hash_indices_table"], scoring=scoring)
    if cls is GroupedTopKRouter:
        return grouped_topk_ref(
            logits, FACTORY_K, 4, 2, scoring=scoring, e_score_correction_bias=bias
        )
    if cls is CustomRoutingRouter:
        values, ids = logits.topk(FACTORY_K, dim=-1)
        return torch.sigmoid(values), ids
    return None


@pytest.mark.parametrize(
    "features, cls, ignored", FACTORY_CASES, ids=["+".join(c[0]) or "plain" for c in FACTORY_CASES]
)
def test_factory_chooses_by_priority(features, cls, ignored):
    kwargs = factory_kwargs(features)
    if ignored:
        with pytest.warns(UserWarning, match="not used") as record:
            router = create_router(FACTORY_K, FACTORY_E, **kwargs)
        message = " ".join(str(w.message) for w in record if "not used" in str(w.message))
        for name in ALL_IGNORABLE:
            assert (name in message) == (name in ignored), (name, message)
        assert record[0].filename == __file__  # the warning points at the caller
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            router = create_router(FACTORY_K, FACTORY_E, **kwargs)
    assert type(router) is cls

    # The chosen router really uses the parameters of its kind.
    num_logits = FACTORY_E + (FACTORY_Z if "zero" in features else 0)
    logits = random_logits(37, num_logits)
    input_ids = torch.randint(0, 9, (37,))
    weights, ids = route(router, logits, input_ids)
    expected = expected_factory_routing(cls, kwargs, logits, input_ids)
    if expected is None:
        assert router.strategy == "uniform_random"
        check_ids_valid(ids, num_logits)
    else:
        check_routing(weights, ids, *expected)


def test_factory_bias_and_hash_table_together_is_an_error():
    with pytest.raises(ValueError, match="exactly one of e_score_correction_bias and hash"):
        create_router(
            2,
            8,
            e_score_correction_bias=random_bias(8),
            hash_indices_table=random_hash_table(5, 8, 2),
        )


def test_simulation_env_var_overrides_everything(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "skewed")
    with pytest.warns(UserWarning, match="use_grouped_topk, custom_routing_function"):
        router = create_router(
            4,
            16,
            use_grouped_topk=True,
            num_expert_group=4,
            topk_group=2,
            custom_routing_function=sigmoid_of_top_logits,
            zero_expert_num=2,
            zero_expert_type="zero",
        )
    assert type(router) is RoutingSimulatorRouter and router.strategy == "skewed"
    logits = random_logits(37, 18)
    simulated = create_router(4, 18, routing_simulation="skewed")
    assert_equal(route(router, logits)[1], route(simulated, logits)[1], what="simulated ids")


def test_simulation_env_var_is_read_when_the_router_is_created(monkeypatch):
    plain = create_router(4, 16)
    monkeypatch.setenv(ENV_VAR, "uniform_random")
    simulated = create_router(4, 16)
    monkeypatch.delenv(ENV_VAR)
    assert type(plain) is TopKRouter and type(simulated) is RoutingSimulatorRouter
    logits = random_logits(37, 16)
    monkeypatch.setenv(ENV_VAR, "skewed")  # changes neither router that exists
    check_routing(*route(plain, logits), *topk_route_ref(logits, 4))
    assert simulated.strategy == "uniform_random"


def test_simulation_argument_beats_env_var(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "uniform_random")
    assert create_router(2, 8).strategy == "uniform_random"
    assert create_router(2, 8, routing_simulation="skewed").strategy == "skewed"


def test_unknown_simulation_from_env_var_is_an_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "zipf")
    with pytest.raises(ValueError, match=r"unknown routing simulation 'zipf'"):
        create_router(2, 8)


# --------------------------------------------------------------------------------------------
# 4. zero experts


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("zero_type", ["identity", "zero"])
def test_zero_expert_router_matches_reference(zero_type, with_bias, num_tokens):
    """Zero experts are routed like the others: top-k over all E + Z logits."""
    num_experts, num_zero, top_k = 8, 3, 4
    logits = random_logits(num_tokens, num_experts + num_zero)
    bias = random_bias(num_experts + num_zero) if with_bias else None
    router = create_router(
        top_k,
        num_experts,
        scoring_func="sigmoid",
        zero_expert_num=num_zero,
        zero_expert_type=zero_type,
        e_score_correction_bias=bias,
        routed_scaling_factor=2.5,
    )
    assert type(router) is ZeroExpertRouter
    assert router.zero_expert_type is ZeroExpertType(zero_type)
    ref = topk_route_ref(
        logits,
        top_k,
        scoring=ScoringFunc.SIGMOID,
        e_score_correction_bias=bias,
        routed_scaling_factor=2.5,
    )
    check_routing(*route(router, logits), *ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("zero_type", list(ZeroExpertType), ids=lambda t: t.value)
def test_split_zero_experts_matches_hand_loop(zero_type, num_tokens, dtype):
    num_experts, num_zero, top_k = 6, 4, 4
    router = create_router(top_k, num_experts, zero_expert_num=num_zero, zero_expert_type=zero_type)
    x = torch.randn(num_tokens, 32, dtype=dtype)
    weights, ids = router.select_experts(x, random_logits(num_tokens, num_experts + num_zero))
    if num_tokens > 1:  # both kinds of slot occur
        assert (ids >= num_experts).any() and (ids < num_experts).any()
    weights_in, ids_in = weights.clone(), ids.clone()

    split = split_zero_experts(x, weights, ids, num_experts, zero_type)

    expected_weights = poison_(torch.empty(num_tokens, top_k))
    expected_ids = torch.full((num_tokens, top_k), -7, dtype=torch.int64)
    expected_output = torch.zeros(num_tokens, 32, dtype=torch.float64)
    for m in range(num_tokens):
        for j in range(top_k):
            expert, weight = int(ids[m, j]), float(weights[m, j])
            if expert >= num_experts:
                expected_ids[m, j], expected_weights[m, j] = -1, 0.0
                if zero_type is ZeroExpertType.IDENTITY:
                    expected_output[m] += weight * x[m].double()
            else:
                expected_ids[m, j], expected_weights[m, j] = expert, weight

    assert split.topk_ids.dtype == torch.int32 and split.topk_weights.dtype == torch.float32
    assert_equal(split.topk_ids, expected_ids, what="ids after split")
    assert_close(split.topk_weights, expected_weights, tol=0.0, what="weights after split")
    if zero_type is ZeroExpertType.IDENTITY:
        assert split.zero_output.dtype == dtype
        assert_close(split.zero_output, expected_output, dtype, what="identity output")
    else:
        assert split.zero_output is None
    # the routing given is not modified in place
    assert torch.equal(weights, weights_in) and torch.equal(ids, ids_in)


# --------------------------------------------------------------------------------------------
# 5. routing simulation


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_simulation_is_deterministic_and_valid(strategy, num_tokens):
    num_experts, top_k = 16, 4
    router = create_router(
        top_k, num_experts, routing_simulation=strategy, routed_scaling_factor=2.0
    )
    weights, ids = route(router, random_logits(num_tokens, num_experts))
    # other logits, another call: the same routing
    weights_again, ids_again = route(router, random_logits(num_tokens, num_experts))
    assert weights.shape == ids.shape == (num_tokens, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert_equal(ids_again, ids, what="simulated ids")
    assert_close(weights_again, weights, tol=0.0, what="simulated weights")
    check_ids_valid(ids, num_experts)
    assert (weights > 0).all()
    sums = weights.double().sum(dim=-1)
    assert_close(sums, torch.full_like(sums, 2.0), torch.float32, what="renormalized * 2")


def test_skewed_simulation_concentrates_load_on_first_experts():
    num_experts, top_k, num_tokens = 16, 2, 2000
    uniform_share = num_tokens * top_k / num_experts  # 250
    loads = {}
    for strategy in STRATEGIES:
        router = create_router(top_k, num_experts, routing_simulation=strategy)
        _, ids = route(router, random_logits(num_tokens, num_experts))
        loads[strategy] = torch.bincount(ids.flatten().long(), minlength=num_experts)
    skewed, uniform = loads["skewed"], loads["uniform_random"]
    assert int(skewed[0]) > 2 * uniform_share, skewed
    assert int(skewed.argmax()) == 0
    assert int(skewed[: num_experts // 4].sum()) > int(skewed[num_experts // 4 :].sum()), skewed
    # uniform: every expert within 30 % of its share (5 standard deviations)
    assert ((uniform - uniform_share).abs() < 0.3 * uniform_share).all(), uniform


# --------------------------------------------------------------------------------------------
# non-finite logits (router/base.py): -inf never chosen while k finite remain; NaN poisons
# only its own token

NONFINITE_E, NONFINITE_G, NONFINITE_K, NONFINITE_Z, NONFINITE_VOCAB = 16, 4, 4, 4, 9
ROUTER_KINDS = ("topk", "bias", "grouped", "grouped_bias", "hash", "zero")


def build_router(kind, *, scoring="softmax", renormalize=True, bias=None):
    """One router of each kind over NONFINITE_E experts (E + Z logits for "zero")."""
    common = dict(scoring_func=scoring, renormalize=renormalize)
    k, e = NONFINITE_K, NONFINITE_E
    if kind == "topk":
        return create_router(k, e, **common)
    if kind == "bias":
        return create_router(k, e, e_score_correction_bias=bias, **common)
    if kind in ("grouped", "grouped_bias"):
        return create_router(
            k,
            e,
            use_grouped_topk=True,
            num_expert_group=NONFINITE_G,
            topk_group=2,
            e_score_correction_bias=bias,
            **common,
        )
    if kind == "hash":
        table = random_hash_table(NONFINITE_VOCAB, e, k)
        return create_router(k, e, hash_indices_table=table, **common)
    return create_router(
        k,
        e,
        zero_expert_num=NONFINITE_Z,
        zero_expert_type="identity",
        e_score_correction_bias=bias,
        **common,
    )


def router_reference(kind, logits, scoring, bias):
    common = dict(scoring=ScoringFunc(scoring), e_score_correction_bias=bias)
    if kind in ("grouped", "grouped_bias"):
        return grouped_topk_ref(logits, NONFINITE_K, NONFINITE_G, 2, **common)
    return topk_route_ref(logits, NONFINITE_K, **common)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("kind", ("topk", "bias", "grouped", "grouped_bias", "zero"))
def test_neg_inf_logit_never_chosen(kind, scoring):
    num_logits = NONFINITE_E + (NONFINITE_Z if kind == "zero" else 0)
    group_size = num_logits // NONFINITE_G
    num_tokens = 37
    # half of each group's experts -inf, at random per token: every group keeps >= 2 finite
    # experts, so the kept groups always hold k finite ones
    masked = torch.zeros(num_tokens, num_logits, dtype=torch.bool)
    for m in range(num_tokens):
        for g in range(NONFINITE_G):
            masked[m, g * group_size + torch.randperm(group_size)[: group_size // 2]] = True
    logits = random_logits(num_tokens, num_logits).masked_fill(masked, float("-inf"))
    # a bias far above the scores on a random quarter of the experts: it lifts the score (0) of
    # a -inf expert above the finite ones without it
    bias = None
    if kind in ("bias", "grouped_bias", "zero"):
        bias = random_bias(num_logits)
        bias[torch.randperm(num_logits)[: num_logits // 4]] += 10.0
    router = build_router(kind, scoring=scoring, bias=bias)
    weights, ids = route(router, logits)
    assert not masked.gather(1, ids.long()).any(), "a -inf expert was chosen"
    assert weights.isfinite().all()
    check_routing(weights, ids, *router_reference(kind, logits, scoring, bias))


@pytest.mark.parametrize("kind", ("topk", "grouped"))
def test_neg_inf_logit_not_taken_for_an_underflowed_score(kind):
    """softmax of a logit 200 below the row's max is 0 in float32, as is a -inf logit's: the
    finite expert must still win."""
    num_tokens = 37
    logits = torch.full((num_tokens, NONFINITE_E), -200.0) + torch.randn(num_tokens, NONFINITE_E)
    logits[:, 0] = 0.0  # the one expert with a non-zero score
    masked = torch.zeros_like(logits, dtype=torch.bool)
    for m in range(num_tokens):  # 2 -inf per group of 4
        for g in range(NONFINITE_G):
            masked[m, 4 * g + 1 + torch.randperm(3)[:2]] = True
    logits = logits.masked_fill(masked, float("-inf"))
    router = build_router(kind, scoring="softmax", renormalize=False)
    weights, ids = route(router, logits)
    assert not masked.gather(1, ids.long()).any(), "a -inf expert was chosen"
    assert (ids[:, 0] == 0).all()
    assert_close(weights[:, 0], torch.ones(num_tokens), torch.float32, what="the finite winner")


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_nan_logit_poisons_only_its_token(kind, scoring, renormalize):
    num_logits = NONFINITE_E + (NONFINITE_Z if kind == "zero" else 0)
    num_tokens, bad = 37, 11
    bias = random_bias(num_logits) if kind in ("bias", "grouped_bias", "zero") else None
    router = build_router(kind, scoring=scoring, renormalize=renormalize, bias=bias)
    logits = random_logits(num_tokens, num_logits)
    input_ids = torch.randint(0, NONFINITE_VOCAB, (num_tokens,))
    if kind == "hash":  # an expert the token is routed to
        expert = int(router.hash_indices_table[input_ids[bad], 1])
    else:
        expert = int(torch.randint(0, num_logits, ()))
    poisoned = logits.clone()
    poisoned[bad, expert] = float("nan")

    weights, ids = route(router, poisoned, input_ids)
    clean_weights, clean_ids = route(router, logits, input_ids)

    assert weights[bad].isnan().any(), weights[bad]
    if renormalize or scoring == "softmax":
        assert weights[bad].isnan().all(), weights[bad]
    others = torch.arange(num_tokens) != bad
    assert_equal(ids[others], clean_ids[others], what="ids of the other tokens")
    assert_close(weights[others], clean_weights[others], tol=0.0, what="other tokens' weights")
    check_ids_valid(ids, num_logits)


# --------------------------------------------------------------------------------------------
# 6. bad input: ValueError / TypeError naming the problem, before any score is computed


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if a router computes scores: bad input must be rejected before."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("scores were computed before the bad input was rejected")

    monkeypatch.setattr(topk_module, "compute_scores", must_not_run)
    monkeypatch.setattr(grouped_module, "compute_scores", must_not_run)


def must_not_be_called(*args):
    raise AssertionError("custom routing function called on bad input")


SELECT_KINDS = {
    "topk": lambda: create_router(2, 8),
    "bias": lambda: create_router(2, 8, e_score_correction_bias=random_bias(8)),
    "grouped": lambda: create_router(2, 8, use_grouped_topk=True, num_expert_group=4, topk_group=2),
    "hash": lambda: create_router(2, 8, hash_indices_table=random_hash_table(11, 8, 2)),
    "custom": lambda: create_router(2, 8, custom_routing_function=must_not_be_called),
    "zero": lambda: create_router(2, 6, zero_expert_num=2, zero_expert_type="zero"),
    "simulation": lambda: create_router(2, 8, routing_simulation="skewed"),
}
# (name, hidden_states shape, router_logits, error, match); every router has 8 logits
BAD_SELECT = [
    ("logits rank 1", (5, HIDDEN), (8,), ValueError,
     r"router_logits must have 2 dimensions, got shape \(8,\)"),
    ("logits rank 3", (5, HIDDEN), (5, 1, 8), ValueError,
     r"router_logits must have 2 dimensions, got shape \(5, 1, 8\)"),
    ("too many experts", (5, HIDDEN), (5, 9), ValueError,
     r"router_logits must have 8 columns .*got shape \(5, 9\)"),
    ("too few experts", (5, HIDDEN), (5, 6), ValueError,
     r"router_logits must have 8 columns .*got shape \(5, 6\)"),
    ("token count mismatch", (4, HIDDEN), (5, 8), ValueError,
     "hidden_states has 4 tokens but router_logits has 5"),
    ("hidden_states rank 1", (5,), (5, 8), ValueError,
     "hidden_states must have 2 dimensions"),
    ("logits not a tensor", (5, HIDDEN), "list", TypeError,
     "router_logits must be a torch.Tensor, got list"),
    ("integer logits", (5, HIDDEN), "int", TypeError,
     r"router_logits must have dtype in .*got torch.int64"),
    ("bool logits", (5, HIDDEN), "bool", TypeError,
     r"router_logits must have dtype in .*got torch.bool"),
]  # fmt: skip


def make_logits(spec):
    if spec == "list":
        return torch.randn(5, 8).tolist()
    if spec == "int":
        return torch.randint(-3, 3, (5, 8))
    if spec == "bool":
        return torch.randn(5, 8) > 0
    return torch.randn(*spec)


@pytest.mark.parametrize("kind", list(SELECT_KINDS))
@pytest.mark.parametrize(
    "x_shape, logits_spec, error, match",
    [case[1:] for case in BAD_SELECT],
    ids=[case[0] for case in BAD_SELECT],
)
def test_bad_select_input_rejected_before_compute(
    kind, x_shape, logits_spec, error, match, no_compute
):
    router = SELECT_KINDS[kind]()
    input_ids = torch.randint(0, 11, (5,))
    with pytest.raises(error, match=match):
        router.select_experts(torch.randn(*x_shape), make_logits(logits_spec), input_ids)


BAD_INPUT_IDS = [
    ("missing", None, ValueError, "needs input_ids"),
    ("out of range", torch.tensor([0, 1, 11, 2, 3]), ValueError,
     r"input_ids must lie in \[0, 11\), got values in \[0, 11\]"),
    ("negative", torch.tensor([0, -1, 2, 3, 4]), ValueError,
     r"input_ids must lie in \[0, 11\), got values in \[-1, 4\]"),
    ("wrong length", torch.tensor([0, 1, 2]), ValueError, "input_ids has 3 tokens"),
    ("rank 2", torch.zeros(5, 1, dtype=torch.int64), ValueError,
     "input_ids must have 1 dimensions"),
    ("float", torch.zeros(5), TypeError, r"input_ids must have dtype in .*got torch.float32"),
]  # fmt: skip


@pytest.mark.parametrize(
    "input_ids, error, match", [c[1:] for c in BAD_INPUT_IDS], ids=[c[0] for c in BAD_INPUT_IDS]
)
def test_bad_input_ids_for_hash_routing(input_ids, error, match, no_compute):
    router = SELECT_KINDS["hash"]()
    with pytest.raises(error, match=match):
        router.select_experts(torch.randn(5, HIDDEN), torch.randn(5, 8), input_ids)


GROUPS = dict(use_grouped_topk=True, num_expert_group=4, topk_group=2)
# (name, create_router(top_k, num_experts, **kwargs), error, match)
BAD_CONSTRUCTION = [
    ("top_k 0", (0, 8), {}, ValueError, "top_k must be >= 1, got 0"),
    ("top_k negative", (-2, 8), {}, ValueError, "top_k must be >= 1, got -2"),
    ("top_k > num_experts", (9, 8), {}, ValueError,
     r"top_k \(9\) must be <= the number of experts \(8\)"),
    ("top_k float", (2.0, 8), {}, TypeError, "top_k must be an int, got float"),
    ("num_experts 0", (1, 0), {}, ValueError, "num_experts must be >= 1, got 0"),
    ("topk_group > num_expert_group", (2, 8), {**GROUPS, "topk_group": 5}, ValueError,
     r"topk_group \(5\) must be <= num_expert_group \(4\)"),
    ("experts not divisible by groups", (2, 8), {**GROUPS, "num_expert_group": 3,
                                                 "topk_group": 1}, ValueError,
     r"num_experts \(8\) must be divisible by num_expert_group \(3\)"),
    ("top_k > experts in kept groups", (5, 8), GROUPS, ValueError,
     r"top_k \(5\) must be <= the experts in the kept groups .* = 4\)"),
    ("grouped without groups", (2, 8), {"use_grouped_topk": True}, ValueError,
     "use_grouped_topk needs num_expert_group and topk_group"),
    ("topk_group 0", (2, 8), {**GROUPS, "topk_group": 0}, ValueError,
     "topk_group must be >= 1, got 0"),
    ("bias too long", (2, 8), {"e_score_correction_bias": random_bias(9)}, ValueError,
     r"e_score_correction_bias must have shape \(8,\), got \(9,\)"),
    ("bias 2-d", (2, 8), {"e_score_correction_bias": random_bias(8)[None]}, ValueError,
     r"e_score_correction_bias must have 1 dimensions, got shape \(1, 8\)"),
    ("bias integer", (2, 8), {"e_score_correction_bias": torch.arange(8)}, TypeError,
     r"e_score_correction_bias must have dtype in .*got torch.int64"),
    ("grouped bias too short", (2, 8), {**GROUPS, "e_score_correction_bias": random_bias(4)},
     ValueError, r"e_score_correction_bias must have shape \(8,\), got \(4,\)"),
    ("zero-expert bias without the zero experts", (2, 8),
     {"zero_expert_num": 2, "zero_expert_type": "zero", "e_score_correction_bias": random_bias(8)},
     ValueError, r"e_score_correction_bias must have shape \(10,\), got \(8,\)"),
    ("hash id out of range", (2, 8), {"hash_indices_table": torch.tensor([[0, 1], [7, 8]])},
     ValueError, r"hash_indices_table must lie in \[0, 8\), got values in \[0, 8\]"),
    ("hash id negative", (2, 8), {"hash_indices_table": torch.tensor([[0, 1], [-1, 3]])},
     ValueError, r"hash_indices_table must lie in \[0, 8\), got values in \[-1, 3\]"),
    ("hash table wrong k", (2, 8), {"hash_indices_table": torch.tensor([[0, 1, 2]])},
     ValueError, r"hash_indices_table must be \[vocab, top_k=2\], got \(1, 3\)"),
    ("hash table duplicate in a row", (2, 8),
     {"hash_indices_table": torch.tensor([[0, 1], [3, 3], [4, 5]])},
     ValueError, "hash_indices_table has a row that names the same expert twice"),
    ("hash table float", (2, 8), {"hash_indices_table": torch.zeros(3, 2)}, TypeError,
     r"hash_indices_table must have dtype in .*got torch.float32"),
    ("hash table 1-d", (2, 8), {"hash_indices_table": torch.tensor([0, 1])}, ValueError,
     "hash_indices_table must have 2 dimensions"),
    ("unknown scoring_func", (2, 8), {"scoring_func": "tanh"}, ValueError,
     r"unknown scoring_func 'tanh'; expected one of \['softmax', 'sigmoid', 'sqrtsoftplus'\]"),
    ("scoring_func not a string", (2, 8), {"scoring_func": 3}, TypeError,
     "scoring_func must be a ScoringFunc or a str, got int"),
    ("unknown simulation strategy", (2, 8), {"routing_simulation": "zipf"}, ValueError,
     r"unknown routing simulation 'zipf'; expected one of \('uniform_random', 'skewed'\)"),
    ("zero_expert_num without type", (2, 8), {"zero_expert_num": 2}, ValueError,
     r"zero_expert_num > 0 needs zero_expert_type"),
    ("zero_expert_type without num", (2, 8), {"zero_expert_type": "zero"}, ValueError,
     "zero_expert_type='zero' given but zero_expert_num is 0"),
    ("unknown zero_expert_type", (2, 8), {"zero_expert_num": 2, "zero_expert_type": "one"},
     ValueError, r"unknown zero_expert_type 'one'; expected one of \['identity', 'zero'\]"),
    ("zero_expert_num negative", (2, 8), {"zero_expert_num": -1}, ValueError,
     "zero_expert_num must be >= 0, got -1"),
    ("zero_expert_num float", (2, 8), {"zero_expert_num": 2.0, "zero_expert_type": "zero"},
     TypeError, "zero_expert_num must be an int, got float"),
    ("routed_scaling_factor 0", (2, 8), {"routed_scaling_factor": 0.0}, ValueError,
     "routed_scaling_factor must be a positive number, got 0.0"),
    ("renormalize not a bool", (2, 8), {"renormalize": 1}, TypeError,
     "renormalize must be a bool, got int"),
    ("custom function not callable", (2, 8), {"custom_routing_function": "topk"}, TypeError,
     "custom_routing_function must be callable"),
]  # fmt: skip


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [c[1:] for c in BAD_CONSTRUCTION],
    ids=[c[0] for c in BAD_CONSTRUCTION],
)
def test_bad_router_parameters(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        create_router(*args, **kwargs)


def _custom_returning(weights_fn, ids_fn):
    return lambda x, logits, topk, renorm: (weights_fn(logits.shape[0]), ids_fn(logits.shape[0]))


_GOOD_IDS = lambda m: torch.stack([torch.randperm(8)[:2] for _ in range(m)])
_GOOD_WEIGHTS = lambda m: torch.rand(m, 2)
BAD_CUSTOM = [
    ("weights wrong k", _custom_returning(lambda m: torch.rand(m, 3), _GOOD_IDS), ValueError,
     r"custom routing weights must have shape \(5, 2\), got \(5, 3\)"),
    ("ids wrong tokens", _custom_returning(_GOOD_WEIGHTS, lambda m: _GOOD_IDS(m + 1)),
     ValueError, r"custom routing ids must have shape \(5, 2\), got \(6, 2\)"),
    ("ids out of range", _custom_returning(_GOOD_WEIGHTS, lambda m: _GOOD_IDS(m) + 7),
     ValueError, r"custom routing ids must lie in \[0, 8\)"),
    ("ids negative", _custom_returning(_GOOD_WEIGHTS, lambda m: _GOOD_IDS(m) - 8),
     ValueError, r"custom routing ids must lie in \[0, 8\)"),
    ("ids repeated in a token",
     _custom_returning(_GOOD_WEIGHTS, lambda m: torch.tensor([[1, 2]] * (m - 1) + [[3, 3]])),
     ValueError, "custom routing ids name the same expert twice"),
    ("ids float", _custom_returning(_GOOD_WEIGHTS, lambda m: _GOOD_IDS(m).float()), TypeError,
     r"custom routing ids must have dtype in .*got torch.float32"),
    ("weights integer", _custom_returning(lambda m: torch.ones(m, 2, dtype=torch.int64),
                                          _GOOD_IDS), TypeError,
     r"custom routing weights must have dtype in .*got torch.int64"),
    ("not a pair", lambda x, logits, topk, renorm: _GOOD_IDS(5), TypeError,
     r"custom_routing_function must return a \(weights, ids\) tuple"),
]  # fmt: skip


@pytest.mark.parametrize(
    "fn, error, match", [c[1:] for c in BAD_CUSTOM], ids=[c[0] for c in BAD_CUSTOM]
)
def test_bad_custom_routing_result(fn, error, match):
    router = create_router(2, 8, custom_routing_function=fn)
    with pytest.raises(error, match=match):
        router.select_experts(torch.randn(5, HIDDEN), torch.randn(5, 8))


def test_good_custom_result_passes_the_checks():
    """The bad results above each differ from this good one in one thing."""
    weights = torch.rand(5, 2)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(5)])
    fn = lambda x, logits, topk, renorm: (weights, ids)
    check_routing(
        *create_router(2, 8, custom_routing_function=fn).select_experts(
            torch.randn(5, HIDDEN), torch.randn(5, 8)
        ),
        weights,
        ids,
    )
