"""The deep_gemm layer's error on the wgmma engine with the promotion (128-wide tiles, the
default) and with fast accumulation (256-wide tiles, FusedMoEQuantConfig.fast_accum), beside
the FP8 quantization's own error. On a Hopper GPU, without the DeepGEMM library:

    FUSEDMOE_DEEP_GEMM=0 PYTHONPATH=. python3 benchmarks/probe_fast_accum_precision.py \\
        [--presets mixtral-8x7b,...] [--tokens 1024,4096,16384]

Each tile is forced at every M (the backend takes the fast tiles only from 256 slots per
expert), so the columns compare the two kernels on the same inputs. Errors are max |a - e| /
max |e| and ||a - e|| / ||e|| against:
  exact  the torch backend on the same quantized weights and routing (float64 inside)
  bf16   the torch backend on the unquantized bf16 weights, in float32 (presets whose experts
         fit in float32 on the card; "nan" for deepseek-v3)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe.functional import fused_experts
from fusedmoe.kernels import deep_gemm_moe
from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
from fusedmoe.tools.presets import PRESETS

FLOAT32_REFERENCE_MAX_ELEMENTS = 3e9  # E * H * I: larger experts skip the bf16 reference


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    a, e = actual.double(), expected.double()
    return float((a - e).abs().max() / e.abs().max()), float((a - e).norm() / e.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="mixtral-8x7b,qwen3-235b-a22b,qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", default="1024,4096,16384")
    args = ap.parse_args()
    device = torch.device("cuda")
    real_gemm = deep_gemm_moe.wgmma_grouped_gemm

    def forced(block_n):  # the tile given here, whatever the backend asks for
        def gemm(*args, **kwargs):
            return real_gemm(*args, **{**kwargs, "block_n": block_n})

        return gemm

    print("preset M | exact vs bf16 | promote vs exact | fast vs exact | vs bf16: promote, fast")
    for name in args.presets.split(","):
        p = PRESETS[name]
        e, h, i = p.num_experts, p.hidden_size, p.intermediate_size
        w13, w2 = make_expert_weights(name, e, h, i, p.activation, torch.bfloat16, device)
        experts = quantize_expert_set(w13, w2, "fp8_block", with_plain=False)
        small = p.num_experts * p.hidden_size * p.intermediate_size < FLOAT32_REFERENCE_MAX_ELEMENTS
        for m in (int(t) for t in args.tokens.split(",")):
            r = make_routing(
                name, m, p.num_experts, p.top_k, p.hidden_size, "uniform", torch.bfloat16, device
            )
            routed = (r.topk_weights, r.topk_ids)
            bf16 = None
            if small:
                bf16 = fused_experts(
                    r.x.float(), w13.float(), w2.float(), *routed, backend="torch",
                    activation=p.activation,
                )  # fmt: skip
            qargs = (r.x, experts.w13, experts.w2, *routed)
            qc = experts.quant_config
            exact = fused_experts(*qargs, quant_config=qc, backend="torch", activation=p.activation)
            outs = {}
            for block_n in (128, 256):
                deep_gemm_moe.wgmma_grouped_gemm = forced(block_n)
                try:
                    outs[block_n] = fused_experts(
                        *qargs, quant_config=qc, backend="deep_gemm", activation=p.activation
                    )
                finally:
                    deep_gemm_moe.wgmma_grouped_gemm = real_gemm
            if torch.equal(outs[128], outs[256]):
                raise RuntimeError("both tiles gave the same output: the tile was not forced")
            nan = (float("nan"), float("nan"))
            cells = [
                errors(exact, bf16) if bf16 is not None else nan,
                errors(outs[128], exact),
                errors(outs[256], exact),
                errors(outs[128], bf16) if bf16 is not None else nan,
                errors(outs[256], bf16) if bf16 is not None else nan,
            ]
            print(name, m, "|", " | ".join(f"{a:.2e} {b:.2e}" for a, b in cells), flush=True)
            del bf16, exact, outs
        del w13, w2, experts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
