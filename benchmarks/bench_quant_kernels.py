"""Time the Triton activation quantizers (fusedmoe.quant.kernels) on a CUDA GPU.

    python benchmarks/bench_quant_kernels.py [--hbm-gbps 4800] [--json rows.json]

For each kernel, M in (1, 64, 1024, 4096, 16384) and K in (2048, 7168) (K is the quantized
width; the fused kernel reads h [M, 2K]): the median time of CUDA-graph replays
(triton.testing.do_bench_cudagraph, or do_bench where graphs fail), GB/s = (bytes read +
bytes written) / time, and pct_floor = floor / time with floor = bytes / HBM bandwidth (the
H200's 4.8 TB/s by default). These kernels are memory-bound: at large M they should reach
> 70% of the floor. At small M the launch dominates, and inputs that fit in L2 (~50 MB) can
read faster than HBM, so pct_floor may pass 100 there.

Every output is checked against its torch twin (fusedmoe.quant.activation) in the same run:
err_vs_twin is max |dequant(kernel) - dequant(twin)| / max |dequant(twin)|, q_mismatch the
fraction of e4m3 elements that differ, quant_err the same normalised max error against the
unquantized values (the format's own rounding: at most 1/28 for float32 group scales).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

try:
    import fusedmoe  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_MS = (1, 64, 1024, 4096, 16384)
DEFAULT_KS = (2048, 7168)
DEVICE = "cuda"
KERNELS = ("group_fp8", "act_mul_group_fp8", "mxfp8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth, GB/s")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--ms", type=int, nargs="+", default=list(DEFAULT_MS))
    p.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS))
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--column-major", action="store_true", help="column-major group scales")
    p.add_argument("--ue8m0", action="store_true", help="power-of-two group scales")
    p.add_argument("--activation", default="silu", help="activation of the fused kernel")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    return p.parse_args(argv)


def time_ms(fn) -> tuple[float, str]:
    """Median ms of fn: CUDA-graph replay, else plain launches."""
    import triton.testing

    fn()  # compile outside any graph capture
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"), "graph"
    except Exception as exc:  # capture can fail (driver, allocator): time plain launches
        print(f"  (CUDA graph timing failed: {type(exc).__name__}: {exc}; using do_bench)")
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), "launch"


def normalised_max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    if scale == 0.0:
        return float((actual - expected).abs().max()) if actual.numel() else 0.0
    return float((actual - expected).abs().max()) / scale


def bench_case(kernel: str, m: int, k: int, args, dtype: torch.dtype) -> dict:
    from fusedmoe.activation import apply_activation
    from fusedmoe.quant import activation as qa
    from fusedmoe.quant import kernels as kq
    from fusedmoe.quant import keys
    from fusedmoe.quant.reference import dequantize

    g, cm, ue = args.group_size, args.column_major, args.ue8m0
    in_bytes = torch.finfo(dtype).bits // 8
    group_key = keys.QuantKey(
        keys.ElementFormat.FP8,
        keys.ScaleLayout.GROUP,
        keys.ScaleFormat.UE8M0 if ue else keys.ScaleFormat.FLOAT32,
        group=(1, g),
    )
    if kernel == "group_fp8":
        x = torch.randn(m, k, device=DEVICE, dtype=dtype)
        run = lambda: kq.per_token_group_quant_fp8_triton(x, g, cm, ue)
        twin = lambda: qa.per_token_group_quant_fp8_torch(x, g, cm, ue)
        exact, key = x.float(), group_key
        moved = m * k * in_bytes + m * k + m * math.ceil(k / g) * 4
    elif kernel == "act_mul_group_fp8":
        x = torch.randn(m, 2 * k, device=DEVICE, dtype=dtype) * 3
        act = args.activation
        run = lambda: kq.act_mul_per_token_group_quant_fp8_triton(x, act, None, g, cm, ue)
        twin = lambda: qa.act_mul_per_token_group_quant_fp8_torch(x, act, None, g, cm, ue)
        exact, key = apply_activation(act, x), group_key
        moved = m * 2 * k * in_bytes + m * k + m * math.ceil(k / g) * 4
    else:
        x = torch.randn(m, k, device=DEVICE, dtype=dtype)
        run = lambda: kq.quantize_mxfp8_triton(x)
        twin = lambda: qa.quantize_mxfp8_torch(x)
        exact, key = x.float(), keys.MXFP8
        moved = m * k * in_bytes + m * k + m * (k // 32)

    q, scales = run()
    q_ref, scales_ref = twin()
    deq, deq_ref = dequantize(q, scales, key), dequantize(q_ref, scales_ref, key)
    row = {
        "kernel": kernel,
        "M": m,
        "K": k,
        "err_vs_twin": normalised_max_error(deq, deq_ref),
        "q_mismatch": float((q.float() != q_ref.float()).float().mean()) if q.numel() else 0.0,
        "scales_equal": bool(torch.equal(scales, scales_ref)),
        "quant_err": normalised_max_error(deq, exact),
        "bytes": moved,
    }
    del q, scales, q_ref, scales_ref, deq, deq_ref, exact
    ms, how = time_ms(run)
    floor_us = moved / (args.hbm_gbps * 1e9) * 1e6
    row.update(
        time_us=ms * 1e3,
        gbps=moved / (ms * 1e-3) / 1e9,
        floor_us=floor_us,
        pct_floor=100.0 * floor_us / (ms * 1e3),
        timing=how,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_quant_kernels: no CUDA GPU here (torch.cuda.is_available() is False); "
            "these timings need one. The kernels' CPU checks are tests/test_quant_kernels.py.",
            file=sys.stderr,
        )
        return 2
    import triton

    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    print(
        f"# {device}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype} input,"
        f" g={args.group_size}, column_major={args.column_major}, ue8m0={args.ue8m0},"
        f" activation={args.activation}, HBM floor at {args.hbm_gbps:.0f} GB/s"
    )
    header = (
        f"{'kernel':<18} {'M':>6} {'K':>5} {'time_us':>9} {'GB/s':>8} {'pct_floor':>9} "
        f"{'err_vs_twin':>11} {'q_mismatch':>10} {'scales_eq':>9} {'quant_err':>9}"
    )
    print(header)
    rows = []
    for kernel in args.kernels:
        for k in args.ks:
            for m in args.ms:
                torch.manual_seed(0)
                row = bench_case(kernel, m, k, args, dtype)
                rows.append(row)
                print(
                    f"{kernel:<18} {m:>6} {k:>5} {row['time_us']:>9.2f} {row['gbps']:>8.0f} "
                    f"{row['pct_floor']:>8.1f}% {row['err_vs_twin']:>11.2e} "
                    f"{row['q_mismatch']:>10.2e} {row['scales_equal']!s:>9} "
                    f"{row['quant_err']:>9.2e}",
                    flush=True,
                )
                torch.cuda.empty_cache()
    large = [r["pct_floor"] for r in rows if r["M"] >= 4096]
    if large:
        print(f"# mean pct_floor at M >= 4096: {sum(large) / len(large):.1f}%")
    if args.json is not None:
        meta = {
            "device": device,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "dtype": args.dtype,
            "group_size": args.group_size,
            "column_major": args.column_major,
            "ue8m0": args.ue8m0,
            "activation": args.activation,
            "hbm_gbps": args.hbm_gbps,
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"# wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
