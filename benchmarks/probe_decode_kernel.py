"""The one-launch decode (fusedmoe.kernels.moe_decode) against the five-launch chain, at M = 1.

    PYTHONPATH=. python3 benchmarks/probe_decode_kernel.py [--presets qwen3-30b-a3b,...]
        [--quants bf16,fp8_block] [--sweep] [--json rows.json]

For each preset and scheme (uniform routing, one token, the preset's biases): the experts'
computation through fused_experts(backend="triton") under CUDA-graph replay with the chain
(use_decode_config(False)), with the one-launch decode's default config, and with --sweep a
grid of item widths, warps and stages. Prints us, % of the floor and the relative difference
to the chain's output (a different summation order: not zero).
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

from fusedmoe.functional import fused_experts
from fusedmoe.kernels.moe_decode import DecodeConfig, decode_config, use_decode_config
from fusedmoe.tools.bench.inputs import (
    make_expert_biases,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.bench.timing import rel_err, settle, time_ms
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import ceilings_for, distinct_experts, moe_floor


def sweep(default: DecodeConfig) -> list[DecodeConfig]:
    out = [
        DecodeConfig(n1, 128, n2, 128, warps, stages, per_sm)
        for (n1, n2), warps, stages, per_sm in itertools.product(
            ((16, 32), (16, 64), (16, 128), (32, 64), (32, 128)), (2, 4), (3, 4), (3, 4)
        )
    ]
    return [c for c in dict.fromkeys(out) if c != default]


def short(c: DecodeConfig) -> str:
    return f"n1 {c.block_n1} n2 {c.block_n2} w{c.num_warps} s{c.num_stages} x{c.programs_per_sm}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--presets",
        type=csv_list(str),
        default=["qwen3-30b-a3b", "gpt-oss-120b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b"],
    )
    p.add_argument("--quants", type=csv_list(str), default=["bf16", "fp8_block"])
    p.add_argument("--sweep", action="store_true")
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
        w13, w2 = make_expert_weights(name, e, h, i, act, torch.bfloat16, dev)
        b13, b2 = make_expert_biases(name, w13, w2) if preset.has_bias else (None, None)
        r = make_routing(name, 1, e, k, h, "uniform", torch.bfloat16, dev)
        for quant in args.quants:
            scheme = None if quant == "bf16" else quant
            ex = quantize_expert_set(w13, w2, scheme, with_plain=False)
            floor = moe_floor(
                quant, num_distinct=distinct_experts(r.topk_ids, e), num_tokens=1, top_k=k,
                hidden_size=h, intermediate_size=i, ceilings=ceilings,
            ).seconds * 1e6  # fmt: skip
            run = functools.partial(
                fused_experts, r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids, activation=act,
                quant_config=ex.quant_config, backend="triton", w13_bias=b13, w2_bias=b2,
            )  # fmt: skip
            with use_decode_config(False):
                chain_out = run()
                settle(run, dev)
                chain_us = time_ms(run, dev, rep_ms=args.rep_ms)[0] * 1e3
            default = decode_config(k, i, h, quant != "bf16")
            timed = {}
            for config in [default, *(sweep(default) if args.sweep else [])]:
                with use_decode_config(config):
                    try:
                        out = run()
                        err = rel_err(out, chain_out)
                        us = time_ms(run, dev, rep_ms=args.rep_ms)[0] * 1e3
                    except RuntimeError as exc:  # e.g. more programs than can be resident
                        print(f"{name} {quant} {short(config)}: {exc!s:.80}", flush=True)
                        continue
                timed[short(config)] = (us, err)
                tag = "default " if config == default else ""
                print(f"{name} {quant} {tag}{short(config)}: {us:.1f} us ({100 * floor / us:.0f}%)"
                      f" vs chain {chain_us:.1f} us ({100 * floor / chain_us:.0f}%), "
                      f"rel diff {err:.1e}", flush=True)  # fmt: skip
            best = min(timed, key=lambda c: timed[c][0])
            rows.append(dict(preset=name, quant=quant, floor_us=floor, chain_us=chain_us,
                             default=short(default), default_us=timed[short(default)][0],
                             best=best, best_us=timed[best][0], timed=timed))  # fmt: skip
            del ex
            torch.cuda.empty_cache()
        del w13, w2
        torch.cuda.empty_cache()
    print("\npreset, quant: chain -> one launch (default config) [best config] us, % of floor")
    for row in rows:
        f, chain, one = row["floor_us"], row["chain_us"], row["default_us"]
        best = f"[{row['best']}: {row['best_us']:.1f}]"
        print(
            f"{row['preset']} {row['quant']}: {chain:.1f} ({100 * f / chain:.0f}%) -> "
            f"{one:.1f} ({100 * f / one:.0f}%) {best}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
