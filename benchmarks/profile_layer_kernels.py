"""Where a layer call's time goes, kernel by kernel, for each backend.

    FUSEDMOE_DEEP_GEMM=0 PYTHONPATH=. python3 benchmarks/profile_layer_kernels.py
        [--presets deepseek-v3,...] [--tokens 256,1024] [--routing skewed]
        [--backends deep_gemm,triton] [--quant fp8_block] [--json rows.json]

For each preset, M, routing and backend: the call's CUDA-graph median (as `fusedmoe bench`
times it) and the mean device time of each kernel launch in the order the call makes them
(torch.profiler over 20 eager calls; a kernel launched twice per call, such as the GEMM,
appears twice), and the rows each touched expert receives.
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
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import time_ms
from fusedmoe.tools.presets import PRESETS


def kernels_in_order(fn, calls: int = 20) -> list[tuple[str, float]]:
    """[(kernel name, mean device us)] of one fn() call's launches, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    per_call = len(events) // calls
    return [
        (events[j].name, sum(events[c * per_call + j].device_time for c in range(calls)) / calls)
        for j in range(per_call)
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", type=csv_list(str), default=["deepseek-v3", "gpt-oss-120b"])
    p.add_argument("--tokens", type=csv_list(int), default=[256, 1024])
    p.add_argument("--routing", type=csv_list(str), default=["skewed"])
    p.add_argument("--backends", type=csv_list(str), default=["deep_gemm", "triton"])
    p.add_argument("--quant", default="fp8_block")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for name in args.presets:
        pr = PRESETS[name]
        e, k, h, i = pr.num_experts, pr.top_k, pr.hidden_size, pr.intermediate_size
        w13, w2 = make_expert_weights(name, e, h, i, pr.activation, torch.bfloat16, dev)
        scheme = None if args.quant == "bf16" else args.quant
        ex = quantize_expert_set(w13, w2, scheme, with_plain=False)
        del w13, w2
        torch.cuda.empty_cache()
        for routing in args.routing:
            for m in args.tokens:
                r = make_routing(name, m, e, k, h, routing, torch.bfloat16, dev)
                counts = torch.bincount(r.topk_ids.flatten(), minlength=e)
                touched = counts[counts > 0].sort(descending=True).values.tolist()
                print(f"{name} {routing} M={m}: rows of the {len(touched)} experts touched "
                      f"{touched}", flush=True)  # fmt: skip
                for backend in args.backends:
                    run = functools.partial(
                        fused_experts, r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids,
                        activation=pr.activation, quant_config=ex.quant_config, backend=backend,
                    )  # fmt: skip
                    graph_us = time_ms(run, dev)[0] * 1e3
                    kernels = kernels_in_order(run)
                    print(f"  {backend}: graph {graph_us:.1f} us | " + ", ".join(
                        f"{n[:24]} {us:.1f}" for n, us in kernels), flush=True)  # fmt: skip
                    rows.append(dict(preset=name, routing=routing, m=m, backend=backend,
                                     quant=args.quant, graph_us=graph_us, kernels=kernels,
                                     rows_per_expert=touched))  # fmt: skip
        del ex
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
