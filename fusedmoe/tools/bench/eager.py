"""`fusedmoe bench --eager`: what a call costs when nobody captures a CUDA graph.

Most callers run eager: a transformers model, a plain PyTorch loop, a notebook. Between two
kernels the GPU waits for the host to launch the next one, and a host sync stalls the queue.
This mode times four entries of each (shape, scheme, M), on the same inputs:

    layer                 FusedMoE.forward(x, router_logits): checks, routing, the backend the
                          layer's oracle picked, shared experts (none in the presets)
    fused_experts         fusedmoe.fused_experts(x, w13, w2, topk_weights, topk_ids) given the
                          layer's own routing, on the layer's (quantized) weights
    grouped_mm+routing    the plain PyTorch pipeline a layer replaces: softmax, top-k,
                          renormalize, then fusedmoe.tools.baselines.grouped_mm_experts
    grouped_mm            grouped_mm_experts alone, given the layer's routing

The grouped_mm entries read the layer's 16-bit weights (before quantize_ in quantized rows).

Columns (GPU; on the CPU only eager_us and host_us, the others "-"):

    eager_us    wall time of N back-to-back calls / N, one torch.cuda.synchronize() after the
                N-th (after warm-up); median of 3 such loops. On the CPU: time.perf_counter.
    graph_us    the same call captured once in a torch.cuda.CUDAGraph, replayed N times back
                to back, one synchronize after the last, wall time / N; "-" where the call
                cannot be captured (it reads device values on the host), with the error in note
    ratio       eager_us / graph_us: what the host costs on top of the GPU's work
    host_us     host work per call: the wall time from the start of the N calls to the
                return of the N-th, before the final synchronize, / N (median of 3 loops).
                While the GPU keeps up, it is the CPU time of issuing one call (Python,
                checks, launches, allocator); once the GPU is the bottleneck and the launch
                queue fills, issuing blocks and it approaches eager_us. host_us ~ eager_us
                and eager_us >> graph_us: the call is host-bound.
    launches    GPU activities of one call under torch.profiler (ProfilerActivity.CUDA):
                kernels, memcpy and memset, counted from the profiler's device-side events
    syncs       host synchronisations of one call: warnings of
                torch.cuda.set_sync_debug_mode("warn") ("called a synchronizing CUDA
                operation"): .item(), .tolist(), nonzero, device-to-host copies, ...; it
                misses syncs that do not go through PyTorch (a raw cudaDeviceSynchronize)

N is chosen from the warm-up so that one loop takes about --rep-ms (10 to 200 calls; 3 to 20
on the CPU). The first call (compilation, autotuning) is never timed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fusedmoe.functional import fused_experts
from fusedmoe.layer_backends import layer_problem
from fusedmoe.oracle import select_backend
from fusedmoe.tools.baselines import grouped_mm_experts, grouped_mm_unavailable
from fusedmoe.tools.bench.inputs import make_routing
from fusedmoe.tools.bench.report import format_table
from fusedmoe.tools.bench.sweep import PLAIN_DTYPES, QUANTS, SCHEME_ACT, preset_label
from fusedmoe.tools.presets import MoEPreset

__all__ = ["ENTRIES", "EagerRow", "EagerSpec", "format_eager_table", "run_eager", "time_eager"]

ENTRIES = ("layer", "fused_experts", "grouped_mm+routing", "grouped_mm")
SYNC_WARNING = "called a synchronizing CUDA operation"
_LOOPS = 3  # timed loops of N calls; medians are kept


@dataclass
class EagerRow:
    preset: str  # the shape's name, "(scaled 1/N)" where H and I were divided by N
    quant: str  # bf16 / fp16 / fp32 or the scheme the layer was quantized to
    routing: str  # "uniform", "skewed" or "skewed:<strength>" router logits
    entry: str  # one of ENTRIES
    backend: str  # the backend that ran: the layer's oracle choice, fused_experts', or torch
    tokens: int  # M
    calls: int  # N, calls per timed loop
    eager_us: float  # wall time per call, N back-to-back calls, one sync at the end
    graph_us: float | None  # per call, CUDA-graph replays; None: not captured (or the CPU)
    ratio: float | None  # eager_us / graph_us
    host_us: float  # time to issue one call (until the N-th returns, before the sync) / N
    launches: int | None  # kernels + memcpy + memset of one call (None: the CPU, or failed)
    syncs: int | None  # host syncs of one call (None: the CPU)
    timing: str  # "cuda" (wall clock around CUDA work) or "cpu"
    note: str  # why a column is "-", or what the entry runs


@dataclass
class EagerSpec:
    presets: list[MoEPreset]  # shapes, already scaled where they should be
    quants: list[str]  # names of QUANTS
    tokens: list[int]
    routings: list[str]
    device: torch.device
    backends: list[str] | None = None  # layer backends (None: the oracle's, "auto")
    rep_ms: float = 50.0  # about this long per timed loop

    def __post_init__(self) -> None:
        bad = [q for q in self.quants if q not in QUANTS]
        if bad:
            raise ValueError(f"unknown --quant {bad}; expected names of {list(QUANTS)}")
        if not self.tokens or any(m < 1 for m in self.tokens):
            raise ValueError(f"--tokens must be counts >= 1, got {self.tokens}")

    @property
    def num_cases(self) -> int:
        backends = len(self.backends or ["auto"])
        return (
            len(self.presets) * len(self.quants) * backends * len(self.routings) * len(self.tokens)
        )


# ---- measuring one call ------------------------------------------------------------------------
@dataclass
class EagerTiming:
    calls: int
    eager_us: float
    host_us: float
    graph_us: float | None
    graph_error: str | None
    launches: int | None
    syncs: int | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _settle(device: torch.device) -> None:
    """Synchronize after a failure; a sticky CUDA error surfaces in the next row instead."""
    with contextlib.suppress(RuntimeError):
        _sync(device)


def _why(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:160]}"


def _calls(per_call_s: float, rep_ms: float, device: torch.device) -> int:
    low, high = (10, 200) if device.type == "cuda" else (3, 20)
    return int(min(high, max(low, rep_ms / 1e3 / max(per_call_s, 1e-9))))


def _eager_loop(fn: Callable[[], object], calls: int, device: torch.device) -> tuple[float, float]:
    """-> (wall seconds of the calls and the sync after them, seconds until the last returned)."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    _sync(device)
    return time.perf_counter() - start, issued - start


def _graph_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Per-call wall microseconds of `calls` replays of fn() captured in one CUDA graph."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture wants
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    _sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    samples = []
    for _ in range(_LOOPS):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            graph.replay()
        _sync(device)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    del graph
    return statistics.median(samples)


def count_launches(fn: Callable[[], object], device: torch.device) -> int:
    """GPU activities (kernels, memcpy, memset) of one fn() call, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def count_syncs(fn: Callable[[], object]) -> int:
    """Host synchronisations of one fn() call, as torch.cuda's sync debug mode warns them."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(1 for w in caught if SYNC_WARNING in str(w.message))


def time_eager(fn: Callable[[], object], device: torch.device, rep_ms: float) -> EagerTiming:
    """Eager and graph time per call, host time, launches and syncs of fn() on `device`."""
    fn()  # compile, autotune, allocate: never timed
    _sync(device)
    warm = _eager_loop(fn, 3, device)[0] / 3
    calls = _calls(warm, rep_ms, device)
    loops = [_eager_loop(fn, calls, device) for _ in range(_LOOPS)]
    eager_us = statistics.median(wall for wall, _ in loops) / calls * 1e6
    host_us = statistics.median(issued for _, issued in loops) / calls * 1e6
    if device.type != "cuda":
        return EagerTiming(calls, eager_us, host_us, None, None, None, None)
    syncs = count_syncs(fn)
    try:
        launches: int | None = count_launches(fn, device)
    except Exception:  # the profiler is unavailable (CUPTI): not a reason to drop the row
        launches = None
    graph_us, graph_error = None, None
    try:
        graph_us = _graph_us(fn, calls, device)
    except Exception as exc:  # a host read inside the call: it cannot be captured
        graph_error = f"not captured: {_why(exc)}"
        _settle(device)
    return EagerTiming(calls, eager_us, host_us, graph_us, graph_error, launches, syncs)


# ---- the entries of one (shape, scheme, backend) -----------------------------------------------
def _softmax_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a plain PyTorch MoE block routes by: softmax, top-k, renormalize."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [M, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [M, k]
    return weights / weights.sum(dim=-1, keepdim=True), ids.int()


def _fused_experts_backend(layer, requested: str, dtype: torch.dtype, device: torch.device):
    """(what fused_experts is given, the backend that runs) for the layer's weights.

    A layer whose backend was requested by name: fused_experts gets that name (strict, as the
    layer), or, for a backend that routes inside, the oracle's pick without router logits. An
    oracle-chosen layer: fused_experts gets "auto", as a caller who names no backend does (a
    backend named outright is strict: deep_gemm would then keep small calls it hands to triton
    under "auto")."""
    choice = layer.backend_choice()
    if not choice.experts_cls.routes_inside:
        return ("auto" if requested == "auto" else choice.name), choice.name
    # the layer's problem as fused_experts poses it: no router logits, the layer's quant config
    problem = dataclasses.replace(
        layer_problem(layer, device, dtype, requires_grad=False),
        quant_config=layer.quant_config,
        has_router_logits=False,
    )
    name = select_backend(problem).name
    return ("auto" if requested == "auto" else name), name


def _entries(layer, r, top_k: int, fe_backend: str, w13_plain, w2_plain, loop: bool):
    """ENTRIES -> a call of no arguments, on the inputs of `r`."""
    x, logits = r.x, r.router_logits
    act = layer.activation.kind
    with torch.inference_mode():
        topk_weights, topk_ids = layer.router.select_experts(x, logits)  # the layer's routing
    w13, w2, qc = layer.w13_weight, layer.w2_weight, layer.quant_config

    def run_fused_experts():
        return fused_experts(
            x, w13, w2, topk_weights, topk_ids, activation=act, quant_config=qc,
            activation_params=layer.activation.params, w13_bias=layer.w13_bias,
            w2_bias=layer.w2_bias, backend=fe_backend,
        )  # fmt: skip

    def run_grouped_mm_routed():
        weights, ids = _softmax_topk(logits, top_k)
        return grouped_mm_experts(x, w13_plain, w2_plain, weights, ids, act, loop)

    def run_grouped_mm():
        return grouped_mm_experts(x, w13_plain, w2_plain, topk_weights, topk_ids, act, loop)

    return {
        "layer": lambda: layer(x, logits),
        "fused_experts": run_fused_experts,
        "grouped_mm+routing": run_grouped_mm_routed,
        "grouped_mm": run_grouped_mm,
    }


def _bench_layer(preset: MoEPreset, quant: str, backend: str, spec: EagerSpec, note, step):
    device = spec.device
    dtype = PLAIN_DTYPES[quant if quant in PLAIN_DTYPES else SCHEME_ACT]
    layer = preset.build(dtype=dtype, device=device, backend=backend)
    w13_plain = layer.w13_weight.detach()  # the 16-bit weights, kept for grouped_mm
    w2_plain = layer.w2_weight.detach()
    if quant not in PLAIN_DTYPES:
        layer.quantize_(quant)
    layer.eval()
    choice = layer.backend_choice()
    fe_arg, fe_backend = _fused_experts_backend(layer, backend, dtype, device)
    where = f"{preset_label(preset)}, {quant}"
    note(
        f"{where}: the layer runs {choice.name} ({choice.reason}); "
        f"fused_experts(backend={fe_arg!r}) runs {fe_backend}"
    )
    loop = grouped_mm_unavailable(device, dtype) is not None
    gmm = "torch (per-expert loop)" if loop else "torch._grouped_mm"
    rows = []
    for routing in spec.routings:
        for m in spec.tokens:
            r = make_routing(
                preset.name, m, preset.num_experts, preset.top_k, preset.hidden_size, routing,
                dtype, device,
            )  # fmt: skip
            entries = _entries(layer, r, preset.top_k, fe_arg, w13_plain, w2_plain, loop)
            for entry, fn in entries.items():
                name = {"layer": choice.name, "fused_experts": fe_backend}.get(entry, gmm)
                what = "softmax top-k routing" if entry == "grouped_mm+routing" else ""
                rows.append(_row(preset, quant, routing, entry, name, m, fn, what, spec, note))
            if step is not None:
                step(f"{where}, {routing}, M={m}")
    return rows


def _row(preset, quant, routing, entry, backend, m, fn, what, spec: EagerSpec, note) -> EagerRow:
    device = spec.device
    base = dict(preset=preset_label(preset), quant=quant, routing=routing, entry=entry,
                backend=backend, tokens=m, timing=device.type)  # fmt: skip
    try:
        with torch.inference_mode():
            t = time_eager(fn, device, spec.rep_ms)
    except Exception as exc:  # one entry failing must not end the run
        message = f"failed: {_why(exc)}"
        note(f"{preset_label(preset)}, {quant}, M={m}: {entry} {message}")
        _settle(device)
        nan = float("nan")
        return EagerRow(**base, calls=0, eager_us=nan, graph_us=None, ratio=None, host_us=nan,
                        launches=None, syncs=None, note=message)  # fmt: skip
    notes = [n for n in (what, t.graph_error) if n]
    ratio = None if t.graph_us is None or t.graph_us <= 0 else t.eager_us / t.graph_us
    return EagerRow(
        **base, calls=t.calls, eager_us=t.eager_us, graph_us=t.graph_us, ratio=ratio,
        host_us=t.host_us, launches=t.launches, syncs=t.syncs, note="; ".join(notes),
    )  # fmt: skip


def run_eager(
    spec: EagerSpec,
    *,
    note: Callable[[str], None] = print,
    step: Callable[[str], None] | None = None,
) -> list[EagerRow]:
    """Every row: shapes x schemes x layer backends x routings x token counts x ENTRIES."""
    rows: list[EagerRow] = []
    for preset in spec.presets:
        for quant in spec.quants:
            for backend in spec.backends or ["auto"]:
                try:
                    rows += _bench_layer(preset, quant, backend, spec, note, step)
                except (ValueError, TypeError, RuntimeError) as exc:  # the layer is refused
                    note(f"{preset_label(preset)}, {quant}, {backend}: no layer: {exc!s:.300}")
                if spec.device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


# ---- output --------------------------------------------------------------------------------------
def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or value != value else format(value, fmt)  # NaN -> "-"


_COLUMNS = (  # (header, row -> text, right-aligned)
    ("preset", lambda r: r.preset, False),
    ("quant", lambda r: r.quant, False),
    ("entry", lambda r: r.entry, False),
    ("backend", lambda r: r.backend, False),
    ("tokens", lambda r: str(r.tokens), True),
    ("eager_us", lambda r: _num(r.eager_us, ".1f"), True),
    ("graph_us", lambda r: _num(r.graph_us, ".1f"), True),
    ("eager/graph", lambda r: _num(r.ratio, ".2f"), True),
    ("host_us", lambda r: _num(r.host_us, ".1f"), True),
    ("launches", lambda r: "-" if r.launches is None else str(r.launches), True),
    ("syncs", lambda r: "-" if r.syncs is None else str(r.syncs), True),
    ("note", lambda r: r.note, False),
)


def format_eager_table(rows: Sequence[EagerRow]) -> str:
    return format_table(rows, _COLUMNS)


def _record(row: EagerRow, run_info: dict) -> dict:
    values = {k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(row).items()}
    return {**values, **run_info}


def write_eager_json(path: Path, rows: Sequence[EagerRow], run_info: dict) -> None:
    path.write_text(json.dumps([_record(r, run_info) for r in rows], indent=1) + "\n")


def write_eager_csv(path: Path, rows: Sequence[EagerRow], run_info: dict) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*EagerRow.__dataclass_fields__, *run_info])
        writer.writeheader()
        for r in rows:
            writer.writerow(_record(r, run_info))


def run_eager_command(
    args: argparse.Namespace, device: torch.device, shapes: list[MoEPreset], tokens: list[int]
) -> int:
    """`fusedmoe bench --eager`: the rows, the notes, the table last; JSON and CSV."""
    from fusedmoe.tools.bench.report import Progress
    from fusedmoe.tools.ceilings import device_label

    spec = EagerSpec(
        presets=shapes, quants=args.quant, tokens=tokens, routings=args.routing, device=device,
        backends=args.backends, rep_ms=args.rep_ms,
    )  # fmt: skip
    label = device_label(device)
    notes: list[str] = []
    progress = Progress(spec.num_cases, quiet=args.quiet)
    try:
        rows = run_eager(spec, note=notes.append, step=progress.step)
    finally:
        progress.finish()
    how = (
        "wall clock, N calls then one torch.cuda.synchronize(); graph: the call replayed from "
        "a CUDA graph; launches: torch.profiler; syncs: set_sync_debug_mode('warn')"
        if device.type == "cuda"
        else "cpu: time.perf_counter over N calls; graph, launches and syncs need CUDA"
    )
    header = [f"fusedmoe bench --eager on {label}, torch {torch.__version__}", how]
    print("\n".join(f"# {line}" for line in [*header, *notes]))
    run_info = {"device": label, "torch": torch.__version__}
    for path, write in ((args.json, write_eager_json), (args.csv, write_eager_csv)):
        if path is not None:
            write(Path(path), rows, run_info)
            print(f"# wrote {len(rows)} rows to {path}")
    print(format_eager_table(rows))
    return 0 if rows else 1
