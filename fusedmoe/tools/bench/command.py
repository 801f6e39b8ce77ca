"""`fusedmoe bench`: from parsed arguments to the table, JSON, CSV and plot (tools.cli parses).

Shapes: presets (real sizes on a GPU; on the CPU divided by --scale, default 16, and labelled
"(scaled 1/16)") or one custom --experts --top-k --hidden --intermediate shape, as given.
--eager times host cost per call instead (fusedmoe.tools.bench.eager); --backward a training
step, forward and backward, against grouped_mm under autograd (fusedmoe.tools.bench.backward).
--peers adds other libraries' kernels to the forward bench's table (fusedmoe.tools.peers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fusedmoe._triton import has_triton
from fusedmoe.oracle import backend_names
from fusedmoe.tools.bench.contenders import BASELINES
from fusedmoe.tools.bench.report import (
    Progress,
    format_table,
    plot_available,
    write_csv,
    write_json,
    write_plot,
)
from fusedmoe.tools.bench.sweep import BenchSpec, run_bench
from fusedmoe.tools.ceilings import device_label, resolve_ceilings
from fusedmoe.tools.presets import PRESETS, MoEPreset, get_preset

__all__ = ["CPU_SCALE", "CPU_TOKENS", "GPU_TOKENS", "run_bench_command"]

GPU_TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
CPU_TOKENS = (1, 8, 64)
#: on the CPU presets' hidden and intermediate sizes are divided by this unless --scale says
CPU_SCALE = 16
_CUSTOM = ("experts", "top_k", "hidden", "intermediate")


def _fail(message: str) -> int:
    print(f"fusedmoe bench: {message}", file=sys.stderr)
    return 2


def _shapes(args: argparse.Namespace, device: torch.device) -> list[MoEPreset]:
    given = [name for name in _CUSTOM if getattr(args, name) is not None]
    if given:
        if len(given) != len(_CUSTOM):
            missing = [f"--{n.replace('_', '-')}" for n in _CUSTOM if n not in given]
            raise ValueError(f"a custom shape needs all four sizes; missing {' '.join(missing)}")
        if args.preset is not None:
            raise ValueError("give either --preset or a custom shape (--experts ...), not both")
        sizes = [getattr(args, n) for n in _CUSTOM]
        if any(v < 1 for v in sizes):
            raise ValueError(f"--experts --top-k --hidden --intermediate must be >= 1, got {sizes}")
        if args.top_k > args.experts:
            raise ValueError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
        return [MoEPreset("custom", *sizes, activation=args.activation)]
    scale = args.scale if args.scale is not None else (CPU_SCALE if device.type == "cpu" else 1)
    if scale < 1:
        raise ValueError(f"--scale must be >= 1, got {scale}")
    names = args.preset if args.preset is not None else list(PRESETS)
    return [get_preset(name).scaled(scale) for name in names]


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA GPU is visible (--device cpu runs scaled)")
    return torch.device(name)


def run_bench_command(args: argparse.Namespace) -> int:
    try:
        device = _device(args.device)
        shapes = _shapes(args, device)
    except ValueError as exc:
        return _fail(str(exc))
    if args.backends is not None:
        known = [*backend_names(), *BASELINES]
        unknown = [b for b in args.backends if b not in known]
        if unknown:
            from fusedmoe.tools.peers import PEERS

            peers = [b for b in unknown if b in PEERS]
            hint = f" ({', '.join(peers)}: a peer, give it with --peers)" if peers else ""
            return _fail(f"unknown backend(s) {unknown}; expected names of {known}{hint}")
    eager, backward = getattr(args, "eager", False), getattr(args, "backward", False)
    peers = getattr(args, "peers", None) or []
    if eager and backward:
        return _fail("--eager and --backward are two modes: give one")
    if (eager or backward) and peers:
        return _fail("--peers applies to the forward bench, not --eager / --backward")
    if (eager or backward) and getattr(args, "fast_accum", False):
        return _fail("--fast-accum applies to the forward bench, not --eager / --backward")
    if backward:
        from fusedmoe.tools.bench import backward as backward_mode

        if args.plot is not None:
            return _fail("--backward writes --json and --csv, not --plot")
        cpu = device.type == "cpu"
        tokens = args.tokens or list(backward_mode.CPU_TOKENS if cpu else backward_mode.GPU_TOKENS)
        return backward_mode.run_backward_command(args, device, shapes, tokens)
    if args.plot is not None and (why := plot_available()) is not None:
        return _fail(why)
    tokens = args.tokens or list(CPU_TOKENS if device.type == "cpu" else GPU_TOKENS)
    if eager:
        from fusedmoe.tools.bench.eager import run_eager_command

        return run_eager_command(args, device, shapes, tokens)
    ceilings = resolve_ceilings(
        args.ceilings, device, hbm_gbps=args.hbm_gbps, bf16_tflops=args.bf16_tflops,
        fp8_tflops=args.fp8_tflops,
    )  # fmt: skip
    try:
        spec = BenchSpec(
            presets=shapes,
            quants=args.quant,
            tokens=tokens,
            routings=args.routing,
            device=device,
            ceilings=ceilings,
            backends=args.backends,
            rep_ms=args.rep_ms,
            ref_max_slots=args.ref_max_slots,
            fast_accum=getattr(args, "fast_accum", False),
            peers=list(peers),
        )
    except ValueError as exc:
        return _fail(str(exc))
    label = device_label(device)
    triton_version = "-"
    if has_triton():
        import triton

        triton_version = triton.__version__
    header = [
        f"fusedmoe bench on {label}, torch {torch.__version__}, triton {triton_version}",
        f"floor ceilings ({ceilings.name}): {ceilings.hbm_gbps:.1f} GB/s, bf16 "
        f"{ceilings.bf16_tflops:.3g} / fp8 {ceilings.fp8_tflops:.3g} TFLOP/s",
    ]
    if device.type == "cpu":
        header.append(
            "cpu: time.perf_counter medians; the floor only indicates (the weights fit in caches)"
        )
    notes: list[str] = []
    progress = Progress(spec.num_cases, quiet=args.quiet)
    try:
        rows = run_bench(spec, note=notes.append, step=progress.step)
    finally:
        progress.finish()
    print("\n".join(f"# {line}" for line in [*header, *notes]))
    print(format_table(rows))
    run_info = {
        "device": label,
        "ceilings": ceilings.name,
        "hbm_gbps": ceilings.hbm_gbps,
        "bf16_tflops": ceilings.bf16_tflops,
        "fp8_tflops": ceilings.fp8_tflops,
        "torch": torch.__version__,
    }
    for path, write in ((args.json, write_json), (args.csv, write_csv)):
        if path is not None:
            write(Path(path), rows, run_info)
            print(f"# wrote {len(rows)} rows to {path}")
    if args.plot is not None:
        write_plot(Path(args.plot), rows, f"fusedmoe bench on {label} (floor: {ceilings.name})")
        print(f"# wrote the plot to {args.plot}")
    return 0 if rows else 1
