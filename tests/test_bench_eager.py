"""fusedmoe bench --eager on the CPU (eager and host time; the CUDA columns are "-"), and the
models of benchmarks/bench_hf_model.py built at tiny sizes."""

import argparse
import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fusedmoe.functional import fused_experts
from fusedmoe.tools.bench.eager import ENTRIES, EagerRow
from fusedmoe.tools.cli import main

EAGER_KEYS = {"preset", "quant", "routing", "entry", "backend", "tokens", "calls", "eager_us"}
EAGER_KEYS |= {"graph_us", "ratio", "host_us", "launches", "syncs", "timing", "note", "device"}
ROOT = Path(__file__).resolve().parent.parent


def test_bench_eager_on_cpu_writes_json_and_csv(tmp_path, capsys):
    js, cs = tmp_path / "eager.json", tmp_path / "eager.csv"
    argv = ["bench", "--eager", "--device", "cpu", "--preset", "qwen3-30b-a3b", "--tokens", "1,4"]
    argv += ["--quant", "bf16", "--quiet", "--rep-ms", "5", "--json", str(js), "--csv", str(cs)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out.splitlines()
    assert "eager_us" in out and "host_us" in out and "the layer runs" in out
    assert table[-1].startswith("qwen3-30b-a3b (scaled 1/16)")  # the table comes last
    rows = json.loads(js.read_text())
    assert set(EagerRow.__dataclass_fields__) <= EAGER_KEYS
    assert len(rows) == 2 * len(ENTRIES) and all(set(r) >= EAGER_KEYS for r in rows)
    assert {(r["entry"], r["tokens"]) for r in rows} == {(e, m) for e in ENTRIES for m in (1, 4)}
    for r in rows:
        assert r["timing"] == "cpu" and r["note"] in ("", "softmax top-k routing"), r
        assert r["eager_us"] > 0 and 0 < r["host_us"] <= r["eager_us"] * 1.01 and r["calls"] >= 3
        # no CUDA: no graph, launches or syncs
        assert r["graph_us"] is None and r["ratio"] is None
        assert r["launches"] is None and r["syncs"] is None
    with cs.open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)


def test_bench_eager_quantized_custom_shape(capsys):
    argv = ["bench", "--eager", "--device", "cpu", "--experts", "8", "--top-k", "2"]
    argv += ["--hidden", "64", "--intermediate", "64", "--tokens", "3", "--quant", "fp8_block"]
    assert main([*argv, "--quiet", "--rep-ms", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:6] == "custom"]
    assert [r[2] for r in rows] == list(ENTRIES) and all(r[1] == "fp8_block" for r in rows)


@pytest.mark.parametrize(
    "requested, quant, given",
    [(None, "bf16", "auto"), (None, "fp8_block", "auto"), ("torch", "fp8_block", "torch")],
)  # on the CPU the oracle picks monolithic (routes inside) for bf16, torch for fp8_block
def test_bench_eager_gives_fused_experts_what_a_caller_would(
    monkeypatch, capsys, requested, quant, given
):
    """An oracle-chosen layer: fused_experts gets "auto" (a backend named outright is strict,
    and deep_gemm would then keep the small calls auto hands to triton); a named one, its name."""
    from fusedmoe.tools.bench import eager

    seen = []

    def spy(*args, backend, **kwargs):
        seen.append(backend)
        return fused_experts(*args, backend=backend, **kwargs)

    monkeypatch.setattr(eager, "fused_experts", spy)
    argv = ["bench", "--eager", "--device", "cpu", "--experts", "8", "--top-k", "2", "--hidden"]
    argv += ["64", "--intermediate", "64", "--tokens", "3", "--quiet", "--rep-ms", "1"]
    argv += ["--quant", quant] + (["--backends", requested] if requested else [])
    assert main(argv) == 0
    assert seen and set(seen) == {given}
    assert f"fused_experts(backend={given!r}) runs" in capsys.readouterr().out


def _benchmark(name: str):
    """benchmarks/<name>.py as a module (they need transformers)."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hf_bench():
    return _benchmark("bench_hf_model")


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
def test_hf_bench_models_build_tiny(name):
    """The benchmark's models at tiny sizes: built, patched, one forward (no timing)."""
    bench = _hf_bench()
    import fusedmoe.integrations.transformers as fmt

    model = bench.build_model(name, 2, "cpu", dtype=torch.float32, **bench.TINY_SIZES[name])
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.inference_mode():
        expected = model(ids).logits
        report = fmt.patch(model)
        assert len(report.replaced) >= 1 and not report.skipped, report
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_hf_bench_times_each_decode_step():
    """The step timer gets the prompt, then each new token: decode - 1 steps after the first
    token, each a positive gap; the prompt's forward (before the first token) is not one."""
    bench = _hf_bench()
    model = bench.build_model("qwen3", 2, "cpu", dtype=torch.float32, **bench.TINY_SIZES["qwen3"])
    prompt = torch.randint(0, model.config.vocab_size, (1, 6))
    timer = bench.StepTimer()
    with torch.inference_mode():
        bench._generate(model, prompt, argparse.Namespace(decode=5), timer)
    assert len(timer.stamps) == 6
    steps = timer.steps_ms()
    assert len(steps) == 4 and all(step > 0 for step in steps)
    assert steps[0] == pytest.approx((timer.stamps[2] - timer.stamps[1]) * 1e3)


def test_hf_bench_no_experts_floor_does_no_expert_work():
    """The floor row's experts return their input: the model runs without the experts' work."""
    bench = _hf_bench()
    base = bench.build_model("qwen3", 2, "cpu", dtype=torch.float32, **bench.TINY_SIZES["qwen3"])
    model, note = bench.prepare(base, bench.NO_EXPERTS)
    assert "floor" in note
    experts = bench.first_moe(model, bench.NO_EXPERTS)
    x = torch.randn(3, base.config.hidden_size)
    ids = torch.randint(0, experts.num_experts, (3, base.config.num_experts_per_tok))
    weights = torch.rand(3, base.config.num_experts_per_tok)
    with torch.inference_mode():
        assert experts(x, ids, weights) is x
        # the copy runs the floor; the base model keeps its own experts
        assert not torch.equal(bench.first_moe(base, "grouped_mm")(x, ids, weights), x)


@pytest.mark.parametrize("impl", ["fusedmoe", "no_experts", "patched"])
def test_hf_experts_call_bench_times_one_token_calls_and_changes_nothing(impl):
    """bench_hf_experts_call's timers: one sample per one-token experts (or block) call, none
    for longer calls, and the model computes what it computes untimed."""
    bench = _benchmark("bench_hf_experts_call")
    hf = bench.hf
    base = hf.build_model("qwen3", 2, "cpu", dtype=torch.float32, **hf.TINY_SIZES["qwen3"])
    untimed, _ = hf.prepare(base, impl)
    samples: list[float] = []
    model = bench.prepare(base, impl, samples)
    one, five = (torch.randint(0, base.config.vocab_size, (1, n)) for n in (1, 5))
    with torch.inference_mode():
        torch.testing.assert_close(model(five).logits, untimed(five).logits)
        assert samples == []  # five tokens: not a decode call
        torch.testing.assert_close(model(one).logits, untimed(one).logits)
    assert len(samples) == base.config.num_hidden_layers and all(s > 0 for s in samples)


def test_hf_bench_gpu_share_failure_stays_in_its_row(monkeypatch):
    """A profiled run that fails leaves that impl's GPU share empty with the error in its note;
    the other impls keep theirs."""
    bench = _hf_bench()

    def share(model, prompt, args):
        if model == "broken":
            raise RuntimeError("CUPTI said no")
        return 0.5

    monkeypatch.setattr(bench, "_decode_gpu_ms", share)
    values = {"fine": {"note": ""}, "bad": {"note": "replaced 4 blocks"}}
    shares = bench._gpu_shares({"fine": "model", "bad": "broken"}, values, None, None)
    assert shares == {"fine": 0.5, "bad": None}
    assert values["fine"]["note"] == ""
    assert values["bad"]["note"].startswith("replaced 4 blocks; GPU share failed: RuntimeError")
