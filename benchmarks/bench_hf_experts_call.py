"""Host time of one experts call inside a transformers MoE model's decode, per implementation.

    python benchmarks/bench_hf_experts_call.py [--model qwen3|deepseek] [--layers 4]
                                               [--decode 32] [--rounds 6] [--prefill 0]

bench_hf_model.py times whole decode steps, where the rest of the model (attention, norms, the
model's own router, generate()'s loop) takes most of the time and the host drifts between
runs. This one asks a narrower question: how long does the host spend inside the experts call
of one decode step? Each implementation's experts function is wrapped in a timer
(time.perf_counter around the call; calls of one token only), so what an implementation costs
the host is measured in the model, where cold caches and a busy driver make every call slower
than the same call in a loop.

Implementations (the same weights and prompt; one copy of the model each, all alive at once):
    grouped_mm   transformers' torch._grouped_mm experts
    batched_mm   transformers' batched-mm experts (each slot's expert weights gathered, then
                 bmm); skipped with --prefill, where it gathers a copy of the weights per slot
    fusedmoe     fusedmoe's registered experts implementation
    no_experts   an experts function that returns its input: the floor of the other rows
    patched      fusedmoe.integrations.transformers.patch(): whole MoE blocks replaced, so its
                 timer wraps the block (the router included), not the experts alone

Rows: decode ms per token (greedy generation of --decode tokens after a 16-token prompt,
the implementations taking turns for --rounds rounds after a warm-up, median), its ratio to
grouped_mm's, and the median and mean host microseconds of one timed call. --prefill N runs a
forward of N tokens before each generate() (as bench_hf_model.py does), so the decode graphs
replay between prefill-sized ones.
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hf_model as hf  # the models and helpers of the sibling benchmark

IMPLS = ("grouped_mm", "batched_mm", "fusedmoe", "no_experts", "patched")
TIMED_PREFIX = "timed_"


def timed_experts(fn, samples: list[float]):
    """An experts function (self, hidden_states, top_k_index, top_k_weights) that calls `fn` and
    appends the host seconds of each one-token call to `samples`."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        start = time.perf_counter()
        out = fn(self, hidden_states, top_k_index, top_k_weights)
        if hidden_states.shape[0] == 1:
            samples.append(time.perf_counter() - start)
        return out

    return forward


def timed_block(block: torch.nn.Module, samples: list[float]) -> None:
    """Time `block`'s forward (hidden_states [B, T, H]) in place: calls of one token."""
    forward = block.forward

    def timed(hidden_states):
        start = time.perf_counter()
        out = forward(hidden_states)
        if hidden_states.shape[:-1].numel() == 1:
            samples.append(time.perf_counter() - start)
        return out

    block.forward = timed


def prepare(base: torch.nn.Module, impl: str, samples: list[float]) -> torch.nn.Module:
    """A copy of `base` running `impl`, each one-token experts (or block) call timed."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    import fusedmoe.integrations.transformers as fmt

    model = copy.deepcopy(base)
    if impl == "patched":
        fmt.patch(model)
        for module in model.modules():
            if isinstance(module, fmt.FusedMoEBlock):
                timed_block(module, samples)
        return model
    functions = {
        "fusedmoe": fmt.fusedmoe_experts_forward,
        "no_experts": hf._no_experts,
    }
    fn = functions.get(impl) or ALL_EXPERTS_FUNCTIONS[impl]
    ExpertsInterface.register(TIMED_PREFIX + impl, timed_experts(fn, samples))
    model.set_experts_implementation(TIMED_PREFIX + impl)
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
