"""The triton backend against deep_gemm's wgmma engine under routings of growing skew, with
the statistics of each routing that a choice made on the device could read (fp8_block, one
Hopper GPU, whole layer, CUDA-graph medians).

    FUSEDMOE_DEEP_GEMM=0 PYTHONPATH=. python3 benchmarks/probe_engine_by_load.py
        [--presets ...] [--tokens 128,256,512,1024,2048] [--strengths 0,1,2,3,4]

Each line: the routing's slots S = M * k, the experts it touches, the share of the slots
held by experts with >= 64 / 128 / 256 slots, then both backends' times and their ratio
(wgmma / triton). --auto adds the oracle's own choice (deep_gemm, not by name): "auto" with
the choice made on the GPU from the ids (ENGINE_MIN_SLOTS_PER_TOUCHED_EXPERT, inside the CUDA
graph the timing captures), "auto_host" with it off (FUSEDMOE_LOAD_CHOICE=0: the mean), and
which backend's output auto's matches bit for bit. On a torch without conditional graph nodes
(< 2.12) --auto installs benchmarks/cond_node_shim.py, so that the choice branches through
them; with --no-shim it does not, and both paths run, each gated by its flag. Only calls
below WGMMA_MIN_SLOTS_PER_EXPERT slots per expert on the mean are of interest: above it the
oracle already takes the engine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_backends import csv_list
from probe_decode_tiles import fp8_block_experts

from fusedmoe.experts.deep_gemm import LOAD_CHOICE_ENV, DeepGemmExperts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.modular.kernel import FusedMoEModularKernel
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
from fusedmoe.modular.types import ActivationSpec, ExpertWeights
from fusedmoe.tools.bench.inputs import make_routing
from fusedmoe.tools.bench.timing import settle, time_ms
from fusedmoe.tools.presets import PRESETS


def load_stats(topk_ids: torch.Tensor, num_experts: int) -> dict:
    counts = torch.bincount(topk_ids.flatten().long(), minlength=num_experts).cpu()
    slots = int(counts.sum())
    share = {t: float(counts[counts >= t].sum()) / slots for t in (64, 128, 256)}
    return {
        "slots": slots,
        "touched": int((counts > 0).sum()),
        "max": int(counts.max()),
        **{f"share{t}": round(v, 3) for t, v in share.items()},
    }


def graph_output(run) -> torch.Tensor:
    """run's output from one replay of a CUDA graph capturing it (where auto chooses on the
    GPU: through conditional nodes where the graph can hold them, else both paths gated)."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--presets",
        type=csv_list(str),
        default=["gpt-oss-120b", "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b"],
    )
    p.add_argument("--tokens", type=csv_list(int), default=[128, 256, 512, 1024, 2048])
    p.add_argument("--strengths", type=csv_list(float), default=[0.0, 1.0, 2.0, 3.0, 4.0])
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--auto", action="store_true", help="time the oracle's choice too")
    p.add_argument(
        "--no-shim", action="store_true",
        help="with --auto on a torch < 2.12: no conditional nodes (both paths run, gated)",
    )  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    contenders = {"triton": TritonExperts(), "wgmma": DeepGemmExperts(strict=True, engine="wgmma")}
    if args.auto:
        contenders.update(auto=DeepGemmExperts(), auto_host=DeepGemmExperts())
        if not args.no_shim and not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
            import cond_node_shim

            cond_node_shim.install()
            print(cond_node_shim.self_test(), flush=True)
    rows = []
    for name in args.presets:
        pr = PRESETS[name]
        e, k, h = pr.num_experts, pr.top_k, pr.hidden_size
        ex = fp8_block_experts(name, dev)
        weights = ExpertWeights(ex.w13, ex.w2, w13_bias=ex.w13_bias, w2_bias=ex.w2_bias)
        for m in args.tokens:
            if m * k / e >= 128:
                continue
            for s in args.strengths:
                routing = "uniform" if s == 0 else f"skewed:{s:g}"
                r = make_routing(name, m, e, k, h, routing, torch.bfloat16, dev)
                row = {"preset": name, "M": m, "routing": routing, **load_stats(r.topk_ids, e)}
                outs = {}
                for label, experts in contenders.items():
                    os.environ[LOAD_CHOICE_ENV] = "0" if label == "auto_host" else "1"
                    kernel = FusedMoEModularKernel(NoEPPrepareFinalize(), experts)
                    run = functools.partial(
                        kernel.forward, r.x, weights, r.topk_weights, r.topk_ids,
                        activation=ActivationSpec.make(pr.activation), global_num_experts=e,
                        quant_config=ex.quant_config,
                    )  # fmt: skip
                    settle(run, dev, rep_ms=10)
                    ms, how = time_ms(run, dev, rep_ms=args.rep_ms)
                    row[label] = round(ms * 1e3, 1)
                    if how != "graph":  # a capture that failed: timed eagerly, say so
                        row[f"{label}_timed_by"] = how
                    if label == "auto":  # auto chooses on the GPU only inside a graph
                        outs[label] = graph_output(run)
                    else:
                        outs[label] = run()
                os.environ.pop(LOAD_CHOICE_ENV, None)
                row["ratio"] = round(row["wgmma"] / row["triton"], 3)
                if args.auto:
                    same = [b for b in ("triton", "wgmma") if torch.equal(outs["auto"], outs[b])]
                    row["auto_is"] = same[0] if same else "neither"
                rows.append(row)
                print(json.dumps(row), flush=True)
        del ex, weights
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
