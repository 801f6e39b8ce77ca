"""The symm_mem EP dispatch on GPUs over NVSHMEM: its forward makes no host sync, a whole EP
layer forward captured in a CUDA graph replays new inputs equal to eager, and it equals the
unsharded layer with skewed routing (most tokens to one rank) and ranks without tokens; under
torch.compile it equals eager; a rank whose peer never reaches a barrier fails within
FUSEDMOE_EP_BARRIER_TIMEOUT_S instead of waiting forever. Needs >= 2 CUDA GPUs and torch with
NVSHMEM; runs on 2 ranks (4 where there are 4 GPUs).

    pytest -q -m gpu tests/test_ep_symm_gpu.py
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fusedmoe import FusedMoE, ParallelConfig
from fusedmoe.parallel import symm_mem_ep
from fusedmoe.parallel.symm_mem_ep import (
    SymmMemEPPrepareFinalize,
    combine_blocks_override,
    routing_first_override,
)
from tests.helpers import assert_close, free_port, fused_checkpoint, spawn_ranks


def _nvshmem() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return symm_mem.is_nvshmem_available()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2 or not dist.is_nccl_available() or not _nvshmem(),
        reason="needs 2 CUDA GPUs, NCCL and NVSHMEM",
    ),
]

WORLD = 4 if torch.cuda.device_count() >= 4 else 2
E, TOP_K, H, I = 32, 4, 1024, 512
MAX_TOKENS = 96  # max_tokens_per_rank
SCHEMES = (None, "fp8_block")
TOL = {None: dict(tol=3e-2), "fp8_block": dict(tol=8e-2, rms_tol=1e-2)}
# tokens of each rank per eager call: uneven, zero on some ranks, one rank full
CALLS = ((37, 0, 96, 1)[:WORLD], (0, 5, 0, 0)[:WORLD], (96,) * WORLD)
GRAPH_TOKENS = 24  # every rank's tokens in the captured forward
OVER_CALLS = ((MAX_TOKENS + 5, 7, 0, 3)[:WORLD], (4, 9, 2, 1)[:WORLD])  # rank 0 over, then not
GRAPH_REPLAYS = 3
#: (scheme, combine blocks): the decode form (one combine; the routing travels with the
#: activations), and the prefill form: the combine in 3 column blocks on 256-column bounds
#: (H = 1024: 256, 512 and 256 columns) as the triton backend writes them, and the routing
#: sent first, the activations on a side stream (symm_mem_ep.routing_first)
VARIANTS = tuple((scheme, blocks) for scheme in SCHEMES for blocks in (None, 3))
_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


def _layer(device, pc=None) -> FusedMoE:
    return FusedMoE(
        E, TOP_K, H, I, params_dtype=torch.bfloat16, device=device, backend="torch",
        parallel_config=pc,
    )  # fmt: skip


def _finish(layer: FusedMoE, checkpoint, scheme) -> FusedMoE:
    layer.load_weights(checkpoint)
    if scheme is not None:
        layer.quantize_(scheme)
    layer.set_backend("triton")
    return layer


def _rows(counts, rank: int, start: int) -> slice:
    return slice(start + sum(counts[:rank]), start + sum(counts[: rank + 1]))


def _init(rank: int, port: int, world: int) -> torch.device:
    """A spawned rank's NCCL group of `world` (NVLink multicast off) on its own GPU."""
    os.environ.update(_ENV)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120), device_id=device,
    )  # fmt: skip
    return device


def _variant(rank: int, device, data, scheme) -> dict:
    """One (scheme, combine blocks) variant's calls on this rank."""
    pc = ParallelConfig(
        ep_size=WORLD, ep_rank=rank, dp_size=WORLD, dp_rank=rank,
        all2all_backend="auto", max_tokens_per_rank=MAX_TOKENS,
    )  # fmt: skip
    layer = _finish(_layer(device, pc), data["checkpoint"], scheme)
    explain = layer.backend_choice().explain()
    eager, start = [], 0
    logits_all = data["skewed"]
    for counts in CALLS:
        rows = _rows(counts, rank, start)
        x, logits = data["x"][rows].to(device), logits_all[rows].to(device)
        with torch.no_grad():
            eager.append(layer(x, logits).cpu())
        start += sum(counts)
    # no host sync in a forward (after the first: it allocates and rendezvouses)
    x, logits = data["x"][:8].to(device), logits_all[:8].to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            layer(x, logits)
        synced = ""
    except RuntimeError as e:
        synced = str(e)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # one whole EP forward captured, replayed with new inputs
    g = torch.Generator(device="cpu").manual_seed(100 + rank)
    static_x = torch.randn(GRAPH_TOKENS, H, generator=g).to(device, torch.bfloat16)
    static_logits = torch.randn(GRAPH_TOKENS, E, generator=g).to(device)
    with torch.no_grad():
        layer(static_x, static_logits)  # warm-up on every rank
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x, static_logits)
        replays = []
        for _ in range(GRAPH_REPLAYS):
            new_x = torch.randn(GRAPH_TOKENS, H, generator=g).to(device, torch.bfloat16)
            new_logits = torch.randn(GRAPH_TOKENS, E, generator=g).to(device)
            static_x.copy_(new_x)
            static_logits.copy_(new_logits)
            graph.replay()
            replayed = static_y.clone()
            replays.append((replayed.cpu(), layer(new_x, new_logits).cpu()))
    # rank 0 over the bound: it raises at the call's end, the others' outputs are
    # right, and every rank's next call runs
    over = []
    for counts in OVER_CALLS:
        start = sum(counts[:rank])
        rows = slice(start, start + counts[rank])
        x, logits = data["x"][rows].to(device), logits_all[rows].to(device)
        try:
            with torch.no_grad():
                over.append(layer(x, logits).cpu())
        except ValueError as e:
            over.append(str(e))
    _, kernel = layer._kernel(device, torch.bfloat16, False)
    last = kernel.prepare_finalize._last_buffers  # this layer's buffers
    peer = last is not None and last.regions and last.peer is not None
    result = {
        "eager": eager, "explain": explain, "synced": synced, "replays": replays,
        "over": over, "peer": peer, "send": last is not None and last.send is not None,
    }  # fmt: skip
    del graph, layer
    return result


def _worker(rank: int, port: int, path: str) -> None:
    device = _init(rank, port, WORLD)
    try:
        data = torch.load(path)
        results = {}
        sent_first = []  # routing_first's answers (the dispatch asks it at every call)
        asked = symm_mem_ep.routing_first

        def spied(*args):
            sent_first.append(asked(*args))
            return sent_first[-1]

        symm_mem_ep.routing_first = spied
        # the activations' stores start late (about 1 ms): an experts' stage that read them
        # before joining their stream would read stale rows
        send = SymmMemEPPrepareFinalize._send_activations

        def late(*args, **kwargs):
            torch.cuda._sleep(2_000_000)
            return send(*args, **kwargs)

        SymmMemEPPrepareFinalize._send_activations = late
        for scheme, blocks in VARIANTS:
            sent_first.clear()
            with combine_blocks_override(blocks), routing_first_override(blocks is not None):
                results[scheme, blocks] = _variant(rank, device, data, scheme)
            results[scheme, blocks]["routing_first"] = set(sent_first)
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned():
    torch.manual_seed(0)
    full = _layer("cpu")
    checkpoint = fused_checkpoint(full)
    rows = sum(sum(c) for c in CALLS)
    x = torch.randn(rows, H, dtype=torch.bfloat16)
    # skewed: the experts of rank 0 (the first E / WORLD) are favoured
    skewed = torch.randn(rows, E)
    skewed[:, : E // WORLD] += 2.0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ep_symm.pt")
        torch.save({"checkpoint": checkpoint, "x": x, "skewed": skewed}, path)
        spawn_ranks(_worker, (free_port(), path), WORLD, 400, "the symm_mem EP workers")
        results = [torch.load(f"{path}.rank{r}") for r in range(WORLD)]
    return checkpoint, x, skewed, results


def _variant_id(variant) -> str:
    scheme, blocks = variant
    return f"{scheme or 'bf16'}-{blocks or 1}_blocks"


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_symm_mem_sharded_equals_unsharded(variant, spawned):
    scheme = variant[0]
    checkpoint, x, logits, results = spawned
    assert "dispatch: symm_mem" in results[0][variant]["explain"]
    if os.environ.get("FUSEDMOE_SYMM_MEM_TRANSPORT", "auto") in ("auto", "peer"):
        assert all(results[r][variant]["peer"] for r in range(WORLD)), "not the peer transport"
        # the prefill form sent the routing first at every call, the decode form never
        form = {variant[1] is not None}
        assert all(results[r][variant]["routing_first"] == form for r in range(WORLD))
        # the peer transport stores into and loads from the peers' buffers: no send buffer
        assert not any(results[r][variant]["send"] for r in range(WORLD))
    layer = _finish(_layer("cuda"), checkpoint, scheme)
    start = 0
    for c, counts in enumerate(CALLS):
        whole = slice(start, start + sum(counts))
        with torch.no_grad():
            expected = layer(x[whole].cuda(), logits[whole].cuda()).cpu()
        for rank in range(WORLD):
            mine = _rows(counts, rank, start)
            got = results[rank][variant]["eager"][c]
            exp = expected[mine.start - start : mine.stop - start]
            assert_close(got, exp, torch.bfloat16, what=f"call {c} rank {rank}", **TOL[scheme])
        start += sum(counts)


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_symm_mem_forward_makes_no_host_sync(variant, spawned):
    for rank in range(WORLD):
        assert spawned[3][rank][variant]["synced"] == "", spawned[3][rank][variant]["synced"]


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_symm_mem_forward_replays_from_a_cuda_graph(variant, spawned):
    for rank in range(WORLD):
        replays = spawned[3][rank][variant]["replays"]
        assert len(replays) == GRAPH_REPLAYS
        for i, (replayed, eager) in enumerate(replays):
            assert_close(replayed, eager, torch.bfloat16, what=f"replay {i} rank {rank}", tol=1e-2)


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_symm_mem_rank_over_the_bound_raises_its_peers_are_right(variant, spawned):
    scheme = variant[0]
    checkpoint, x, logits, results = spawned
    first = results[0][variant]["over"][0]
    assert isinstance(first, str) and f"max_tokens_per_rank = {MAX_TOKENS}" in first
    layer = _finish(_layer("cuda"), checkpoint, scheme)
    for c, counts in enumerate(OVER_CALLS):
        with torch.no_grad():
            expected = layer(x[: sum(counts)].cuda(), logits[: sum(counts)].cuda()).cpu()
        for rank in range(WORLD):
            if c == 0 and rank == 0:
                continue
            got = results[rank][variant]["over"][c]
            assert not isinstance(got, str), got
            start = sum(counts[:rank])
            exp = expected[start : start + counts[rank]]
            assert_close(got, exp, torch.bfloat16, what=f"call {c} rank {rank}", **TOL[scheme])


def _symm_layer(device, rank: int, world: int, checkpoint) -> FusedMoE:
    pc = ParallelConfig(
        ep_size=world, ep_rank=rank, dp_size=world, dp_rank=rank, all2all_backend="symm_mem",
        max_tokens_per_rank=MAX_TOKENS,
    )  # fmt: skip
    return _finish(_layer(device, pc), checkpoint, None)


def _compiled_worker(rank: int, port: int, path: str) -> None:
    device = _init(rank, port, WORLD)
    try:
        data = torch.load(path)
        layer = _symm_layer(device, rank, WORLD, data["checkpoint"])
        from torch._dynamo.utils import counters

        counters.clear()
        compiled = torch.compile(layer)
        pairs, start = [], 0
        for counts in CALLS:
            rows = _rows(counts, rank, start)
            x, logits = data["x"][rows].to(device), data["skewed"][rows].to(device)
            # the routing first: compiled, the activations travel on the current stream, eager
            # on a side stream; the calls alternate, with the same barriers on every rank
            with torch.no_grad(), routing_first_override(True):
                pairs.append((compiled(x, logits).cpu(), layer(x, logits).cpu()))
            start += sum(counts)
        _, kernel = layer._kernel(device, torch.bfloat16, False)
        last = kernel.prepare_finalize._last_buffers
        torch.save({
            "pairs": pairs, "explain": layer.backend_choice().explain(),
            "graphs": counters["stats"]["unique_graphs"],
            "peer": bool(last is not None and last.regions and last.peer is not None),
        }, f"{path}.rank{rank}")  # fmt: skip
    finally:
        dist.destroy_process_group()


def _timeout_worker(rank: int, port: int, path: str) -> None:
    """Two ranks: a forward on both (buffers made), then rank 0 alone enters a device barrier
    with a 2 s limit; rank 1 never does. Each saves what it saw and leaves without tearing the
    group down (rank 0's CUDA context is lost after the assert). Rank 0's stdout and stderr
    (where the device assert's message lands) go to a file."""
    if rank == 0:
        log = os.open(f"{path}.log0", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
    device = _init(rank, port, 2)
    data = torch.load(path)
    layer = _symm_layer(device, rank, 2, data["checkpoint"])
    x, logits = data["x"][:4].to(device), data["skewed"][:4].to(device)
    with torch.no_grad():
        layer(x, logits)
    torch.cuda.synchronize()
    dist.barrier()
    # the limit only now: the first forward's barriers wait for each rank's kernel compiles
    os.environ["FUSEDMOE_EP_BARRIER_TIMEOUT_S"] = "2"
    result = {"ran": False, "error": "", "elapsed": 0.0}
    if rank == 0:
        _, kernel = layer._kernel(device, torch.bfloat16, False)
        start = time.monotonic()
        result["ran"] = kernel.prepare_finalize.device_barrier()
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            result["error"] = str(e)
        result["elapsed"] = time.monotonic() - start
    else:
        time.sleep(5)
    torch.save(result, f"{path}.rank{rank}")
    if rank == 0:
        os.fsync(1)
    os._exit(0)


@pytest.fixture(scope="module")
def data_path():
    torch.manual_seed(1)
    checkpoint = fused_checkpoint(_layer("cpu"))
    rows = sum(sum(c) for c in CALLS)
    skewed = torch.randn(rows, E)
    skewed[:, : E // WORLD] += 2.0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ep_symm_data.pt")
        x = torch.randn(rows, H, dtype=torch.bfloat16)
        torch.save({"checkpoint": checkpoint, "x": x, "skewed": skewed}, path)
        yield path


def test_symm_mem_compiled_equals_eager(data_path):
    """The symm_mem layer under torch.compile (inductor) on GPUs: every call of CALLS (uneven
    counts, zero on some ranks, skewed routing; the routing sent first) equals the same rank's
    eager forward."""
    spawn_ranks(_compiled_worker, (free_port(), data_path), WORLD, 400, "the compiled EP workers")
    for rank in range(WORLD):
        got = torch.load(f"{data_path}.rank{rank}")
        assert "dispatch: symm_mem" in got["explain"]
        assert len(got["pairs"]) == len(CALLS)
        assert got["peer"], f"rank {rank}: not the peer transport"
        assert got["graphs"] > 0, f"rank {rank}: torch.compile compiled no graph"
        for c, (compiled, eager) in enumerate(got["pairs"]):
            assert compiled.shape == eager.shape
            if eager.numel():
                assert eager.abs().max() > 0
            assert_close(compiled, eager, torch.bfloat16, what=f"call {c} rank {rank}", tol=1e-2)


def test_barrier_times_out_when_a_rank_never_arrives(data_path):
    """FUSEDMOE_EP_BARRIER_TIMEOUT_S = 2: rank 0's device barrier, which rank 1 never reaches,
    fails with the barrier's device-side assert after about 2 s instead of waiting forever."""
    log_path = f"{data_path}.log0"
    try:
        spawn_ranks(
            _timeout_worker, (free_port(), data_path), 2, 120, "the barrier-timeout workers"
        )
    except BaseException:  # rank 0's traceback went to its log
        if os.path.exists(log_path):
            with open(log_path, errors="replace") as f:
                print(f.read()[-4000:])
        raise
    got = torch.load(f"{data_path}.rank0")
    assert got["ran"], "rank 0 made no device barrier (not the peer transport?)"
    assert "device-side assert" in got["error"], got["error"]
    assert 2.0 <= got["elapsed"] < 60.0, got["elapsed"]
    with open(log_path, errors="replace") as f:
        log = f.read()
    assert "FUSEDMOE_EP_BARRIER_TIMEOUT_S" in log, log[-2000:]
