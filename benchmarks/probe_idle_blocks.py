"""What the triton backend's GEMM launches spend on row blocks that turn out empty (issue 19).

The grid of each expert GEMM is sized on the host for the most row blocks any routing can need
(S + E_l * (block_m - 1) rows): the aligned layout's real count is known only on the device,
and every program past it returns at once. Under skewed routing most row blocks are empty. This
probe times each call as shipped, then with the grids trimmed to the row blocks in use (read on
the host before timing: an upper bound on what a launch that spent nothing on empty blocks
would gain). On a GPU:

    PYTHONPATH=. python3 benchmarks/probe_idle_blocks.py [--presets ...] [--quant fp8_block,bf16]
        [--tokens 8,64,256,1024]

Times are CUDA-graph medians of the expert computation after prepare (the recorded arguments
of one fused_experts call), us.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.probe_dual_config import record_args
from fusedmoe.kernels import fused_moe as fm
from fusedmoe.tools.bench.inputs import (
    make_expert_biases,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.presets import PRESETS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--quant", default="fp8_block,bf16")
    ap.add_argument("--tokens", default="8,64,256,1024")
    args = ap.parse_args()
    device = torch.device("cuda")
    real_rows = fm.gemm_rows
    print("preset quant routing M | block_m, row blocks used / launched | shipped us | trimmed us")
    for name in args.presets.split(","):
        p = PRESETS[name]
        e, h, i = p.num_experts, p.hidden_size, p.intermediate_size
        w13, w2 = make_expert_weights(name, e, h, i, p.activation, torch.bfloat16, device)
        for quant in args.quant.split(","):
            experts = quantize_expert_set(w13, w2, None if quant == "bf16" else quant,
                                          with_plain=False)  # fmt: skip
            if p.has_bias:
                experts.w13_bias, experts.w2_bias = make_expert_biases(name, w13, w2)
            for m in (int(t) for t in args.tokens.split(",")):
                for kind in ("uniform", "skewed"):
                    r = make_routing(
                        name, m, p.num_experts, p.top_k, p.hidden_size, kind, torch.bfloat16,
                        device,
                    )  # fmt: skip
                    call = record_args(experts, r, p.activation)
                    used = {}

                    def trimmed(topk_ids, expert_map, block_m, num_local, used=used):
                        rows = real_rows(topk_ids, expert_map, block_m, num_local)
                        if rows.routing is None:
                            return rows
                        if block_m not in used:  # the first (untimed) call reads the count
                            post = int(rows.routing.num_tokens_post_padded.item())
                            used[block_m] = (max(1, post // block_m), rows.num_blocks)
                        return dataclasses.replace(rows, num_blocks=used[block_m][0])

                    shipped = triton.testing.do_bench_cudagraph(
                        lambda c=call: fm._fused_experts_triton_impl(*c), rep=100
                    )
                    fm.gemm_rows = trimmed
                    try:
                        fm._fused_experts_triton_impl(*call)
                        cut = triton.testing.do_bench_cudagraph(
                            lambda c=call: fm._fused_experts_triton_impl(*c), rep=100
                        )
                    finally:
                        fm.gemm_rows = real_rows
                    blocks = ", ".join(f"{b}: {u} / {n}" for b, (u, n) in used.items()) or "direct"
                    print(
                        f"{name} {quant} {kind} {m} | {blocks} | {shipped * 1e3:.1f} | "
                        f"{cut * 1e3:.1f} ({(cut / shipped - 1) * 100:+.1f}%)",
                        flush=True,
                    )
            del experts
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
