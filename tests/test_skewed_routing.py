"""Skewed routing (fusedmoe.tools.bench.inputs): the popularity law and its parameter, the seeded
generator, the tuner's choice under its two rules (least worst ratio, keep-uniform), and every
shipped tuned config run under skewed routing against the reference (Triton's CPU interpreter,
small shapes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fusedmoe.tools.bench.inputs import (
    SKEW_EXPONENT,
    SKEW_STRENGTH,
    make_routing,
    seeded,
    skew_bias,
    skew_strength,
)
from fusedmoe.tools.tune import (
    least_worst_ratio,
    ranked_choices,
    rule_scores,
    tune_shape,
    uniform_kept_score,
)

CPU = torch.device("cpu")
TUNED = Path(__file__).resolve().parents[1] / "fusedmoe" / "kernels" / "tuned"


def _loads(kind, num_tokens=2048, num_experts=64, top_k=4):
    r = make_routing("law", num_tokens, num_experts, top_k, 32, kind, torch.float32, CPU)
    return torch.bincount(r.topk_ids.flatten().long(), minlength=num_experts).double()


# ---------------------------------------------------------------------------------------------
# the law and the generator
# ---------------------------------------------------------------------------------------------
def test_the_generator_is_deterministic():
    for kind in ("uniform", "skewed", "skewed:1.5"):
        a = make_routing("det", 100, 32, 4, 16, kind, torch.bfloat16, CPU)
        b = make_routing("det", 100, 32, 4, 16, kind, torch.bfloat16, CPU)
        assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.x, b.x), kind
        assert torch.equal(a.topk_weights, b.topk_weights), kind
    uniform = make_routing("det", 100, 32, 4, 16, "uniform", torch.bfloat16, CPU)
    skewed = make_routing("det", 100, 32, 4, 16, "skewed", torch.bfloat16, CPU)
    other_m = make_routing("det", 101, 32, 4, 16, "skewed", torch.bfloat16, CPU)
    assert not torch.equal(uniform.topk_ids, skewed.topk_ids)
    assert not torch.equal(other_m.topk_ids[:100], skewed.topk_ids)


def test_the_bias_follows_the_law():
    """bias(e) = -strength * 1.2 * log(rank(e)), ranks a permutation of 1..E."""
    bias = skew_bias(16, 2.0, seeded(CPU, "bias"), CPU)
    ranks = torch.exp(-bias / (2.0 * SKEW_EXPONENT))
    assert torch.allclose(ranks.sort().values, torch.arange(1.0, 17.0), rtol=1e-5)
    assert not torch.equal(ranks, torch.arange(1.0, 17.0)), "the experts are shuffled"
    assert SKEW_STRENGTH == 3.0 and skew_strength("skewed") == 3.0


def test_the_strength_sets_the_concentration():
    """Uniform share k / E; at strength 3 the busiest expert takes many times that, at 1 a few
    times, at 0 about the same as uniform."""
    share = {kind: float(_loads(kind).max() / _loads(kind).sum()) for kind in
             ("uniform", "skewed:0", "skewed:1", "skewed")}  # fmt: skip
    uniform_share = 1 / 64
    assert share["uniform"] < 2 * uniform_share and share["skewed:0"] < 2 * uniform_share
    assert 2 * uniform_share < share["skewed:1"] < share["skewed"]
    assert share["skewed"] > 8 * uniform_share, share
    top = _loads("skewed").sort(descending=True).values
    assert float(top[:8].sum() / top.sum()) > 0.5, "a few experts take most slots"


@pytest.mark.parametrize("kind", ["zipf", "skewed:", "skewed:-1", "skewed:inf", "skewed:x"])
def test_bad_routing_names_are_refused(kind):
    with pytest.raises(ValueError, match="routing must be 'uniform', 'skewed' or"):
        make_routing("bad", 4, 8, 2, 16, kind, torch.float32, CPU)


def test_the_cli_takes_a_strength(capsys):
    from fusedmoe.tools.cli import build_parser, main

    args = build_parser().parse_args(["bench", "--routing", "uniform,skewed,skewed:2"])
    assert args.routing == ["uniform", "skewed", "skewed:2"]
    with pytest.raises(SystemExit):
        main(["bench", "--routing", "uniform,zipf"])
    assert "routing must be 'uniform', 'skewed' or" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the tuner's choice
# ---------------------------------------------------------------------------------------------
def test_least_worst_ratio_prefers_the_config_good_under_both():
    timed = {  # (uniform ms, skewed ms)
        "uniform_winner": (1.00, 2.00),  # the best uniform time, 2x the best skewed one
        "balanced": (1.05, 1.10),
        "skewed_winner": (1.50, 1.00),
    }
    score = least_worst_ratio(timed)
    assert min(score, key=score.get) == "balanced"
    assert math.isclose(score["uniform_winner"], 2.0)
    assert math.isclose(score["balanced"], 1.1)
    assert least_worst_ratio({}) == {}
    # where the rules disagree: the sum of the times picks A, the least worst ratio B
    timed = {"A": (1.0, 1.5), "B": (1.35, 1.2), "C": (2.0, 1.0)}
    score = least_worst_ratio(timed)
    assert min(timed, key=lambda c: sum(timed[c])) == "A"
    assert min(score, key=score.get) == "B"


def test_keep_uniform_takes_the_best_skewed_time_that_keeps_uniform_time():
    timed = {  # (uniform ms, skewed ms)
        "today": (1.00, 2.00),
        "much_faster_skewed": (1.20, 1.00),  # 20% slower uniform: out of the running
        "within_slack": (1.009, 1.50),
        "faster_both": (0.90, 1.80),
        "just_over": (1.011, 1.10),
    }
    score = uniform_kept_score(timed, "today", 0.01)
    assert set(score) == {"today", "within_slack", "faster_both"}
    assert score["today"] == 1.0
    assert math.isclose(score["within_slack"], 0.75)
    assert min(score, key=score.get) == "within_slack"
    # with no slack only what is at least as fast under uniform routing competes
    assert set(uniform_kept_score(timed, "today", 0.0)) == {"today", "faster_both"}
    # the least worst ratio takes a config that is slower than today under uniform routing
    lw = least_worst_ratio(timed)
    assert min(lw, key=lw.get) == "just_over"


def test_the_rules_rank_what_is_verified():
    timed = {  # (uniform ms, skewed ms)
        "heuristic": (1.10, 1.60),
        "today": (1.00, 2.00),
        "skewed_only": (1.30, 1.00),
        "both_better": (0.99, 1.50),
        "noise": (1.00, 1.99),  # 0.5% better skewed: under --min-gain
    }
    # least-worst: scored against the fastest under each routing, measured against the
    # heuristic, which is the last resort (as before keep-uniform existed)
    score = rule_scores(timed, "least-worst", "heuristic", 0.01)
    assert score == least_worst_ratio(timed)
    ranked = ranked_choices(score, "heuristic", "heuristic", 0.03)
    old_rule = [c for c in sorted(score, key=score.get) if score[c] < score["heuristic"] * 0.97]
    assert ranked == [*old_rule, "heuristic"]
    assert ranked[0] == "skewed_only"  # worst ratio 1.31, then both_better 1.5, heuristic 1.6
    # keep-uniform: today's config is the bar and the first fallback, the heuristic the last
    score = rule_scores(timed, "keep-uniform", "today", 0.01)
    assert set(score) == {"today", "both_better", "noise"}
    assert ranked_choices(score, "today", "heuristic", 0.03) == [
        "both_better",
        "today",
        "heuristic",
    ]
    # nothing beats today by min_gain: today, then the heuristic
    assert ranked_choices(score, "today", "heuristic", 0.3) == ["today", "heuristic"]


def test_tune_shape_refuses_an_unknown_rule_before_touching_a_device():
    with pytest.raises(ValueError, match=r"rule \(--rule\) must be one of"):
        tune_shape(None, "bf16", [8], rule="fastest")
    with pytest.raises(ValueError, match=r"uniform_slack .* must be a number >= 0"):
        tune_shape(None, "bf16", [8], rule="keep-uniform", uniform_slack=float("nan"))


# ---------------------------------------------------------------------------------------------
# every shipped tuned config, under skewed routing, against the reference
# ---------------------------------------------------------------------------------------------
def _shipped() -> list[tuple[str, dict]]:
    """(dtype key, config json) of every distinct entry of the shipped tables."""
    seen, out = set(), []
    for path in sorted(TUNED.glob("*/*.json")):
        dtype = path.stem.split("dtype=")[1]
        for entry in json.loads(path.read_text()).values():
            key = (dtype, json.dumps(entry, sort_keys=True))
            if key not in seen:
                seen.add(key)
                out.append((dtype, entry))
    return out


SHIPPED = _shipped()


def test_tables_are_shipped():
    assert len(SHIPPED) >= 4, "the package ships tuned tables (fusedmoe/kernels/tuned)"
    assert {d for d, _ in SHIPPED} >= {"bfloat16", "fp8_block"}


@pytest.mark.parametrize(
    ("dtype", "entry"), SHIPPED, ids=[f"{d}-{i}" for i, (d, _) in enumerate(SHIPPED)]
)
def test_shipped_config_is_right_under_skewed_routing(dtype, entry):
    pytest.importorskip("triton")
    from fusedmoe import fused_experts
    from fusedmoe.kernels.moe_config import MoEKernelConfig, use_moe_kernel_config
    from fusedmoe.quant import quantize_experts
    from tests.helpers import assert_close, quant_tol
    from tests.reference import random_experts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = MoEKernelConfig.from_json(entry, "test")
    # I = 192: a partial group; 270 tokens, top-1: the popular expert's 259 rows span 3 blocks
    # of 128 (and many of 16)
    num_experts, hidden, inter, top_k, num_tokens = 8, 256, 192, 1, 270
    r = make_routing("tables", num_tokens, num_experts, top_k, hidden, "skewed",
                     torch.bfloat16, torch.device(device))  # fmt: skip
    loads = torch.bincount(r.topk_ids.flatten().long().cpu(), minlength=num_experts)
    assert int(loads.max()) > 2 * 128, "skewed: one expert's rows span several row blocks"
    experts = random_experts(num_experts, hidden, inter, "silu", dtype=torch.bfloat16)
    w13, w2, qc = experts["w13"], experts["w2"], None
    if dtype == "fp8_block":
        w13, w2, qc = quantize_experts(w13, w2, "fp8_block")
        from tests.helpers import quant_config_to

        qc = quant_config_to(qc, device)
    w13, w2 = w13.to(device), w2.to(device)
    args = (r.x, w13, w2, r.topk_weights, r.topk_ids)
    with use_moe_kernel_config(config):
        out = fused_experts(*args, quant_config=qc, backend="triton")
    ref = fused_experts(*args, quant_config=qc, backend="torch")
    tol = quant_tol(device) if qc is not None else {}
    assert_close(out, ref, torch.bfloat16, **tol)
