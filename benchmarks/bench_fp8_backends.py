"""Time the FP8 backends (triton, deep_gemm, hpc) against each other and the floor, on a GPU.

    PYTHONPATH=. python3 benchmarks/bench_fp8_backends.py [--tokens 1,8,64,...]
        [--cases deepseek-v3:fp8_block,qwen3-235b-a22b:fp8_block,qwen3-30b-a3b:fp8_tensor]
        [--backends triton,deep_gemm,deep_gemm:triton,hpc] [--routing uniform]
        [--parts] [--json rows.json]

deep_gemm runs the DeepGEMM library's GEMMs where one is importable (its auto engine);
deep_gemm:triton is the same backend on our Triton GEMMs. --parts adds, for fp8_block where
the library runs, a "dg parts" row: the sum of the pieces of the library path, each timed alone
(x's quantization, moe_align + permute, the library's GEMM1, act + quant, its GEMM2, the
unpermute-reduce), the figure the whole layer is held against.

The whole expert computation given the routing, from bf16 x to bf16 out (the activation
quantization of prepare inside the timed region), median of CUDA-graph replays, weights at the
presets' real sizes. fp8_tensor runs with static activation scales (the hpc contract: per-expert
weight scales, a1 / a2 scales calibrated once, here from a first batch). Each backend is
requested by name: without the DeepGEMM library, deep_gemm below 128 tokens is then refused, and
the row says so (the oracle would run triton there); "auto" is the oracle's own choice.
rel_err: against the float64 torch backend where M * k <= 8192, else against triton.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe import fused_experts
from fusedmoe.quant import make_quant_config
from fusedmoe.tools.bench.inputs import (
    make_expert_biases,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.bench.timing import rel_err, time_ms
from fusedmoe.tools.presets import PRESETS
from fusedmoe.tools.roofline import (
    ceilings_for,
    distinct_experts,
    floor_seconds,
    fp8_block_scale_bytes,
    moe_bytes,
    moe_flops,
)

DEFAULT_CASES = ("deepseek-v3:fp8_block", "qwen3-235b-a22b:fp8_block", "qwen3-30b-a3b:fp8_tensor")
DEFAULT_TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
BACKENDS = ("triton", "deep_gemm", "hpc")


@dataclass
class Row:
    preset: str
    quant: str
    routing: str
    backend: str
    tokens: int
    time_us: float
    floor_us: float
    roofline_pct: float
    tflops: float
    rel_err: float | None
    note: str


def csv_list(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def quantize_static_fp8_tensor(w13, w2, x_calib):
    """fp8_tensor weights (a scale per expert) with static a1 / a2 scales: a1 from |x| of a
    calibration batch; a2 = 8 / 448 (SiLU * up of these N(0, 1/fan_in) weights stays within a
    few units)."""
    experts = quantize_expert_set(w13, w2, "fp8_tensor", with_plain=False)
    a1 = x_calib.abs().amax().float().reshape(1) / 448
    a2 = torch.tensor([8.0 / 448], device=x_calib.device)
    qc = experts.quant_config
    static = make_quant_config("fp8_tensor", qc.w1.scale, qc.w2.scale, a1_scale=a1, a2_scale=a2)
    return experts.w13, experts.w2, static


def _backend(name):
    """A backend name, or "deep_gemm:<engine>": that engine of deep_gemm, requested by name."""
    if ":" not in name:
        return name
    from fusedmoe.experts.deep_gemm import DeepGemmExperts

    base, engine = name.split(":")
    if base != "deep_gemm":
        raise ValueError(f"only deep_gemm has engines, got {name!r}")

    class Engine(DeepGemmExperts):
        @classmethod
        def create(cls, *, requested: bool = False):
            return DeepGemmExperts(strict=requested, engine=engine)

    return Engine


def library_parts_us(x, q13, q2, qc, topk_ids, act, device, rep_ms):
    """{piece: us} of the library path, each piece timed alone on this routing (None where
    the library does not run here)."""
    from fusedmoe.activation import MoEActivation
    from fusedmoe.kernels import deep_gemm_lib
    from fusedmoe.kernels.deep_gemm_moe import (
        carve_permuted,
        compute_aligned_M_and_alignment,
        library_layout,
        permute_contiguous,
        unpermute_reduce,
    )
    from fusedmoe.quant.activation import per_token_group_quant_fp8
    from fusedmoe.quant.kernels import act_mul_per_token_group_quant_fp8_triton

    if deep_gemm_lib.library_unusable_reason(device) is not None:
        return None
    lib = deep_gemm_lib.find_library()
    m, k = topk_ids.shape
    e, n, h = q13.shape
    if library_layout(m, k, e, 128)[0] != "contiguous":
        return None
    m_sum, _ = compute_aligned_M_and_alignment(m, k, e, 128)
    a1q, a1s = per_token_group_quant_fp8(x, 128)
    ws13 = torch.empty(m_sum, max(n // 2, h), dtype=x.dtype, device=device)
    a_out, s_out = carve_permuted(ws13, m_sum, h, a1s.shape[1], torch.float32)
    layout = permute_contiguous(a1q, a1s, topk_ids, e, 128, m_sum, a_out=a_out, scale_out=s_out)
    hbuf = torch.empty(m_sum, n, dtype=x.dtype, device=device)
    a2q, a2s = act_mul_per_token_group_quant_fp8_triton(
        hbuf.normal_(), act, column_major_scales=True
    )
    y = torch.empty(m_sum, h, dtype=x.dtype, device=device)
    out = torch.empty_like(x)
    w = torch.rand(m, k, device=device)
    pieces = {
        "quant x": lambda: per_token_group_quant_fp8(x, 128),
        "permute": lambda: permute_contiguous(
            a1q, a1s, topk_ids, e, 128, m_sum, a_out=a_out, scale_out=s_out
        ),
        "gemm1": lambda: lib.contiguous(
            layout.a, layout.a_scale, q13, qc.w1.scale, hbuf, layout.m_indices
        ),
        "act+quant": lambda: act_mul_per_token_group_quant_fp8_triton(
            hbuf, MoEActivation(act), column_major_scales=True
        ),
        "gemm2": lambda: lib.contiguous(a2q, a2s, q2, qc.w2.scale, y, layout.m_indices),
        "unpermute": lambda: unpermute_reduce(y, out, w, topk_ids, layout.inv_perm, e),
    }
    return {name: time_ms(fn, device, rep_ms=rep_ms)[0] * 1e3 for name, fn in pieces.items()}


def run_case(preset_name, quant, args, ceilings, device):
    preset = PRESETS[preset_name]
    e, k, h, i = preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size
    act, dtype = preset.activation, torch.bfloat16
    w13, w2 = make_expert_weights(preset.name, e, h, i, act, dtype, device)
    if quant == "fp8_block":
        experts = quantize_expert_set(w13, w2, "fp8_block", with_plain=False)
        q13, q2, qc = experts.w13, experts.w2, experts.quant_config
    else:
        calib = make_routing(preset.name, 256, e, k, h, "uniform", dtype, device).x
        q13, q2, qc = quantize_static_fp8_tensor(w13, w2, calib)
    bias = {}
    if preset.has_bias:  # gpt-oss: timed with its expert biases, as a model runs it
        b13, b2 = make_expert_biases(preset.name, w13, w2)
        bias = dict(w13_bias=b13, w2_bias=b2)
    del w13, w2
    torch.cuda.empty_cache()
    rows = []
    for routing in args.routing:
        for m in args.tokens:
            inputs = make_routing(preset.name, m, e, k, h, routing, dtype, device)
            x, topk_weights, topk_ids = inputs.x, inputs.topk_weights, inputs.topk_ids
            d = distinct_experts(topk_ids, e)
            scale_bytes = fp8_block_scale_bytes(d, h, i) if quant == "fp8_block" else 4.0 * d
            num_bytes = moe_bytes(d, m, k, h, i, 1, 2, scale_bytes)
            flops = moe_flops(m, k, h, i)
            floor_us = floor_seconds(num_bytes, flops, ceilings, True) * 1e6
            run = functools.partial(fused_experts, x, q13, q2, topk_weights, topk_ids,
                                    activation=act, quant_config=qc, **bias)  # fmt: skip
            ref = None
            if m * k <= 8192:
                ref = run(backend="torch")
            outputs = {}
            for backend in args.backends:
                try:
                    outputs[backend] = run(backend=_backend(backend))
                except ValueError as exc:
                    rows.append(Row(preset_name, quant, routing, backend, m, float("nan"),
                                    floor_us, float("nan"), float("nan"), None,
                                    f"refused: {exc}"[:90]))  # fmt: skip
                    continue
                ms, how = time_ms(functools.partial(run, backend=_backend(backend)), device,
                                  rep_ms=args.rep_ms)  # fmt: skip
                us = ms * 1e3
                against = ref if ref is not None else outputs.get("triton")
                err = None if against is None else rel_err(outputs[backend], against)
                row = Row(preset_name, quant, routing, backend, m, us, floor_us,
                          100 * floor_us / us, flops / us / 1e6, err, how)  # fmt: skip
                rows.append(row)
                print(fmt(row), file=sys.stderr, flush=True)
            parts = None
            if args.parts and quant == "fp8_block":
                parts = library_parts_us(x, q13, q2, qc, topk_ids, act, device, args.rep_ms)
            if parts is not None:
                us = sum(parts.values())
                note = " ".join(f"{name} {t:.0f}" for name, t in parts.items())
                row = Row(preset_name, quant, routing, "dg parts", m, us, floor_us,
                          100 * floor_us / us, flops / us / 1e6, None, note)  # fmt: skip
                rows.append(row)
                print(fmt(row), file=sys.stderr, flush=True)
    return rows


def fmt(r: Row) -> str:
    err = "-" if r.rel_err is None else f"{r.rel_err:.1e}"
    return (
        f"{r.preset:<16} {r.quant:<10} {r.routing:<7} {r.backend:<10} {r.tokens:>6} "
        f"{r.time_us:>9.1f} {r.floor_us:>9.1f} {r.roofline_pct:>6.1f}% {r.tflops:>7.1f} "
        f"{err:>8}  {r.note}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=csv_list(str), default=list(DEFAULT_CASES))
    p.add_argument("--tokens", type=csv_list(int), default=list(DEFAULT_TOKENS))
    p.add_argument("--backends", type=csv_list(str), default=list(BACKENDS))
    p.add_argument("--routing", type=csv_list(str), default=["uniform"])
    p.add_argument("--rep-ms", type=int, default=50)
    p.add_argument("--parts", action="store_true", help="time the library path's pieces alone")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_backends: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ceilings = ceilings_for(torch.cuda.get_device_name())
    print(f"# {torch.cuda.get_device_name()}, floors from {ceilings.name}", file=sys.stderr)
    rows = []
    for case in args.cases:
        preset_name, quant = case.split(":")
        rows += run_case(preset_name, quant, args, ceilings, device)
        torch.cuda.empty_cache()
    print(
        f"{'preset':<16} {'quant':<10} {'routing':<7} {'backend':<10} {'M':>6} {'time_us':>9} "
        f"{'floor_us':>9} {'roof%':>7} {'TFLOP/s':>7} {'rel_err':>8}  note"
    )
    for r in rows:
        print(fmt(r))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
