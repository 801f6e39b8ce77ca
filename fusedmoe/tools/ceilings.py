"""The ceilings of the roofline floor on this machine: measured once per device name and cached.

    hbm_gbps     the best of three passes over a buffer far larger than the caches: a
                 device-to-device copy (bytes read + written / time), a sum and a bf16
                 matrix-vector product (bytes read / time). Hand-tuned kernels can still read
                 a few % faster (an H200's copy gives 4.2 TB/s, MoE decode kernels 4.5): such
                 rows show roofline_pct over 100; --ceilings h200 takes the 4.8 TB/s datasheet
    bf16_tflops  an 8192^3 bf16 matmul on random data (2 * n^3 / time)
    fp8_tflops   the same through torch._scaled_mm on FP8 e4m3 operands (the bf16 figure where
                 this GPU or torch has no FP8 matmul)

Each figure is the median of timed repeats after warm-up (CUDA events on a GPU,
time.perf_counter on the CPU). The result is written as JSON to
$FUSEDMOE_CACHE_DIR/ceilings/<device name>.json (default ~/.cache/fusedmoe) and read back on
later runs: the measurement takes a few seconds on a GPU, once.

On the CPU the same three figures are measured (smaller sizes; the FP8 figure is the bf16
one), so a CPU benchmark's roofline_pct exists, but it only indicates: the scaled-down
presets' weights fit in the CPU caches, so times can beat a DRAM floor.
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from fusedmoe._paths import CACHE_ENV, cache_dir
from fusedmoe.tools.roofline import H100, H200, Ceilings

__all__ = [
    "CACHE_ENV",
    "NAMED_CEILINGS",
    "cache_dir",
    "device_label",
    "measure_ceilings",
    "measured_ceilings",
    "resolve_ceilings",
]

#: --ceilings h200 / h100: the figures of ../shared/PERFORMANCE.md (fusedmoe.tools.roofline)
NAMED_CEILINGS = {"h200": H200, "h100": H100}


def device_label(device: torch.device) -> str:
    """The name ceilings are cached under: the GPU's name, or "cpu (<processor>)"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine() or 'unknown'})"


def _cache_file(label: str) -> Path:
    return cache_dir() / "ceilings" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", label) + ".json")


# ---------------------------------------------------------------------------------------------
# measuring


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after two warm-up calls."""
    for _ in range(2):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def _fp8_matmul(n: int, device: torch.device) -> Callable[[], object] | None:
    """An n^3 FP8 e4m3 matmul through torch._scaled_mm, or None where it does not run."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as it wants
    one = torch.ones((), device=device)

    def run():
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        run()
        torch.cuda.synchronize(device)
    except (RuntimeError, TypeError):  # no FP8 tensor cores (pre-sm89) or an older torch
        return None
    return run


def _memory_gbps(device: torch.device, num_bytes: int, repeats: int) -> float:
    """The best of three passes over num_bytes: a copy (bytes read + written / time), a sum and
    a bf16 matrix-vector product (bytes read / time; GEMV reads as MoE decode reads weights)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), device, repeats)
    read_s = _median_seconds(lambda: src.sum(dtype=torch.float32), device, repeats)
    matrix = src.view(-1, 8192)  # [R, 8192]
    vector = torch.randn(8192, 1, dtype=torch.bfloat16, device=device)
    gemv_s = _median_seconds(lambda: matrix @ vector, device, repeats)
    return max(2 * num_bytes / copy_s, num_bytes / read_s, num_bytes / gemv_s) / 1e9


def measure_ceilings(device: torch.device | str, *, size: str = "full") -> Ceilings:
    """Measure the three ceilings on `device` now. size "small" shrinks the buffers and
    matrices (tests; the CPU default)."""
    device = torch.device(device)
    small = size == "small" or device.type == "cpu"
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    repeats = 3 if device.type == "cpu" else 5 if small else 20
    # a buffer far larger than L2 (50-60 MB on Hopper) or than a CPU's last-level cache
    hbm_gbps = _memory_gbps(device, (1 << 26) if small else (1 << 31), repeats)
    n = 256 if device.type == "cpu" else (2048 if small else 8192)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bf16_tflops = 2 * n**3 / _median_seconds(lambda: a @ b, device, repeats) / 1e12
    fp8 = _fp8_matmul(n, device)
    fp8_tflops = bf16_tflops
    if fp8 is not None:
        fp8_tflops = 2 * n**3 / _median_seconds(fp8, device, repeats) / 1e12
    return Ceilings(
        hbm_gbps=hbm_gbps,
        bf16_tflops=bf16_tflops,
        fp8_tflops=fp8_tflops,
        name=f"measured on {device_label(device)}",
    )


def measured_ceilings(device: torch.device | str, *, refresh: bool = False) -> Ceilings:
    """The ceilings of this device, measured on the first call and read from the cache after."""
    device = torch.device(device)
    label = device_label(device)
    path = _cache_file(label)
    if path.is_file() and not refresh:
        try:
            raw = json.loads(path.read_text())
            return Ceilings(
                hbm_gbps=float(raw["hbm_gbps"]),
                bf16_tflops=float(raw["bf16_tflops"]),
                fp8_tflops=float(raw["fp8_tflops"]),
                name=str(raw["name"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measure again and overwrite it
    ceilings = measure_ceilings(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(ceilings), indent=1) + "\n")
    except OSError:
        pass  # a read-only home: measured again next time
    return ceilings


def resolve_ceilings(
    mode: str,
    device: torch.device | str,
    *,
    hbm_gbps: float | None = None,
    bf16_tflops: float | None = None,
    fp8_tflops: float | None = None,
) -> Ceilings:
    """The ceilings a benchmark uses: mode "auto" (measured, cached), "h200" or "h100"
    (PERFORMANCE.md's figures); each figure given explicitly replaces that one. With all three
    given nothing is measured."""
    overrides = {
        name: value
        for name, value in (
            ("hbm_gbps", hbm_gbps),
            ("bf16_tflops", bf16_tflops),
            ("fp8_tflops", fp8_tflops),
        )
        if value is not None
    }
    for name, value in overrides.items():
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if mode in NAMED_CEILINGS:
        base = NAMED_CEILINGS[mode]
    elif mode == "auto":
        if len(overrides) == 3:
            return Ceilings(**overrides, name="given")
        base = measured_ceilings(device)
    else:
        raise ValueError(f"ceilings must be 'auto' or one of {list(NAMED_CEILINGS)}, got {mode!r}")
    if not overrides:
        return base
    return replace(base, **overrides, name=f"{base.name}, with {', '.join(overrides)} given")
