"""The `fusedmoe` command: argument parsing, then one driver per subcommand.

fusedmoe demo      [--preset qwen3-30b-a3b] [--tokens N] [--device cpu|cuda] [--dtype bfloat16]
fusedmoe bench     [--preset a,b | --experts E --top-k k --hidden H --intermediate I]
                   [--quant bf16,fp8_block] [--tokens 1,8,64] [--routing uniform,skewed]
                   [--backends triton,...] [--json F] [--csv F] [--plot F.png]     (tools.bench)
                   [--peers triton_kernels]: other libraries in the same table  (tools.peers)
                   [--eager]: eager vs CUDA-graph time, host us, launches, syncs per call
                   [--backward]: forward + backward vs grouped_mm under autograd: time,
                   peak memory, roofline, gradients checked
fusedmoe tune      [--preset a,b | custom shape] [--dtype bf16,fp8_block] [--tokens ...]
                   [--out DIR | --ship] [--budget-s S] [--rule keep-uniform]       (tools.tune)
fusedmoe backends  [--json]                                              (tools.capabilities)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from fusedmoe.activation import MoEActivation
from fusedmoe.quant.config import SCHEMES
from fusedmoe.tools.presets import PRESETS, get_preset

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: relative (norm) error the demo accepts against the float64 reference
DTYPE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
QUANT_TOLERANCE = {
    "fp8_tensor": 0.12,
    "fp8_channel": 0.12,
    "fp8_block": 0.12,
    "mxfp8": 0.12,
    "int8": 0.05,
    "mxfp4_w4a8": 0.3,
    "mxfp4_w4a16": 0.3,
    "nvfp4": 0.3,
    "nvfp4_w4a16": 0.3,
    "int4_w4a16": 0.3,
    "int8_w8a16": 0.05,
}
#: on the CPU the demo divides hidden and intermediate sizes by this, so it runs in seconds
CPU_SCALE = 16


def _time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn() in milliseconds, after two warm-up calls."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _table(rows: list[dict[str, str]]) -> str:
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(widths[k]) for k in keys)]
    lines.append("  ".join("-" * widths[k] for k in keys))
    lines += ["  ".join(r[k].ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)


HF_DEMO_TOKENS = 20


def run_hf_demo(args: argparse.Namespace, device: torch.device) -> int:
    """A tiny random Qwen3-MoE: greedy generation, original vs patched, and both timings."""
    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        import fusedmoe.integrations.transformers as fmt
    except ImportError as exc:
        print(f"fusedmoe demo --hf needs transformers 5: pip install 'fusedmoe[hf]' ({exc})",
              file=sys.stderr)  # fmt: skip
        return 2
    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
    )
    torch.manual_seed(args.seed)
    original = Qwen3MoeForCausalLM(config).to(device=device, dtype=torch.float32).eval()
    patched = copy.deepcopy(original)
    report = fmt.patch(patched, backend=args.backend)
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=device)
    new_tokens = HF_DEMO_TOKENS

    def generate(model):
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False)  # fmt: skip

    with torch.inference_mode():
        outputs = {name: generate(m) for name, m in (("original", original), ("patched", patched))}
        times = {
            name: _time_ms(lambda m=m: generate(m), device, args.repeats)
            for name, m in (("original", original), ("patched", patched))
        }
    same = torch.equal(outputs["original"], outputs["patched"])
    print(
        f"fusedmoe demo --hf: tiny random Qwen3-MoE (2 layers, H=128, E=16, k=4, I=64), float32 "
        f"on {device.type}, greedy generation of {new_tokens} tokens; patched "
        f"{len(report.replaced)} MoE blocks ({len(report.skipped)} skipped)"
    )
    rows = [
        {
            "model": name,
            "time_ms": f"{times[name]:.1f}",
            "tokens/s": f"{new_tokens / (times[name] / 1e3):,.0f}",
            "tokens": " ".join(map(str, outputs[name][0, prompt.shape[1] :][:8].tolist())) + " ...",
        }
        for name in ("original", "patched")
    ]
    print(_table(rows))
    print(f"identical tokens: {same}")
    return 0 if same else 1


def run_demo(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fusedmoe demo: --device cuda, but no CUDA GPU is visible", file=sys.stderr)
        return 2
    if args.hf:
        return run_hf_demo(args, device)
    if args.tokens < 0:
        print(f"fusedmoe demo: --tokens must be >= 0, got {args.tokens}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    preset = get_preset(args.preset)
    scale = args.scale if args.scale is not None else (CPU_SCALE if device.type == "cpu" else 1)
    if scale < 1:
        print(f"fusedmoe demo: --scale must be >= 1, got {scale}", file=sys.stderr)
        return 2
    preset = preset.scaled(scale)

    torch.manual_seed(args.seed)
    layer = preset.build(dtype=dtype, device=device, backend=args.backend)
    float_layer = copy.deepcopy(layer)
    if args.quant != "none":
        layer.quantize_(args.quant)
    x = torch.randn(args.tokens, preset.hidden_size, dtype=dtype, device=device)
    logits = torch.randn(args.tokens, preset.num_experts, dtype=torch.float32, device=device)
    choice = layer.backend_choice()

    with torch.inference_mode():
        out = layer(x, logits)
        # the reference: the torch backend on a float64 copy of the unquantized layer
        reference_layer = float_layer.to(torch.float64)
        reference_layer.set_backend("torch")
        ref = reference_layer(x.double(), logits)
        err = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
        ms = _time_ms(lambda: layer(x, logits), device, args.repeats)

    print(
        f"fusedmoe demo: {preset.label}: E={preset.num_experts} k={preset.top_k} "
        f"H={preset.hidden_size} I={preset.intermediate_size}, {args.tokens} tokens, "
        f"{args.dtype} on {device.type}"
        + ("" if args.quant == "none" else f", {args.quant} experts")
    )
    if scale > 1:
        print(
            f"  (hidden and intermediate sizes divided by {scale}, rounded up to a multiple of "
            "32, so the run takes seconds; --scale 1 for the real sizes)"
        )
    tokens_per_s = args.tokens / (ms / 1e3) if ms > 0 else float("inf")
    row = {
        "backend": choice.name,
        "why chosen": choice.reason,
        "time_ms": f"{ms:.3f}",
        "tokens/s": f"{tokens_per_s:,.0f}",
        "rel_err": f"{err:.2e}",
    }
    print(_table([row]))
    for name, why in choice.refused.items():
        print(f"  not {name}: {why}")
    tolerance = QUANT_TOLERANCE.get(args.quant) or DTYPE_TOLERANCE[dtype]
    if not err <= tolerance:
        print(f"FAILED: relative error {err:.2e} above {tolerance:.0e}", file=sys.stderr)
        return 1
    return 0


def _routing_name(text: str) -> str:
    from fusedmoe.tools.bench.inputs import skew_strength

    skew_strength(text)  # a ValueError: argparse reports it
    return text


def csv_list(kind=str, choices: Sequence | None = None):
    """An argparse type: "a,b,c" -> [kind(a), kind(b), kind(c)], each in `choices`."""

    def parse(text: str) -> list:
        try:
            values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"in {text!r}: {exc}") from None
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not among {list(choices)}")
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
        return values

    return parse


def _add_shape_arguments(p: argparse.ArgumentParser, preset_help: str) -> None:
    p.add_argument("--preset", type=csv_list(str, tuple(PRESETS)), default=None, help=preset_help)
    shape = p.add_argument_group("a custom shape instead of presets (all four)")
    shape.add_argument("--experts", type=int, default=None, help="E")
    shape.add_argument("--top-k", type=int, default=None, help="k")
    shape.add_argument("--hidden", type=int, default=None, help="H")
    shape.add_argument("--intermediate", type=int, default=None, help="I")
    shape.add_argument("--activation", default="silu", choices=[a.value for a in MoEActivation])


def run_bench(args: argparse.Namespace) -> int:
    if args.ep > 1:
        if getattr(args, "peers", None):
            print("fusedmoe bench: --peers applies to the single-GPU bench, not --ep",
                  file=sys.stderr)  # fmt: skip
            return 2
        return run_ep_bench(args)
    from fusedmoe.tools.bench.command import run_bench_command

    return run_bench_command(args)


def run_ep_bench(args: argparse.Namespace) -> int:
    """`fusedmoe bench --ep N` under torchrun: the expert-parallel layer (tools.ep_bench)."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.ep:
        print(
            f"fusedmoe bench --ep {args.ep} runs one process per rank: launch it as "
            f"`torchrun --nproc-per-node {args.ep} -m fusedmoe bench --ep {args.ep} ...` "
            f"(WORLD_SIZE is {world})",
            file=sys.stderr,
        )
        return 2
    if args.experts is not None or (args.preset and len(args.preset) != 1):
        print("fusedmoe bench --ep takes one --preset (no custom shape)", file=sys.stderr)
        return 2
    from fusedmoe.tools import ep_bench

    argv = ["--preset", args.preset[0] if args.preset else "deepseek-v3"]
    argv += ["--dtypes", ",".join(args.quant)]
    if args.ep_kinds:
        argv += ["--kinds", ",".join(args.ep_kinds)]
    if args.tokens:
        argv += ["--tokens", ",".join(map(str, args.tokens))]
    if args.backends:
        argv += ["--backend", args.backends[0]]
    if args.device != "auto":
        argv += ["--device", args.device]
    if args.scale:
        argv += ["--scale", str(args.scale)]
    if args.json:
        argv += ["--json", args.json]
    if args.check:
        argv.append("--check")
    if args.ep_graph:
        argv.append("--graph")
    if args.ep_max_tokens is not None:
        argv += ["--max-tokens", str(args.ep_max_tokens)]
    return ep_bench.main(argv)


def run_tune(args: argparse.Namespace) -> int:
    from fusedmoe.tools.tune import run_tune_command

    return run_tune_command(args)


def run_backends(args: argparse.Namespace) -> int:
    import json

    from fusedmoe.tools.capabilities import as_json, capability_matrix, format_matrix

    matrix = capability_matrix()
    if args.json:
        print(json.dumps(as_json(matrix), indent=1))
    else:
        print(format_matrix(matrix))
    return 0


def _add_bench(sub) -> None:
    from fusedmoe.tools.bench.command import CPU_SCALE, CPU_TOKENS, GPU_TOKENS
    from fusedmoe.tools.bench.sweep import QUANTS
    from fusedmoe.tools.ceilings import NAMED_CEILINGS
    from fusedmoe.tools.peers import PEERS

    p = sub.add_parser(
        "bench",
        help="time every backend that supports a shape here, beside grouped_mm and eager",
        description="Time every backend that supports the shape and scheme on this machine, "
        "beside two baselines (grouped_mm: torch._grouped_mm; eager: a per-expert loop), "
        "against the roofline floor, checked against the reference backend.",
    )
    _add_shape_arguments(p, "presets (default: all); on the CPU scaled down by --scale")
    p.add_argument(
        "--quant",
        type=csv_list(str, QUANTS),
        default=["bf16"],
        help="bf16, fp16, fp32 or quantization schemes (default bf16)",
    )
    p.add_argument(
        "--tokens",
        type=csv_list(int),
        default=None,
        help=f"token counts (default {GPU_TOKENS} on a GPU, {CPU_TOKENS} on the CPU)",
    )
    p.add_argument(
        "--routing",
        type=csv_list(_routing_name),
        default=["uniform"],
        help="uniform, skewed (popularity ~ 1/rank^1.2 at strength 3) or skewed:<strength>",
    )
    p.add_argument(
        "--backends",
        type=csv_list(str),
        default=None,
        help="backends to time (default: every one that supports the config here)",
    )
    p.add_argument(
        "--peers",
        type=csv_list(str, PEERS),
        default=None,
        help="other libraries' MoE kernels to time in the same table, on the same weights and "
        "routing (routing included in their time): triton_kernels (OpenAI's MXFP4 MoE, as "
        "gpt-oss runs on Hopper: mxfp4_w4a16 rows, swigluoai or silu, an sm90 GPU, "
        "triton_kernels importable, e.g. PYTHONPATH=.vendor). Rows a peer does not run are "
        "named in the notes with why",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--scale",
        type=int,
        default=None,
        help=f"divide presets' H and I by this (default {CPU_SCALE} on cpu, 1 on gpu)",
    )
    p.add_argument(
        "--ceilings",
        default="auto",
        choices=["auto", *NAMED_CEILINGS],
        help="floor ceilings: measured once per device and cached (auto), or the figures of "
        "the lent H200 / H100 (docs/performance.md)",
    )
    p.add_argument("--hbm-gbps", type=float, default=None, help="HBM read bandwidth, GB/s")
    p.add_argument("--bf16-tflops", type=float, default=None, help="bf16 matmul peak")
    p.add_argument("--fp8-tflops", type=float, default=None, help="fp8 matmul peak")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--csv", default=None, help="write the rows as CSV here")
    p.add_argument("--plot", default=None, help="write a PNG of time against tokens here")
    p.add_argument("--rep-ms", type=float, default=50.0, help="timed ms per contender and row")
    p.add_argument(
        "--ref-max-slots",
        type=int,
        default=1 << 17,
        help="rows with more M*k slots compare against another contender instead "
        "of the float64 reference",
    )
    p.add_argument(
        "--fast-accum",
        action="store_true",
        help="fp8_block rows: quant configs with fast_accum=True (the wgmma engine's fast "
        "accumulation), labelled fp8_block+fast_accum (the baselines still run the "
        "dequantized bf16 weights)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--eager",
        action="store_true",
        help="time host cost per call instead: the FusedMoE layer, fused_experts and the "
        "grouped_mm pipeline, eager (N calls, one sync) beside CUDA-graph replay, with host "
        "time, launches and syncs per call (fusedmoe.tools.bench.eager)",
    )
    p.add_argument(
        "--backward",
        action="store_true",
        help="time a training step instead: forward + backward of the layer (router gate, "
        "routing, experts; x, gate and expert weights require grad) beside the "
        "torch._grouped_mm pipeline under autograd, with peak memory, percent of the "
        "3x-forward floor and the gradients compared (default tokens 4096,16384 on a GPU; "
        "bf16/fp16/fp32 only; fusedmoe.tools.bench.backward)",
    )
    ep = p.add_argument_group("expert parallelism (under torchrun: one process per rank)")
    ep.add_argument("--ep", type=int, default=1, help="ranks: time the EP layer (tokens per rank)")
    ep.add_argument(
        "--ep-kinds",
        type=csv_list(str, ("naive", "all_to_all", "symm_mem")),
        default=None,
        help="EP prepare/finalize kinds (default naive,all_to_all, and symm_mem where it runs: "
        "CUDA with torch's NVSHMEM)",
    )
    ep.add_argument(
        "--ep-graph",
        action="store_true",
        help="EP: time symm_mem replayed from CUDA graphs (its stages and the forward)",
    )
    ep.add_argument(
        "--ep-max-tokens",
        type=int,
        default=None,
        help="EP: symm_mem's max_tokens_per_rank (default: the largest --tokens)",
    )
    ep.add_argument("--check", action="store_true", help="EP: compare with the unsharded layer")
    p.set_defaults(func=run_bench)


def _add_tune(sub) -> None:
    from fusedmoe.tools.bench.command import GPU_TOKENS
    from fusedmoe.tools.tune import RULES, TUNE_DTYPES, UNIFORM_SLACK

    p = sub.add_parser(
        "tune",
        help="search the Triton kernel configs of a shape on this GPU and write the table",
        description="Search the Triton backend's kernel configs for each token bucket on the "
        "current GPU, verify the winners against the reference, and write the JSON table the "
        "backend loads for this device name. Needs a CUDA GPU.",
    )
    _add_shape_arguments(p, "presets (default: all)")
    p.add_argument(
        "--dtype",
        type=csv_list(str, tuple(TUNE_DTYPES)),
        default=["bf16"],
        help=f"of {list(TUNE_DTYPES)} (default bf16)",
    )
    p.add_argument("--tokens", type=csv_list(int), default=list(GPU_TOKENS), help="M buckets")
    p.add_argument(
        "--out",
        default=None,
        help="table root (default $FUSEDMOE_TUNED_CONFIGS, else the user cache)",
    )
    p.add_argument("--ship", action="store_true", help="write into fusedmoe/kernels/tuned/")
    p.add_argument(
        "--engines-only",
        action="store_true",
        help="fp8_block: only time deep_gemm's GEMM engines (the DeepGEMM library, wgmma) and "
        "write which is faster per bucket; the kernel configs are left as they are",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for the whole run, shared evenly (default: no limit)",
    )
    p.add_argument("--max-configs", type=int, default=40, help="configs timed per bucket at most")
    p.add_argument("--rep-ms", type=float, default=20.0, help="timed ms per config")
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.03,
        help="a config replaces the heuristic's (keep-uniform: today's) only when this much faster",
    )
    p.add_argument(
        "--rule",
        choices=RULES,
        default=RULES[0],
        help="least-worst: the best worst ratio to the fastest time under uniform and skewed "
        "routing (default); keep-uniform: the fastest under skewed routing among the configs no "
        "slower under uniform routing than the tables' entry today (within --uniform-slack)",
    )
    p.add_argument(
        "--uniform-slack",
        type=float,
        default=UNIFORM_SLACK,
        help="keep-uniform: the uniform-routing time a candidate may lose, a fraction of "
        f"today's (default {UNIFORM_SLACK}: about the timings' run-to-run noise)",
    )
    p.set_defaults(func=run_tune)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusedmoe",
        description=(
            "fusedmoe: the Mixture-of-Experts layer of large language models as one PyTorch "
            "module. Run a real model's MoE layer and check it (demo), time the backends "
            "against the roofline and torch._grouped_mm (bench), tune the Triton kernels for "
            "this GPU (tune), or list what each backend supports (backends)."
        ),
    )
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="run one MoE layer of a real model's shape, checked")
    demo.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    demo.add_argument("--tokens", type=int, default=64)
    demo.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    demo.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    demo.add_argument("--backend", default="auto")
    demo.add_argument(
        "--quant", default="none", choices=["none", *SCHEMES], help="quantize the experts online"
    )
    demo.add_argument(
        "--scale",
        type=int,
        default=None,
        help=f"divide hidden and intermediate sizes by this (default {CPU_SCALE} on cpu, 1 on gpu)",
    )
    demo.add_argument("--repeats", type=int, default=5)
    demo.add_argument(
        "--hf",
        action="store_true",
        help="generate with a tiny transformers model, original vs patched (needs fusedmoe[hf])",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=run_demo)
    _add_bench(sub)
    _add_tune(sub)
    backends = sub.add_parser(
        "backends", help="what every backend supports, and whether it runs on this machine"
    )
    backends.add_argument("--json", action="store_true", help="print the matrix as JSON")
    backends.set_defaults(func=run_backends)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"fusedmoe {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
