"""`fusedmoe tune`: search the Triton backend's kernel configs for one shape on this GPU, verify
the winners, and write the table the backend loads for this device name.

Legend: E_l local experts, k top-k, H hidden (K of GEMM1), I intermediate, N = 2I (gated) rows
of w13 per expert, M tokens.

For each token bucket M (the shape's real sizes):

    candidates  the heuristic's config (fusedmoe.kernels.moe_config.heuristic_config), the
                config the tables give the bucket today (shipped, or the user's), the
                heuristic's configs of the neighbouring buckets, and every config one step
                from it: block_m x/÷ 2; per GEMM block_n and block_k x/÷ 2,
                num_warps 2 <-> 4 <-> 8, num_stages +-1 (2 to 6), group_m in
                {1, 8, 16, 32, 64, 1024} (1024: columns first, GemmConfig says why);
                fuse_activation toggled for fp8_block, unfused with 32- and 64-wide GEMM1
                tiles, and (from a fused config) twice the rows unfused with each GEMM's tile
                at most 128 wide.
                Then the same steps around the best so far, until nothing improves, the
                bucket's share of --budget-s is spent, or --max-configs were timed
    timing      the whole fused_experts call under use_moe_kernel_config(candidate), median of
                CUDA-graph replays (triton.testing.do_bench_cudagraph), after about a second
                of untimed replays per bucket (tools.bench.timing.settle: the first timing after
                new weights read up to 11% slow, which favoured any config over the
                heuristic's, timed first), under a uniform and a
                skewed routing (tools.bench.inputs: popularity ~ 1 / rank^1.2 at strength 3,
                seeded): a config that wins on uniform routing alone can lose 30-50% when a
                popular expert's rows make many thin tiles; a candidate that does not compile
                or launch (shared memory, registers) is dropped
    score       --rule least-worst (the default): the least worst ratio, max over the two
                routings of time / the fastest time any candidate had under that routing (1.0:
                best under both); the winner must beat the heuristic's score by more than
                --min-gain, else the heuristic's config is written (noise must not change the
                table). It may trade some uniform time for much skewed time.
                --rule keep-uniform: only candidates whose uniform time is within
                --uniform-slack of the config the tables give the bucket today compete, on
                their skewed time; the winner must beat today's skewed time by more than
                --min-gain, else today's config is written again (a re-tune that never makes
                uniform routing slower). The search starts around today's config.
    verified    under both routings, against fused_experts(..., backend="torch") (float64
                inside) on the first min(M, 256) tokens, within the test suite's tolerance of
                the dtype (quantized: normalised max 0.08, RMS 1.5e-2), and against the
                heuristic's config at the full M; a winner that fails is dropped for the next
                best (then today's config under keep-uniform, then the heuristic's)

For fp8_block, where the DeepGEMM library and our wgmma GEMMs both run the shape, each bucket
also times the deep_gemm backend on each engine (the same timing, both routings) and records the
faster (least worst ratio) with both times in the engine table beside the configs
(kernels.moe_config.engine_table_path); deep_gemm's "auto" engine then takes the measured winner
at the nearest bucket. --engines-only measures the engines and leaves the configs alone.

The table, {"<M>": config}, goes to table_path(root, device name, E_l, N, H, dtype) where root
is --out (default: $FUSEDMOE_TUNED_CONFIGS, else <cache dir>/tuned, both read automatically),
or the package's fusedmoe/kernels/tuned/ with --ship. Entries already in the file for other
buckets are kept. Needs a CUDA GPU: on the CPU it refuses.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from fusedmoe.activation import MoEActivation
from fusedmoe.functional import fused_experts
from fusedmoe.tools.bench.inputs import (
    ROUTINGS,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.bench.timing import rel_err, settle

__all__ = [
    "RULES",
    "TUNE_DTYPES",
    "UNIFORM_SLACK",
    "EngineResult",
    "TuneResult",
    "TuneShape",
    "candidates_around",
    "check_rule",
    "engines_unmeasurable",
    "least_worst_ratio",
    "ranked_choices",
    "rule_scores",
    "tune_engines",
    "tune_shape",
    "uniform_kept_score",
    "write_engine_table",
]

#: --dtype names -> (activation dtype, the tables' dtype key, weight scheme or None)
TUNE_DTYPES = {
    "bf16": (torch.bfloat16, "bfloat16", None),
    "fp16": (torch.float16, "float16", None),
    "fp32": (torch.float32, "float32", None),
    "fp8_tensor": (torch.bfloat16, "fp8_tensor", "fp8_tensor"),
    "fp8_channel": (torch.bfloat16, "fp8_channel", "fp8_channel"),
    "fp8_block": (torch.bfloat16, "fp8_block", "fp8_block"),
    "int8": (torch.bfloat16, "int8", "int8"),
}
#: normalised max error of the triton backend against the float64 reference (tests/helpers.py)
VERIFY_TOLERANCE = {"bfloat16": 3e-2, "float16": 4e-3, "float32": 1e-4}
QUANT_TOLERANCE = 0.08  # quantized: max error ...
QUANT_RMS_TOLERANCE = 1.5e-2  # ... and normalised RMS error
VERIFY_MAX_TOKENS = 256
#: accumulator elements per program above which a tile spills heavily (never faster)
_MAX_ACC = 128 * 256
#: how a bucket's winner is chosen (the module docstring's "score")
RULES = ("least-worst", "keep-uniform")
#: keep-uniform: the uniform-routing time a candidate may lose, a fraction of today's
UNIFORM_SLACK = 0.01
#: launch orders tried (GemmConfig.group_m). Wider groups and the columns-first order (1024)
#: made mixtral-8x7b 1% to 6% faster at M = 256 to 4096 on an H100, under both routings
#: (probe_launch_order.py at ab63d6f, then the bench before and after the tables changed)
GROUP_M_STEPS = (1, 8, 16, 32, 64, 1024)


@dataclass(frozen=True)
class TuneShape:
    name: str
    num_experts: int  # E_l: the experts in w13 (local experts under EP)
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"

    @property
    def gemm1_rows(self) -> int:
        return MoEActivation.parse(self.activation).gemm1_out_size(self.intermediate_size)


@dataclass
class TuneResult:
    tokens: int
    heuristic_ms: float  # summed over the routings
    best_ms: float
    config: object  # MoEKernelConfig written to the table
    tried: int  # candidates timed
    failed: int  # candidates that did not compile or launch
    rejected: int  # faster candidates that failed verification
    max_err: float  # the written config's error against the reference


def _pow2_steps(value: int, low: int, high: int) -> list[int]:
    return [v for v in (value // 2, value * 2) if low <= v <= high]


def _gemm_steps(g, *, fp8_block: bool) -> Iterable:
    """GemmConfigs one knob away from g."""
    k_high = 128 if fp8_block else 256  # a 128-block scale per K tile: BK divides 128
    for bn in _pow2_steps(g.block_n, 16, 256):
        yield dataclasses.replace(g, block_n=bn)
    for bk in _pow2_steps(g.block_k, 32 if fp8_block else 16, k_high):
        yield dataclasses.replace(g, block_k=bk)
    for warps in {2: (4,), 4: (2, 8), 8: (4,)}.get(g.num_warps, (4,)):
        yield dataclasses.replace(g, num_warps=warps)
    for stages in (g.num_stages - 1, g.num_stages + 1):
        if 2 <= stages <= 6:
            yield dataclasses.replace(g, num_stages=stages)
    for group_m in GROUP_M_STEPS:
        if group_m != g.group_m:
            yield dataclasses.replace(g, group_m=group_m)


def _fits(config, gated: bool) -> bool:
    acc1 = config.block_m * config.gemm1.block_n * (2 if gated and config.fuse_activation else 1)
    return max(acc1, config.block_m * config.gemm2.block_n) <= _MAX_ACC


def _fused_width(g) -> int:
    """The width a fused fp8_block GEMM1 tile runs at (fusedmoe.kernels.fused_moe widens it)."""
    return g.block_n if g.block_n % 128 == 0 else 128


def candidates_around(config, dtype_key: str, gated: bool = True) -> list:
    """Configs one step from `config`, most promising first (rows per block, then tiles)."""
    fp8_block = dtype_key == "fp8_block"
    out = [dataclasses.replace(config, block_m=bm) for bm in _pow2_steps(config.block_m, 16, 128)]
    # fused, an fp8_block GEMM1 below 128 wide runs 128 wide (the launcher widens it to whole
    # quantization groups): a step that leaves the width it runs at would time the same kernel
    widened = fp8_block and config.fuse_activation
    for which in ("gemm1", "gemm2"):
        current = getattr(config, which)
        for g in _gemm_steps(current, fp8_block=fp8_block):
            same_kernel = g.block_n != current.block_n and _fused_width(g) == _fused_width(current)
            if not (which == "gemm1" and widened and same_kernel):
                out.append(dataclasses.replace(config, **{which: g}))
    if fp8_block:
        out.append(dataclasses.replace(config, fuse_activation=not config.fuse_activation))
        if config.fuse_activation and config.block_m < 128:
            # twice the rows unfused, each GEMM's tile at most 128 wide: the one accumulator
            # holds what the fused gate and up ones held (fused, 128 rows spill). A single knob
            # from here is slower, so the search would not reach it: on an H100 it was 5-10%
            # faster at prefill for gpt-oss-120b and mixtral-8x7b
            narrow = {
                which: dataclasses.replace(g, block_n=min(g.block_n, 128))
                for which, g in (("gemm1", config.gemm1), ("gemm2", config.gemm2))
            }
            out.append(
                dataclasses.replace(
                    config, block_m=2 * config.block_m, fuse_activation=False, **narrow
                )
            )
        if config.fuse_activation:
            # unfused, GEMM1's tile is free to narrow (fused, the launcher widens it to a whole
            # 128 group): at M = 1 on an H100 a sweep found unfused 32- and 64-wide tiles (4x
            # and 2x the programs) plus the act + quant launch fastest for qwen3-30b-a3b and
            # deepseek-v3
            for bn in (32, 64):
                gemm1 = dataclasses.replace(config.gemm1, block_n=bn)
                out.append(dataclasses.replace(config, gemm1=gemm1, fuse_activation=False))
    return [c for c in out if _fits(c, gated)]


def _unique(configs: Iterable) -> list:
    seen, out = set(), []
    for c in configs:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def _close_enough(out: torch.Tensor, ref: torch.Tensor, dtype_key: str) -> tuple[bool, float]:
    err = rel_err(out, ref)
    if dtype_key in VERIFY_TOLERANCE:
        return err <= VERIFY_TOLERANCE[dtype_key], err
    scale = max(float(ref.double().abs().max()), 1e-30)
    rms = float((out.double() - ref.double()).square().mean().sqrt()) / scale
    return err <= QUANT_TOLERANCE and rms <= QUANT_RMS_TOLERANCE, err


@dataclass(frozen=True)
class _Search:
    """The knobs of one search (those of tune_shape)."""

    budget_s: float | None  # per bucket
    max_configs: int
    rep_ms: float
    min_gain: float
    log: Callable[[str], None]
    rule: str
    uniform_slack: float


def check_rule(rule: str, uniform_slack: float) -> None:
    """A ValueError unless rule is one of RULES and uniform_slack a number >= 0."""
    if rule not in RULES:
        raise ValueError(f"rule (--rule) must be one of {RULES}, got {rule!r}")
    if not uniform_slack >= 0:
        raise ValueError(
            f"uniform_slack (--uniform-slack) must be a number >= 0, got {uniform_slack!r}"
        )


def tune_shape(
    shape: TuneShape,
    dtype: str,
    tokens: list[int],
    *,
    budget_s: float | None = None,
    max_configs: int = 40,
    rep_ms: float = 20.0,
    min_gain: float = 0.03,
    log: Callable[[str], None] = print,
    rule: str = RULES[0],
    uniform_slack: float = UNIFORM_SLACK,
) -> list[TuneResult]:
    """Tune every bucket of `tokens` for one shape and dtype on the current CUDA device;
    budget_s is shared evenly by the buckets; rule and uniform_slack as the module says."""
    check_rule(rule, uniform_slack)
    act_dtype, _, scheme = TUNE_DTYPES[dtype]
    device = torch.device("cuda", torch.cuda.current_device())
    w13, w2 = make_expert_weights(
        shape.name, shape.num_experts, shape.hidden_size, shape.intermediate_size,
        shape.activation, act_dtype, device,
    )  # fmt: skip
    experts = quantize_expert_set(w13, w2, scheme, with_plain=False)
    del w13, w2
    share = None if budget_s is None else budget_s / max(len(tokens), 1)
    search = _Search(share, max_configs, rep_ms, min_gain, log, rule, uniform_slack)
    results = [_tune_bucket(shape, dtype, experts, m, search) for m in tokens]
    del experts
    torch.cuda.empty_cache()
    return results


def _tune_bucket(shape: TuneShape, dtype: str, experts, m: int, search: _Search) -> TuneResult:
    import triton.testing

    from fusedmoe.kernels.moe_config import (
        heuristic_config,
        moe_kernel_config,
        use_moe_kernel_config,
    )

    act_dtype, dtype_key, _ = TUNE_DTYPES[dtype]
    e, k, h, i = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
    gated = MoEActivation.parse(shape.activation).is_gated
    start = time.perf_counter()
    device = experts.w13.device
    routings = [make_routing(shape.name, m, e, k, h, kind, act_dtype, device) for kind in ROUTINGS]

    def run(r) -> torch.Tensor:
        return fused_experts(
            r.x, experts.w13, experts.w2, r.topk_weights, r.topk_ids,
            activation=shape.activation, quant_config=experts.quant_config, backend="triton",
        )  # fmt: skip

    timed: dict = {}  # config -> (median ms under each routing)
    failed = []

    def measure(config) -> None:
        try:
            times = []
            with use_moe_kernel_config(config):
                for routing in routings:
                    call = functools.partial(run, routing)
                    call()  # compile outside the capture
                    times.append(
                        triton.testing.do_bench_cudagraph(
                            call, rep=search.rep_ms, return_mode="median"
                        )
                    )
            timed[config] = tuple(times)
        except Exception as exc:  # out of shared memory / registers
            torch.cuda.synchronize()
            failed.append(config)
            search.log(f"    {_short(config)}: dropped ({type(exc).__name__}: {str(exc)[:80]})")

    def spent() -> bool:
        elapsed = time.perf_counter() - start
        over_time = search.budget_s is not None and elapsed > search.budget_s
        return over_time or len(timed) + len(failed) >= search.max_configs

    base = heuristic_config(m, k, e, h, i, dtype_key)
    try:  # the bucket's first timing would read slow (fusedmoe.tools.bench.timing)
        with use_moe_kernel_config(base):
            settle(functools.partial(run, routings[0]), device)
    except Exception:  # measure() reports what does not run
        torch.cuda.synchronize()
    measure(base)
    if base not in timed:
        raise RuntimeError(f"the heuristic config {_short(base)} does not run for M={m}")
    seeds = [heuristic_config(mm, k, e, h, i, dtype_key) for mm in (max(1, m // 8), m * 8)]
    # the config the tables give this bucket today (shipped or the user's): a re-tune under
    # other routings or rules never loses sight of the old winner
    current = moe_kernel_config(m, k, e, shape.gemm1_rows, h, i, dtype_key,
                                torch.cuda.get_device_name(device))  # fmt: skip
    if current != base:
        search.log(f"    the tables' entry today: {_short(current)}")
    seeds.insert(0, current)
    queue = _unique([*seeds, *candidates_around(base, dtype_key, gated)])
    if search.rule == "keep-uniform" and current not in timed:  # the bar: timed first
        measure(current)
    # keep-uniform measures against today's config (the heuristic's where it does not run)
    reference = current if search.rule == "keep-uniform" and current in timed else base
    if reference != base:  # the search starts from today's config: its neighbours first
        queue = _unique([*candidates_around(reference, dtype_key, gated), *queue])
    best = reference
    while queue and not spent():
        config = queue.pop(0)
        if config in timed or config in failed:
            continue
        measure(config)
        # a new fastest time under one routing rescales every score: the best is recomputed
        score = rule_scores(timed, search.rule, reference, search.uniform_slack)
        leader = min(score, key=score.get)
        if leader != best:
            best = leader
            fresh = [c for c in candidates_around(best, dtype_key, gated) if c not in timed]
            queue = _unique([*fresh, *queue])  # search around the new best first
    score = rule_scores(timed, search.rule, reference, search.uniform_slack)
    ranked = ranked_choices(score, reference, base, search.min_gain)
    chosen, rejected, err = _verify(
        ranked, run, routings, experts, shape, dtype_key, use_moe_kernel_config
    )
    today = "" if reference == base else f"today {_ms(timed[reference])} ms, "
    chosen_score = f"{score[chosen]:.2f}" if chosen in score else "-"
    search.log(
        f"  M={m}: heuristic {_ms(timed[base])} ms, {today}tuned {_ms(timed[chosen])} ms "
        f"({'/'.join(ROUTINGS)}; score {score[reference]:.2f} -> {chosen_score}) after "
        f"{len(timed)} configs ({len(failed)} failed, {rejected} rejected), rel_err {err:.1e}: "
        f"{_short(chosen)}"
    )
    return TuneResult(
        m, sum(timed[base]), sum(timed[chosen]), chosen, len(timed), len(failed), rejected, err
    )


def least_worst_ratio(timed: dict) -> dict:
    """{config: max over routings of its time / the fastest time under that routing}."""
    if not timed:
        return {}
    fastest = [
        min(times[j] for times in timed.values()) for j in range(len(next(iter(timed.values()))))
    ]
    return {
        c: max(t / f for t, f in zip(times, fastest, strict=True)) for c, times in timed.items()
    }


def rule_scores(timed: dict, rule: str, reference, uniform_slack: float) -> dict:
    """The scores of `rule` (lower is better; configs a rule rules out are absent):
    least-worst: least_worst_ratio; keep-uniform: uniform_kept_score against `reference`."""
    if rule == "least-worst":
        return least_worst_ratio(timed)
    return uniform_kept_score(timed, reference, uniform_slack)


def ranked_choices(score: dict, reference, base, min_gain: float) -> list:
    """The configs to verify, in order: those scoring more than min_gain better than
    `reference` (best first), then the reference, then the heuristic's `base` (the last resort,
    and the output every other is checked against at the full M)."""
    bar = score[reference] * (1 - min_gain)
    faster = [c for c in sorted(score, key=score.get) if score[c] < bar]
    return _unique([*faster, reference, base])


def uniform_kept_score(timed: dict, keep, slack: float) -> dict:
    """{config: its worst time under a non-uniform routing / keep's time there}, for the
    configs whose uniform time is at most keep's times (1 + slack); keep scores 1.0. The
    timings are ordered as ROUTINGS."""
    u = ROUTINGS.index("uniform")
    others = [j for j in range(len(ROUTINGS)) if j != u]
    limit = timed[keep][u] * (1.0 + slack)
    return {
        c: max(times[j] / timed[keep][j] for j in others)
        for c, times in timed.items()
        if c == keep or times[u] <= limit
    }


def _ms(times) -> str:
    return "/".join(f"{t:.4f}" for t in times)


def _verify(ranked, run, routings, experts, shape, dtype_key, override) -> tuple:
    """The first config of `ranked` that matches the reference and the last config's output
    (the heuristic's) under every routing; the last must. -> (config, how many were rejected,
    its largest error against the reference)."""
    m_v = min(routings[0].x.shape[0], VERIFY_MAX_TOKENS)
    subs, refs, full_bases = [], [], []
    with torch.inference_mode():
        for r in routings:
            sub = dataclasses.replace(
                r, x=r.x[:m_v], topk_weights=r.topk_weights[:m_v], topk_ids=r.topk_ids[:m_v]
            )
            subs.append(sub)
            ref = fused_experts(
                sub.x, experts.w13, experts.w2, sub.topk_weights, sub.topk_ids,
                activation=shape.activation, quant_config=experts.quant_config, backend="torch",
            )  # fmt: skip
            refs.append(ref)
            with override(ranked[-1]):
                full_bases.append(run(r).clone())
        for n, config in enumerate(ranked):
            ok, worst = True, 0.0
            with override(config):
                for r, sub, ref, full_base in zip(routings, subs, refs, full_bases, strict=True):
                    ok_ref, err = _close_enough(run(sub), ref, dtype_key)
                    ok_full = config is ranked[-1] or _close_enough(run(r), full_base, dtype_key)[0]
                    ok, worst = ok and ok_ref and ok_full, max(worst, err)
            if ok:
                return config, n, worst
    raise RuntimeError(
        f"the heuristic config {_short(ranked[-1])} fails verification for {shape.name} "
        f"{dtype_key} M={routings[0].x.shape[0]}: rel_err {worst:.2e} (a kernel bug: report it)"
    )


def _short(config) -> str:
    g1, g2 = config.gemm1, config.gemm2
    fuse = "" if config.fuse_activation else " unfused"
    return (
        f"BM{config.block_m} g1[{g1.block_n}x{g1.block_k} gm{g1.group_m} w{g1.num_warps} "
        f"s{g1.num_stages}] g2[{g2.block_n}x{g2.block_k} gm{g2.group_m} w{g2.num_warps} "
        f"s{g2.num_stages}]{fuse}"
    )


def write_table(
    root: Path, device_name: str, shape: TuneShape, dtype: str, results: list[TuneResult]
) -> Path:
    """Merge the results into the table file (other buckets already there are kept)."""
    from fusedmoe.kernels.moe_config import table_path

    dtype_key = TUNE_DTYPES[dtype][1]
    path = table_path(
        root, device_name, shape.num_experts, shape.gemm1_rows, shape.hidden_size, dtype_key
    )
    table = {}
    if path.is_file():
        try:
            table = json.loads(path.read_text())
        except json.JSONDecodeError:
            table = {}
    for res in results:
        table[str(res.tokens)] = res.config.to_json()
    table = dict(sorted(table.items(), key=lambda kv: int(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# the deep_gemm backend's GEMM engines (fp8_block): the DeepGEMM library or our wgmma GEMMs


@dataclass
class EngineResult:
    tokens: int
    engine: str  # the faster: "library" or "wgmma"
    times_ms: dict[str, tuple[float, ...]]  # engine -> median ms under each of ROUTINGS
    rel_err: float  # the two engines' outputs against each other (normalised max)


def engines_unmeasurable(shape: TuneShape, dtype: str) -> str | None:
    """None where both GEMM engines of the deep_gemm backend run `shape` on this GPU (then
    tune_engines measures which is faster), else why there is nothing to choose."""
    from fusedmoe.experts.deep_gemm import DeepGemmExperts
    from fusedmoe.modular.types import ActivationSpec, MoEProblem
    from fusedmoe.quant.config import quantize_experts

    if dtype != "fp8_block":
        return f"only fp8_block has two engines, not {dtype}"
    tiny = quantize_experts(torch.randn(1, 256, 128), torch.randn(1, 128, 128), dtype)
    problem = MoEProblem(
        device=torch.device("cuda", torch.cuda.current_device()), dtype=torch.bfloat16,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts, top_k=shape.top_k,
        activation=ActivationSpec.make(shape.activation), quant_config=tiny[2],
    )  # fmt: skip
    if not DeepGemmExperts.library_runs(problem):
        return "the DeepGEMM library does not run it here"
    if not DeepGemmExperts.wgmma_runs(problem):
        return "the wgmma engine does not run it here"
    return None


def tune_engines(
    shape: TuneShape, dtype: str, tokens: list[int], *, rep_ms: float = 20.0, log=print
) -> list[EngineResult]:
    """For each bucket: the deep_gemm backend by name on the library's GEMMs and on ours
    (wgmma), the whole call timed as the configs are (CUDA-graph medians under each routing);
    the faster by the least worst ratio over the routings. The two outputs must agree."""
    import triton.testing

    from fusedmoe.experts.deep_gemm import DeepGemmExperts
    from fusedmoe.modular.kernel import FusedMoEModularKernel, WorkspaceCache
    from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize
    from fusedmoe.modular.types import ActivationSpec, ExpertWeights

    act_dtype, dtype_key, scheme = TUNE_DTYPES[dtype]
    device = torch.device("cuda", torch.cuda.current_device())
    e, k, h = shape.num_experts, shape.top_k, shape.hidden_size
    w13, w2 = make_expert_weights(
        shape.name, e, h, shape.intermediate_size, shape.activation, act_dtype, device
    )
    experts = quantize_expert_set(w13, w2, scheme, with_plain=False)
    del w13, w2
    weights = ExpertWeights(experts.w13, experts.w2)
    # workspaces of their own, freed after each timing: the benchmark captures on a new stream
    # each time, and the shared cache keeps buffers per stream
    workspaces = WorkspaceCache()
    kernels = {}
    for engine in ("library", "wgmma"):
        experts_on = DeepGemmExperts(strict=True, engine=engine)
        kernels[engine] = FusedMoEModularKernel(
            NoEPPrepareFinalize(), experts_on, workspaces=workspaces
        )
    results = []
    for m in tokens:
        routings = [
            make_routing(shape.name, m, e, k, h, kind, act_dtype, device) for kind in ROUTINGS
        ]
        times: dict[str, list[float]] = {name: [] for name in kernels}
        outputs: dict[str, torch.Tensor] = {}
        worst = 0.0
        for r in routings:
            for name, kernel in kernels.items():
                call = functools.partial(
                    kernel.forward, r.x, weights, r.topk_weights, r.topk_ids,
                    activation=ActivationSpec.make(shape.activation), global_num_experts=e,
                    quant_config=experts.quant_config,
                )  # fmt: skip
                outputs[name] = call().clone()  # compiles outside the capture
                settle(call, device)
                times[name].append(
                    triton.testing.do_bench_cudagraph(call, rep=rep_ms, return_mode="median")
                )
                workspaces.clear()
            ok, err = _close_enough(outputs["wgmma"], outputs["library"], dtype_key)
            if not ok:
                raise RuntimeError(
                    f"{shape.name} M={m}: the wgmma engine's output differs from the library's "
                    f"(rel_err {err:.2e}): a kernel bug, report it"
                )
            worst = max(worst, err)
        timed = {name: tuple(t) for name, t in times.items()}
        score = least_worst_ratio(timed)
        engine = min(score, key=lambda name: (score[name], name != "library"))
        results.append(EngineResult(m, engine, timed, worst))
        log(
            f"  M={m}: library {_ms(timed['library'])} ms, wgmma {_ms(timed['wgmma'])} ms "
            f"({'/'.join(ROUTINGS)}): {engine}"
        )
    del experts, weights
    torch.cuda.empty_cache()
    return results


def write_engine_table(
    root: Path, device_name: str, shape: TuneShape, dtype: str, results: list[EngineResult]
) -> Path:
    """Merge the engine choices into their table beside the configs (other buckets kept)."""
    from fusedmoe.kernels.moe_config import engine_table_path

    path = engine_table_path(
        root, device_name, shape.num_experts, shape.gemm1_rows, shape.hidden_size,
        TUNE_DTYPES[dtype][1],
    )  # fmt: skip
    table = json.loads(path.read_text()) if path.is_file() else {}
    for res in results:
        table[str(res.tokens)] = {
            "engine": res.engine,
            **{f"{name}_ms": [round(t, 4) for t in ts] for name, ts in res.times_ms.items()},
        }
    table = dict(sorted(table.items(), key=lambda kv: int(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# the command


def _fail(message: str) -> int:
    import sys

    print(f"fusedmoe tune: {message}", file=sys.stderr)
    return 2


def tune_shapes(args) -> list[TuneShape]:
    from fusedmoe.tools.presets import PRESETS, get_preset

    sizes = [args.experts, args.top_k, args.hidden, args.intermediate]
    if any(v is not None for v in sizes):
        if any(v is None for v in sizes):
            raise ValueError("a custom shape needs --experts --top-k --hidden --intermediate")
        if args.preset is not None:
            raise ValueError("give either --preset or a custom shape (--experts ...), not both")
        if any(v < 1 for v in sizes):
            raise ValueError(f"--experts --top-k --hidden --intermediate must be >= 1, got {sizes}")
        return [TuneShape("custom", *sizes, activation=args.activation)]
    names = args.preset if args.preset is not None else list(PRESETS)
    presets = [get_preset(n) for n in names]
    return [
        TuneShape(p.name, p.num_experts, p.top_k, p.hidden_size, p.intermediate_size, p.activation)
        for p in presets
    ]


def run_tune_command(args) -> int:
    """fusedmoe tune: refuses without a CUDA GPU and Triton; else tunes and writes the tables."""
    from fusedmoe._triton import INSTALL_HINT, has_triton

    try:
        shapes = tune_shapes(args)
    except ValueError as exc:
        return _fail(str(exc))
    if args.ship and args.out is not None:
        return _fail("give --out DIR or --ship, not both")
    try:
        check_rule(args.rule, args.uniform_slack)
    except ValueError as exc:
        return _fail(str(exc))
    if not torch.cuda.is_available():
        return _fail(
            "needs a CUDA GPU: it times the Triton kernels on the GPU whose tables it writes, "
            "and none is visible here (the CPU runs the heuristic's configs; nothing to tune)"
        )
    if not has_triton():
        return _fail(f"needs Triton: {INSTALL_HINT}")
    from fusedmoe.kernels.moe_config import SHIPPED_DIR, user_tables_dir

    root = SHIPPED_DIR if args.ship else Path(args.out) if args.out else user_tables_dir()
    device_name = torch.cuda.get_device_name()
    tokens = sorted(set(args.tokens))
    cases = len(shapes) * len(args.dtype)
    budget = None if args.budget_s is None else args.budget_s / cases
    print(f"fusedmoe tune on {device_name}: {cases} shape(s) x dtype(s), tokens {tokens}")
    print(f"tables go to {root}")
    begin = time.perf_counter()
    for shape in shapes:
        for dtype in args.dtype:
            print(
                f"{shape.name} {dtype}: E={shape.num_experts} k={shape.top_k} "
                f"H={shape.hidden_size} I={shape.intermediate_size} {shape.activation}",
                flush=True,
            )
            log = functools.partial(print, flush=True)
            if not args.engines_only:
                results = tune_shape(
                    shape, dtype, tokens, budget_s=budget, max_configs=args.max_configs,
                    rep_ms=args.rep_ms, min_gain=args.min_gain, log=log, rule=args.rule,
                    uniform_slack=args.uniform_slack,
                )  # fmt: skip
                log(f"  wrote {write_table(root, device_name, shape, dtype, results)}")
            why_not = engines_unmeasurable(shape, dtype)
            if why_not is not None:
                if dtype == "fp8_block" or args.engines_only:
                    log(f"  GEMM engines: nothing to choose ({why_not})")
                continue
            log("  GEMM engines of deep_gemm (the DeepGEMM library, our wgmma):")
            engines = tune_engines(shape, dtype, tokens, rep_ms=args.rep_ms, log=log)
            log(f"  wrote {write_engine_table(root, device_name, shape, dtype, engines)}")
    print(f"done in {time.perf_counter() - begin:.0f} s")
    return 0
