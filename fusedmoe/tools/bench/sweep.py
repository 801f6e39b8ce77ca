"""The sweep of `fusedmoe bench`: shapes x schemes x routings x token counts x contenders.

For each shape and scheme the weights are drawn (the same seed for every scheme), quantized,
timed over every routing and token count, and freed before the next scheme. In each row every
contender computes out [M, H] from the same x [M, H] and routing, and is compared with the
reference backend on the same inputs:

    rel_err       max |out - ref| / max |ref|, ref = fused_experts(..., backend="torch") (float64
                  inside) where M * k <= ref_max_slots; beyond it (the float64 reference gets
                  slow), against the first other contender, named in err_ref
    floor_ms      tools.roofline.moe_floor for the weights the contender reads (the baselines
                  read the scheme's values as 16-bit weights: their floor is a 16-bit one)
    tflops, gbps  the floor's flops and bytes over the measured time
    roofline_pct  floor_ms / time_ms * 100
    extra_gb      on a GPU, what one eager call allocates above what was allocated before it
                  (torch.cuda.max_memory_allocated): its workspaces, and a dequantized copy of
                  the weights if it made one (the weights, inputs and cached buffers are before
                  it); None on the CPU
    err_bf16      quantized rows: max |out - plain| / max |plain|, plain = the reference
                  backend on the unquantized weights the scheme was made from (the scheme's
                  error and the kernel's together), where rel_err has its float64 reference;
                  computed for every such row up front, then the unquantized weights are freed

Peers (--peers, fusedmoe.tools.peers): other libraries' kernels on the same weights and
routing, one contender each after the backends; built once per shape and scheme (their weight
conversion untimed), or named in the notes with why they do not run that row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusedmoe.modular.types import ActivationSpec, MoEProblem
from fusedmoe.quant.config import FAST_ACCUM_SCHEMES, SCHEMES
from fusedmoe.tools.bench.contenders import (
    REFERENCE,
    Contender,
    make_contenders,
    reference_run,
    select_backends,
)
from fusedmoe.tools.bench.inputs import (
    ExpertSet,
    make_expert_biases,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.bench.timing import peak_memory_gb, rel_err, settle, time_ms
from fusedmoe.tools.presets import MoEPreset
from fusedmoe.tools.roofline import Ceilings, distinct_experts, moe_floor

__all__ = ["PLAIN_DTYPES", "QUANTS", "BenchSpec", "Row", "run_bench"]

#: unquantized rows: the name in --quant -> the activation (and weight) dtype
PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTS = (*PLAIN_DTYPES, *SCHEMES)
#: quantized schemes run with bf16 activations
SCHEME_ACT = "bf16"


@dataclass
class Row:
    preset: str  # the shape's name, "(scaled 1/N)" where H and I were divided by N
    quant: str  # the row's scheme (or unquantized dtype): what the backends read
    routing: str  # "uniform", "skewed" or "skewed:<strength>"
    backend: str  # a backend of fusedmoe.oracle.BACKENDS, or a baseline
    weights: str  # the weight format this contender reads
    tokens: int  # M
    distinct: int  # D: distinct experts the routing touches
    time_ms: float
    tflops: float
    gbps: float
    floor_ms: float
    roofline_pct: float
    rel_err: float | None  # None: no reference for this row
    err_ref: str  # what rel_err was measured against
    timing: str  # "graph", "launch (...)" or "cpu"
    extra_gb: float | None = None  # one eager call's allocations above its base (None: CPU)
    #: against the same layer unquantized (the reference backend on the bf16 weights the scheme
    #: was made from): the scheme's error with the kernel's; None for unquantized rows, and
    #: where rel_err has no float64 reference (--ref-max-slots)
    err_bf16: float | None = None


@dataclass
class BenchSpec:
    presets: list[MoEPreset]  # shapes, already scaled where they should be
    quants: list[str]  # names of QUANTS
    tokens: list[int]
    routings: list[str]
    device: torch.device
    ceilings: Ceilings
    backends: list[str] | None = None  # None: every backend that supports the row here
    rep_ms: float = 50.0  # timed milliseconds per contender and row
    ref_max_slots: int = 1 << 17  # rows with more M * k slots skip the float64 reference
    fast_accum: bool = False  # fp8_block rows: FusedMoEQuantConfig.fast_accum (quant label +)
    #: other libraries timed beside the backends (fusedmoe.tools.peers.PEERS)
    peers: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        bad = [q for q in self.quants if q not in QUANTS]
        if bad:
            raise ValueError(f"unknown --quant {bad}; expected names of {list(QUANTS)}")
        if self.peers:
            from fusedmoe.tools.peers import PEERS  # no triton: the adapter loads it lazily

            unknown = [p for p in self.peers if p not in PEERS]
            if unknown:
                raise ValueError(f"unknown --peers {unknown}; expected names of {list(PEERS)}")
        if not self.tokens or any(m < 1 for m in self.tokens):
            raise ValueError(f"--tokens must be counts >= 1, got {self.tokens}")
        if not self.presets or not self.quants or not self.routings:
            raise ValueError("nothing to benchmark: no preset, quant or routing given")
        if self.fast_accum and not set(self.quants) & set(FAST_ACCUM_SCHEMES):
            raise ValueError(
                f"--fast-accum applies to {', '.join(FAST_ACCUM_SCHEMES)}: add it to --quant"
            )

    @property
    def num_cases(self) -> int:
        return len(self.presets) * len(self.quants) * len(self.routings) * len(self.tokens)


#: note(text): a line about the sweep (the oracle's choice, what was not timed and why)
Note = Callable[[str], None]


def _act_dtype(quant: str) -> tuple[str, torch.dtype]:
    name = quant if quant in PLAIN_DTYPES else SCHEME_ACT
    return name, PLAIN_DTYPES[name]


def _problem(preset: MoEPreset, quant_config, dtype: torch.dtype, device) -> MoEProblem:
    return MoEProblem(
        device=device,
        dtype=dtype,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_experts=preset.num_experts,
        top_k=preset.top_k,
        activation=ActivationSpec.make(preset.activation),
        quant_config=quant_config,
        has_bias=preset.has_bias,
        has_router_logits=True,  # as in a FusedMoE layer
    )


def run_bench(
    spec: BenchSpec, *, note: Note = print, step: Callable[[str], None] | None = None
) -> list[Row]:
    """Every row of the sweep; step(label) is called after each (shape, scheme, routing, M)."""
    rows: list[Row] = []
    for preset in spec.presets:
        for quant in spec.quants:
            rows += _bench_scheme(preset, quant, spec, note, step)
            if spec.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _bench_scheme(preset, quant, spec: BenchSpec, note: Note, step) -> list[Row]:
    act_name, dtype = _act_dtype(quant)
    device = spec.device
    w13, w2 = make_expert_weights(
        preset.name, preset.num_experts, preset.hidden_size, preset.intermediate_size,
        preset.activation, dtype, device,
    )  # fmt: skip
    experts = quantize_expert_set(
        w13, w2, None if quant in PLAIN_DTYPES else quant, fast_accum=_fast_accum(quant, spec)
    )
    if preset.has_bias:
        experts.w13_bias, experts.w2_bias = make_expert_biases(preset.name, w13, w2)
    plain_refs = _unquantized_references(preset, quant, spec, w13, w2, experts)
    del w13, w2
    problem = _problem(preset, experts.quant_config, dtype, device)
    selection = select_backends(problem, spec.backends)
    where = f"{preset_label(preset)}, {quant}"
    if selection.choice is not None:
        note(f"{where}: the oracle picks {selection.choice.name}: {selection.choice.reason}")
    else:
        note(f"{where}: the oracle finds no backend ({selection.choice_error})")
    for name, why in selection.refused.items():
        note(f"{where}: not timing {name}: {why}")
    peers = _peers(preset, quant, experts, dtype, spec, note, where)
    contenders = make_contenders(
        selection.backends, experts, activation=preset.activation,
        num_experts=preset.num_experts, top_k=preset.top_k, act_name=act_name, quant=quant,
        device=device, peers=peers,
    )  # fmt: skip
    for c in contenders:
        if c.note.startswith("per-expert loop ("):
            note(f"{where}: {c.name} runs as a {c.note}")
    reference = reference_run(experts, preset.activation)
    rows = []
    first = True  # the first timing after the weights are made is settled first (timing.py)
    for routing in spec.routings:
        for m in spec.tokens:
            rows += _bench_case(
                preset, quant, routing, m, contenders, reference, spec, note,
                settle_first=first, plain_ref=plain_refs.get((routing, m)),
            )  # fmt: skip
            first = False
            if step is not None:
                step(f"{where}, {routing}, M={m}")
    return rows


def _unquantized_references(preset, quant, spec: BenchSpec, w13, w2, experts) -> dict:
    """(routing, M) -> the reference backend's output on the unquantized weights w13, w2 the
    scheme was made from (err_bf16), for a quantized scheme's rows that get a float64
    reference; computed before the sweep, so that those weights need not be kept."""
    if quant in PLAIN_DTYPES:
        return {}
    plain = ExpertSet(w13, w2, None, None, None, experts.w13_bias, experts.w2_bias)
    run = reference_run(plain, preset.activation)
    refs = {}
    with torch.inference_mode():
        for routing in spec.routings:
            for m in spec.tokens:
                if m * preset.top_k <= spec.ref_max_slots:
                    refs[routing, m] = run(_row_inputs(preset, quant, routing, m, spec.device))
    return refs


def _row_inputs(preset, quant, routing, m, device):
    """A row's tokens and routing (seeded: the same for every call with these arguments)."""
    return make_routing(
        preset.name, m, preset.num_experts, preset.top_k, preset.hidden_size, routing,
        _act_dtype(quant)[1], device,
    )  # fmt: skip


def _peers(preset, quant, experts, dtype, spec: BenchSpec, note: Note, where: str):
    """The peers that run this shape and scheme, each noted with how it runs; the others
    noted with why not. Imports fusedmoe.tools.peers only when --peers names one."""
    if not spec.peers:
        return []
    from fusedmoe.tools.peers import peer_contenders

    peers, refused = peer_contenders(
        spec.peers, experts, quant=quant, activation=preset.activation, top_k=preset.top_k,
        hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        act_dtype=dtype, device=spec.device,
    )  # fmt: skip
    for name, why in refused.items():
        note(f"{where}: not timing peer {name}: {why}")
    for c in peers:
        note(f"{where}: peer {c.name}: {c.note}")
    return peers


def _fast_accum(quant: str, spec: BenchSpec) -> bool:
    return spec.fast_accum and quant in FAST_ACCUM_SCHEMES


def _bench_case(
    preset, quant, routing, m, contenders: list[Contender], reference, spec, note, *,
    settle_first: bool = False, plain_ref: torch.Tensor | None = None,
):  # fmt: skip
    device = spec.device
    k = preset.top_k
    inputs = _row_inputs(preset, quant, routing, m, device)
    num_distinct = distinct_experts(inputs.topk_ids, preset.num_experts)
    with torch.inference_mode():
        outputs: dict[str, torch.Tensor] = {}
        for c in contenders:
            try:
                outputs[c.name] = c.run(inputs)
            except Exception as exc:  # one contender failing must not end the sweep
                note(f"{preset_label(preset)}, {quant}, M={m}: {c.name} failed: {exc!r:.300}")
        for c in contenders:
            if c.check is None or c.name not in outputs:
                continue
            try:
                found = c.check(inputs)
            except Exception as exc:
                found = f"its check failed: {exc!r:.300}"
            if found is not None:
                note(f"{preset_label(preset)}, {quant}, {routing}, M={m}: {c.name}: {found}")
        ref, ref_name = None, "none"
        if m * k <= spec.ref_max_slots:
            ref = outputs.get(REFERENCE)
            ref = reference(inputs) if ref is None else ref
            ref_name = f"{REFERENCE}({quant})"
        rows = []
        for c in contenders:
            if c.name not in outputs:
                continue
            if ref is not None:
                err, err_ref = rel_err(outputs[c.name], ref), ref_name
            else:
                others = [n for n in outputs if n != c.name]
                err = rel_err(outputs[c.name], outputs[others[0]]) if others else None
                err_ref = others[0] if others else "none"
            if settle_first:
                settle(functools.partial(c.run, inputs), device, capturable=c.capturable)
                settle_first = False
            ms, how = time_ms(
                functools.partial(c.run, inputs), device, rep_ms=spec.rep_ms,
                capturable=c.capturable,
            )  # fmt: skip
            row = _row(preset, quant, routing, m, num_distinct, c, ms, how, err, err_ref, spec)
            if plain_ref is not None:
                row.err_bf16 = rel_err(outputs[c.name], plain_ref)
            peak = peak_memory_gb(functools.partial(c.run, inputs), device)
            row.extra_gb = None if peak is None else peak[0] - peak[1]
            rows.append(row)
    return rows


def _row(preset, quant, routing, m, num_distinct, c: Contender, ms, how, err, err_ref, spec):
    floor = moe_floor(
        c.weights,
        num_distinct=num_distinct,
        num_tokens=m,
        top_k=preset.top_k,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        ceilings=spec.ceilings,
        gated=ActivationSpec.make(preset.activation).kind.is_gated,
        act_bytes=_act_dtype(quant)[1].itemsize,
    )
    seconds = ms / 1e3
    return Row(
        preset=preset_label(preset),
        quant=quant + ("+fast_accum" if _fast_accum(quant, spec) else ""),
        routing=routing,
        backend=c.name,
        weights=c.weights,
        tokens=m,
        distinct=num_distinct,
        time_ms=ms,
        tflops=floor.flops / seconds / 1e12,
        gbps=floor.num_bytes / seconds / 1e9,
        floor_ms=floor.seconds * 1e3,
        roofline_pct=100.0 * floor.seconds / seconds,
        rel_err=err,
        err_ref=err_ref,
        timing=how,
    )


def preset_label(preset: MoEPreset) -> str:
    return preset.name if preset.scale == 1 else f"{preset.name} (scaled 1/{preset.scale})"


def row_dict(row: Row) -> dict:
    return dataclasses.asdict(row)
