"""Sweep the tiles of the FP8 backends on one preset, on a GPU: the deep_gemm grouped GEMM at
prefill, and the decode tiles of the triton / hpc expert GEMMs.

    PYTHONPATH=. python3 benchmarks/sweep_fp8_configs.py [--preset deepseek-v3]
        [--prefill 4096,16384] [--decode 1,8,64]

Prints one line per (config, M): median CUDA-graph time of the whole expert computation and
its percent of the floor. What it finds goes into the heuristics (deep_gemm_config,
moe_config.heuristic_config) by hand; `fusedmoe tune` writes per-shape tables.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_backends import csv_list

from fusedmoe import fused_experts
from fusedmoe.kernels.deep_gemm_moe import use_deep_gemm_config
from fusedmoe.kernels.moe_config import (
    GemmConfig,
    MoEKernelConfig,
    heuristic_config,
    use_moe_kernel_config,
)
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import time_ms
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import (
    ceilings_for,
    distinct_experts,
    floor_seconds,
    fp8_block_scale_bytes,
    moe_bytes,
    moe_flops,
)

PREFILL_TILES = [  # (block_m, block_n, warps, stages)
    (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 4, 3), (128, 128, 4, 3),
    (64, 128, 4, 4),
]  # fmt: skip
DECODE_GEMM2 = [  # (block_n, warps, stages) of GEMM2 at 16-row blocks
    (64, 4, 4), (32, 4, 4), (128, 4, 4), (64, 4, 6), (64, 8, 4), (32, 4, 6),
]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--prefill", type=csv_list(int), default=[4096, 16384])
    p.add_argument("--decode", type=csv_list(int), default=[1, 8, 64])
    args = p.parse_args(argv)
    device = torch.device("cuda")
    ceilings = ceilings_for(torch.cuda.get_device_name())
    preset = PRESETS[args.preset]
    e, k, h, i = preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size
    w13, w2 = make_expert_weights(preset.name, e, h, i, preset.activation, torch.bfloat16, device)
    experts = quantize_expert_set(w13, w2, "fp8_block", with_plain=False)
    q13, q2, qc = experts.w13, experts.w2, experts.quant_config
    del w13, w2, experts
    torch.cuda.empty_cache()

    def inputs(m):
        r = make_routing(preset.name, m, e, k, h, "uniform", torch.bfloat16, device)
        d = distinct_experts(r.topk_ids, e)
        nbytes = moe_bytes(d, m, k, h, i, 1, 2, fp8_block_scale_bytes(d, h, i))
        floor = floor_seconds(nbytes, moe_flops(m, k, h, i), ceilings, True) * 1e6
        return r.x, r.topk_weights, r.topk_ids, floor

    def report(what, m, run, floor):
        try:
            us = time_ms(run, device, rep_ms=40)[0] * 1e3
        except Exception as exc:  # a tile that does not fit: say so and go on
            print(f"{what:<44} M={m:<6} failed: {type(exc).__name__}: {exc!s:.80}", flush=True)
            return
        print(f"{what:<44} M={m:<6} {us:9.1f} us  {100 * floor / us:5.1f}%", flush=True)

    for m in args.prefill:
        x, weights, ids, floor = inputs(m)
        run = functools.partial(fused_experts, x, q13, q2, weights, ids, quant_config=qc)
        report("triton (heuristic)", m, functools.partial(run, backend="triton"), floor)
        for bm, bn, warps, stages in PREFILL_TILES:
            config = GemmConfig(block_n=bn, block_k=128, group_m=8, num_warps=warps,
                                num_stages=stages)  # fmt: skip
            with use_deep_gemm_config(bm, config):
                report(f"deep_gemm bm={bm} bn={bn} w={warps} s={stages}", m,
                       functools.partial(run, backend="deep_gemm"), floor)  # fmt: skip
    for m in args.decode:
        x, weights, ids, floor = inputs(m)
        run = functools.partial(fused_experts, x, q13, q2, weights, ids, quant_config=qc)
        base = heuristic_config(m, k, e, h, i, "fp8_block")
        for bn, warps, stages in DECODE_GEMM2:
            gemm2 = GemmConfig(bn, base.gemm2.block_k, base.gemm2.group_m, warps, stages)
            config = MoEKernelConfig(base.block_m, base.gemm1, gemm2, base.fuse_activation)
            with use_moe_kernel_config(config):
                for backend in ("triton", "hpc"):
                    what = f"{backend} bm={base.block_m} gemm2 bn={bn} w={warps} s={stages}"
                    report(what, m, functools.partial(run, backend=backend), floor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
