"""The fused router on a GPU: each preset's routing (its router as FusedMoE builds it) at several
token counts, the shipped launch rule (fusedmoe.router.fused.routing_kernel_config) against
other tiles (rows a program x warps) and the torch twins (the routing under autograd).

    python benchmarks/bench_routing.py                      # the presets below, the sweep
    python benchmarks/bench_routing.py --tokens 1,4096 --presets deepseek-v3 --no-sweep

Times are medians of CUDA-graph replays of 20 calls (us a call; the twins: 20 eager calls,
launches included), with the rule's rates: GB/s of float32 logits read, million tokens routed
a second. Every tile's ids are checked against the shipped rule's ('!' marks a tile that
differs). docs/performance.md has the runs.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

import fusedmoe.router.fused as fused
from fusedmoe.tools.presets import get_preset

PRESETS = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b")
TILES = tuple(itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8)))  # (rows, warps)


def _graph_us(fn, calls: int = 20, replays: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def _eager_us(fn, calls: int = 20) -> float:
    """Eager calls, launches included (the twins' several launches are their cost)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--tokens", default="1,64,1024,4096,16384")
    parser.add_argument("--no-sweep", action="store_true", help="the shipped rule and the twin")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    shipped = fused.routing_kernel_config
    print(
        f"{'preset':16s} {'tokens':>6s} {'rule':>5s} {'us':>7s} {'GB/s':>6s} {'Mtok/s':>7s} "
        f"{'twin us':>8s}  best tiles"
    )
    for name in args.presets.split(","):
        layer = get_preset(name).scaled(64).build(dtype=torch.bfloat16, device="cuda")
        router = layer.router
        for m in (int(t) for t in args.tokens.split(",")):
            logits = torch.randn(m, layer.num_experts, device="cuda")
            x = torch.empty(m, layer.hidden_size, device="cuda", dtype=torch.bfloat16)

            def route(logits=logits, x=x, select=router.select_experts):
                return select(x, logits)

            expected_ids = route()[1]
            rule_us = _graph_us(route)
            with torch.enable_grad():  # autograd on the logits: the torch twins route
                twin_us = _eager_us(functools.partial(route, logits.clone().requires_grad_()))
            groups = getattr(router, "num_expert_group", None) or 1  # the rule's argument
            padded = fused.next_power_of_2(groups) * fused.next_power_of_2(
                layer.num_experts // groups
            )
            rule = shipped(m, padded, True)
            best = []
            if not args.no_sweep:
                try:
                    for rows, warps in TILES:
                        if rows > 2 * max(m, 1):
                            continue
                        fused.routing_kernel_config = lambda *_, r=rows, w=warps: (
                            fused.RoutingKernelConfig(r, w)
                        )
                        same = torch.equal(route()[1], expected_ids)
                        best.append((_graph_us(route), rows, warps, same))
                finally:
                    fused.routing_kernel_config = shipped
                best.sort()
            tiles = " ".join(f"{r}x{w}:{t:.1f}{'' if ok else '!'}" for t, r, w, ok in best[:4])
            gbps = logits.numel() * logits.element_size() / rule_us / 1e3  # the logits read
            print(
                f"{name:16s} {m:6d} {rule.block_m:>2d}x{rule.num_warps:<2d} {rule_us:7.1f} "
                f"{gbps:6.1f} {m / rule_us:7.1f} {twin_us:8.1f}  {tiles}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
