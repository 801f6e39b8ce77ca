"""The Gluon (wgmma, warp-specialized) grouped GEMM against the Triton grouped GEMM and, where
importable, the DeepGEMM library, on the contiguous expert-aligned layout: GEMM alone, both
GEMMs of each preset, uniform routing; checked against a float32 torch reference on sampled
rows. On a GPU:

    PYTHONPATH=.:.vendor python3 benchmarks/probe_wgmma_gemm.py [--presets deepseek-v3,...]
        [--tokens 4096,16384] [--dtypes fp8_block,bf16] [--configs 128x4,256x3]
        [--no-others] [--graph] [--json out.json]

--configs: block_n x stages of the wgmma GEMM, one contender each.

TFLOP/s counts the routed rows only (2 * M * k * N * K), not the alignment padding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe.kernels import deep_gemm_moe as dg
from fusedmoe.kernels.deep_gemm_lib import find_library
from fusedmoe.kernels.fused_moe import TL_DTYPE
from fusedmoe.kernels.wgmma_gemm import wgmma_grouped_gemm
from fusedmoe.quant.formats import FP8_DTYPE
from fusedmoe.tools.presets import PRESETS


def _routing(m, e, k, device):
    return torch.randn(m, e, device=device).topk(k, dim=1).indices.to(torch.int32)


def _reference_rows(layout, a, a_s, w, w_s, rows):
    """float32 out[rows] of the block-scaled (or plain) grouped GEMM."""
    experts = layout.m_indices[rows].long()
    out = torch.empty(len(rows), w.shape[1], device=a.device)
    for e in experts.unique().tolist():
        sel = (experts == e).nonzero().flatten()
        r = rows[sel]
        x = a[r].float()
        we = w[e].float()
        if a_s is not None:
            x = x * a_s[r].repeat_interleave(128, dim=1)[:, : x.shape[1]]
            ws = w_s[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            we = we * ws[: we.shape[0], : we.shape[1]]
        out[sel] = x @ we.T
    return out


def _contenders(layout, w, w_s, out, configs, others, lib):
    """{name: a call computing out} for one GEMM."""
    n, kk = w.shape[1], w.shape[2]
    contenders = {}
    for cfg in configs:
        bn, st = (int(v) for v in cfg.split("x"))
        contenders[f"wg {cfg}"] = lambda bn=bn, st=st: wgmma_grouped_gemm(
            layout.a, layout.a_scale, w, w_s, out, layout.expert_ids, layout.num_rows, 128,
            block_n=bn, stages=st,
        )  # fmt: skip
    if w_s is not None and others:
        contenders["triton"] = lambda: dg._grouped_gemm(
            layout.a, layout.a_scale, dg._A_MODE["fp8_block"], w, w_s, dg._W_MODE["fp8_block"],
            out, layout, w_fp4=False, h_dtype=TL_DTYPE[torch.bfloat16],
        )  # fmt: skip
        if lib is not None and kk % 128 == 0 and n % 128 == 0:
            contenders["deepgemm"] = lambda: lib.contiguous(
                layout.a, layout.a_scale, w, w_s, out, layout.m_indices
            )
    return contenders


def run_case(preset, tokens, dtype, configs, lib, device, others, graph):
    p = PRESETS[preset]
    e, k = p.num_experts, p.top_k
    results = []
    ids = _routing(tokens, e, k, device)
    for gemm, (n, kk) in (
        ("gemm1", (2 * p.intermediate_size, p.hidden_size)),
        ("gemm2", (p.hidden_size, p.intermediate_size)),
    ):
        scaled = dtype == "fp8_block"
        g = triton.cdiv(kk, 128)
        if scaled:
            x = (torch.randn(tokens, kk, device=device, dtype=torch.bfloat16) * 2).to(FP8_DTYPE)
            x_s = torch.rand(tokens, g, device=device) * 0.02 + 0.001
            w = (torch.randn(e, n, kk, device=device, dtype=torch.bfloat16) * 2).to(FP8_DTYPE)
            w_s = torch.rand(e, triton.cdiv(n, 128), g, device=device) * 0.02 + 0.001
        else:
            x = torch.randn(tokens, kk, device=device, dtype=torch.bfloat16)
            x_s = None
            w = torch.randn(e, n, kk, device=device, dtype=torch.bfloat16) * 0.05
            w_s = None
        m_sum, _ = dg.compute_aligned_M_and_alignment(tokens, k, e, 128)
        scale_out = None
        if scaled:
            scale_out = torch.empty(g, m_sum, device=device).t()  # column-major
        layout = dg.permute_contiguous(x, x_s, ids, e, 128, m_sum, scale_out=scale_out)
        out = torch.empty(m_sum, n, device=device, dtype=torch.bfloat16)
        flops = 2.0 * tokens * k * n * kk
        valid = (layout.m_indices >= 0).nonzero().flatten()
        sample = valid[torch.randperm(len(valid), device=device)[:384]]
        ref = _reference_rows(layout, layout.a, layout.a_scale, w, w_s, sample)

        contenders = _contenders(layout, w, w_s, out, configs, others, lib)
        for name, fn in contenders.items():
            out.fill_(float("nan"))
            try:
                fn()
                torch.cuda.synchronize()
                err = ((out[sample].float() - ref).norm() / ref.norm()).item()
                if graph:  # back to back, as the bench replays a layer
                    ms = triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median")
                else:
                    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
            except Exception as exc:  # report and go on: a probe
                print(f"{preset} {tokens} {gemm} {name}: {type(exc).__name__}: {exc}"[:400])
                continue
            tflops = flops / ms / 1e9
            results.append(
                dict(preset=preset, tokens=tokens, dtype=dtype, gemm=gemm, contender=name,
                     ms=ms, tflops=tflops, rel_err=err)
            )  # fmt: skip
            print(
                f"{preset:16s} {tokens:6d} {dtype:9s} {gemm} {name:10s} {ms * 1e3:9.1f} us "
                f"{tflops:7.1f} TFLOP/s err {err:.2e}",
                flush=True,
            )
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--dtypes", default="fp8_block,bf16")
    ap.add_argument("--configs", default="128x4,256x3")
    ap.add_argument("--no-others", action="store_true", help="only the wgmma configs")
    ap.add_argument("--graph", action="store_true", help="CUDA-graph replays, no L2 flush")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    lib = find_library()
    print("library:", None if lib is None else lib.describe(), flush=True)
    configs = args.configs.split(",")
    rows = []
    for dtype in args.dtypes.split(","):
        for preset in args.presets.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                torch.manual_seed(0)
                rows += run_case(
                    preset, tokens, dtype, configs, lib, device, not args.no_others, args.graph
                )
                torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\nsummary (TFLOP/s, routed rows)")
    for r in rows:
        print(
            f"{r['preset']:16s} {r['tokens']:6d} {r['dtype']:9s} {r['gemm']} "
            f"{r['contender']:10s} {r['tflops']:7.1f} err {r['rel_err']:.1e}"
        )


if __name__ == "__main__":
    main()
