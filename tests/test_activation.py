"""apply_activation against hand formulas written element by element with the math module."""

from __future__ import annotations

import math

import pytest
import torch

from fusedmoe import ActivationParams, MoEActivation, apply_activation
from tests.helpers import assert_close
from tests.reference import ALL_ACTIVATIONS, GATED, activation_ref


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _silu(v: float) -> float:
    return v * _sigmoid(v)


def _gelu(v: float) -> float:
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def _gelu_tanh(v: float) -> float:
    return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))


def _clamp(v: float, low: float, high: float) -> float:
    return max(low, min(high, v))


def hand_activation(name: str, row: list[float], alpha=None, beta=None, limit=None) -> list[float]:
    """One row of GEMM1 output -> the activation, from the spec, one scalar at a time."""
    if name == "silu_no_mul":
        return [_silu(v) for v in row]
    if name == "gelu_no_mul":
        return [_gelu(v) for v in row]
    if name == "relu2_no_mul":
        return [max(v, 0.0) ** 2 for v in row]
    half = len(row) // 2
    if name == "swigluoai":  # gpt-oss: gate and up alternate
        pairs = [(row[2 * i], row[2 * i + 1]) for i in range(half)]
    else:
        pairs = [(row[i], row[half + i]) for i in range(half)]
    out = []
    for g, u in pairs:
        if name == "silu":
            if limit is not None:
                g, u = min(g, limit), _clamp(u, -limit, limit)
            out.append(_silu(g) * u)
        elif name == "gelu":
            out.append(_gelu(g) * u)
        elif name == "gelu_tanh":
            out.append(_gelu_tanh(g) * u)
        elif name in ("swigluoai", "swigluoai_uninterleave"):
            a = 1.702 if alpha is None else alpha
            lim = 7.0 if limit is None else limit
            offset = 1.0 if name == "swigluoai" or beta is None else beta
            g, u = min(g, lim), _clamp(u, -lim, lim)
            out.append((u + offset) * g * _sigmoid(a * g))
        elif name == "swiglustep":
            lim = 7.0 if limit is None else limit
            out.append(min(_silu(g), lim) * _clamp(u, -lim, lim))
        else:
            raise AssertionError(name)
    return out


def hand_apply(name: str, h: torch.Tensor, **params) -> torch.Tensor:
    rows = h.double().reshape(-1, h.shape[-1]).tolist()
    out = torch.tensor([hand_activation(name, r, **params) for r in rows], dtype=torch.float64)
    return out.reshape(*h.shape[:-1], -1)


# (activation, params): every activation with its defaults, and with each parameter it takes
CASES = [(name, {}) for name in ALL_ACTIVATIONS] + [
    ("silu", {"limit": 3.0}),
    ("swigluoai", {"alpha": 1.0, "limit": 5.0}),
    ("swigluoai_uninterleave", {"alpha": 2.0, "beta": 0.5, "limit": 4.0}),
    ("swigluoai_uninterleave", {"beta": -1.5}),
    ("swiglustep", {"limit": 2.0}),
]


def test_cases_cover_every_activation():
    assert {m.value for m in MoEActivation} == set(ALL_ACTIVATIONS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("name", "params"), CASES)
def test_matches_hand_formula(name, params, dtype):
    # std 6: many values lie beyond the clamp limits (2 .. 7) on both sides
    h = (torch.randn(3, 5, 24) * 6).to(dtype)
    limit = params.get("limit", 7.0)
    assert (h > limit).any() and (h < -limit).any()
    out = apply_activation(name, h, ActivationParams(**params) if params else None)
    assert out.dtype == torch.float32
    expected = hand_apply(name, h, **params)
    width = 12 if name in GATED else 24
    assert out.shape == (3, 5, width)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize(("name", "params"), CASES)
def test_test_reference_matches_hand_formula(name, params):
    """The float64 tensor reference the other test files use is the same function."""
    h = torch.randn(4, 16, dtype=torch.float64) * 6
    assert_close(activation_ref(name, h, **params), hand_apply(name, h, **params))


def test_clamps_change_the_result():
    """The limit is really applied: a tiny limit gives a different answer than the default."""
    h = torch.randn(8, 16) * 6
    default = apply_activation("swiglustep", h)
    tight = apply_activation("swiglustep", h, ActivationParams(limit=0.5))
    assert_close(tight, hand_apply("swiglustep", h, limit=0.5), torch.float32)
    assert (default - tight).abs().max() > 1.0


def test_interleaved_layout_is_gate_then_up_alternating():
    # gate = 2, up = 3 in every pair: (3 + 1) * 2 * sigmoid(1.702 * 2)
    h = torch.tensor([[2.0, 3.0, 2.0, 3.0]])
    out = apply_activation(MoEActivation.SWIGLUOAI, h)
    expected = torch.full((1, 2), 4.0 * 2.0 * _sigmoid(1.702 * 2.0), dtype=torch.float64)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("name", ["silu", "SiLU", "GELU_TANH", "relu2_no_mul"])
def test_string_names(name):
    assert MoEActivation.parse(name) is MoEActivation(name.lower())
    h = torch.randn(2, 8)
    assert_close(apply_activation(name, h), hand_apply(name.lower(), h), torch.float32)


@pytest.mark.parametrize("name", ["swish", "relu", "silu_and_mul", ""])
def test_unknown_name_is_value_error(name):
    with pytest.raises(ValueError, match="unknown activation"):
        apply_activation(name, torch.randn(2, 8))


def test_non_string_name_is_type_error():
    with pytest.raises(TypeError, match="activation must be"):
        apply_activation(3, torch.randn(2, 8))


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("gelu", {"limit": 7.0}),
        ("gelu_tanh", {"alpha": 1.0}),
        ("silu", {"alpha": 1.0}),
        ("silu", {"beta": 1.0}),
        ("swigluoai", {"beta": 0.5}),
        ("swiglustep", {"alpha": 1.0}),
        ("silu_no_mul", {"limit": 1.0}),
        ("gelu_no_mul", {"alpha": 1.0}),
        ("relu2_no_mul", {"limit": 1.0}),
    ],
)
def test_params_refused_for_activations_that_do_not_take_them(name, params):
    key = next(iter(params))
    with pytest.raises(ValueError, match=f"takes no {key}"):
        apply_activation(name, torch.randn(2, 8), ActivationParams(**params))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"limit": 0.0}, "limit must be > 0"),
        ({"limit": -1.0}, "limit must be > 0"),
        ({"alpha": float("nan")}, "alpha must be a finite number"),
        ({"beta": float("inf")}, "beta must be a finite number"),
        ({"limit": "7"}, "limit must be a finite number"),
    ],
)
def test_bad_activation_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationParams(**kwargs)


def test_params_must_be_activation_params():
    with pytest.raises(TypeError, match="ActivationParams"):
        apply_activation("silu", torch.randn(2, 8), {"limit": 7.0})


@pytest.mark.parametrize("name", GATED)
def test_gated_needs_even_width(name):
    with pytest.raises(ValueError, match="even width"):
        apply_activation(name, torch.randn(2, 7))


@pytest.mark.parametrize(
    ("name", "gated", "gemm1_out", "out"),
    [
        ("silu", True, 16, 8),
        ("gelu", True, 16, 8),
        ("gelu_tanh", True, 16, 8),
        ("swigluoai", True, 16, 8),
        ("swigluoai_uninterleave", True, 16, 8),
        ("swiglustep", True, 16, 8),
        ("silu_no_mul", False, 8, 8),
        ("gelu_no_mul", False, 8, 8),
        ("relu2_no_mul", False, 8, 8),
    ],
)
def test_sizes(name, gated, gemm1_out, out):
    act = MoEActivation(name)
    assert act.is_gated is gated
    assert act.gemm1_out_size(8) == gemm1_out
    assert act.output_size(gemm1_out) == out
