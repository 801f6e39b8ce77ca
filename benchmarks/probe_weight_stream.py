"""How fast can a decode GEMM read expert weights on this GPU? A minimal Triton GEMV over the
weights of top_k experts, beside which the triton backend's decode GEMMs are judged.

    PYTHONPATH=. python3 benchmarks/probe_weight_stream.py [--presets gpt-oss-120b,...]

At M = 1 an expert GEMM is a read of k experts' weights (row-major [N, K], K contiguous). For
each preset's GEMM1 weights of top_k experts, FP8 and bf16, a kernel with nothing but the read
and a 16-row tl.dot (one program per BN rows, K in steps of BK) is timed under CUDA-graph
replay, cycling through three copies of the weights so that L2 cannot hold them between
launches. FP8 modes: 0 one accumulator over K; 1 each 128-wide K block promoted with its scale
(the block-scaled GEMM's loop); 2 two 128-wide blocks per step, each promoted (256 bytes of a
row per step, as bf16 at BK = 128). What it showed on an H100: the bandwidth depends on the
bytes read (a few microseconds of start and tail per launch), not on the loop's form.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_backends import csv_list

from fusedmoe.tools.presets import PRESETS

COPIES = 3  # weight sets cycled through, so that no launch finds its weights in L2


@triton.jit
def _gemv_kernel(
    w_ptr, s_ptr, out_ptr, K, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr
):  # fmt: skip
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    a = tl.full((16, 128 if MODE == 2 else BK), 1.0, tl.float32).to(w_ptr.dtype.element_ty)
    acc = tl.zeros((16, BN), dtype=tl.float32)
    if MODE == 2:
        cols = tl.arange(0, 128)
        ptrs = w_ptr + rows.to(tl.int64)[None, :] * K + cols[:, None]
        for k0 in range(0, K, 256):
            t0 = tl.load(ptrs + k0, mask=(k0 + cols)[:, None] < K, other=0.0)
            t1 = tl.load(ptrs + k0 + 128, mask=(k0 + 128 + cols)[:, None] < K, other=0.0)
            s0 = tl.load(s_ptr + k0 // 128)
            s1 = tl.load(s_ptr + k0 // 128 + 1, mask=k0 + 128 < K, other=0.0)
            acc += tl.dot(a, t0) * s0 + tl.dot(a, t1) * s1
    else:
        cols = tl.arange(0, BK)
        ptrs = w_ptr + rows.to(tl.int64)[None, :] * K + cols[:, None]
        for k0 in range(0, K, BK):
            tile = tl.load(ptrs + k0, mask=(k0 + cols)[:, None] < K, other=0.0)
            if MODE == 1:
                acc += tl.dot(a, tile) * tl.load(s_ptr + k0 // 128)
            else:
                acc = tl.dot(a, tile, acc)
    tl.store(out_ptr + rows, tl.sum(acc, 0))


def _time_us(weights, scales, out, k, bn, bk, mode, stages) -> float:
    def run():
        for w in weights:
            _gemv_kernel[(w.shape[0] // bn,)](
                w, scales, out, k, BN=bn, BK=bk, MODE=mode, num_warps=4, num_stages=stages
            )

    run()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run, rep=40, return_mode="median") * 1e3 / COPIES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--presets",
        type=csv_list(str),
        default=["gpt-oss-120b", "deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b"],
    )
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    for name in args.presets:
        pr = PRESETS[name]
        n, k = 2 * pr.intermediate_size, pr.hidden_size
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            weights = [torch.randn(pr.top_k * n, k, device=dev).to(dtype) for _ in range(COPIES)]
            nbytes = weights[0].numel() * weights[0].element_size()
            scales = torch.rand(triton.cdiv(k, 128), device=dev)
            out = torch.empty(pr.top_k * n, device=dev)
            fp8 = dtype == torch.float8_e4m3fn
            modes = [(0, 128), (1, 128), (0, 256), (2, 256)] if fp8 else [(0, 64), (0, 128)]
            for mode, bk in modes:
                for bn in (32, 64):
                    for stages in (3, 4):
                        us = _time_us(weights, scales, out, k, bn, bk, mode, stages)
                        print(
                            f"{name} GEMM1 x{pr.top_k} {str(dtype)[6:]} {nbytes / 1e6:.1f} MB "
                            f"mode {mode} BK {bk} BN {bn} stages {stages}: {us:.1f} us "
                            f"{nbytes / us / 1e6:.2f} TB/s",
                            flush=True,
                        )
            del weights
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
