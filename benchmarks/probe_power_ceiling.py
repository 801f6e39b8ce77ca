"""What the GPU sustains at its power cap: dense FP8 and bf16 GEMMs and deepseek-v3's block-scaled
grouped GEMM1 (our wgmma GEMM, and DeepGEMM's where importable), each replayed back to back
from a CUDA graph for --seconds after two idle seconds. "burst" is the first timed window,
"sustained" the median of the windows in the second half; the SM clock range and the mean
power over the second half come from nvidia-smi, polled every 0.1 s.

    PYTHONPATH=.:.vendor python3 benchmarks/probe_power_ceiling.py [--seconds 6]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusedmoe.kernels import deep_gemm_moe as dg
from fusedmoe.kernels.deep_gemm_lib import find_library
from fusedmoe.kernels.wgmma_gemm import wgmma_grouped_gemm
from fusedmoe.quant.formats import FP8_DTYPE


class Smi:
    """(time, SM MHz, W) samples from nvidia-smi on a background thread."""

    def __init__(self):
        self.samples: list[tuple[float, int, float]] = []
        self.stop = False
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self):
        query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
        while not self.stop:
            out = subprocess.run(query, capture_output=True, text=True).stdout.strip()
            try:
                clock, power = out.splitlines()[0].split(",")
                self.samples.append((time.time(), int(clock), float(power)))
            except (ValueError, IndexError):
                pass
            time.sleep(0.1)

    def between(self, t0: float, t1: float):
        picked = [(c, p) for t, c, p in self.samples if t0 <= t <= t1]
        if not picked:
            return None, None
        clocks = [c for c, _ in picked]
        return (min(clocks), max(clocks)), sum(p for _, p in picked) / len(picked)


def phase(fn, flops: float, seconds: float, smi: Smi):
    torch.cuda.synchronize()
    time.sleep(2.0)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t0 = time.time()
    windows = []
    while time.time() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        end.synchronize()
        windows.append((time.time() - t0, 3 * flops / (start.elapsed_time(end) * 1e-3) / 1e12))
    late = sorted(w for t, w in windows if t >= seconds / 2)
    clocks, power = smi.between(t0 + seconds / 2, time.time())
    return windows[0][1], late[len(late) // 2], clocks, power


def _dense(dev, seconds: float, smi: Smi) -> dict:
    """The dense 8192^3 GEMMs: FP8 through torch._scaled_mm, bf16 through matmul."""
    n = 8192
    a8 = (torch.randn(n, n, device=dev) * 0.5).to(FP8_DTYPE)
    b8 = (torch.randn(n, n, device=dev) * 0.5).to(FP8_DTYPE).t()
    one = torch.ones((), device=dev)
    ab = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bb = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    return {
        "dense fp8 _scaled_mm 8192^3": phase(
            lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
            2 * n**3, seconds, smi,
        ),
        "dense bf16 matmul 8192^3": phase(lambda: ab @ bb, 2 * n**3, seconds, smi),
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_power_ceiling: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    smi = Smi()
    results = _dense(dev, args.seconds, smi)
    tokens, e, k, width, hidden = 16384, 256, 8, 4096, 7168  # deepseek-v3's GEMM1
    groups = hidden // 128
    ids = torch.randn(tokens, e, device=dev).topk(k, dim=1).indices.to(torch.int32)
    x = (torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16) * 2).to(FP8_DTYPE)
    x_s = torch.rand(tokens, groups, device=dev) * 0.02 + 0.001
    w = (torch.randn(e, width, hidden, device=dev, dtype=torch.bfloat16) * 2).to(FP8_DTYPE)
    w_s = torch.rand(e, width // 128, groups, device=dev) * 0.02 + 0.001
    m_sum, _ = dg.compute_aligned_M_and_alignment(tokens, k, e, 128)
    scale_out = torch.empty(groups, m_sum, device=dev).t()
    lay = dg.permute_contiguous(x, x_s, ids, e, 128, m_sum, scale_out=scale_out)
    out = torch.empty(m_sum, width, device=dev, dtype=torch.bfloat16)
    flops = 2 * tokens * k * width * hidden
    results["ours, deepseek-v3 GEMM1 M=16384"] = phase(
        lambda: wgmma_grouped_gemm(
            lay.a, lay.a_scale, w, w_s, out, lay.expert_ids, lay.num_rows, 128
        ),
        flops, args.seconds, smi,
    )  # fmt: skip
    lib = find_library()
    if lib is not None:
        results["DeepGEMM, deepseek-v3 GEMM1 M=16384"] = phase(
            lambda: lib.contiguous(lay.a, lay.a_scale, w, w_s, out, lay.m_indices),
            flops, args.seconds, smi,
        )  # fmt: skip
    smi.stop = True
    print(f"# {torch.cuda.get_device_name()}")
    print(f"{'what':<38}{'burst TFLOP/s':>14}{'sustained':>11}  SM MHz (sustained)  W")
    for name, (burst, sustained, clocks, power) in results.items():
        tail = "" if clocks is None else f"  {clocks[0]}-{clocks[1]}  {power:.0f}"
        print(f"{name:<38}{burst:>14.0f}{sustained:>11.0f}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
