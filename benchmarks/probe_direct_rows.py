"""Direct rows (no alignment launch: each GEMM program finds its expert's slots) beyond one token.

    PYTHONPATH=. python3 benchmarks/probe_direct_rows.py [--presets ...] [--quants bf16,fp8_block]
        [--tokens 2,4,8,16] [--json rows.json]

The triton backend's expert computation (fused_experts, CUDA-graph replay) at small M, uniform
and skewed routing, with the bucket's config: with the alignment kernel (it sorts the slots by
expert first), and with direct rows for any M (fusedmoe.kernels.fused_moe.DIRECT_MAX_TOKENS),
where every GEMM program scans the S ids for the slots of its own slot's expert.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_backends import csv_list

from fusedmoe.functional import fused_experts
from fusedmoe.kernels import fused_moe
from fusedmoe.tools.bench.inputs import (
    make_expert_biases,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.bench.timing import rel_err, settle, time_ms
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import ceilings_for, distinct_experts, moe_floor

PRESET_NAMES = ["qwen3-30b-a3b", "gpt-oss-120b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", type=csv_list(str), default=PRESET_NAMES)
    p.add_argument("--quants", type=csv_list(str), default=["bf16", "fp8_block"])
    p.add_argument("--tokens", type=csv_list(int), default=[2, 4, 8, 16, 32])
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    ceilings = ceilings_for(torch.cuda.get_device_name())
    rows = []
    for name in args.presets:
        preset = PRESETS[name]
        e, k, h, i = preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size
        act = preset.activation
        w13, w2 = make_expert_weights(name, e, h, i, act, torch.bfloat16, dev)
        b13, b2 = make_expert_biases(name, w13, w2) if preset.has_bias else (None, None)
        for quant in args.quants:
            ex = quantize_expert_set(w13, w2, None if quant == "bf16" else quant, with_plain=False)
            for m in args.tokens:
                for routing in ("uniform", "skewed"):
                    r = make_routing(name, m, e, k, h, routing, torch.bfloat16, dev)
                    floor = moe_floor(
                        quant, num_distinct=distinct_experts(r.topk_ids, e), num_tokens=m,
                        top_k=k, hidden_size=h, intermediate_size=i, ceilings=ceilings,
                    ).seconds * 1e6  # fmt: skip
                    run = functools.partial(
                        fused_experts, r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids,
                        activation=act, quant_config=ex.quant_config, backend="triton",
                        w13_bias=b13, w2_bias=b2,
                    )  # fmt: skip
                    settle(run, dev)
                    saved = fused_moe.DIRECT_MAX_TOKENS
                    fused_moe.DIRECT_MAX_TOKENS = 0  # the alignment kernel at every M
                    try:
                        ref = run()
                        aligned = time_ms(run, dev, rep_ms=args.rep_ms)[0] * 1e3
                        fused_moe.DIRECT_MAX_TOKENS = 1 << 20  # direct rows at every M
                        err = rel_err(run(), ref)
                        direct = time_ms(run, dev, rep_ms=args.rep_ms)[0] * 1e3
                    finally:
                        fused_moe.DIRECT_MAX_TOKENS = saved
                    row = dict(preset=name, quant=quant, m=m, routing=routing, floor_us=floor,
                               aligned_us=aligned, direct_us=direct, err=err)  # fmt: skip
                    rows.append(row)
                    print(f"{name} {quant} M={m} {routing}: aligned {aligned:.1f} us "
                          f"({100 * floor / aligned:.0f}%), direct {direct:.1f} us "
                          f"({100 * floor / direct:.0f}%, {direct / aligned:.3f}x); "
                          f"diff {err:.1e}", flush=True)  # fmt: skip
            del ex
            torch.cuda.empty_cache()
        del w13, w2
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
