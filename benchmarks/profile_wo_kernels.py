"""Per-kernel GPU times of one 4-bit weight-only MoE call, fusedmoe's and (with --peer) OpenAI
triton_kernels' on the same experts: where a call's time goes, kernel by kernel (the
one-slot form's question in docs/performance.md, "The one-slot form").

    python benchmarks/profile_wo_kernels.py [--tokens 1,8,64] [--peer]
                                            [--experts 128] [--top-k 4]
                                            [--hidden 2880] [--intermediate 2880]

gpt-oss-120b's experts by default (swigluoai with biases): random N(0, 0.02^2) bf16 weights
quantized to MXFP4 (quantize_experts), random top-k routing of softmax weights. Each call runs
3 times eagerly, then 10 times under torch.profiler; prints per implementation and token count
the kernels' summed time per call and the 8 longest kernels (time per call, launches per
call). --peer needs triton_kernels importable (fusedmoe.tools.peers). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from fusedmoe import fused_experts
from fusedmoe.quant import quantize_experts

_REPS = 10


def _kernel_rows(fn) -> list[tuple[str, float, int]]:
    """(kernel, us per call, launches per call) of fn, longest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(_REPS):
            fn()
        torch.cuda.synchronize()
    rows = [
        (e.key, e.device_time_total / _REPS, e.count // _REPS)
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--peer", action="store_true", help="also OpenAI triton_kernels")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--intermediate", type=int, default=2880)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_wo_kernels.py profiles CUDA kernels: it needs a CUDA GPU")
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    q13, q2, qc = quantize_experts(w13, w2, "mxfp4_w4a16")
    del w13, w2
    b13 = torch.randn(e, 2 * i, device="cuda", generator=gen).to(torch.bfloat16) * 0.1
    b2 = torch.randn(e, h, device="cuda", generator=gen).to(torch.bfloat16) * 0.1
    peer = None
    if args.peer:
        from fusedmoe.tools.bench.inputs import ExpertSet
        from fusedmoe.tools.peers import TritonKernelsMoE

        experts = ExpertSet(q13, q2, qc, None, None, b13, b2)
        peer = TritonKernelsMoE(experts, activation="swigluoai", top_k=k)
    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, h, device="cuda", generator=gen).to(torch.bfloat16)
        logits = torch.randn(m, e, device="cuda", generator=gen)
        scores, ids = logits.topk(k, dim=1)
        weights, ids = torch.softmax(scores, -1), ids.to(torch.int32)

        def ours(x=x, weights=weights, ids=ids):
            return fused_experts(
                x, q13, q2, weights, ids, quant_config=qc, backend="triton",
                activation="swigluoai", w13_bias=b13, w2_bias=b2,
            )  # fmt: skip

        calls = {"fusedmoe": ours}
        if peer is not None:
            from fusedmoe.tools.bench.inputs import RoutingInputs

            routing = RoutingInputs(x, logits, weights, ids)
            calls["triton_kernels"] = lambda routing=routing: peer(routing)
        for name, fn in calls.items():
            rows = _kernel_rows(fn)
            total = sum(us for _, us, _ in rows)
            print(f"{name} tokens {m}: kernels {total:.1f} us a call")
            for kernel, us, count in rows[:8]:
                print(f"    {us:8.1f} us x{count}  {kernel[:90]}")


if __name__ == "__main__":
    main()
