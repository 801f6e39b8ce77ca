"""The 4-bit weight-only op alone, replayed in CUDA graphs, per tile size: the A/B behind the
MXFP4 kernel choices in docs/performance.md ("4-bit weight-only experts").

    python benchmarks/bench_wo_tiles.py [--tokens 8,64,1024,4096] [--block-m table,64,128]
                                        [--group-m 8] [--gemv 16x128x4,32x256x4]
                                        [--one-slot 1x16,2x16,1x32]
                                        [--scheme mxfp4_w4a16] [--experts 128] [--top-k 4]
                                        [--hidden 2880] [--intermediate 2880]

The defaults are gpt-oss-120b's experts (swigluoai with biases), random N(0, 0.02^2) bf16
weights quantized with quantize_experts, random top-k routing of softmax weights. Each
--block-m value is a slots-per-tile override through use_wo_config ("table": the shipped
choice); on Hopper, tiles up to 64 run wo_hopper's decode form and larger ones its prefill
form's 128 where experts see 128 slots or more on average (wo_hopper.hopper_block_m), else
64; --group-m values are the launch order's groups of row blocks for those overrides (each
tile with each, named tile/group). Each --gemv value BNxBKxW runs the decode GEMV
(wo_gemm._wo_gemv_kernel: one slot a program) with BN weight rows and BK columns a step on W
warps, at any token count, where wo_hopper's kernels do not run (for MXFP4 x bf16 on Hopper
a decode config runs the one-slot form instead; FUSEDMOE_WO_GEMV_MMA=0 with
FUSEDMOE_WO_HOPPER=0 keeps the GEMV there). Prints one line per token count: ms per call for
each tile (fusedmoe.tools.bench.timing.time_ms: the median of CUDA-graph replays), and which
was fastest. Each --one-slot value TxCB runs wo_hopper_gemv's one-slot form (MXFP4 x bf16 on
Hopper) at any token count, T 16-row mma tiles a warp, CB bytes of a row a lane and step.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools

import torch

from fusedmoe import fused_experts
from fusedmoe.kernels import wo_hopper
from fusedmoe.kernels.wo_moe import WoConfig, WoGemmConfig, use_wo_config
from fusedmoe.quant import quantize_experts
from fusedmoe.tools.bench.timing import time_ms


def _counted(launch, ran, *args, **kwargs):
    """launch, recording in `ran` that it ran."""
    ran.append(1)
    return launch(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,64,1024,4096")
    parser.add_argument("--block-m", default="table,64,128")
    parser.add_argument("--group-m", default="8", help="GROUP_M of the --block-m overrides")
    parser.add_argument("--gemv", default="", help="GEMV tiles BNxBKxW, comma-separated")
    parser.add_argument("--one-slot", default="", help="one-slot form tiles TxCB, comma-separated")
    parser.add_argument("--scheme", default="mxfp4_w4a16")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--intermediate", type=int, default=2880)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_wo_tiles.py times CUDA graphs: it needs a CUDA GPU")
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    device = torch.device("cuda")
    tiles = [None if t == "table" else int(t) for t in args.block_m.split(",") if t]
    groups = [int(g) for g in args.group_m.split(",") if g]
    gemvs = [tuple(int(v) for v in t.split("x")) for t in args.gemv.split(",") if t]
    if any(len(g) != 3 for g in gemvs):
        raise SystemExit(f"--gemv takes BNxBKxW values, got {args.gemv!r}")
    one_slot = [tuple(int(v) for v in t.split("x")) for t in args.one_slot.split(",") if t]
    if any(len(t) != 2 for t in one_slot):
        raise SystemExit(f"--one-slot takes TxCB values, got {args.one_slot!r}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    q13, q2, qc = quantize_experts(w13, w2, args.scheme)
    del w13, w2
    b13 = torch.randn(e, 2 * i, device="cuda", generator=gen).to(torch.bfloat16) * 0.1
    b2 = torch.randn(e, h, device="cuda", generator=gen).to(torch.bfloat16) * 0.1
    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16)
        scores, ids = torch.rand(m, e, device="cuda", generator=gen).topk(k, dim=1)
        weights, ids = torch.softmax(scores, -1), ids.to(torch.int32)

        def call(x=x, weights=weights, ids=ids):
            return fused_experts(
                x, q13, q2, weights, ids, quant_config=qc, backend="triton",
                activation="swigluoai", w13_bias=b13, w2_bias=b2,
            )  # fmt: skip

        times = {}
        for tile in tiles:
            if tile is None:
                times["table"] = time_ms(call, device)[0]
                continue
            for group in groups:
                gemm = WoGemmConfig(64, 128, group, 4, 2)
                name = str(tile) if len(groups) == 1 else f"{tile}/{group}"
                with use_wo_config(WoConfig(tile, gemm, gemm)):
                    times[name] = time_ms(call, device)[0]
        for bn, bk, warps in gemvs:
            gemm = WoGemmConfig(64, 128, 8, 4, 2)
            gemv = WoGemmConfig(bn, bk, 1, warps, 1)
            with use_wo_config(WoConfig(16, gemm, gemm, gemv)):
                times[f"gemv {bn}x{bk}x{warps}"] = time_ms(call, device)[0]
        for tiles_, cb in one_slot:
            gemm = WoGemmConfig(64, 128, 8, 4, 2)
            gemv = WoGemmConfig(8, 256, 1, 4, 1)  # any: the one-slot form takes its place
            ran = []
            launch = wo_hopper.launch_mx_gemv
            wo_hopper.launch_mx_gemv = functools.partial(_counted, launch, ran)
            try:
                config = WoConfig(16, gemm, gemm, gemv)
                with use_wo_config(config), wo_hopper.use_one_slot_tile(tiles_, cb):
                    times[f"one-slot {tiles_}x{cb}"] = time_ms(call, device)[0]
            finally:
                wo_hopper.launch_mx_gemv = launch
            if not ran:
                raise SystemExit(
                    "--one-slot: the one-slot form did not run (it takes MXFP4 x bf16 on "
                    "Hopper, FUSEDMOE_WO_GEMV_MMA not 0)"
                )
        best = min(times, key=times.get)
        cells = "  ".join(f"{name}: {ms:.4f}" for name, ms in times.items())
        print(f"tokens {m:6d}  {cells}  (fastest: {best})", flush=True)


if __name__ == "__main__":
    main()
