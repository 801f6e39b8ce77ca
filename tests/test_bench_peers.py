"""fusedmoe bench --peers: option parsing, why a peer does not run a row (CPU, missing library,
scheme, shape), the pure-torch layout helpers of the triton_kernels peer, its conversion into
triton_kernels' Hopper layouts (pure torch inside triton_kernels, where it imports), and on a
Hopper GPU the peer itself against the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedmoe import fused_experts
from fusedmoe.activation import apply_activation
from fusedmoe.quant import keys
from fusedmoe.quant.formats import e2m1_decode, e8m0_decode
from fusedmoe.quant.reference import dequantize, quantize
from fusedmoe.tools import peers
from fusedmoe.tools.bench.contenders import Contender
from fusedmoe.tools.bench.inputs import (
    make_expert_biases,
    make_expert_weights,
    make_routing,
    quantize_expert_set,
)
from fusedmoe.tools.cli import build_parser, main
from tests.helpers import assert_close

VENDOR = Path(__file__).resolve().parents[1] / ".vendor"
TINY = ["bench", "--experts", "6", "--top-k", "2", "--hidden", "64", "--intermediate", "32"]
TINY += ["--hbm-gbps", "20", "--bf16-tflops", "0.5", "--fp8-tflops", "1", "--quiet"]
TINY += ["--device", "cpu"]


def _reason(**overrides):
    """refusal_reason of the triton_kernels peer for gpt-oss-120b's row, with `overrides`."""
    row = dict(
        quant="mxfp4_w4a16", activation="swigluoai", top_k=4, hidden_size=2880,
        intermediate_size=2880, act_dtype=torch.bfloat16, device=torch.device("cuda"),
    )  # fmt: skip
    row.update(overrides)
    return peers.refusal_reason("triton_kernels", **row)


@pytest.fixture
def hopper(monkeypatch):
    """The refusal checks believe they look at an sm90 GPU (no GPU is touched)."""
    monkeypatch.setattr(peers, "_cuda_capability", lambda device: (9, 0))


@pytest.fixture
def triton_kernels(monkeypatch):
    """The vendored triton_kernels on the path, or skip."""
    if VENDOR.is_dir():
        monkeypatch.syspath_prepend(str(VENDOR))
    pytest.importorskip("triton")
    try:
        return peers.import_triton_kernels()
    except Exception as exc:
        pytest.skip(f"triton_kernels is not importable here: {exc!r}")


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def test_peers_option_parses_a_comma_list():
    args = build_parser().parse_args(["bench", "--peers", "triton_kernels"])
    assert args.peers == ["triton_kernels"]
    assert build_parser().parse_args(["bench"]).peers is None


def test_unknown_peer_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--peers", "triton_kernels,cutlass"])
    assert exc.value.code == 2 and "cutlass" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backends", "triton_kernels"], "give it with --peers"),
        (["--peers", "triton_kernels", "--eager"], "--peers applies to the forward bench"),
        (["--peers", "triton_kernels", "--backward"], "--peers applies to the forward bench"),
        (["--peers", "triton_kernels", "--ep", "2"], "not --ep"),
    ],
)
def test_peers_where_they_do_not_apply(argv, message, capsys):
    assert main([*TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_on_the_cpu_says_why_the_peer_does_not_run(tmp_path, capsys):
    js = tmp_path / "rows.json"
    argv = [*TINY, "--tokens", "3", "--quant", "mxfp4_w4a16,bf16", "--peers", "triton_kernels"]
    assert main([*argv, "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "mxfp4_w4a16: not timing peer triton_kernels: runs on a CUDA GPU only" in out
    assert "bf16: not timing peer triton_kernels: runs mxfp4_w4a16" in out
    rows = json.loads(js.read_text())
    assert rows and "triton_kernels" not in {r["backend"] for r in rows}


@pytest.mark.parametrize("with_peers", [False, True])
def test_bench_on_the_cpu_never_loads_triton_kernels(with_peers):
    """Without --peers, and with it where the CPU refuses the row before the library check,
    nothing imports triton_kernels (even with it on the path)."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(VENDOR)!r})\n"
        "from fusedmoe.tools.cli import main\n"
        f"argv = {TINY!r} + ['--tokens', '2', '--quant', 'mxfp4_w4a16']\n"
        f"argv += {['--peers', 'triton_kernels'] if with_peers else []!r}\n"
        "assert main(argv) == 0\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'triton_kernels']\n"
        "print('NO-TK-OK')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "NO-TK-OK" in result.stdout, result.stderr[-2000:]


def test_importing_the_peers_module_loads_no_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import fusedmoe.tools.peers as p\n"
        "import torch\n"
        "why = p.refusal_reason('triton_kernels', quant='mxfp4_w4a16', activation='swigluoai',"
        " top_k=4, hidden_size=2880, intermediate_size=2880, act_dtype=torch.bfloat16,"
        " device=torch.device('cpu'))\n"
        "assert 'CUDA GPU only' in why, why\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'triton' and sys.modules[m]]\n"
        "print('NO-TRITON-OK')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "NO-TRITON-OK" in result.stdout, result.stderr[-2000:]


def test_a_peer_is_a_row_of_the_table_with_its_note_and_check(tmp_path, capsys, monkeypatch):
    """The sweep's side of a peer, on the CPU with a stand-in (the reference on the row's
    weights): it is timed after the backends and before the baselines, its note and the
    finding of its check go to the notes, and its rows are compared with the reference."""
    calls = []

    def stand_in(names, experts, *, quant, activation, top_k, **_):
        def run(r):
            return fused_experts(
                r.x, experts.w13, experts.w2, r.topk_weights, r.topk_ids, activation=activation,
                quant_config=experts.quant_config, backend="torch",
            )  # fmt: skip

        def check(r):
            calls.append(r.x.shape[0])
            return "a stand-in's finding"

        return [Contender("triton_kernels", quant, run, note="a stand-in", check=check)], {}

    monkeypatch.setattr(peers, "peer_contenders", stand_in)
    js = tmp_path / "rows.json"
    argv = [*TINY, "--tokens", "2,5", "--quant", "mxfp4_w4a16", "--backends", "torch"]
    assert main([*argv, "--peers", "triton_kernels", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "mxfp4_w4a16: peer triton_kernels: a stand-in" in out
    assert "uniform, M=5: triton_kernels: a stand-in's finding" in out
    assert calls == [2, 5]
    rows = json.loads(js.read_text())
    order = [r["backend"] for r in rows if r["tokens"] == 2]
    assert order == ["torch", "triton_kernels", "grouped_mm", "eager"]
    peer = [r for r in rows if r["backend"] == "triton_kernels"]
    assert all(r["weights"] == "mxfp4_w4a16" and r["rel_err"] == 0.0 for r in peer), peer


# ---------------------------------------------------------------------------------------------
# why a row is refused
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"quant": "bf16"}, "runs mxfp4_w4a16"),
        ({"quant": "mxfp4_w4a8"}, "this row is mxfp4_w4a8"),
        ({"activation": "gelu"}, "activation is gelu"),
        ({"activation": "swigluoai_uninterleave"}, "swigluoai, silu only"),
        ({"act_dtype": torch.float16}, "bf16 activations"),
        ({"top_k": 6}, "power-of-two top_k"),
        ({"device": torch.device("cpu")}, "CUDA GPU only; this row is on cpu"),
        ({"hidden_size": 128}, "need N > 128"),
        ({"intermediate_size": 64}, "2I = 128"),
    ],
)
def test_refusal_reasons(hopper, overrides, message):
    why = _reason(**overrides)
    assert why is not None and message in why, why


@pytest.mark.parametrize(("capability", "name"), [((8, 0), "sm80"), ((10, 0), "sm100")])
def test_refused_off_hopper(monkeypatch, capability, name):
    monkeypatch.setattr(peers, "_cuda_capability", lambda device: capability)
    why = _reason()
    assert why is not None and "Hopper (sm90)" in why and name in why


def test_refused_without_the_library(hopper, monkeypatch):
    for module in [m for m in sys.modules if m.split(".")[0] == "triton_kernels"]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "triton_kernels", None)  # import fails
    why = _reason()
    assert why is not None and "triton_kernels is not importable" in why
    assert "PYTHONPATH=.vendor" in why


def test_silu_with_a_clamp_is_refused(hopper):
    from fusedmoe.quant import make_quant_config

    e, n, k = 2, 4, 64
    qc = make_quant_config(
        "mxfp4_w4a16",
        torch.zeros(e, n, k // 32, dtype=torch.uint8),
        torch.zeros(e, n, k // 32, dtype=torch.uint8),
        gemm1_clamp_limit=7.0,
    )
    assert "no swiglu equivalent" in _reason(activation="silu", quant_config=qc)


def test_accepted_where_it_applies(hopper, triton_kernels):
    assert _reason() is None
    assert _reason(activation="silu", top_k=8, hidden_size=2048, intermediate_size=768) is None


def test_peer_contenders_never_raise(monkeypatch):
    """A conversion that fails is a refusal with the error, not the end of the sweep."""
    monkeypatch.setattr(peers, "refusal_reason", lambda *a, **k: None)

    def boom(*args, **kwargs):
        raise RuntimeError("no such layout")

    monkeypatch.setattr(peers, "TritonKernelsMoE", boom)
    experts = _experts("swigluoai", bias=False)
    out, refused = peers.peer_contenders(
        ["triton_kernels"], experts, quant="mxfp4_w4a16", activation="swigluoai", top_k=2,
        hidden_size=64, intermediate_size=32, act_dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert out == [] and "no such layout" in refused["triton_kernels"]


# ---------------------------------------------------------------------------------------------
# the layout helpers (pure torch)
# ---------------------------------------------------------------------------------------------


def _decode_k_major(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [E, K/2, N] packed along K (even k low nibble) and E8M0 [E, G, N] -> float32
    [E, K, N]: the decoder of the peer's orientation, written along dim 1."""
    e, half, n = values.shape
    codes = torch.stack((values & 0x0F, values >> 4), dim=2).reshape(e, 2 * half, n)
    per_k = e8m0_decode(scales).repeat_interleave(32, dim=1)[:, : 2 * half]
    return e2m1_decode(codes) * per_k


@pytest.mark.parametrize("k", [64, 96, 160])
def test_k_major_view_keeps_every_value(k):
    """Our packed MXFP4 [E, N, K/2] seen K-major [E, K/2, N]: decoding it along K gives the
    values dequantize gives ours, transposed; scale groups padded to a multiple of 4 with 0."""
    e, n = 3, 40
    w = torch.randn(e, n, k) * torch.logspace(-3, 2, n).view(1, n, 1)
    qx = quantize(w, keys.MXFP4)
    ours = dequantize(qx.q, qx.scale, keys.MXFP4)  # [E, N, K]
    values, scales = peers.k_major_mxfp4(qx.q, qx.scale, group_multiple=4)
    assert values.shape == (e, k // 2, n) and values.stride(1) == 1
    assert values.data_ptr() == qx.q.data_ptr()  # a view: no byte moves
    groups = -(-(k // 32) // 4) * 4
    assert scales.shape == (e, groups, n)
    assert (scales[:, k // 32 :] == 0).all()
    assert torch.equal(_decode_k_major(values, scales), ours.transpose(1, 2))


def test_k_major_refuses_what_is_not_mxfp4():
    with pytest.raises(ValueError, match="uint8"):
        peers.k_major_mxfp4(torch.zeros(2, 4, 8), torch.zeros(2, 4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not fit"):
        peers.k_major_mxfp4(
            torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8)
        )


def test_interleave_halves():
    t = torch.arange(2 * 6 * 3).view(2, 6, 3)
    pairs = peers.interleave_halves(t, dim=1)
    assert torch.equal(pairs[:, 0::2], t[:, :3]) and torch.equal(pairs[:, 1::2], t[:, 3:])
    assert torch.equal(peers.interleave_halves(torch.arange(4), dim=0), torch.tensor([0, 2, 1, 3]))


def test_the_peers_swiglu_is_our_swigluoai():
    """triton_kernels' fused swiglu (gate = even column, clamp max on gate, clamp both ways on
    up, (up + 1), alpha 1.702, limit 7) is fusedmoe's swigluoai."""
    h = torch.randn(5, 7, 64, dtype=torch.float64) * 6  # many values beyond the limit
    ours = apply_activation("swigluoai", h)
    assert_close(peers.swiglu_pairs(h, 1.702, 7.0), ours, torch.float64)


@pytest.mark.parametrize("bias", [False, True])
def test_silu_through_the_peers_swiglu(bias):
    """silu(g) * u on our halves = the peer's swiglu(alpha 1, no clamp) on the interleaved
    rows with GEMM1's bias less 1 on every up entry."""
    e, i, h_size, m = 3, 16, 32, 9
    w13 = torch.randn(e, 2 * i, h_size, dtype=torch.float64)
    b13 = torch.randn(e, 2 * i, dtype=torch.float64) if bias else None
    x = torch.randn(m, h_size, dtype=torch.float64)
    ours = torch.stack([
        apply_activation("silu", x @ w13[j].T + (0 if b13 is None else b13[j])) for j in range(e)
    ])  # fmt: skip
    w_peer = peers.interleave_halves(w13, dim=1)
    b_peer = peers.gemm1_bias(peers.MoEActivation.SILU, b13, e, 2 * i, torch.device("cpu"))
    assert b_peer.dtype == torch.float32 and b_peer.shape == (e, 2 * i)
    theirs = torch.stack([
        peers.swiglu_pairs(x @ w_peer[j].T + b_peer[j].double(), 1.0, None) for j in range(e)
    ])  # fmt: skip
    assert_close(theirs, ours, torch.float32)  # the bias is float32: u - 1 rounds once


def test_gemm1_bias_for_swigluoai_is_ours_in_float32():
    b = torch.randn(2, 8, dtype=torch.bfloat16)
    out = peers.gemm1_bias(peers.MoEActivation.SWIGLUOAI, b, 2, 8, b.device)
    assert out.dtype == torch.float32 and torch.equal(out, b.float())
    assert peers.gemm1_bias(peers.MoEActivation.SWIGLUOAI, None, 2, 8, b.device) is None


# ---------------------------------------------------------------------------------------------
# the conversion into triton_kernels' layouts (pure torch inside triton_kernels)
# ---------------------------------------------------------------------------------------------


def _experts(activation: str, *, bias: bool, e=4, h=256, i=192, device="cpu"):
    device = torch.device(device)
    w13, w2 = make_expert_weights("peers", e, h, i, activation, torch.bfloat16, device)
    experts = quantize_expert_set(w13, w2, "mxfp4_w4a16")
    if bias:
        experts.w13_bias, experts.w2_bias = make_expert_biases("peers", w13, w2)
    return experts


@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_conversion_into_the_hopper_layouts_round_trips(triton_kernels, activation):
    """The adapter's weights, unswizzled by triton_kernels' own layouts, are our bytes seen
    K-major (silu: rows interleaved), and its scales ours (padded); biases float32."""
    experts = _experts(activation, bias=activation == "swigluoai", h=2880 // 10, i=2880 // 10)
    peer = peers.TritonKernelsMoE(experts, activation=activation, top_k=2)
    assert peer.swizzled == (torch.torch_version.TorchVersion(torch.__version__) >= (2, 8, 1))
    qc = experts.quant_config
    w13, s13 = experts.w13, qc.w1.scale
    if activation == "silu":
        w13, s13 = peers.interleave_halves(w13), peers.interleave_halves(s13)
    for tk_w, precision, (w, s) in (
        (peer.w13, peer.pc13, (w13, s13)),
        (peer.w2, peer.pc2, (experts.w2, qc.w2.scale)),
    ):
        e, n, half = w.shape
        assert list(tk_w.shape) == [e, 2 * half, n]  # matmul_ogs' w [E, K, N]
        values, scales = peers.k_major_mxfp4(w, s, group_multiple=4)
        got = tk_w.storage.layout.unswizzle_data(tk_w.storage.data)
        assert torch.equal(got, values)
        tk_s = precision.weight_scale
        got_s = tk_s.storage.layout.unswizzle_data(tk_s.storage.data)
        assert torch.equal(got_s[:, : scales.shape[1], : scales.shape[2]], scales)
    if activation == "swigluoai":
        assert torch.equal(peer.b13, experts.w13_bias.float())
        assert torch.equal(peer.b2, experts.w2_bias.float())
        assert (peer.alpha, peer.limit) == (1.702, 7.0)
    else:
        assert peer.b2 is None and (peer.b13[:, 1::2] == -1).all()
        assert (peer.b13[:, 0::2] == 0).all()
        assert (peer.alpha, peer.limit) == (1.0, None)
    assert "converted once per shape" in peer.note


@pytest.mark.parametrize(("activation", "bias"), [("swigluoai", True), ("silu", False)])
def test_the_peers_dataflow_in_float64_is_the_reference(triton_kernels, activation, bias):
    """What the peer computes, replayed in float64 from its converted operands (unswizzled by
    triton_kernels' layouts, decoded along K): per slot, GEMM1 on w [E, K, N] plus bias, the
    fused swiglu on column pairs, GEMM2 plus bias, times the router weight, summed over the k
    slots. It is the reference's function: the orientation, the silu interleave and bias, and
    where the router weight goes are right (the kernels' arithmetic itself needs a GPU)."""
    e, k, h, i, m = 4, 2, 160, 96, 7
    experts = _experts(activation, bias=bias, e=e, h=h, i=i)
    peer = peers.TritonKernelsMoE(experts, activation=activation, top_k=k)
    r = make_routing("peers", m, e, k, h, "uniform", torch.bfloat16, torch.device("cpu"))

    def weight(tk_w, precision):  # -> float64 [E, K, N]
        values = tk_w.storage.layout.unswizzle_data(tk_w.storage.data)
        tk_s = precision.weight_scale
        scales = tk_s.storage.layout.unswizzle_data(tk_s.storage.data)[..., : values.shape[2]]
        return _decode_k_major(values, scales).double()

    w13, w2 = weight(peer.w13, peer.pc13), weight(peer.w2, peer.pc2)
    b13 = torch.zeros(e, w13.shape[2]) if peer.b13 is None else peer.b13
    b2 = torch.zeros(e, h) if peer.b2 is None else peer.b2
    out = torch.zeros(m, h, dtype=torch.float64)
    x = r.x.double()
    for t in range(m):
        for j in range(k):
            ex = int(r.topk_ids[t, j])
            act = peers.swiglu_pairs(x[t] @ w13[ex] + b13[ex].double(), peer.alpha, peer.limit)
            out[t] += float(r.topk_weights[t, j]) * (act @ w2[ex] + b2[ex].double())
    ref = fused_experts(
        r.x.double(), experts.w13, experts.w2, r.topk_weights, r.topk_ids,
        activation=activation, quant_config=experts.quant_config, backend="torch",
        w13_bias=experts.w13_bias, w2_bias=experts.w2_bias,
    )  # fmt: skip
    assert_close(out, ref.double(), torch.float64 if activation == "swigluoai" else torch.float32)


# ---------------------------------------------------------------------------------------------
# on a Hopper GPU
# ---------------------------------------------------------------------------------------------


def _on_hopper(triton_kernels):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper (sm90) GPU")


@pytest.mark.gpu
@pytest.mark.parametrize(("activation", "bias"), [("swigluoai", True), ("silu", False)])
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_peer_matches_the_reference_on_hopper(triton_kernels, activation, bias, tokens):
    _on_hopper(triton_kernels)
    from fusedmoe.tools.bench.timing import rel_err, time_ms

    device = torch.device("cuda")
    e, k, h, i = 16, 4, 480, 288  # 15 and 9 scale groups: padded to 16 and 12, as gpt-oss's 90
    experts = _experts(activation, bias=bias, e=e, h=h, i=i, device="cuda")
    peer = peers.TritonKernelsMoE(experts, activation=activation, top_k=k)
    r = make_routing("peers", tokens, e, k, h, "uniform", torch.bfloat16, device)
    with torch.inference_mode():
        out = peer(r)
        ref = fused_experts(
            r.x, experts.w13, experts.w2, r.topk_weights, r.topk_ids, activation=activation,
            quant_config=experts.quant_config, backend="torch", w13_bias=experts.w13_bias,
            w2_bias=experts.w2_bias,
        )  # fmt: skip
        assert peer.routing_mismatch(r) is None
        assert out.shape == (tokens, h) and out.dtype == torch.bfloat16
        assert rel_err(out, ref) < 0.03, rel_err(out, ref)
        _, how = time_ms(lambda: peer(r), device, rep_ms=5.0)
    assert how == "graph", f"the peer did not capture in a CUDA graph: {how}"


@pytest.mark.gpu
def test_bench_times_the_peer_on_hopper(triton_kernels, tmp_path, capsys):
    _on_hopper(triton_kernels)
    js = tmp_path / "rows.json"
    # scale 6: H = I = 480, 15 scale groups per row (padded to 16, as gpt-oss's 90 to 92)
    argv = ["bench", "--preset", "gpt-oss-120b", "--scale", "6", "--quant", "mxfp4_w4a16"]
    argv += ["--tokens", "1,64", "--peers", "triton_kernels", "--ceilings", "h100", "--quiet"]
    argv += ["--rep-ms", "5", "--json", str(js)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "peer triton_kernels: OpenAI triton_kernels matmul_ogs" in out
    rows = [r for r in json.loads(js.read_text()) if r["backend"] == "triton_kernels"]
    assert [r["tokens"] for r in rows] == [1, 64]
    assert all(r["rel_err"] < 0.03 and r["weights"] == "mxfp4_w4a16" for r in rows), rows
