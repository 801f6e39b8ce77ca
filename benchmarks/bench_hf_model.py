"""Prefill and decode time of a mid-size random-initialised transformers MoE model on a GPU.

    python benchmarks/bench_hf_model.py [--layers 4] [--prefill 2048] [--decode 64] [--json out]

The model is Qwen3-MoE with the real hidden and expert sizes of Qwen3-30B-A3B (hidden 2048,
128 experts of intermediate 768, top-8) and a few layers, in bfloat16. Each implementation
runs the same weights and inputs:
    eager        transformers' per-expert loop
    grouped_mm   transformers' torch._grouped_mm implementation
    fusedmoe     the experts through fusedmoe (experts_implementation="fusedmoe")
    patched      whole MoE blocks replaced by FusedMoE (fusedmoe.integrations.transformers.patch)
Prefill: one forward of [1, prefill] tokens. Decode: ms per token of greedy generation of
`decode` tokens after a 16-token prompt. Logits are compared with eager's (max abs diff).
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


def build_model(layers: int, device: str):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=32768,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    return model


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() on the GPU, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--impls", nargs="+", default=["eager", "grouped_mm", "fusedmoe", "patched"]
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hf_model: needs a CUDA GPU", file=sys.stderr)
        return 2

    import fusedmoe.integrations.transformers as fmt

    base = build_model(args.layers, "cuda")
    prefill_ids = torch.randint(0, base.config.vocab_size, (1, args.prefill), device="cuda")
    prompt = prefill_ids[:, :16]
    rows, reference_logits = [], None
    for impl in args.impls:
        model = copy.deepcopy(base)
        if impl == "patched":
            report = fmt.patch(model)
            note = f"replaced {len(report.replaced)} blocks"
        else:
            model.set_experts_implementation(impl)
            note = ""
        with torch.inference_mode():
            logits = model(prefill_ids).logits.float()
            if reference_logits is None:
                reference_logits = logits
            diff = float((logits - reference_logits).abs().max())
            prefill_ms = timed(lambda m=model: m(prefill_ids), args.repeats)

            def generate(m=model):
                m.generate(prompt, max_new_tokens=args.decode, min_new_tokens=args.decode,
                           do_sample=False)  # fmt: skip

            decode_ms = timed(generate, 1) / args.decode
        rows.append(
            dict(
                impl=impl,
                prefill_ms=round(prefill_ms, 2),
                prefill_tok_s=round(args.prefill / prefill_ms * 1e3),
                decode_ms_per_token=round(decode_ms, 2),
                max_abs_logit_diff_vs_eager=diff,
                note=note,
            )
        )
        del model
        torch.cuda.empty_cache()

    shape = f"Qwen3-MoE {args.layers} layers (H 2048, E 128, I 768, k 8), bf16"
    print(
        f"# {torch.cuda.get_device_name()}, {shape}, prefill {args.prefill}, decode {args.decode}"
    )
    keys = list(rows[0])
    print("  ".join(f"{k:>24}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]!s:>24}" for k in keys))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
