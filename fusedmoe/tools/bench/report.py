"""The outputs of `fusedmoe bench`: a terminal table, JSON, CSV, a PNG plot, a progress bar.

JSON is a list of objects, one per row, with the keys of fusedmoe.tools.bench.sweep.Row (preset,
quant, routing, backend, weights, tokens, distinct, time_ms, tflops, gbps, floor_ms,
roofline_pct, rel_err, err_ref, timing, extra_gb, err_bf16) plus the run's device and ceilings;
CSV has the same columns. The plot needs matplotlib (pip install 'fusedmoe[plot]'): one panel
per (shape, scheme, routing), time against tokens on log-log axes, one line per contender and
the floor of the scheme's weights dashed.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from fusedmoe.tools.bench.sweep import Row

__all__ = ["Progress", "format_table", "plot_available", "write_csv", "write_json", "write_plot"]

PLOT_HINT = "pip install 'fusedmoe[plot]' (or pip install matplotlib)"

_COLUMNS = (  # (header, row -> text, right-aligned)
    ("preset", lambda r: r.preset, False),
    ("quant", lambda r: r.quant, False),
    ("routing", lambda r: r.routing, False),
    ("backend", lambda r: r.backend, False),
    ("weights", lambda r: r.weights, False),
    ("tokens", lambda r: str(r.tokens), True),
    ("D", lambda r: str(r.distinct), True),
    ("time_ms", lambda r: f"{r.time_ms:.4f}", True),
    ("TFLOP/s", lambda r: f"{r.tflops:.2f}", True),
    ("GB/s", lambda r: f"{r.gbps:.1f}", True),
    ("floor_ms", lambda r: f"{r.floor_ms:.4f}", True),
    ("roofline_pct", lambda r: f"{r.roofline_pct:.1f}", True),
    ("rel_err", lambda r: "-" if r.rel_err is None else f"{r.rel_err:.1e}", True),
    ("vs", lambda r: r.err_ref, False),
    ("err_bf16", lambda r: "-" if r.err_bf16 is None else f"{r.err_bf16:.1e}", True),
    ("timing", lambda r: r.timing, False),
    ("extra_GB", lambda r: "-" if r.extra_gb is None else f"{r.extra_gb:.3f}", True),
)


def format_table(rows: Sequence, columns: Sequence[tuple] = _COLUMNS) -> str:
    """The rows as an aligned text table (a header line, a rule, one line per row); columns:
    (header, row -> text, right-aligned) each, the bench's by default."""
    cells = [[fmt(r) for _, fmt, _ in columns] for r in rows]
    widths = [
        max(len(header), *(len(c[i]) for c in cells)) if cells else len(header)
        for i, (header, _, _) in enumerate(columns)
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, (_, _, right) in zip(values, widths, columns, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line([h for h, _, _ in columns]), line(["-" * w for w in widths])]
    return "\n".join(out + [line(c) for c in cells])


def write_json(path: Path, rows: Sequence[Row], run_info: dict) -> None:
    path.write_text(json.dumps([{**asdict(r), **run_info} for r in rows], indent=1) + "\n")


def write_csv(path: Path, rows: Sequence[Row], run_info: dict) -> None:
    fields = [*Row.__dataclass_fields__, *run_info]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({**asdict(r), **run_info})


def plot_available() -> str | None:
    """None when matplotlib can be imported, else why not and how to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"--plot needs matplotlib ({exc}): {PLOT_HINT}"
    return None


def write_plot(path: Path, rows: Sequence[Row], title: str) -> None:
    """Latency against tokens, one panel per (shape, scheme, routing), floor dashed."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display; a no-op when a backend is already set
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        panels.setdefault((r.preset, r.quant, r.routing), []).append(r)
    if not panels:
        raise ValueError("--plot: no rows to plot")
    names = list(dict.fromkeys(r.backend for r in rows))  # one color per contender everywhere
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {name: palette[n % len(palette)] for n, name in enumerate(names)}
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.0 * nrows), squeeze=False)
    for ax, ((preset, quant, routing), panel) in zip(axes.flat, panels.items(), strict=False):
        by_backend: dict[str, list[Row]] = {}
        for r in panel:
            by_backend.setdefault(r.backend, []).append(r)
        for backend, series in by_backend.items():
            series.sort(key=lambda r: r.tokens)
            ax.plot(
                [r.tokens for r in series], [r.time_ms for r in series], marker="o",
                label=backend, color=color[backend],
            )  # fmt: skip
        floor = sorted({(r.tokens, r.floor_ms) for r in panel if r.weights == quant})
        if floor:
            ax.plot(
                [t for t, _ in floor], [f for _, f in floor], "k--", linewidth=1.5,
                label=f"floor ({quant} weights)",
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        ticks = sorted({r.tokens for r in panel})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"{preset}, {quant}, {routing}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Progress:
    """Progress of the sweep on stderr: a bar redrawn in place ("\\r") on a terminal, one line
    per finished case otherwise (logs), nothing when quiet."""

    def __init__(self, total: int, *, quiet: bool = False, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.bar = not quiet and self.stream.isatty()
        self.total = max(total, 1)
        self.done = 0

    def step(self, label: str = "") -> None:
        self.done += 1
        if self.quiet:
            return
        if self.bar:
            width = 30
            filled = int(width * self.done / self.total)
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r\x1b[2K[{bar}] {self.done}/{self.total} {label}"[:160])
        else:
            self.stream.write(f"[{self.done}/{self.total}] {label}\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.bar:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
