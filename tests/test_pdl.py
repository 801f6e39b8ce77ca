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
    from fusedmoe.kernels import load_choice, moe_align, moe_gemm
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
        "load_count": load_choice._count_kernel,
        "load_choose": load_choice._choose_kernel,
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


@pytest.mark.parametrize("name", list(_pdl_kernels()))
def test_every_pdl_kernel_waits_before_anything_else(name):
    """The first statement of the kernel's body (after its docstring) is pdl_start(PDL) or
    pdl_wait(PDL): no load or store can run before the previous kernel has finished."""
    fn = _pdl_kernels()[name].fn
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    assert "PDL" in [a.arg for a in func.args.args]
    body = func.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
    assert ast.unparse(first.value) in ("pdl_start(PDL)", "pdl_wait(PDL)")


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
