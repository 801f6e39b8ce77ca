"""Hot tiles (MoEKernelConfig.hot_m) on the shipped configs, under uniform and skewed routing, on
a GPU.

    PYTHONPATH=. python3 benchmarks/probe_hot_tiles.py [--dtype bf16,fp8_block]
        [--preset deepseek-v3,...] [--tokens 64,256,1024] [--json rows.json]

For each preset, dtype and M: the bucket's config as the tables give it (hot_m 0, or the
table's), then the same config with each hot_m in 2, 4 and 8 x block_m (up to 128 rows; 256
from 64-row blocks), timed under `fusedmoe bench`'s uniform and skewed routing
(tools.bench.inputs). The bucket's own config is timed first and last (run-to-run drift).
Times are medians of CUDA-graph replays, in us. A config that fails to compile (shared memory,
registers) is recorded with its error. Rows are written as they come (--json).
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

from fusedmoe.activation import MoEActivation
from fusedmoe.functional import fused_experts
from fusedmoe.kernels.moe_config import MAX_HOT_M, moe_kernel_config, use_moe_kernel_config
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.presets import PRESETS

SCHEMES = {"bf16": None, "fp8_block": "fp8_block"}  # the weights' quantization
CONFIG_KEYS = {"bf16": "bfloat16", "fp8_block": "fp8_block"}  # the tuned tables' dtype


def _call(r, ex, act, config):
    with use_moe_kernel_config(config):
        return fused_experts(
            r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids, activation=act,
            quant_config=ex.quant_config, backend="triton",
        )  # fmt: skip


def _time_us(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1000


def hot_candidates(block_m: int) -> list[int]:
    tallest = 128 if block_m < 64 else MAX_HOT_M
    return [f * block_m for f in (2, 4, 8) if f * block_m <= tallest]


def probe(preset: str, dtype: str, tokens: list[int], sink) -> None:
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    p = PRESETS[preset]
    e, k, h, i, act = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size, p.activation
    n = MoEActivation.parse(act).gemm1_out_size(i)
    w13, w2 = make_expert_weights(preset, e, h, i, act, torch.bfloat16, dev)
    ex = quantize_expert_set(w13, w2, SCHEMES[dtype], with_plain=False)
    del w13, w2
    for m in tokens:
        bucket = moe_kernel_config(m, k, e, n, h, i, CONFIG_KEYS[dtype], name)
        routings = {
            kind: make_routing(preset, m, e, k, h, kind, torch.bfloat16, dev)
            for kind in ("uniform", "skewed")
        }
        hots = [bucket.hot_m] + [v for v in hot_candidates(bucket.block_m) if v != bucket.hot_m]
        for hot in [*hots, bucket.hot_m]:  # the bucket's own config again, last
            config = dataclasses.replace(bucket, hot_m=hot)
            row = dict(preset=preset, dtype=dtype, tokens=m, block_m=bucket.block_m, hot_m=hot,
                       table_hot_m=bucket.hot_m, config=config.to_json())  # fmt: skip
            for kind, r in routings.items():
                try:
                    row[f"{kind}_us"] = _time_us(functools.partial(_call, r, ex, act, config))
                except Exception as exc:  # recorded: resources, compile errors
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    break
            sink(row)
    del ex
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16,fp8_block")
    parser.add_argument("--preset", default=",".join(PRESETS))
    parser.add_argument("--tokens", default="64,256,1024")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []

    def sink(row):
        rows.append(row)
        times = " ".join(f"{kind} {row[kind + '_us']:.1f}" for kind in ("uniform", "skewed")
                         if kind + "_us" in row)  # fmt: skip
        print(f"{row['dtype']} {row['preset']} M={row['tokens']} BM{row['block_m']} "
              f"hot {row['hot_m']}: {times} {row.get('error', '')}", flush=True)  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")

    for dtype in args.dtype.split(","):
        for preset in args.preset.split(","):
            probe(preset, dtype, [int(t) for t in args.tokens.split(",")], sink)


if __name__ == "__main__":
    main()
