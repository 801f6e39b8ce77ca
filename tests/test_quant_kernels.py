"""The Triton activation quantizers (fusedmoe.quant.kernels) against their torch twins.

Without a GPU the kernels run on Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes here are small; the `gpu` tests at the end run the compiled
kernels at DeepSeek-V3 sizes. Legend: M tokens, K quantized width, I intermediate (h [M, 2I]),
g group size.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from fusedmoe.activation import ActivationParams, MoEActivation, apply_activation
from fusedmoe.quant import activation as qa
from fusedmoe.quant import kernels as kq
from fusedmoe.quant import keys
from fusedmoe.quant.formats import FP8_DTYPE
from fusedmoe.quant.reference import dequantize
from tests.helpers import assert_close, assert_equal

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
E4M3_POSITIVE = E4M3_VALUES[(E4M3_VALUES >= 0) & E4M3_VALUES.isfinite()].unique()  # sorted


def _group_key(group_size: int, use_ue8m0: bool) -> keys.QuantKey:
    fmt = keys.ScaleFormat.UE8M0 if use_ue8m0 else keys.ScaleFormat.FLOAT32
    return keys.QuantKey(keys.ElementFormat.FP8, keys.ScaleLayout.GROUP, fmt, group=(1, group_size))


def _activations(m: int, k: int, dtype: torch.dtype, device: str = DEVICE) -> torch.Tensor:
    """[M, K] values with row magnitudes over a few decades and a few outliers."""
    x = torch.randn(m, k, device=device) * torch.exp(torch.randn(m, 1, device=device))
    if x.numel():
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 500),), device=device)
        flat[idx] *= 20.0  # stays finite in float16
    return x.to(dtype)


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 ulps of positive float32 tensors."""
    return (
        a.float().contiguous().view(torch.int32) - b.float().contiguous().view(torch.int32)
    ).abs()


def _near_power_of_two(raw_scale: torch.Tensor, ulps: int) -> torch.Tensor:
    """Where a float32 scale lies within `ulps` of a power of two (UE8M0 may round either way)."""
    nearest = torch.exp2(torch.log2(raw_scale.double()).round()).float()
    return _ulp_distance(raw_scale, nearest) <= ulps


def _assert_matches_twin(
    q: torch.Tensor,
    scales: torch.Tensor,
    q_ref: torch.Tensor,
    scales_ref: torch.Tensor,
    key: keys.QuantKey,
    *,
    scale_ulps: int = 0,
    max_mismatch: float = 0.0,
    free_groups: torch.Tensor | None = None,
) -> None:
    """Scales equal (within `scale_ulps` float32 ulps), with the twin's shape and strides; q equal
    but for at most a fraction `max_mismatch` of one-step e4m3 differences; dequantized values
    close. `free_groups` [M, G] bool: groups whose UE8M0 scale may be either neighbouring power
    of two (their amax sits within ulps of the rounding boundary)."""
    assert q.dtype == FP8_DTYPE and q.shape == q_ref.shape, (q.dtype, q.shape, q_ref.shape)
    assert scales.dtype == scales_ref.dtype and scales.shape == scales_ref.shape
    for dim, size in enumerate(scales.shape):  # strides of size-1 dims mean nothing
        if size > 1:
            assert scales.stride(dim) == scales_ref.stride(dim), (
                scales.stride(),
                scales_ref.stride(),
            )
    if q.numel() == 0:
        return
    g = key.group[1]
    if free_groups is None:
        free_groups = torch.zeros(scales.shape, dtype=torch.bool, device=scales.device)
    if scales.dtype == torch.uint8:
        assert_equal(scales, scales_ref, what="E8M0 scales")
    else:
        ulps = torch.where(free_groups, 0, _ulp_distance(scales, scales_ref))
        worst = int(ulps.max())
        assert worst <= scale_ulps, f"scales differ by {worst} ulps (> {scale_ulps})"
    exact = scale_ulps == 0 and max_mismatch == 0.0
    codes, codes_ref = q.view(torch.uint8).int(), q_ref.view(torch.uint8).int()
    free = free_groups.repeat_interleave(g, dim=1)[:, : q.shape[1]]
    # exact: bit for bit (the sign of zero too); else: by value
    differ = ((codes != codes_ref) if exact else (q.float() != q_ref.float())) & ~free
    fraction = float(differ.float().mean())
    assert fraction <= max_mismatch, f"{fraction:.2e} of q differ from the twin (> {max_mismatch})"
    if bool(differ.any()):
        steps = ((codes & 0x7F) - (codes_ref & 0x7F)).abs()
        same_sign = (codes & 0x80) == (codes_ref & 0x80)
        assert bool((same_sign & (steps <= 1))[differ].all()), "q differs by more than one step"
    assert_close(
        dequantize(q, scales, key),
        dequantize(q_ref, scales_ref, key),
        torch.float32,
        # else: one e4m3 step (32 / 224 of a UE8M0 group's max) on a small fraction of q
        tol=None if exact else 0.15,
        rms_tol=None if exact else 1e-2,
        what="dequantized",
    )


# ---------------------------------------------------------------------------------------------
# per-token-group FP8
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [0, 1, 37])
@pytest.mark.parametrize("k", [128, 200, 256])
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_per_token_group_quant_matches_twin(m, k, group_size, column_major, use_ue8m0):
    x = _activations(m, k, torch.bfloat16)
    q, scales = kq.per_token_group_quant_fp8_triton(x, group_size, column_major, use_ue8m0)
    q_ref, scales_ref = qa.per_token_group_quant_fp8_torch(x, group_size, column_major, use_ue8m0)
    num_groups = math.ceil(k / group_size)
    assert scales.shape == (m, num_groups) and scales.dtype == torch.float32
    if m > 0:
        assert scales.stride() == ((1, m) if column_major else (num_groups, 1))
    if use_ue8m0 and m > 0:
        mantissa, _ = torch.frexp(scales)
        assert bool((mantissa == 0.5).all()), "UE8M0 scales must be powers of two"
    _assert_matches_twin(q, scales, q_ref, scales_ref, _group_key(group_size, use_ue8m0))


@pytest.mark.parametrize("group_size", [48, 96])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_group_size_not_a_power_of_two(group_size, use_ue8m0):
    """Groups narrower than the kernel's power-of-two lanes: the extra lanes are masked."""
    x = _activations(37, 200, torch.bfloat16)
    h = (torch.randn(37, 400, device=DEVICE) * 3).to(torch.bfloat16)
    q, scales = kq.per_token_group_quant_fp8_triton(x, group_size, True, use_ue8m0)
    q_ref, scales_ref = qa.per_token_group_quant_fp8_torch(x, group_size, True, use_ue8m0)
    _assert_matches_twin(q, scales, q_ref, scales_ref, _group_key(group_size, use_ue8m0))
    _check_fused(h, "swiglustep", None, group_size, False, use_ue8m0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_per_token_group_quant_input_dtypes(dtype, use_ue8m0):
    x = _activations(37, 256, dtype)
    q, scales = kq.per_token_group_quant_fp8_triton(x, 128, False, use_ue8m0)
    q_ref, scales_ref = qa.per_token_group_quant_fp8_torch(x, 128, False, use_ue8m0)
    _assert_matches_twin(q, scales, q_ref, scales_ref, _group_key(128, use_ue8m0))


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_per_token_group_quant_strided_input(layout):
    if layout == "row_slice":  # rows of a wider buffer: row stride 384 != K
        x = _activations(37, 384, torch.bfloat16)[:, 64:320]
    else:  # column-major x: K is not the contiguous dim
        x = _activations(256, 37, torch.bfloat16).t()
    q, scales = kq.per_token_group_quant_fp8_triton(x, 128, False, False)
    q_ref, scales_ref = qa.per_token_group_quant_fp8_torch(x.contiguous(), 128, False, False)
    assert q.is_contiguous()
    _assert_matches_twin(q, scales, q_ref, scales_ref, _group_key(128, False))


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_zero_row_gets_finite_scales_and_zero_q(use_ue8m0):
    x = _activations(5, 256, torch.bfloat16)
    x[2] = 0.0
    x[4, 128:] = 0.0  # one all-zero group in a live row
    q, scales = kq.per_token_group_quant_fp8_triton(x, 128, False, use_ue8m0)
    q_ref, scales_ref = qa.per_token_group_quant_fp8_torch(x, 128, False, use_ue8m0)
    assert bool(scales.isfinite().all()) and bool((scales > 0).all())
    assert bool((q[2].float() == 0).all()) and bool((q[4, 128:].float() == 0).all())
    assert bool((q[4, :128].float() != 0).any())
    _assert_matches_twin(q, scales, q_ref, scales_ref, _group_key(128, use_ue8m0))


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_huge_element_saturates_and_flushes_its_group(use_ue8m0):
    x = torch.randn(3, 256, device=DEVICE)
    x[0, 5] = 3.0e38  # near float32's max: the group's other values fall below e4m3's range
    x[1, 200] = -1.0e30
    q, scales = kq.per_token_group_quant_fp8_triton(x, 128, False, use_ue8m0)
    q_ref, scales_ref = qa.per_token_group_quant_fp8_torch(x, 128, False, use_ue8m0)
    assert bool(q.float().isfinite().all())
    assert float(q[0, 5].float()) == 448.0 or use_ue8m0  # UE8M0 rounds the scale up: <= 448
    assert float(q[1, 200].float()) < 0 and float(q[1, 200].float().abs()) >= 224.0
    assert int((q[0, :128].float() != 0).sum()) == 1
    _assert_matches_twin(q, scales, q_ref, scales_ref, _group_key(128, use_ue8m0))


@pytest.mark.parametrize(("use_ue8m0", "scale"), [(False, 1.0), (True, 1.0), (False, 3.0)])
def test_rounds_to_nearest_even_at_every_tie(use_ue8m0, scale):
    """Every midpoint between neighbouring e4m3 values (ties, normal and subnormal) and its
    neighbours one float32 ulp away, times the group scale (amax = 448 * scale). Scale 3: x / 3
    must be IEEE division (a multiply by a rounded 1/3 lands beside the ties)."""
    mid = (E4M3_POSITIVE[:-1] + E4M3_POSITIVE[1:]) / 2  # 126 ties, exact in float32
    below, above = torch.nextafter(mid, torch.zeros(1)), torch.nextafter(mid, mid * 2)
    values = torch.cat([mid, below, above, E4M3_POSITIVE])
    values = torch.cat([values, -values]) * scale
    num_groups = math.ceil(values.numel() / 127)
    body = torch.nn.functional.pad(values, (0, num_groups * 127 - values.numel()))
    amax = torch.full((num_groups, 1), 448.0 * scale)
    x = torch.cat([amax, body.view(num_groups, 127)], dim=1).reshape(1, -1).to(DEVICE)
    q, scales = kq.per_token_group_quant_fp8_triton(x, 128, False, use_ue8m0)
    assert bool((scales == scale).all())
    expected = (x / scale).to(FP8_DTYPE)  # IEEE division, then torch's cast (ties to even)
    assert_equal(q.view(torch.uint8), expected.view(torch.uint8), what="e4m3 codes")


def test_ue8m0_scale_is_the_smallest_power_of_two_at_or_above():
    """Scales exactly at a power of two stay, one ulp above goes up: checked in float64."""
    k_exp = torch.arange(-20, 20, dtype=torch.float64)
    at = torch.exp2(k_exp) * 448.0  # amax / 448 == 2**k exactly
    above = torch.nextafter(at.float(), at.float() * 2).double()
    amax = torch.cat([at, above]).float()
    x = torch.randn(amax.numel(), 128).clamp(-1, 1) * amax[:, None] / 2
    x[:, 7] = amax
    q, scales = kq.per_token_group_quant_fp8_triton(x.to(DEVICE), 128, False, True)
    q, scales = q.cpu(), scales.cpu()
    raw = amax.double() / 448.0
    expected = torch.exp2(torch.ceil(torch.log2(raw)))
    assert_equal(scales[:, 0].double(), expected, what="UE8M0 scales")
    assert bool((q[:, 7].float() <= 448.0).all())


# ---------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [0, 1, 37])
@pytest.mark.parametrize("k", [128, 224, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp8_matches_twin(m, k, dtype):
    x = _activations(m, k, dtype)
    q, scales = kq.quantize_mxfp8_triton(x)
    q_ref, scales_ref = qa.quantize_mxfp8_torch(x)
    assert scales.dtype == torch.uint8 and scales.shape == (m, k // 32)
    _assert_matches_twin(q, scales, q_ref, scales_ref, keys.MXFP8)


def test_mxfp8_exponents_from_float64_and_saturation():
    """code = floor(log2(amax)) - 8 + 127, exact in float64, for amax at, one ulp below and
    just below the next power of two (the last two saturate: amax / 2**exponent > 448); an
    all-zero block gets code 0. (The twin's float32 log2 rounds one ulp below 2**k up to k.)"""
    powers = torch.exp2(torch.arange(-30, 30, dtype=torch.float32))
    amax = torch.cat([powers, torch.nextafter(powers, powers / 2), powers * 1.9, powers * 0.0])
    x = torch.randn(amax.numel(), 32).clamp(-1, 1) * amax[:, None] / 2
    x[:, 3] = -amax
    q, scales = kq.quantize_mxfp8_triton(x.to(DEVICE))
    q, scales = q.cpu(), scales.cpu()
    a = amax.double()
    expected = torch.where(a > 0, torch.floor(torch.log2(a)) - 8 + 127, torch.zeros_like(a))
    assert_equal(scales[:, 0].double(), expected.clamp(0, 254), what="E8M0 codes")
    saturated = amax / torch.exp2(scales[:, 0].float() - 127) > 448
    assert bool(saturated.any())
    assert bool((q[saturated, 3].float() == -448.0).all())
    assert bool((q[amax == 0].float() == 0).all())
    q_exact = (x / torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)).clamp(-448, 448)
    assert_equal(q.view(torch.uint8), q_exact.to(FP8_DTYPE).view(torch.uint8), what="q")


# ---------------------------------------------------------------------------------------------
# gated activation + per-token-group FP8, fused
# ---------------------------------------------------------------------------------------------
ACTIVATION_CASES = [
    ("silu", None),
    ("silu", ActivationParams(limit=2.5)),
    ("swiglustep", None),
    ("swiglustep", ActivationParams(limit=3.0)),
    ("swigluoai_uninterleave", None),
    ("swigluoai_uninterleave", ActivationParams(alpha=1.5, beta=0.5, limit=3.0)),
    ("swigluoai", None),
    ("gelu", None),
]
# The fused kernel's exp (and on a GPU its approximate division) may differ from torch's in the
# last bits, so may the group amax and scale.
FUSED_SCALE_ULPS = 8 if DEVICE == "cuda" else 4
FUSED_MAX_MISMATCH = 2e-3


def _free_ue8m0_groups(h, activation, params, group_size, use_ue8m0):
    """Groups whose UE8M0 scale may round to either power of two (see _assert_matches_twin)."""
    a = apply_activation(activation, h.float(), params)
    m, i = a.shape
    num_groups = math.ceil(i / group_size)
    padded = torch.nn.functional.pad(a.abs(), (0, num_groups * group_size - i))
    amax = padded.view(m, num_groups, group_size).amax(dim=2)
    if not use_ue8m0:
        return torch.zeros_like(amax, dtype=torch.bool)
    return _near_power_of_two(amax.clamp(min=1e-10) / 448.0, FUSED_SCALE_ULPS)


def _check_fused(h, activation, params, group_size, column_major, use_ue8m0):
    q, scales = kq.act_mul_per_token_group_quant_fp8_triton(
        h, activation, params, group_size, column_major, use_ue8m0
    )
    q_ref, scales_ref = qa.act_mul_per_token_group_quant_fp8_torch(
        h, activation, params, group_size, column_major, use_ue8m0
    )
    _assert_matches_twin(
        q,
        scales,
        q_ref,
        scales_ref,
        _group_key(group_size, use_ue8m0),
        scale_ulps=FUSED_SCALE_ULPS,
        max_mismatch=FUSED_MAX_MISMATCH,
        free_groups=_free_ue8m0_groups(h, activation, params, group_size, use_ue8m0),
    )
    return q, scales


@pytest.mark.parametrize(("activation", "params"), ACTIVATION_CASES)
@pytest.mark.parametrize(
    ("m", "i", "group_size", "column_major", "use_ue8m0"),
    [(37, 256, 128, False, False), (37, 200, 64, True, True), (1, 128, 128, True, False)],
)
def test_act_mul_matches_twin(activation, params, m, i, group_size, column_major, use_ue8m0):
    h = (torch.randn(m, 2 * i, device=DEVICE) * 3).to(torch.bfloat16)
    q, scales = _check_fused(h, activation, params, group_size, column_major, use_ue8m0)
    assert q.shape == (m, i) and scales.shape == (m, math.ceil(i / group_size))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_act_mul_input_dtypes(dtype):
    h = (torch.randn(37, 512, device=DEVICE) * 3).to(dtype)
    _check_fused(h, "silu", None, 128, False, True)


def test_act_mul_zero_rows_and_strided_input():
    h = (torch.randn(9, 640, device=DEVICE) * 3).to(torch.bfloat16)[:, :512]  # row stride 640
    h[3] = 0.0
    q, scales = _check_fused(h, "swiglustep", None, 128, False, False)
    assert bool((q[3].float() == 0).all()) and bool(scales.isfinite().all())


def test_act_mul_saturates_huge_values():
    h = torch.randn(2, 512, device=DEVICE)
    h[0, 3], h[0, 256 + 3] = 50.0, 1.0e30  # silu(50) * 1e30: far above the group's others
    h[1, 10], h[1, 256 + 10] = 50.0, -1.0e30
    q, _ = _check_fused(h, "silu", None, 128, False, False)
    assert float(q[0, 3].float()) == 448.0 and float(q[1, 10].float()) == -448.0


@pytest.mark.parametrize("bound", [0, 5, 6, 13, 37, 40])
def test_act_mul_rows_in_use(monkeypatch, bound):
    """rows_in_use (the contiguous layout's rows in use): the row tiles below it are those of
    the unbounded call, bit for bit; the tiles that start at or past it are never written."""
    h = (torch.randn(37, 512, device=DEVICE) * 3).to(torch.bfloat16)
    with kq.use_quant_kernel_config(kq.QuantKernelConfig(2, 1, 1)):  # two rows a program
        q_all, s_all = _act_quant(h, "silu", None, 128, True, False)
        alloc = kq._alloc_group_outputs

        def poisoned(*args, **kwargs):  # outputs a skipped row keeps: q 1.0, scales -1
            q, s = alloc(*args, **kwargs)
            return q.fill_(1.0), s.fill_(-1.0)

        monkeypatch.setattr(kq, "_alloc_group_outputs", poisoned)
        rows = torch.tensor([bound], dtype=torch.int32, device=DEVICE)
        q, s = _act_quant(h, "silu", None, 128, True, False, rows)
    done = min(37, -(-bound // 2) * 2)  # whole tiles of two rows
    assert_equal(q[:done].view(torch.uint8), q_all[:done].view(torch.uint8))
    assert_equal(s[:done], s_all[:done])
    assert bool((q[done:].float() == 1.0).all()) and bool((s[done:] == -1.0).all())


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize(("i", "group_size"), [(256, 128), (200, 64)])  # a partial last group
def test_act_mul_bias(activation, i, group_size):
    """bias[row_expert[m]] is added to h's row in fp32 before the activation (interleaved gate
    / up included); a row of expert -1 (padding) or past E takes none: the twin on h + bias."""
    m, num_experts = 37, 3
    h = (torch.randn(m, 2 * i, device=DEVICE) * 3).to(torch.bfloat16)
    bias = (torch.randn(num_experts, 2 * i, device=DEVICE) * 3).to(torch.bfloat16)
    row_expert = torch.randint(-1, num_experts, (m,), dtype=torch.int32, device=DEVICE)
    row_expert[0], row_expert[1], row_expert[2] = -1, num_experts - 1, num_experts
    q, scales = _act_quant(h, activation, None, group_size, True, False, None, bias, row_expert)
    has_bias = (row_expert >= 0) & (row_expert < num_experts)
    added = torch.where(
        has_bias[:, None], bias.float()[row_expert.clamp(0, num_experts - 1).long()], 0.0
    )
    h_biased = h.float() + added  # fp32, as the kernel adds it
    q_ref, scales_ref = qa.act_mul_per_token_group_quant_fp8_torch(
        h_biased, activation, None, group_size, True, False
    )
    _assert_matches_twin(
        q, scales, q_ref, scales_ref, _group_key(group_size, False),
        scale_ulps=FUSED_SCALE_ULPS, max_mismatch=FUSED_MAX_MISMATCH,
    )  # fmt: skip
    q_plain, _ = _act_quant(h, activation, None, group_size, True, False)
    for row in (0, 2):  # expert -1 and expert E: no bias
        assert_equal(q[row].view(torch.uint8), q_plain[row].view(torch.uint8))
    assert not bool((q[has_bias].view(torch.uint8) == q_plain[has_bias].view(torch.uint8)).all())


def test_act_mul_bias_is_checked():
    h, bias = _ones(4, 256), _ones(2, 256)
    rows = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    for b, r, error, match in (
        (bias, None, ValueError, "bias and row_expert come together"),
        (None, rows, ValueError, "bias and row_expert come together"),
        ("b", rows, TypeError, "bias must be a tensor"),
        (_ones(2, 128), rows, ValueError, r"bias must be \[E, 256\]"),
        (bias.int(), rows, TypeError, "bias must be floating point"),
        (bias, rows[:3], ValueError, r"row_expert must be int32 \[4\]"),
        (bias, rows.long(), ValueError, "row_expert must be int32"),
        (bias, torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)[:, 0], ValueError,
         "row_expert must be contiguous"),
    ):  # fmt: skip
        with pytest.raises(error, match=match):
            _act_quant(h, "silu", None, 128, False, False, None, b, r)


def test_act_mul_rows_in_use_is_checked():
    h = _ones(4, 256)
    for rows, error, match in (
        (3, TypeError, "rows_in_use must be a tensor"),
        (torch.tensor([3]), ValueError, "int32 tensor of one element, got torch.int64"),
        (torch.tensor([3, 4], dtype=torch.int32), ValueError, r"of shape \(2,\)"),
    ):
        with pytest.raises(error, match=match):
            _act_quant(h, "silu", None, 128, False, False, rows)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="rows_in_use is on cpu"):
            _act_quant(h, "silu", None, 128, False, False, torch.tensor([3], dtype=torch.int32))


def test_fused_supports():
    for name in ("silu", "swiglustep", "swigluoai_uninterleave", "swigluoai", "gelu"):
        assert kq.fused_supports(name, None)
        assert kq.fused_supports(MoEActivation.parse(name))
    assert kq.fused_supports("silu", ActivationParams(limit=7.0))
    assert kq.fused_supports("swigluoai_uninterleave", ActivationParams(1.7, 1.0, 7.0))
    for name in ("gelu_tanh", "silu_no_mul", "gelu_no_mul", "relu2_no_mul"):
        assert not kq.fused_supports(name, None)


# ---------------------------------------------------------------------------------------------
# launches: M = 0, configs, bad input, torch.library registration
# ---------------------------------------------------------------------------------------------
class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError(f"a kernel was launched for an empty input (grid {grid})")


def test_empty_input_launches_nothing(monkeypatch):
    monkeypatch.setattr(kq, "_group_quant_fp8_kernel", _NoLaunch())
    monkeypatch.setattr(kq, "_act_mul_group_quant_fp8_kernel", _NoLaunch())
    q, s = kq.per_token_group_quant_fp8_triton(torch.empty(0, 256, device=DEVICE), 128, True, False)
    assert q.shape == (0, 256) and s.shape == (0, 2)
    q, s = kq.act_mul_per_token_group_quant_fp8_triton(torch.empty(0, 512, device=DEVICE), "silu")
    assert q.shape == (0, 256) and s.shape == (0, 2)
    q, s = kq.quantize_mxfp8_triton(torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE))
    assert q.shape == (0, 64) and s.shape == (0, 2) and s.dtype == torch.uint8


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_config_heuristic_is_bounded():
    for m in (1, 37, 1024, 16384):
        for k, g in ((7168, 128), (2048, 128), (7168, 32), (200, 64)):
            num_groups = math.ceil(k / g)
            cfg = kq.quant_kernel_config(m, num_groups, g)
            assert cfg == kq.quant_kernel_config(m, num_groups, g)
            tile = cfg.block_m * cfg.groups_per_program * _next_pow2(g)
            for v in (cfg.block_m, cfg.groups_per_program, cfg.num_warps):
                assert v & (v - 1) == 0, cfg
            assert tile <= 4096 and cfg.groups_per_program <= _next_pow2(num_groups), cfg
    assert kq.quant_kernel_config(16384, 56, 128).block_m > 1  # large M: several rows a program


@pytest.mark.parametrize(
    "config",
    [kq.QuantKernelConfig(4, 4, 2), kq.QuantKernelConfig(1, 1, 1), kq.QuantKernelConfig(16, 2, 4)],
)
def test_partial_tiles_under_config_override(config):
    """Tiles that overhang M and the group count (and a last partial group) mask correctly."""
    x = _activations(37, 200, torch.float32)
    h = (torch.randn(37, 400, device=DEVICE) * 3).to(torch.bfloat16)
    heuristic = kq.quant_kernel_config(37, 4, 64)
    with kq.use_quant_kernel_config(config):
        assert kq.quant_kernel_config(37, 4, 64) == config
        q, s = kq.per_token_group_quant_fp8_triton(x, 64, True, False)
        _check_fused(h, "silu", None, 64, False, True)
        q_mx, s_mx = kq.quantize_mxfp8_triton(x[:, :192])
    assert kq.quant_kernel_config(37, 4, 64) == heuristic  # the override ends with the scope
    q_ref, s_ref = qa.per_token_group_quant_fp8_torch(x, 64, True, False)
    _assert_matches_twin(q, s, q_ref, s_ref, _group_key(64, False))
    q_ref, s_ref = qa.quantize_mxfp8_torch(x[:, :192])
    _assert_matches_twin(q_mx, s_mx, q_ref, s_ref, keys.MXFP8)


def _ones(*shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype, device=DEVICE)


_group_quant = kq.per_token_group_quant_fp8_triton
_act_quant = kq.act_mul_per_token_group_quant_fp8_triton


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: _group_quant([[1.0]], 128), TypeError, "x must be a torch.Tensor"),
        (lambda: _group_quant(_ones(2, 2, 128)), ValueError, r"x must be 2-D .* \(2, 2, 128\)"),
        (lambda: _group_quant(_ones(2, 128, dtype=torch.int32)), TypeError, "x must be bfloat16"),
        (lambda: _group_quant(_ones(2, 128).to(FP8_DTYPE)), TypeError, "x must be bfloat16"),
        (lambda: _group_quant(_ones(2, 128), 0), ValueError, "group_size"),
        (lambda: _group_quant(_ones(2, 128), True), ValueError, "group_size"),
        (lambda: _group_quant(_ones(2, 128), 128, "yes"), TypeError, "column_major_scales"),
        (lambda: _group_quant(_ones(2, 128), 128, False, 1), TypeError, "use_ue8m0"),
        (lambda: kq.quantize_mxfp8_triton(_ones(2, 40)), ValueError, "K % 32"),
        (lambda: kq.quantize_mxfp8_triton(_ones(40)), ValueError, "x must be 2-D"),
        (lambda: _act_quant(_ones(2, 255)), ValueError, "h must be .* even width"),
        (lambda: _act_quant(_ones(2, 256), "gelu_tanh"), ValueError, "no fused kernel"),
        (lambda: _act_quant(_ones(2, 256), "tanh"), ValueError, "activation"),
        (lambda: _act_quant(_ones(2, 256), "silu", {}), TypeError, "params"),
        (lambda: _act_quant(_ones(2, 256), "silu", ActivationParams(alpha=1.0)), ValueError,
         "alpha"),
        (lambda: _act_quant("h"), TypeError, "h must be a torch.Tensor"),
        (lambda: _act_quant(_ones(2, 256), "silu", None, 128, 0), TypeError, "column_major"),
    ],
)  # fmt: skip
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"x is on cpu.*CUDA"):
        kq.per_token_group_quant_fp8_triton(torch.ones(2, 128, device="cpu"), 128)


def test_ops_are_registered_with_fake_implementations():
    x = torch.randn(5, 96, dtype=torch.bfloat16, device=DEVICE)
    h = torch.randn(5, 192, dtype=torch.bfloat16, device=DEVICE)
    checks = [
        (torch.ops.fusedmoe.per_token_group_quant_fp8_triton.default, (x, 64, True, False)),
        (torch.ops.fusedmoe.quantize_mxfp8_triton.default, (x,)),
        (
            torch.ops.fusedmoe.act_mul_per_token_group_quant_fp8_triton.default,
            (h, "swigluoai_uninterleave", 1.702, 1.0, 7.0, True, 64, True, True),
        ),
    ]
    for op, args in checks:
        result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_traces_under_torch_compile():
    x = torch.randn(6, 256, dtype=torch.bfloat16, device=DEVICE)

    def quantize_both(x):
        q, s = kq.per_token_group_quant_fp8_triton(x, 128, True, False)
        q_mx, s_mx = kq.quantize_mxfp8_triton(x)
        return q.float() * 2, s, q_mx, s_mx

    compiled = torch.compile(quantize_both, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x), quantize_both(x), strict=True):
        assert got.stride() == want.stride()
        assert_equal(got.view(torch.uint8) if got.dtype == FP8_DTYPE else got,
                     want.view(torch.uint8) if want.dtype == FP8_DTYPE else want)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the dispatchers of fusedmoe.quant.activation take the Triton path where Triton runs
# ---------------------------------------------------------------------------------------------
def _spy(monkeypatch, name):
    calls = []
    real = getattr(kq, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(kq, name, spy)
    return calls


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter path: CPU tensors")
def test_dispatchers_take_the_triton_path_under_the_interpreter(monkeypatch):
    x = _activations(37, 256, torch.bfloat16)
    h = (torch.randn(37, 512) * 3).to(torch.bfloat16)

    calls = _spy(monkeypatch, "per_token_group_quant_fp8_triton")
    q, s = qa.per_token_group_quant_fp8(x, 128, True, True)
    assert len(calls) == 1
    q_ref, s_ref = qa.per_token_group_quant_fp8_torch(x, 128, True, True)
    _assert_matches_twin(q, s, q_ref, s_ref, _group_key(128, True))

    calls = _spy(monkeypatch, "quantize_mxfp8_triton")
    q, s = qa.quantize_mxfp8(x)
    assert len(calls) == 1
    _assert_matches_twin(q, s, *qa.quantize_mxfp8_torch(x), keys.MXFP8)

    calls = _spy(monkeypatch, "act_mul_per_token_group_quant_fp8_triton")
    params = ActivationParams(limit=4.0)
    q, s = qa.act_mul_per_token_group_quant_fp8(h, "silu", params, 128, False, False)
    assert len(calls) == 1
    q_ref, s_ref = qa.act_mul_per_token_group_quant_fp8_torch(h, "silu", params, 128)
    _assert_matches_twin(
        q, s, q_ref, s_ref, _group_key(128, False), scale_ulps=FUSED_SCALE_ULPS,
        max_mismatch=FUSED_MAX_MISMATCH,
    )  # fmt: skip
    # an activation without a fused kernel falls back to the twin
    q, s = qa.act_mul_per_token_group_quant_fp8(h, "gelu_tanh")
    assert len(calls) == 1
    q_ref, s_ref = qa.act_mul_per_token_group_quant_fp8_torch(h, "gelu_tanh")
    assert_equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernels at DeepSeek-V3 sizes
# ---------------------------------------------------------------------------------------------
GPU_SHAPES = [(1, 7168), (4096, 7168), (1, 2048), (4096, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "k"), GPU_SHAPES)
@pytest.mark.parametrize(("column_major", "use_ue8m0"), [(False, False), (True, True)])
def test_gpu_per_token_group_quant(m, k, column_major, use_ue8m0):
    x = _activations(m, k, torch.bfloat16, "cuda")
    q, scales = kq.per_token_group_quant_fp8_triton(x, 128, column_major, use_ue8m0)
    q_ref, scales_ref = qa.per_token_group_quant_fp8_torch(x, 128, column_major, use_ue8m0)
    assert q.is_cuda and scales.is_cuda
    _assert_matches_twin(q, scales, q_ref, scales_ref, _group_key(128, use_ue8m0))


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "k"), GPU_SHAPES)
def test_gpu_mxfp8(m, k):
    x = _activations(m, k, torch.bfloat16, "cuda")
    q, scales = kq.quantize_mxfp8_triton(x)
    _assert_matches_twin(q, scales, *qa.quantize_mxfp8_torch(x), keys.MXFP8)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "i"), GPU_SHAPES)
@pytest.mark.parametrize(("activation", "params"), ACTIVATION_CASES[::2] + ACTIVATION_CASES[5:6])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_gpu_act_mul(m, i, activation, params, use_ue8m0):
    h = (torch.randn(m, 2 * i, device="cuda") * 3).to(torch.bfloat16)
    _check_fused(h, activation, params, 128, use_ue8m0, use_ue8m0)


@pytest.mark.gpu
def test_gpu_dispatchers_take_the_triton_path(monkeypatch):
    x = _activations(64, 7168, torch.bfloat16, "cuda")
    calls = _spy(monkeypatch, "per_token_group_quant_fp8_triton")
    qa.per_token_group_quant_fp8(x, 128)
    calls_mx = _spy(monkeypatch, "quantize_mxfp8_triton")
    qa.quantize_mxfp8(x)
    assert len(calls) == 1 and len(calls_mx) == 1
