"""fusedmoe bench --backward on the CPU: tiny shapes, the table's columns, JSON and CSV, and the
gradient check catching a wrong gradient."""

import csv
import json

import pytest

from fusedmoe import FusedMoE
from fusedmoe.tools.bench.backward import GRAD_TOLERANCE, BackwardRow
from fusedmoe.tools.cli import main

# a custom shape, and ceilings given so that nothing is measured
TINY = ["bench", "--backward", "--experts", "8", "--top-k", "2", "--hidden", "64"]
TINY += ["--intermediate", "32", "--hbm-gbps", "20", "--bf16-tflops", "0.5", "--fp8-tflops", "1"]
TINY += ["--device", "cpu", "--quiet", "--rep-ms", "1"]  # the CPU also on a GPU machine
COLUMNS = ["preset", "dtype", "routing", "tokens", "backend", "fusedmoe_ms", "grouped_mm_ms",
           "speedup", "fusedmoe_GB", "grouped_mm_GB", "floor_ms", "fusedmoe_roof%",
           "grouped_mm_roof%", "out_err", "dx_err", "dW_err", "baseline", "note"]  # fmt: skip
LEAVES = {"x", "gate", "w13", "w2"}


def table(out: str) -> tuple[list[str], list[dict[str, str]]]:
    """The table printed last: its header, and each row as {column: cell} (the note, last, may
    hold spaces)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("preset "))
    header = lines[start].split()
    rows = []
    for line in lines[start + 2 :]:
        cells = line.split(maxsplit=len(header) - 1)
        rows.append(dict(zip(header, cells + [""] * (len(header) - len(cells)), strict=True)))
    return header, rows


def test_backward_rows_columns_json_and_csv(tmp_path, capsys):
    js, cs = tmp_path / "bwd.json", tmp_path / "bwd.csv"
    argv = [*TINY, "--tokens", "16,33", "--routing", "uniform,skewed"]
    assert main([*argv, "--json", str(js), "--csv", str(cs)]) == 0
    out = capsys.readouterr().out
    header, cells = table(out)
    assert header == COLUMNS
    assert "the layer runs torch under autograd" in out and "3x the forward" in out
    assert len(cells) == 4 and all(c["preset"] == "custom" and c["dtype"] == "bf16" for c in cells)
    rows = json.loads(js.read_text())
    assert {(r["routing"], r["tokens"]) for r in rows} == {
        (routing, m) for routing in ("uniform", "skewed") for m in (16, 33)
    }
    assert all(set(r) >= set(BackwardRow.__dataclass_fields__) | {"device"} for r in rows)
    bound = GRAD_TOLERANCE["bf16"]
    for r in rows:
        assert r["backend"] == "torch" and r["timing"] == "cpu" and r["note"] == "", r
        assert r["fusedmoe_ms"] > 0 and r["grouped_mm_ms"] > 0 and r["floor_ms"] > 0
        assert r["speedup"] == pytest.approx(r["grouped_mm_ms"] / r["fusedmoe_ms"])
        assert r["fusedmoe_roofline_pct"] == pytest.approx(100 * r["floor_ms"] / r["fusedmoe_ms"])
        # no CUDA: no memory figures
        assert r["fusedmoe_peak_gb"] is None and r["grouped_mm_peak_gb"] is None
        assert set(r["grad_errs"]) == LEAVES and r["dx_err"] == r["grad_errs"]["x"]
        assert r["dw_err"] == max(v for k, v in r["grad_errs"].items() if k != "x")
        # both contenders round to bf16; gradients agree to a few of its roundings
        assert 0 < r["out_err"] < bound and 0 < r["dx_err"] < bound and 0 < r["dw_err"] < bound
    with cs.open() as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(rows) and {f"grad_err_{k}" for k in LEAVES} <= set(lines[0])


def test_a_broken_gradient_shows_as_a_large_error(monkeypatch, capsys):
    """The layer's forward is unchanged but its backward doubled: the check must see it."""
    forward = FusedMoE.forward

    def doubled_backward(self, *args, **kwargs):
        y = forward(self, *args, **kwargs)
        return y.detach() + 2 * (y - y.detach())  # the same values, twice the gradient

    monkeypatch.setattr(FusedMoE, "forward", doubled_backward)
    assert main([*TINY, "--tokens", "16"]) == 1
    out = capsys.readouterr().out
    [row] = table(out)[1]
    assert float(row["out_err"]) < GRAD_TOLERANCE["bf16"]
    assert float(row["dx_err"]) > 0.5 and float(row["dW_err"]) > 0.5
    assert "GRADIENT MISMATCH" in row["note"]


def test_biases_and_swigluoai_preset(tmp_path, capsys):
    """gpt-oss-120b (scaled): expert biases, the interleaved clamped activation."""
    js = tmp_path / "bwd.json"
    argv = ["bench", "--backward", "--preset", "gpt-oss-120b", "--scale", "64", "--tokens", "8"]
    argv += ["--hbm-gbps", "20", "--bf16-tflops", "0.5", "--fp8-tflops", "1", "--device", "cpu"]
    assert main([*argv, "--quiet", "--rep-ms", "1", "--json", str(js)]) == 0
    [row] = json.loads(js.read_text())
    assert row["preset"] == "gpt-oss-120b (scaled 1/64)"
    assert set(row["grad_errs"]) == LEAVES | {"w13_bias", "w2_bias"}
    assert max(row["grad_errs"].values()) < GRAD_TOLERANCE["bf16"], row


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--quant", "fp8_block"], "inference only"),
        (["--eager"], "two modes"),
        (["--plot", "x.png"], "not --plot"),
    ],
)
def test_backward_refuses(extra, message, capsys):
    assert main([*TINY, "--tokens", "4", *extra]) == 2
    assert message in capsys.readouterr().err


def test_fp32_gradients_agree_closely(capsys):
    assert main([*TINY, "--tokens", "9", "--quant", "fp32"]) == 0
    [row] = table(capsys.readouterr().out)[1]
    assert row["dtype"] == "fp32"
    assert max(float(row[k]) for k in ("out_err", "dx_err", "dW_err")) < 1e-4
