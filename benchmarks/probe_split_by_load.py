"""Would a schedule that follows the per-expert load help skewed routing? A two-launch emulation,
on a GPU.

    PYTHONPATH=. python3 benchmarks/probe_split_by_load.py [--dtype bf16,fp8_block]
        [--preset deepseek-v3,...] [--tokens 64,256,1024] [--json rows.json]

For each preset and M, under the skewed routing of `fusedmoe bench` (tools.bench.inputs):

    base     the triton backend with the bucket's config (one call)
    heavy    the experts holding >= T slots alone (an expert_map sends the others to -1), with
             the config of a prefill bucket (4096 or 16384 tokens): tall tiles
    light    the other experts alone, with the bucket's config
    both     heavy then light in one CUDA graph: what a split of the grid by load into two
             launches, each with its own tiles, would cost (less one alignment and one top-k sum)

T in {32, 64, 128}. Times are medians of CUDA-graph replays, in us; floor_us is
tools.roofline.moe_floor with the named ceilings of the GPU (not the measured ones
`fusedmoe bench` uses, so its percentages run lower).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe.activation import MoEActivation
from fusedmoe.functional import fused_experts
from fusedmoe.kernels.moe_config import moe_kernel_config, use_moe_kernel_config
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import ceilings_for, moe_floor

SCHEMES = {"bf16": None, "fp8_block": "fp8_block"}  # the weights' quantization
CONFIG_KEYS = {"bf16": "bfloat16", "fp8_block": "fp8_block"}  # the tuned tables' dtype


def _call(r, ex, act, config, expert_map=None):
    with use_moe_kernel_config(config):
        return fused_experts(
            r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids, activation=act,
            quant_config=ex.quant_config, backend="triton", expert_map=expert_map,
        )  # fmt: skip


def _time_us(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1000


def _both(call, tall, heavy_map, bucket, light_map):
    return lambda: (call(tall, heavy_map), call(bucket, light_map))


def probe(preset: str, dtype: str, tokens: list[int]) -> list[dict]:
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    scheme, key = SCHEMES[dtype], CONFIG_KEYS[dtype]
    p = PRESETS[preset]
    e, k, h, i, act = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size, p.activation
    activation = MoEActivation.parse(act)
    w13, w2 = make_expert_weights(preset, e, h, i, act, torch.bfloat16, dev)
    ex = quantize_expert_set(w13, w2, scheme, with_plain=False)
    del w13, w2
    n = activation.gemm1_out_size(i)
    rows = []
    for m in tokens:
        r = make_routing(preset, m, e, k, h, "skewed", torch.bfloat16, dev)
        counts = torch.bincount(r.topk_ids.flatten().long(), minlength=e)
        distinct = int((counts > 0).sum())
        floor = moe_floor(
            dtype, num_distinct=distinct, num_tokens=m, top_k=k, hidden_size=h,
            intermediate_size=i, ceilings=ceilings_for(name), gated=activation.is_gated,
        ).seconds * 1e6  # fmt: skip
        bucket = moe_kernel_config(m, k, e, n, h, i, key, name)

        call = functools.partial(_call, r, ex, act)
        base = _time_us(functools.partial(call, bucket))
        top = sorted(counts.tolist(), reverse=True)[:6]
        print(
            f"{dtype} {preset} M={m} D={distinct} floor {floor:.1f} us, base {base:.1f} us "
            f"({100 * floor / base:.0f}% of the floor), slots of the top experts {top}"
        )
        ids = torch.arange(e, device=dev, dtype=torch.int32)
        for threshold in (32, 64, 128):
            heavy = counts >= threshold
            if not heavy.any() or heavy.all():
                continue
            heavy_map = torch.where(heavy, ids, -1).to(torch.int32)
            light_map = torch.where(heavy, -1, ids).to(torch.int32)
            for prefill in (4096, 16384):
                tall = moe_kernel_config(prefill, k, e, n, h, i, key, name)
                row = dict(
                    preset=preset, dtype=dtype, tokens=m, distinct=distinct, floor_us=floor,
                    base_us=base, threshold=threshold, prefill_bucket=prefill,
                    heavy_experts=int(heavy.sum()),
                    heavy_us=_time_us(functools.partial(call, tall, heavy_map)),
                    heavy_bucket_config_us=_time_us(functools.partial(call, bucket, heavy_map)),
                    light_us=_time_us(functools.partial(call, bucket, light_map)),
                    both_us=_time_us(_both(call, tall, heavy_map, bucket, light_map)),
                )  # fmt: skip
                rows.append(row)
                print(
                    f"  T={threshold} heavy experts {row['heavy_experts']} (tiles of M={prefill}):"
                    f" heavy {row['heavy_us']:.1f} light {row['light_us']:.1f}"
                    f" both {row['both_us']:.1f} ({100 * floor / row['both_us']:.0f}% of the floor)"
                    f" vs base {base:.1f}",
                    flush=True,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16,fp8_block")
    parser.add_argument("--preset", default=",".join(PRESETS))
    parser.add_argument("--tokens", default="64,256,1024")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for dtype in args.dtype.split(","):
        for preset in args.preset.split(","):
            rows += probe(preset, dtype, tokens)
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
