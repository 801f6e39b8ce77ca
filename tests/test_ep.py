"""Expert parallelism: placement, the EP prepare/finalize objects, sharded == unsharded.

The distributed cases spawn 2, 3 and 4 gloo processes once each (module fixtures), run every case
of EP_CASES there, and compare each rank's outputs with the single-process layer (NoEP, every
expert, all tokens at once) computed here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fusedmoe import FusedMoE, ParallelConfig, get_compressed_expert_map, select_backend
from fusedmoe.parallel.config import linear_expert_map, round_robin_expert_map
from fusedmoe.parallel.naive_ep import even_split, quantizes_before_dispatch
from fusedmoe.parallel.placement import ExpertPlacement, expert_placement
from fusedmoe.parallel.symm_mem_ep import TRANSPORT_ENV, combine_blocks_override
from fusedmoe.quant.config import quantize_experts
from tests.helpers import assert_close, assert_equal, free_port, init_gloo, spawn_ranks

E, H, I = 8, 128, 128  # H, I: whole 128-blocks for fp8_block
TOP_K = 3


# ---- placement ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_experts", [1, 7, 8, 13])
@pytest.mark.parametrize("ep_size", [1, 2, 3, 4])
def test_linear_and_round_robin_maps(num_experts, ep_size):
    if ep_size > num_experts:
        pytest.skip("every rank needs an expert")
    seen_linear, seen_rr = [], []
    for rank in range(ep_size):
        linear = linear_expert_map(num_experts, ep_size, rank)
        rr = round_robin_expert_map(num_experts, ep_size, rank)
        mine = [g for g in range(num_experts) if int(linear[g]) >= 0]
        expected_count = num_experts // ep_size + (1 if rank < num_experts % ep_size else 0)
        assert len(mine) == expected_count
        assert mine == list(range(mine[0], mine[0] + len(mine)))  # contiguous
        assert [int(linear[g]) for g in mine] == list(range(len(mine)))
        mine_rr = [g for g in range(num_experts) if int(rr[g]) >= 0]
        assert mine_rr == list(range(rank, num_experts, ep_size))
        assert [int(rr[g]) for g in mine_rr] == list(range(len(mine_rr)))
        seen_linear += mine
        seen_rr += mine_rr
        for strategy, expert_map in (("linear", linear), ("round_robin", rr)):
            placement = expert_placement(num_experts, ep_size, strategy)
            assert_equal(placement.expert_map(rank), expert_map, what=f"{strategy} rank {rank}")
    assert sorted(seen_linear) == sorted(seen_rr) == list(range(num_experts))  # each once


def test_placement_with_replicas():
    placement = expert_placement(5, 3, "linear", num_redundant_experts=2)  # P = 7: 3 + 2 + 2
    assert placement.num_physical == 7 and placement.has_replicas
    assert placement.physical_to_logical == (0, 1, 2, 3, 4, 0, 1)
    assert [placement.local_physical(r) for r in range(3)] == [(0, 1, 2), (3, 4), (5, 6)]
    assert placement.local_logical(2) == (0, 1)
    assert placement.contiguous_start(0) is None  # replicas: a map, not a shift
    table, counts = placement.replica_table()
    assert table.tolist() == [[0, 5], [1, 6], [2, 2], [3, 3], [4, 4]]
    assert counts.tolist() == [2, 2, 1, 1, 1]
    assert placement.owner().tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert placement.describe(2) == "0->5(0), 1->6(1)"
    assert expert_placement(8, 3).contiguous_start(1) == 3
    assert expert_placement(8, 2, "round_robin").contiguous_start(0) is None
    assert get_compressed_expert_map(placement.expert_map(1)) == "0->3, 1->4"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(num_logical=2, ep_size=1, physical_to_logical=(0,), physical_rank=(0,)),
         ValueError, "cannot hold 2 logical"),
        (dict(num_logical=2, ep_size=1, physical_to_logical=(0, 0), physical_rank=(0, 0)),
         ValueError, r"missing \[1\]"),
        (dict(num_logical=2, ep_size=2, physical_to_logical=(0, 1), physical_rank=(0, 0)),
         ValueError, "every rank"),
        (dict(num_logical=2, ep_size=1, physical_to_logical=(0, 1), physical_rank=(0,)),
         ValueError, "one entry per physical expert"),
        (dict(num_logical=2.0, ep_size=1, physical_to_logical=(0, 1), physical_rank=(0, 0)),
         TypeError, "num_logical must be an int"),
    ],
)  # fmt: skip
def test_placement_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        ExpertPlacement(**kwargs)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((8, 9), ValueError, r"ep_size \(9\) must be <= the number of physical experts \(8\)"),
        ((8, 2, "block"), ValueError, "placement must be one of"),
        ((8, 2, "linear", -1), ValueError, "num_redundant_experts must be >= 0"),
        ((0, 1), ValueError, "num_experts must be >= 1"),
    ],
)
def test_expert_placement_validation(args, error, match):
    with pytest.raises(error, match=match):
        expert_placement(*args)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"placement": "blocks"}, ValueError, "placement must be one of"),
        ({"num_redundant_experts": -1}, ValueError, "num_redundant_experts must be an int >= 0"),
        ({"sequence_parallel": True}, ValueError, "needs ep_size > 1 and dp_size == 1"),
        ({"sequence_parallel": 1, "ep_size": 2}, TypeError, "sequence_parallel must be a bool"),
        (
            {"sequence_parallel": True, "ep_size": 2, "dp_size": 2},
            ValueError,
            "needs ep_size > 1 and dp_size == 1",
        ),
    ],
)
def test_parallel_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        ParallelConfig(**kwargs)


def test_moves_tokens():
    assert not ParallelConfig(ep_size=2).moves_tokens  # shared tokens: partial sums
    assert ParallelConfig(ep_size=2, dp_size=2).moves_tokens
    assert ParallelConfig(ep_size=2, sequence_parallel=True).moves_tokens
    assert not ParallelConfig(dp_size=2).moves_tokens


def test_even_split_and_quantize_before_dispatch():
    assert even_split(7, 3) == (3, 2, 2) and even_split(0, 2) == (0, 0) and even_split(1, 4)[0] == 1
    w13, w2 = torch.randn(2, 256, 128), torch.randn(2, 128, 128)

    def config(scheme, **kw):
        return quantize_experts(w13, w2, scheme, **kw)[2]

    assert quantizes_before_dispatch(None)
    assert quantizes_before_dispatch(config("fp8_block"))  # per-token groups travel
    static = config("fp8_tensor", a1_scale=torch.ones(1), a2_scale=torch.ones(1))
    assert quantizes_before_dispatch(static)  # one calibrated scale, the same everywhere
    assert not quantizes_before_dispatch(config("fp8_tensor"))  # one dynamic scale


# ---- single process: the layer's placement, loading and partial sums ---------------------------
def full_layer(seed: int = 0, **kwargs) -> FusedMoE:
    torch.manual_seed(seed)
    return FusedMoE(E, TOP_K, H, I, params_dtype=torch.float32, backend="torch", **kwargs)


def checkpoint_of(layer: FusedMoE, per_expert: bool = False) -> list[tuple[str, torch.Tensor]]:
    w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
    if not per_expert:
        return [("experts.gate_up_proj", w13), ("experts.down_proj", w2)]
    items = []
    for e in range(w13.shape[0]):
        items += [
            (f"mlp.experts.{e}.gate_proj.weight", w13[e, :I]),
            (f"mlp.experts.{e}.up_proj.weight", w13[e, I:]),
            (f"mlp.experts.{e}.down_proj.weight", w2[e]),
        ]
    return items


@pytest.mark.parametrize("per_expert", [False, True])
@pytest.mark.parametrize(
    ("placement", "redundant", "ep_size"),
    [("linear", 0, 3), ("round_robin", 0, 2), ("round_robin", 3, 2), ("linear", 2, 1)],
)
def test_partial_sums_of_shared_tokens_add_up(per_expert, placement, redundant, ep_size):
    """ep_size > 1 without DP: every rank has the same tokens and returns its partial sum."""
    full = full_layer()
    x, logits = torch.randn(37, H), torch.randn(37, E)
    expected = full(x, logits)
    total = torch.zeros(37, H, dtype=torch.float64)
    for rank in range(ep_size):
        pc = ParallelConfig(
            ep_size=ep_size, ep_rank=rank, placement=placement, num_redundant_experts=redundant
        )
        layer = full_layer(seed=1, parallel_config=pc)
        loaded = layer.load_weights(checkpoint_of(full, per_expert))
        logical = layer.placement.local_logical(rank)
        assert layer.w13_weight.shape[0] == len(logical) == layer.local_num_experts
        assert_equal(layer.w13_weight, full.w13_weight[list(logical)], what="local w13")
        if per_expert:  # only the local experts' names are loaded
            assert {int(n.split(".")[2]) for n in loaded} == set(logical)
        total += layer(x, logits).double()
    assert_close(total, expected.double(), torch.float32)


def test_oracle_reasons_under_ep():
    problem = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2)
    choice = select_backend(**problem, ep_size=2, has_router_logits=True, dtype=torch.float32)
    assert choice.name == "monolithic"  # a contiguous block: the shift runs
    choice = select_backend(
        **problem, ep_size=2, has_expert_map=True, has_router_logits=True, dtype=torch.float32
    )
    assert choice.name == "torch" and choice.refused["monolithic"] == "no expert_map"
    pc = ParallelConfig(ep_size=2, ep_rank=0, sequence_parallel=True)
    layer = full_layer(parallel_config=pc)
    layer.set_backend("auto")
    choice = layer.backend_choice()
    assert choice.name == "torch"
    assert "sequence-parallel dispatch" in choice.refused["monolithic"]
    pc = ParallelConfig(ep_size=2, ep_rank=0, dp_size=2, dp_rank=0, all2all_backend="all_to_all")
    with pytest.raises(ValueError, match="'all_to_all' dispatch"):
        FusedMoE(E, 2, H, I, params_dtype=torch.float32, parallel_config=pc, backend="monolithic")
    # triton takes an expert_map, so it runs a shard (where Triton runs at all)
    from fusedmoe.experts.triton import TritonExperts

    assert TritonExperts.supports_ep(4)


def test_ep_dispatch_needs_a_group():
    """(Training through the dispatch: tests/test_ep_autograd.py.)"""
    pc = ParallelConfig(ep_size=2, ep_rank=0, dp_size=2, dp_rank=0)
    layer = full_layer(parallel_config=pc)
    x = torch.randn(3, H, requires_grad=True)
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized here")
    match = r"needs torch\.distributed initialized"
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=match):
            layer(x, torch.randn(3, E))


# ---- distributed: sharded == unsharded over gloo -----------------------------------------------
@dataclass(frozen=True)
class EPCase:
    name: str
    kind: str = "naive"  # all2all_backend
    calls: tuple = ((5, 8), (13, 0), (0, 0), (1, 2))  # tokens of each rank, per call
    scheme: str | None = None  # quant_config
    placement: str = "linear"
    redundant: int = 0
    sequence_parallel: bool = False  # calls: (M,) the tokens every rank shares
    chunk_size: int | None = None
    shared: bool = False  # shared experts and zero experts
    rebalance: bool = False  # EPLB: rebalance after the calls, run them again
    backend: str = "torch"  # triton: on the CPU under its interpreter (TRITON_INTERPRET=1)
    transport: str = "emulated"  # symm_mem's: the regions layout, or "emulated_vdev" (grouped)
    compiled: bool = False  # the layer under torch.compile (aot_eager: dynamo and aot_autograd)
    #: symm_mem: its combine in this many column blocks of 32 (the triton backend writes them
    #: block by block, the torch backend in one piece)
    combine_blocks: int | None = None
    #: the triton backend reports only its first this many blocks: finalize issues the rest
    reported_blocks: int | None = None


A1_SCALE, A2_SCALE = torch.tensor([0.02]), torch.tensor([0.05])
EP2_CASES = [
    EPCase("naive"),
    EPCase("all_to_all", "all_to_all"),
    EPCase("naive_chunked", chunk_size=3, calls=((7, 2), (0, 5))),
    EPCase("a2a_chunked", "all_to_all", chunk_size=3, calls=((7, 2), (0, 5))),
    EPCase("naive_fp8_block", scheme="fp8_block", calls=((6, 3), (0, 4))),
    EPCase("a2a_fp8_block", "all_to_all", scheme="fp8_block", calls=((6, 3), (0, 4))),
    EPCase("naive_fp8_static", scheme="fp8_tensor", calls=((6, 3), (4, 0))),
    EPCase("a2a_fp8_static", "all_to_all", scheme="fp8_tensor", calls=((6, 3), (4, 0))),
    EPCase("naive_sp", sequence_parallel=True, calls=((9,), (1,), (0,))),
    EPCase("a2a_sp", "all_to_all", sequence_parallel=True, calls=((9,), (1,), (0,))),
    EPCase("naive_shared_zero", shared=True, calls=((6, 3), (0, 4))),
    EPCase("a2a_shared_zero_rr", "all_to_all", placement="round_robin", shared=True,
           calls=((6, 3), (0, 4))),
    EPCase("naive_eplb", redundant=3, placement="round_robin", rebalance=True,
           calls=((11, 4), (0, 6))),
    EPCase("a2a_eplb", "all_to_all", redundant=2, rebalance=True, calls=((11, 4), (0, 6))),
    EPCase("naive_triton_rr", placement="round_robin", backend="triton", calls=((5, 0), (3, 4))),
    EPCase("a2a_triton_fp8_block", "all_to_all", scheme="fp8_block", backend="triton",
           calls=((5, 0), (3, 4))),
    # symm_mem over the emulated transport (gloo): the layout, counts and masking of the kind
    EPCase("symm", "symm_mem"),
    EPCase("symm_chunked", "symm_mem", chunk_size=3, calls=((7, 2), (0, 5))),
    EPCase("symm_fp8_block", "symm_mem", scheme="fp8_block", calls=((6, 3), (0, 4))),
    EPCase("symm_fp8_static", "symm_mem", scheme="fp8_tensor", calls=((6, 3), (4, 0))),
    EPCase("symm_sp", "symm_mem", sequence_parallel=True, calls=((9,), (1,), (0,))),
    EPCase("symm_shared_zero_rr", "symm_mem", placement="round_robin", shared=True,
           calls=((6, 3), (0, 4))),
    EPCase("symm_eplb", "symm_mem", redundant=2, rebalance=True, calls=((11, 4), (0, 6))),
    EPCase("symm_triton_fp8_block", "symm_mem", scheme="fp8_block", backend="triton",
           calls=((5, 0), (3, 4))),
    # the combine by column blocks, as the experts write them (triton) or after (torch)
    EPCase("symm_blocks", "symm_mem", combine_blocks=3, calls=((5, 8), (0, 3), (13, 13))),
    EPCase("symm_triton_blocks", "symm_mem", backend="triton", combine_blocks=3,
           calls=((5, 0), (3, 4))),
    EPCase("symm_triton_sp_blocks", "symm_mem", backend="triton", sequence_parallel=True,
           combine_blocks=2, calls=((9,), (1,))),
    EPCase("symm_triton_blocks_reported_1", "symm_mem", backend="triton", combine_blocks=3,
           reported_blocks=1, calls=((5, 0), (3, 4))),
    # under torch.compile: symm_mem's dispatch and combine run outside the graph
    EPCase("naive_compiled", compiled=True, calls=((5, 8), (0, 2))),
    EPCase("a2a_compiled", "all_to_all", compiled=True, calls=((5, 8), (0, 2))),
    EPCase("symm_compiled", "symm_mem", compiled=True, calls=((5, 8), (0, 2))),
    EPCase("symm_compiled_fp8_block", "symm_mem", scheme="fp8_block", compiled=True,
           calls=((6, 3),)),
    # the grouped layout (all_to_all_vdev's, where peers are not mapped)
    EPCase("symm_vdev", "symm_mem", transport="emulated_vdev"),
    EPCase("symm_vdev_fp8_block", "symm_mem", scheme="fp8_block", calls=((6, 3), (0, 4)),
           transport="emulated_vdev"),
]  # fmt: skip
EP4_CASES = [
    EPCase("naive4", calls=((3, 0, 7, 1), (0, 0, 0, 2))),
    EPCase("a2a4", "all_to_all", calls=((3, 0, 7, 1), (0, 0, 0, 2))),
    EPCase("a2a4_fp8_block", "all_to_all", scheme="fp8_block", calls=((3, 0, 5, 1),)),
    EPCase("naive4_eplb", redundant=4, placement="round_robin", rebalance=True,
           calls=((5, 1, 0, 3),)),
    EPCase("a2a4_sp", "all_to_all", sequence_parallel=True, calls=((7,),)),
    EPCase("symm4", "symm_mem", calls=((3, 0, 7, 1), (0, 0, 0, 2), (13, 13, 13, 13))),
    EPCase("symm4_eplb", "symm_mem", redundant=4, placement="round_robin", rebalance=True,
           calls=((5, 1, 0, 3),)),
    EPCase("symm4_vdev", "symm_mem", calls=((3, 0, 7, 1), (13, 13, 13, 13)),
           transport="emulated_vdev"),
]  # fmt: skip
#: three ranks: a group that is not a power of two (symm_mem's peer transport takes any size;
#: only torch's all_to_all_vdev, the grouped layout, needs a power of two)
EP3_CASES = [
    EPCase("naive3", calls=((4, 0, 9), (1, 1, 0))),
    EPCase("a2a3", "all_to_all", calls=((4, 0, 9), (1, 1, 0))),
    EPCase("symm3", "symm_mem", calls=((4, 0, 9), (0, 0, 2), (6, 6, 6))),
    EPCase("symm3_fp8_block", "symm_mem", scheme="fp8_block", calls=((5, 2, 0),)),
    EPCase("symm3_triton_blocks", "symm_mem", backend="triton", combine_blocks=4,
           calls=((4, 0, 9),)),
    EPCase("symm3_eplb_rr", "symm_mem", redundant=3, placement="round_robin", rebalance=True,
           calls=((5, 1, 3),)),
]  # fmt: skip
CASES = {case.name: case for case in EP2_CASES + EP3_CASES + EP4_CASES}


def _shared_modules():
    torch.manual_seed(7)
    return nn.Linear(H, H, bias=False)


def make_layer(case: EPCase, pc: ParallelConfig | None = None) -> FusedMoE:
    kwargs = {}
    if case.shared:
        kwargs = dict(
            shared_experts=_shared_modules(), zero_expert_num=2, zero_expert_type="identity"
        )
    layer = FusedMoE(
        E, TOP_K, H, I, params_dtype=torch.float32, backend="torch", parallel_config=pc, **kwargs
    )
    return layer


def quantize(layer: FusedMoE, case: EPCase) -> None:
    if case.scheme == "fp8_tensor":
        layer.quantize_("fp8_tensor", a1_scale=A1_SCALE, a2_scale=A2_SCALE)
    elif case.scheme is not None:
        layer.quantize_(case.scheme)


def call_rows(case: EPCase, world: int):
    """Per call: (rows of the whole call, [rows of each rank])."""
    start, out = 0, []
    for counts in case.calls:
        if case.sequence_parallel:
            rows = slice(start, start + counts[0])
            out.append((rows, [rows] * world))
            start += counts[0]
            continue
        ranks, offset = [], start
        for count in counts:
            ranks.append(slice(offset, offset + count))
            offset += count
        out.append((slice(start, offset), ranks))
        start = offset
    return out


def total_rows(cases) -> int:
    return max(
        sum(c[0] if case.sequence_parallel else sum(c) for c in case.calls) for case in cases
    )


SYMM_MAX_TOKENS = 13  # the symm_mem cases' bound: calls of 13 tokens a rank fill it


@contextlib.contextmanager
def reporting_only(blocks: int):
    """The triton backend (in this process) calls OutputColumns.done for its first `blocks`
    blocks only, as a backend that stops reporting would."""
    from fusedmoe.experts.triton import TritonExperts
    from fusedmoe.modular.types import OutputColumns

    real = TritonExperts.apply

    def apply(self, call, gate=None):
        columns = call.output_columns
        if columns is not None:
            done = columns.done
            call = dataclasses.replace(
                call,
                output_columns=OutputColumns(columns.bounds, lambda j: j < blocks and done(j)),
            )
        return real(self, call, gate)

    TritonExperts.apply = apply
    try:
        yield
    finally:
        TritonExperts.apply = real


def _ep_worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ[TRANSPORT_ENV] = "emulated"  # symm_mem's layout over gloo
    init_gloo(rank, world, port)
    try:
        torch.set_num_threads(1)
        data = torch.load(path)
        results = {}
        for case in (CASES[name] for name in data["cases"]):
            os.environ[TRANSPORT_ENV] = case.transport
            if case.chunk_size is not None:
                os.environ["FUSEDMOE_CHUNK_SIZE"] = str(case.chunk_size)
            pc = ParallelConfig(
                ep_size=world,
                ep_rank=rank,
                dp_size=1 if case.sequence_parallel else world,
                dp_rank=0 if case.sequence_parallel else rank,
                sequence_parallel=case.sequence_parallel,
                all2all_backend=case.kind,
                placement=case.placement,
                num_redundant_experts=case.redundant,
                max_tokens_per_rank=SYMM_MAX_TOKENS,
            )
            layer = make_layer(case, pc)
            os.environ.pop("FUSEDMOE_CHUNK_SIZE", None)
            layer.load_weights(data["checkpoint"])
            if case.shared:
                layer.load_weights(data["shared"])
            quantize(layer, case)
            layer.set_backend(case.backend)
            forward = torch.compile(layer, backend="aot_eager") if case.compiled else layer
            outputs, placements = [], []
            rounds = 2 if case.rebalance else 1
            for _ in range(rounds):
                for _call, ranks in call_rows(case, world):
                    rows = ranks[rank]
                    blocks = combine_blocks_override(case.combine_blocks, align=32)
                    reports = contextlib.nullcontext()
                    if case.reported_blocks is not None:
                        reports = reporting_only(case.reported_blocks)
                    with torch.no_grad(), blocks, reports:
                        logits = data["logits"][rows, : routing_columns(case)]
                        outputs.append(forward(data["x"][rows], logits))
                if case.rebalance and len(placements) == 0:
                    from fusedmoe.parallel.eplb import rebalance_layer

                    moved = rebalance_layer(layer)
                    placements.append((moved.physical_to_logical, moved.physical_rank))
            kernel = layer._kernel(torch.device("cpu"), torch.float32, False)[1]
            stats = kernel.prepare_finalize.stats.as_dict()
            results[case.name] = {"outputs": outputs, "stats": stats, "placements": placements}
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, cases, data: dict, timeout_s: int = 150, worker=_ep_worker) -> list[dict]:
    """Spawn `world` gloo ranks running worker(rank, world, port, path) on the cases and data
    saved at path; -> what each rank saved at f"{path}.rank{rank}"."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ep.pt")
        torch.save({**data, "cases": [case.name for case in cases]}, path)
        spawn_ranks(worker, (world, free_port(), path), world, timeout_s, f"the {world} EP workers")
        return [torch.load(f"{path}.rank{r}") for r in range(world)]


needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _data(cases):
    torch.manual_seed(3)
    full = make_layer(EPCase("full"))
    full.reset_parameters()
    rows = total_rows(cases)
    x = torch.randn(rows, H)
    logits = torch.randn(rows, E + 2) * 2  # two extra columns: zero experts, where a case has
    shared = [("shared_experts.weight", _shared_modules().weight.detach())]
    return full, {"checkpoint": checkpoint_of(full), "shared": shared, "x": x}, logits


def _spawned(world: int, cases):
    full, data, logits = _data(cases)
    # a case without zero experts routes on the first E columns
    results = run_ranks(world, cases, {**data, "logits": logits})
    return full, data["x"], logits, results


@pytest.fixture(scope="module")
def ep2():
    return _spawned(2, EP2_CASES)


@pytest.fixture(scope="module")
def ep3():
    return _spawned(3, EP3_CASES)


@pytest.fixture(scope="module")
def ep4():
    return _spawned(4, EP4_CASES)


def _check_case(case: EPCase, world: int, spawned) -> None:
    full, x, logits, results = spawned
    layer = make_layer(case)
    layer.load_weights(checkpoint_of(full))
    if case.shared:
        layer.load_weights([("shared_experts.weight", _shared_modules().weight.detach())])
    quantize(layer, case)
    ranks = [results[r][case.name] for r in range(world)]
    columns = routing_columns(case)
    calls = call_rows(case, world)
    rounds = 2 if case.rebalance else 1
    for round_ in range(rounds):
        for c, (whole, per_rank) in enumerate(calls):
            with torch.no_grad():
                expected = layer(x[whole], logits[whole, :columns])
            for r in range(world):
                got = ranks[r]["outputs"][round_ * len(calls) + c]
                own = per_rank[r]
                offset = whole.start
                exp = expected[own.start - offset : own.stop - offset]
                what = f"{case.name} round {round_} call {c} rank {r}"
                if case.sequence_parallel:
                    exp = expected
                assert_close(got, exp, torch.float32, what=what, **tolerance(case))
    stats = [rk["stats"] for rk in ranks]
    assert all(s["calls"] > 0 for s in stats)
    # what one rank sent, the others received
    assert sum(s["tokens_sent"] for s in stats) == sum(s["tokens_received"] for s in stats)
    if case.rebalance:
        placements = [rk["placements"][0] for rk in ranks]
        assert all(p == placements[0] for p in placements)  # every rank computed the same


def tolerance(case: EPCase) -> dict:
    """Sharded == unsharded up to float32 summation order; the triton backend against the torch
    one (the reference here) with FP8 may round an intermediate to a neighbouring FP8 value."""
    if case.backend == "triton" and case.scheme is not None:
        return {"tol": 5e-2, "rms_tol": 5e-3}
    return {}


def _case_params(cases):
    return [pytest.param(case, id=case.name) for case in cases]


def routing_columns(case: EPCase) -> int:
    """Zero-expert cases route over E + 2 logits, the others over E."""
    return E + 2 if case.shared else E


@needs_gloo
@pytest.mark.parametrize("case", _case_params(EP2_CASES))
def test_two_ranks_sharded_equals_unsharded(case, ep2):
    _check_case(case, 2, ep2)


@needs_gloo
@pytest.mark.parametrize("case", _case_params(EP3_CASES))
def test_three_ranks_sharded_equals_unsharded(case, ep3):
    _check_case(case, 3, ep3)


@needs_gloo
@pytest.mark.parametrize("case", _case_params(EP4_CASES))
def test_four_ranks_sharded_equals_unsharded(case, ep4):
    _check_case(case, 4, ep4)


@needs_gloo
def test_all_to_all_moves_fewer_tokens_than_naive(ep4):
    results = ep4[3]
    naive = sum(results[r]["naive4"]["stats"]["tokens_sent"] for r in range(4))
    a2a = sum(results[r]["a2a4"]["stats"]["tokens_sent"] for r in range(4))
    assert 0 < a2a < naive
    naive_bytes = sum(results[r]["naive4"]["stats"]["dispatch_bytes_sent"] for r in range(4))
    a2a_bytes = sum(results[r]["a2a4"]["stats"]["dispatch_bytes_sent"] for r in range(4))
    assert 0 < a2a_bytes < naive_bytes


# ---- ranks built with different layers fail fast ------------------------------------------------
# (name, kind, what rank 1 changes, the field the error must name)
MISMATCHES = [
    ("hidden", "naive", dict(hidden_size=H + 64), "hidden_size"),
    ("experts", "all_to_all", dict(num_experts=E + 4), "num_experts"),
    ("symm_tokens", "symm_mem", dict(max_tokens=SYMM_MAX_TOKENS + 1), "max_tokens_per_rank"),
    ("quantized_later", "naive", dict(quantize_after_first="fp8_block"), "quant_scheme"),
    ("a2a_sp_placement", "all_to_all", dict(placement="round_robin", sp=True), "placement"),
    # EP over shared tokens: no dispatch, the caller all-reduces (compared at the first call)
    ("shared_tokens_hidden", "naive", dict(hidden_size=H + 64, shared_tokens=True), "hidden_size"),
    ("shared_tokens_experts", "naive", dict(num_experts=E + 4, shared_tokens=True), "num_experts"),
]


def _mismatch_worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ[TRANSPORT_ENV] = "emulated"
    init_gloo(rank, world, port)
    try:
        torch.set_num_threads(1)
        results = {}
        for name, kind, change, _ in MISMATCHES:
            sp = change.get("sp", False)  # both ranks: sequence parallel
            shared = sp or change.get("shared_tokens", False)  # both ranks: one set of tokens
            change = change if rank == 1 else {}
            hidden = change.get("hidden_size", H)
            experts = change.get("num_experts", E)
            pc = ParallelConfig(
                ep_size=world, ep_rank=rank, dp_size=1 if shared else world,
                dp_rank=0 if shared else rank,
                sequence_parallel=sp, all2all_backend=kind,
                placement=change.get("placement", "linear"),
                max_tokens_per_rank=change.get("max_tokens", SYMM_MAX_TOKENS),
            )  # fmt: skip
            layer = FusedMoE(experts, TOP_K, hidden, I, params_dtype=torch.float32,
                             backend="torch", parallel_config=pc)  # fmt: skip
            errors = []
            for call in range(2):
                if call == 1 and "quantize_after_first" in change:
                    layer.quantize_(change["quantize_after_first"])
                try:
                    with torch.no_grad():
                        layer(torch.randn(3, hidden), torch.randn(3, experts))
                    errors.append("")
                except ValueError as e:
                    errors.append(str(e))
                    break
            results[name] = errors
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mismatched():
    return run_ranks(2, [], {}, worker=_mismatch_worker)


@needs_gloo
@pytest.mark.parametrize("case", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_ranks_built_differently_fail_fast(case, mismatched):
    name, _, change, field = case
    for rank in range(2):
        errors = mismatched[rank][name]
        if "quantize_after_first" in change:
            assert errors[0] == "", errors  # the first call agrees
        message = errors[-1]
        assert "ranks of the EP group were built with different layers" in message, message
        assert f"{field}:" in message and "ranks [0]" in message and "ranks [1]" in message


def _over_bound_worker(rank: int, world: int, port: int, path: str) -> None:
    """symm_mem, rank 0 over the bound in the first call: it raises, rank 1's output is right,
    and both ranks' next call runs."""
    os.environ[TRANSPORT_ENV] = "emulated"
    init_gloo(rank, world, port)
    try:
        torch.set_num_threads(1)
        data = torch.load(path)
        pc = ParallelConfig(
            ep_size=world, ep_rank=rank, dp_size=world, dp_rank=rank,
            all2all_backend="symm_mem", max_tokens_per_rank=SYMM_MAX_TOKENS,
        )  # fmt: skip
        layer = make_layer(EPCase("over"), pc)
        layer.load_weights(data["checkpoint"])
        results = {}
        for blocks, backend in OVER_BOUND_RUNS:
            layer.set_backend(backend)
            results[blocks, backend] = []
            for counts in OVER_BOUND_CALLS:
                start = sum(counts[:rank])
                rows = slice(start, start + counts[rank])
                try:
                    with torch.no_grad(), combine_blocks_override(blocks, align=32):
                        y = layer(data["x"][rows], data["logits"][rows, :E])
                    results[blocks, backend].append(y)
                except ValueError as e:
                    results[blocks, backend].append(str(e))
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


OVER_BOUND_CALLS = ((SYMM_MAX_TOKENS + 3, 4), (2, 5))
#: (combine blocks, backend): one combine; blocks combined after the experts (torch), or as
#: the experts write them (triton)
OVER_BOUND_RUNS = ((None, "torch"), (3, "torch"), (3, "triton"))


@needs_gloo
def test_symm_mem_rank_over_the_bound_raises_and_its_peer_is_right():
    full, data, logits = _data([EPCase("x", calls=((SYMM_MAX_TOKENS + 3, 4), (2, 5)))])
    ranks = run_ranks(2, [], {**data, "logits": logits}, worker=_over_bound_worker)
    for run in OVER_BOUND_RUNS:
        first = ranks[0][run][0]
        assert isinstance(first, str) and "max_tokens_per_rank = 13" in first, (run, first)
        assert "this rank had 16 tokens" in first
        for c, counts in enumerate(OVER_BOUND_CALLS):
            with torch.no_grad():
                expected = full(data["x"][: sum(counts)], logits[: sum(counts), :E])
            for rank in range(2):
                if c == 0 and rank == 0:
                    continue
                start = sum(counts[:rank])
                got = ranks[rank][run][c]
                assert not isinstance(got, str), got
                assert_close(got, expected[start : start + counts[rank]], torch.float32,
                             what=f"{run}: call {c} rank {rank}")  # fmt: skip
