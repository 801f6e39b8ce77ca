"""Decode tiles of the fp8_block triton path, swept beyond the tuner's local search.

    PYTHONPATH=. python3 benchmarks/probe_decode_tiles.py [--presets gpt-oss-120b,...]
        [--tokens 1,8] [--json rows.json]

For each preset and M (uniform routing): the whole expert computation under CUDA-graph
replay (as `fusedmoe bench` times it) with the shipped config, then with each config of a
grid: GEMM1 fused with the activation and its 1 x 128 quantization (128-wide tiles: one
program per slot and group) or unfused (narrow GEMM1 tiles, then the act + quant kernel),
crossed with GEMM2 tiles. Prints us and % of the floor per config, then for the shipped and
the fastest config the device time of each kernel (torch.profiler, 20 eager calls): how far
the GEMMs alone are from reading the weights at the card's bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_backends import csv_list
from profile_decode_kernels import GEMM, _kernel_us

from fusedmoe.functional import fused_experts
from fusedmoe.kernels.fused_moe import device_name
from fusedmoe.kernels.moe_config import (
    GemmConfig,
    MoEKernelConfig,
    moe_kernel_config,
    use_moe_kernel_config,
)
from fusedmoe.tools.bench.inputs import (
    ExpertSet,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.bench.timing import settle, time_ms
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import ceilings_for, distinct_experts, moe_floor


def fp8_floor_us(topk_ids, num_experts, hidden, inter, ceilings) -> float:
    """The fp8_block layer's floor for this routing, in us (fusedmoe.tools.roofline)."""
    m, k = topk_ids.shape
    floor = moe_floor(
        "fp8_block", num_distinct=distinct_experts(topk_ids, num_experts), num_tokens=m,
        top_k=k, hidden_size=hidden, intermediate_size=inter, ceilings=ceilings,
    )  # fmt: skip
    return floor.seconds * 1e6


def fp8_block_experts(name: str, device: torch.device) -> ExpertSet:
    """The preset's experts (tools.bench.inputs' weights), quantized to fp8_block; the bf16
    weights are freed before it returns."""
    p = PRESETS[name]
    w13, w2 = make_expert_weights(
        name, p.num_experts, p.hidden_size, p.intermediate_size, p.activation, torch.bfloat16,
        device,
    )  # fmt: skip
    experts = quantize_expert_set(w13, w2, "fp8_block", with_plain=False)
    del w13, w2
    torch.cuda.empty_cache()
    return experts


def grid(shipped: MoEKernelConfig) -> list[MoEKernelConfig]:
    """The configs to time besides the shipped one."""
    gemm2s = [shipped.gemm2] + [
        GemmConfig(bn, 128, 8, warps, stages)
        for bn, warps, stages in ((32, 4, 5), (64, 4, 4), (32, 2, 4), (64, 2, 4))
    ]
    out = []
    for bm, warps, stages in itertools.product((16, 64), (4, 8), (3, 4, 5)):
        gemm1 = GemmConfig(128, 128, 8, warps, stages)
        out += [MoEKernelConfig(bm, gemm1, g2, True) for g2 in gemm2s[:3]]
    for bn, warps, stages in itertools.product((32, 64, 128), (2, 4), (3, 4, 6)):
        gemm1 = GemmConfig(bn, 128, 8, warps, stages)
        out += [MoEKernelConfig(16, gemm1, g2, False) for g2 in gemm2s]
    return [c for c in dict.fromkeys(out) if c != shipped]


def short(c: MoEKernelConfig) -> str:
    g1, g2 = c.gemm1, c.gemm2
    return (
        f"BM{c.block_m} g1[{g1.block_n} w{g1.num_warps} s{g1.num_stages} gm{g1.group_m}] "
        f"g2[{g2.block_n} w{g2.num_warps} s{g2.num_stages} gm{g2.group_m}]"
        + ("" if c.fuse_activation else " unfused")
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", type=csv_list(str), default=["gpt-oss-120b", "qwen3-30b-a3b"])
    p.add_argument("--tokens", type=csv_list(int), default=[1, 8])
    p.add_argument("--rep-ms", type=float, default=25.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    ceilings = ceilings_for(torch.cuda.get_device_name())
    rows = []
    for name in args.presets:
        preset = PRESETS[name]
        e, k, h, i = preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size
        act = preset.activation
        ex = fp8_block_experts(name, dev)
        for m in args.tokens:
            r = make_routing(name, m, e, k, h, "uniform", torch.bfloat16, dev)
            floor = fp8_floor_us(r.topk_ids, e, h, i, ceilings)
            run = functools.partial(
                fused_experts, r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids, activation=act,
                quant_config=ex.quant_config, backend="triton",
            )  # fmt: skip
            ref = run()
            shipped = moe_kernel_config(m, k, e, 2 * i, h, i, "fp8_block", device_name(r.x))
            timed = {}
            settle(run, dev)
            for config in [shipped, *grid(shipped)]:
                with use_moe_kernel_config(config):
                    try:
                        out = run()
                        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        us = time_ms(run, dev, rep_ms=args.rep_ms)[0] * 1e3
                    except Exception as exc:  # a tile that does not fit: say so, go on
                        print(f"{name} M={m} {short(config)}: {type(exc).__name__} {exc!s:.60}")
                        continue
                timed[config] = us
                tag = "shipped " if config == shipped else ""
                print(f"{name} M={m} {tag}{short(config)}: {us:.1f} us "
                      f"({100 * floor / us:.0f}%) diff {err:.1e}", flush=True)  # fmt: skip
            best = min(timed, key=timed.get)
            for label, config in (("shipped", shipped), ("best", best)):
                with use_moe_kernel_config(config):
                    kernels = _kernel_us(run)
                gemms = kernels.get(GEMM, 0.0) * 2
                total = sum(v * (2 if n.startswith(GEMM) else 1) for n, v in kernels.items())
                print(f"  {label} {short(config)}: graph {timed[config]:.1f} us, kernels "
                      f"{total:.1f} us, GEMMs {gemms:.1f} us: " + ", ".join(
                          f"{n[:28]} {v:.1f}" for n, v in kernels.items()), flush=True)  # fmt: skip
                rows.append(dict(preset=name, m=m, which=label, config=short(config),
                                 graph_us=timed[config], floor_us=floor,
                                 kernels=kernels))  # fmt: skip
            rows.append(dict(preset=name, m=m, which="all", floor_us=floor,
                             timed={short(c): t for c, t in timed.items()}))  # fmt: skip
        del ex
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
