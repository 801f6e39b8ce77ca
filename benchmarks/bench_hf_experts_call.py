"""Host time of one experts call inside a transformers MoE model's decode, per implementation.

    python benchmarks/bench_hf_experts_call.py [--model qwen3|deepseek] [--layers 4]
                                               [--decode 32] [--rounds 6] [--prefill 0]

bench_hf_model.py times whole decode steps, where the rest of the model (attention, norms, the
model's own router, generate()'s loop) takes most of the time and the host drifts between
runs. This one asks a narrower question: how long does the host spend inside the experts call
of one decode step? Each experts module's forward is wrapped in a timer (time.perf_counter
around the call; calls of one token only), so what an implementation costs the host is
measured in the model, where cold caches and a busy driver make every call slower than the
same call in a loop.

Implementations (the same weights and prompt; one copy of the model each, all alive at once),
built as bench_hf_model.py builds them:
    grouped_mm   transformers' grouped_mm experts implementation
    batched_mm   transformers' batched-mm experts (each slot's expert weights gathered, then
                 bmm); skipped with --prefill, where it gathers a copy of the weights per slot
    fusedmoe     fusedmoe's registered experts implementation
    no_experts   an experts function that returns its input: the floor of the other rows
    patched      fusedmoe.integrations.transformers.patch(): whole MoE blocks replaced, so the
                 timer wraps the block (the router included), not the experts alone
The timer wraps each experts module's (or block's) forward on the instance, outside
transformers' dispatch: a transformers build that hands one-token calls of one implementation
to another is timed doing so.

Rows: decode ms per token (greedy generation of --decode tokens after a 16-token prompt,
the implementations taking turns for --rounds rounds after a warm-up, median), its ratio to
grouped_mm's, and the median and mean host microseconds of one timed call. --prefill N runs a
forward of N tokens before each generate() (as bench_hf_model.py does), so the decode graphs
replay between prefill-sized ones.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hf_model as hf  # the models and helpers of the sibling benchmark

IMPLS = ("grouped_mm", "batched_mm", "fusedmoe", "no_experts", "patched")


def timed_forward(module: torch.nn.Module, samples: list[float]) -> None:
    """Time `module`'s forward in place: the host seconds of each call of one token (its input
    [T, H] or [B, T, H]) go to `samples`. The wrapper sits on the instance, outside whatever the
    class's forward dispatches to, so an experts module is timed as transformers runs it
    (including any choice its dispatch makes by the call's size)."""
    forward = module.forward

    def timed(hidden_states, *args, **kwargs):
        start = time.perf_counter()
        out = forward(hidden_states, *args, **kwargs)
        if hidden_states.shape[:-1].numel() == 1:
            samples.append(time.perf_counter() - start)
        return out

    module.forward = timed


def prepare(base: torch.nn.Module, impl: str, samples: list[float]) -> torch.nn.Module:
    """A copy of `base` running `impl` (as bench_hf_model builds it), each one-token call of
    its experts modules (or, patched, its FusedMoE blocks) timed."""
    from fusedmoe.integrations.transformers import FusedMoEBlock

    model, _ = hf.prepare(base, impl)
    for module in model.modules():
        if isinstance(module, FusedMoEBlock) if impl == "patched" else hf.is_experts(module):
            timed_forward(module, samples)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(hf.SIZES), default="qwen3")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prefill", type=int, default=0, help="tokens of a forward before each")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hf_experts_call: needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = [i for i in args.impls if not (args.prefill and i == "batched_mm")]
    base = hf.build_model(args.model, args.layers, "cuda")
    prompt = torch.randint(0, base.config.vocab_size, (1, hf.PROMPT), device="cuda")
    prefill = torch.randint(0, base.config.vocab_size, (1, max(args.prefill, 1)), device="cuda")
    samples = {impl: [] for impl in impls}
    models = {}
    with torch.inference_mode():
        for impl in impls:
            model = prepare(base, impl, samples[impl])
            if args.prefill:
                model(prefill)
            hf._generate(model, prompt, args)  # warm-up: kernels compiled, graphs captured
            models[impl] = model
        for timed in samples.values():
            timed.clear()
        decode = collections.defaultdict(list)
        for _ in range(args.rounds):
            for impl, model in models.items():
                if args.prefill:
                    model(prefill)
                step = hf._once(lambda m=model: hf._generate(m, prompt, args)) / args.decode
                decode[impl].append(step)
    print(
        f"# {torch.cuda.get_device_name()}, {hf.describe(args.model, args.layers)}, decode "
        f"{args.decode} tokens, {args.rounds} rounds, prefill before each: {args.prefill}"
    )
    reference = statistics.median(decode["grouped_mm"]) if "grouped_mm" in decode else None
    print("impl        decode_ms_per_token  vs_grouped_mm  call_host_us_median  call_host_us_mean")
    for impl in impls:
        ms = statistics.median(decode[impl])
        ratio = "-" if reference is None else f"{ms / reference:.2f}x"
        calls = samples[impl]
        print(
            f"{impl:<11} {ms:<20.3f} {ratio:<14} {statistics.median(calls) * 1e6:<20.1f} "
            f"{statistics.mean(calls) * 1e6:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
