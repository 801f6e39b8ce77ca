"""Time the reference ("torch") and "monolithic" backends on the CPU, for the oracle's preference.

    python benchmarks/bench_cpu_backends.py [--scale 16] [--ms 1 16 128] [--repeats 15]
                                            [--dtypes bfloat16 float32] [--threads N]
                                            [--json rows.json]

For each preset of fusedmoe.tools.presets (hidden and intermediate sizes divided by --scale, as the
CPU demo does; experts, top-k and routing as the model has them), each dtype and each M: a
FusedMoE layer with random weights, run under inference_mode on both backends with the same
weights and inputs. Reported: the median wall time of --repeats calls after two warm-up calls
(time_ms), tokens/s and GFLOP/s of the monolithic backend (2 * M * k * (N * H + H * I) routed
FLOPs), the speedup torch / monolithic, and each backend's relative error ||y - ref|| / ||ref||
against the float64 reference (the torch backend on a float64 copy of the layer). gpt-oss runs
with gpt_oss_routing=True (top-k over the logits, then softmax over the k).

Both backends read every routed expert's weights once per call, so at decode sizes the time is
the weights' memory traffic: the reference also converts them to float64, monolithic reads them
in the activation dtype (bfloat16 halves the traffic of float32). On a CPU without native
bfloat16 matmuls a tiny bfloat16 GEMM costs ~10 us of fixed overhead, which is why scaled-down
bfloat16 shapes at M = 1 gain least.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import fusedmoe  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe.tools.presets import PRESETS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BACKENDS = ("torch", "monolithic")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=int, default=16, help="divide H and I by this")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float32"])
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=list(PRESETS))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return p.parse_args(argv)


def time_ms(fn, repeats: int) -> float:
    """Median wall time of fn() in milliseconds, after two warm-up calls."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def bench_case(preset, dtype: torch.dtype, num_tokens: int, repeats: int) -> dict:
    extra = {"gpt_oss_routing": True} if preset.activation == "swigluoai" else {}
    layer = preset.build(dtype=dtype, device="cpu", **extra)
    reference = copy.deepcopy(layer).to(torch.float64)
    reference.set_backend("torch")
    x = torch.randn(num_tokens, preset.hidden_size, dtype=dtype)
    logits = torch.randn(num_tokens, preset.num_experts)
    row = {
        "preset": preset.label,
        "dtype": str(dtype).removeprefix("torch."),
        "M": num_tokens,
    }
    with torch.inference_mode():
        ref = reference(x.double(), logits)
        for name in BACKENDS:
            layer.set_backend(name)
            row[f"{name}_ms"] = time_ms(lambda: layer(x, logits), repeats)
            row[f"{name}_err"] = relative_error(layer(x, logits), ref)
    num_n = 2 * preset.intermediate_size if "no_mul" not in preset.activation else 0
    flops = 2 * num_tokens * preset.top_k * preset.hidden_size
    flops *= (num_n or preset.intermediate_size) + preset.intermediate_size
    seconds = row["monolithic_ms"] / 1e3
    row["speedup"] = row["torch_ms"] / row["monolithic_ms"]
    row["mono_tok_s"] = num_tokens / seconds
    row["mono_gflop_s"] = flops / seconds / 1e9
    return row


def format_table(rows: list[dict]) -> str:
    columns = [
        ("preset", "preset", "{}"),
        ("dtype", "dtype", "{}"),
        ("M", "M", "{}"),
        ("torch_ms", "torch_ms", "{:.3f}"),
        ("monolithic_ms", "monolithic_ms", "{:.3f}"),
        ("speedup", "speedup", "{:.1f}x"),
        ("mono_tok_s", "mono tok/s", "{:,.0f}"),
        ("mono_gflop_s", "mono GFLOP/s", "{:.2f}"),
        ("torch_err", "torch rel_err", "{:.1e}"),
        ("monolithic_err", "mono rel_err", "{:.1e}"),
    ]
    cells = [[fmt.format(r[key]) for key, _, fmt in columns] for r in rows]
    heads = [head for _, head, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"CPU backends, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"H and I divided by {args.scale} (rounded up to a multiple of 32), "
        f"median of {args.repeats} calls under inference_mode"
    )
    rows = []
    for name in args.presets:
        preset = PRESETS[name].scaled(args.scale)
        for dtype_name in args.dtypes:
            for num_tokens in args.ms:
                rows.append(bench_case(preset, DTYPES[dtype_name], num_tokens, args.repeats))
    print(format_table(rows))
    slower = [r for r in rows if r["speedup"] < 1.0]
    where = [(r["preset"], r["dtype"], r["M"]) for r in slower]
    print(
        f"monolithic faster than torch in {len(rows) - len(slower)} of {len(rows)} cases"
        + (f"; slower in: {where}" if slower else "")
    )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
