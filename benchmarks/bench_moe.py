"""Time the whole MoE expert computation (routing given) on a CUDA GPU, against its floor.

    PYTHONPATH=. python3 benchmarks/bench_moe.py [--quick] [--presets deepseek-v3,mixtral-8x7b]
        [--tokens 1,8,64] [--quant bf16,fp8_block] [--routing uniform,skewed]
        [--backends triton,grouped_mm] [--ceilings auto|h200|h100] [--json rows.json]

For every preset of fusedmoe.presets (real sizes: the weights are far larger than L2), quant
scheme, routing and token count M, each contender computes out [M, H] from x [M, H] and a given
top-k routing -- alignment or permutation, both GEMMs, the activation, the activation
quantization (FP8) and the weighted top-k reduce all inside the timed region:

    triton      fusedmoe.fused_experts(..., backend="triton") on the scheme's weights
    grouped_mm  plain PyTorch on the bf16 weights, also in fp8_block rows (weights: bf16):
                sort the M*k slots by expert, gather x, torch._grouped_mm, activation,
                torch._grouped_mm, times the router weight, un-permute, sum the k slots

Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph; the column timing
says "launch" where capture failed and plain launches were timed). The floor is
fusedmoe.roofline's: max(bytes / HBM, flops / matmul peak), bytes counting only the D distinct
experts the routing touches, for the weights that row's contender reads (bf16 for grouped_mm).
roofline_pct = floor / time * 100. Where the touched weights fit in L2 (qwen3-30b-a3b at M = 1
reads 75 MB against 50-60 MB of L2) replays can beat HBM and the percentage is flattered.

Routing: uniform = softmax top-k of N(0, 1) logits, renormalised; skewed = the same with an
expert bias -1.2 * log(rank + 1) over a random ranking (Zipf-like popularity). No biases
(gpt-oss has them; both contenders run without). grouped_mm applies the preset's activation:
silu * mul in bf16, others through fusedmoe.apply_activation (float32, then bf16).

Correctness in the same run: rel_err = max |out - ref| / max |ref|, with ref (column err_ref)
fusedmoe.fused_experts(..., backend="torch") (float64 inside, on the same quantized weights)
where M * k <= --ref-max-slots, else the other contender. In fp8_block rows grouped_mm's error
against the FP8 reference is mostly the weights' quantization error.

--device cpu is a debug mode: shrunken presets (--scale, default 32), time.perf_counter timing,
grouped_mm's GEMMs as a per-expert loop, triton only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import fusedmoe  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe import fused_experts
from fusedmoe._triton import interpreting
from fusedmoe.activation import MoEActivation, apply_activation
from fusedmoe.presets import PRESETS, MoEPreset
from fusedmoe.quant import make_quant_config, quantize_experts
from fusedmoe.roofline import (
    H100,
    H200,
    Ceilings,
    ceilings_for,
    distinct_experts,
    floor_seconds,
    fp8_block_scale_bytes,
    moe_bytes,
    moe_flops,
)

DEFAULT_TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
QUICK_TOKENS = (1, 64, 4096)
CPU_TOKENS = (1, 8, 37)
QUANTS = ("bf16", "fp8_block")
ROUTINGS = ("uniform", "skewed")
BACKENDS = ("triton", "grouped_mm")
DTYPE = torch.bfloat16
# elements of one float32 copy of a chunk of experts while quantizing (quantize makes several)
QUANT_CHUNK_ELEMENTS = 1 << 28


@dataclass
class Row:
    preset: str
    quant: str  # the row's scheme: what the triton contender runs
    routing: str
    backend: str
    weights: str  # what this contender reads: "bf16" or "fp8_block"
    tokens: int
    distinct: int  # D: distinct experts the routing touches
    time_us: float
    tflops: float
    gbps: float  # floor bytes / time
    floor_us: float
    roofline_pct: float
    tokens_per_s: float
    rel_err: float | None
    err_ref: str  # what rel_err was measured against
    timing: str  # "graph", "launch (...)" or "cpu"


# ---------------------------------------------------------------------------------------------
# inputs


def seeded(device: torch.device, *key: object) -> torch.Generator:
    """A generator seeded by `key`, the same in every run and for every contender."""
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32("/".join(map(str, key)).encode()))
    return gen


def make_expert_weights(
    preset: MoEPreset, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] in bf16, N(0, 1 / fan_in), drawn in place (no fp32 copy)."""
    e, h, i = preset.num_experts, preset.hidden_size, preset.intermediate_size
    gemm1_out = MoEActivation.parse(preset.activation).gemm1_out_size(i)
    gen = seeded(device, preset.name, "weights")
    w13 = torch.empty(e, gemm1_out, h, dtype=DTYPE, device=device).normal_(
        0.0, 1.0 / math.sqrt(h), generator=gen
    )
    w2 = torch.empty(e, h, i, dtype=DTYPE, device=device).normal_(
        0.0, 1.0 / math.sqrt(i), generator=gen
    )
    return w13, w2


def quantize_fp8_block(w13: torch.Tensor, w2: torch.Tensor):
    """quantize_experts(w13, w2, "fp8_block"), a few experts at a time to bound the float32
    temporaries (all of deepseek-v3's w13 at once would need several 30 GB copies)."""
    per_expert = w13[0].numel() + w2[0].numel()
    chunk = max(1, QUANT_CHUNK_ELEMENTS // per_expert)
    w13_q = torch.empty(w13.shape, dtype=torch.float8_e4m3fn, device=w13.device)
    w2_q = torch.empty(w2.shape, dtype=torch.float8_e4m3fn, device=w2.device)
    w13_scales, w2_scales = [], []
    for start in range(0, w13.shape[0], chunk):
        part = slice(start, start + chunk)
        q13, q2, qc = quantize_experts(w13[part], w2[part], "fp8_block")
        w13_q[part], w2_q[part] = q13, q2
        w13_scales.append(qc.w1.scale)
        w2_scales.append(qc.w2.scale)
        del q13, q2, qc
    config = make_quant_config("fp8_block", torch.cat(w13_scales), torch.cat(w2_scales))
    return w13_q, w2_q, config


def make_routing(
    num_tokens: int, num_experts: int, top_k: int, kind: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> topk_weights [M, k] float32 (rows sum to 1), topk_ids [M, k] int32."""
    device = gen.device
    logits = torch.randn(num_tokens, num_experts, device=device, generator=gen)
    if kind == "skewed":  # expert of popularity rank r gets a logit bias -1.2 log(r + 1)
        rank = torch.randperm(num_experts, device=device, generator=gen)
        logits = logits - 1.2 * torch.log1p(rank.float())
    elif kind != "uniform":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
    topk_weights, topk_ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


# ---------------------------------------------------------------------------------------------
# the torch._grouped_mm contender


def grouped_gemm(
    a_sorted: torch.Tensor, w: torch.Tensor, expert_ends: torch.Tensor, loop: bool
) -> torch.Tensor:
    """Rows of expert e times w[e].T: a_sorted [S, K] (by expert), w [E, N, K] -> [S, N].

    expert_ends [E] int32: rows expert_ends[e-1]:expert_ends[e] belong to expert e.
    torch._grouped_mm(mat_a [S, K], mat_b [E, K, N], offs=[E] int32) takes bf16 operands with
    16-byte aligned strides; w.transpose(-2, -1) is the column-major [E, K, N] view it reads
    fastest. loop=True is the twin: one matmul per expert (reads the ends on the host).
    """
    if not loop:
        return torch._grouped_mm(a_sorted, w.transpose(-2, -1), offs=expert_ends)
    out = a_sorted.new_empty(a_sorted.shape[0], w.shape[1])
    start = 0
    for expert, end in enumerate(expert_ends.tolist()):
        if end > start:
            out[start:end] = a_sorted[start:end] @ w[expert].t()
        start = end
    return out


def grouped_mm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    loop: bool = False,
) -> torch.Tensor:
    """The MoE experts in plain PyTorch around torch._grouped_mm. x [M, H] -> [M, H].

        order        = argsort(topk_ids.flatten())          [S = M*k] slots sorted by expert
        expert_ends  = #slots with id <= e, for each e      [E] int32
        h            = grouped_mm(x[order // k], w13)       [S, 2I]
        a            = act(h)                               [S, I]
        y            = grouped_mm(a, w2) * topk_weights     [S, H], in sorted order
        out[m]       = sum_j y[slot (m, j)]                 [M, H]

    topk_ids must lie in [0, E). No host synchronisation unless loop=True.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)  # [S], [S] int64
    # searchsorted, not bincount + cumsum: bincount reads max(ids) on the host, which a CUDA
    # graph cannot capture
    experts = torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype)
    expert_ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)  # [E]
    x_sorted = x.index_select(0, order // top_k)  # [S, H]
    h = grouped_gemm(x_sorted, w13, expert_ends, loop)  # [S, 2I]
    if MoEActivation.parse(activation) is MoEActivation.SILU:
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up  # [S, I], bf16 throughout, as a plain PyTorch layer does
    else:
        a = apply_activation(activation, h).to(x.dtype)  # float32 inside
    y = grouped_gemm(a, w2, expert_ends, loop)  # [S, H]
    y = y * topk_weights.flatten()[order].to(y.dtype).unsqueeze(1)
    y_slots = torch.empty_like(y).index_copy_(0, order, y)  # back to slot order (m, j)
    return y_slots.view(num_tokens, top_k, -1).sum(dim=1)  # float32 accumulation inside


def check_grouped_mm(device: torch.device, loop: bool) -> None:
    """grouped_mm_experts against fused_experts(backend="torch") on small shapes, before timing.

    Odd M, an expert with no tokens, silu and the interleaved swigluoai.
    """
    num_experts, top_k, hidden, inter, tokens = 8, 2, 256, 128, 37
    gen = seeded(device, "check_grouped_mm")
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(DTYPE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device, generator=gen) / 16).to(DTYPE)
    w2 = (torch.randn(num_experts, hidden, inter, device=device, generator=gen) / 11).to(DTYPE)
    topk_weights, topk_ids = make_routing(tokens, num_experts, top_k, "uniform", gen)
    topk_ids = torch.where(topk_ids == 3, torch.full_like(topk_ids, 5), topk_ids)  # empty group
    # on the CPU also the real op, where this torch runs it there: it checks the operand layout
    variants = (True, False) if loop else (False,)
    for activation in ("silu", "swigluoai"):
        ref = fused_experts(
            x, w13, w2, topk_weights, topk_ids, activation=activation, backend="torch"
        )
        for use_loop in variants:
            how = "per-expert loop" if use_loop else "torch._grouped_mm"
            try:
                out = grouped_mm_experts(x, w13, w2, topk_weights, topk_ids, activation, use_loop)
            except RuntimeError as exc:
                if not loop or use_loop:
                    raise
                print(f"# ({how} does not run on {device}: {exc!s:.100})", file=sys.stderr)
                continue
            err = rel_err(out, ref)
            print(f"# grouped_mm check ({how}, {activation}): rel_err {err:.2e}", file=sys.stderr)
            if not err < 2e-2:
                raise RuntimeError(f"grouped_mm_experts ({how}, {activation}) is wrong: {err}")


# ---------------------------------------------------------------------------------------------
# timing and errors


def time_us(fn, device: torch.device, rep_ms: int) -> tuple[float, str]:
    """Median microseconds of fn: CUDA-graph replays, else plain launches; on CPU, wall time."""
    if device.type != "cuda":
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6, "cpu"
    import triton.testing

    fn()  # compile and autotune outside any capture
    torch.cuda.synchronize()
    try:
        ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
        return ms * 1e3, "graph"
    except Exception as exc:  # capture can fail (a host sync, the allocator): launches
        torch.cuda.synchronize()
        print(
            f"  (CUDA graph timing failed: {type(exc).__name__}: {exc}; do_bench)", file=sys.stderr
        )
        ms = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
        return ms * 1e3, f"launch ({type(exc).__name__})"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    diff = (actual.double() - expected.double()).abs().max()
    scale = expected.double().abs().max()
    return float(diff / scale) if float(scale) > 0 else float(diff)


# ---------------------------------------------------------------------------------------------
# one preset


def bench_preset(
    preset: MoEPreset, args: argparse.Namespace, ceilings: Ceilings, device: torch.device
) -> list[Row]:
    """Every row of one preset: weights made once, each scheme's rows, then all freed."""
    w13, w2 = make_expert_weights(preset, device)
    rows = []
    for quant in [q for q in QUANTS if q in args.quant]:  # bf16 first: fp8 is made from it
        if quant == "bf16":
            run_weights = (w13, w2, None)
        else:
            run_weights = quantize_fp8_block(w13, w2)
            if "grouped_mm" not in args.backends:  # nothing reads the bf16 weights any more
                w13 = w2 = None
        contenders = make_contenders(preset, quant, run_weights, (w13, w2), args, device)
        del run_weights
        rows.extend(bench_scheme(preset, quant, contenders, args, ceilings, device))
        del contenders
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


@dataclass(frozen=True)
class Contender:
    weights: str  # what it reads: "bf16" or "fp8_block"
    run: object  # (x, topk_weights, topk_ids) -> out [M, H]
    reference: object  # the same through fused_experts(backend="torch")


def make_contenders(preset, quant, run_weights, bf16_weights, args, device) -> dict:
    """name -> Contender; run_weights = (w13, w2, quant config or None) of the scheme."""
    w13, w2, qc = run_weights
    act = preset.activation

    def triton_run(x, topk_weights, topk_ids):
        return fused_experts(
            x, w13, w2, topk_weights, topk_ids, activation=act, quant_config=qc, backend="triton"
        )

    def torch_run(x, topk_weights, topk_ids):
        return fused_experts(
            x, w13, w2, topk_weights, topk_ids, activation=act, quant_config=qc, backend="torch"
        )

    w13_bf16, w2_bf16 = bf16_weights
    loop = device.type != "cuda"

    def grouped_mm_run(x, topk_weights, topk_ids):
        return grouped_mm_experts(x, w13_bf16, w2_bf16, topk_weights, topk_ids, act, loop)

    contenders = {}
    if "triton" in args.backends:
        contenders["triton"] = Contender(quant, triton_run, torch_run)
    if "grouped_mm" in args.backends:
        contenders["grouped_mm"] = Contender("bf16", grouped_mm_run, torch_run)
    return contenders


def bench_scheme(preset, quant, contenders, args, ceilings, device) -> list[Row]:
    """The rows of one preset and scheme: every routing and token count, every contender."""
    e, k = preset.num_experts, preset.top_k
    h, i = preset.hidden_size, preset.intermediate_size
    rows = []
    for routing in args.routing:
        for m in args.tokens:
            gen = seeded(device, preset.name, routing, m)  # the same inputs for every scheme
            x = torch.randn(m, h, device=device, generator=gen).to(DTYPE)
            topk_weights, topk_ids = make_routing(m, e, k, routing, gen)
            inputs = (x, topk_weights, topk_ids)
            num_distinct = distinct_experts(topk_ids, e)
            outputs = {name: c.run(*inputs) for name, c in contenders.items()}
            ref = None
            if m * k <= args.ref_max_slots and contenders:
                ref = next(iter(contenders.values())).reference(*inputs)
            for name, contender in contenders.items():
                if ref is not None:
                    err, err_ref = rel_err(outputs[name], ref), f"torch({quant})"
                else:  # too slow in float64: check the contenders against each other
                    others = [o for o in outputs if o != name]
                    err = rel_err(outputs[name], outputs[others[0]]) if others else None
                    err_ref = others[0] if others else "none"
                us, how = time_us(functools.partial(contender.run, *inputs), device, args.rep_ms)
                fp8 = contender.weights == "fp8_block"
                scale_bytes = fp8_block_scale_bytes(num_distinct, h, i) if fp8 else 0.0
                weight_bytes = 1 if fp8 else 2
                num_bytes = moe_bytes(num_distinct, m, k, h, i, weight_bytes, 2, scale_bytes)
                flops = moe_flops(m, k, h, i)
                floor_us = floor_seconds(num_bytes, flops, ceilings, fp8) * 1e6
                row = Row(
                    preset=preset.label,
                    quant=quant,
                    routing=routing,
                    backend=name,
                    weights=contender.weights,
                    tokens=m,
                    distinct=num_distinct,
                    time_us=us,
                    tflops=flops / (us * 1e-6) / 1e12,
                    gbps=num_bytes / (us * 1e-6) / 1e9,
                    floor_us=floor_us,
                    roofline_pct=100.0 * floor_us / us,
                    tokens_per_s=m / (us * 1e-6),
                    rel_err=err,
                    err_ref=err_ref,
                    timing=how,
                )
                rows.append(row)
                print(format_row(row), file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# output

HEADER = (
    f"{'preset':<16} {'quant':<9} {'routing':<7} {'backend':<10} {'weights':<9} {'M':>6} "
    f"{'D':>4} {'time_us':>10} {'TFLOP/s':>8} {'GB/s':>7} {'floor_us':>9} {'roof%':>6} "
    f"{'rel_err':>8} {'vs':<16} timing"
)


def format_row(r: Row) -> str:
    err = "-" if r.rel_err is None else f"{r.rel_err:.1e}"
    return (
        f"{r.preset:<16} {r.quant:<9} {r.routing:<7} {r.backend:<10} {r.weights:<9} "
        f"{r.tokens:>6} {r.distinct:>4} {r.time_us:>10.1f} {r.tflops:>8.1f} {r.gbps:>7.0f} "
        f"{r.floor_us:>9.1f} {r.roofline_pct:>5.1f}% {err:>8} {r.err_ref:<16} {r.timing}"
    )


def csv_list(kind, choices=None):
    """An argparse type: "a,b,c" -> [kind(a), kind(b), kind(c)], each in `choices`."""

    def parse(text: str) -> list:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected a comma list of {choices}, got {text!r}")
        return values

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", type=csv_list(str, tuple(PRESETS)), default=list(PRESETS))
    p.add_argument("--tokens", type=csv_list(int), default=None, help="token counts M")
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS} by default")
    p.add_argument("--quant", type=csv_list(str, QUANTS), default=list(QUANTS))
    p.add_argument("--routing", type=csv_list(str, ROUTINGS), default=list(ROUTINGS))
    p.add_argument("--backends", type=csv_list(str, BACKENDS), default=list(BACKENDS))
    p.add_argument("--ceilings", choices=("auto", "h200", "h100"), default="auto")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--rep-ms", type=int, default=50, help="timed milliseconds per sample set")
    p.add_argument(
        "--ref-max-slots",
        type=int,
        default=8192,
        help="compare with the float64 torch backend where M * k <= this, else across contenders",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: debug run")
    p.add_argument("--scale", type=int, default=None, help="divide H and I (cpu default 32)")
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = list(
            CPU_TOKENS if args.device == "cpu" else QUICK_TOKENS if args.quick else DEFAULT_TOKENS
        )
    if args.scale is None:
        args.scale = 32 if args.device == "cpu" else 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_moe: no CUDA GPU here (torch.cuda.is_available() is False); these timings "
            "need one. --device cpu runs a shrunken debug pass.",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device)
    if args.device == "cuda":
        import triton

        device_name, triton_version = torch.cuda.get_device_name(), triton.__version__
    else:
        device_name, triton_version = "cpu (debug)", "-"
        if "triton" in args.backends and not interpreting():
            print("# cpu: the triton contender needs TRITON_INTERPRET=1; dropped", file=sys.stderr)
            args.backends = [b for b in args.backends if b != "triton"]
    if args.ceilings == "auto":
        ceilings = ceilings_for(device_name) if args.device == "cuda" else H200
    else:
        ceilings = {"h200": H200, "h100": H100}[args.ceilings]

    print(
        f"# {device_name}, torch {torch.__version__}, triton {triton_version}; floors from "
        f"{ceilings.name}: {ceilings.hbm_gbps:.0f} GB/s, bf16 {ceilings.bf16_tflops:.0f} / fp8 "
        f"{ceilings.fp8_tflops:.0f} TFLOP/s",
        file=sys.stderr,
    )
    if "grouped_mm" in args.backends:
        check_grouped_mm(device, loop=args.device != "cuda")

    rows: list[Row] = []
    for name in args.presets:
        preset = PRESETS[name].scaled(args.scale)
        print(
            f"# {preset.label}: E={preset.num_experts} k={preset.top_k} "
            f"H={preset.hidden_size} I={preset.intermediate_size} {preset.activation}",
            file=sys.stderr,
        )
        rows.extend(bench_preset(preset, args, ceilings, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(HEADER)
    for row in rows:
        print(format_row(row))
    if args.json is not None:
        run_info = {"device": device_name, "ceilings": ceilings.name, "torch": torch.__version__}
        dicts = [{**asdict(r), **run_info} for r in rows]
        args.json.write_text(json.dumps(dicts, indent=1))
        print(f"# wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
