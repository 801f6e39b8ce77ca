"""The wgmma engine's GEMM1 with the activation and its quantization in the epilogue, against
GEMM1 storing h for the act + quant kernel: whole layer, on a Hopper GPU, without the library.

    FUSEDMOE_DEEP_GEMM=0 PYTHONPATH=. python3 benchmarks/bench_act_fusion.py
        [--presets deepseek-v3,...] [--tokens 4096,16384] [--routing uniform,skewed]

For each cell: the deep_gemm backend (the wgmma engine at every M) under CUDA-graph replay,
the two paths alternating (--runs times each, medians printed), their outputs compared bit
for bit (a2 is the same bytes either way, so the layer's output must be too), and % of the
floor at the card's ceilings (fusedmoe.tools.roofline).
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

from fusedmoe.functional import fused_experts
from fusedmoe.kernels.deep_gemm_moe import use_wgmma_act_fusion
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import settle, time_ms
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import (
    ceilings_for,
    distinct_experts,
    floor_seconds,
    fp8_block_scale_bytes,
    moe_bytes,
    moe_flops,
)

SILU_PRESETS = ["deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", type=csv_list(str), default=SILU_PRESETS)
    p.add_argument("--tokens", type=csv_list(int), default=[4096, 16384])
    p.add_argument("--routing", type=csv_list(str), default=["uniform"])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rep-ms", type=float, default=100.0)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    ceilings = ceilings_for(torch.cuda.get_device_name())
    table = []
    for name in args.presets:
        pr = PRESETS[name]
        e, k, h, i = pr.num_experts, pr.top_k, pr.hidden_size, pr.intermediate_size
        w13, w2 = make_expert_weights(name, e, h, i, pr.activation, torch.bfloat16, dev)
        ex = quantize_expert_set(w13, w2, "fp8_block", with_plain=False)
        del w13, w2
        torch.cuda.empty_cache()
        for routing in args.routing:
            for m in args.tokens:
                r = make_routing(name, m, e, k, h, routing, torch.bfloat16, dev)
                d = distinct_experts(r.topk_ids, e)
                nbytes = moe_bytes(d, m, k, h, i, 1, 2, fp8_block_scale_bytes(d, h, i))
                floor = floor_seconds(nbytes, moe_flops(m, k, h, i), ceilings, True) * 1e6
                run = functools.partial(
                    fused_experts, r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids,
                    activation=pr.activation, quant_config=ex.quant_config, backend="deep_gemm",
                )  # fmt: skip
                outs, times = {}, {True: [], False: []}
                for fused in (False, True):
                    with use_wgmma_act_fusion(fused):
                        outs[fused] = run()
                settle(run, dev)
                for _ in range(args.runs):
                    for fused in (False, True):
                        with use_wgmma_act_fusion(fused):
                            times[fused].append(time_ms(run, dev, rep_ms=args.rep_ms)[0] * 1e3)
                same = torch.equal(outs[True], outs[False])
                off, on = (sorted(times[f])[len(times[f]) // 2] for f in (False, True))
                line = (
                    f"{name:<16} {routing:<8} M={m:<6} h + act kernel {off:9.1f} us "
                    f"({100 * floor / off:4.1f}%)  fused {on:9.1f} us ({100 * floor / on:4.1f}%)"
                    f"  {on / off:.3f}x  bitwise {'same' if same else 'DIFFERENT'}"
                    f"  runs {[round(t, 1) for t in times[False]]} / "
                    f"{[round(t, 1) for t in times[True]]}"
                )
                print(line, flush=True)
                table.append(line)
        del ex
        torch.cuda.empty_cache()
    print("\n".join(["", "summary:", *table]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
