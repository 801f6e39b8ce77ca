"""The symm_mem EP dispatch on one process: where each token's row goes (dispatch_positions), the
row movers (the Triton kernels of fusedmoe.kernels.ep_rows against their torch twins, the twins
against plain loops), the choice of the dispatch kind (resolve_dispatch), the config's new
fields, SymmMemEPPrepareFinalize's checks, single-pass modular kernels, and the explanation.

Without a GPU the kernels run on Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes here are small. Sharded == unsharded over the emulated
transport: tests/test_ep.py (the symm* cases).

Legend: M tokens, E experts (P physical), k top-k, R ranks, C send slots (C: no slot), W row width.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

from fusedmoe import FusedMoE, ParallelConfig
from fusedmoe._triton import triton_runs_on
from fusedmoe.experts.torch_ref import TorchExperts
from fusedmoe.modular.kernel import FusedMoEModularKernel
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.modular.types import ActivationSpec, ExpertWeights
from fusedmoe.oracle import BackendChoice, select_backend
from fusedmoe.parallel.config import DEFAULT_MAX_TOKENS_PER_RANK
from fusedmoe.parallel.placement import expert_placement
from fusedmoe.parallel.rows import (
    dispatch_positions,
    dispatch_positions_torch,
    gather_sum_rows,
    gather_sum_rows_torch,
    scatter_rows,
    scatter_rows_torch,
)
from fusedmoe.parallel.symm_mem_ep import (
    COMBINE_BLOCKS_MIN_BYTES,
    ROUTING_FIRST_MIN_BYTES,
    TRANSPORT_ENV,
    SymmMemEPPrepareFinalize,
    combine_blocks_override,
    combine_bounds,
    routing_first,
    routing_first_override,
)
from fusedmoe.parallel.wiring import DispatchChoice, resolve_dispatch
from tests.helpers import assert_close, assert_equal, poison_, random_routing
from tests.reference import random_experts, reference

needs_triton = pytest.mark.skipif(
    not triton_runs_on(torch.empty(0)),
    reason="needs Triton on this device (CUDA, or TRITON_INTERPRET=1 on the CPU)",
)
CPU = torch.device("cpu")


# ---- dispatch_positions ------------------------------------------------------------------------
def dispatch_positions_ref(topk_ids, owner, num_ranks, num_slots):
    """Plain loops: each token once to each rank that owns one of its experts; the send rows
    grouped by rank in rank order, tokens in order within a rank; num_slots where not sent."""
    num_tokens = topk_ids.shape[0]
    goes = [[False] * num_ranks for _ in range(num_tokens)]
    for m in range(num_tokens):
        for e in topk_ids[m].tolist():
            if e >= 0:
                goes[m][int(owner[e])] = True
    pos = torch.full((num_tokens, num_ranks), num_slots, dtype=torch.int64)
    counts = torch.zeros(num_ranks, dtype=torch.int64)
    slot = 0
    for r in range(num_ranks):
        for m in range(num_tokens):
            if goes[m][r]:
                pos[m, r] = slot
                counts[r] += 1
                slot += 1
    return pos, counts


@dataclasses.dataclass(frozen=True)
class RouteCase:
    name: str
    num_tokens: int  # M
    num_experts: int  # E (logical)
    top_k: int
    num_ranks: int  # R
    placement: str = "linear"
    redundant: int = 0  # EPLB replicas: P = E + redundant physical ids
    empty: float = 0.0  # fraction of -1 slots
    routing: str = "distinct"  # "distinct", "repeats" (with replacement), "hot", "one_rank"


ROUTE_CASES = [
    RouteCase("M0", 0, 8, 2, 2),
    RouteCase("M1", 1, 8, 3, 4, "round_robin"),
    RouteCase("odd_R3_rr_empty", 37, 8, 3, 3, "round_robin", empty=0.3),
    RouteCase("repeats_linear", 29, 8, 4, 2, routing="repeats"),  # same rank twice in a token
    RouteCase("repeats_R4_rr", 23, 9, 5, 4, "round_robin", routing="repeats", empty=0.2),
    RouteCase("hot_expert", 13, 8, 2, 4, routing="hot"),  # all tokens, all slots: one expert
    RouteCase("one_rank_rr", 19, 9, 3, 3, "round_robin", routing="one_rank"),
    RouteCase("k_eq_E", 11, 4, 4, 2, "round_robin"),
    RouteCase("R1", 17, 6, 2, 1, empty=0.5),
    RouteCase("all_empty", 7, 8, 2, 2, empty=1.0),
    RouteCase("replicas", 21, 5, 2, 3, redundant=2, empty=0.1),
]  # fmt: skip


def route(case: RouteCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [M, k] physical ids, owner [P]) of a fresh random routing."""
    placement = expert_placement(case.num_experts, case.num_ranks, case.placement, case.redundant)
    owner = placement.owner()
    num_physical, shape = owner.numel(), (case.num_tokens, case.top_k)
    if case.routing == "distinct":
        ids = random_routing(case.num_tokens, num_physical, case.top_k)[1]
    elif case.routing == "repeats":
        ids = torch.randint(0, num_physical, shape, dtype=torch.int32)
    elif case.routing == "hot":
        ids = torch.full(shape, num_physical - 1, dtype=torch.int32)
    else:  # "one_rank": every slot an expert of rank 1
        mine = (owner == 1).nonzero().flatten()
        ids = mine[torch.randint(0, mine.numel(), shape)].to(torch.int32)
    if case.empty:
        ids = ids.masked_fill(torch.rand(shape) < case.empty, -1)
    return ids, owner


def check_positions(pos, counts, ids, owner, num_ranks, num_slots, *, what):
    """pos and counts against the loops, and the invariants, independently of them."""
    assert pos.dtype == torch.int64 and pos.shape == (ids.shape[0], num_ranks)
    expected_pos, expected_counts = dispatch_positions_ref(ids, owner, num_ranks, num_slots)
    assert_equal(counts, expected_counts, what=f"{what} counts")
    assert_equal(pos, expected_pos, what=f"{what} pos")
    sent = pos != num_slots  # [M, R]
    dest = torch.zeros(ids.shape[0], num_ranks + 1, dtype=torch.bool)
    for m, row in enumerate(ids.tolist()):
        for e in row:
            dest[m, int(owner[e]) if e >= 0 else num_ranks] = True
    assert_equal(sent, dest[:, :num_ranks], what=f"{what}: the ranks each token goes to, once")
    assert_equal(counts, sent.sum(dim=0), what=f"{what}: counts == rows sent")
    total = int(counts.sum())
    assert_equal(pos[sent].sort().values, torch.arange(total), what=f"{what}: a permutation")
    start = 0
    for r in range(num_ranks):  # grouped by rank in rank order, token order within a rank
        got = pos[:, r][sent[:, r]]
        assert_equal(got, torch.arange(start, start + int(counts[r])), what=f"{what} rank {r}")
        start += int(counts[r])


ROUTE_PARAMS = [pytest.param(c, id=c.name) for c in ROUTE_CASES]


@pytest.mark.parametrize("case", ROUTE_PARAMS)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_dispatch_positions_torch_match_loops(case, ids_dtype):
    ids, owner = route(case)
    ids = ids.to(ids_dtype)
    num_slots = case.num_ranks * max(case.num_tokens, 1)  # C = R * B with B >= M
    pos, counts = dispatch_positions_torch(ids, owner, case.num_ranks, num_slots)
    assert counts.dtype == torch.int64
    check_positions(pos, counts, ids, owner, case.num_ranks, num_slots, what=case.name)
    if case.routing == "hot":
        assert int((counts > 0).sum()) == (1 if case.num_tokens else 0)
    if case.routing == "one_rank":
        assert counts.tolist() == [0, case.num_tokens, 0]


# with the kernel's tile at 256 (blocks of 64 tokens for 3 and 4 ranks): one full block, one
# and a bit, two and a bit; at 64, 6 ranks (padded to 8) take the smallest block, 16 tokens
BLOCK_PARAMS = [
    pytest.param(RouteCase("M64", 64, 8, 8, 4), id="M64"),
    pytest.param(RouteCase("M65", 65, 6, 2, 3, routing="repeats"), id="M65"),
    pytest.param(RouteCase("M150", 150, 8, 3, 3, "round_robin", empty=0.2), id="M150"),
    pytest.param(RouteCase("R6", 41, 12, 3, 6, "round_robin", empty=0.1), id="R6"),
    # the shipped tile: blocks of 256 tokens for 4 ranks, eight and a bit
    pytest.param(RouteCase("M2100", 2100, 16, 8, 4, empty=0.1), id="M2100"),
]


@needs_triton
@pytest.mark.parametrize("case", [*ROUTE_PARAMS, *BLOCK_PARAMS])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tile", [64, 256, None], ids=["tile64", "tile256", "tile_default"])
def test_dispatch_positions_kernel_match_loops(monkeypatch, case, ids_dtype, tile):
    """dispatch_positions where Triton runs: a program a block of POSITIONS_TILE tokens x ranks
    (the shipped tile, and 64 and 256), then the blocks' offsets where there are several."""
    from fusedmoe.kernels import ep_rows

    if tile is not None:
        monkeypatch.setattr(ep_rows, "POSITIONS_TILE", tile)
    ids, owner = route(case)
    ids = ids.to(ids_dtype)
    num_slots = case.num_ranks * max(case.num_tokens, 1) + 5
    counts = torch.full((case.num_ranks,), -7, dtype=torch.int64)  # written, not added to
    pos = dispatch_positions(ids, owner, case.num_ranks, num_slots, counts)
    check_positions(pos, counts, ids, owner, case.num_ranks, num_slots, what=case.name)


@needs_triton
@pytest.mark.parametrize("owner_dtype", [torch.int32, torch.int64])
def test_dispatch_positions_kernel_strided_ids(owner_dtype):
    """topk_ids column-major and as a column slice (strides read, not assumed)."""
    case = RouteCase("strided", 70, 9, 3, 3, "round_robin", empty=0.2, routing="repeats")
    ids, owner = route(case)
    owner = owner.to(owner_dtype)
    for layout, strided in (
        ("column-major", ids.t().contiguous().t()),
        ("column slice", torch.cat([ids, ids.flip(1)], dim=1)[:, : case.top_k]),
    ):
        counts = torch.empty(3, dtype=torch.int64)
        pos = dispatch_positions(strided, owner, 3, 3 * 70, counts)
        check_positions(pos, counts, ids, owner, 3, 3 * 70, what=layout)


def test_dispatch_positions_value_where_not_sent():
    """num_slots is what pos holds where a token does not go, whatever its value."""
    ids = torch.tensor([[0, -1], [-1, -1], [3, 3]], dtype=torch.int32)
    owner = expert_placement(4, 2, "linear").owner()  # 0, 0, 1, 1
    counts = torch.empty(2, dtype=torch.int64)
    pos = dispatch_positions(ids, owner, 2, 1000, counts)
    assert pos.tolist() == [[0, 1000], [1000, 1000], [1000, 1]]
    assert counts.tolist() == [1, 1]
    twin_pos, twin_counts = dispatch_positions_torch(ids, owner, 2, 1000)
    assert twin_pos.tolist() == pos.tolist() and twin_counts.tolist() == [1, 1]


# ---- the row movers: twins against loops, kernels against twins -------------------------------
def scatter_ref(src, pos, dst, col, trash):
    """dst with dst[pos[m, r], col:col + W] = src[m] for pos[m, r] != trash, by loops."""
    out = dst.clone()
    for m in range(pos.shape[0]):
        for r in range(pos.shape[1]):
            p = int(pos[m, r])
            if p != trash:
                out[p, col : col + src.shape[1]] = src[m]
    return out


def gather_ref(src, pos, hidden, trash):
    """float64 [M, H]: out[m] = sum of src[pos[m, r], :H] over r with pos[m, r] != trash."""
    out = torch.zeros(pos.shape[0], hidden, dtype=torch.float64)
    for m in range(pos.shape[0]):
        for r in range(pos.shape[1]):
            p = int(pos[m, r])
            if p != trash:
                out[m] += src[p, :hidden].double()
    return out


def random_rows(shape, dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


def poisoned(shape, dtype) -> torch.Tensor:
    """NaN for floats (tests/helpers.poison_), a fixed sentinel for the byte and int32 rows."""
    if dtype.is_floating_point:
        return poison_(torch.empty(shape, dtype=dtype))
    return torch.full(shape, 77, dtype=dtype)


def assert_same_rows(actual, expected, *, what):
    """Exact, NaN (the poison) in the same places."""
    if actual.dtype.is_floating_point:
        assert_close(actual, expected, tol=0.0, what=what)
    else:
        assert_equal(actual, expected, what=what)


def positions(num_tokens, num_ranks, *, extra_slots=0, empty=0.3):
    """(pos [M, R] of a fresh random routing: E = 2R experts, k = 3, repeats and empty slots;
    C, with spare slots beyond the rows sent)."""
    owner = expert_placement(2 * num_ranks, num_ranks, "round_robin").owner()
    ids = torch.randint(0, 2 * num_ranks, (num_tokens, 3), dtype=torch.int32)
    ids = ids.masked_fill(torch.rand(num_tokens, 3) < empty, -1)
    capacity = num_ranks * max(num_tokens, 1) + extra_slots
    pos, _ = dispatch_positions_torch(ids, owner, num_ranks, capacity)
    return pos, capacity


# (M, R, W, dtype, col, src_stride_pad): odd widths, R = 1..4, a column offset, src rows strided
SCATTER_GRID = [
    (0, 2, 37, torch.bfloat16, 0, 0),
    (1, 1, 37, torch.float32, 3, 0),
    (7, 2, 37, torch.bfloat16, 0, 0),
    (6, 3, 199, torch.float16, 5, 11),
    (5, 4, 1000, torch.float32, 0, 0),
    (9, 3, 64, torch.uint8, 16, 0),  # FP8 rows travel as their bytes
    (4, 2, 13, torch.int32, 0, 3),  # the metadata rows: ids | weights as int32
]
SCATTER_IDS = [f"M{m}-R{r}-W{w}-{str(d)[6:]}-col{c}-pad{p}" for m, r, w, d, c, p in SCATTER_GRID]


def scatter_problem(num_tokens, num_ranks, width, dtype, col, pad):
    pos, capacity = positions(num_tokens, num_ranks, extra_slots=2)  # rows [n, C) not targeted
    src = random_rows((num_tokens, width + pad), dtype)[:, :width]  # row stride width + pad
    # more rows than C + 1 (row C is the trash), more columns than col + W
    dst = poisoned((capacity + 4, col + width + 5), dtype)
    return src, pos, dst, capacity


@pytest.mark.parametrize("problem", SCATTER_GRID, ids=SCATTER_IDS)
def test_scatter_rows_torch_matches_loops(problem):
    col = problem[4]
    src, pos, dst, capacity = scatter_problem(*problem)
    expected = scatter_ref(src, pos, dst, col, capacity)
    scatter_rows_torch(src, pos, dst, col, capacity)
    keep = torch.arange(dst.shape[0]) != capacity  # row C takes what goes nowhere: not compared
    assert_same_rows(dst[keep], expected[keep], what="scatter_rows_torch")


@needs_triton
@pytest.mark.parametrize("problem", SCATTER_GRID, ids=SCATTER_IDS)
def test_scatter_rows_triton_matches_twin(problem):
    from fusedmoe.kernels.ep_rows import scatter_rows_triton

    width, col = problem[2], problem[4]
    src, pos, dst, capacity = scatter_problem(*problem)
    untouched = dst.clone()
    expected = dst.clone()
    scatter_rows_torch(src, pos, expected, col, capacity)
    scatter_rows_triton(src, pos, dst, col, capacity)
    keep = torch.arange(dst.shape[0]) != capacity
    assert_same_rows(dst[keep], expected[keep], what="scatter_rows_triton")
    # every row and column the routing does not target still holds the poison (row C, the
    # trash, is free to take what goes nowhere)
    targeted = torch.zeros(dst.shape[0], dtype=torch.bool)
    targeted[pos[pos != capacity]] = True
    targeted[capacity] = True
    assert_same_rows(dst[~targeted], untouched[~targeted], what="rows not targeted")
    outside = torch.ones(dst.shape[1], dtype=torch.bool)
    outside[col : col + width] = False
    assert_same_rows(dst[:, outside], untouched[:, outside], what="columns outside the row")


# (M, R, H, src dtype, out dtype, src_width_pad): odd widths, R = 1..4, padded source rows
GATHER_GRID = [
    (0, 2, 37, torch.float32, torch.float32, 0),
    (1, 1, 37, torch.bfloat16, torch.bfloat16, 0),
    (7, 2, 37, torch.bfloat16, torch.bfloat16, 27),
    (6, 3, 199, torch.float16, torch.float16, 0),
    (5, 4, 1000, torch.float32, torch.float32, 24),
    (8, 4, 199, torch.float32, torch.bfloat16, 0),  # accumulated in fp32, rounded once
    (5, 3, 2100, torch.bfloat16, torch.bfloat16, 8),  # two column blocks (2048 bf16 a block)
]
GATHER_IDS = [
    f"M{m}-R{r}-H{h}-{str(s)[6:]}-to-{str(o)[6:]}-pad{p}" for m, r, h, s, o, p in GATHER_GRID
]


def gather_problem(num_tokens, num_ranks, hidden, src_dtype, out_dtype, pad):
    pos, capacity = positions(num_tokens, num_ranks, extra_slots=3)
    # C + 1 rows of fresh values: the rows no token addresses (stale rows) too, and row C
    src = torch.randn(capacity + 1, hidden + pad).to(src_dtype)
    out = poison_(torch.empty(num_tokens, hidden, dtype=out_dtype))
    return src, pos, out, capacity


@pytest.mark.parametrize("problem", GATHER_GRID, ids=GATHER_IDS)
def test_gather_sum_rows_torch_matches_loops(problem):
    src, pos, out, capacity = gather_problem(*problem)
    gather_sum_rows_torch(src, pos, out, capacity)
    expected = gather_ref(src, pos, out.shape[1], capacity)
    assert_close(out, expected, out.dtype, what="gather twin")


@needs_triton
@pytest.mark.parametrize("max_programs", [None, 3])  # 3: programs striding over the items
@pytest.mark.parametrize("problem", GATHER_GRID, ids=GATHER_IDS)
def test_gather_sum_rows_triton_matches_twin(problem, max_programs):
    from fusedmoe.kernels.ep_rows import gather_sum_rows_triton

    src, pos, out, capacity = gather_problem(*problem)
    hidden, out_dtype = out.shape[1], out.dtype
    expected = torch.empty_like(out)
    gather_sum_rows_torch(src, pos, expected, capacity)
    gather_sum_rows_triton(src, pos, out, capacity, max_programs)
    # both sum in float32 and round once to out's dtype: they differ by the float32 summation
    # order at most (where that moves a rounding, one ulp of out's dtype)
    assert_close(out, expected, out_dtype, what="gather kernel vs twin")
    assert_close(out, gather_ref(src, pos, hidden, capacity), out_dtype, what="gather kernel")


def _gather_twin(src, pos, out, trash):
    gather_sum_rows_torch(src, pos, out, trash)


def _gather_triton(src, pos, out, trash):
    from fusedmoe.kernels.ep_rows import gather_sum_rows_triton

    gather_sum_rows_triton(src, pos, out, trash)


@pytest.mark.parametrize(
    "gather",
    [
        pytest.param(_gather_twin, id="twin"),
        pytest.param(_gather_triton, id="triton", marks=needs_triton),
    ],
)  # fmt: skip
def test_gather_ignores_nan_and_inf_in_rows_no_token_addresses(gather):
    """Rows [n, C) of the receive buffer are stale (uninitialized memory, or an earlier call's
    rows of another dtype): whatever they hold must not reach a token's sum."""
    pos = torch.tensor([[0, 3], [1, 3], [3, 3]])  # C = 3; no token addresses row 2
    src = torch.randn(4, 8)  # C + 1 rows
    src[2] = float("nan")  # a stale row (C - 1)
    src[3] = float("inf")  # the trash row (C)
    out = poison_(torch.empty(3, 8))
    gather(src, pos, out, 3)
    expected = torch.stack([src[0], src[1], torch.zeros(8)])
    assert_close(out, expected, torch.float32, what="sum over the addressed rows only")


# ---- the combine's column blocks ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("capacity", "hidden", "expected"),
    [
        (16384, 7168, (0, 3072, 5120, 6400, 7168)),  # deepseek-v3, 4 x 4096 tokens: 12/8/5/3
        (16384, 2880, (0, 1280, 2048, 2560, 2880)),  # gpt-oss: the last block the remainder
        (1024, 7168, (0, 7168)),  # decode-sized buffers: one block (one barrier)
        (COMBINE_BLOCKS_MIN_BYTES // (2 * 512), 512, (0, 256, 512)),  # as 256-blocks allow
        (COMBINE_BLOCKS_MIN_BYTES // (2 * 256), 256, (0, 256)),
    ],
)  # fmt: skip
def test_combine_bounds_rule(capacity, hidden, expected):
    bounds = combine_bounds(capacity, hidden, torch.bfloat16)
    assert bounds == expected
    assert all(b % 256 == 0 for b in bounds[1:-1])


def test_combine_bounds_override_is_scoped_and_checked():
    with combine_blocks_override(3, align=32):
        assert combine_bounds(4, 128, torch.float32) == (0, 32, 96, 128)
        with combine_blocks_override(None):  # the rule again
            assert combine_bounds(4, 128, torch.float32) == (0, 128)
        with combine_blocks_override(8):  # 128 columns hold no 256-block: one
            assert combine_bounds(4, 128, torch.float32) == (0, 128)
    assert combine_bounds(4, 128, torch.float32) == (0, 128)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="combine blocks"), combine_blocks_override(bad):
            pass


def test_routing_first_rule_and_override():
    """The routing travels ahead of the activations where C rows of the dispatch hold 64 MiB
    (deepseek-v3's bf16 rows at a bound of 4096 tokens on 4 ranks; not at 256); the override
    is scoped and checked."""
    row = 7168 * 2 + 64  # bf16 activations, then the metadata words, padded
    assert routing_first(4 * 4096, row) and not routing_first(4 * 256, row)
    assert routing_first(ROUTING_FIRST_MIN_BYTES, 1)
    assert not routing_first(ROUTING_FIRST_MIN_BYTES - 1, 1)
    with routing_first_override(True):
        assert routing_first(4, 64)
        with routing_first_override(None):  # the rule again
            assert not routing_first(4, 64)
        with routing_first_override(False):
            assert not routing_first(4 * 4096, row)
    assert not routing_first(4, 64)
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="True, False or None"), routing_first_override(bad):
            pass


@needs_triton
@pytest.mark.parametrize("grouped", [True, False])
def test_positions_blocks_counts_read_in_chunks(monkeypatch, grouped):
    """Several blocks, their counts read a chunk at a time by the second launch (chunks of 2
    blocks here: five of them, the last whole); the positions, counts and posts as the twin's."""
    from fusedmoe.kernels import ep_rows

    monkeypatch.setattr(ep_rows, "POSITIONS_TILE", 64)  # 16 tokens a block at 3 ranks
    monkeypatch.setattr(ep_rows, "_COUNTS_CHUNK", 2)
    grids = []
    launch = ep_rows.launch

    def spied(kernel, grid, *args):
        grids.append(grid[0])
        return launch(kernel, grid, *args)

    monkeypatch.setattr(ep_rows, "launch", spied)
    case = RouteCase("chunks", 150, 8, 3, 3, "round_robin", empty=0.2)
    ids, owner = route(case)
    counts = torch.empty(3, dtype=torch.int64)
    posts = [torch.full((4,), -9, dtype=torch.int64) for _ in range(3)]
    pos = dispatch_positions(ids, owner, 3, 3 * 150, counts, grouped=grouped,
                             post=[p[1:2] for p in posts])  # fmt: skip
    assert grids == [10, 10]  # 150 tokens in blocks of 16, then their offsets
    twin_pos, twin_counts = dispatch_positions_torch(ids, owner, 3, 3 * 150, grouped)
    assert_equal(pos, twin_pos, what="positions")
    assert_equal(counts, twin_counts, what="counts")
    for r, p in enumerate(posts):
        assert p.tolist() == [-9, int(twin_counts[r]), -9, -9], f"post {r}"


# ---- the dispatchers in rows.py ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("interpret", ["1", "0"])
def test_dispatchers_pick_the_kernel_where_triton_runs(monkeypatch, dtype, interpret):
    """dispatch_positions, scatter_rows, gather_sum_rows: the Triton kernels where Triton runs
    (here: the CPU under the interpreter; the row movers not for float64), else the twins; the
    same results either way."""
    if torch.cuda.is_available() and interpret == "1":
        pytest.skip("the interpreter case is the CPU machine's (conftest.py sets it there)")
    ep_rows = pytest.importorskip("fusedmoe.kernels.ep_rows")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    launched = []

    def recording(fn):
        def run(*args, **kwargs):
            launched.append(fn.__name__)
            return fn(*args, **kwargs)

        return run

    for name in ("dispatch_positions_triton", "scatter_rows_triton", "gather_sum_rows_triton"):
        monkeypatch.setattr(ep_rows, name, recording(getattr(ep_rows, name)))
    ids, owner = route(RouteCase("six", 6, 6, 3, 3, "round_robin", empty=0.3, routing="repeats"))
    capacity = 3 * 6 + 1
    counts = torch.full((3,), -7, dtype=torch.int64)
    pos = dispatch_positions(ids, owner, 3, capacity, counts)
    check_positions(pos, counts, ids, owner, 3, capacity, what="dispatch_positions")
    src = torch.randn(6, 45).to(dtype)
    dst, dst_twin = poisoned((capacity + 1, 45), dtype), poisoned((capacity + 1, 45), dtype)
    scatter_rows(src, pos, dst, 0, capacity)
    scatter_rows_torch(src, pos, dst_twin, 0, capacity)
    assert_same_rows(dst[:capacity], dst_twin[:capacity], what="scatter_rows")
    out, out_twin = poisoned((6, 40), dtype), poisoned((6, 40), dtype)
    rows = torch.randn(capacity + 1, 45).to(dtype)
    gather_sum_rows(rows, pos, out, capacity)
    gather_sum_rows_torch(rows, pos, out_twin, capacity)
    assert_close(out, out_twin, dtype, what="gather_sum_rows")
    expected = ["dispatch_positions_triton"] if interpret == "1" else []
    if interpret == "1" and dtype != torch.float64:
        expected += ["scatter_rows_triton", "gather_sum_rows_triton"]
    assert launched == expected


# ---- resolve_dispatch --------------------------------------------------------------------------
def dp_config(backend: str = "auto", **kwargs) -> ParallelConfig:
    return ParallelConfig(
        ep_size=2, ep_rank=0, dp_size=2, dp_rank=0, all2all_backend=backend, **kwargs
    )


def use_transport(monkeypatch, transport: str) -> None:
    """ "nvshmem" (the default: what a CPU machine cannot run) or "emulated" (symm_mem on any
    device, tests/test_ep.py)."""
    if transport == "emulated":
        monkeypatch.setenv(TRANSPORT_ENV, "emulated")
    else:
        monkeypatch.delenv(TRANSPORT_ENV, raising=False)


@pytest.fixture
def real_transport(monkeypatch):
    use_transport(monkeypatch, "nvshmem")


@pytest.fixture
def emulated(monkeypatch):
    use_transport(monkeypatch, "emulated")


def test_auto_on_cpu_is_naive_and_says_why(real_transport):
    choice = resolve_dispatch(dp_config(), CPU)
    assert choice.kind == "naive"
    assert "symm_mem" in choice.reason and "needs CUDA" in choice.reason, choice.reason
    assert choice.describe() == f"naive: {choice.reason}"


def test_symm_mem_asked_on_cpu_is_refused(real_transport):
    with pytest.raises(ValueError, match=r"all2all_backend='symm_mem' cannot run here.*needs CUDA"):
        resolve_dispatch(dp_config("symm_mem"), CPU)


@pytest.mark.parametrize("transport", ["nvshmem", "emulated"])
@pytest.mark.parametrize("asked", ["naive", "all_to_all"])
def test_naive_and_all_to_all_asked_are_kept(monkeypatch, transport, asked):
    use_transport(monkeypatch, transport)
    for kwargs in ({}, {"requires_grad": True}, {"rows_independent": False}):
        choice = resolve_dispatch(dp_config(asked), CPU, **kwargs)
        assert choice == DispatchChoice(asked, "asked for (ParallelConfig.all2all_backend)")


@pytest.mark.parametrize("spelling", ["emulated", " Emulated "])
def test_emulated_transport_makes_auto_symm_mem(monkeypatch, spelling):
    monkeypatch.setenv(TRANSPORT_ENV, spelling)
    choice = resolve_dispatch(dp_config(max_tokens_per_rank=96), CPU)
    assert choice.kind == "symm_mem"
    assert "up to 96 tokens per rank" in choice.reason, choice.reason
    asked = resolve_dispatch(dp_config("symm_mem"), CPU)
    assert asked.kind == "symm_mem" and asked.reason.startswith("asked for"), asked.reason


@pytest.mark.parametrize("size", [2, 3, 4, 6])
@pytest.mark.parametrize("transport", ["auto", "peer", "vdev"])
def test_group_size_rule(monkeypatch, size, transport):
    """nvshmem_unavailable_reason on a group of `size` NCCL ranks with NVSHMEM (stubbed: no GPU
    here): a power of two runs every transport; another size only the peer transport asked
    for by name (auto would fall to vdev where peers are not mapped, which needs a power of
    two), and the reason says how to get it."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from fusedmoe.parallel.symm_mem_ep import nvshmem_unavailable_reason

    monkeypatch.setenv(TRANSPORT_ENV, transport)
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: True)
    monkeypatch.setattr(symm_mem, "get_backend", lambda device: "NVSHMEM")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl", raising=False)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
    why = nvshmem_unavailable_reason(torch.device("cuda", 0))
    if size in (2, 4) or transport == "peer":
        assert why is None, why
    else:
        assert f"power-of-two group (this one has {size} ranks)" in why, why
        assert f"{TRANSPORT_ENV}=peer" in why, why


# (asked, keyword): what symm_mem cannot run -> the kind that can, and why (under the emulated
# transport, where symm_mem would otherwise run)
CANNOT_RUN = [
    ("auto", {"requires_grad": True}, "naive", "inference only"),
    ("symm_mem", {"requires_grad": True}, "all_to_all", "inference only"),
    ("auto", {"rows_independent": False}, "naive", "one scale over the whole batch"),
    ("symm_mem", {"rows_independent": False}, "all_to_all", "one scale over the whole batch"),
    ("auto", {"routes_inside": True}, "naive", "routes inside"),
    ("symm_mem", {"routes_inside": True}, "naive", "routes inside"),
]


@pytest.mark.parametrize("transport", ["nvshmem", "emulated"])
@pytest.mark.parametrize(("asked", "kwargs", "kind", "why"), CANNOT_RUN)
def test_what_symm_mem_cannot_run_takes_another_kind(
    monkeypatch, transport, asked, kwargs, kind, why
):
    use_transport(monkeypatch, transport)
    choice = resolve_dispatch(dp_config(asked), CPU, **kwargs)  # no ValueError for symm_mem
    assert choice.kind == kind and why in choice.reason, choice


@pytest.mark.parametrize(
    "pc",
    [
        ParallelConfig(),
        ParallelConfig(dp_size=2, dp_rank=1, all2all_backend="symm_mem"),  # DP only: no EP
        ParallelConfig(ep_size=2, ep_rank=1, all2all_backend="symm_mem"),  # shared tokens
    ],
    ids=["single", "dp_only", "ep_shared_tokens"],
)
def test_no_dispatch_where_tokens_stay(emulated, pc):
    choice = resolve_dispatch(pc, CPU)
    assert choice == DispatchChoice(None)
    assert choice.describe() == "none (tokens stay on their rank)"


def test_sequence_parallel_dispatches(emulated):
    pc = ParallelConfig(ep_size=2, ep_rank=1, sequence_parallel=True)
    assert resolve_dispatch(pc, CPU).kind == "symm_mem"


# ---- ParallelConfig: the new fields ------------------------------------------------------------
def test_parallel_config_defaults():
    pc = ParallelConfig()
    assert pc.all2all_backend == "auto"
    assert pc.max_tokens_per_rank == DEFAULT_MAX_TOKENS_PER_RANK >= 1
    assert ParallelConfig(max_tokens_per_rank=1).max_tokens_per_rank == 1
    assert dp_config("symm_mem", max_tokens_per_rank=4096).max_tokens_per_rank == 4096


@pytest.mark.parametrize("value", [True, False, 0, -1, 2.0, "8", None])
def test_max_tokens_per_rank_refused(value):
    with pytest.raises(ValueError, match=r"max_tokens_per_rank must be an int >= 1, got"):
        ParallelConfig(max_tokens_per_rank=value)


@pytest.mark.parametrize("backend", ["auto", "naive", "all_to_all", "symm_mem"])
def test_all2all_backends_accepted(backend):
    assert dp_config(backend).all2all_backend == backend


@pytest.mark.parametrize("backend", ["nvshmem", "SYMM_MEM", "symm-mem", "deepep", "", None])
def test_unknown_all2all_backend_refused(backend):
    with pytest.raises(ValueError, match=r"all2all_backend must be one of .*'symm_mem'"):
        dp_config(backend)


# ---- SymmMemEPPrepareFinalize ------------------------------------------------------------------
def symm_pf(max_tokens=4, *, ep_size=2, sequence_parallel=False, owner=None):
    if owner is None:
        owner = expert_placement(8, ep_size, "linear").owner()
    return SymmMemEPPrepareFinalize(
        ep_size, 0, owner, max_tokens_per_rank=max_tokens, sequence_parallel=sequence_parallel
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_tokens": True}, TypeError, "max_tokens_per_rank must be an int, got True"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens_per_rank must be an int, got 2.0"),
        ({"max_tokens": "4"}, TypeError, "max_tokens_per_rank must be an int"),
        ({"max_tokens": 0}, ValueError, "max_tokens_per_rank must be >= 1, got 0"),
        ({"max_tokens": -3}, ValueError, "max_tokens_per_rank must be >= 1, got -3"),
        ({"owner": torch.zeros(8)}, TypeError, r"expert_owner must have dtype in .*float32"),
        ({"owner": torch.zeros(2, 4, dtype=torch.int64)}, ValueError,
         "expert_owner must have 1 dimensions"),
        ({"owner": [0, 0, 1, 1]}, TypeError, "expert_owner must be a torch.Tensor"),
        ({"sequence_parallel": 1}, TypeError, "sequence_parallel must be a bool"),
    ],
)  # fmt: skip
def test_symm_pf_constructor_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        symm_pf(**kwargs)


@pytest.mark.parametrize("owner_dtype", [torch.int32, torch.int64])
def test_symm_pf_constructed(owner_dtype):
    owner = expert_placement(8, 2, "round_robin").owner().to(owner_dtype)
    pf = symm_pf(5, owner=owner)
    assert pf.single_pass() is True
    assert pf.capacity == 2 * 5 and pf.num_dispatchers() == 2
    assert pf.expert_owner.dtype == torch.int64
    assert_equal(pf.expert_owner, owner.long(), what="expert_owner")
    assert NoEPPrepareFinalize().single_pass() is False  # the default it overrides


@pytest.mark.parametrize(
    ("sequence_parallel", "ep_size", "ok", "too_many"),
    [(False, 2, (0, 1, 4), (5, 100)), (True, 2, (0, 7, 8), (9, 17)), (True, 4, (13, 16), (17,))],
)
def test_num_tokens_bounded_by_max_tokens_per_rank(
    monkeypatch, sequence_parallel, ep_size, ok, too_many
):
    """B = 4: a rank's own count, or under sequence parallelism its slice ceil(M / R), is at
    most B; the count itself is returned (one pass of every token, nothing exchanged). Over
    the bound the call is refused at its end (finalize raises the reason recorded here): the
    rank still joins the call's exchanges, so that its peers do not wait or fall out of step."""
    pf = symm_pf(4, ep_size=ep_size, sequence_parallel=sequence_parallel)
    monkeypatch.setattr(pf.comm, "check", lambda: None)  # no process group here
    for num_tokens in ok:
        assert pf.num_tokens_across_ranks(num_tokens, CPU) == num_tokens
        assert pf._refused is None
    for num_tokens in too_many:
        assert pf.num_tokens_across_ranks(num_tokens, CPU) == num_tokens
        assert re.search(r"at most max_tokens_per_rank = 4 .*raise", pf._refused)
    pf.num_tokens_across_ranks(ok[-1], CPU)  # the next call starts afresh
    assert pf._refused is None


def test_num_tokens_needs_a_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized here")
    with pytest.raises(ValueError, match=r"needs torch\.distributed initialized"):
        symm_pf().num_tokens_across_ranks(1, CPU)


def test_prepare_refuses_autograd_first():
    """Before the process group is checked, before any argument is looked at."""
    pf = symm_pf()
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="symm_mem dispatch is inference only"):
        pf.prepare(x, None, None, 8, None, False, None, requires_grad=True)
    if not (dist.is_available() and dist.is_initialized()):  # the same call for inference
        with pytest.raises(ValueError, match=r"needs torch\.distributed initialized"):
            pf.prepare(x, None, None, 8, None, False, None)


# ---- the modular kernel with a single-pass prepare/finalize ------------------------------------
def run_kernel(kernel, x, weights, topk_weights, topk_ids):
    return kernel.forward(
        x, weights, topk_weights, topk_ids, activation=ActivationSpec(),
        global_num_experts=weights.w13.shape[0],
    )  # fmt: skip


class CountingPrepareFinalize(NoEPPrepareFinalize):
    """No EP, counting prepare calls and their rows; single_pass as asked."""

    def __init__(self, single: bool) -> None:
        self.single = single
        self.rows: list[int] = []

    def single_pass(self) -> bool:
        return self.single

    def prepare(self, a1, *args, **kwargs):
        self.rows.append(a1.shape[0])
        return super().prepare(a1, *args, **kwargs)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, *args):
        if topk_ids.shape[0] == 0:  # as the EP finalize: nothing to reduce (a pass of no token)
            return
        super().finalize(output, fused_expert_output, topk_weights, topk_ids, *args)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 37])
@pytest.mark.parametrize("chunk_size", [1, 3])
def test_single_pass_runs_one_pass_whatever_the_chunk_size(num_tokens, chunk_size):
    hidden, num_experts = 16, 4
    experts = random_experts(num_experts, hidden, 8)
    weights = ExpertWeights(experts["w13"], experts["w2"])
    x = torch.randn(num_tokens, hidden)
    topk_weights, topk_ids = random_routing(num_tokens, num_experts, 2, empty=0.2)
    outputs = {}
    for single in (True, False):
        pf = CountingPrepareFinalize(single)
        kernel = FusedMoEModularKernel(pf, TorchExperts(), chunk_size=chunk_size)
        outputs[single] = run_kernel(kernel, x, weights, topk_weights, topk_ids)
        if single:
            assert pf.rows == [num_tokens]  # one pass, zero tokens too
        else:  # the control: the same object chunks when it is not single-pass
            chunks = range(0, num_tokens, chunk_size)
            assert pf.rows == [min(chunk_size, num_tokens - s) for s in chunks]
    assert outputs[True].shape == (num_tokens, hidden)
    assert_equal(outputs[True], outputs[False], what="single pass == chunked")
    assert_close(outputs[True], reference(x, experts, topk_weights, topk_ids), torch.float32)


class BufferPrepareFinalize(NoEPPrepareFinalize):
    """No EP, handing the experts an output buffer of its own (as symm_mem hands its combine's
    send rows), and recording what finalize gets."""

    def __init__(self) -> None:
        self.asked: list[tuple] = []
        self.buffer: torch.Tensor | None = None
        self.finalized: torch.Tensor | None = None

    def experts_may_write_output(self) -> bool:
        return False  # as the EP ones: the kernel does not hand the experts its output

    def expert_output_buffer(self, shape, dtype, device):
        self.asked.append((tuple(shape), dtype, device))
        self.buffer = poison_(torch.empty(shape, dtype=dtype, device=device))
        return self.buffer

    def finalize(self, output, fused_expert_output, *args):
        self.finalized = fused_expert_output
        super().finalize(output, fused_expert_output, *args)


@pytest.mark.parametrize("recorded", [False, True])
def test_experts_write_into_the_prepare_finalize_buffer(recorded):
    """FusedMoEModularKernel asks PrepareFinalize.expert_output_buffer between prepare and
    finalize, for inference only (a recorded call's output belongs to autograd)."""
    num_experts, hidden = 4, 16
    experts = random_experts(num_experts, hidden, 8)
    weights = ExpertWeights(experts["w13"].requires_grad_(recorded), experts["w2"])
    x = torch.randn(9, hidden)
    topk_weights, topk_ids = random_routing(9, num_experts, 2)
    pf = BufferPrepareFinalize()
    kernel = FusedMoEModularKernel(pf, TorchExperts())
    out = run_kernel(kernel, x, weights, topk_weights, topk_ids)
    assert_close(out, reference(x, experts, topk_weights, topk_ids), torch.float32)
    if recorded:
        assert pf.asked == [] and pf.buffer is None
        return
    assert len(pf.asked) == 1 and pf.asked[0][1:] == (torch.float32, CPU), pf.asked
    assert pf.finalized is pf.buffer  # the experts' output went there, finalize read it there
    assert not pf.buffer.isnan().any()  # written by the experts, every element
    assert symm_pf().expert_output_buffer((8, hidden), torch.float32, CPU) is None  # no call


# ---- the explanation ---------------------------------------------------------------------------
def test_explain_prints_the_dispatch_line_when_told():
    choice = select_backend(
        hidden_size=16,
        intermediate_size=8,
        num_experts=4,
        top_k=2,
        backend="torch",
        dtype=torch.float32,
    )
    assert choice.dispatch is None
    assert "dispatch:" not in choice.explain()
    told = dataclasses.replace(choice, dispatch="naive: auto; symm_mem needs CUDA (the layer ...)")
    lines = told.explain().splitlines()
    assert lines[0] == choice.explain().splitlines()[0]
    assert lines[1] == "  dispatch: naive: auto; symm_mem needs CUDA (the layer ...)"
    assert sum(line.startswith("  dispatch:") for line in lines) == 1
    direct = BackendChoice("torch", TorchExperts, "asked for", dispatch="symm_mem: asked for")
    assert direct.explain().splitlines()[1] == "  dispatch: symm_mem: asked for"


@pytest.mark.parametrize(
    ("transport", "requires_grad", "expected"),
    [
        ("nvshmem", False, "  dispatch: naive: auto; symm_mem needs CUDA"),
        ("emulated", False, "  dispatch: symm_mem: "),
        ("emulated", True, "  dispatch: naive: symm_mem is inference only"),
    ],
)
def test_layer_explains_how_its_tokens_travel(monkeypatch, transport, requires_grad, expected):
    use_transport(monkeypatch, transport)
    explained = small_layer(dp_config()).backend_choice(requires_grad=requires_grad).explain()
    assert any(line.startswith(expected) for line in explained.splitlines()), explained
    shared = small_layer(ParallelConfig(ep_size=2, ep_rank=0))  # partial sums: no dispatch
    assert "dispatch:" not in shared.backend_choice().explain()


def small_layer(pc: ParallelConfig) -> FusedMoE:
    return FusedMoE(4, 2, 16, 8, params_dtype=torch.float32, backend="torch", parallel_config=pc)


# ---- the metadata words of a row: packed on the way out, unpacked (stale rows emptied) in -----
@pytest.mark.parametrize(("num_tokens", "top_k", "num_scales", "num_ranks"),
                         [(0, 2, 0, 2), (1, 1, 0, 2), (37, 8, 0, 4), (19, 4, 56, 3)])  # fmt: skip
def test_pack_meta_kernel_equals_twin(num_tokens, top_k, num_scales, num_ranks):
    from fusedmoe.kernels.ep_rows import pack_meta_triton
    from fusedmoe.parallel.rows import dispatch_positions_torch, pack_meta_torch

    g = torch.Generator().manual_seed(num_tokens + top_k)
    ids = torch.randint(-1, 16, (num_tokens, top_k), generator=g, dtype=torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=g)
    scale = torch.rand(num_tokens, num_scales, generator=g) if num_scales else None
    owner = torch.randint(0, num_ranks, (16,), generator=g)
    capacity, col = num_ranks * max(num_tokens, 1), 4
    pos, _ = dispatch_positions_torch(ids, owner, num_ranks, capacity)
    width = col + 2 * top_k + num_scales + 3
    want = torch.full((capacity + 5, width), -7, dtype=torch.int32)  # poison
    got = want.clone()
    pack_meta_torch(ids, weights, scale, pos, want, col, capacity)
    if triton_runs_on(ids):
        pack_meta_triton(ids, weights.t().contiguous().t(), scale, pos, got, col, capacity)
        rows = torch.arange(capacity + 5) != capacity  # the twin writes row C, the kernel not
        assert_equal(got[rows], want[rows], what="packed words")
    # no other column or row written
    written = torch.zeros_like(want, dtype=torch.bool)
    written[pos[pos != capacity], col : col + 2 * top_k + num_scales] = True
    written[capacity] = True
    assert (want[~written] == -7).all()
    # the twin: ids then the weights' and scales' float32 bits, at col, nothing else touched
    for m in range(num_tokens):
        for r in range(num_ranks):
            slot = int(pos[m, r])
            if slot == capacity:
                continue
            row = want[slot]
            assert row[col : col + top_k].tolist() == ids[m].tolist()
            assert torch.equal(row[col + top_k : col + 2 * top_k].view(torch.float32), weights[m])
            if scale is not None:
                assert torch.equal(row[col + 2 * top_k : col + 2 * top_k + num_scales].view(
                    torch.float32), scale[m])  # fmt: skip


@pytest.mark.parametrize("received", [(0, 0, 0), (3, 0, 2), (4, 4, 4)])
@pytest.mark.parametrize("num_scales", [0, 7])
def test_unpack_meta_empties_the_stale_rows(received, num_scales):
    from fusedmoe.kernels.ep_rows import unpack_meta_triton
    from fusedmoe.parallel.rows import unpack_meta_torch

    top_k, capacity, col = 3, 12, 2
    g = torch.Generator().manual_seed(sum(received) + num_scales)
    src = torch.randint(-(2**30), 2**30, (capacity + 3, col + 2 * top_k + num_scales + 1),
                        generator=g, dtype=torch.int32)  # fmt: skip
    counts = torch.tensor(received, dtype=torch.int64)
    n = sum(received)
    ids, weights, scale = unpack_meta_torch(src, col, counts, capacity, top_k, num_scales)
    assert ids.shape == (capacity, top_k) and ids.dtype == torch.int32
    assert_equal(ids[:n], src[:n, col : col + top_k], what="live ids")
    assert (ids[n:] == -1).all() and (weights[n:] == 0).all()
    assert torch.equal(weights[:n].view(torch.int32), src[:n, col + top_k : col + 2 * top_k])
    if num_scales:
        assert (scale[n:] == 1).all()
        assert torch.equal(scale[:n].view(torch.int32), src[:n, col + 2 * top_k : -1])
    else:
        assert scale is None
    if triton_runs_on(src):
        got = unpack_meta_triton(src, col, counts, capacity, top_k, num_scales)
        assert_equal(got[0], ids, what="ids")
        assert torch.equal(got[1].view(torch.int32), weights.view(torch.int32))
        if num_scales:
            assert torch.equal(got[2].view(torch.int32), scale.view(torch.int32))


def test_buffers_refuse_a_second_caller_while_a_forward_is_in_flight():
    """Between a dispatch and its combine the shared buffers belong to that forward's thread
    and stream: another thread is refused (not silently mixed in), and so is the same caller
    (its last forward stopped midway: its exchanges are one behind its peers'); after the
    combine, anyone."""
    import threading

    from fusedmoe.parallel.symm_mem_ep import _Buffers

    empty = torch.empty(0)
    bufs = _Buffers(send=empty, recv=empty, out=empty, counts=empty, received=empty)
    errors = []

    def other():
        try:
            bufs.take(CPU)
        except RuntimeError as e:
            errors.append(str(e))

    bufs.take(CPU)
    with pytest.raises(RuntimeError, match="out of step with its peers"):
        bufs.take(CPU)  # the same thread again, before its combine
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "one EP forward of a group at a time" in errors[0]
    bufs.release()
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1  # free again: the other thread took it


# ---- the regions layout: ungrouped positions, per-rank targets, region unpack, barrier ---------
# Each rank's rows go into a region of its own at the destination: pos[m, r] is token m's index
# among the tokens going to rank r (no start added), the targets one tensor per rank (a region
# of each peer's buffer, or of a local staging buffer), the received rows unpacked per region.
def ungrouped_positions_ref(topk_ids, owner, num_ranks, num_slots):
    """Plain loops: pos[m, r] = #{m' < m going to r} where m goes to r, else num_slots."""
    pos = torch.full((topk_ids.shape[0], num_ranks), num_slots, dtype=torch.int64)
    counts = [0] * num_ranks
    for m, row in enumerate(topk_ids.tolist()):
        for r in sorted({int(owner[e]) for e in row if e >= 0}):
            pos[m, r] = counts[r]
            counts[r] += 1
    return pos, torch.tensor(counts, dtype=torch.int64)


# M2100: a rank's count carried over the shipped tile's blocks (nine, then their offsets)
UNGROUPED_PARAMS = [*ROUTE_PARAMS, *(p for p in BLOCK_PARAMS if p.id == "M2100")]


@pytest.mark.parametrize("case", UNGROUPED_PARAMS)
@pytest.mark.parametrize("path", ["twin", "triton", "fallback"])
def test_dispatch_positions_ungrouped_and_posted(monkeypatch, case, path):
    """grouped=False: each rank's rows numbered from 0; count r also stored into post[r] (a
    one-element slot of a separate tensor, nothing around it touched). "triton": the dispatcher
    where Triton runs (the kernel); "fallback": where it does not (the twin, then the posts)."""
    ids, owner = route(case)
    num_ranks = case.num_ranks
    num_slots = num_ranks * max(case.num_tokens, 1) + 3
    expected_pos, expected_counts = ungrouped_positions_ref(ids, owner, num_ranks, num_slots)
    me = min(1, num_ranks - 1)  # this rank's slot in each peer's incoming counts
    incoming = [torch.full((num_ranks + 1,), -9, dtype=torch.int64) for _ in range(num_ranks)]
    posts = [slots[me : me + 1] for slots in incoming]
    if path == "twin":
        pos, counts = dispatch_positions_torch(ids, owner, num_ranks, num_slots, grouped=False)
    else:
        if path == "triton" and not triton_runs_on(ids):
            pytest.skip("needs Triton on this device")
        if path == "fallback":
            if torch.cuda.is_available():
                pytest.skip("the CPU machine's case")
            monkeypatch.setenv("TRITON_INTERPRET", "0")
        counts = torch.full((num_ranks,), -7, dtype=torch.int64)  # written, not added to
        pos = dispatch_positions(
            ids, owner, num_ranks, num_slots, counts, grouped=False, post=posts
        )
        for r, slots in enumerate(incoming):
            expected = torch.full((num_ranks + 1,), -9, dtype=torch.int64)
            expected[me] = expected_counts[r]
            assert_equal(slots, expected, what=f"rank {r}'s incoming slots")
    assert pos.dtype == torch.int64 and pos.shape == (case.num_tokens, num_ranks)
    assert_equal(counts, expected_counts, what="counts")
    assert_equal(pos, expected_pos, what="ungrouped pos")
    # the grouped layout is the same rows with each rank's start added
    grouped, _ = dispatch_positions_ref(ids, owner, num_ranks, num_slots)
    sent = pos != num_slots
    starts = torch.cumsum(expected_counts, 0) - expected_counts
    assert_equal(torch.where(sent, pos + starts, num_slots), grouped, what="grouped - starts")


REGION_ROWS = 8  # B: rows of a rank's region (>= M)


def regions_routing(num_tokens=7, num_ranks=3, silent=2):
    """(topk_ids with -1 slots, pos [M, R] ungrouped, counts [R], C = R * B): repeats, token 0
    sent nowhere, rank `silent` sent nothing."""
    ids, owner = route(RouteCase("regions", num_tokens, 2 * num_ranks, 3, num_ranks,
                                 "round_robin", empty=0.25, routing="repeats"))  # fmt: skip
    ids = ids.masked_fill(owner[ids.long().clamp(min=0)] == silent, -1)
    ids[0] = -1
    capacity = num_ranks * REGION_ROWS
    pos, counts = ungrouped_positions_ref(ids, owner, num_ranks, capacity)
    assert counts[silent] == 0 and all(counts[r] > 0 for r in range(num_ranks) if r != silent)
    return ids, owner, pos, counts, capacity


# how the R per-rank targets lie: (buffers of the layout, targets from those buffers)
TARGET_LAYOUTS = {
    # region r of one buffer (the emulated transport's staging buffer)
    "one_buffer": (1, lambda bufs, num_ranks: [bufs[0][r * REGION_ROWS :]
                                               for r in range(num_ranks)]),
    # as one_buffer, every other target a column further: offsets not multiples of 16 elements
    "shifted": (1, lambda bufs, num_ranks: [bufs[0][r * REGION_ROWS :, r % 2 :]
                                            for r in range(num_ranks)]),
    # rank r's own buffer, this rank's region (1) of each: symm_mem's peers' buffers
    "peers": (None, lambda bufs, num_ranks: [b[REGION_ROWS :] for b in bufs]),
    # separate buffers, each target at a row offset of its own
    "skewed": (None, lambda bufs, num_ranks: [b[2 * r + 1 :] for r, b in enumerate(bufs)]),
}  # fmt: skip


def rank_buffers(layout, num_ranks, cols, make_buffer):
    """(buffers, targets): the buffers of the layout, made by make_buffer(shape)."""
    count, targets = TARGET_LAYOUTS[layout]
    shape = (num_ranks * REGION_ROWS + 3, cols)
    bufs = [make_buffer(shape) for _ in range(count or num_ranks)]
    return bufs, targets(bufs, num_ranks)


def check_alignment(layout, targets):
    """rank_offsets' offsets and aligned flag against the addresses."""
    from fusedmoe.kernels.ep_rows import rank_offsets

    base, offsets, aligned = rank_offsets(targets, len(targets))
    assert base is targets[0] and offsets.dtype == torch.int64
    item = base.element_size()
    deltas = [(t.data_ptr() - base.data_ptr()) // item for t in targets]
    assert offsets.tolist() == deltas
    assert aligned == all(d % 16 == 0 for d in deltas)
    if layout == "one_buffer":  # row stride 50 elements, regions of 8 rows: 400 = 25 * 16
        assert aligned
    if layout == "shifted":
        assert not aligned


def scatter_list_ref(src, pos, targets, col, trash):
    """Plain loops into the targets (in place)."""
    for m in range(pos.shape[0]):
        for r, target in enumerate(targets):
            p = int(pos[m, r])
            if p != trash:
                target[p, col : col + src.shape[1]] = src[m]


@needs_triton
@pytest.mark.parametrize("layout", list(TARGET_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.int32])
def test_scatter_rows_to_per_rank_targets(layout, dtype):
    """M = 7, R = 3, W = 45 at column 2 of rows of 50: Triton == twin == loops, every element
    the routing does not target (other regions, rank 2's, the row ends) still poisoned."""
    from fusedmoe.kernels.ep_rows import scatter_rows_triton

    _, _, pos, _, capacity = regions_routing()
    width, col, cols = 45, 2, 50
    src = random_rows((7, width + 4), dtype)[:, :width]  # row stride 49
    results = {}
    for name, run in (("loops", scatter_list_ref), ("twin", scatter_rows_torch),
                      ("triton", scatter_rows_triton)):  # fmt: skip
        bufs, targets = rank_buffers(layout, 3, cols, lambda shape: poisoned(shape, dtype))
        if name == "triton":
            check_alignment(layout, targets)
        run(src, pos, targets, col, capacity)
        results[name] = bufs
    for name in ("twin", "triton"):
        for i, (got, want) in enumerate(zip(results[name], results["loops"], strict=True)):
            assert_same_rows(got, want, what=f"{name} buffer {i}")


def pack_list_ref(ids, weights, scale, pos, targets, col, trash):
    for m in range(pos.shape[0]):
        words = [*ids[m].tolist(), *weights[m].float().view(torch.int32).tolist()]
        if scale is not None:
            words += scale[m].float().view(torch.int32).tolist()
        for r, target in enumerate(targets):
            p = int(pos[m, r])
            if p != trash:
                target[p, col : col + len(words)] = torch.tensor(words, dtype=torch.int32)


@needs_triton
@pytest.mark.parametrize("layout", list(TARGET_LAYOUTS))
@pytest.mark.parametrize("num_scales", [0, 5])
def test_pack_meta_to_per_rank_targets(layout, num_scales):
    """k = 3 ids | weights | scales as int32 words at column 4 of rows of 50: Triton == twin ==
    loops, nothing else written."""
    from fusedmoe.kernels.ep_rows import pack_meta_triton
    from fusedmoe.parallel.rows import pack_meta, pack_meta_torch

    ids, _, pos, _, capacity = regions_routing()
    weights = torch.rand(7, 6)[:, ::2] + 0.1  # strided, never zero
    scale = torch.rand(7, num_scales + 2)[:, 1:-1] + 0.5 if num_scales else None
    col = 4
    results = {}
    for name, run in (("loops", pack_list_ref), ("twin", pack_meta_torch),
                      ("triton", pack_meta_triton), ("dispatcher", pack_meta)):  # fmt: skip
        bufs, targets = rank_buffers(layout, 3, 50, lambda shape: poisoned(shape, torch.int32))
        if name == "triton":
            check_alignment(layout, targets)
        run(ids, weights, scale, pos, targets, col, capacity)
        results[name] = bufs
    for name in ("twin", "triton", "dispatcher"):
        for i, (got, want) in enumerate(zip(results[name], results["loops"], strict=True)):
            assert_equal(got, want, what=f"{name} buffer {i}")
    written = sum(int((b != 77).sum()) for b in results["loops"])
    assert written == int((pos != capacity).sum()) * (6 + num_scales)


def gather_list_ref(targets, pos, hidden, trash):
    out = torch.zeros(pos.shape[0], hidden, dtype=torch.float64)
    for m in range(pos.shape[0]):
        for r, source in enumerate(targets):
            p = int(pos[m, r])
            if p != trash:
                out[m] += source[p, :hidden].double()
    return out


@needs_triton
@pytest.mark.parametrize("layout", list(TARGET_LAYOUTS))
@pytest.mark.parametrize(("src_dtype", "out_dtype"), [(torch.bfloat16, torch.bfloat16),
                                                      (torch.float16, torch.float32),
                                                      (torch.float32, torch.float32)])  # fmt: skip
def test_gather_sum_rows_from_per_rank_sources(layout, src_dtype, out_dtype):
    """H = 45 of rows of 50; only the rows each source rank holds for this rank hold values,
    every other element (stale rows, other regions) NaN: Triton == twin == loops, a token sent
    nowhere summing to 0."""
    from fusedmoe.kernels.ep_rows import gather_sum_rows_triton

    _, _, pos, counts, capacity = regions_routing()
    hidden = 45
    _, sources = rank_buffers(layout, 3, 50, lambda shape: poisoned(shape, src_dtype))
    for r, source in enumerate(sources):  # the rows rank r holds for this rank
        source[: int(counts[r])] = torch.randn(int(counts[r]), source.shape[1]).to(src_dtype)
    check_alignment(layout, sources)
    expected = gather_list_ref(sources, pos, hidden, capacity)
    assert not expected.isnan().any() and (expected[0] == 0).all()
    got, twin = poisoned((7, hidden), out_dtype), poisoned((7, hidden), out_dtype)
    gather_sum_rows_triton(sources, pos, got, capacity)
    gather_sum_rows_torch(sources, pos, twin, capacity)
    assert_close(twin, expected, out_dtype, what="twin vs loops")
    assert_close(got, expected, out_dtype, what="triton vs loops")
    assert_close(got, twin, out_dtype, what="triton vs twin")
    dispatched = poisoned((7, hidden), out_dtype)
    gather_sum_rows(sources, pos, dispatched, capacity)
    assert_close(dispatched, expected, out_dtype, what="dispatcher vs loops")


def unpack_regions_ref(src, col, received, region_rows, num_regions, top_k, num_scales):
    """Plain loops: rank s's rows [s * B, s * B + received[s]) as sent, the others empty."""
    capacity = num_regions * region_rows
    ids = torch.full((capacity, top_k), -1, dtype=torch.int32)
    weights = torch.zeros(capacity, top_k, dtype=torch.float32)
    scale = torch.ones(capacity, num_scales, dtype=torch.float32)
    for s in range(num_regions):
        for i in range(int(received[s])):
            words = src[s * region_rows + i, col:]
            ids[s * region_rows + i] = words[:top_k]
            weights[s * region_rows + i] = words[top_k : 2 * top_k].view(torch.float32)
            scale[s * region_rows + i] = words[2 * top_k : 2 * top_k + num_scales].view(
                torch.float32
            )
    return ids, weights, scale if num_scales else None


@pytest.mark.parametrize("received", [(0, 0, 0), (8, 8, 8), (0, 8, 3), (5, 0, 8), (1, 7, 0)])
@pytest.mark.parametrize("num_scales", [0, 3])
@pytest.mark.parametrize("path", ["twin", "triton", "dispatcher"])
def test_unpack_meta_in_regions(received, num_scales, path):
    """region_rows = B = 8, R = 3: rank s's rows [8s, 8s + received[s]) arrived (0 and B
    among them), every other row an empty slot (id -1, weight 0, scale 1)."""
    from fusedmoe.parallel.rows import unpack_meta, unpack_meta_torch

    top_k, col, num_ranks = 3, 2, 3
    capacity = num_ranks * REGION_ROWS
    src = torch.randint(-(2**30), 2**30, (capacity + 2, col + 2 * top_k + num_scales + 1),
                        dtype=torch.int32)  # fmt: skip
    counts = torch.tensor(received, dtype=torch.int64)
    if path == "triton":
        if not triton_runs_on(src):
            pytest.skip("needs Triton on this device")
        from fusedmoe.kernels.ep_rows import unpack_meta_triton as run
    else:
        run = unpack_meta_torch if path == "twin" else unpack_meta
    got = run(src, col, counts, capacity, top_k, num_scales, REGION_ROWS)
    want = unpack_regions_ref(src, col, counts, REGION_ROWS, num_ranks, top_k, num_scales)
    assert got[0].dtype == torch.int32 and got[0].shape == (capacity, top_k)
    assert_equal(got[0], want[0], what="ids")
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)), "weights"
    if num_scales:
        assert torch.equal(got[2].view(torch.int32), want[2].view(torch.int32)), "scales"
    else:
        assert got[2] is None
    live = int((got[0][:, 0] != -1).sum())  # ids of the live rows: never -1 by chance here
    assert live == sum(received)


@needs_triton
def test_regions_round_trip_over_three_ranks():
    """Three ranks on one process, through the dispatchers: each rank's rows (x's bytes, then
    its ids | weights words) into its region of every destination's receive buffer and its
    count into the destination's incoming slot; unpacked per region; the "experts" scale the
    rows by (r + 1) into their out, whose stale rows stay poisoned; each rank sums its tokens'
    rows loaded from its region of every rank's out (the peer transport's combine). Rank 2 is
    sent nothing, and token 0 of each rank goes nowhere."""
    from fusedmoe.parallel.rows import pack_meta, unpack_meta

    num_ranks, hidden, top_k, B = 3, 45, 3, REGION_ROWS
    capacity = num_ranks * B
    x_bytes = 192  # 45 float32 = 180 bytes, the words from 16-byte aligned column 192
    row_bytes = x_bytes + 4 * 2 * top_k
    word_col = x_bytes // 4
    owner = expert_placement(2 * num_ranks, num_ranks, "round_robin").owner()
    num_tokens = (7, 5, 3)
    xs, ids, weights = [], [], []
    for m in num_tokens:
        topk = torch.randint(0, 2 * num_ranks, (m, top_k), dtype=torch.int32)
        topk = topk.masked_fill((torch.rand(m, top_k) < 0.2) | (owner[topk.long()] == 2), -1)
        topk[0] = -1
        xs.append(torch.randn(m, hidden))
        ids.append(topk)
        weights.append(torch.rand(m, top_k) + 0.1)
    recv = [torch.full((capacity + 1, row_bytes), 0xEE, dtype=torch.uint8) for _ in range(3)]
    incoming = [torch.full((num_ranks,), -5, dtype=torch.int64) for _ in range(3)]
    positions_of = []
    for q in range(num_ranks):  # rank q's dispatch
        targets = [peer[q * B :] for peer in recv]
        posts = [peer[q : q + 1] for peer in incoming]
        counts = torch.empty(num_ranks, dtype=torch.int64)
        pos = dispatch_positions(ids[q], owner, num_ranks, capacity, counts, grouped=False,
                                 post=posts)  # fmt: skip
        x = xs[q].view(torch.uint8)
        scatter_rows(x, pos, targets, 0, capacity)
        words = [t.view(torch.int32) for t in targets]
        pack_meta(ids[q], weights[q], None, pos, words, word_col, capacity)
        positions_of.append(pos)
    outs = []
    for r in range(num_ranks):  # what rank r received, from its incoming counts alone
        sent = [[m for m, row in enumerate(ids[s].tolist())
                 if any(e >= 0 and int(owner[e]) == r for e in row)]
                for s in range(num_ranks)]  # fmt: skip
        assert incoming[r].tolist() == [len(tokens) for tokens in sent]
        got_ids, got_weights, scale = unpack_meta(recv[r].view(torch.int32), word_col,
                                                  incoming[r], capacity, top_k, 0, B)  # fmt: skip
        assert scale is None
        x_in = recv[r][:capacity, : 4 * hidden].view(torch.float32)
        out = poison_(torch.empty(capacity + 1, hidden))
        for s in range(num_ranks):
            for i in range(B):
                row = s * B + i
                if i < len(sent[s]):
                    m = sent[s][i]
                    assert_equal(got_ids[row], ids[s][m], what=f"rank {r} row {row} ids")
                    assert torch.equal(got_weights[row], weights[s][m])
                    assert torch.equal(x_in[row], xs[s][m])
                    out[row] = x_in[row] * (r + 1)  # the experts' rows
                else:
                    assert (got_ids[row] == -1).all() and (got_weights[row] == 0).all()
        outs.append(out)
    assert (incoming[2] == 0).all()
    for q in range(num_ranks):  # rank q sums its tokens' rows, loaded from region q of each out
        y = poison_(torch.empty(num_tokens[q], hidden))
        gather_sum_rows([out[q * B :] for out in outs], positions_of[q], y, capacity)
        factor = torch.tensor(
            [sum(r + 1 for r in {int(owner[e]) for e in row if e >= 0}) for row in ids[q].tolist()],
            dtype=torch.float32,
        )
        assert factor[0] == 0
        assert_close(y, xs[q] * factor[:, None], torch.float32, what=f"rank {q} combine")


# ---- rank_offsets -----------------------------------------------------------------------------
def _unaligned_float32(offset_bytes):
    import numpy as np

    raw = bytearray(4 * 64)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.float32, count=16, offset=offset_bytes))


@needs_triton
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: [torch.zeros(4, 8)] * 2, "2 per-rank targets for 3 ranks"),
        (lambda: [torch.zeros(4, 8)] * 4, "4 per-rank targets for 3 ranks"),
        (lambda: [torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16)],
         "one dtype, device and row stride"),
        (lambda: [torch.zeros(4, 8), torch.zeros(4, 9)[:, :8], torch.zeros(4, 8)],
         "one dtype, device and row stride"),
        (lambda: [torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 8, device="meta")],
         "one dtype, device and row stride"),
        (lambda: [_unaligned_float32(0), _unaligned_float32(2), _unaligned_float32(4)],
         "bytes apart: not whole"),
    ],
    ids=["too_few", "too_many", "dtype", "row_stride", "device", "not_whole_elements"],
)  # fmt: skip
def test_rank_offsets_refuses(make, match):
    from fusedmoe.kernels.ep_rows import rank_offsets

    with pytest.raises(ValueError, match=match):
        rank_offsets(make(), 3)


@needs_triton
def test_rank_offsets_values_and_alignment():
    from fusedmoe.kernels.ep_rows import rank_offsets

    one = torch.zeros(10, 45)
    base, offsets, aligned = rank_offsets(one, 3)  # one tensor: every rank, offset 0
    assert base is one and offsets.tolist() == [0, 0, 0] and aligned
    buf = torch.zeros(30, 48)  # regions of 5 rows of 48: 240 elements apart, 15 * 16
    regions = [buf[5 * r :] for r in range(3)]
    base, offsets, aligned = rank_offsets(regions, 3)
    assert base is regions[0] and offsets.tolist() == [0, 240, 480] and aligned
    base, offsets, aligned = rank_offsets(regions, 3, base_index=2)  # from the last one
    assert base is regions[2] and offsets.tolist() == [-480, -240, 0] and aligned
    odd = [buf[5 * r :, r:] for r in range(3)]  # one row stride, offsets 0, 241, 482
    _, offsets, aligned = rank_offsets(odd, 3)
    assert offsets.tolist() == [0, 241, 482] and not aligned
    strided = torch.zeros(30, 45)  # regions of 5 rows of 45: 225 elements apart
    _, offsets, aligned = rank_offsets([strided[5 * r :] for r in range(3)], 3)
    assert offsets.tolist() == [0, 225, 450] and not aligned
    rows_of_40 = torch.zeros(3, 40, dtype=torch.bfloat16)  # 40 apart: 16-byte, not 16-element
    _, offsets, aligned = rank_offsets([rows_of_40[r:] for r in range(3)], 3)
    assert offsets.tolist() == [0, 40, 80] and not aligned
    slots = torch.zeros(7, dtype=torch.int64)  # the posts' one-element slots
    _, offsets, aligned = rank_offsets([slots[1:2], slots[6:7], slots[0:1]], 3)
    assert offsets.tolist() == [0, 5, -1] and not aligned
    far = torch.zeros(40, dtype=torch.int64)
    _, offsets, aligned = rank_offsets([far[16:17], far[0:1], far[32:33]], 3)
    assert offsets.tolist() == [0, -16, 16] and aligned


@pytest.mark.parametrize("runner", ["twin", pytest.param("triton", marks=needs_triton)])
def test_row_movers_refuse_a_wrong_count_of_targets(runner):
    from fusedmoe.parallel import rows as twins

    if runner == "triton":
        from fusedmoe.kernels import ep_rows

        scatter, gather, pack = (ep_rows.scatter_rows_triton, ep_rows.gather_sum_rows_triton,
                                 ep_rows.pack_meta_triton)  # fmt: skip
    else:
        scatter, gather, pack = (twins.scatter_rows_torch, twins.gather_sum_rows_torch,
                                 twins.pack_meta_torch)  # fmt: skip
    pos = torch.tensor([[0, 1, 6], [6, 0, 6]])  # R = 3, trash 6
    two = [torch.zeros(6, 8), torch.zeros(6, 8)]
    with pytest.raises(ValueError, match="2 per-rank targets for 3 ranks"):
        scatter(torch.randn(2, 8), pos, two, 0, 6)
    with pytest.raises(ValueError, match="2 per-rank targets for 3 ranks"):
        gather(two, pos, torch.empty(2, 8), 6)
    words = [torch.zeros(6, 8, dtype=torch.int32)] * 4
    with pytest.raises(ValueError, match="4 per-rank targets for 3 ranks"):
        pack(torch.zeros(2, 2, dtype=torch.int32), torch.rand(2, 2), None, pos, words, 0, 6)


# ---- barrier_triton ---------------------------------------------------------------------------
def epoch_pads(num_ranks, rank, done, seen):
    """(pads, their guarded buffers): pads[r] an int64 [R + 1] view inside a buffer of its own
    with a guard word (99) either side. This rank has made `done` barriers (its pad[R]) and
    seen the epochs `seen[s]` from each rank s (its pad[s]); the peers' pads hold random
    epochs (their own business: only word [rank] of each is this rank's to write)."""
    buffers = []
    for r in range(num_ranks):
        buf = torch.full((num_ranks + 3,), 99, dtype=torch.int64)
        if r == rank:
            buf[1:-1] = torch.tensor([*seen, done])
        else:
            buf[1:-1] = torch.randint(0, 9, (num_ranks + 1,))
        buffers.append(buf)
    return [buf[1:-1] for buf in buffers], buffers


def expected_pads(buffers, rank, epoch):
    """After rank's barrier of `epoch`: word [rank] of every pad = epoch, its own count too."""
    want = [buf.clone() for buf in buffers]
    for buf in want:
        buf[1 + rank] = epoch
    want[rank][1 + len(buffers)] = epoch
    return want


def run_in_thread(fn, timeout):
    """fn() in a daemon thread: (thread, errors); joined for `timeout` s (a hang fails the test
    instead of the session)."""
    import threading

    errors = []

    def body():
        try:
            fn()
        except BaseException as e:  # reported in the test's thread
            errors.append(e)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(timeout)
    return thread, errors


@needs_triton
@pytest.mark.parametrize(
    ("num_ranks", "rank", "done", "seen"),
    [(1, 0, 0, [0]), (2, 1, 0, [1, 0]), (3, 0, 4, [4, 5, 5]), (3, 2, 1, [3, 2, 1]),
     (4, 1, 6, [7, 6, 9, 7])],
)  # fmt: skip
def test_barrier_writes_its_epoch_everywhere_and_returns_once_every_rank_is_there(
    num_ranks, rank, done, seen
):
    """Every peer already at this barrier's epoch (done + 1) or past it (a fast peer already at
    its next barrier): rank's barrier writes the epoch into word [rank] of every pad (itself
    too) and its own count, and returns; no other word written."""
    from fusedmoe.kernels.ep_rows import barrier_triton

    seen = [max(e, done + 1) if s != rank else e for s, e in enumerate(seen)]
    pads, buffers = epoch_pads(num_ranks, rank, done, seen)
    want = expected_pads(buffers, rank, done + 1)
    thread, errors = run_in_thread(lambda: barrier_triton(pads, rank), timeout=30)
    assert not thread.is_alive(), "the barrier did not return: an epoch not seen"
    assert not errors, errors
    for r, (got, expected) in enumerate(zip(buffers, want, strict=True)):
        assert_equal(got, expected, what=f"rank {r}'s pad (guards around it)")


@needs_triton
def test_barrier_timeout_from_the_environment(monkeypatch):
    """FUSEDMOE_EP_BARRIER_TIMEOUT_S: unset, the default (NCCL's 10 minutes); a number of
    seconds, 0 for no limit; anything else refused before a barrier is launched."""
    from fusedmoe.kernels import ep_rows

    monkeypatch.delenv(ep_rows.BARRIER_TIMEOUT_ENV, raising=False)
    assert ep_rows.barrier_timeout_s() == ep_rows.BARRIER_TIMEOUT_S == 600.0
    for raw, want in (("2.5", 2.5), ("0", 0.0), ("30", 30.0)):
        monkeypatch.setenv(ep_rows.BARRIER_TIMEOUT_ENV, raw)
        assert ep_rows.barrier_timeout_s() == want
    for raw in ("-1", "soon", "nan", "inf", ""):
        monkeypatch.setenv(ep_rows.BARRIER_TIMEOUT_ENV, raw)
        with pytest.raises(ValueError, match="FUSEDMOE_EP_BARRIER_TIMEOUT_S"):
            ep_rows.barrier_timeout_s()
        with pytest.raises(ValueError, match="FUSEDMOE_EP_BARRIER_TIMEOUT_S"):
            ep_rows.barrier_triton([torch.zeros(3, dtype=torch.int64)] * 2, 0)


@needs_triton
def test_barrier_refuses_pads_of_another_shape():
    from fusedmoe.kernels.ep_rows import barrier_triton

    with pytest.raises(ValueError, match=r"int64 \[R \+ 1\]"):
        barrier_triton([torch.zeros(2, dtype=torch.int32)] * 2, 0)
    with pytest.raises(ValueError, match=r"int64 \[R \+ 1\]"):
        barrier_triton([torch.zeros(2, dtype=torch.int64)] * 2, 0)


@needs_triton
def test_barrier_waits_for_a_late_peer():
    """Rank 0 of 3 at its 3rd barrier, rank 2 still at its 2nd: the barrier writes its epoch,
    then waits (in a thread of its own: the only kernel running) until rank 2's arrives."""
    import time

    from fusedmoe.kernels.ep_rows import barrier_triton

    pads, buffers = epoch_pads(3, 0, 2, [2, 3, 2])
    want = expected_pads(buffers, 0, 3)
    want[0][1 + 2] = 3  # rank 2's epoch, when it comes
    thread, errors = run_in_thread(lambda: barrier_triton(pads, 0), timeout=0)
    deadline = time.monotonic() + 30
    while any(int(buffers[r][1]) != 3 for r in (1, 2)):  # its epoch written to its peers
        assert thread.is_alive() and time.monotonic() < deadline, (errors, buffers)
        time.sleep(0.01)
    time.sleep(0.3)
    assert thread.is_alive() and not errors, "returned before rank 2 arrived"
    pads[0][2] = 3  # rank 2 arrives
    thread.join(30)
    assert not thread.is_alive() and not errors, errors
    for r, (got, expected) in enumerate(zip(buffers, want, strict=True)):
        assert_equal(got, expected, what=f"rank {r}'s pad")


@needs_triton
@pytest.mark.parametrize("programs", [1, 3])
def test_scatter_rows_striding_over_its_items_matches_the_twin(monkeypatch, programs):
    """scatter_rows with fewer programs than items (as on a GPU, where each takes at most 8
    programs a SM and strides over the rest): the same bytes as its twin."""
    from fusedmoe.kernels import ep_rows

    monkeypatch.setattr(ep_rows, "_programs", lambda items, t: min(items, programs))
    torch.manual_seed(programs)
    num_ranks, region, width = 3, 5, 6000  # bytes: two column blocks, the second ragged
    ids = torch.randint(0, 6, (7, 2))
    ids[1, 0] = -1
    owner = torch.tensor([0, 0, 1, 1, 2, 2])
    pos, _ = dispatch_positions_torch(ids, owner, num_ranks, num_ranks * region, grouped=False)
    src = torch.randint(0, 256, (7, width), dtype=torch.uint8)
    got = torch.full((num_ranks * region, width), 0xEE, dtype=torch.uint8)
    want = got.clone()
    ep_rows.scatter_rows_triton(src, pos, [got[r * region :] for r in range(num_ranks)], 0,
                                num_ranks * region)  # fmt: skip
    scatter_rows_torch(src, pos, [want[r * region :] for r in range(num_ranks)], 0,
                       num_ranks * region)  # fmt: skip
    assert torch.equal(got, want)


@needs_triton
def test_rank_tensors_find_their_offsets_once():
    """RankTensors (a plan's per-rank views): rank_offsets checks them at its first call and
    returns the same result after, per (R, base_index); a plain tuple is checked every time."""
    from fusedmoe.kernels import ep_rows

    buf = torch.zeros(4, 64, dtype=torch.float32)
    views = ep_rows.RankTensors(buf[r:] for r in range(3))
    first = ep_rows.rank_offsets(views, 3)
    assert first[1].tolist() == [0, 64, 128] and first[2]
    assert ep_rows.rank_offsets(views, 3) is first
    other = ep_rows.rank_offsets(views, 3, base_index=2)
    assert other is not first and other[1].tolist() == [-128, -64, 0]
    calls = []
    real = ep_rows._rank_offsets

    def counting(*args):
        calls.append(args)
        return real(*args)

    import unittest.mock

    with unittest.mock.patch.object(ep_rows, "_rank_offsets", counting):
        ep_rows.rank_offsets(views, 3)
        ep_rows.rank_offsets(tuple(views), 3)
        ep_rows.rank_offsets(tuple(views), 3)
    assert len(calls) == 2  # the plain tuples, not the RankTensors


@needs_triton
def test_barrier_takes_rank_tensors():
    """The peer transport hands the barrier its pads as RankTensors (offsets found once, from
    this rank's own pad): the same epochs as with a list, call after call."""
    from fusedmoe.kernels.ep_rows import RankTensors, barrier_triton

    pads, _ = epoch_pads(2, 1, 0, [2, 0])
    held = RankTensors(pads)
    for epoch in (1, 2):
        thread, errors = run_in_thread(lambda: barrier_triton(held, 1), timeout=30)
        assert not thread.is_alive() and not errors, errors
        assert pads[1].tolist() == [2, epoch, epoch] and int(pads[0][1]) == epoch
