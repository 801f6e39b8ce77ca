"""Programmatic dependent launch (fusedmoe._pdl).

On the CPU: it is off there, FUSEDMOE_PDL=0 turns it off, and every kernel that takes the PDL
constexpr waits for the previous kernel before anything else (the contract that makes an early
start safe). On a GPU (`gpu` marker): a decode-sized layer gives bit-identical outputs with PDL on
and off, eager and replayed from a CUDA graph, many times over (a missing wait would show as a
race), and the kernels were compiled for PDL.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from fusedmoe import _pdl as pdl


def _pdl_kernels():
    from fusedmoe.kernels import moe_align, moe_gemm
    from fusedmoe.quant import kernels as quant_kernels
    from fusedmoe.router import fused

    return {
        "moe_gemm": moe_gemm._moe_gemm_kernel,
        "moe_sum": moe_gemm._moe_sum_kernel,
        "align_single": moe_align._align_single_kernel,
        "count": moe_align._count_kernel,
        "scan": moe_align._scan_kernel,
        "scatter": moe_align._scatter_kernel,
        "group_quant": quant_kernels._group_quant_fp8_kernel,
        "act_mul_group_quant": quant_kernels._act_mul_group_quant_fp8_kernel,
        "route": fused._route_kernel,
    }


def test_off_on_the_cpu():
    assert pdl.pdl_args(torch.empty(1)) == {"PDL": False}


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("FUSEDMOE_PDL", "0")
    assert not pdl._enabled()
    monkeypatch.setenv("FUSEDMOE_PDL", "1")
    assert pdl._enabled() == pdl._HAS_GDC


def test_the_launch_option_comes_only_with_the_constexpr():
    assert pdl._ON == {"PDL": True, "launch_pdl": True}
    assert "launch_pdl" not in pdl._OFF


_WAITS = ("pdl_start(PDL)", "pdl_wait(PDL)", "pdl_start_early(PDL)")


def _call(statement) -> str | None:
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        return ast.unparse(statement.value)
    return None


@pytest.mark.parametrize("name", list(_pdl_kernels()))
def test_every_pdl_kernel_waits_before_anything_else(name):
    """The first statement of the kernel's body (after its docstring) waits for the previous
    kernel (pdl_start, pdl_wait, pdl_start_early): no load or store can run before it has
    finished. The one exception is the GEMM's weight prefetch, which reads only the row block's
    expert (written before GEMM1 started, see moe_gemm._prefetch_w_rows) and then waits."""
    fn = _pdl_kernels()[name].fn
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    assert "PDL" in [a.arg for a in func.args.args]
    body = func.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0]
    if isinstance(first, ast.If):
        assert ast.unparse(first.test) == "PREFETCH_W" and not first.orelse
        assert len(first.body) == 1
        assert (_call(first.body[0]) or "").startswith("_prefetch_w_rows(")
        first = body[1]
    assert _call(first) in _WAITS


def test_the_prefetch_reads_only_the_expert_ids():
    """_prefetch_w_rows runs before the GEMM's wait: its only loads are of the row block's
    expert (expert_ids, or topk_ids and the expert map), and it stores nothing."""
    from fusedmoe.kernels import moe_gemm

    source = inspect.getsource(moe_gemm._prefetch_w_rows.fn)
    loads = [ast.unparse(node.args[0]) for node in ast.walk(ast.parse(textwrap.dedent(source)))
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.load"]  # fmt: skip
    assert sorted(loads) == ["expert_ids_ptr + pid_m", "ids_ptr + pid_m", "map_ptr + expert"]
    assert "tl.store" not in source and "atomic" not in source


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
def _hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] < 9 or not pdl._HAS_GDC:
        pytest.skip("PDL needs compute capability >= 9.0 and Triton's griddepcontrol")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [None, "fp8_block"], ids=["bf16", "fp8_block"])
def test_gpu_outputs_are_the_same_with_and_without_pdl(scheme, monkeypatch):
    _hopper()
    from fusedmoe import FusedMoE

    torch.manual_seed(0)
    layer = FusedMoE(128, 8, 2048, 768, params_dtype=torch.bfloat16, device="cuda",
                     quant_config=scheme)  # fmt: skip
    for num_tokens in (1, 8, 64):
        x = torch.randn(num_tokens, 2048, dtype=torch.bfloat16, device="cuda")
        logits = torch.randn(num_tokens, 128, device="cuda")
        outs = {}
        for on in (False, True):
            monkeypatch.setattr(pdl, "_BY_DEVICE", {})
            monkeypatch.setenv("FUSEDMOE_PDL", "1" if on else "0")
            eager = [layer(x, logits) for _ in range(20)]
            graph = torch.cuda.CUDAGraph()
            static = layer(x, logits)
            with torch.cuda.graph(graph):
                static = layer(x, logits)
            replays = []
            for _ in range(20):
                graph.replay()
                replays.append(static.clone())
            outs[on] = eager + replays
            assert pdl.pdl_args(x) == (pdl._ON if on else pdl._OFF)
        first = outs[False][0]
        assert torch.isfinite(first.float()).all()
        for out in outs[False] + outs[True]:
            assert torch.equal(out, first), f"M = {num_tokens}"


@pytest.mark.gpu
def test_gpu_kernels_are_compiled_for_pdl(monkeypatch):
    _hopper()
    from fusedmoe import fused_experts
    from fusedmoe.kernels import moe_gemm
    from tests.helpers import random_routing

    monkeypatch.setattr(pdl, "_BY_DEVICE", {})
    monkeypatch.setenv("FUSEDMOE_PDL", "1")
    torch.manual_seed(1)
    w13 = torch.randn(8, 512, 256, dtype=torch.bfloat16, device="cuda") * 0.1
    w2 = torch.randn(8, 256, 256, dtype=torch.bfloat16, device="cuda") * 0.1
    weights, ids = random_routing(3, 8, 2, device="cuda")
    x = torch.randn(3, 256, dtype=torch.bfloat16, device="cuda")
    fused_experts(x, w13, w2, weights, ids, backend="triton")
    compiled = [
        k for cache in moe_gemm._moe_gemm_kernel.device_caches.values() for k in cache[0].values()
    ]
    assert any(getattr(k.metadata, "launch_pdl", False) for k in compiled)
