"""`fusedmoe bench --backward`: one training step of the MoE layer, forward and backward,
against the torch._grouped_mm pipeline under autograd (what transformers' "grouped_mm" experts
implementation runs when training).

Each (shape, dtype, routing, M) row runs two contenders on the same tensors: x [M, H] and a
router gate [E, H] that require grad, the layer's expert parameters (w13 [E, N, H], w2 [E, H, I],
biases where the shape has them), which both contenders read, and one output gradient g [M, H]:

    fusedmoe     logits = x @ gate.T                                   [M, E]
                 y = FusedMoE(x, logits): routing, the backend the layer's oracle picks for a
                 forward that autograd records (or each of --backends)
    grouped_mm   logits = x @ gate.T; softmax, top-k, renormalize
                 y = fusedmoe.tools.baselines.grouped_mm_experts (torch._grouped_mm for both
                 GEMMs, or its per-expert loop twin where torch._grouped_mm has no backward)
    then         torch.autograd.grad(y, [x, gate, w13, w2, (w13_bias, w2_bias)], g)

Both route by softmax top-k renormalized, whatever the preset's own routing (deepseek-v3's
grouped sigmoid routing is not reproduced in the baseline): the two compute the same function,
so their gradients can be compared. The logits come from x @ gate.T (x ~ N(0, 1), gate ~
N(0, 1 / H)), plus a constant Zipf-like expert bias for "skewed" (tools.bench.inputs' law).

Columns:

    fusedmoe_ms, grouped_mm_ms   median wall time of the whole step (gate, routing, forward,
                                 backward; CUDA events around each step on a GPU, nothing
                                 captured; time.perf_counter on the CPU), after a warm-up step
    speedup                      grouped_mm_ms / fusedmoe_ms
    *_GB                         torch.cuda.max_memory_allocated() during one step, the peak
                                 statistics reset before it (weights, inputs and the gradients
                                 returned included; GB = 1e9 bytes); "-" on the CPU
    *_roof%                      floor / time, floor = 3 x the forward's roofline floor
                                 (fusedmoe.tools.roofline.moe_floor: the forward's GEMMs, then
                                 those of dx and of dW; weights read twice, their gradients
                                 written once)
    out_err, dx_err, dW_err      max |fusedmoe - grouped_mm| / max |grouped_mm| of the output,
                                 of dx, and the largest over the weights (gate, w13, w2, biases;
                                 each one is in the JSON's grad_errs). A gradient above the
                                 dtype's bound (GRAD_TOLERANCE; BIAS_GRAD_TOLERANCE for the
                                 biases, where the baseline's own bf16 sums are the coarser
                                 side) is flagged in the note and the command exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from fusedmoe.tools.baselines import grouped_mm_backward_unavailable, grouped_mm_experts
from fusedmoe.tools.bench.inputs import seeded, skew_bias, skew_strength
from fusedmoe.tools.bench.report import format_table
from fusedmoe.tools.bench.sweep import PLAIN_DTYPES, preset_label
from fusedmoe.tools.bench.timing import peak_memory_gb, rel_err, time_ms
from fusedmoe.tools.presets import MoEPreset
from fusedmoe.tools.roofline import Ceilings, distinct_experts, moe_floor

__all__ = [
    "CPU_TOKENS",
    "GPU_TOKENS",
    "GRAD_TOLERANCE",
    "BackwardRow",
    "BackwardSpec",
    "check_trainable",
    "chunked_rel_err",
    "format_backward_table",
    "mismatched",
    "run_backward",
    "run_backward_command",
    "write_backward_csv",
    "write_backward_json",
]

#: default token counts of this mode: prefill-sized batches, where training runs
GPU_TOKENS = (4096, 16384)
CPU_TOKENS = (8, 64)
#: bound on out_err, dx_err and dW_err: a few roundings of the dtype apart (both contenders
#: round); a wrong gradient is off by its own size (error ~1)
GRAD_TOLERANCE = {"bf16": 5e-2, "fp16": 1e-2, "fp32": 1e-2}
#: the bound for the bias gradients: the baseline sums each expert's S / E rows into its bias
#: gradient with atomic adds in the activation dtype (index_select's backward), so in bf16 its
#: own error grows with the expert load (5e-2 at gpt-oss-120b, 16384 tokens). fusedmoe's sum
#: in float32 and are checked against float64 in tests/test_train_triton.py.
BIAS_GRAD_TOLERANCE = {"bf16": 1.5e-1, "fp16": 2e-2, "fp32": 1e-2}
#: the fwd+bwd floor is this many times the forward's
BACKWARD_FLOOR_FACTOR = 3


@dataclass
class BackwardRow:
    preset: str  # the shape's name, "(scaled 1/N)" where H and I were divided by N
    dtype: str  # bf16 / fp16 / fp32: activations, weights and gradients
    routing: str  # "uniform", "skewed" or "skewed:<strength>" router logits
    tokens: int  # M
    distinct: int  # D: distinct experts the routing touches
    backend: str  # the fusedmoe layer's backend for a recorded forward
    baseline: str  # "torch._grouped_mm" or "per-expert loop" (torch._grouped_mm has no backward)
    fusedmoe_ms: float  # one fwd+bwd step (NaN: failed, see note)
    grouped_mm_ms: float
    speedup: float  # grouped_mm_ms / fusedmoe_ms
    fusedmoe_peak_gb: float | None  # torch.cuda.max_memory_allocated of one step (None: CPU)
    grouped_mm_peak_gb: float | None
    base_gb: float | None  # allocated before a step (weights, inputs): in both peaks
    floor_ms: float  # BACKWARD_FLOOR_FACTOR x the forward's roofline floor
    fusedmoe_roofline_pct: float
    grouped_mm_roofline_pct: float
    out_err: float | None  # fusedmoe against grouped_mm, max-normalised (None: not compared)
    dx_err: float | None
    dw_err: float | None  # the largest of grad_errs but dx
    grad_errs: dict[str, float] = field(default_factory=dict)  # leaf name -> its error
    timing: str = ""  # "launch" (CUDA events) or "cpu"
    note: str = ""


def check_trainable(dtypes: Sequence[str]) -> None:
    """Only unquantized rows train: quantized experts are inference only."""
    quantized = [d for d in dtypes if d not in PLAIN_DTYPES]
    if quantized:
        raise ValueError(
            f"--backward times training, and quantized experts ({', '.join(quantized)}) are "
            f"inference only: --quant takes {list(PLAIN_DTYPES)} here"
        )


@dataclass
class BackwardSpec:
    presets: list[MoEPreset]  # shapes, already scaled where they should be
    dtypes: list[str]  # names of PLAIN_DTYPES
    tokens: list[int]
    routings: list[str]
    device: torch.device
    ceilings: Ceilings
    backends: list[str] | None = None  # layer backends (None: the oracle's, "auto")
    rep_ms: float = 50.0  # timed milliseconds per contender and row

    def __post_init__(self) -> None:
        check_trainable(self.dtypes)
        if not self.tokens or any(m < 1 for m in self.tokens):
            raise ValueError(f"--tokens must be counts >= 1, got {self.tokens}")
        bad = [r for r in self.routings if not _known_routing(r)]
        if bad or not self.presets or not self.dtypes or not self.routings:
            raise ValueError(f"nothing to benchmark, or unknown routing {bad}")

    @property
    def num_cases(self) -> int:
        backends = len(self.backends or ["auto"])
        return (
            len(self.presets) * len(self.dtypes) * backends * len(self.routings) * len(self.tokens)
        )


def _known_routing(kind: str) -> bool:
    try:
        skew_strength(kind)
    except ValueError:
        return False
    return True


# ---- the inputs of one row ---------------------------------------------------------------------
@dataclass
class StepInputs:
    """What both contenders of a row differentiate with respect to, and the output gradient."""

    x: torch.Tensor  # [M, H] requires grad
    gate: torch.Tensor  # [E, H] requires grad: logits = x @ gate.T
    logit_bias: torch.Tensor | None  # float32 [E], constant: the skewed routing's bias
    grad_out: torch.Tensor  # [M, H]


def _inputs(preset: MoEPreset, routing: str, m: int, dtype, device) -> StepInputs:
    e, h = preset.num_experts, preset.hidden_size
    gen = seeded(device, preset.name, "backward", routing, m, e, h)
    x = torch.randn(m, h, device=device, generator=gen).to(dtype).requires_grad_()
    gate = torch.randn(e, h, device=device, generator=gen).mul_(h**-0.5).to(dtype)
    grad_out = torch.randn(m, h, device=device, generator=gen).to(dtype)
    strength = skew_strength(routing)
    bias = None if strength is None else skew_bias(e, strength, gen, device)
    return StepInputs(x, gate.requires_grad_(), bias, grad_out)


def _logits(inputs: StepInputs) -> torch.Tensor:
    logits = F.linear(inputs.x, inputs.gate)  # [M, E]
    return logits if inputs.logit_bias is None else logits + inputs.logit_bias


def _softmax_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [M, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [M, k]
    return weights / weights.sum(dim=-1, keepdim=True), ids.int()


def _build_layer(preset: MoEPreset, dtype: torch.dtype, device, backend: str):
    """The preset's layer (shape, activation, biases) routed by softmax top-k renormalized, its
    weights drawn N(0, 1 / fan_in) in place from a seeded generator."""
    plain = dataclasses.replace(preset, routing={}, correction_bias=False)
    layer = plain.build(dtype=dtype, device=device, backend=backend)
    gen = seeded(device, preset.name, "backward", "weights")
    with torch.no_grad():
        layer.w13_weight.normal_(0.0, preset.hidden_size**-0.5, generator=gen)
        layer.w2_weight.normal_(0.0, preset.intermediate_size**-0.5, generator=gen)
        for bias in (layer.w13_bias, layer.w2_bias):
            if bias is not None:
                bias.normal_(0.0, 0.1, generator=gen)
    return layer.train()


def _leaves(layer, inputs: StepInputs) -> dict[str, torch.Tensor]:
    leaves = {"x": inputs.x, "gate": inputs.gate, "w13": layer.w13_weight, "w2": layer.w2_weight}
    if layer.w13_bias is not None:
        leaves |= {"w13_bias": layer.w13_bias, "w2_bias": layer.w2_bias}
    return leaves


Step = Callable[[], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


def _steps(layer, inputs: StepInputs, loop: bool) -> dict[str, Step]:
    """Each contender's step: -> (y [M, H], the gradients of _leaves in order)."""
    leaves = list(_leaves(layer, inputs).values())
    top_k, act = layer.top_k, layer.activation.kind

    def fusedmoe_step():
        y = layer(inputs.x, _logits(inputs))
        return y, torch.autograd.grad(y, leaves, inputs.grad_out)

    def grouped_mm_step():
        weights, ids = _softmax_topk(_logits(inputs), top_k)
        y = grouped_mm_experts(
            inputs.x, layer.w13_weight, layer.w2_weight, weights, ids, act, loop,
            w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        )  # fmt: skip
        return y, torch.autograd.grad(y, leaves, inputs.grad_out)

    return {"fusedmoe": fusedmoe_step, "grouped_mm": grouped_mm_step}


# ---- measuring ----------------------------------------------------------------------------------
def _why(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}"


@dataclass
class _Measured:
    ms: float = math.nan
    peak: tuple[float, float] | None = None
    result: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None
    error: str | None = None


def _kept(result) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A step's output and gradients, detached, moved to the host: while the other contender
    runs they hold no GPU memory (deepseek-v3's weight gradients alone are 22 GB in bf16)."""
    y, grads = result
    return y.detach().cpu(), tuple(g.cpu() for g in grads)


def _measure(step: Step, spec: BackwardSpec) -> _Measured:
    device = spec.device
    try:
        result = _kept(step())  # warm-up (compilation, autotuning) and the values compared
        peak = peak_memory_gb(step, device)
        ms, _ = time_ms(step, device, rep_ms=spec.rep_ms, capturable=False)
        return _Measured(ms, peak, result)
    except Exception as exc:  # one contender failing (refused, out of memory) must not end the run
        if device.type == "cuda":
            with contextlib.suppress(RuntimeError):
                torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        return _Measured(error=_why(exc))


def chunked_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """timing.rel_err, max |actual - expected| / max |expected|, a slice of rows at a time in
    float32 (a whole float64 copy of a preset's weight gradient would not fit)."""
    if expected.numel() == 0:
        return 0.0
    rows = max(1, (1 << 24) // max(1, expected[0].numel())) if expected.dim() else 1
    if expected.dim() == 0 or rows >= expected.shape[0]:
        return rel_err(actual, expected)
    diff = scale = 0.0
    for start in range(0, expected.shape[0], rows):
        a, e = actual[start : start + rows].float(), expected[start : start + rows].float()
        diff = max(diff, float((a - e).abs().max()))
        scale = max(scale, float(e.abs().max()))
    return diff / scale if scale > 0 else diff


def _errors(names: Sequence[str], ours, theirs) -> tuple[float, dict[str, float]]:
    out_err = chunked_rel_err(ours[0], theirs[0])
    grads = {n: chunked_rel_err(a, b) for n, a, b in zip(names, ours[1], theirs[1], strict=True)}
    return out_err, grads


# ---- the sweep -----------------------------------------------------------------------------------
def _bench_layer(preset, dtype_name, backend, spec: BackwardSpec, note, step) -> list[BackwardRow]:
    device, dtype = spec.device, PLAIN_DTYPES[dtype_name]
    layer = _build_layer(preset, dtype, device, backend)
    where = f"{preset_label(preset)}, {dtype_name}"
    try:
        choice = layer.backend_choice(requires_grad=True)
        backend_name = choice.name
        note(f"{where}: the layer runs {choice.name} under autograd ({choice.reason})")
    except ValueError as exc:  # a named backend without a backward: the rows say so
        backend_name = backend
        note(f"{where}: {exc}")
    why_loop = grouped_mm_backward_unavailable(device, dtype)
    loop = why_loop is not None
    baseline = "per-expert loop" if loop else "torch._grouped_mm"
    if loop:
        note(f"{where}: grouped_mm runs as a per-expert loop ({why_loop})")
    rows = []
    for routing in spec.routings:
        for m in spec.tokens:
            inputs = _inputs(preset, routing, m, dtype, device)
            row = _bench_case(
                preset, dtype_name, routing, layer, inputs, backend_name, baseline, loop, spec
            )
            rows.append(row)
            if step is not None:
                step(f"{where}, {routing}, M={m}")
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _bench_case(preset, dtype_name, routing, layer, inputs, backend, baseline, loop, spec):
    m = inputs.x.shape[0]
    with torch.no_grad():
        _, ids = _softmax_topk(_logits(inputs), preset.top_k)
    num_distinct = distinct_experts(ids, preset.num_experts)
    names = list(_leaves(layer, inputs))
    measured = {name: _measure(s, spec) for name, s in _steps(layer, inputs, loop).items()}
    ours, theirs = measured["fusedmoe"], measured["grouped_mm"]
    notes = [f"{name} failed: {r.error}" for name, r in measured.items() if r.error]
    out_err = dx_err = dw_err = None
    grad_errs: dict[str, float] = {}
    if ours.result is not None and theirs.result is not None:
        out_err, grad_errs = _errors(names, ours.result, theirs.result)
        dx_err = grad_errs["x"]
        dw_err = max(v for k, v in grad_errs.items() if k != "x")
        bound = GRAD_TOLERANCE[dtype_name]

        def bound_of(name: str) -> float:
            return BIAS_GRAD_TOLERANCE[dtype_name] if name.endswith("_bias") else bound

        errors = {"out": out_err, **grad_errs}
        worst = {k: v for k, v in errors.items() if not v <= bound_of(k)}
        if worst:
            listed = ", ".join(f"{k} {v:.1e} (bound {bound_of(k):.0e})" for k, v in worst.items())
            notes.append(f"GRADIENT MISMATCH: {listed}")
    floor = moe_floor(
        dtype_name,
        num_distinct=num_distinct,
        num_tokens=m,
        top_k=preset.top_k,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        ceilings=spec.ceilings,
        gated=layer.activation.kind.is_gated,
        act_bytes=PLAIN_DTYPES[dtype_name].itemsize,
    )
    floor_ms = BACKWARD_FLOOR_FACTOR * floor.seconds * 1e3
    base = ours.peak or theirs.peak
    return BackwardRow(
        preset=preset_label(preset),
        dtype=dtype_name,
        routing=routing,
        tokens=m,
        distinct=num_distinct,
        backend=backend,
        baseline=baseline,
        fusedmoe_ms=ours.ms,
        grouped_mm_ms=theirs.ms,
        speedup=theirs.ms / ours.ms,
        fusedmoe_peak_gb=None if ours.peak is None else ours.peak[0],
        grouped_mm_peak_gb=None if theirs.peak is None else theirs.peak[0],
        base_gb=None if base is None else base[1],
        floor_ms=floor_ms,
        fusedmoe_roofline_pct=100.0 * floor_ms / ours.ms,
        grouped_mm_roofline_pct=100.0 * floor_ms / theirs.ms,
        out_err=out_err,
        dx_err=dx_err,
        dw_err=dw_err,
        grad_errs=grad_errs,
        timing="launch" if spec.device.type == "cuda" else "cpu",
        note="; ".join(notes),
    )


def run_backward(
    spec: BackwardSpec,
    *,
    note: Callable[[str], None] = print,
    step: Callable[[str], None] | None = None,
) -> list[BackwardRow]:
    """Every row: shapes x dtypes x layer backends x routings x token counts."""
    rows: list[BackwardRow] = []
    for preset in spec.presets:
        for dtype_name in spec.dtypes:
            for backend in spec.backends or ["auto"]:
                try:
                    rows += _bench_layer(preset, dtype_name, backend, spec, note, step)
                except (ValueError, TypeError, RuntimeError) as exc:  # the layer is refused
                    note(f"{preset_label(preset)}, {dtype_name}, {backend}: no layer: {exc!s:.300}")
                if spec.device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def mismatched(rows: Sequence[BackwardRow]) -> list[BackwardRow]:
    """The rows whose gradients disagree beyond GRAD_TOLERANCE."""
    return [r for r in rows if "GRADIENT MISMATCH" in r.note]


# ---- output --------------------------------------------------------------------------------------
def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or value != value else format(value, fmt)  # NaN -> "-"


_COLUMNS = (  # (header, row -> text, right-aligned)
    ("preset", lambda r: r.preset, False),
    ("dtype", lambda r: r.dtype, False),
    ("routing", lambda r: r.routing, False),
    ("tokens", lambda r: str(r.tokens), True),
    ("backend", lambda r: r.backend, False),
    ("fusedmoe_ms", lambda r: _num(r.fusedmoe_ms, ".3f"), True),
    ("grouped_mm_ms", lambda r: _num(r.grouped_mm_ms, ".3f"), True),
    ("speedup", lambda r: _num(r.speedup, ".2f"), True),
    ("fusedmoe_GB", lambda r: _num(r.fusedmoe_peak_gb, ".2f"), True),
    ("grouped_mm_GB", lambda r: _num(r.grouped_mm_peak_gb, ".2f"), True),
    ("floor_ms", lambda r: _num(r.floor_ms, ".4f"), True),
    ("fusedmoe_roof%", lambda r: _num(r.fusedmoe_roofline_pct, ".1f"), True),
    ("grouped_mm_roof%", lambda r: _num(r.grouped_mm_roofline_pct, ".1f"), True),
    ("out_err", lambda r: _num(r.out_err, ".1e"), True),
    ("dx_err", lambda r: _num(r.dx_err, ".1e"), True),
    ("dW_err", lambda r: _num(r.dw_err, ".1e"), True),
    ("baseline", lambda r: r.baseline, False),
    ("note", lambda r: r.note, False),
)


def format_backward_table(rows: Sequence[BackwardRow]) -> str:
    return format_table(rows, _COLUMNS)


def _record(row: BackwardRow, run_info: dict) -> dict:
    def clean(v):
        return None if isinstance(v, float) and v != v else v  # NaN -> null

    values = {k: clean(v) for k, v in asdict(row).items()}
    values["grad_errs"] = {k: clean(v) for k, v in row.grad_errs.items()}
    return {**values, **run_info}


def write_backward_json(path: Path, rows: Sequence[BackwardRow], run_info: dict) -> None:
    path.write_text(json.dumps([_record(r, run_info) for r in rows], indent=1) + "\n")


def write_backward_csv(path: Path, rows: Sequence[BackwardRow], run_info: dict) -> None:
    """One line per row; grad_errs spread over grad_err_<leaf> columns."""
    leaves = list(dict.fromkeys(k for r in rows for k in r.grad_errs))
    fields = [f for f in BackwardRow.__dataclass_fields__ if f != "grad_errs"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*fields, *(f"grad_err_{k}" for k in leaves),
                                               *run_info])  # fmt: skip
        writer.writeheader()
        for r in rows:
            record = _record(r, run_info)
            errs = record.pop("grad_errs")
            writer.writerow({**record, **{f"grad_err_{k}": v for k, v in errs.items()}})


def run_backward_command(
    args: argparse.Namespace, device: torch.device, shapes: list[MoEPreset], tokens: list[int]
) -> int:
    """`fusedmoe bench --backward`: the notes, the table last; JSON. Exits 1 when a row's
    gradients disagree (or no row ran)."""
    from fusedmoe.tools.bench.report import Progress
    from fusedmoe.tools.ceilings import device_label, resolve_ceilings

    check_trainable(args.quant)  # before the ceilings are measured
    ceilings = resolve_ceilings(
        args.ceilings, device, hbm_gbps=args.hbm_gbps, bf16_tflops=args.bf16_tflops,
        fp8_tflops=args.fp8_tflops,
    )  # fmt: skip
    spec = BackwardSpec(
        presets=shapes, dtypes=args.quant, tokens=tokens, routings=args.routing, device=device,
        ceilings=ceilings, backends=args.backends, rep_ms=args.rep_ms,
    )  # fmt: skip
    label = device_label(device)
    notes: list[str] = []
    progress = Progress(spec.num_cases, quiet=args.quiet)
    try:
        rows = run_backward(spec, note=notes.append, step=progress.step)
    finally:
        progress.finish()
    how = (
        "CUDA events around each step (median), peak memory torch.cuda.max_memory_allocated"
        if device.type == "cuda"
        else "cpu: time.perf_counter medians; no memory figures"
    )
    header = [
        f"fusedmoe bench --backward on {label}, torch {torch.__version__}: forward + backward "
        "(gate, routing, experts; grads of x, gate, w13, w2 and biases) vs grouped_mm under "
        "autograd",
        how,
        f"floor: {BACKWARD_FLOOR_FACTOR}x the forward's ({ceilings.name}: "
        f"{ceilings.hbm_gbps:.1f} GB/s, {ceilings.bf16_tflops:.3g} TFLOP/s bf16); errors: "
        "fusedmoe against grouped_mm, max-normalised",
    ]
    print("\n".join(f"# {line}" for line in [*header, *notes]))
    run_info = {
        "device": label,
        "ceilings": ceilings.name,
        "hbm_gbps": ceilings.hbm_gbps,
        "bf16_tflops": ceilings.bf16_tflops,
        "torch": torch.__version__,
    }
    for path, write in ((args.json, write_backward_json), (args.csv, write_backward_csv)):
        if path is not None:
            write(Path(path), rows, run_info)
            print(f"# wrote {len(rows)} rows to {path}")
    print(format_backward_table(rows))
    return 0 if rows and not mismatched(rows) else 1
