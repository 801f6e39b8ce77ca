"""GEMM2 with the top-k sum in it (MoEKernelConfig.gemm2_sum) against GEMM2 then moe_sum, at
M = 1 (the calls without alignment): the triton backend's whole layer, CUDA-graph medians, each
bucket's shipped config as is and with gemm2_sum tiles from a small grid, and whether the
outputs are bit for bit the same.

    PYTHONPATH=. python3 benchmarks/probe_gemm2_sum.py [--presets ...] [--quant bf16,fp8_block]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe import fused_experts
from fusedmoe.kernels.fused_moe import device_name
from fusedmoe.kernels.moe_config import GemmConfig, moe_kernel_config, use_moe_kernel_config
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import time_ms
from fusedmoe.tools.presets import PRESETS

DTYPE_KEY = {"bf16": "bfloat16", "fp8_block": "fp8_block"}


def _tiles(quant: str):
    block_ks = (128,) if quant == "fp8_block" else (64, 128)
    for bn, bk, warps, stages in itertools.product((16, 32, 64), block_ks, (4, 8), (2, 3, 4, 6)):
        yield GemmConfig(bn, bk, 1, warps, stages)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--quant", default="bf16,fp8_block")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    print(f"# {torch.cuda.get_device_name()}", flush=True)
    for name in args.presets.split(","):
        p = PRESETS[name]
        w13, w2 = make_expert_weights(
            p.name, p.num_experts, p.hidden_size, p.intermediate_size, p.activation,
            torch.bfloat16, device,
        )  # fmt: skip
        for quant in args.quant.split(","):
            if quant == "bf16":
                a, b, qc = w13, w2, None
            else:
                experts = quantize_expert_set(w13, w2, quant, with_plain=False)
                a, b, qc = experts.w13, experts.w2, experts.quant_config
            r = make_routing(
                p.name, args.tokens, p.num_experts, p.top_k, p.hidden_size, "uniform",
                torch.bfloat16, device,
            )  # fmt: skip
            run = functools.partial(
                fused_experts, r.x, a, b, r.topk_weights, r.topk_ids,
                activation=p.activation, quant_config=qc, backend="triton",
            )  # fmt: skip
            base = moe_kernel_config(
                args.tokens, p.top_k, p.num_experts, w13.shape[1], p.hidden_size,
                p.intermediate_size, DTYPE_KEY[quant], device_name(r.x),
            )  # fmt: skip
            base = dataclasses.replace(base, gemm2_sum=None)

            def timed(config, run=run):
                with use_moe_kernel_config(config):
                    out = run()
                    return time_ms(run, device, rep_ms=40)[0] * 1e3, out

            t0, ref = timed(base)
            results = []
            for tile in _tiles(quant):
                try:
                    t, out = timed(dataclasses.replace(base, gemm2_sum=tile))
                except Exception as exc:  # too much shared memory for this tile
                    print(f"  {tile}: {type(exc).__name__}", flush=True)
                    continue
                err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
                results.append((t, tile, torch.equal(out, ref), err))
            t1, _ = timed(base)
            best_t, best_tile, _, _ = min(results, key=lambda x: x[0])
            same = all(r[2] for r in results)
            worst = max(r[3] for r in results)
            print(
                f"{name:<16}{quant:<10} base {t0:8.1f} / {t1:8.1f} us   best sum {best_t:8.1f} us"
                f" ({best_t / min(t0, t1):.3f})  bn={best_tile.block_n} bk={best_tile.block_k}"
                f" w={best_tile.num_warps} s={best_tile.num_stages}  same={same} err={worst:.1e}",
                flush=True,
            )  # fmt: skip
            rows.append(dict(
                preset=name, quant=quant, tokens=args.tokens, base_us=[t0, t1], same=same,
                sum_us={f"{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}": t
                        for t, c, _, _ in results},
            ))  # fmt: skip
            a = b = qc = experts = None
        del w13, w2
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
