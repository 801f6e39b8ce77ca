"""Where the deep_gemm layer's time goes on each GEMM engine: the whole layer, then each grouped
GEMM call the layer made, replayed alone on the layer's own tensors (the bench's weights and
routing), CUDA-graph medians. On a GPU:

    FUSEDMOE_DEEP_GEMM=0 PYTHONPATH=. python3 benchmarks/probe_wgmma_layer.py
        [--presets deepseek-v3,mixtral-8x7b] [--tokens 16384] [--engines triton,wgmma]
        [--json out.json]

A GEMM that is fast alone but slow inside the layer points at the context (clocks, what the
other kernels leave in L2); one that is slow alone on these tensors but fast on the probe's
random ones (probe_wgmma_gemm.py) points at the data.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe import fused_experts
from fusedmoe.experts.deep_gemm import DeepGemmExperts
from fusedmoe.kernels import deep_gemm_moe
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.bench.timing import time_ms
from fusedmoe.tools.presets import PRESETS

# the function each engine's layer calls once per grouped GEMM
_GEMM_FN = {"triton": "_grouped_gemm", "wgmma": "wgmma_grouped_gemm"}


def _engine_backend(engine):
    class Engine(DeepGemmExperts):
        @classmethod
        def create(cls, *, requested: bool = False):
            return DeepGemmExperts(strict=requested, engine=engine)

    return Engine


def _record_gemms(engine, run):
    """Run the layer once with the engine's GEMM function wrapped: [(args, kwargs)] of each."""
    name = _GEMM_FN[engine]
    real = getattr(deep_gemm_moe, name)
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    setattr(deep_gemm_moe, name, spy)
    try:
        run()
        torch.cuda.synchronize()
    finally:
        setattr(deep_gemm_moe, name, real)
    return [functools.partial(real, *a, **k) for a, k in calls]


def _swap_probe(gemms, device):
    """GEMM1 of the wgmma layer on its own tensors, then with A, then w, replaced by random FP8
    (the probe's data), each timed on both engines' GEMMs: {variant: {engine: us}}."""
    from fusedmoe.kernels.fused_moe import TL_DTYPE
    from fusedmoe.quant.formats import FP8_DTYPE

    call = gemms[0]
    a, a_scale, w, w_scale, out, expert_ids, num_rows, alignment = call.args
    m_sum = a.shape[0]
    m_indices = torch.full((m_sum,), -1, dtype=torch.int32, device=device)
    blocks = expert_ids.repeat_interleave(alignment)[:m_sum]
    m_indices.copy_(torch.where(torch.arange(m_sum, device=device) < num_rows, blocks, -1))
    layout = deep_gemm_moe.ContiguousLayout(
        a, a_scale, m_indices, None, expert_ids, num_rows, alignment
    )

    def timed(a_, w_, a_s=a_scale, w_s=w_scale):
        def triton_gemm():
            deep_gemm_moe._grouped_gemm(
                a_, a_s, deep_gemm_moe._A_MODE["fp8_block"], w_, w_s,
                deep_gemm_moe._W_MODE["fp8_block"], out, layout, w_fp4=False,
                h_dtype=TL_DTYPE[out.dtype],
            )  # fmt: skip

        engines = {
            "wgmma": lambda: deep_gemm_moe.wgmma_grouped_gemm(
                a_, a_s, w_, w_s, out, expert_ids, num_rows, alignment
            ),
            "triton": triton_gemm,
        }
        return {name: time_ms(fn, device, rep_ms=200)[0] * 1e3 for name, fn in engines.items()}

    def rand_like(t):
        return (torch.randn(t.shape, device=device, dtype=torch.bfloat16) * 2).to(FP8_DTYPE)

    result = {"layer data": timed(a, w)}
    result["random A"] = timed(rand_like(a), w)
    result["random w"] = timed(a, rand_like(w))
    fresh_a_s = torch.rand(a_scale.shape[1], m_sum, device=device).t() * 0.02 + 0.001
    fresh_w_s = torch.rand(w_scale.shape, device=device) * 0.02 + 0.001
    result["random scales"] = timed(a, w, fresh_a_s, fresh_w_s)
    result["scale layouts"] = {
        "a_scale": (tuple(a_scale.shape), a_scale.stride(), a_scale.data_ptr() % 128),
        "w_scale": (tuple(w_scale.shape), w_scale.stride(), str(w_scale.dtype)),
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="deepseek-v3,mixtral-8x7b")
    ap.add_argument("--tokens", default="16384")
    ap.add_argument("--engines", default="triton,wgmma")
    ap.add_argument("--json", default=None)
    ap.add_argument("--swap", action="store_true", help="GEMM1 with random A / w (wgmma only)")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for preset_name in args.presets.split(","):
        p = PRESETS[preset_name]
        e, k, h, i = p.num_experts, p.top_k, p.hidden_size, p.intermediate_size
        w13, w2 = make_expert_weights(p.name, e, h, i, p.activation, torch.bfloat16, device)
        experts = quantize_expert_set(w13, w2, "fp8_block", with_plain=False)
        del w13, w2
        torch.cuda.empty_cache()
        for m in (int(t) for t in args.tokens.split(",")):
            inputs = make_routing(p.name, m, e, k, h, "uniform", torch.bfloat16, device)
            for engine in args.engines.split(","):
                run = functools.partial(
                    fused_experts, inputs.x, experts.w13, experts.w2, inputs.topk_weights,
                    inputs.topk_ids, activation=p.activation, quant_config=experts.quant_config,
                    backend=_engine_backend(engine),
                )  # fmt: skip
                layer_us = time_ms(run, device, rep_ms=200)[0] * 1e3
                gemms = _record_gemms(engine, run)
                gemm_us = [time_ms(g, device, rep_ms=200)[0] * 1e3 for g in gemms]
                row = dict(preset=preset_name, tokens=m, engine=engine, layer_us=layer_us,
                           gemm_us=gemm_us, rest_us=layer_us - sum(gemm_us))  # fmt: skip
                if args.swap and engine == "wgmma":
                    row["swap"] = _swap_probe(gemms, device)
                    print(row["swap"], flush=True)
                rows.append(row)
                print(
                    f"{preset_name:16s} {m:6d} {engine:7s} layer {layer_us:9.1f} us  gemms "
                    + " + ".join(f"{g:.1f}" for g in gemm_us)
                    + f"  rest {row['rest_us']:.1f}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
