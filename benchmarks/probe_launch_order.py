"""The triton backend's launch order under skewed routing: grouped rows against columns first.

    PYTHONPATH=. python3 benchmarks/probe_launch_order.py [--presets ...] [--quant bf16,fp8_block]
        [--tokens 8,64,256,1024] [--routing uniform,skewed] [--orders 1,16,64,1024]
        [--pairs] [--json rows.json]

Each GEMM launches its (row block, column tile) programs in an order set by `group_m`:
`group_m` row blocks take every column tile, then the next `group_m` row blocks. The idea it
tests: under skewed routing a popular expert owns many consecutive row blocks, so some waves of
programs might compute on one expert while others only stream weights. With `group_m` at least
the number of row blocks (1024 here) the order is columns first: every wave holds the row blocks
of every expert for a few column tiles. The rows (A) are then read once per column tile; at
small M they are a few MB, held in L2. (On an H100 it held for mixtral-8x7b only; skewed calls
turned out bound by L2: README, "Launch order".)

For each preset, scheme, M and routing: the whole expert computation under CUDA-graph replay
(as `fusedmoe bench` times it) with the shipped config, then with both GEMMs' group_m set to
each order and each GEMM alone set to 1024 (or, with --pairs, every pair of GEMM1 and GEMM2
orders drawn from the shipped one and --orders). Prints us and % of the floor, and the largest
relative difference to the shipped config's output (the order changes no arithmetic: 0). Last,
per bucket, the pair the tuner's keep-uniform rule would take among those timed: uniform time
within 1% of the shipped config's, the least skewed time, taken if 3% below the shipped one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_backends import csv_list

from fusedmoe.functional import fused_experts
from fusedmoe.kernels.fused_moe import device_name
from fusedmoe.kernels.moe_config import MoEKernelConfig, moe_kernel_config, use_moe_kernel_config
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import settle, time_ms
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import ceilings_for, distinct_experts, moe_floor

ALL = 1024  # more row blocks than the calls here have: the order is columns first


def with_orders(c: MoEKernelConfig, g1: int | None, g2: int | None) -> MoEKernelConfig:
    gemm1 = c.gemm1 if g1 is None else dataclasses.replace(c.gemm1, group_m=g1)
    gemm2 = c.gemm2 if g2 is None else dataclasses.replace(c.gemm2, group_m=g2)
    return dataclasses.replace(c, gemm1=gemm1, gemm2=gemm2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", type=csv_list(str), default=list(PRESETS))
    p.add_argument("--quant", type=csv_list(str), default=["bf16", "fp8_block"])
    p.add_argument("--tokens", type=csv_list(int), default=[8, 64, 256, 1024])
    p.add_argument("--routing", type=csv_list(str), default=["uniform", "skewed"])
    p.add_argument("--orders", type=csv_list(int), default=[1, 16, 64, ALL])
    p.add_argument("--pairs", action="store_true", help="every (GEMM1, GEMM2) pair of orders")
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    orders = args.orders
    dev = torch.device("cuda")
    ceilings = ceilings_for(torch.cuda.get_device_name())
    rows = []
    for name in args.presets:
        pr = PRESETS[name]
        e, k, h, i = pr.num_experts, pr.top_k, pr.hidden_size, pr.intermediate_size
        w13, w2 = make_expert_weights(name, e, h, i, pr.activation, torch.bfloat16, dev)
        for quant in args.quant:
            scheme = None if quant == "bf16" else quant
            ex = quantize_expert_set(w13, w2, scheme, with_plain=False)
            dtype = "bfloat16" if scheme is None else quant
            for m in args.tokens:
                for routing in args.routing:
                    r = make_routing(name, m, e, k, h, routing, torch.bfloat16, dev)
                    floor = moe_floor(
                        quant, num_distinct=distinct_experts(r.topk_ids, e), num_tokens=m,
                        top_k=k, hidden_size=h, intermediate_size=i, ceilings=ceilings,
                    ).seconds * 1e6  # fmt: skip
                    run = functools.partial(
                        fused_experts, r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids,
                        activation=pr.activation, quant_config=ex.quant_config, backend="triton",
                    )  # fmt: skip
                    shipped = moe_kernel_config(m, k, e, 2 * i, h, i, dtype, device_name(r.x))
                    ref = run().float()
                    settle(run, dev, rep_ms=20.0)
                    variants = {"shipped": shipped}
                    if args.pairs:
                        g1s = dict.fromkeys([shipped.gemm1.group_m, *orders])
                        g2s = dict.fromkeys([shipped.gemm2.group_m, *orders])
                        for g1 in g1s:
                            for g2 in g2s:
                                c = with_orders(shipped, g1, g2)
                                if c != shipped:
                                    variants[f"{g1}/{g2}"] = c
                    else:
                        for g in orders:
                            variants[f"both {g}"] = with_orders(shipped, g, g)
                        variants[f"gemm1 {ALL}"] = with_orders(shipped, ALL, None)
                        variants[f"gemm2 {ALL}"] = with_orders(shipped, None, ALL)
                    timed = {}
                    for label, config in variants.items():
                        with use_moe_kernel_config(config):
                            out = run().float()
                            diff = ((out - ref).abs().max() / ref.abs().max()).item()
                            timed[label] = time_ms(run, dev, rep_ms=args.rep_ms)[0] * 1e3
                        print(f"{name} {quant} M={m} {routing} {label} "
                              f"(gm {config.gemm1.group_m}/{config.gemm2.group_m}): "
                              f"{timed[label]:.1f} us "
                              f"({100 * floor / timed[label]:.0f}%) diff {diff:.1e}",
                              flush=True)  # fmt: skip
                    rows.append(dict(preset=name, quant=quant, m=m, routing=routing,
                                     floor_us=floor, shipped_group_m=[shipped.gemm1.group_m,
                                     shipped.gemm2.group_m], block_m=shipped.block_m,
                                     timed=timed))  # fmt: skip
            del ex
            torch.cuda.empty_cache()
        del w13, w2
        torch.cuda.empty_cache()
    print("\npreset quant M routing: shipped us -> best order (us, x of shipped)")
    for row in rows:
        t = row["timed"]
        best = min(t, key=t.get)
        print(
            f"{row['preset']:16s} {row['quant']:9s} {row['m']:5d} {row['routing']:8s} "
            f"{t['shipped']:8.1f} -> {best:10s} {t[best]:8.1f} ({t[best] / t['shipped']:.3f})"
        )
    print("\nkeep-uniform (uniform within 1%, skewed 3% faster): preset quant M -> pair")
    by_bucket = {}
    for row in rows:
        by_bucket.setdefault((row["preset"], row["quant"], row["m"]), {})[row["routing"]] = row
    for (name, quant, m), both in by_bucket.items():
        if "uniform" not in both or "skewed" not in both:
            continue
        tu, ts = both["uniform"]["timed"], both["skewed"]["timed"]
        fits = [v for v in tu if v != "shipped" and v in ts and tu[v] <= 1.01 * tu["shipped"]]
        best = min(fits, key=ts.get, default=None)
        if best is not None and ts[best] <= 0.97 * ts["shipped"]:
            print(
                f"{name:16s} {quant:9s} {m:5d} -> {best:10s} uniform "
                f"{tu[best] / tu['shipped']:.3f}, skewed {ts[best] / ts['shipped']:.3f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
