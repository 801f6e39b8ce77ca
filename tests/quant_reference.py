"""Independent quantizers for the quantization tests, written from the spec, not from fusedmoe.

Pure python, one element at a time (small sizes only): the scale of each cell from its amax,
the element rounded on its format's grid with ties to even, saturating at the format's max.
Fake quantizers return what a quantized pipeline sees, dequantized in float32 (the spec
dequantizes as a float32 product q * scale), and a quantized MoE pipeline computed with them.
Nothing here imports the package.

Formats: e4m3fn (max 448, subnormals k * 2**-9), E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6; sign bit 8;
the element of even index in the low nibble), E8M0 (2 ** (code - 127)), INT8 (+-127), INT4
(unsigned codes 0 .. 15 packed as E2M1 is, worth (code - zero) * scale; zero 8 when symmetric).
"""

from __future__ import annotations

import math
import struct

import torch

from tests.reference import activation_ref

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def f32(v: float) -> float:
    """Round a python float to float32 (nearest even), as a float32 tensor op does."""
    return struct.unpack("f", struct.pack("f", v))[0]


AMAX_EPS = f32(1e-10)  # the documented floor of a cell's amax (float32, as torch.clamp casts it)


def floor_log2(a: float) -> int:
    """floor(log2(a)) for a > 0, exactly (frexp: a = m * 2**e with m in [0.5, 1))."""
    return math.frexp(a)[1] - 1


def ceil_log2(a: float) -> int:
    m, e = math.frexp(a)
    return e - 1 if m == 0.5 else e


def fp8_round(v: float) -> float:
    """e4m3fn: round to nearest even on the grid, saturating at +-448."""
    a = abs(v)
    if a >= 448.0:
        return math.copysign(448.0, v)
    if a == 0.0:
        return 0.0
    step = 2.0 ** (max(floor_log2(a), -6) - 3)  # subnormals share the spacing of 2**-6
    return math.copysign(round(a / step) * step, v)  # round(): ties to even


def e2m1_code(v: float) -> int:
    """The nearest E2M1 value (ties to the even index), saturating at 6; sign bit when v < 0."""
    a = min(abs(v), 6.0)
    index = min(range(8), key=lambda i: (abs(E2M1_GRID[i] - a), i % 2))
    return (8 if v < 0 else 0) | index


def e2m1_value(code: int) -> float:
    return -E2M1_GRID[code & 7] if code & 8 else E2M1_GRID[code & 7]


def decode_fp4_bytes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float64 [..., K]: low nibble first, sign bit 8, E2M1_GRID values."""
    table = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float64)
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return table[nibbles.long()]


def int4_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int64 codes [..., K]: the low nibble is the element of even index."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()


def gemm_rows(x: torch.Tensor) -> list[list[float]]:
    return x.float().tolist()


# ---- quantizers: values and scales, per element -----------------------------------------------
def group_quant_fp8_loops(
    x: torch.Tensor, group: int = 128, ue8m0: bool = False
) -> tuple[list[list[float]], list[list[float]]]:
    """x [M, K] -> (q values [M][K], float32 scales [M][ceil(K/group)])."""
    q_rows, s_rows = [], []
    for row in gemm_rows(x):
        q_row, s_row = [], []
        for start in range(0, len(row), group):
            chunk = row[start : start + group]
            s = f32(max(max(abs(v) for v in chunk), AMAX_EPS) / 448.0)
            if ue8m0:
                s = 2.0 ** ceil_log2(s)
            s_row.append(s)
            q_row += [fp8_round(f32(v / s)) for v in chunk]
        q_rows.append(q_row)
        s_rows.append(s_row)
    return q_rows, s_rows


def mxfp4_quant_loops(w: torch.Tensor) -> tuple[list, list]:
    """w [E, N, K] -> (packed bytes [E][N][K/2], E8M0 codes [E][N][K/32])."""
    packed, codes = [], []
    for expert in w.float().tolist():
        p_e, c_e = [], []
        for row in expert:
            p_row, c_row = [], []
            for start in range(0, len(row), 32):
                chunk = row[start : start + 32]
                amax = max(abs(v) for v in chunk)
                exponent = -127 if amax == 0 else max(-127, min(127, floor_log2(amax) - 2))
                c_row.append(exponent + 127)
                nibbles = [e2m1_code(v / 2.0**exponent) for v in chunk]
                p_row += [
                    lo | (hi << 4) for lo, hi in zip(nibbles[0::2], nibbles[1::2], strict=True)
                ]
            p_e.append(p_row)
            c_e.append(c_row)
        packed.append(p_e)
        codes.append(c_e)
    return packed, codes


def int4_quant_loops(
    w: torch.Tensor, group: int, zero_points: bool
) -> tuple[list, list, list | None]:
    """w [E, N, K] -> (packed bytes [E][N][K/2], float32 scales [E][N][K/g], zero points
    [E][N][K/g] or None). Symmetric: s = amax / 7, q = clamp(round(v / s) + 8, 1, 15). Zero
    points (GPTQ / AWQ): the range [min(lo, 0), max(hi, 0)] over 15 steps, s = (max - min) / 15
    (at least the amax floor), zero = clamp(round(-min / s), 0, 15), q = clamp(round(v / s) +
    zero, 0, 15). round(): ties to even."""
    packed, scales, zeros = [], [], []
    for expert in w.float().tolist():
        p_e, s_e, z_e = [], [], []
        for row in expert:
            p_row, s_row, z_row = [], [], []
            for start in range(0, len(row), group):
                chunk = row[start : start + group]
                if zero_points:
                    high, low = max(max(chunk), 0.0), min(min(chunk), 0.0)
                    s = max(f32(f32(high - low) / 15.0), AMAX_EPS)
                    zero = max(0, min(15, round(f32(-low / s))))
                    codes = [max(0, min(15, round(f32(v / s)) + zero)) for v in chunk]
                else:
                    s = f32(max(max(abs(v) for v in chunk), AMAX_EPS) / 7.0)
                    zero = 8
                    codes = [max(1, min(15, round(f32(v / s)) + 8)) for v in chunk]
                s_row.append(s)
                z_row.append(zero)
                p_row += [lo | (hi << 4) for lo, hi in zip(codes[0::2], codes[1::2], strict=True)]
            p_e.append(p_row)
            s_e.append(s_row)
            z_e.append(z_row)
        packed.append(p_e)
        scales.append(s_e)
        zeros.append(z_e)
    return packed, scales, zeros if zero_points else None


def int8_group_quant_loops(w: torch.Tensor, group: int) -> tuple[list, list]:
    """w [E, N, K] -> (int8 values [E][N][K], float32 scales [E][N][ceil(K/g)]): s = amax / 127
    per 1 x g group, q = clamp(round(v / s), -127, 127)."""
    values, scales = [], []
    for expert in w.float().tolist():
        v_e, s_e = [], []
        for row in expert:
            v_row, s_row = [], []
            for start in range(0, len(row), group):
                chunk = row[start : start + group]
                s = f32(max(max(abs(v) for v in chunk), AMAX_EPS) / 127.0)
                s_row.append(s)
                v_row += [max(-127, min(127, round(f32(v / s)))) for v in chunk]
            v_e.append(v_row)
            s_e.append(s_row)
        values.append(v_e)
        scales.append(s_e)
    return values, scales


# ---- fake quantizers: x [R, K] -> float32 [R, K], what the pipeline computes with --------------
def fake_quant_fp8_group(x: torch.Tensor, group: int = 128, ue8m0: bool = False) -> torch.Tensor:
    q, s = group_quant_fp8_loops(x, group, ue8m0)
    return torch.tensor(
        [
            [f32(v * s_row[i // group]) for i, v in enumerate(q_row)]
            for q_row, s_row in zip(q, s, strict=True)
        ]
    )


def fake_quant_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """Per row (token): s = amax / 448."""
    out = []
    for row in gemm_rows(x):
        s = f32(max(max(abs(v) for v in row), AMAX_EPS) / 448.0)
        out.append([f32(fp8_round(f32(v / s)) * s) for v in row])
    return torch.tensor(out)


def fake_quant_fp8_tensor(x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One scale for the whole tensor: the given (static) one, or amax / 448."""
    rows = gemm_rows(x)
    if scale is None:
        scale = f32(max(max(abs(v) for row in rows for v in row), AMAX_EPS) / 448.0)
    return torch.tensor([[f32(fp8_round(f32(v / scale)) * scale) for v in row] for row in rows])


def fake_quant_int8_rows(x: torch.Tensor) -> torch.Tensor:
    out = []
    for row in gemm_rows(x):
        s = f32(max(max(abs(v) for v in row), AMAX_EPS) / 127.0)
        out.append([f32(max(-127, min(127, round(f32(v / s)))) * s) for v in row])
    return torch.tensor(out)


def fake_quant_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """1 x 32 groups, shared exponent floor(log2(amax)) - 8, e4m3 elements (saturating)."""
    out = []
    for row in gemm_rows(x):
        out_row = []
        for start in range(0, len(row), 32):
            chunk = row[start : start + 32]
            amax = max(abs(v) for v in chunk)
            exponent = -127 if amax == 0 else max(-127, min(127, floor_log2(amax) - 8))
            s = 2.0**exponent
            out_row += [fp8_round(v / s) * s for v in chunk]
        out.append(out_row)
    return torch.tensor(out)


def fake_quant_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """1 x 16 groups: g = amax(tensor) / (448 * 6); block scale e4m3(amax / 6 / g), at least
    the smallest e4m3 subnormal; E2M1 elements of x / (block scale * g)."""
    rows = gemm_rows(x)
    g = f32(max(max(abs(v) for row in rows for v in row), AMAX_EPS) / (448.0 * 6.0))
    out = []
    for row in rows:
        out_row = []
        for start in range(0, len(row), 16):
            chunk = row[start : start + 16]
            amax = max(abs(v) for v in chunk)
            s = f32(fp8_round(max(f32(f32(amax / 6.0) / g), 2.0**-9)) * g)
            out_row += [f32(e2m1_value(e2m1_code(f32(v / s))) * s) for v in chunk]
        out.append(out_row)
    return torch.tensor(out)


# ---- weight dequantizers: stored weights + scales -> float64 [E, N, K] ------------------------
def dequant_fp8_tensor(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.stack([q[e].float() * float(scale[e]) for e in range(q.shape[0])]).double()


def dequant_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-channel scales [E, N] (FP8 or INT8)."""
    return (q.float() * scale.float().reshape(q.shape[0], q.shape[1], 1)).double()


def dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = q.float().clone()
    num_e, rb, kb = scale.shape
    for e in range(num_e):
        for i in range(rb):
            for j in range(kb):
                rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
                out[e, rows, cols] *= float(scale[e, i, j])
    return out.double()


def dequant_mxfp8(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    scale = torch.exp2(codes.double() - 127.0).repeat_interleave(32, dim=-1)
    return q.double() * scale


def dequant_mxfp4(packed: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4: nibbles -> E2M1 values * 2 ** (code - 127), 32 values per code."""
    scale = torch.exp2(codes.double() - 127.0).repeat_interleave(32, dim=-1)
    return decode_fp4_bytes(packed) * scale


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
    cells = scale.float() * global_scale.float().view(-1, 1, 1)  # float32 products, as the spec
    values = decode_fp4_bytes(packed).float()
    return (values * cells.repeat_interleave(16, dim=-1)).double()


def dequant_int4(
    packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """INT4 weights [E, N, K/2] with group scales [E, N, K/g] (g = K / the scale's columns) and
    uint8 zero points of the scale's shape (None: 8): (code - zero) * scale, a float32 product."""
    codes = int4_codes(packed)
    group = codes.shape[-1] // scale.shape[-1]
    zero = torch.full(scale.shape, 8) if zero_point is None else zero_point.long()
    values = (codes - zero.repeat_interleave(group, dim=-1)).float()
    return (values * scale.float().repeat_interleave(group, dim=-1)).double()


def dequant_int8_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """INT8 weights [E, N, K] with 1 x g group scales [E, N, K/g]."""
    group = q.shape[-1] // scale.shape[-1]
    return (q.float() * scale.float().repeat_interleave(group, dim=-1)).double()


# ---- the quantized MoE pipeline ----------------------------------------------------------------
def pipeline_by_hand(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fake_quant,
    *,
    activation: str = "silu",
    params: dict | None = None,
) -> torch.Tensor:
    """out[m] = sum_j w[m, j] * (fq(act(fq(x[m]) @ w13[e].T)) @ w2[e].T) in float64.

    w13, w2: the dequantized float64 weights. fq quantizes x and then all the routed rows of
    the intermediate together (a per-tensor scale spans them), each from float32; fq None: both
    stay in float64 (the dtype of x).
    """
    params = params or {}
    num_tokens, top_k = topk_ids.shape
    xq = x.double() if fake_quant is None else fake_quant(x.float()).double()
    rows = [(m, j, int(topk_ids[m, j])) for m in range(num_tokens) for j in range(top_k)]
    a = torch.stack([activation_ref(activation, w13[e] @ xq[m], **params) for m, _, e in rows])
    aq = a if fake_quant is None else fake_quant(a.float()).double()
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float64)
    for r, (m, j, e) in enumerate(rows):
        out[m] += float(topk_weights[m, j]) * (w2[e] @ aq[r])
    return out
