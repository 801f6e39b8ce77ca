"""A device-side choice between two kernel configs of the triton backend, measured before it is
built (issue 19). Every call aligns the slots for both configs' row blocks; a comparison on the
device keeps the config whose padded rows are fewest relative to the other (config B when
padded_B <= T * padded_A) and zeroes the other alignment's row count, so that config's GEMM
launches return at once. The act + quant and top-k sum kernels are shared (they index slots,
not aligned rows). On a GPU:

    PYTHONPATH=. python3 benchmarks/probe_dual_config.py [--presets ...] [--tokens 64,256,1024]
        [--quant fp8_block] [--factors 4,16] [--threshold 2]

Config A is the bucket's (today's); config B is the config of the bucket `factor` times larger
(taller row blocks, tuned for more slots per expert). Each cell times, under CUDA-graph replay,
the expert computation after prepare (the recorded arguments of one fused_experts call): A
alone, B alone, and the dual call (A, B, threshold), and checks the dual output against A's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe.activation import MoEActivation
from fusedmoe.functional import fused_experts
from fusedmoe.kernels import fused_moe as fm
from fusedmoe.kernels import moe_gemm as g
from fusedmoe.kernels.moe_config import moe_kernel_config
from fusedmoe.tools.bench.inputs import (
    make_expert_biases,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.presets import PRESETS


def record_args(experts, routing, activation):
    """The arguments of the triton backend's impl for this call (after prepare)."""
    seen = []
    real = fm._fused_experts_triton_impl

    def spy(*args):
        seen.append(args)
        return real(*args)

    fm._fused_experts_triton_impl = spy
    try:
        fused_experts(
            routing.x, experts.w13, experts.w2, routing.topk_weights, routing.topk_ids,
            quant_config=experts.quant_config, backend="triton", activation=activation,
            w13_bias=experts.w13_bias, w2_bias=experts.w2_bias,
        )  # fmt: skip
    finally:
        fm._fused_experts_triton_impl = real
    return seen[-1]


def config_for(args, num_tokens):
    x, w13, topk_ids, activation, dtype_key = args[1], args[3], args[10], args[15], args[24]
    num_local, gemm1_rows, hidden = w13.shape
    width = MoEActivation(activation).output_size(gemm1_rows)
    return moe_kernel_config(
        num_tokens, topk_ids.shape[1], num_local, gemm1_rows, hidden, width, dtype_key,
        fm.device_name(x),
    )  # fmt: skip


def run_configs(args, configs, threshold):
    """_fused_experts_triton_impl with one or two configs (the device-side choice)."""
    (output, x, a1_scale, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, topk_weights,
     topk_ids, expert_map, _a2_static_scale, workspace13, workspace2, activation, alpha, beta,
     limit, has_limit, a_mode, w_mode, a2_mode, mul_routed_weight, _) = args  # fmt: skip
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    num_local, gemm1_rows, hidden = w13.shape
    act = MoEActivation(activation)
    width = act.output_size(gemm1_rows)
    fused = configs[0].fuse_activation or not fm._unfused_ok(a2_mode, act)
    rows = [fm.gemm_rows(topk_ids, expert_map, c.block_m, num_local) for c in configs]
    if len(configs) == 2:
        pa, pb = (r.routing.num_tokens_post_padded for r in rows)
        use_b = pb.float() <= threshold * pa.float()
        pa.mul_(~use_b)
        pb.mul_(use_b)
    out_mode, _ = fm.A2_MODES[a2_mode]
    a2, a2_scale = fm._a2_buffers(workspace2, num_slots, width, a2_mode, output.dtype)
    params = (alpha, beta, limit, has_limit)
    h_dtype = fm.TL_DTYPE[output.dtype]
    if not fused:
        h = torch.empty((num_slots, gemm1_rows), dtype=output.dtype, device=x.device)
    for config, r in zip(configs, rows, strict=True):
        if fused:
            gemm1 = config.gemm1
            if out_mode in (g.OUT_FP8_GROUP, g.OUT_FP8_GROUP_UE8M0) and gemm1.block_n % 128:
                gemm1 = dataclasses.replace(gemm1, block_n=g.QUANT_GROUP)
            fm.launch_gemm(
                x, a1_scale, fm.A_MODES[a_mode], top_k, w13, w13_scale, fm.W_MODES[w_mode],
                w13_bias, a2, a2_scale, topk_weights, r, num_slots, gemm1, activation=act,
                params=params, out_mode=out_mode, mul_routed_weight=False, h_dtype=h_dtype,
            )  # fmt: skip
        else:
            fm.launch_gemm(
                x, a1_scale, fm.A_MODES[a_mode], top_k, w13, w13_scale, fm.W_MODES[w_mode],
                w13_bias, h, None, topk_weights, r, num_slots, config.gemm1, activation=None,
                params=params, out_mode=g.OUT_PLAIN, mul_routed_weight=False, h_dtype=h_dtype,
            )  # fmt: skip
    if not fused:
        a2, a2_scale = fm.act_mul_group_quant_fp8_impl(
            h, act.value, alpha, beta, limit, has_limit, g.QUANT_GROUP, False,
            a2_mode == "fp8_group_ue8m0",
        )  # fmt: skip
    y = workspace13.view(-1)[: num_slots * hidden].view(num_slots, hidden)
    for config, r in zip(configs, rows, strict=True):
        fm.launch_gemm(
            a2, a2_scale, fm._A2_SCALE[a2_mode], 1, w2, w2_scale, fm.W_MODES[w_mode], w2_bias,
            y, None, topk_weights.reshape(-1), r, num_slots, config.gemm2, activation=None,
            params=params, out_mode=g.OUT_PLAIN, mul_routed_weight=mul_routed_weight,
            h_dtype=h_dtype,
        )  # fmt: skip
    fm.moe_sum(y, output, topk_ids, expert_map, num_local)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--tokens", default="64,256,1024")
    ap.add_argument("--quant", default="fp8_block")
    ap.add_argument("--factors", default="4,16")
    ap.add_argument("--threshold", type=float, default=2.0)
    args = ap.parse_args()
    device = torch.device("cuda")
    factors = [int(f) for f in args.factors.split(",")]
    print("preset quant routing M | A us | B(xF) us, dual us, chose B | ...")
    for name in args.presets.split(","):
        p = PRESETS[name]
        e, h, i = p.num_experts, p.hidden_size, p.intermediate_size
        w13, w2 = make_expert_weights(name, e, h, i, p.activation, torch.bfloat16, device)
        scheme = None if args.quant == "bf16" else args.quant
        experts = quantize_expert_set(w13, w2, scheme, with_plain=False)
        if p.has_bias:
            experts.w13_bias, experts.w2_bias = make_expert_biases(name, w13, w2)
        del w13, w2
        for m in (int(t) for t in args.tokens.split(",")):
            for routing_kind in ("uniform", "skewed"):
                r = make_routing(
                    name, m, p.num_experts, p.top_k, p.hidden_size, routing_kind,
                    torch.bfloat16, device,
                )  # fmt: skip
                call = record_args(experts, r, p.activation)
                output = call[0]
                cfg_a = config_for(call, m)
                run_configs(call, [cfg_a], 0)
                ref = output.clone()
                t_a = triton.testing.do_bench_cudagraph(
                    lambda c=call, a=cfg_a: run_configs(c, [a], 0), rep=100
                )
                cells = [f"{t_a * 1e3:7.1f}"]
                for f in factors:
                    cfg_b = config_for(call, m * f)
                    if cfg_b == cfg_a or cfg_b.fuse_activation != cfg_a.fuse_activation:
                        cells.append(f"B(x{f}) same/unfit")
                        continue
                    t_b = triton.testing.do_bench_cudagraph(
                        lambda c=call, b=cfg_b: run_configs(c, [b], 0), rep=100
                    )
                    rows = run_configs(call, [cfg_a, cfg_b], args.threshold)
                    chose_b = int(rows[1].routing.num_tokens_post_padded.item()) > 0
                    err = float(
                        (output.float() - ref.float()).abs().max() / ref.float().abs().max()
                    )
                    t_d = triton.testing.do_bench_cudagraph(
                        lambda c=call, a=cfg_a, b=cfg_b: run_configs(c, [a, b], args.threshold),
                        rep=100,
                    )
                    cells.append(
                        f"B(x{f}) bm{cfg_b.block_m} {t_b * 1e3:7.1f}, dual {t_d * 1e3:7.1f}"
                        f" {'B' if chose_b else 'A'} err {err:.1e}"
                    )
                print(f"{name} {args.quant} {routing_kind} {m} bmA{cfg_a.block_m} |",
                      " | ".join(cells), flush=True)  # fmt: skip
        del experts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
