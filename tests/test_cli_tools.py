"""fusedmoe backends and tune on the CPU; the floor arithmetic against hand-computed values;
the ceilings' cache."""

import dataclasses
import functools
import json
import math

import pytest
import torch

import fusedmoe.tools.capabilities as caps
import fusedmoe.tools.ceilings as ceil
from fusedmoe._triton import interpreting
from fusedmoe.experts.torch_ref import TorchExperts
from fusedmoe.oracle import backend_names
from fusedmoe.quant.config import SCHEMES
from fusedmoe.tools.cli import main
from fusedmoe.tools.roofline import H200, Ceilings, moe_floor, scale_bytes

# ---------------------------------------------------------------------------------------------
# fusedmoe backends


def test_backends_prints_every_backend(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "runs here" in out and "expert_map" in out and "autograd" in out
    for name in backend_names():
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    for column in ("bf16", "fp64", *SCHEMES):
        assert column in out


def test_backends_json_reads_the_predicates(capsys):
    assert main(["backends", "--json"]) == 0
    matrix = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert list(matrix) == list(backend_names())
    torch_ref = matrix["torch"]
    assert torch_ref["schemes"] == list(SCHEMES) and torch_ref["autograd"]
    assert torch_ref["runs_here"] is None and "cpu" in torch_ref["devices"]
    assert matrix["monolithic"]["routes_inside"] and matrix["monolithic"]["schemes"] == []
    triton = matrix["triton"]
    if interpreting():  # the test suite's CPU runs: Triton's interpreter, when named
        assert triton["devices"] == ["cpu (by name)", "cuda"] and triton["runs_here"] is None
    elif not torch.cuda.is_available():
        assert triton["devices"] == ["cuda"] and "CUDA" in triton["runs_here"]


def test_a_new_backend_appears_by_itself(monkeypatch, capsys):
    class OnlyFp8(TorchExperts):
        name = "only_fp8"

        @classmethod
        def supports_quant_config(cls, quant_config):
            return quant_config is not None and quant_config.scheme.startswith("fp8")

        @classmethod
        def supports_device(cls, device):
            return device.type == "cuda"

        @classmethod
        def supports_ep(cls, ep_size):
            return ep_size == 1

        @classmethod
        def supports_hidden_size(cls, hidden_size):
            return hidden_size % 128 == 0

    monkeypatch.setattr(caps, "BACKENDS", (*caps.BACKENDS, OnlyFp8))
    entry = caps.capability_matrix()[-1]
    assert entry.name == "only_fp8" and entry.devices == ["cuda"] and not entry.ep
    assert entry.hidden_multiple == 128 and caps.capability_matrix()[0].hidden_multiple == 1
    assert entry.schemes == ["fp8_tensor", "fp8_channel", "fp8_block"]
    assert entry.runs_here is None if torch.cuda.is_available() else "CUDA" in entry.runs_here
    assert "only_fp8" in caps.format_matrix(caps.capability_matrix())


# ---------------------------------------------------------------------------------------------
# fusedmoe tune


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: tune would run")
def test_tune_refuses_on_the_cpu(capsys, tmp_path):
    assert main(["tune", "--preset", "qwen3-30b-a3b", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--experts", "8"], "needs --experts --top-k --hidden --intermediate"),
        (["--ship", "--out", "x"], "not both"),
        (
            ["--rule", "keep-uniform", "--uniform-slack", "-0.5"],
            "(--uniform-slack) must be a number >= 0",
        ),
    ],
)
def test_tune_refuses_bad_arguments(argv, message, capsys):
    assert main(["tune", *argv]) == 2
    assert message in capsys.readouterr().err


def test_tune_passes_the_rule_to_each_shape(monkeypatch, tmp_path, capsys):
    import fusedmoe._triton as triton_module
    from fusedmoe.tools import tune

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(triton_module, "has_triton", lambda: True)
    monkeypatch.setattr(tune, "tune_shape", lambda *a, **kw: seen.append(kw) or [])
    monkeypatch.setattr(tune, "write_table", lambda *a: tmp_path / "table.json")
    argv = ["tune", "--preset", "qwen3-30b-a3b", "--out", str(tmp_path), "--rule", "keep-uniform"]
    assert main([*argv, "--uniform-slack", "0.02"]) == 0
    assert [(kw["rule"], kw["uniform_slack"]) for kw in seen] == [("keep-uniform", 0.02)]
    assert main(["tune", "--preset", "qwen3-30b-a3b", "--out", str(tmp_path)]) == 0
    assert (seen[-1]["rule"], seen[-1]["uniform_slack"]) == ("least-worst", 0.01)
    capsys.readouterr()


def test_tune_candidates_are_valid_configs():
    pytest.importorskip("triton")
    from fusedmoe.kernels.moe_config import heuristic_config
    from fusedmoe.tools.tune import candidates_around

    for dtype in ("bfloat16", "fp8_block"):
        for m in (1, 64, 4096):
            base = heuristic_config(m, 8, 128, 2048, 768, dtype)
            around = candidates_around(base, dtype)
            assert around and base not in around and len(set(around)) == len(around)
            for c in around:
                c.check()
                assert c.block_m * c.gemm2.block_n <= 128 * 256
                if dtype == "fp8_block":
                    assert all(128 % g.block_k == 0 for g in (c.gemm1, c.gemm2))
            assert any(c.gemm1.num_warps == 2 for c in around) == (base.gemm1.num_warps == 4)
            for which in ("gemm1", "gemm2"):  # every launch order, columns first included
                orders = {getattr(c, which).group_m for c in around} | {
                    getattr(base, which).group_m
                }
                assert orders >= {1, 8, 16, 32, 64, 1024}, (which, orders)
            if dtype == "fp8_block":
                assert any(not c.fuse_activation for c in around)
                narrow = {c.gemm1.block_n for c in around if not c.fuse_activation}
                assert base.fuse_activation <= (narrow >= {32, 64}), narrow
                # a fused GEMM1 below 128 wide runs 128 wide: no step to another such width
                fused = [c.gemm1.block_n for c in around if c.fuse_activation]
                assert not [bn for bn in fused if bn % 128 and bn != base.gemm1.block_n], fused
                assert 2 * base.gemm1.block_n in fused  # a wider tile is a real candidate
                if base.fuse_activation and base.block_m < 128:  # the tall unfused step
                    narrow = {
                        name: dataclasses.replace(g, block_n=min(g.block_n, 128))
                        for name, g in (("gemm1", base.gemm1), ("gemm2", base.gemm2))
                    }
                    tall = dataclasses.replace(
                        base, block_m=2 * base.block_m, fuse_activation=False, **narrow
                    )
                    assert tall in around


def test_tune_table_is_what_the_backend_loads(tmp_path):
    pytest.importorskip("triton")
    from fusedmoe.kernels import moe_config as mc
    from fusedmoe.tools.tune import TuneResult, TuneShape, write_table

    shape = TuneShape("t", 8, 2, 256, 96)
    configs = {m: mc.heuristic_config(m, 2, 8, 256, 96, "bfloat16") for m in (1, 512)}
    results = [TuneResult(m, 1.0, 0.9, c, 5, 0, 0, 1e-3) for m, c in configs.items()]
    path = write_table(tmp_path, "NVIDIA Test GPU", shape, "bf16", results[:1])
    path = write_table(tmp_path, "NVIDIA Test GPU", shape, "bf16", results[1:])  # merged
    assert path == mc.table_path(tmp_path, "NVIDIA Test GPU", 8, 192, 256, "bfloat16")
    assert mc._load_table(str(path)) == configs


def test_tuned_engine_table_is_what_the_backend_reads(tmp_path, monkeypatch):
    from fusedmoe.kernels import moe_config as mc
    from fusedmoe.tools.tune import EngineResult, TuneShape, write_engine_table

    shape = TuneShape("t", 8, 2, 256, 96)
    times = {"library": (2.0, 1.5), "wgmma": (1.8, 1.0)}
    first = [EngineResult(512, "wgmma", times, 1e-3)]
    write_engine_table(tmp_path, "NVIDIA Test GPU", shape, "fp8_block", first)
    path = write_engine_table(  # merged with the bucket already there
        tmp_path, "NVIDIA Test GPU", shape, "fp8_block", [EngineResult(4096, "library", times, 0)]
    )
    assert path == mc.engine_table_path(tmp_path, "NVIDIA Test GPU", 8, 192, 256, "fp8_block")
    monkeypatch.setenv("FUSEDMOE_TUNED_CONFIGS", str(tmp_path))
    engine = functools.partial(
        mc.measured_engine, num_local_experts=8, gemm1_rows=192, hidden_size=256,
        dtype="fp8_block", device_name="NVIDIA Test GPU",
    )  # fmt: skip
    assert [engine(m) for m in (1, 2000, 2400, 16384)] == ["wgmma", "wgmma", "library", "library"]
    assert engine(512, device_name="Another GPU") is None  # measured on one GPU only


def test_tune_engines_only_measures_the_engines_alone(monkeypatch, tmp_path, capsys):
    import fusedmoe._triton as triton_module
    from fusedmoe.tools import tune

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(triton_module, "has_triton", lambda: True)
    monkeypatch.setattr(tune, "tune_shape", lambda *a, **kw: pytest.fail("configs tuned"))
    monkeypatch.setattr(tune, "engines_unmeasurable", lambda shape, dtype: None)
    monkeypatch.setattr(tune, "tune_engines", lambda shape, *a, **kw: seen.append(shape) or [])
    monkeypatch.setattr(tune, "write_engine_table", lambda *a: tmp_path / "engines.json")
    argv = ["tune", "--preset", "qwen3-30b-a3b,mixtral-8x7b", "--dtype", "fp8_block"]
    assert main([*argv, "--out", str(tmp_path), "--engines-only"]) == 0
    assert [s.name for s in seen] == ["qwen3-30b-a3b", "mixtral-8x7b"]
    assert "engines.json" in capsys.readouterr().out


def test_tuned_tables_default_to_the_user_cache(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from fusedmoe.kernels import moe_config as mc

    monkeypatch.delenv(mc.TUNED_CONFIGS_ENV, raising=False)
    monkeypatch.setenv(ceil.CACHE_ENV, str(tmp_path))
    assert mc.user_tables_dir() == tmp_path / "tuned"
    monkeypatch.setenv(mc.TUNED_CONFIGS_ENV, str(tmp_path / "mine"))
    assert mc.user_tables_dir() == tmp_path / "mine"


# ---------------------------------------------------------------------------------------------
# the floor, by hand (qwen3-30b-a3b: H = 2048, I = 768, k = 8; D = 8 experts, M = 1)

H, I, K_TOP, D = 2048, 768, 8, 8
ACT = 2 * 1 * H * 2  # x in and out, bf16
FLOPS = 2 * 1 * K_TOP * 3 * H * I  # 75_497_472


@pytest.mark.parametrize(
    ("quant", "expected_bytes", "fp8"),
    [
        ("bf16", 8 * 3 * 2048 * 768 * 2 + ACT, False),  # 75_505_664
        ("fp32", 8 * 3 * 2048 * 768 * 4 + ACT, False),
        # 128-blocks: w13 12 x 16, w2 16 x 6 per expert, 4 bytes each: 8 * 4 * 288 = 9216
        ("fp8_block", 37_748_736 + 9216 + ACT, True),
        ("fp8_tensor", 37_748_736 + 8 * 4 * 2 + ACT, True),
        ("fp8_channel", 37_748_736 + 8 * 4 * (1536 + 2048) + ACT, True),
        # 4-bit: half a byte a value plus one E8M0 byte per 32: 8 * 4_718_592 / 32 = 1_179_648
        ("mxfp4_w4a16", 18_874_368 + 1_179_648 + ACT, False),
        ("mxfp4_w4a8", 18_874_368 + 1_179_648 + ACT, True),
        ("nvfp4", 18_874_368 + 2_359_296 + 64 + ACT, True),
    ],
)
def test_floor_by_hand(quant, expected_bytes, fp8):
    floor = moe_floor(
        quant, num_distinct=D, num_tokens=1, top_k=K_TOP, hidden_size=H, intermediate_size=I,
        ceilings=H200,
    )  # fmt: skip
    assert floor.num_bytes == expected_bytes and floor.flops == FLOPS
    peak = 1410e12 if fp8 else 779e12
    assert floor.seconds == max(expected_bytes / 4800e9, FLOPS / peak)
    if quant == "bf16":  # 15.73 us: bound by reading the 8 experts' weights
        assert floor.seconds * 1e6 == pytest.approx(15.7303, abs=1e-4)


def test_floor_at_prefill_is_compute_bound():
    # deepseek-v3, M = 16384, all 256 experts: 1.154e16 flops take 14.8 ms at 779 TFLOP/s; its
    # 22.5 GB of bf16 weights 4.7 ms at 4.8 TB/s (at M = 4096 the weights still bound it)
    floor = moe_floor(
        "bf16", num_distinct=256, num_tokens=16384, top_k=8, hidden_size=7168,
        intermediate_size=2048, ceilings=Ceilings(4800.0, 779.0, 1410.0, "t"),
    )  # fmt: skip
    assert floor.flops == 2 * 16384 * 8 * 3 * 7168 * 2048
    assert floor.seconds == floor.flops / 779e12 and floor.seconds * 1e3 == pytest.approx(
        14.82, 1e-3
    )


def test_floor_non_gated_and_bad_format():
    floor = moe_floor(
        "bf16", num_distinct=1, num_tokens=2, top_k=1, hidden_size=64, intermediate_size=32,
        ceilings=H200, gated=False,
    )  # fmt: skip
    assert floor.flops == 2 * 2 * 1 * 2 * 64 * 32
    assert floor.num_bytes == 2 * 64 * 32 * 2 + 2 * 2 * 64 * 2
    assert scale_bytes("fp8_block", 1, 129, 128, 256) == 4 * (2 * 2 + 2 * 1)  # ceil(129/128) = 2
    with pytest.raises(ValueError, match="unknown weight format"):
        moe_floor("fp7", num_distinct=1, num_tokens=1, top_k=1, hidden_size=8,
                  intermediate_size=8, ceilings=H200)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# ceilings: named, given, measured once per device name


def test_ceilings_named_and_given(monkeypatch):
    monkeypatch.setattr(ceil, "measure_ceilings", lambda *a, **k: pytest.fail("measured"))
    assert ceil.resolve_ceilings("h200", "cpu") == H200
    given = ceil.resolve_ceilings("auto", "cpu", hbm_gbps=1.0, bf16_tflops=2.0, fp8_tflops=3.0)
    assert (given.hbm_gbps, given.bf16_tflops, given.fp8_tflops) == (1.0, 2.0, 3.0)
    mixed = ceil.resolve_ceilings("h100", "cpu", hbm_gbps=3000.0)
    assert mixed.hbm_gbps == 3000.0 and mixed.bf16_tflops == 800.0 and "given" in mixed.name
    with pytest.raises(ValueError, match="--hbm-gbps must be > 0"):
        ceil.resolve_ceilings("h200", "cpu", hbm_gbps=0.0)
    with pytest.raises(ValueError, match="ceilings must be"):
        ceil.resolve_ceilings("a100", "cpu")


def test_ceilings_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(ceil.CACHE_ENV, str(tmp_path))
    calls = []

    def fake_measure(device, **kwargs):
        calls.append(device)
        return Ceilings(12.5, 0.25, 0.5, f"measured on {ceil.device_label(device)}")

    monkeypatch.setattr(ceil, "measure_ceilings", fake_measure)
    first = ceil.resolve_ceilings("auto", "cpu")
    again = ceil.resolve_ceilings("auto", "cpu")
    assert first == again and len(calls) == 1
    (cached,) = (tmp_path / "ceilings").iterdir()
    assert json.loads(cached.read_text())["hbm_gbps"] == 12.5
    ceil.measured_ceilings("cpu", refresh=True)
    assert len(calls) == 2


def test_cpu_ceilings_are_measured():
    c = ceil.measure_ceilings("cpu", size="small")
    assert all(math.isfinite(v) and v > 0 for v in (c.hbm_gbps, c.bf16_tflops, c.fp8_tflops))
    assert c.name.startswith("measured on cpu")
