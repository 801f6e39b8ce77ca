"""Expert-parallel benchmark: dispatch, experts, combine and the whole forward per rank.

    torchrun --nproc-per-node 2 -m fusedmoe.tools.ep_bench                      # 2 GPUs, NCCL
    torchrun --nproc-per-node 2 -m fusedmoe.tools.ep_bench --device cpu --scale 16 --tokens 16,64

A deepseek-v3-sized layer (E = 256, k = 8, H = 7168, I = 2048, its grouped sigmoid routing;
--scale divides H and I) sharded over the ranks as EP over the DP group: each rank has its own
M tokens (--tokens, per rank), holds E / R experts, and gets its own tokens' output back. For
each activation scheme (--dtypes: bf16, fp8_block) and dispatch (--kinds: naive, all_to_all,
symm_mem):

    dispatch  PrepareFinalize.prepare: quantize + send tokens (their scales, ids, weights)
    experts   Experts.apply on the tokens that landed on the rank
    combine   PrepareFinalize.finalize: top-k reduce + send the partial sums back and sum
    forward   FusedMoE.forward: routing + all of the above (+ the count exchanges)

Times are the median over --iters runs (CUDA events on GPUs, perf_counter on CPUs), the
slowest rank's; each stage is timed alone (every rank's earlier work done and the ranks
together before it starts: a stage's time holds no wait for a slower rank), the forward whole.
With --graph, the symm_mem kind's stages and forward are captured in CUDA graphs (one per
stage, one for the forward) and replayed, each after a spin on the GPU that hides the host's
launch of the replay (the other kinds make host syncs: eager). Bytes are
what one rank received from the others (mean over ranks); GB/s = those bytes / the stage's
time; tokens/s = R * M / forward time. With --check, the smallest token count of each
configuration is compared with the unsharded layer (every expert on each rank, all ranks'
tokens): the error is printed and a failure exits 1.
Rank 0 prints the table; --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from fusedmoe.layer import FusedMoE
from fusedmoe.modular.kernel import WorkspaceCache
from fusedmoe.modular.types import ExpertsCall
from fusedmoe.parallel.comm import EPCommStats
from fusedmoe.parallel.config import ParallelConfig
from fusedmoe.tools.presets import get_preset
from fusedmoe.weights.tensors import expert_weights

#: required on the lent multi-GPU machines (no NVLink multicast / NVLS)
_ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
DTYPES = {"bf16": (torch.bfloat16, None), "fp8_block": (torch.bfloat16, "fp8_block")}
KINDS = ("naive", "all_to_all", "symm_mem")
CHECK_TOL = {None: 3e-2, "fp8_block": 8e-2}  # normalised max error vs the unsharded layer


@dataclass
class Row:
    dtype: str
    kind: str
    tokens_per_rank: int
    ranks: int
    dispatch_ms: float
    experts_ms: float
    combine_ms: float
    forward_ms: float
    dispatch_bytes: float  # received by one rank from the others, per forward
    combine_bytes: float
    tokens_per_s: float
    check: str  # "" (not checked), "ok (err 1.2e-03)" or "FAIL (...)"

    @property
    def dispatch_gbps(self) -> float:
        return self.dispatch_bytes / self.dispatch_ms / 1e6 if self.dispatch_ms else 0.0

    @property
    def combine_gbps(self) -> float:
        return self.combine_bytes / self.combine_ms / 1e6 if self.combine_ms else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fusedmoe.tools.ep_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="default: cuda when available (NCCL), else cpu (gloo)",
    )
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--scale", type=int, default=1, help="divide H and I by this")
    parser.add_argument("--tokens", default="64,1024,8192", help="tokens per rank, comma list")
    parser.add_argument("--dtypes", default="bf16,fp8_block", help=f"of {list(DTYPES)}")
    parser.add_argument(
        "--kinds",
        default=None,
        help=f"of {list(KINDS)}; default naive,all_to_all, and symm_mem where it runs (CUDA "
        "with torch's NVSHMEM)",
    )
    parser.add_argument("--backend", default=None, help="default: triton on cuda, torch on cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare the smallest token count with the unsharded layer",
    )
    parser.add_argument(
        "--graph", action="store_true", help="time symm_mem under CUDA-graph replay"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="symm_mem's max_tokens_per_rank (default: the largest --tokens)",
    )
    parser.add_argument(
        "--combine-blocks",
        type=int,
        default=None,
        help="symm_mem: the combine in this many column blocks, overlapped with GEMM2 "
        "(default: the rule of fusedmoe.parallel.symm_mem_ep.combine_bounds; 1: none)",
    )
    parser.add_argument(
        "--routing-first",
        choices=("auto", "on", "off"),
        default="auto",
        help="symm_mem's peer transport: the routing sent ahead of the activations, which "
        "travel on a side stream while the experts align their slots (default: the rule of "
        "fusedmoe.parallel.symm_mem_ep.routing_first)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = parser.parse_args(argv)  # fmt: skip
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        parser.error(f"--tokens must be a comma list of ints, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 0:
        parser.error("--tokens must list token counts >= 0")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if args.kinds is None:
        args.kinds = "naive,all_to_all" + (",symm_mem" if _symm_mem_runs(args.device) else "")
    args.kinds = [k for k in args.kinds.split(",") if k]
    for name, values, allowed in (
        ("--dtypes", args.dtypes, DTYPES),
        ("--kinds", args.kinds, KINDS),
    ):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            parser.error(f"{name}: {bad or 'nothing'} not of {list(allowed)}")
    for name in ("scale", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")
    if args.combine_blocks is not None and args.combine_blocks < 1:
        parser.error("--combine-blocks must be >= 1")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "triton" if args.device == "cuda" else "torch"
    return args


def _symm_mem_runs(device: str | None) -> bool:
    """Whether the symm_mem kind can run here (CUDA with torch's NVSHMEM), asked before the
    process group starts: the default --kinds add it where it can."""
    from fusedmoe.parallel.symm_mem_ep import transport_kind

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cpu" or not torch.cuda.is_available():
        return False
    if world & (world - 1) and transport_kind() != "peer":
        return False  # another size: the peer transport only, asked for by name
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return symm_mem.is_nvshmem_available()


def _init_distributed(device: str):
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "fusedmoe.tools.ep_bench runs under torchrun: "
            "torchrun --nproc-per-node 2 -m fusedmoe.tools.ep_bench [options]"
        )
    local = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda" else None
    )
    if local is not None:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        # the rank's GPU named up front: NCCL binds to it at once, and collectives (the barriers
        # included) neither guess it from the global rank nor warn that they did
        dist.init_process_group("nccl" if local is not None else "gloo", device_id=local)
    return dist


# ---- weights and tokens: deterministic, so every rank (and the reference) makes the same ----
def _generator(device: torch.device, *seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(hash(seed) % (2**62))
    return g


def expert_checkpoint(preset, experts, seed: int, device, dtype):
    """Per-expert checkpoint tensors of `experts` (global ids), the same on every rank."""
    hidden, inter = preset.hidden_size, preset.intermediate_size
    for e in experts:
        g = _generator(device, seed, 1, e)
        w13 = torch.randn(2 * inter, hidden, generator=g, device=device) * hidden**-0.5
        w2 = torch.randn(hidden, inter, generator=g, device=device) * inter**-0.5
        yield f"experts.{e}.gate_proj.weight", w13[:inter].to(dtype)
        yield f"experts.{e}.up_proj.weight", w13[inter:].to(dtype)
        yield f"experts.{e}.down_proj.weight", w2.to(dtype)


def rank_tokens(preset, num_tokens: int, rank: int, seed: int, device, dtype):
    g = _generator(device, seed, 2, rank, num_tokens)
    x = torch.randn(num_tokens, preset.hidden_size, generator=g, device=device).to(dtype)
    logits = torch.randn(num_tokens, preset.num_experts, generator=g, device=device)
    return x, logits


def build_layer(preset, scheme, dtype, device, backend, seed, parallel_config=None) -> FusedMoE:
    torch.manual_seed(seed)  # the router's correction bias: the same on every rank
    layer = preset.build(
        dtype=dtype, device=device, backend="torch", parallel_config=parallel_config
    )
    rank = layer.parallel_config.ep_rank
    experts = sorted(set(layer.placement.local_logical(rank)))
    layer.load_weights(expert_checkpoint(preset, experts, seed, device, dtype))
    if scheme is not None:
        layer.quantize_(scheme)
    layer.set_backend(backend)
    return layer


# ---- timing ----
_HEAD_START_CYCLES = 200_000  # _Timer.head_start: about 100 us at an H100's or H200's clock


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def head_start(self) -> None:
        """A spin of about 100 us on the GPU before a timed graph replay: the host's launch of
        the replay (microseconds) then happens while the GPU is busy, and the stage's time is
        the GPU's alone, as when graphs are replayed back to back (every rank spins as long:
        they stay together)."""
        if self.cuda:
            torch.cuda._sleep(_HEAD_START_CYCLES)

    def settle(self, dist, pf=None) -> None:
        """Every rank's queued work done, and the ranks together: the next stage is timed
        alone (a stage's time then holds no wait for a slower rank's earlier stage). Where the
        prepare/finalize has a barrier on the GPUs (symm_mem's peer transport), it runs last:
        the ranks' timed stages then start together, not tens of microseconds apart (the
        host's launch skew, which a stage that starts with a barrier would count)."""
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()
        barrier = getattr(pf, "device_barrier", None)
        if self.cuda and barrier is not None:
            barrier()


def _stage_buffers(layer: FusedMoE, kernel, weights, prepared, x, workspaces):
    """The experts' workspaces and output for a prepared call, as the modular kernel takes them
    (the output where the prepare/finalize offers a buffer of its own: symm_mem's out rows)."""
    experts = kernel.experts
    num_tokens, top_k = prepared.topk_ids.shape
    shapes = experts.workspace_shapes(
        num_tokens, weights.gemm1_out_size, weights.hidden_size, top_k,
        layer.placement.num_physical, weights.num_local_experts, layer.activation.kind,
    )  # fmt: skip
    dtype = experts.workspace_dtype(x.dtype)
    ws13 = workspaces.get("workspace13", shapes.workspace13, dtype, x.device)
    ws2 = workspaces.get("workspace2", shapes.workspace2, dtype, x.device)
    out = kernel.prepare_finalize.expert_output_buffer(tuple(shapes.output), x.dtype, x.device)
    if out is None:
        out = workspaces.get("output", shapes.output, x.dtype, x.device)
    return ws13, ws2, out


def _prepare(pf, x, topk_weights, topk_ids, num_physical, layer, experts, qc):
    """The dispatch stage: prepare, and its activations arrived (PrepareResult.input_ready:
    the experts' stage is timed alone)."""
    prepared = pf.prepare(
        x, topk_weights, topk_ids, num_physical, layer.expert_map, False, qc,
        defer_input_quant=experts.wants_unquantized_input(),
    )  # fmt: skip
    if prepared.input_ready is not None:
        prepared.input_ready()
    return prepared


def time_stages(layer: FusedMoE, x, logits, timer: _Timer, dist) -> tuple[float, float, float]:
    """One forward split into its stages, through the layer's own modular kernel:
    -> (dispatch ms, experts ms, combine ms)."""
    _, kernel = layer._kernel(x.device, x.dtype, False)
    pf, experts = kernel.prepare_finalize, kernel.experts
    weights = expert_weights(layer, experts.hidden_size_alignment)
    topk_weights, topk_ids = layer.router.select_experts(x, logits)
    qc = layer.quant_config
    num_physical = layer.placement.num_physical  # the ids the experts see (E without replicas)
    timer.settle(dist, pf)
    t0 = timer.mark()
    prepared = _prepare(pf, x, topk_weights, topk_ids, num_physical, layer, experts, qc)
    t1 = timer.mark()
    num_tokens = prepared.topk_ids.shape[0]
    ws13, ws2, out = _stage_buffers(layer, kernel, weights, prepared, x, kernel.workspaces)
    t2 = timer.mark()
    if num_tokens:
        experts.apply(
            ExpertsCall(
                output=out, hidden_states=prepared.a1q, weights=weights,
                topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
                activation=layer.activation, global_num_experts=num_physical,
                workspace13=ws13, workspace2=ws2, expert_map=layer.expert_map,
                quant_config=qc, a1q_scale=prepared.a1q_scale,
                a1q_global_scale=prepared.a1q_global_scale,
                expert_tokens_meta=prepared.expert_tokens_meta,
            )
        )  # fmt: skip
    t3 = timer.mark()
    output = torch.empty_like(x)
    timer.settle(dist, pf)
    t3b = timer.mark()
    pf.finalize(
        output, out, prepared.topk_weights, prepared.topk_ids, False,
        experts.finalize_weight_and_reduce_impl(),
    )  # fmt: skip
    t4 = timer.mark()
    return timer.elapsed_ms(t0, t1), timer.elapsed_ms(t2, t3), timer.elapsed_ms(t3b, t4)


def _captured(fn):
    """fn() captured in a CUDA graph: (graph, what fn returned: its static outputs)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graphed_stages(layer: FusedMoE, x, logits):
    """The stages of time_stages and the whole forward, each captured in a CUDA graph (after
    the eager warm-up): -> (prepare, experts, finalize, forward) graphs, replayed in order, and
    the tensors they read and write that were allocated outside them (kept alive with them)."""
    _, kernel = layer._kernel(x.device, x.dtype, False)
    pf, experts = kernel.prepare_finalize, kernel.experts
    weights = expert_weights(layer, experts.hidden_size_alignment)
    topk_weights, topk_ids = layer.router.select_experts(x, logits)
    qc = layer.quant_config
    num_physical = layer.placement.num_physical
    g1, prepared = _captured(
        lambda: _prepare(pf, x, topk_weights, topk_ids, num_physical, layer, experts, qc)
    )
    ws13, ws2, out = _stage_buffers(layer, kernel, weights, prepared, x, WorkspaceCache())
    call = ExpertsCall(
        output=out, hidden_states=prepared.a1q, weights=weights,
        topk_weights=prepared.topk_weights, topk_ids=prepared.topk_ids,
        activation=layer.activation, global_num_experts=num_physical,
        workspace13=ws13, workspace2=ws2, expert_map=layer.expert_map, quant_config=qc,
        a1q_scale=prepared.a1q_scale, a1q_global_scale=prepared.a1q_global_scale,
    )  # fmt: skip
    g2, _ = _captured(lambda: experts.apply(call))
    output = torch.empty_like(x)
    reduce = experts.finalize_weight_and_reduce_impl()
    g3, _ = _captured(
        lambda: pf.finalize(
            output, out, prepared.topk_weights, prepared.topk_ids, False, reduce
        )
    )  # fmt: skip
    g4, _ = _captured(lambda: layer(x, logits))
    return (g1, g2, g3, g4), (call, output, topk_weights, topk_ids)


def time_graphs(graphs, timer: _Timer, dist, pf=None) -> tuple[float, float, float, float]:
    """(dispatch, experts, combine, forward) ms of one replay of each graph."""
    (g1, g2, g3, g4), _ = graphs
    stages = []
    for graph in (g1, g2, g3):  # each stage alone: every rank starts it together
        timer.settle(dist, pf)
        timer.head_start()
        start = timer.mark()
        graph.replay()
        stages.append(timer.elapsed_ms(start, timer.mark()))
    timer.settle(dist, pf)
    timer.head_start()
    start = timer.mark()
    g4.replay()
    return (*stages, timer.elapsed_ms(start, timer.mark()))


def time_forward(layer, x, logits, timer, dist) -> float:
    dist.barrier()
    start = timer.mark()
    with torch.no_grad():
        layer(x, logits)
    return timer.elapsed_ms(start, timer.mark())


def check_sharded(args, preset, scheme, dtype, device, layer, num_tokens, rank, world) -> str:
    """This rank's output vs the unsharded layer (every expert) on every rank's tokens."""
    reference = build_layer(preset, scheme, dtype, device, args.backend, args.seed)
    inputs = [rank_tokens(preset, num_tokens, r, args.seed, device, dtype) for r in range(world)]
    with torch.no_grad():
        got = layer(*inputs[rank])
        expected = reference(torch.cat([x for x, _ in inputs]), torch.cat([g for _, g in inputs]))
    del reference
    expected = expected[rank * num_tokens : (rank + 1) * num_tokens]
    scale = max(float(expected.abs().max()), 1e-30) if expected.numel() else 1.0
    err = float((got.float() - expected.float()).abs().max()) / scale if got.numel() else 0.0
    ok = err <= CHECK_TOL[scheme]
    return f"{'ok' if ok else 'FAIL'} (err {err:.1e})"


def run(args) -> list[Row]:
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    dist = _init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else (
        torch.device("cpu")
    )  # fmt: skip
    preset = get_preset(args.preset).scaled(args.scale)
    timer = _Timer(device)
    rows = []
    for dtype_name in args.dtypes:
        dtype, scheme = DTYPES[dtype_name]
        for kind in args.kinds:
            pc = ParallelConfig(
                ep_size=world, ep_rank=rank, dp_size=world, dp_rank=rank, all2all_backend=kind,
                max_tokens_per_rank=args.max_tokens or max(*args.tokens, 1),
            )  # fmt: skip
            layer = build_layer(preset, scheme, dtype, device, args.backend, args.seed, pc)
            for num_tokens in args.tokens:
                x, logits = rank_tokens(preset, num_tokens, rank, args.seed, device, dtype)
                _, kernel = layer._kernel(device, dtype, False)
                pf = kernel.prepare_finalize
                stages, forwards = [], []
                with torch.no_grad():
                    stats = EPCommStats()  # one rank (ep = 1): nothing travels
                    if hasattr(pf, "reset_stats"):
                        pf.count_traffic = True  # symm_mem: counts read on the host, untimed
                        pf.reset_stats()
                        time_stages(layer, x, logits, timer, dist)
                        stats = pf.reset_stats()
                        pf.count_traffic = False
                    graphs = None
                    if args.graph and kind == "symm_mem" and device.type == "cuda":
                        time_forward(layer, x, logits, timer, dist)  # warm-up
                        graphs = graphed_stages(layer, x, logits)
                    for i in range(args.warmup + args.iters):
                        if graphs is not None:
                            *stage, forward = time_graphs(graphs, timer, dist, pf)
                        else:
                            stage = time_stages(layer, x, logits, timer, dist)
                            forward = time_forward(layer, x, logits, timer, dist)
                        if i >= args.warmup:
                            stages.append(stage)
                            forwards.append(forward)
                    del graphs
                medians = [statistics.median(s[j] for s in stages) for j in range(3)]
                mine = [*medians, statistics.median(forwards),
                        stats.dispatch_bytes_received, stats.combine_bytes_received]  # fmt: skip
                check = ""
                if args.check and num_tokens == min(args.tokens):
                    check = check_sharded(
                        args, preset, scheme, dtype, device, layer, num_tokens, rank, world
                    )
                everyone = [None] * world
                dist.all_gather_object(everyone, (mine, check))
                times = [max(r[0][j] for r in everyone) for j in range(4)]
                moved = [statistics.mean(r[0][j] for r in everyone) for j in (4, 5)]
                checks = [r[1] for r in everyone]
                failed = [c for c in checks if c.startswith("FAIL")]
                rows.append(
                    Row(dtype_name, kind, num_tokens, world, *times, *moved,
                        tokens_per_s=world * num_tokens / (times[3] / 1e3) if times[3] else 0.0,
                        check=(failed[0] if failed else checks[0]))
                )  # fmt: skip
            del layer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_table(rows: list[Row], title: str) -> str:
    header = (
        f"{'dtype':<10} {'dispatch':<10} {'M/rank':>7} {'disp ms':>8} {'exp ms':>8} "
        f"{'comb ms':>8} {'fwd ms':>8} {'disp MB':>8} {'comb MB':>8} {'disp GB/s':>9} "
        f"{'comb GB/s':>9} {'tok/s':>10}  check"
    )
    lines = [title, header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.dtype:<10} {r.kind:<10} {r.tokens_per_rank:>7} {r.dispatch_ms:>8.3f} "
            f"{r.experts_ms:>8.3f} {r.combine_ms:>8.3f} {r.forward_ms:>8.3f} "
            f"{r.dispatch_bytes / 1e6:>8.2f} {r.combine_bytes / 1e6:>8.2f} "
            f"{r.dispatch_gbps:>9.2f} {r.combine_gbps:>9.2f} {r.tokens_per_s:>10.0f}  {r.check}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from fusedmoe.parallel.symm_mem_ep import combine_blocks_override, routing_first_override

    args = parse_args(argv)
    first = {"auto": None, "on": True, "off": False}[args.routing_first]
    with combine_blocks_override(args.combine_blocks), routing_first_override(first):
        rows = run(args)
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        preset = get_preset(args.preset).scaled(args.scale)
        title = (
            f"EP benchmark: {preset.label}, E={preset.num_experts}, k={preset.top_k}, "
            f"H={preset.hidden_size}, I={preset.intermediate_size}, {dist.get_world_size()} "
            f"ranks ({args.device}, {dist.get_backend()}), backend {args.backend}"
        )
        if args.combine_blocks is not None:
            title += f", symm_mem combine in {args.combine_blocks} column blocks"
        if first is not None:
            title += f", routing first {args.routing_first}"
        print(format_table(rows, title), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                payload = [
                    {**asdict(r), "dispatch_gbps": r.dispatch_gbps, "combine_gbps": r.combine_gbps}
                    for r in rows
                ]
                json.dump({"title": title, "rows": payload}, f, indent=2)
    failed = any(r.check.startswith("FAIL") for r in rows)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
