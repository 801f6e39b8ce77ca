r"""Kernel times of one fp8_block call on deep_gemm chosen by the oracle, with the choice on the
GPU off (FUSEDMOE_LOAD_CHOICE=0: the host's choice, one path) and on (without conditional graph
nodes: both paths launched, each gated by its flag): what the path not chosen costs.

    FUSEDMOE_DEEP_GEMM=0 PYTHONPATH=. python3 benchmarks/profile_gated_pair.py \
        gpt-oss-120b 2048 uniform

torch.profiler over 5 eager calls after 3 of warm-up; each kernel's device time per call.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_decode_tiles import fp8_block_experts

from fusedmoe.experts.deep_gemm import LOAD_CHOICE_ENV, DeepGemmExperts
from fusedmoe.modular.kernel import FusedMoEModularKernel
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.modular.types import ActivationSpec, ExpertWeights
from fusedmoe.tools.bench.inputs import make_routing
from fusedmoe.tools.presets import PRESETS

_CALLS = 5


def kernel_times(run) -> dict[str, tuple[int, float]]:
    """name -> (launches, device us) per call, over _CALLS calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(_CALLS):
            run()
        torch.cuda.synchronize()
    totals: dict[str, tuple[int, float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count, us = totals.get(event.name[:60], (0, 0.0))
            totals[event.name[:60]] = (count + 1, us + event.device_time)
    return {k: (c // _CALLS, us / _CALLS) for k, (c, us) in totals.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset")
    p.add_argument("tokens", type=int)
    p.add_argument("routing", help="uniform, skewed or skewed:<strength>")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    pr = PRESETS[args.preset]
    ex = fp8_block_experts(args.preset, dev)
    weights = ExpertWeights(ex.w13, ex.w2, w13_bias=ex.w13_bias, w2_bias=ex.w2_bias)
    r = make_routing(
        args.preset, args.tokens, pr.num_experts, pr.top_k, pr.hidden_size, args.routing,
        torch.bfloat16, dev,
    )  # fmt: skip
    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), DeepGemmExperts())
    run = functools.partial(
        kernel.forward, r.x, weights, r.topk_weights, r.topk_ids,
        activation=ActivationSpec.make(pr.activation), global_num_experts=pr.num_experts,
        quant_config=ex.quant_config,
    )  # fmt: skip
    for choice in ("0", "1"):
        os.environ[LOAD_CHOICE_ENV] = choice
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        times = kernel_times(run)
        print(f"== {args.preset} M={args.tokens} {args.routing} {LOAD_CHOICE_ENV}={choice}")
        for name, (count, us) in sorted(times.items(), key=lambda kv: -kv[1][1]):
            print(f"  {us:9.1f} us  x{count:<3d} {name}")
        print(f"  {sum(us for _, us in times.values()):9.1f} us  total")
    os.environ.pop(LOAD_CHOICE_ENV, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
