"""quantize / dequantize (fusedmoe.quant.reference) for every QuantKey, from first principles.

Per key and shape: the scale shapes and dtypes the keys docstring states, the scale values
computed here from the cell amax (INT4 with zero points: from the cell's min and max),
element-wise round-trip bounds of the element format, and bit-exact agreement with independent
per-element loops (pure python, tests/quant_reference.py) for the FP8 1 x 128 group, MXFP4,
INT4 (symmetric and with zero points) and INT8 group formats. Then the edge cases: all-zero
cells, huge elements, subnormals, K that the MX / NVFP4 / INT4 groups do not divide,
column-major scales, static scales; and INT4 / INT8 group codes checked by hand (nibble order,
the zero point of an all-positive, all-negative and all-zero group, the codes' ends 0 and 15).

The weight-only groups of 32 and 64 have no name in fusedmoe.quant.keys (keys.int_weight_key
makes them): the cases name them INT4_GROUP32, INT8_GROUP64, ... (DERIVED_KEYS).

Legend: M tokens, K reduced dim, E experts, N rows of a weight; a cell is the set of elements
sharing one scale (tensor, row, 1 x g group, bn x bk block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from fusedmoe.quant import keys
from fusedmoe.quant.activation import (
    per_token_group_quant_fp8_torch,
    quantize_activation,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_int8_per_token,
    quantize_mxfp8,
    quantize_mxfp8_torch,
    quantize_nvfp4,
)
from fusedmoe.quant.config import OperandQuant
from fusedmoe.quant.keys import (
    WEIGHT_ONLY_GROUPS,
    ElementFormat,
    QuantKey,
    ScaleFormat,
    ScaleLayout,
    int_weight_key,
)
from fusedmoe.quant.reference import dequantize, quantize
from tests.helpers import assert_close, assert_equal
from tests.quant_reference import (
    AMAX_EPS,
    ceil_log2,
    decode_fp4_bytes,
    dequant_int4,
    e2m1_code,
    f32,
    floor_log2,
    fp8_round,
    group_quant_fp8_loops,
    int4_codes,
    int4_quant_loops,
    int8_group_quant_loops,
    mxfp4_quant_loops,
)

FP8 = torch.float8_e4m3fn
INT4, INT8 = ElementFormat.INT4, ElementFormat.INT8

#: the weight-only group keys without a name in keys (INT4_GROUP128 has one): name -> key
DERIVED_KEYS = {
    f"{element.name}_GROUP{g}": int_weight_key(element, g)
    for element in (INT4, INT8)
    for g in WEIGHT_ONLY_GROUPS
    if not hasattr(keys, f"{element.name}_GROUP{g}")
}


def key_of(name: str) -> QuantKey:
    return getattr(keys, name) if hasattr(keys, name) else DERIVED_KEYS[name]


# ---- what each key produces: the table of the keys docstring ---------------------------------
@dataclass(frozen=True)
class Case:
    key_name: str
    shape: tuple[int, ...]  # of x
    q_shape: tuple[int, ...]
    q_dtype: torch.dtype
    scale_shape: tuple[int, ...]
    scale_dtype: torch.dtype
    global_shape: tuple[int, ...] | None = None
    zero_point: bool = False  # INT4: with uint8 zero points of the scale's shape

    @property
    def key(self) -> QuantKey:
        return key_of(self.key_name)

    @property
    def id(self) -> str:
        zp = "-zero_points" if self.zero_point else ""
        return f"{self.key_name}{zp}-{'x'.join(map(str, self.shape))}"


F32, U8 = torch.float32, torch.uint8
CASES = [
    # TENSOR: activations [1], weights [E]
    Case("FP8_STATIC_TENSOR", (37, 200), (37, 200), FP8, (1,), F32),
    Case("FP8_DYNAMIC_TENSOR", (37, 200), (37, 200), FP8, (1,), F32),
    Case("FP8_TENSOR", (3, 200, 72), (3, 200, 72), FP8, (3,), F32),
    # ROW: activations [M, 1] (per token), weights [E, N] (per channel)
    Case("FP8_DYNAMIC_TOKEN", (37, 200), (37, 200), FP8, (37, 1), F32),
    Case("FP8_CHANNEL", (3, 200, 72), (3, 200, 72), FP8, (3, 200), F32),
    Case("INT8_DYNAMIC_TOKEN", (37, 200), (37, 200), torch.int8, (37, 1), F32),
    Case("INT8_CHANNEL", (3, 200, 72), (3, 200, 72), torch.int8, (3, 200), F32),
    # GROUP 1 x g: activations [M, ceil(K/g)], weights [E, N, ceil(K/g)]
    Case("FP8_DYNAMIC_GROUP128", (37, 200), (37, 200), FP8, (37, 2), F32),
    Case("FP8_DYNAMIC_GROUP128", (5, 72), (5, 72), FP8, (5, 1), F32),
    Case("FP8_DYNAMIC_GROUP128", (2, 72, 200), (2, 72, 200), FP8, (2, 72, 2), F32),
    Case("FP8_DYNAMIC_GROUP128_UE8M0", (37, 200), (37, 200), FP8, (37, 2), F32),
    Case("FP8_DYNAMIC_GROUP128_UE8M0", (3, 200, 72), (3, 200, 72), FP8, (3, 200, 1), F32),
    Case("MXFP8", (37, 96), (37, 96), FP8, (37, 3), U8),
    Case("MXFP8", (3, 40, 64), (3, 40, 64), FP8, (3, 40, 2), U8),
    Case("MXFP4", (37, 96), (37, 48), U8, (37, 3), U8),
    Case("MXFP4", (3, 40, 64), (3, 40, 32), U8, (3, 40, 2), U8),
    Case("NVFP4", (37, 48), (37, 24), U8, (37, 3), FP8, (1,)),
    Case("NVFP4", (3, 40, 80), (3, 40, 40), U8, (3, 40, 5), FP8, (3,)),
    # INT4 weights (GROUP 1 x g, g 32 / 64 / 128): uint8 [E, N, K/2], float32 [E, N, K/g], and
    # with zero points uint8 [E, N, K/g]; [M, K] operands as the activation GROUP layout
    Case("INT4_GROUP128", (3, 40, 256), (3, 40, 128), U8, (3, 40, 2), F32),
    Case("INT4_GROUP128", (3, 40, 256), (3, 40, 128), U8, (3, 40, 2), F32, zero_point=True),
    Case("INT4_GROUP64", (3, 40, 192), (3, 40, 96), U8, (3, 40, 3), F32),
    Case("INT4_GROUP64", (2, 24, 128), (2, 24, 64), U8, (2, 24, 2), F32, zero_point=True),
    Case("INT4_GROUP32", (3, 40, 96), (3, 40, 48), U8, (3, 40, 3), F32),
    Case("INT4_GROUP32", (3, 40, 96), (3, 40, 48), U8, (3, 40, 3), F32, zero_point=True),
    Case("INT4_GROUP32", (37, 64), (37, 32), U8, (37, 2), F32, zero_point=True),
    # INT8 weight-only group scales: int8 [E, N, K], float32 [E, N, K/g]
    Case("INT8_GROUP32", (3, 40, 96), (3, 40, 96), torch.int8, (3, 40, 3), F32),
    Case("INT8_GROUP64", (2, 24, 128), (2, 24, 128), torch.int8, (2, 24, 2), F32),
    Case("INT8_GROUP128", (3, 40, 256), (3, 40, 256), torch.int8, (3, 40, 2), F32),
    # BLOCK bn x bk: weights [E, ceil(N/bn), ceil(K/bk)] (and [ceil(M/bn), ceil(K/bk)] in 2-D)
    Case("FP8_BLOCK128", (3, 200, 72), (3, 200, 72), FP8, (3, 2, 1), F32),
    Case("FP8_BLOCK128", (2, 72, 200), (2, 72, 200), FP8, (2, 1, 2), F32),
    Case("FP8_BLOCK128", (1, 256, 384), (1, 256, 384), FP8, (1, 2, 3), F32),
    Case("FP8_BLOCK128", (37, 200), (37, 200), FP8, (1, 2), F32),
]
CASE_IDS = [c.id for c in CASES]


def test_every_key_has_a_case():
    every_key = {name for name, v in vars(keys).items() if isinstance(v, QuantKey)}
    assert every_key | set(DERIVED_KEYS) == {c.key_name for c in CASES}
    # every INT4 / INT8 weight-only group size, INT4 symmetric and with zero points
    assert {key_of(n).group[1] for n in DERIVED_KEYS} | {128} == set(WEIGHT_ONLY_GROUPS)
    int4 = [c for c in CASES if c.key.element is INT4]
    assert {(c.key.group[1], c.zero_point) for c in int4} == {
        (g, zp) for g in WEIGHT_ONLY_GROUPS for zp in (False, True)
    }


def random_operand(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fresh random values whose magnitude varies by 2**-6 .. 2**6 from row to row, so that one
    block mixes large and tiny rows (tiny ones land in the e4m3 subnormals)."""
    x = torch.randn(shape)
    rows = torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1)).float())
    return (x * rows).to(dtype)


def static_scale(case: Case) -> torch.Tensor | None:
    return torch.tensor([0.004]) if case.key.static else None


def run(case: Case, x: torch.Tensor):
    return quantize(x, case.key, static_scale(case), zero_point=case.zero_point)


def dequant(qx, key: QuantKey) -> torch.Tensor:
    return dequantize(qx.q, qx.scale, key, qx.global_scale, qx.zero_point)


# ---- cells, computed here independently (flat cell id per element, scatter amax) -------------
def cell_grid(key: QuantKey, shape3: tuple[int, int, int]) -> tuple[int, ...]:
    b, r, k = shape3
    if key.layout is ScaleLayout.TENSOR:
        return (b,)
    if key.layout is ScaleLayout.ROW:
        return (b, r)
    bn, bk = key.group
    return (b, math.ceil(r / bn), math.ceil(k / bk))


def cell_ids(key: QuantKey, shape3: tuple[int, int, int]) -> torch.Tensor:
    """[B, R, K] -> the flat index of each element's cell in cell_grid."""
    b, r, k = shape3
    bi = torch.arange(b).view(b, 1, 1)
    ri = torch.arange(r).view(1, r, 1)
    ki = torch.arange(k).view(1, 1, k)
    grid = cell_grid(key, shape3)
    if key.layout is ScaleLayout.TENSOR:
        ids = bi + 0 * ri + 0 * ki
    elif key.layout is ScaleLayout.ROW:
        ids = bi * r + ri + 0 * ki
    else:
        bn, bk = key.group
        ids = (bi * grid[1] + ri // bn) * grid[2] + ki // bk
    return ids.expand(b, r, k)


def cell_reduce(x3: torch.Tensor, key: QuantKey, reduce: str) -> torch.Tensor:
    """amax, amin of the (signed) elements of each cell: float32 [cells], flat."""
    grid = cell_grid(key, tuple(x3.shape))
    ids = cell_ids(key, tuple(x3.shape)).reshape(-1)
    out = torch.zeros(math.prod(grid), dtype=torch.float32)
    return out.scatter_reduce(0, ids, x3.reshape(-1).float(), reduce, include_self=False)


def cell_amax(x3: torch.Tensor, key: QuantKey) -> torch.Tensor:
    return cell_reduce(x3.abs(), key, "amax")


def expected_int4(x3: torch.Tensor, key: QuantKey, zero_point: bool):
    """INT4: (the float32 scale, the zero point) of every cell. Symmetric: amax / 7 and 8; zero
    points: the cell's range stretched to hold 0, [min(lo, 0), max(hi, 0)], in 15 steps."""
    if not zero_point:
        return [f32(max(a, AMAX_EPS) / 7.0) for a in cell_amax(x3, key).tolist()], None
    scales, zeros = [], []
    high, low = cell_reduce(x3, key, "amax").tolist(), cell_reduce(x3, key, "amin").tolist()
    for hi, lo in zip(high, low, strict=True):
        hi, lo = max(hi, 0.0), min(lo, 0.0)
        s = max(f32(f32(hi - lo) / 15.0), AMAX_EPS)
        scales.append(s)
        zeros.append(max(0, min(15, round(f32(-lo / s)))))
    return scales, zeros


def expected_scales(x3: torch.Tensor, key: QuantKey) -> tuple[list[float], list[float] | None]:
    """The stored scale of every cell (E8M0: the code; NVFP4: the e4m3 value) and the NVFP4
    global scale per batch, from the formulas of the spec, evaluated one cell at a time."""
    amax = cell_amax(x3, key).tolist()
    fmt_max = {ElementFormat.FP8: 448.0, ElementFormat.INT8: 127.0, ElementFormat.FP4: 6.0}
    fmt_max = fmt_max[key.element]
    if key.scale_format is ScaleFormat.E8M0:
        emax = {ElementFormat.FP8: 8, ElementFormat.FP4: 2}[key.element]
        codes = [0 if a == 0 else max(0, min(254, floor_log2(a) - emax + 127)) for a in amax]
        return codes, None
    if key.scale_format is ScaleFormat.E4M3_GLOBAL:
        b = x3.shape[0]
        tensor_amax = x3.abs().reshape(b, -1).amax(dim=1).float().tolist()
        g = [f32(max(a, AMAX_EPS) / (448.0 * 6.0)) for a in tensor_amax]
        per_batch = len(amax) // b
        stored = [
            fp8_round(max(f32(f32(a / 6.0) / g[i // per_batch]), 2.0**-9))
            for i, a in enumerate(amax)
        ]
        return stored, g
    scales = [f32(max(a, AMAX_EPS) / fmt_max) for a in amax]
    if key.scale_format is ScaleFormat.UE8M0:
        scales = [2.0 ** ceil_log2(s) for s in scales]
    return scales, None


def element_scales(q, key: QuantKey, shape3) -> torch.Tensor:
    """The dequantization multiplier of every element [B, R, K], float64, from the stored scale."""
    grid = cell_grid(key, shape3)
    stored = q.scale.reshape(grid)
    if key.scale_format is ScaleFormat.E8M0:
        cells = torch.exp2(stored.double() - 127.0)
    else:
        cells = stored.double()
    if key.scale_format is ScaleFormat.E4M3_GLOBAL:
        cells = cells * q.global_scale.double().view(-1, *([1] * (cells.dim() - 1)))
    return cells.reshape(-1)[cell_ids(key, shape3)]


def element_values(q, key: QuantKey, shape3) -> torch.Tensor:
    """The stored elements decoded, before scaling: float64 [B, R, K] (INT4: code - zero)."""
    if key.element is INT4:
        codes = int4_codes(q.q).reshape(shape3)
        if q.zero_point is None:
            return (codes - 8).double()
        zeros = q.zero_point.reshape(-1).long()[cell_ids(key, shape3)]
        return (codes - zeros).double()
    values = decode_fp4_bytes(q.q) if key.element is ElementFormat.FP4 else q.q.double()
    return values.reshape(shape3)


def as3(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == 2 else x


# ---- shapes, dtypes and scale values ---------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_shapes_and_dtypes(case):
    qx = run(case, random_operand(case.shape))
    assert qx.q.shape == case.q_shape and qx.q.dtype == case.q_dtype
    assert qx.scale.shape == case.scale_shape and qx.scale.dtype == case.scale_dtype
    if case.global_shape is None:
        assert qx.global_scale is None
    else:
        assert qx.global_scale.shape == case.global_shape
        assert qx.global_scale.dtype == torch.float32
    if case.zero_point:
        assert qx.zero_point.shape == case.scale_shape and qx.zero_point.dtype == U8
    else:
        assert qx.zero_point is None
    deq = dequant(qx, case.key)
    assert deq.shape == case.shape and deq.dtype == torch.float32


@pytest.mark.parametrize("case", [c for c in CASES if not c.key.static], ids=lambda c: c.id)
def test_scale_values_from_the_cell_amax(case):
    x = random_operand(case.shape)
    qx = run(case, x)
    if case.key.element is INT4:
        want, want_zeros = expected_int4(as3(x), case.key, case.zero_point)
        assert qx.scale.reshape(-1).tolist() == want
        if want_zeros is not None:
            assert qx.zero_point.reshape(-1).tolist() == want_zeros
            assert len(set(want_zeros)) > 1, "zero points that differ from cell to cell"
        return
    want, want_global = expected_scales(as3(x), case.key)
    stored = qx.scale.reshape(-1)
    got = stored.float().tolist() if stored.dtype == FP8 else stored.tolist()
    assert got == want
    if want_global is not None:
        assert qx.global_scale.tolist() == want_global


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_round_trip_bounds_element_wise(case, dtype):
    """|dequantize(quantize(x)) - x| within the rounding of the element format, per element:

    FP8 e4m3   |v| = |x| / s <= 448: half a grid step, <= max(2**-4 |x|, 2**-10 s) (subnormals)
               |v| > 448 (MX scales, static scales): saturated, x_hat = +-448 s exactly
    INT8       <= 0.5 s
    FP4 E2M1   |v| < 6: half the grid gap at |v| (0.25 below 2, 0.5 below 4, 1 below 6) * s
               |v| >= 6: saturated, x_hat = +-6 s exactly
    INT4       <= 0.5 s (the amax is 7 s, the range 15 s: the codes' ends 0 and 15 only cut off
               a tie that rounds outwards, by half a step)
    """
    x = random_operand(case.shape, dtype)
    key = case.key
    qx = run(case, x)
    shape3 = tuple(as3(x).shape)
    s = element_scales(qx, key, shape3)
    x64 = as3(x).double()
    # dequantize, as the spec defines it, equals the product computed here
    x_hat = dequant(qx, key).double().reshape(shape3)
    assert_close(x_hat, element_values(qx, key, shape3) * s, tol=2e-7, what="dequantize")

    err = (x_hat - x64).abs()
    v = x64.abs() / s
    slack = 1 + 2.0**-18  # float32 x / s and q * s
    if key.element in (INT8, INT4):
        bound = 0.5 * s
        saturated = torch.zeros_like(v, dtype=torch.bool)
    else:
        fmt_max = 448.0 if key.element is ElementFormat.FP8 else 6.0
        saturated = v > fmt_max * slack
        if key.element is ElementFormat.FP8:
            bound = torch.maximum(2.0**-4 * x64.abs(), 2.0**-10 * s)
        else:
            half_gap = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
            bound = half_gap * s
        sat_value = torch.sign(x64) * fmt_max * s
        assert_close(x_hat[saturated], sat_value[saturated], tol=1e-6, what="saturated")
    ok = (err <= bound * slack) | saturated
    if not bool(ok.all()):
        i = tuple(int(j) for j in (~ok).nonzero()[0])
        raise AssertionError(
            f"{key.name}: |x_hat - x| = {float(err[i]):.4g} > bound {float(bound[i]):.4g} at {i} "
            f"(x {float(x64[i]):.6g}, x_hat {float(x_hat[i]):.6g}, scale {float(s[i]):.4g})"
        )
    if not key.static and key.scale_format in (ScaleFormat.FLOAT32, ScaleFormat.UE8M0):
        assert not bool(saturated.any()), "an amax scale never saturates"


# ---- independent loops, bit for bit ----------------------------------------------------------
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(3, 200), (4, 128), (2, 37)])
def test_fp8_group128_matches_per_element_loops(shape, ue8m0):
    x = random_operand(shape)
    x[0, :5] = torch.tensor([448.0, -3.5, 2.0**-12, 0.0, 1e-3])  # an exact amax, a subnormal
    key = keys.FP8_DYNAMIC_GROUP128_UE8M0 if ue8m0 else keys.FP8_DYNAMIC_GROUP128
    qx = quantize(x, key)
    q_want, s_want = group_quant_fp8_loops(x, 128, ue8m0)
    assert qx.q.float().tolist() == q_want
    assert qx.scale.tolist() == s_want
    # the activation quantizer's torch twin is the same function
    q2, s2 = per_token_group_quant_fp8_torch(x, 128, use_ue8m0=ue8m0)
    assert q2.float().tolist() == q_want and s2.tolist() == s_want


def test_fp8_group_size_other_than_128():
    x = random_operand((3, 100))
    q, s = per_token_group_quant_fp8_torch(x, 32)
    q_want, s_want = group_quant_fp8_loops(x, 32)
    assert q.float().tolist() == q_want and s.tolist() == s_want


def test_mxfp4_weights_match_per_element_loops():
    w = random_operand((2, 3, 96))
    # ties, saturation (amax 7 * 2**3: shared exponent 3, 7 -> 6) and an all-zero group
    w[0, 0, :32] = torch.randn(32) * 0.1
    w[0, 0, :10] = torch.tensor([7.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, -0.1]) * 8
    w[1, 2, 32:64] = 0.0
    qw = quantize(w, keys.MXFP4)
    packed, codes = mxfp4_quant_loops(w)
    assert qw.q.tolist() == packed
    assert qw.scale.tolist() == codes
    assert qw.scale[1, 2, 1] == 0  # the all-zero group: the smallest exponent
    assert qw.q[0, 0, :5].tolist() == [0x07, 0x22, 0x44, 0x66, 0x8C]


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("group", WEIGHT_ONLY_GROUPS)
def test_int4_weights_match_per_element_loops(group, zero_points):
    w = random_operand((2, 3, 256))
    # ties (scale 1: amax 7, or the range [-3.5, 11.5]), a group all of one sign, an all-zero one
    w[0, 0, :group] = torch.rand(group) - 0.5
    w[0, 0, :8] = torch.tensor([7.0, 0.5, 1.5, -2.5, 3.5, -0.5, 6.5, -7.0])
    if zero_points:
        w[0, 0, :8] = torch.tensor([11.5, -3.5, 0.5, 1.5, -2.5, 2.5, 5.5, 0.0])
    w[1, 1, :group] = w[1, 1, :group].abs() + 0.5
    w[1, 2, -group:] = -w[1, 2, -group:].abs() - 0.5
    w[0, 1, :group] = 0.0
    key = int_weight_key(INT4, group)
    qw = quantize(w, key, zero_point=zero_points)
    packed, scales, zeros = int4_quant_loops(w, group, zero_points)
    assert qw.q.tolist() == packed
    assert qw.scale.tolist() == scales
    assert (qw.zero_point is None) == (zeros is None)
    if zeros is not None:
        assert qw.zero_point.tolist() == zeros
    assert scales[0][0][0] == 1.0 and (zeros is None or zeros[0][0][0] == 4)  # the ties above
    # dequantize: (code - zero) * scale, the low nibble being the element of even k
    want = dequant_int4(qw.q, qw.scale, qw.zero_point).float()
    assert_equal(dequantize(qw.q, qw.scale, key, zero_point=qw.zero_point), want)


def test_int4_symmetric_codes_by_hand():
    """scale = amax / 7, code = round(x / scale) + 8 (ties to even) in [1, 15], two codes per
    byte with the element of even k in the low nibble."""
    x = torch.zeros(1, 64)
    x[0, :8] = torch.tensor([7.0, -7.0, 0.5, 1.5, -0.5, -2.5, 3.49, -6.6])  # scale 1
    x[0, 32:36] = torch.tensor([-14.0, 3.0, 1.0, 5.0])  # scale 2
    x[0, 36:] = 0.25  # 0.125 steps: code 8
    qx = quantize(x, int_weight_key(INT4, 32))
    assert qx.scale.tolist() == [[1.0, 2.0]] and qx.zero_point is None
    # codes 15 1 | 8 10 | 8 6 | 11 1 | 8 8 ..., then 1 10 | 8 10 | 8 8 ...
    assert qx.q[0, :4].tolist() == [0x1F, 0xA8, 0x68, 0x1B]
    assert qx.q[0, 4:16].tolist() == [0x88] * 12
    assert qx.q[0, 16:].tolist() == [0xA1, 0xA8] + [0x88] * 14
    x_hat = dequantize(qx.q, qx.scale, int_weight_key(INT4, 32))
    assert x_hat[0, :8].tolist() == [7.0, -7.0, 0.0, 2.0, 0.0, -2.0, 3.0, -7.0]
    assert x_hat[0, 32:36].tolist() == [-14.0, 4.0, 0.0, 4.0]
    assert not bool(x_hat[0, 8:32].any()) and not bool(x_hat[0, 36:].any())
    # symmetric codes never use 0: -amax is code 1 (-7 steps), +amax code 15
    codes = int4_codes(quantize(random_operand((4, 128)), keys.INT4_GROUP128).q)
    assert int(codes.min()) >= 1 and int(codes.max()) <= 15


def test_int4_zero_points_by_hand():
    """scale = (max - min) / 15 over the group's range stretched to hold 0, zero = round(-min /
    scale) (uint8, one per group), code = round(x / scale) + zero in [0, 15]."""
    x = torch.zeros(1, 128)
    # range [-3.5, 11.5]: scale 1, zero round(3.5) = 4; both ends are ties that round outwards:
    # 11.5 -> 12 + 4 = 16 saturates at code 15 (11), -3.5 -> -4 + 4 = code 0 (-4)
    x[0, :8] = torch.tensor([11.5, -3.5, 0.0, 1.5, -1.5, 2.5, 5.0, 0.25])
    # all positive (min 1 > 0): the range is [0, 7.5], scale 0.5, zero 0
    x[0, 32:64] = 1.0
    x[0, 32:36] = torch.tensor([1.0, 7.5, 3.0, 0.25])
    # all negative: the range is [-7.5, 0], scale 0.5, zero 15: -7.5 is code 0, -0.5 code 14
    x[0, 64:96] = -1.0
    x[0, 64:68] = torch.tensor([-7.5, -0.5, -3.0, -0.75])
    # x[0, 96:]: all zero: scale the amax floor, zero 0, codes 0
    key = int_weight_key(INT4, 32)
    qx = quantize(x, key, zero_point=True)
    assert qx.scale.tolist() == [[1.0, 0.5, 0.5, AMAX_EPS]]
    assert qx.zero_point.dtype == torch.uint8 and qx.zero_point.tolist() == [[4, 0, 15, 0]]
    q = qx.q[0].tolist()
    assert q[:4] == [0x0F, 0x64, 0x62, 0x49] and q[4:16] == [0x44] * 12  # 15 0 | 4 6 | 2 6 | 9 4
    assert q[16:18] == [0xF2, 0x06] and q[18:32] == [0x22] * 14  # 2 15 | 6 0 | 2 2 ...
    assert q[32:34] == [0xE0, 0xD9] and q[34:48] == [0xDD] * 14  # 0 14 | 9 13 | 13 13 ...
    assert q[48:] == [0x00] * 16
    x_hat = dequantize(qx.q, qx.scale, key, zero_point=qx.zero_point)[0]
    assert x_hat[:8].tolist() == [11.0, -4.0, 0.0, 2.0, -2.0, 2.0, 5.0, 0.0]
    assert x_hat[32:36].tolist() == [1.0, 7.5, 3.0, 0.0] and x_hat[36:64].tolist() == [1.0] * 28
    assert (
        x_hat[64:68].tolist() == [-7.5, -0.5, -3.0, -1.0] and x_hat[68:96].tolist() == [-1.0] * 28
    )
    assert x_hat[96:].tolist() == [0.0] * 32
    # the same codes read without their zero points (zero 8) are other weights
    assert not torch.equal(dequantize(qx.q, qx.scale, key), x_hat[None])


def test_int4_zero_point_codes_span_0_to_15():
    """With zero points a group's min is code 0 (when below 0) and its codes reach 15: all
    16 codes are used, not the 15 of the symmetric rule."""
    w = random_operand((2, 8, 128))
    qw = quantize(w, keys.INT4_GROUP128, zero_point=True)
    codes = int4_codes(qw.q).view(2, 8, 128)
    lows = w.argmin(dim=-1, keepdim=True)
    assert bool((codes.gather(-1, lows) == 0).all()), "the min is code 0"
    assert int(codes.max()) == 15 and int(codes.min()) == 0


@pytest.mark.parametrize("group", WEIGHT_ONLY_GROUPS)
def test_int8_group_weights_match_per_element_loops(group):
    w = random_operand((2, 3, 256))
    w[0, 0, :group] = 0.0
    key = int_weight_key(INT8, group)
    qw = quantize(w, key)
    values, scales = int8_group_quant_loops(w, group)
    assert qw.q.tolist() == values and qw.scale.tolist() == scales


def test_int8_group_scales_by_hand():
    """scale = amax / 127 per 1 x g group along K, q = round(x / scale) (ties to even)."""
    x = torch.zeros(2, 64)
    x[0, :32] = 1.0
    x[0, :6] = torch.tensor([127.0, -127.0, 2.5, 3.5, -0.4, 100.6])  # scale 1
    x[0, 32:] = -2.0
    x[0, 32:36] = torch.tensor([254.0, -3.0, 5.0, 1.0])  # scale 2
    x[1, 32] = 0.5  # x[1, :32] all zero
    key = int_weight_key(INT8, 32)
    qx = quantize(x, key)
    assert qx.scale.tolist() == [[1.0, 2.0], [f32(AMAX_EPS / 127.0), f32(0.5 / 127.0)]]
    assert qx.q[0, :6].tolist() == [127, -127, 2, 4, 0, 101] and qx.q[0, 6:32].tolist() == [1] * 26
    assert qx.q[0, 32:36].tolist() == [127, -2, 2, 0] and qx.q[0, 36:].tolist() == [-1] * 28
    assert qx.q[1].tolist() == [0] * 32 + [127] + [0] * 31
    x_hat = dequantize(qx.q, qx.scale, key)
    assert x_hat[0, :6].tolist() == [127.0, -127.0, 2.0, 4.0, 0.0, 101.0]
    assert x_hat[0, 32:36].tolist() == [254.0, -4.0, 4.0, 0.0]
    # one scale per row instead (per channel): the first group's small values lose their steps
    per_channel = quantize(x, keys.INT8_DYNAMIC_TOKEN)
    assert per_channel.scale[0].tolist() == [2.0] and per_channel.q[0, 2:4].tolist() == [1, 2]


def test_int8_groups_accept_a_partial_last_group():
    # INT8 groups, as the FP8 ones, do not require K % g == 0: K = 40 in groups of 32 has a
    # last group of 8 scaled by its own amax (the int4 / MX / NVFP4 groups refuse such a K)
    x = torch.randn(2, 3, 40)
    x[..., :32] *= 100.0
    qx = quantize(x, int_weight_key(INT8, 32))
    assert qx.scale.shape == (2, 3, 2)
    want = [[[f32(max(abs(v) for v in row[a:b]) / 127.0) for a, b in ((0, 32), (32, 40))]
             for row in e] for e in x.tolist()]  # fmt: skip
    assert qx.scale.tolist() == want


# ---- edge cases ------------------------------------------------------------------------------
DYNAMIC = [c for c in CASES if not c.key.static]


@pytest.mark.parametrize("case", DYNAMIC, ids=lambda c: c.id)
def test_all_zero_cells_give_finite_nonzero_scales_and_zero_q(case):
    x = random_operand(case.shape)
    x[..., 0, :] = 0.0  # one row: a whole ROW cell, whole GROUP cells, part of a BLOCK
    if case.key.layout is ScaleLayout.BLOCK:
        x[..., :128, :128] = 0.0  # a whole block
    x3 = as3(x)
    qx = run(case, x)
    shape3 = tuple(x3.shape)
    s = element_scales(qx, case.key, shape3)
    assert bool(s.isfinite().all()) and bool((s > 0).all()), "scales finite and non-zero"
    values = element_values(qx, case.key, shape3)
    assert not bool(values.isnan().any())
    zero = x3 == 0
    assert bool((values[zero] == 0).all()), "zeros quantize to zero"
    x_hat = dequant(qx, case.key)
    assert bool((as3(x_hat)[zero] == 0).all())
    # an all-zero tensor as well
    qz = run(case, torch.zeros(case.shape))
    sz = element_scales(qz, case.key, shape3)
    assert bool(sz.isfinite().all()) and bool((sz > 0).all())
    assert bool((element_values(qz, case.key, shape3) == 0).all())
    assert_equal(dequant(qz, case.key), torch.zeros(case.shape))


@pytest.mark.parametrize("huge", [1e30, 3.0e38, -3.0e38])
@pytest.mark.parametrize("case", DYNAMIC, ids=lambda c: c.id)
def test_a_huge_element_gives_no_nan(case, huge):
    x = random_operand(case.shape)
    x.view(-1)[7] = huge
    qx = run(case, x)
    shape3 = tuple(as3(x).shape)
    s = element_scales(qx, case.key, shape3)
    assert bool(s.isfinite().all()) and bool((s > 0).all())
    x_hat = dequant(qx, case.key)
    assert bool(x_hat.isfinite().all())
    # the huge element itself comes back within the format's relative rounding (FP4: 1/4; INT4:
    # half a step of amax / 7, or of a range of at least |huge| / 15)
    rel = {ElementFormat.FP8: 2.0**-4, INT8: 1 / 254, ElementFormat.FP4: 0.25, INT4: 1 / 14}
    got = float(x_hat.view(-1)[7])
    assert abs(got - huge) <= rel[case.key.element] * abs(huge) * (1 + 1e-6)


def test_static_scale_saturates_at_448():
    x = torch.tensor([[1e6, -1e6, 3.0, 448.0 * 2, 0.5]])
    q, s = quantize_fp8_per_tensor(x, torch.tensor([2.0]))
    assert q.float().tolist() == [[448.0, -448.0, 1.5, 448.0, 0.25]]
    assert s.tolist() == [2.0]


def test_subnormal_inputs():
    # float32 subnormal inputs: the scale follows the 1e-10 amax floor, q stays finite
    x = torch.full((2, 128), 1e-40)
    x[1] = -3e-39
    q, s = per_token_group_quant_fp8_torch(x)
    assert s.tolist() == [[f32(AMAX_EPS / 448.0)]] * 2
    assert bool(q.float().isfinite().all())
    # the e4m3 subnormals: values at 2**-9 .. 2**-6 of the scale keep their subnormal value
    tiny = torch.tensor([[448.0, 3 * 2.0**-9, 2.0**-10, 1.5 * 2.0**-9, 5 * 2.0**-9, -(2.0**-8)]])
    q, s = quantize_fp8_per_tensor(tiny, torch.tensor([1.0]))
    assert q.float().tolist() == [[448.0, 3 * 2.0**-9, 0.0, 2 * 2.0**-9, 5 * 2.0**-9, -(2.0**-8)]]
    assert_equal(q.view(torch.uint8), tiny.to(FP8).view(torch.uint8), what="vs torch cast")


@pytest.mark.parametrize(
    ("key_name", "k"),
    [("MXFP8", 48), ("MXFP8", 100), ("MXFP4", 48), ("MXFP4", 40), ("NVFP4", 40), ("NVFP4", 24),
     ("INT4_GROUP128", 96), ("INT4_GROUP128", 192), ("INT4_GROUP64", 96), ("INT4_GROUP32", 40)],
)  # fmt: skip
@pytest.mark.parametrize("ndim", [2, 3])
def test_mx_nvfp4_and_int4_refuse_partial_groups(key_name, k, ndim):
    x = torch.randn(4, k) if ndim == 2 else torch.randn(2, 4, k)
    with pytest.raises(ValueError, match=f"K = {k} is not a multiple"):
        quantize(x, key_of(key_name))
    if key_of(key_name).element is INT4:
        with pytest.raises(ValueError, match=f"K = {k} is not a multiple"):
            quantize(x, key_of(key_name), zero_point=True)


def test_mxfp8_activation_quantizer_refuses_partial_groups():
    with pytest.raises(ValueError, match="K % 32 == 0, got K = 48"):
        quantize_mxfp8(torch.randn(3, 48))


def test_fp8_group_and_block_accept_partial_groups_with_their_own_scale():
    # K = 200: the last group holds 72 elements and is scaled by their amax, not the first's
    x = torch.randn(2, 200)
    x[:, :128] *= 100.0
    _, s = per_token_group_quant_fp8_torch(x)
    want = [[f32(max(abs(v) for v in row[a:b]) / 448.0) for a, b in ((0, 128), (128, 200))]
            for row in x.tolist()]  # fmt: skip
    assert s.tolist() == want


def test_column_major_scales():
    x = random_operand((37, 200))
    row_major = quantize(x, keys.FP8_DYNAMIC_GROUP128)
    col_major = quantize(x, keys.FP8_DYNAMIC_GROUP128, column_major_scales=True)
    assert col_major.scale.shape == (37, 2)
    assert col_major.scale.stride() == (1, 37)
    assert row_major.scale.stride() == (2, 1)
    assert_equal(col_major.scale, row_major.scale, what="scale values")
    assert_equal(col_major.q.view(torch.uint8), row_major.q.view(torch.uint8), what="q")
    _, s = per_token_group_quant_fp8_torch(x, 128, column_major_scales=True)
    assert s.stride() == (1, 37)
    assert_equal(s, row_major.scale, what="scale values")
    # dequantize reads a column-major scale right
    assert_equal(
        dequantize(col_major.q, col_major.scale, keys.FP8_DYNAMIC_GROUP128),
        dequantize(row_major.q, row_major.scale, keys.FP8_DYNAMIC_GROUP128),
    )


@pytest.mark.parametrize(
    ("key_name", "shape"),
    [("FP8_DYNAMIC_TOKEN", (4, 64)), ("FP8_DYNAMIC_TENSOR", (4, 64)),
     ("FP8_DYNAMIC_GROUP128", (2, 4, 64))],
)  # fmt: skip
def test_column_major_scales_only_for_group_activations(key_name, shape):
    with pytest.raises(ValueError, match="column_major_scales applies to the group scales"):
        quantize(torch.randn(shape), getattr(keys, key_name), column_major_scales=True)


def test_static_scales_are_used_as_given():
    x = random_operand((5, 64))
    scale = torch.tensor([0.01])
    qx = quantize(x, keys.FP8_STATIC_TENSOR, scale)
    assert qx.scale.tolist() == [f32(0.01)]
    want = [[fp8_round(f32(v / f32(0.01))) for v in row] for row in x.tolist()]
    assert qx.q.float().tolist() == want
    # the dynamic key on the same x computes its own, different scale
    assert quantize(x, keys.FP8_DYNAMIC_TENSOR).scale.tolist() != [f32(0.01)]
    q, s = quantize_fp8_per_tensor(x, scale)
    assert q.float().tolist() == want and s.tolist() == [f32(0.01)]
    # per-expert static scales of a 3-D operand
    w = torch.randn(3, 4, 8)
    scales = torch.tensor([0.5, 0.25, 1.0])
    qw = quantize(w, keys.FP8_STATIC_TENSOR, scales)
    assert qw.scale.tolist() == scales.tolist()
    assert_equal(qw.q.view(torch.uint8), (w / scales.view(3, 1, 1)).to(FP8).view(torch.uint8))


@pytest.mark.parametrize(
    ("key_name", "scale", "match"),
    [
        ("FP8_STATIC_TENSOR", None, "a static key needs its scale"),
        ("FP8_DYNAMIC_TENSOR", torch.tensor([1.0]), "a dynamic key computes its own scale"),
        ("FP8_STATIC_TENSOR", torch.tensor([0.0]), "static scales must be positive"),
        ("FP8_STATIC_TENSOR", torch.tensor([-1.0]), "static scales must be positive"),
        ("FP8_STATIC_TENSOR", torch.tensor([1.0, 2.0]), r"1 element\(s\).*got \(2,\)"),
        ("FP8_STATIC_TENSOR", 0.5, r"must be a tensor of 1 element\(s\).*got float"),
    ],
)
def test_static_scale_errors(key_name, scale, match):
    with pytest.raises(ValueError, match=match):
        quantize(torch.randn(4, 16), getattr(keys, key_name), scale)


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("x", "error", "match"),
    [
        ([[1.0, 2.0]], TypeError, "x must be a torch.Tensor, got list"),
        (torch.randn(16), ValueError, r"x must be \[M, K\] or \[E, N, K\], got shape \(16,\)"),
        (torch.randn(2, 2, 2, 16), ValueError, "got shape"),
        (
            torch.ones(4, 16, dtype=torch.int32),
            TypeError,
            "float tensor to quantize, got torch.int32",
        ),
        (torch.ones(4, 16).to(FP8), TypeError, "got torch.float8_e4m3fn"),
    ],
)
def test_quantize_bad_input(x, error, match):
    with pytest.raises(error, match=match):
        quantize(x, keys.FP8_DYNAMIC_TOKEN)


def test_zero_points_are_for_int4_alone():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="zero points are for int4 weights, not int8/group1x32"):
        quantize(x, key_of("INT8_GROUP32"), zero_point=True)
    with pytest.raises(ValueError, match="zero points are for int4 weights, not fp8_e4m3/row"):
        quantize(x, keys.FP8_DYNAMIC_TOKEN, zero_point=True)
    q8 = quantize(x, keys.INT8_DYNAMIC_TOKEN)
    with pytest.raises(ValueError, match="only int4 weights have zero points"):
        dequantize(q8.q, q8.scale, keys.INT8_DYNAMIC_TOKEN, zero_point=torch.zeros(4, 1).byte())
    with pytest.raises(ValueError, match="int4 weights take group scales, got int4/row"):
        quantize(x, QuantKey(INT4, ScaleLayout.ROW))


@pytest.mark.parametrize(
    ("element", "group", "error", "match"),
    [
        (INT4, None, ValueError, r"int4 weights need a group size, one of \(32, 64, 128\)"),
        (INT4, 16, ValueError, r"group_size must be one of \(32, 64, 128\), got 16"),
        (INT8, 256, ValueError, r"group_size must be one of \(32, 64, 128\), got 256"),
        (INT4, 32.0, TypeError, "group_size must be an int, got float"),
        (INT8, True, TypeError, "group_size must be an int, got bool"),
    ],
)
def test_weight_only_group_sizes(element, group, error, match):
    with pytest.raises(error, match=match):
        int_weight_key(element, group)


def test_weight_only_keys():
    assert int_weight_key(INT8, None) == keys.INT8_CHANNEL  # per channel
    assert int_weight_key(INT4, 128) == keys.INT4_GROUP128
    for g in WEIGHT_ONLY_GROUPS:
        for element in (INT4, INT8):
            key = int_weight_key(element, g)
            assert key.layout is ScaleLayout.GROUP and key.group == (1, g)
            assert key.scale_format is ScaleFormat.FLOAT32 and not key.static
            assert key.packed == (element is INT4) and key.exact_groups == (element is INT4)


def test_dequantize_nvfp4_needs_the_global_scale():
    qx = quantize(torch.randn(4, 32), keys.NVFP4)
    with pytest.raises(ValueError, match="needs the global scale"):
        dequantize(qx.q, qx.scale, keys.NVFP4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(layout=ScaleLayout.GROUP), "group layout needs group"),
        (dict(layout=ScaleLayout.BLOCK), "block layout needs group"),
        (dict(layout=ScaleLayout.ROW, group=(1, 128)), "row layout takes no group"),
        (dict(layout=ScaleLayout.GROUP, group=(2, 128)), "a GROUP layout spans one row"),
        (dict(layout=ScaleLayout.ROW, static=True), "static scales are per-tensor"),
    ],
)
def test_quant_key_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantKey(ElementFormat.FP8, **kwargs)


def test_group_size_must_be_positive():
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        per_token_group_quant_fp8_torch(torch.randn(2, 8), 0)


# ---- the activation quantizers are the spec --------------------------------------------------
@pytest.mark.parametrize(
    ("fn", "key_name"),
    [
        (quantize_fp8_per_token, "FP8_DYNAMIC_TOKEN"),
        (quantize_int8_per_token, "INT8_DYNAMIC_TOKEN"),
        (quantize_fp8_per_tensor, "FP8_DYNAMIC_TENSOR"),
        (quantize_mxfp8_torch, "MXFP8"),
    ],
)
def test_activation_quantizers(fn, key_name):
    key = getattr(keys, key_name)
    x = random_operand((9, 64))
    q, s = fn(x)
    want, _ = expected_scales(as3(x), key)
    assert s.reshape(-1).tolist() == want
    qx = quantize_activation(x, OperandQuant(key))
    assert_equal(qx.q.view(torch.uint8), q.view(torch.uint8), what="dispatch q")
    assert_equal(qx.scale, s, what="dispatch scale")
    # element-wise: q is the rounding of x / s
    if key.element is ElementFormat.INT8:
        want_q = [
            [max(-127, min(127, round(f32(v / s_m)))) for v in row]
            for row, s_m in zip(x.tolist(), s.reshape(-1).tolist(), strict=True)
        ]
        assert q.tolist() == want_q


def test_nvfp4_activation_quantizer():
    x = random_operand((9, 64))
    qx = quantize_nvfp4(x)
    want, want_global = expected_scales(as3(x), keys.NVFP4)
    assert qx.scale.float().reshape(-1).tolist() == want
    assert qx.global_scale.tolist() == want_global
    # the elements: E2M1 of x / (block scale * global), two per byte, low nibble first
    s = element_scales(qx, keys.NVFP4, (1, 9, 64))[0]
    codes = [[e2m1_code(f32(v / f32(sv))) for v, sv in zip(row, srow, strict=True)]
             for row, srow in zip(x.tolist(), s.tolist(), strict=True)]  # fmt: skip
    packed = [[lo | (hi << 4) for lo, hi in zip(r[0::2], r[1::2], strict=True)] for r in codes]
    assert qx.q.tolist() == packed


def test_unquantized_operand_passes_through():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    qx = quantize_activation(x, OperandQuant())
    assert qx.q is x and qx.scale is None
