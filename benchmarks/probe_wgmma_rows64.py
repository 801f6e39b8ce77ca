"""The wgmma engine on runs of 64 rows (64 x 256 tiles, each warpgroup 128 of the columns)
against runs of 128 (128 x 128 tiles) and the triton backend, whole layer, on a Hopper GPU,
each forced at every M (deep_gemm itself takes runs of 64 below
WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT slots per expert).

    FUSEDMOE_DEEP_GEMM=0 PYTHONPATH=. python3 benchmarks/probe_wgmma_rows64.py
        [--presets ...] [--tokens 64,256,1024,4096] [--routing uniform,skewed]

A run of 64 rows pads an expert's slots to a multiple of 64, not 128: half the padding rows
where experts get few slots (small M, or the many cold experts of skewed routing). Each cell:
CUDA-graph medians of the three, and whether the two engines' outputs are the same bits (each
row's sums are formed alike in both tiles).
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
from probe_decode_tiles import fp8_block_experts, fp8_floor_us

from fusedmoe.experts import deep_gemm
from fusedmoe.experts.deep_gemm import DeepGemmExperts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.modular.kernel import FusedMoEModularKernel
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.modular.types import ActivationSpec, ExpertWeights
from fusedmoe.tools.bench.inputs import make_routing
from fusedmoe.tools.bench.timing import settle, time_ms
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import ceilings_for

SHIPPED_ROWS64_MAX = deep_gemm.WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT


class Rows64(DeepGemmExperts):
    """Runs of 64 rows at every M (the backend takes them below 64 slots per expert)."""

    alignment = 64


def runs_of_128_only(enabled: bool) -> None:
    """Whether deep_gemm keeps runs of 128 rows at every M (read by apply, before capture)."""
    deep_gemm.WGMMA_ROWS64_MAX_SLOTS_PER_EXPERT = 0 if enabled else SHIPPED_ROWS64_MAX


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--presets",
        type=csv_list(str),
        default=["gpt-oss-120b", "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b"],
    )
    p.add_argument("--tokens", type=csv_list(int), default=[64, 256, 1024, 4096])
    p.add_argument("--routing", type=csv_list(str), default=["uniform", "skewed"])
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    ceilings = ceilings_for(torch.cuda.get_device_name())
    contenders = {
        "triton": TritonExperts(),
        "wgmma128": DeepGemmExperts(strict=True, engine="wgmma"),
        "wgmma64": Rows64(strict=True, engine="wgmma"),
    }
    summary = []
    for name in args.presets:
        pr = PRESETS[name]
        e, k, h, i = pr.num_experts, pr.top_k, pr.hidden_size, pr.intermediate_size
        ex = fp8_block_experts(name, dev)
        weights = ExpertWeights(ex.w13, ex.w2, w13_bias=ex.w13_bias, w2_bias=ex.w2_bias)
        for routing in args.routing:
            for m in args.tokens:
                r = make_routing(name, m, e, k, h, routing, torch.bfloat16, dev)
                floor = fp8_floor_us(r.topk_ids, e, h, i, ceilings)
                outs, cells = {}, []
                for label, experts in contenders.items():
                    runs_of_128_only(label == "wgmma128")
                    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), experts)
                    run = functools.partial(
                        kernel.forward, r.x, weights, r.topk_weights, r.topk_ids,
                        activation=ActivationSpec.make(pr.activation), global_num_experts=e,
                        quant_config=ex.quant_config,
                    )  # fmt: skip
                    outs[label] = run()
                    settle(run, dev, rep_ms=50)
                    us = time_ms(run, dev, rep_ms=100)[0] * 1e3
                    cells.append(f"{label} {us:8.1f} us ({100 * floor / us:4.1f}%)")
                runs_of_128_only(False)
                same = torch.equal(outs["wgmma64"], outs["wgmma128"])
                line = f"{name:<16} {routing:<8} M={m:<5} " + "  ".join(cells)
                line += f"  64 vs 128 bits {'same' if same else 'DIFFER'}"
                print(line, flush=True)
                summary.append(line)
        del ex, weights
        torch.cuda.empty_cache()
    print("\n".join(["", "summary:", *summary]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
