"""How `fusedmoe bench` and `fusedmoe tune` time one call, and how they compare outputs.

    GPU   CUDA-graph replays (triton.testing.do_bench_cudagraph): the call is captured
          repeated, replayed, and the median per call is kept; launch gaps, which dominate at
          decode sizes, are gone, as they are in a served model. A call that reads device
          values on the host cannot be captured: it is timed by plain launches (CUDA events
          around each call, median), and the row says "launch".
    CPU   time.perf_counter around each call, median, after a warm-up call.

The first call (Triton compilation, autotuning, allocator warm-up) is never timed. After a
preset's weights are made (a previous preset's freed), the first graph timings read slow: on a
lent H200, gpt-oss-120b bf16 at M = 1 timed 60.0, 56.5, then 54.0 us in a row after
deepseek-v3's weights were freed (53.4 us first after a smaller preset's). `settle` replays the
call untimed for about a second first; `fusedmoe bench` does it once per preset and scheme,
`fusedmoe tune` once per token bucket.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from fusedmoe._triton import has_triton

__all__ = ["peak_memory_gb", "rel_err", "settle", "time_ms"]


def peak_memory_gb(fn: Callable[[], object], device: torch.device) -> tuple[float, float] | None:
    """(peak GB allocated while fn() runs, GB allocated before it) on a GPU; None on the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 1e9, base / 1e9


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 (0 / 0 -> 0)."""
    if expected.numel() == 0:
        return 0.0
    diff = float((actual.double() - expected.double()).abs().max())
    scale = float(expected.double().abs().max())
    return diff / scale if scale > 0 else diff


def _cpu_ms(fn: Callable[[], object], rep_ms: float, max_repeats: int = 50) -> float:
    fn()
    samples: list[float] = []
    while len(samples) < 3 or (sum(samples) < rep_ms and len(samples) < max_repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _launch_ms(fn: Callable[[], object], rep_ms: float, max_repeats: int = 200) -> float:
    """Median of CUDA-event timed launches, about rep_ms of them (at least 5)."""
    fn()
    torch.cuda.synchronize()
    samples: list[float] = []
    while len(samples) < 5 or (sum(samples) < rep_ms and len(samples) < max_repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def time_ms(
    fn: Callable[[], object],
    device: torch.device,
    *,
    rep_ms: float = 50.0,
    capturable: bool = True,
) -> tuple[float, str]:
    """-> (median milliseconds of one fn() call, how it was timed: "graph", "launch", "cpu")."""
    if device.type != "cuda":
        return _cpu_ms(fn, rep_ms), "cpu"
    fn()  # compile and autotune outside any capture
    torch.cuda.synchronize()
    if capturable and has_triton():
        import triton.testing

        try:
            ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
            return float(ms), "graph"
        except Exception as exc:  # a host read inside the call: capture is impossible
            torch.cuda.synchronize()
            return _launch_ms(fn, rep_ms), f"launch ({type(exc).__name__} in capture)"
    return _launch_ms(fn, rep_ms), "launch"


def settle(
    fn: Callable[[], object],
    device: torch.device,
    *,
    rep_ms: float = 100.0,
    capturable: bool = True,
) -> None:
    """Time fn as time_ms would and drop the result (see the module docstring for why): about
    10 x rep_ms milliseconds of graph replays. No-op on the CPU."""
    if device.type == "cuda":
        time_ms(fn, device, rep_ms=rep_ms, capturable=capturable)
