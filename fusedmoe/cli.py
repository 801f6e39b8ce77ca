"""The `fusedmoe` command.

fusedmoe demo [--preset qwen3-30b-a3b] [--tokens N] [--device cpu|cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from fusedmoe.presets import PRESETS, get_preset
from fusedmoe.quant.config import SCHEMES

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedmoe", description=__doc__.strip().splitlines()[0])
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
