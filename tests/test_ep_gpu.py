"""Expert parallelism on 2 GPUs over NCCL: sharded == unsharded for the three dispatch kinds, the
torch and triton backends, bf16 and fp8_block activations, uneven token counts, a rank with no
tokens, sequence parallel, EPLB replicas with a rebalance. Needs >= 2 CUDA GPUs.

    pytest -q -m gpu tests/test_ep_gpu.py
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fusedmoe import FusedMoE, ParallelConfig
from tests.helpers import assert_close, free_port, fused_checkpoint, spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
        reason="needs 2 CUDA GPUs and NCCL",
    ),
]


def _has_nvshmem() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return symm_mem.is_nvshmem_available()


HAS_NVSHMEM = torch.cuda.is_available() and _has_nvshmem()
E, TOP_K, H, I = 16, 4, 512, 256
CALLS = ((37, 0), (5, 130), (1, 1))  # tokens of rank 0 and rank 1, per call
SP_CALLS = (64, 3)  # sequence parallel: tokens both ranks share
MAX_TOKENS = 130  # the symm_mem kind's bound: the largest call of a rank
BACKENDS = ("torch", "triton")
SCHEMES = (None, "fp8_block")
KINDS = ("naive", "all_to_all", "symm_mem")
# (name, backend, scheme, kind, sequence_parallel, redundant experts, placement)
CASES = [
    (f"{b}-{s or 'bf16'}-{k}", b, s, k, False, 0, "linear")
    for b in BACKENDS
    for s in SCHEMES
    for k in KINDS
] + [
    ("triton-bf16-naive-sp", "triton", None, "naive", True, 0, "linear"),
    ("triton-fp8-a2a-sp", "triton", "fp8_block", "all_to_all", True, 0, "linear"),
    ("triton-bf16-a2a-eplb", "triton", None, "all_to_all", False, 4, "round_robin"),
    ("triton-fp8-symm-sp", "triton", "fp8_block", "symm_mem", True, 0, "linear"),
    ("triton-bf16-symm-eplb", "triton", None, "symm_mem", False, 4, "round_robin"),
]
TOL = {None: dict(tol=3e-2), "fp8_block": dict(tol=8e-2, rms_tol=1e-2)}


def _layer(device, pc=None) -> FusedMoE:
    return FusedMoE(
        E, TOP_K, H, I, params_dtype=torch.bfloat16, device=device, backend="torch",
        parallel_config=pc,
    )  # fmt: skip


def _finish(layer: FusedMoE, checkpoint, backend, scheme) -> FusedMoE:
    layer.load_weights(checkpoint)
    if scheme is not None:
        layer.quantize_(scheme)
    layer.set_backend(backend)
    return layer


def gemm_rows(sequence_parallel: bool, rank: int):
    """Per call: (slice of the whole call's rows, slice of this rank's)."""
    start, out = 0, []
    for counts in SP_CALLS if sequence_parallel else CALLS:
        if sequence_parallel:
            out.append((slice(start, start + counts), slice(start, start + counts)))
            start += counts
            continue
        mine = slice(start + sum(counts[:rank]), start + sum(counts[: rank + 1]))
        out.append((slice(start, start + sum(counts)), mine))
        start += sum(counts)
    return out


def _worker(rank: int, port: int, path: str) -> None:
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[key] = "1" if key != "NCCL_NVLS_ENABLE" else "0"
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank),
    )  # fmt: skip
    try:
        data = torch.load(path)
        device = torch.device("cuda", rank)
        results = {}
        for name, backend, scheme, kind, sp, redundant, placement in CASES:
            if kind == "symm_mem" and not HAS_NVSHMEM:
                continue
            pc = ParallelConfig(
                ep_size=2, ep_rank=rank, dp_size=1 if sp else 2, dp_rank=0 if sp else rank,
                sequence_parallel=sp, all2all_backend=kind, placement=placement,
                num_redundant_experts=redundant, max_tokens_per_rank=MAX_TOKENS,
            )  # fmt: skip
            layer = _finish(_layer(device, pc), data["checkpoint"], backend, scheme)
            outputs = []
            for round_ in range(2 if redundant else 1):
                for _, mine in gemm_rows(sp, rank):
                    x, logits = data["x"][mine].to(device), data["logits"][mine].to(device)
                    with torch.no_grad():
                        outputs.append(layer(x, logits).cpu())
                if redundant and round_ == 0:
                    from fusedmoe.parallel.eplb import rebalance_layer

                    rebalance_layer(layer)
            results[name] = outputs
        torch.save(results, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned():
    torch.manual_seed(0)
    full = _layer("cpu")
    checkpoint = fused_checkpoint(full)
    rows = max(sum(sum(c) for c in CALLS), sum(SP_CALLS))
    x = torch.randn(rows, H, dtype=torch.bfloat16)
    logits = torch.randn(rows, E)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ep_gpu.pt")
        torch.save({"checkpoint": checkpoint, "x": x, "logits": logits}, path)
        spawn_ranks(_worker, (free_port(), path), 2, 300, "the NCCL EP workers")
        results = [torch.load(f"{path}.rank{r}") for r in range(2)]
    return checkpoint, x, logits, results


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_nccl_sharded_equals_unsharded(case, spawned):
    checkpoint, x, logits, results = spawned
    name, backend, scheme, kind, sp, redundant, _ = case
    if kind == "symm_mem" and not HAS_NVSHMEM:
        pytest.skip("symm_mem needs torch with NVSHMEM")
    layer = _finish(_layer("cuda"), checkpoint, backend, scheme)
    rounds = 2 if redundant else 1
    for round_ in range(rounds):
        for c, (whole, _) in enumerate(gemm_rows(sp, 0)):
            with torch.no_grad():
                expected = layer(x[whole].cuda(), logits[whole].cuda()).cpu()
            for rank in (0, 1):
                mine = gemm_rows(sp, rank)[c][1]
                got = results[rank][name][round_ * len(gemm_rows(sp, 0)) + c]
                exp = expected[mine.start - whole.start : mine.stop - whole.start]
                assert got.dtype == torch.bfloat16
                assert_close(got, exp, torch.bfloat16, what=f"{name} call {c} rank {rank}",
                             **TOL[scheme])  # fmt: skip
