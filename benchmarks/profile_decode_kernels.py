"""Where decode time goes: the whole layer's CUDA-graph time beside its kernels' device times.

    PYTHONPATH=. python3 benchmarks/profile_decode_kernels.py [--json rows.json]

For qwen3-30b-a3b, gpt-oss-120b and qwen3-235b-a22b at M = 1 and 8, uniform routing: the
triton backend in fp8_block and bf16, and the hpc backend in fp8_block where it runs the
activation. graph_us is the median of CUDA-graph replays of one `fused_experts` call, as
`fusedmoe bench` times it (tools.bench.timing); kernels the mean device time of one launch of
each kernel name over 20 eager calls (torch.profiler). _moe_gemm_kernel launches twice per call
(GEMM1 and GEMM2), so its figure is the mean of the two; kernels_per_call_us counts it twice.
The gap between the two totals is what the launches themselves cost inside the graph.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe.functional import fused_experts
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import time_ms
from fusedmoe.tools.presets import PRESETS

PRESET_NAMES = ("qwen3-30b-a3b", "gpt-oss-120b", "qwen3-235b-a22b")
GEMM = "_moe_gemm_kernel"  # launched twice per call


def _kernel_us(fn, calls: int = 20) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(event.name[:60], []).append(event.device_time)
    return {name: sum(v) / len(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    for preset in PRESET_NAMES:
        p = PRESETS[preset]
        e, k, h, i, act = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size, p.activation
        w13, w2 = make_expert_weights(preset, e, h, i, act, torch.bfloat16, dev)
        sets = {
            "fp8_block": quantize_expert_set(w13, w2, "fp8_block", with_plain=False),
            "bf16": quantize_expert_set(w13, w2, None, with_plain=False),
        }
        del w13, w2
        for m in (1, 8):
            r = make_routing(preset, m, e, k, h, "uniform", torch.bfloat16, dev)
            for quant, backend in (("fp8_block", "triton"), ("bf16", "triton"),
                                   ("fp8_block", "hpc")):  # fmt: skip
                ex = sets[quant]
                fn = functools.partial(
                    fused_experts, r.x, ex.w13, ex.w2, r.topk_weights, r.topk_ids,
                    activation=act, quant_config=ex.quant_config, backend=backend,
                )  # fmt: skip
                try:
                    graph = time_ms(fn, dev, rep_ms=50.0)[0] * 1000
                except ValueError as exc:  # a backend that cannot run the call
                    print(f"{preset} M={m} {quant} {backend}: {exc}")
                    continue
                kernels = _kernel_us(fn)
                per_call = sum(v * (2 if n.startswith(GEMM) else 1) for n, v in kernels.items())
                rows.append(dict(preset=preset, m=m, quant=quant, backend=backend,
                                 graph_us=graph, kernels_per_call_us=per_call,
                                 kernels=kernels))  # fmt: skip
                print(f"{preset} M={m} {quant} {backend}: graph {graph:.1f} us, kernels "
                      f"{per_call:.1f} us: " + ", ".join(f"{n[:32]} {v:.1f}"
                                                         for n, v in kernels.items()))  # fmt: skip
        del sets
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
