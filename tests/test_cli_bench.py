"""fusedmoe bench on the CPU: tiny shapes, every output format, the baselines, bad input."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from fusedmoe import fused_experts
from fusedmoe._triton import interpreting
from fusedmoe.tools.baselines import eager_experts, grouped_mm_experts, grouped_mm_unavailable
from fusedmoe.tools.cli import main
from tests.helpers import assert_close

ROW_KEYS = {"preset", "quant", "backend", "tokens", "time_ms", "tflops", "gbps", "roofline_pct"}
ROW_KEYS |= {"rel_err", "routing", "weights", "distinct", "floor_ms", "err_ref", "timing"}
ROW_KEYS |= {"extra_gb", "err_bf16"}
# a custom shape, and ceilings given so that nothing is measured
TINY = ["bench", "--experts", "6", "--top-k", "2", "--hidden", "64", "--intermediate", "32"]
TINY += ["--hbm-gbps", "20", "--bf16-tflops", "0.5", "--fp8-tflops", "1", "--quiet"]
TINY += ["--device", "cpu"]  # also on a GPU machine


def test_bench_writes_json_and_csv(tmp_path, capsys):
    js, cs = tmp_path / "rows.json", tmp_path / "rows.csv"
    argv = [*TINY, "--tokens", "1,7", "--quant", "bf16,fp8_block", "--routing", "uniform,skewed"]
    assert main([*argv, "--json", str(js), "--csv", str(cs)]) == 0
    out = capsys.readouterr().out
    assert "the oracle picks" in out and "TFLOP/s" in out and "roofline_pct" in out
    rows = json.loads(js.read_text())
    assert isinstance(rows, list) and rows and all(set(r) >= ROW_KEYS for r in rows)
    # every case has the reference backend, both baselines and nothing that cannot run here
    backends = {r["backend"] for r in rows}
    assert {"torch", "grouped_mm", "eager"} <= backends and "triton" not in backends
    assert {(r["quant"], r["routing"], r["tokens"]) for r in rows} == {
        (q, r, m) for q in ("bf16", "fp8_block") for r in ("uniform", "skewed") for m in (1, 7)
    }
    for r in rows:
        assert r["time_ms"] > 0 and r["floor_ms"] > 0 and r["timing"] == "cpu"
        assert r["extra_gb"] is None  # measured on a GPU only
        assert r["roofline_pct"] == pytest.approx(100 * r["floor_ms"] / r["time_ms"])
        # the baselines compute in bf16 without activation quantization: a few % in fp8 rows
        assert r["rel_err"] < (0.1 if r["quant"] == "fp8_block" else 0.03), r
        assert r["weights"] == (r["quant"] if r["backend"] != "grouped_mm" and
                                r["backend"] != "eager" else "bf16")  # fmt: skip
    with cs.open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and set(table[0]) >= ROW_KEYS
    assert [float(r["time_ms"]) for r in table] == [r["time_ms"] for r in rows]


def test_bench_err_bf16_is_the_error_against_the_unquantized_layer(tmp_path):
    """Quantized rows report err_bf16, their output against the reference on the unquantized
    weights the scheme was made from: recomputed here from the bench's own weights and routing
    for the reference row, and far above the kernels' own error for a 4-bit scheme. Unquantized
    rows, and rows without a float64 reference (--ref-max-slots), have none."""
    from fusedmoe.tools.bench.inputs import make_expert_weights, make_routing, quantize_expert_set
    from fusedmoe.tools.bench.timing import rel_err

    js = tmp_path / "rows.json"
    assert main([*TINY, "--tokens", "5", "--quant", "bf16,mxfp4_w4a16", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())
    assert all(r["err_bf16"] is None for r in rows if r["quant"] == "bf16")
    quantized = [r for r in rows if r["quant"] == "mxfp4_w4a16"]
    assert quantized and all(r["err_bf16"] is not None for r in quantized)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    w13, w2 = make_expert_weights("custom", 6, 64, 32, "silu", bf16, cpu)
    experts = quantize_expert_set(w13, w2, "mxfp4_w4a16", with_plain=False)
    r = make_routing("custom", 5, 6, 2, 64, "uniform", bf16, cpu)
    args = (r.topk_weights, r.topk_ids)
    plain = fused_experts(r.x, w13, w2, *args, activation="silu", backend="torch")
    quant = fused_experts(
        r.x, experts.w13, experts.w2, *args, activation="silu",
        quant_config=experts.quant_config, backend="torch",
    )  # fmt: skip
    expected = rel_err(quant, plain)
    reference_row = next(r for r in quantized if r["backend"] == "torch")
    assert reference_row["err_bf16"] == pytest.approx(expected, rel=1e-6)
    assert expected > 5 * max(r["rel_err"] for r in quantized)
    assert main([*TINY, "--tokens", "5", "--quant", "mxfp4_w4a16", "--ref-max-slots", "0",
                 "--json", str(js)]) == 0  # fmt: skip
    assert all(r["err_bf16"] is None for r in json.loads(js.read_text()))


def test_bench_plot_is_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "latency.png"
    assert main([*TINY, "--tokens", "1,4,16", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "wrote the plot" in capsys.readouterr().out


def test_bench_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main([*TINY, "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'fusedmoe[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bench_preset_is_scaled_and_labelled(capsys):
    argv = ["bench", "--preset", "deepseek-v3", "--scale", "64", "--tokens", "3", "--quiet"]
    argv += ["--device", "cpu"]
    assert main([*argv, "--ceilings", "h200", "--backends", "monolithic"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3 (scaled 1/64)" in out and "NVIDIA H200" in out
    lines = [line for line in out.splitlines() if line.startswith("deepseek-v3")]
    # named backends: only those (and the baselines), none of the others
    assert sorted(line.split()[5] for line in lines) == ["eager", "grouped_mm", "monolithic"]


def test_bench_names_what_it_does_not_time(capsys):
    assert main([*TINY, "--tokens", "2", "--quant", "mxfp4_w4a16"]) == 0
    out = capsys.readouterr().out
    assert "not timing monolithic: does not support quant config" in out
    assert "not timing triton" in out


def test_bench_named_triton_runs_on_the_interpreter(capsys):
    pytest.importorskip("triton")
    if not interpreting():
        pytest.skip("Triton's CPU interpreter is off")
    assert main([*TINY, "--tokens", "3", "--backends", "triton", "--quant", "bf16"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    triton = [r for r in rows if r[:1] == ["custom"] and r[3] == "triton"]
    assert len(triton) == 1 and float(triton[0][12]) < 0.03  # rel_err against torch


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backends", "nope"], "unknown backend"),
        (["--tokens", "0"], "--tokens"),
        (["--preset", "mixtral-8x7b"], "not both"),
        (["--top-k", "9"], "exceeds --experts"),
        (["--fast-accum"], "--fast-accum applies to fp8_block"),
        (["--fast-accum", "--quant", "fp8_block", "--eager"], "not --eager / --backward"),
    ],
)
def test_bench_refuses_bad_arguments(argv, message, capsys):
    assert main([*TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_fast_accum_reaches_the_fp8_block_configs(tmp_path, capsys, monkeypatch):
    """--fast-accum: the fp8_block rows' experts carry a quant config with fast_accum (and the
    rows say so); the bf16 rows are as before."""
    from fusedmoe.tools.bench import sweep

    made = []

    def spy(*args, **kwargs):
        made.append(sweep_quantize(*args, **kwargs))
        return made[-1]

    sweep_quantize = sweep.quantize_expert_set
    monkeypatch.setattr(sweep, "quantize_expert_set", spy)
    js = tmp_path / "rows.json"
    argv = [*TINY, "--tokens", "3", "--quant", "bf16,fp8_block", "--fast-accum", "--json", str(js)]
    assert main(argv) == 0
    assert [e.quant_config is not None and e.quant_config.fast_accum for e in made] == [
        False,
        True,
    ]
    rows = json.loads(js.read_text())
    assert {r["quant"] for r in rows} == {"bf16", "fp8_block+fast_accum"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_bench_on_cuda_without_a_gpu(capsys):
    assert main([*TINY[:-2], "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_bench_partial_custom_shape_and_bad_quant(capsys):
    assert main(["bench", "--experts", "4", "--quiet"]) == 2
    assert "missing --top-k --hidden --intermediate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--quant", "fp7"])
    assert exc.value.code == 2 and "fp7" in capsys.readouterr().err


def test_bench_entry_point_json_on_stdout_side(tmp_path):
    js = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "-m", "fusedmoe", *TINY, "--tokens", "2", "--json", str(js)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "time_ms" in result.stdout and len(json.loads(js.read_text())) >= 3


@pytest.mark.parametrize("activation", ["silu", "swigluoai", "gelu_no_mul"])
def test_baselines_match_the_reference(activation):
    """grouped_mm (the op where it runs, and its loop twin) and eager: odd M, an expert that
    gets no token, gated and non-gated activations."""
    num_experts, top_k, hidden, inter, tokens = 8, 2, 64, 32, 37
    gated = activation != "gelu_no_mul"
    x = torch.randn(tokens, hidden).bfloat16()
    w13 = (torch.randn(num_experts, (2 if gated else 1) * inter, hidden) / 8).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter) / 6).bfloat16()
    weights, ids = (
        torch.rand(tokens, top_k).softmax(-1),
        torch.randint(0, num_experts, (tokens, top_k)),
    )
    ids = torch.where(ids == 3, torch.full_like(ids, 5), ids).int()  # expert 3: no token
    for bias in ({}, _biases(w13, w2)):
        ref = fused_experts(
            x, w13, w2, weights, ids, activation=activation, backend="torch", **bias
        )
        outs = {
            "loop": grouped_mm_experts(x, w13, w2, weights, ids, activation, loop=True, **bias),
            "eager": eager_experts(x, w13, w2, weights, ids, activation, **bias),
        }
        if grouped_mm_unavailable(x.device, x.dtype) is None:
            outs["grouped_mm"] = grouped_mm_experts(x, w13, w2, weights, ids, activation, **bias)
        for name, out in outs.items():
            assert_close(out, ref, torch.bfloat16, what=f"{name}, biases: {bool(bias)}")


def _biases(w13, w2):
    b13 = torch.randn(w13.shape[0], w13.shape[1]).bfloat16()
    return {"w13_bias": b13, "w2_bias": torch.randn(w2.shape[0], w2.shape[1]).bfloat16()}


def test_bench_gives_gpt_oss_its_biases(tmp_path, monkeypatch):
    """A preset with expert biases is timed with them: the reference gets them, and every
    contender agrees with it (the N(0, 1) biases are as large as the outputs: a contender that
    dropped them would be far off)."""
    from fusedmoe.tools.bench import contenders

    seen = []
    real = contenders.fused_experts

    def spy(*args, **kwargs):
        seen.append(kwargs.get("w13_bias") is not None and kwargs.get("w2_bias") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(contenders, "fused_experts", spy)
    js = tmp_path / "rows.json"
    argv = ["bench", "--preset", "gpt-oss-120b", "--scale", "32", "--tokens", "5", "--quiet"]
    argv += ["--device", "cpu", "--backends", "monolithic", "--json", str(js)]
    assert main(argv) == 0
    rows = json.loads(js.read_text())
    assert seen and all(seen)  # the reference and the backends, with both biases
    assert {r["backend"] for r in rows} == {"monolithic", "grouped_mm", "eager"}
    assert all(r["rel_err"] is not None and r["rel_err"] < 0.03 for r in rows), rows


def test_settle_runs_nothing_on_the_cpu():
    """timing.settle replays a GPU call untimed before its first timing; on the CPU there is
    no such transient and it must cost nothing."""
    from fusedmoe.tools.bench.timing import settle

    calls = []
    settle(lambda: calls.append(1), torch.device("cpu"))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("capturable", [True, False])
def test_settle_runs_the_call_on_a_gpu(capturable):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fusedmoe.tools.bench.timing import settle

    x = torch.zeros(4, device="cuda")
    settle(lambda: x.add_(1), torch.device("cuda"), rep_ms=1.0, capturable=capturable)
    torch.cuda.synchronize()
    assert float(x[0]) >= 2  # the warm-up call and at least one replay or launch


def test_peak_memory_is_none_on_the_cpu():
    from fusedmoe.tools.bench.timing import peak_memory_gb

    calls = []
    assert peak_memory_gb(lambda: calls.append(1), torch.device("cpu")) is None
    assert calls == []


@pytest.mark.gpu
def test_peak_memory_counts_what_the_call_allocates():
    """peak_memory_gb (bench's extra_GB): a call that allocates 64 MiB shows it above the
    base; one that allocates nothing new shows about nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fusedmoe.tools.bench.timing import peak_memory_gb

    dev = torch.device("cuda")
    held = torch.ones(1 << 20, device=dev)  # before the call: in the base, not the extra
    peak, base = peak_memory_gb(lambda: torch.empty(64 << 20, dtype=torch.uint8, device=dev), dev)
    assert base >= held.numel() * 4 / 1e9
    assert peak - base == pytest.approx((64 << 20) / 1e9, rel=0.05)
    peak, base = peak_memory_gb(lambda: held.add_(1), dev)
    assert peak - base < 1e-3
