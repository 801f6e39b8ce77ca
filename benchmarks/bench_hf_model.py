"""Prefill and decode time of a mid-size random-initialised transformers MoE model on a GPU.

    python benchmarks/bench_hf_model.py [--model qwen3|deepseek] [--layers 4] [--prefill 2048]
                                        [--decode 64] [--no-compile] [--json out.json]

Models (bfloat16, a few layers, real expert sizes):
    qwen3      Qwen3-MoE with the sizes of Qwen3-30B-A3B: hidden 2048, 128 experts of
               intermediate 768, top-8, softmax routing (the default)
    deepseek   DeepSeek-V3-style (transformers' DeepseekV3Config): MLA attention, 256 routed
               experts of intermediate 768 at hidden 2048, top-8 of sigmoid scores
               within the best 4 of 8 groups (ranked by top-2 sums of scores +
               e_score_correction_bias, drawn N(0, 0.1^2) here rather than zeros),
               renormalised, times routed_scaling_factor 2.5, one shared expert, the first
               layer dense (first_k_dense_replace=1). 4 layers hold about 8 GB of bf16
               weights (3 MoE layers of 2.4 GB), sized so that each row of --layers 4
               --prefill 2048 --decode 32 runs in under a minute on an H100.
Each implementation runs the same weights and inputs:
    eager        transformers' per-expert loop
    grouped_mm   transformers' torch._grouped_mm implementation
    fusedmoe     the experts through fusedmoe (experts_implementation="fusedmoe")
    patched      whole MoE blocks replaced by FusedMoE (fusedmoe.integrations.transformers.patch)
    no_experts   a floor, not a model: an experts implementation that returns its input and
                 does no work. What is left is the rest of the model (attention, norms, the
                 model's own router); no experts implementation registered with transformers
                 (fusedmoe's included) can run the model faster than this row. Its logits
                 differ from the others' (no diff is reported); its decode runs the same
                 number of steps (min_new_tokens).

Rows, mode "eager" (every impl): prefill = one forward of [1, prefill] tokens, the median of
--repeats rounds in which the impls take turns (run_eager_rows), after a warm-up of each;
decode = ms per token of greedy generation of `decode` tokens after a 16-token prompt (dynamic
KV cache): the median, over every decode step of those rounds, of the time between two
tokens as generate() hands them to its streamer (StepTimer; the prompt's forward excluded).
A median of steps, not of whole generate() calls: a garbage collection or a stall of the host
lands in one step of one impl, not in its figure. Logits compared with the first impl's (max
abs diff).
Rows, mode "static+compile" (grouped_mm, fusedmoe, patched; --no-compile skips them): the same
generation with a static KV cache, which transformers' generate() compiles on its own
(generation_config.cache_implementation = "static", compile_config = CompileConfig(
fullgraph=False, mode="reduce-overhead"): the decode steps run torch.compile'd and replayed
from CUDA graphs, the prompt's forward eager); the first two generate() calls (compilation, graph
recording) are not timed, and the impls take turns and decode is timed as in the eager rows.
experts_graph_breaks: torch._dynamo.explain(module)(...) on the first MoE layer's experts
module (fusedmoe, grouped_mm) or FusedMoEBlock (patched) with a one-token input: its
graph_break_count, the number of breaks torch.compile takes inside that call, at least 1 when
a fullgraph compile of the call fails (a break Dynamo cannot resume from skips the whole frame,
and explain() does not count it); 0: the experts compile into the decode graph. The first
reason goes in the note.
decode_gpu_ms_per_token (both modes): the GPU's share of a decode step, which the host's noise
does not move: the summed time of the device's work (kernels, CUDA-graph replays' kernels
included, and device copies) in one generate() under torch.profiler, after the timed rounds,
divided by its decode steps (the prompt's forward is in the sum: about one step's worth). On
one stream, as every impl here runs, a step costs at least this much; when
decode_ms_per_token is well above it, the step waits on the host (Python, launches), not on
the GPU. A profiler failure leaves the cell empty, its error in the note.
An impl that fails writes its error in the note column; the others still run.
"""

from __future__ import annotations

import argparse
import copy
import itertools
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

IMPLS = ("eager", "grouped_mm", "fusedmoe", "patched", "no_experts")
COMPILED_IMPLS = ("grouped_mm", "fusedmoe", "patched", "no_experts")
NO_EXPERTS = "no_experts"
PROMPT = 16

#: the benchmark's sizes (build_model's defaults) and tiny ones for a CPU build test
SIZES = {
    "qwen3": dict(
        vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8,
    ),
    "deepseek": dict(
        vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        num_experts_per_tok=8, n_group=8, topk_group=4,
    ),
}  # fmt: skip
TINY_SIZES = {
    "qwen3": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2,
    ),
    "deepseek": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2,
    ),
}  # fmt: skip


def _config(name: str, layers: int, sizes: dict):
    if name == "qwen3":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            num_hidden_layers=layers, norm_topk_prob=True, max_position_embeddings=8192, **sizes
        )
        return config, Qwen3MoeForCausalLM
    if name == "deepseek":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(
            num_hidden_layers=layers, n_shared_experts=1, routed_scaling_factor=2.5,
            first_k_dense_replace=1 if layers > 1 else 0, norm_topk_prob=True,
            max_position_embeddings=8192, num_mtp_layers=0, **sizes,
        )  # fmt: skip
        return config, DeepseekV3ForCausalLM
    raise ValueError(f"unknown model {name!r}; expected qwen3 or deepseek")


def build_model(
    name: str, layers: int, device: str, dtype: torch.dtype = torch.bfloat16, **sizes
) -> torch.nn.Module:
    """A random-initialised `name` model of `layers` layers in eval mode (sizes: SIZES[name],
    any of them overridden)."""
    config, cls = _config(name, layers, {**SIZES[name], **sizes})
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype).eval()
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):  # zeros at init: make the bias matter; float32
            module.e_score_correction_bias = 0.1 * torch.randn_like(bias, dtype=torch.float32)
    return model


def describe(name: str, layers: int) -> str:
    s = SIZES[name]
    if name == "qwen3":
        return (
            f"Qwen3-MoE {layers} layers (H {s['hidden_size']}, E {s['num_experts']}, "
            f"I {s['moe_intermediate_size']}, k {s['num_experts_per_tok']}), bf16"
        )
    return (
        f"DeepSeek-V3-style {layers} layers (first dense; H {s['hidden_size']}, "
        f"E {s['n_routed_experts']}, I {s['moe_intermediate_size']}, k "
        f"{s['num_experts_per_tok']} in {s['topk_group']} of {s['n_group']} groups, 1 shared "
        "expert, MLA), bf16"
    )


def _no_experts(self, hidden_states, top_k_index, top_k_weights):
    """The floor row's experts: no work, the input returned."""
    return hidden_states


def prepare(base: torch.nn.Module, impl: str) -> tuple[torch.nn.Module, str]:
    """A copy of `base` running `impl`, and a note."""
    import fusedmoe.integrations.transformers as fmt

    model = copy.deepcopy(base)
    if impl == "patched":
        report = fmt.patch(model)
        return model, f"replaced {len(report.replaced)} blocks"
    if impl == NO_EXPERTS:
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(NO_EXPERTS, _no_experts)
        model.set_experts_implementation(NO_EXPERTS)
        return model, "floor: the experts do no work (logits not comparable)"
    model.set_experts_implementation(impl)
    return model, ""


def is_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is a transformers experts module (fused gate_up_proj and down_proj)."""
    return hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")


def first_moe(model: torch.nn.Module, impl: str) -> torch.nn.Module | None:
    """The module whose compiled graph breaks are counted: the FusedMoEBlock (patched) or the
    experts module of the first MoE layer."""
    from fusedmoe.integrations.transformers import FusedMoEBlock

    for module in model.modules():
        if impl == "patched" and isinstance(module, FusedMoEBlock):
            return module
        if impl != "patched" and is_experts(module):
            return module
    return None


def experts_graph_breaks(model: torch.nn.Module, impl: str) -> tuple[int | None, str]:
    """(torch._dynamo.explain's graph_break_count of one decode-sized call of the first MoE
    module, its first break reason); (None, why) where it cannot be measured."""
    module = first_moe(model, impl)
    if module is None:
        return None, "no MoE module found"
    hidden = model.config.hidden_size
    device = next(model.parameters()).device
    x = torch.randn(1, hidden, device=device, dtype=model.dtype)
    torch._dynamo.reset()
    if impl == "patched":
        call_args = (x.view(1, 1, hidden),)
    else:
        k = model.config.num_experts_per_tok
        ids = torch.randperm(module.num_experts, device=device)[:k].view(1, k)
        weights = torch.full((1, k), 1.0 / k, device=device, dtype=model.dtype)
        call_args = (x, ids, weights)
    with torch.no_grad():
        explain = torch._dynamo.explain(module)(*call_args)
        # explain() does not count a break Dynamo cannot resume from (it then skips the whole
        # frame): a fullgraph compile of the same call is the check that sees those too
        torch._dynamo.reset()
        try:
            torch.compile(module, fullgraph=True, backend="eager")(*call_args)
            fullgraph_error = ""
        except Exception as exc:  # a graph break, whatever its kind
            fullgraph_error = str(exc).strip().splitlines()[0][:160] if str(exc) else repr(exc)
    torch._dynamo.reset()
    reasons = [str(getattr(r, "reason", r)).splitlines()[0][:160] for r in explain.break_reasons]
    breaks = explain.graph_break_count
    if fullgraph_error:
        breaks = max(breaks, 1)
        reasons = reasons or [fullgraph_error]
    return breaks, (f"first break: {reasons[0]}" if reasons else "")


def _once(fn) -> float:
    """Milliseconds of one fn() on the GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


class StepTimer:
    """A generate() streamer that stamps each token as it comes out. generate() calls put()
    with the prompt, then once per new token, after the step's forward and the host sync that
    picks the token: from the first token on, the gaps between stamps are decode steps."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def steps_ms(self) -> list[float]:
        """The milliseconds of each decode step (the prompt's forward excluded)."""
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.stamps[1:])]


def _generate(model, prompt, args, streamer: StepTimer | None = None) -> None:
    model.generate(prompt, max_new_tokens=args.decode, min_new_tokens=args.decode,
                   do_sample=False, streamer=streamer)  # fmt: skip


def _decode_steps(model, prompt, args) -> list[float]:
    """The milliseconds of each decode step of one greedy generate()."""
    timer = StepTimer()
    torch.cuda.synchronize()
    _generate(model, prompt, args, timer)
    return timer.steps_ms()


def _decode_gpu_ms(model, prompt, args) -> float:
    """GPU ms per decode step of one greedy generate(): the device's work (kernels, copies),
    summed over the profiler's trace, divided by the decode steps (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _generate(model, prompt, args)
        torch.cuda.synchronize()
    kernels_us = sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return kernels_us / 1e3 / args.decode


def _gpu_shares(models: dict, values: dict, prompt, args) -> dict[str, float | None]:
    """impl -> _decode_gpu_ms of its model; None where the profiled run fails (its error in
    the impl's note, the other figures kept)."""
    shares = {}
    for impl, model in models.items():
        try:
            shares[impl] = _decode_gpu_ms(model, prompt, args)
        except Exception as exc:
            shares[impl] = None
            note = values[impl].get("note", "")
            values[impl]["note"] = "; ".join(n for n in (note, f"GPU share {_failure(exc)}") if n)
    return shares


def _take_turns(models: dict, values: dict, repeats: int, timed) -> dict[str, list]:
    """impl -> the samples of timed(model) (a tuple of ms): one untimed round in turn, then
    `repeats` timed ones. An impl whose call raises leaves `models`, its error in its note."""
    samples = {impl: [] for impl in models}
    for round_ in range(repeats + 1):
        for impl, model in list(models.items()):
            try:
                sample = timed(model)
            except Exception as exc:
                values[impl]["note"] = _failure(exc)
                del models[impl], samples[impl]
                continue
            if round_:
                samples[impl].append(sample)
    return samples


def run_eager_rows(base, args, prefill_ids, prompt) -> dict[str, dict]:
    """impl -> its eager row values. Every impl is built and warmed up first (all copies of the
    model are alive at once), then the calls take turns (prefill, then a generate(), impl after
    impl; one untimed round, then `repeats` timed ones): a host that drifts during the run
    (clocks, neighbours) moves every impl's figures alike, so their ratios hold even where the
    absolute figures do not. An impl that fails is dropped with its error in the note."""
    models, values, reference = {}, {}, None
    with torch.inference_mode():
        for impl in args.impls:
            try:
                model, note = prepare(base, impl)
                logits = model(prefill_ids).logits.float()
                if impl == NO_EXPERTS:
                    diff = None
                else:
                    reference = logits if reference is None else reference
                    diff = float((logits - reference).abs().max())
                _generate(model, prompt, args)  # warm-up: kernels compiled, graphs captured
            except Exception as exc:  # one impl failing must not end the run
                values[impl] = dict(note=_failure(exc))
                continue
            models[impl] = model
            values[impl] = dict(max_abs_logit_diff_vs_eager=diff, note=note)
        samples = _take_turns(models, values, args.repeats, lambda model: (
            _once(lambda: model(prefill_ids)), _decode_steps(model, prompt, args),
        ))  # fmt: skip
        gpu = _gpu_shares(models, values, prompt, args)
    for impl, rounds in samples.items():
        prefill_ms = statistics.median(p for p, _ in rounds)
        values[impl].update(
            prefill_ms=round(prefill_ms, 2), prefill_tok_s=round(args.prefill / prefill_ms * 1e3),
            decode_ms_per_token=round(statistics.median(d for _, ds in rounds for d in ds), 3),
            decode_gpu_ms_per_token=None if gpu[impl] is None else round(gpu[impl], 3),
        )  # fmt: skip
    models.clear()
    torch.cuda.empty_cache()
    return values


def run_compiled_rows(base, args, prompt) -> dict[str, dict]:
    """impl -> its static+compile row: greedy decode with a static KV cache and generate()'s own
    torch.compile (reduce-overhead). Each impl compiles and records its graphs first (two
    generate() calls), then the timed calls take turns as in run_eager_rows."""
    from transformers import CompileConfig

    models, values = {}, {}
    for impl in (i for i in args.impls if i in COMPILED_IMPLS):
        try:
            model, note = prepare(base, impl)
            # resets Dynamo: before any compile; the floor's experts have nothing to compile
            breaks, why = (None, "") if impl == NO_EXPERTS else experts_graph_breaks(model, impl)
        except Exception as exc:
            values[impl] = dict(note=_failure(exc))
            continue
        models[impl] = model
        values[impl] = dict(
            experts_graph_breaks=breaks, note="; ".join(n for n in (note, why) if n)
        )
    for impl, model in list(models.items()):
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(
            fullgraph=False, mode="reduce-overhead"
        )
        try:
            with torch.inference_mode():
                _generate(model, prompt, args)
                _generate(model, prompt, args)
        except Exception as exc:
            values[impl]["note"] = _failure(exc)
            del models[impl]
    with torch.inference_mode():
        samples = _take_turns(
            models, values, args.repeats, lambda model: _decode_steps(model, prompt, args)
        )
        gpu = _gpu_shares(models, values, prompt, args)
    for impl, rounds in samples.items():
        steps = [d for ds in rounds for d in ds]
        values[impl]["decode_ms_per_token"] = round(statistics.median(steps), 3)
        values[impl]["decode_gpu_ms_per_token"] = None if gpu[impl] is None else round(gpu[impl], 3)
    models.clear()
    torch._dynamo.reset()  # drop the compiled graphs and their CUDA graph pools
    torch.cuda.empty_cache()
    return values


def _row(model: str, impl: str, mode: str, **values) -> dict:
    row = dict(model=model, impl=impl, mode=mode, prefill_ms=None, prefill_tok_s=None,
               decode_ms_per_token=None, decode_gpu_ms_per_token=None,
               max_abs_logit_diff_vs_eager=None,
               experts_graph_breaks=None, note="")  # fmt: skip
    row.update(values)
    return row


def _failure(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"failed: {type(exc).__name__}: {text[:200]}"


def _print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    cells = [["-" if r[k] is None else str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)).rstrip())
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="qwen3")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument(
        "--no-compile", action="store_true", help="skip the static-cache torch.compile rows"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every row here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hf_model: needs a CUDA GPU", file=sys.stderr)
        return 2

    base = build_model(args.model, args.layers, "cuda")
    prefill_ids = torch.randint(0, base.config.vocab_size, (1, args.prefill), device="cuda")
    prompt = prefill_ids[:, :PROMPT]
    rows = []
    for impl, values in run_eager_rows(base, args, prefill_ids, prompt).items():
        rows.append(_row(args.model, impl, "eager", **values))
        print(rows[-1], file=sys.stderr, flush=True)
    if not args.no_compile:
        for impl, values in run_compiled_rows(base, args, prompt).items():
            rows.append(_row(args.model, impl, "static+compile", **values))
            print(rows[-1], file=sys.stderr, flush=True)

    print(
        f"# {torch.cuda.get_device_name()}, {describe(args.model, args.layers)}, prefill "
        f"{args.prefill}, decode {args.decode} after a {PROMPT}-token prompt, torch "
        f"{torch.__version__}"
    )
    _print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"# wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
