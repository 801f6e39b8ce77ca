"""Expert parallelism under autograd: sharded == unsharded for gradients too.

Spawns 2 and 3 gloo ranks once each (module fixtures). Each rank runs:
  - the adjoints alone: every differentiable collective of fusedmoe.parallel.comm on random
    rows, backward of a random cotangent; the gradients are checked here against the adjoint
    written out as plain loops over every rank's cotangent;
  - EP_CASES: FusedMoE forwards (float64, torch backend, sharded experts with biases) over
    some calls, one backward of sum_calls <y, g>; here the unsharded single-process layer
    runs the same calls, and each rank's gradients must be the matching part of its own:
    d hidden_states and d router_logits of its rows (sequence parallel: all rows, the inputs
    are replicated), d w13 / w2 / biases of its experts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from fusedmoe import FusedMoE, ParallelConfig
from fusedmoe.modular.kernel import CHUNK_SIZE_ENV
from fusedmoe.parallel.comm import EPGroup
from fusedmoe.parallel.naive_ep import even_split
from fusedmoe.parallel.placement import expert_placement
from tests.helpers import assert_close, init_gloo
from tests.test_ep import needs_gloo, run_ranks

E, H, I, TOP_K = 6, 16, 12, 2
DTYPE = torch.float64  # sharded and unsharded sum in different orders: float64 keeps it tight
PARAMS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


@dataclass(frozen=True)
class GradCase:
    name: str
    kind: str = "naive"  # all2all_backend
    sequence_parallel: bool = False
    #: tokens of each rank per call (2 ranks, 3 ranks); sequence parallel: (M,) shared
    calls2: tuple = ((5, 0), (3, 4))
    calls3: tuple = ((4, 0, 7), (2, 5, 1))
    grads: tuple = ("x", "logits", "params")  # what requires grad
    cold: bool = False  # the last rank's experts receive no token
    chunk_size: int | None = None

    def calls(self, world: int) -> tuple:
        return self.calls2 if world == 2 else self.calls3


SP_CALLS = dict(calls2=((7,), (1,)), calls3=((8,), (2,)))  # 1 and 2 tokens: an idle slice
EP_CASES = [
    GradCase("naive"),
    GradCase("all_to_all", "all_to_all"),
    GradCase("naive_sp", sequence_parallel=True, **SP_CALLS),
    GradCase("a2a_sp", "all_to_all", sequence_parallel=True, **SP_CALLS),
    GradCase("a2a_chunked", "all_to_all", chunk_size=2),
    GradCase("naive_cold", cold=True),
    GradCase("a2a_cold", "all_to_all", cold=True),
    # only the experts train: where no token reaches a rank's experts, nothing there requires
    # grad, yet that rank's backward must join the combine's collectives
    GradCase("naive_params_only_cold", grads=("params",), cold=True),
    GradCase("a2a_params_only_cold", "all_to_all", grads=("params",), cold=True),
    GradCase("a2a_router_only", "all_to_all", grads=("logits",)),
]
CASES = {case.name: case for case in EP_CASES}


# ---- the rank side -----------------------------------------------------------------------------
def _layer(pc: ParallelConfig | None = None) -> FusedMoE:
    return FusedMoE(
        E, TOP_K, H, I, has_bias=True, params_dtype=DTYPE, backend="torch", parallel_config=pc
    )


def _call_rows(case: GradCase, world: int) -> list[tuple[slice, list[slice]]]:
    """Per call: (rows of the whole call, rows each rank passes to its layer)."""
    out, start = [], 0
    for counts in case.calls(world):
        if case.sequence_parallel:
            whole = slice(start, start + counts[0])
            out.append((whole, [whole] * world))
        else:
            ranks, offset = [], start
            for count in counts:
                ranks.append(slice(offset, offset + count))
                offset += count
            whole = slice(start, offset)
            out.append((whole, ranks))
        start = whole.stop
    return out


def _run_calls(layer: FusedMoE, case: GradCase, data: dict, rows: list[slice]) -> dict:
    """Forward each call's rows, one backward of sum <y, g>; -> outputs and gradients."""
    layer.zero_grad()
    for name in PARAMS:
        getattr(layer, name).requires_grad_("params" in case.grads)
    xs, logits, loss = [], [], 0
    for r in rows:
        x = data["x"][r].clone().requires_grad_("x" in case.grads)
        lg = data["logits"][r].clone().requires_grad_("logits" in case.grads)
        y = layer(x, lg)
        loss = loss + (y * data["g"][r]).sum()
        xs.append(x)
        logits.append(lg)
    loss.backward()
    return {
        "x": [x.grad for x in xs],
        "logits": [lg.grad for lg in logits],
        **{name: getattr(layer, name).grad for name in PARAMS},
    }


def _adjoint_rows(comm: EPGroup, world: int, rank: int) -> dict:
    """Each differentiable collective on random rows: its inputs, cotangents and gradients."""
    out = {}
    g = torch.Generator().manual_seed(100 + rank)  # this rank's values

    def rand(*shape, gen=g):
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    def grad_of(y, x, v):
        (y * v).sum().backward()
        return x.grad

    counts = (3, 0, 5)[:world]  # rows per rank: uneven, one rank with none
    most = max(counts)
    for replicated_grad in (False, True):
        local = rand(counts[rank], 4).requires_grad_()
        y = comm.all_gather_rows(local, most, replicated_grad=replicated_grad)
        # replicated_grad: the cotangent is the same on every rank
        common = torch.Generator().manual_seed(7)
        v = rand(*y.shape, gen=common) if replicated_grad else rand(*y.shape)
        out[f"all_gather_{replicated_grad}"] = (local.detach(), v, grad_of(y, local, v))

    full = rand(world * 2, 3).requires_grad_()
    y = comm.reduce_scatter_rows(full)
    v = rand(*y.shape)
    out["reduce_scatter"] = (full.detach(), v, grad_of(y, full, v))

    send_counts = [(rank + 2 * r) % 3 for r in range(world)]  # zeros included
    recv_counts = comm.exchange_counts(torch.tensor(send_counts)).tolist()
    send = rand(sum(send_counts), 2).requires_grad_()
    y = comm.all_to_all_rows(send, send_counts, recv_counts)
    v = rand(*y.shape)
    out["all_to_all"] = (send.detach(), v, grad_of(y, send, v), send_counts, recv_counts)

    sp_counts = even_split(world - 1, world)  # the last rank's slice is empty
    replicated = rand(world - 1, 3, gen=torch.Generator().manual_seed(8)).requires_grad_()
    y = comm.own_rows(replicated, sp_counts)
    v = rand(*y.shape)
    out["own_rows"] = (replicated.detach(), v, grad_of(y, replicated, v), sp_counts)
    return out


def _worker(rank: int, world: int, port: int, path: str) -> None:
    init_gloo(rank, world, port)
    try:
        torch.set_num_threads(1)
        data = torch.load(path)
        results = {"adjoints": _adjoint_rows(EPGroup(world, rank), world, rank)}
        for case in (CASES[name] for name in data["cases"]):
            pc = ParallelConfig(
                ep_size=world,
                ep_rank=rank,
                dp_size=1 if case.sequence_parallel else world,
                dp_rank=0 if case.sequence_parallel else rank,
                sequence_parallel=case.sequence_parallel,
                all2all_backend=case.kind,
            )
            if case.chunk_size is not None:
                os.environ[CHUNK_SIZE_ENV] = str(case.chunk_size)
            layer = _layer(pc)
            os.environ.pop(CHUNK_SIZE_ENV, None)
            mine = list(layer.placement.local_logical(rank))
            with torch.no_grad():
                for name in PARAMS:
                    getattr(layer, name).copy_(data["params"][name][mine])
            case_data = {**data, "logits": data["logits_cold" if case.cold else "logits"]}
            rows = [ranks[rank] for _, ranks in _call_rows(case, world)]
            results[case.name] = _run_calls(layer, case, case_data, rows)
        results["quantized_refused"] = _quantized_training_refused(world, rank, data)
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _quantized_training_refused(world: int, rank: int, data: dict) -> str:
    """A quantized layer's dispatch stays inference only: every rank refuses alike."""
    pc = ParallelConfig(ep_size=world, ep_rank=rank, dp_size=world, dp_rank=rank)
    layer = FusedMoE(E, TOP_K, 128, 128, params_dtype=torch.float32, backend="torch",
                     parallel_config=pc)  # fmt: skip
    layer.quantize_("fp8_block")
    x = torch.randn(3, 128, requires_grad=True)
    try:
        layer(x, data["logits"][:3].float())
    except ValueError as error:
        return str(error)
    return ""


# ---- the test side -----------------------------------------------------------------------------
def _data(world: int) -> dict:
    torch.manual_seed(11 + world)
    full = _layer()
    rows = max(sum(sum(c) for c in case.calls(world)) for case in EP_CASES)
    logits = torch.randn(rows, E, dtype=DTYPE)
    cold = logits.clone()
    cold[:, E - E // world :] -= 30.0  # the last rank's (linear) experts: never in the top k
    return {
        "params": {name: getattr(full, name).detach().clone() for name in PARAMS},
        "x": torch.randn(rows, H, dtype=DTYPE),
        "logits": logits,
        "logits_cold": cold,
        "g": torch.randn(rows, H, dtype=DTYPE),
    }


def _spawned(world: int):
    data = _data(world)
    return data, run_ranks(world, EP_CASES, data, timeout_s=120, worker=_worker)


@pytest.fixture(scope="module")
def ranks2():
    return _spawned(2)


@pytest.fixture(scope="module")
def ranks3():
    return _spawned(3)


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def spawned(request):
    return request.param, request.getfixturevalue(f"ranks{request.param}")


def _unsharded(case: GradCase, world: int, data: dict) -> tuple[list, dict]:
    """The single-process layer on the same calls: (whole rows of each call, gradients)."""
    layer = _layer()
    with torch.no_grad():
        for name in PARAMS:
            getattr(layer, name).copy_(data["params"][name])
    if case.cold:
        data = {**data, "logits": data["logits_cold"]}
    calls = _call_rows(case, world)
    return calls, _run_calls(layer, case, data, [whole for whole, _ in calls])


@needs_gloo
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in EP_CASES])
def test_sharded_gradients_equal_unsharded(case, spawned):
    world, (data, results) = spawned
    calls, full = _unsharded(case, world, data)
    placement = expert_placement(E, world)
    for rank in range(world):
        got = results[rank][case.name]
        what = f"{case.name}, rank {rank}/{world}"
        for name in ("x", "logits"):
            if name not in case.grads:
                assert all(t is None for t in got[name]), what
                continue
            for c, (whole, per_rank) in enumerate(calls):
                own = per_rank[rank]
                expected = full[name][c][own.start - whole.start : own.stop - whole.start]
                dtype = torch.float32 if name == "logits" else DTYPE  # topk_weights: float32
                assert_close(got[name][c], expected, dtype, what=f"d {name} call {c}, {what}")
        for name in PARAMS:
            if "params" not in case.grads:
                assert got[name] is None, what
                continue
            expected = full[name][list(placement.local_logical(rank))]
            if case.cold and rank == world - 1:
                # no token used these experts: no gradient, as autograd leaves unused params
                assert got[name] is None and float(expected.abs().max()) == 0.0, what
                continue
            assert_close(got[name], expected, DTYPE, what=f"d {name}, {what}")


@needs_gloo
def test_adjoints_of_the_row_collectives(spawned):
    """Each collective's autograd gradient equals its adjoint written out as loops."""
    world, (_, results) = spawned
    adj = [results[r]["adjoints"] for r in range(world)]
    counts = (3, 0, 5)[:world]
    most = max(counts)
    for r in range(world):
        # all-gather -> reduce-scatter: the sum over ranks of block r of their cotangents
        _, _, grad = adj[r]["all_gather_False"]
        block = slice(r * most, r * most + counts[r])
        expected = sum(adj[s]["all_gather_False"][1][block] for s in range(world))
        assert_close(grad, expected, what=f"all_gather adjoint, rank {r}")
        # replicated gradient: block r of the (common) cotangent
        _, v, grad = adj[r]["all_gather_True"]
        assert_close(grad, v[block], what=f"all_gather (replicated) adjoint, rank {r}")
        # reduce-scatter -> all-gather: block s of rank r's input met rank s's cotangent
        _, _, grad = adj[r]["reduce_scatter"]
        expected = torch.cat([adj[s]["reduce_scatter"][1] for s in range(world)])
        assert_close(grad, expected, what=f"reduce_scatter adjoint, rank {r}")
        # all-to-all -> the reverse all-to-all: the rows rank r sent to s come back from s,
        # in the order s received them
        _, _, grad, send_counts, _ = adj[r]["all_to_all"]
        pieces = []
        for s in range(world):
            recv_s = adj[s]["all_to_all"][4]
            start = sum(recv_s[:r])
            pieces.append(adj[s]["all_to_all"][1][start : start + send_counts[s]])
        assert_close(grad, torch.cat(pieces), what=f"all_to_all adjoint, rank {r}")
        # own rows of a replicated tensor -> every rank's slice gradients, on every rank
        _, _, grad, sp_counts = adj[r]["own_rows"]
        expected = torch.cat([adj[s]["own_rows"][1] for s in range(world)])
        assert expected.shape[0] == sum(sp_counts)
        assert_close(grad, expected, what=f"own_rows adjoint, rank {r}")


@needs_gloo
def test_quantized_dispatch_stays_inference_only(spawned):
    world, (_, results) = spawned
    for r in range(world):
        assert "inference only" in results[r]["quantized_refused"]
