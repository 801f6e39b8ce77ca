"""The number formats of fusedmoe.quant.formats against hand-written, bit-exact known vectors.

E2M1 (FP4) codes are sign << 3 | index into (0, 0.5, 1, 1.5, 2, 3, 4, 6); two codes per byte
with the element of even index in the low nibble. E8M0 codes are biased exponents
(2 ** (code - 127)). E4M3 (float8_e4m3fn) saturates at +-448 and has subnormals k * 2**-9.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedmoe.quant.formats import (
    E2M1_VALUES,
    FP8_DTYPE,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode_exponent,
    mx_shared_exponent,
    pack_fp4,
    round_up_pow2,
    to_fp8,
    unpack_fp4,
)
from tests.helpers import assert_equal

# ---- E2M1 ------------------------------------------------------------------------------------
# (value, 4-bit code). Ties between two neighbours go to the even code (the even index).
E2M1_ENCODE_TABLE = [
    # exact grid points
    (0.0, 0x0),
    (0.5, 0x1),
    (1.0, 0x2),
    (1.5, 0x3),
    (2.0, 0x4),
    (3.0, 0x5),
    (4.0, 0x6),
    (6.0, 0x7),
    # ties: the midpoint of two neighbours rounds to the even code
    (0.25, 0x0),  # 0 (code 0) vs 0.5 (code 1)
    (0.75, 0x2),  # 0.5 (1) vs 1.0 (2)
    (1.25, 0x2),  # 1.0 (2) vs 1.5 (3)
    (1.75, 0x4),  # 1.5 (3) vs 2.0 (4)
    (2.5, 0x4),  # 2.0 (4) vs 3.0 (5)
    (3.5, 0x6),  # 3.0 (5) vs 4.0 (6)
    (5.0, 0x6),  # 4.0 (6) vs 6.0 (7)
    # just off the ties: plain round to nearest
    (0.25 + 2.0**-20, 0x1),
    (0.75 - 2.0**-20, 0x1),
    (1.25 + 2.0**-20, 0x3),
    (2.5 + 2.0**-20, 0x5),
    (5.0 - 2.0**-18, 0x6),
    (5.0 + 2.0**-18, 0x7),
    (0.125, 0x0),
    (2.75, 0x5),
    # saturation at 6
    (6.5, 0x7),
    (7.0, 0x7),
    (1e9, 0x7),
    (float("inf"), 0x7),
    # negatives: sign bit 0x8
    (-0.5, 0x9),
    (-0.75, 0xA),
    (-1.25, 0xA),
    (-2.5, 0xC),
    (-3.5, 0xE),
    (-5.0, 0xE),
    (-6.0, 0xF),
    (-7.0, 0xF),
    (-1e9, 0xF),
    # zeros: the sign is taken from x < 0, so -0.0 encodes as +0 and a small negative that
    # rounds to zero keeps its sign (-0, code 8); both decode to zero
    (-0.0, 0x0),
    (-0.125, 0x8),
    (-0.25, 0x8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_e2m1_encode_known_values(dtype):
    # every value is exact in float32; bfloat16 cannot hold the "just off a tie" ones
    table = [(v, c) for v, c in E2M1_ENCODE_TABLE if float(torch.tensor(v, dtype=dtype)) == v]
    if dtype != torch.bfloat16:
        assert len(table) == len(E2M1_ENCODE_TABLE)
    values = torch.tensor([v for v, _ in table], dtype=dtype)
    codes = e2m1_encode(values)
    assert codes.dtype == torch.uint8
    for (value, code), got in zip(table, codes.tolist(), strict=True):
        assert got == code, f"e2m1_encode({value!r}) = {got:#x}, expected {code:#x}"


def test_e2m1_decode_all_codes():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected += [-v for v in expected]
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.dtype == torch.float32
    assert got.tolist() == expected
    assert bool(torch.signbit(got[8])), "code 8 is negative zero"
    assert tuple(E2M1_VALUES) == tuple(expected[:8])


def test_e2m1_encode_decode_is_identity_on_the_grid():
    codes = torch.tensor([c for c in range(16) if c != 8], dtype=torch.uint8)
    assert_equal(e2m1_encode(e2m1_decode(codes)), codes, what="encode(decode(code))")


def test_fp4_nibble_order():
    # element 0 in the low nibble, element 1 in the high nibble
    assert pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0x21]
    codes = torch.tensor([[1, 2, 3, 4, 0xF, 0], [0, 0xF, 0x8, 0x7, 0xA, 0x5]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x43, 0x0F], [0xF0, 0x78, 0x5A]]
    unpacked = unpack_fp4(torch.tensor([0x21, 0xF0, 0x0F, 0x9C], dtype=torch.uint8))
    assert unpacked.tolist() == [0x1, 0x2, 0x0, 0xF, 0xF, 0x0, 0xC, 0x9]


def test_fp4_pack_unpack_round_trip_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8).view(16, 16)
    codes = unpack_fp4(every_byte)
    assert codes.shape == (16, 32) and int(codes.max()) == 15
    assert_equal(pack_fp4(codes), every_byte, what="pack(unpack(byte))")


def test_fp4_pack_needs_an_even_length():
    with pytest.raises(ValueError, match="even last dimension, got 3"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))


# ---- E8M0 and UE8M0 --------------------------------------------------------------------------
def test_e8m0_known_values():
    # value -> code: encode the exponent log2(value)
    values = [2.0**-127, 2.0**-126, 0.25, 1.0, 2.0, 2.0**100, 2.0**127]
    codes = [0, 1, 125, 127, 128, 227, 254]
    exponents = torch.log2(torch.tensor(values, dtype=torch.float64))
    assert e8m0_encode_exponent(exponents).tolist() == codes
    decoded = e8m0_decode(torch.tensor(codes, dtype=torch.uint8))
    assert decoded.dtype == torch.float32
    assert decoded.tolist() == values  # 2**-127 is a float32 subnormal, held exactly


def test_e8m0_encode_clamps_to_the_range():
    exponents = torch.tensor([-300, -128, -127, 127, 128, 300])
    assert e8m0_encode_exponent(exponents).tolist() == [0, 0, 0, 254, 254, 254]
    assert 255 not in e8m0_encode_exponent(torch.arange(-400, 400)).tolist()  # 255 is NaN


@pytest.mark.parametrize(
    ("amax", "emax", "exponent"),
    [
        (6.0, 2, 0),  # FP4: 6 = 1.5 * 2**2 -> scale 1
        (7.9, 2, 0),  # still 2**2 <= amax < 2**3: 7.9 saturates to 6 at scale 1 (OCP MX)
        (8.0, 2, 1),
        (1.0, 2, -2),
        (448.0, 8, 0),  # FP8 e4m3: 448 = 1.75 * 2**8 -> scale 1
        (511.0, 8, 0),
        (512.0, 8, 1),
        (0.75, 8, -9),
        (2.0**-130, 2, -127),  # below the E8M0 range: clamped
        (0.0, 2, -127),  # an all-zero block: the smallest exponent, never -inf / NaN
        (0.0, 8, -127),
        (3.0e38, 8, 119),
    ],
)
def test_mx_shared_exponent(amax, emax, exponent):
    got = mx_shared_exponent(torch.tensor([amax], dtype=torch.float32), emax)
    assert got.tolist() == [exponent]


def test_round_up_pow2():
    cases = [
        (1.0, 1.0),
        (2.0**-30, 2.0**-30),
        (2.0**20, 2.0**20),
        (1.5, 2.0),
        (3.0, 4.0),
        (0.3, 0.5),
        (1.0 + 2.0**-23, 2.0),  # just above a power of two goes up
        (1.0 - 2.0**-24, 1.0),  # just below stays
        (448.0, 512.0),
        (1e-10 / 448.0, 2.0**-42),
    ]
    x = torch.tensor([c for c, _ in cases], dtype=torch.float32)
    assert round_up_pow2(x).tolist() == [
        float(torch.tensor(e, dtype=torch.float32)) for _, e in cases
    ]


# ---- FP8 E4M3 --------------------------------------------------------------------------------
def test_to_fp8_saturates():
    x = torch.tensor([1e6, -1e6, 448.0, 449.0, 463.9, 500.0, float("inf"), -float("inf"), 3e38])
    got = to_fp8(x)
    assert got.dtype == FP8_DTYPE
    assert got.float().tolist() == [448.0, -448.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0, 448.0]
    assert not bool(got.float().isnan().any())


def test_to_fp8_known_normals():
    # 3 mantissa bits: the grid spacing in [2**e, 2**(e+1)) is 2**(e-3); ties to even
    x = torch.tensor([1.0, 1.0625, 1.1875, 1.125, 3.3, 240.0, 232.0, -0.1, 2.0**-6])
    expected = [1.0, 1.0, 1.25, 1.125, 3.25, 240.0, 224.0, -0.1015625, 2.0**-6]
    assert to_fp8(x).float().tolist() == expected


def test_to_fp8_subnormals():
    tiny = 2.0**-9  # the smallest e4m3 subnormal; normals start at 2**-6
    x = torch.tensor(
        [
            3 * tiny,  # a subnormal: kept
            7 * tiny,  # the largest subnormal
            2.0**-10,  # half the smallest subnormal: tie -> 0 (even)
            1.5 * tiny,  # tie between 1 and 2 subnormal steps -> 2 (even)
            2.5 * tiny,  # tie between 2 and 3 -> 2
            0.75 * tiny,  # above the half: -> 1 step
            2.0**-11,  # below the half: -> 0
            -5 * tiny,
            7.5 * tiny,  # tie between the largest subnormal and the smallest normal -> 2**-6
        ]
    )
    expected = [3 * tiny, 7 * tiny, 0.0, 2 * tiny, 2 * tiny, tiny, 0.0, -5 * tiny, 2.0**-6]
    got = to_fp8(x).float()
    assert got.tolist() == expected
    # and the same as torch's own cast of the clamped value, on a dense sweep of the range
    sweep = torch.linspace(-(2.0**-5), 2.0**-5, 4001)
    assert_equal(
        to_fp8(sweep).view(torch.uint8),
        sweep.clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8),
        what="to_fp8 vs torch cast",
    )


def test_to_fp8_matches_the_torch_cast_everywhere_in_range():
    x = torch.randn(4096) * torch.exp2(torch.randint(-12, 9, (4096,)).float())
    x = torch.cat([x, torch.tensor([1e4, -1e4, 448.0, -448.0, 0.0, -0.0])])
    got = to_fp8(x)
    want = x.clamp(-448.0, 448.0).to(FP8_DTYPE)
    assert_equal(got.view(torch.uint8), want.view(torch.uint8), what="to_fp8 bits")
    # and the element-wise rounding bound of e4m3: half a grid step
    v = x.clamp(-448.0, 448.0).double()
    step = torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))) - 3)
    assert bool(((got.double() - v).abs() <= step / 2).all())


def test_fp8_grid_is_what_the_docstring_says():
    # every finite e4m3fn value: 0, subnormals k * 2**-9, normals (1 + m/8) * 2**e, max 448
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    finite = sorted({abs(v) for v in values.tolist() if not math.isnan(v)})
    expected = {0.0} | {k * 2.0**-9 for k in range(1, 8)}
    expected |= {(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)}
    expected.discard(1.875 * 2.0**8)  # 480 is NaN in the fn variant
    assert finite == sorted(expected)
    assert max(finite) == 448.0
