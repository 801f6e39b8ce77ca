"""torch alone is enough on the CPU: every public entry point runs where `import triton` fails
(the CPU wheel of torch has no triton), and says why the Triton backends cannot run.

Each entry point runs in a fresh interpreter whose `sys.modules["triton"]` is None, which is
what Python does for a module that is absent: `import triton` raises ModuleNotFoundError and
`importlib.util.find_spec("triton")` returns None. `.ci/run` also runs the README's demo
command in a fresh venv with no extras, the real thing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

NO_TRITON = "import sys\nsys.modules['triton'] = None\nsys.modules['triton.language'] = None\n"

# checks that every snippet ends with: nothing imported triton, nothing else of it loaded
EPILOGUE = (
    "\nassert not [m for m in sys.modules if m.split('.')[0] == 'triton' and sys.modules[m]]\n"
    "print('NO-TRITON-OK')\n"
)

LAYER = """
import torch
from fusedmoe import FusedMoE
from fusedmoe.quant.config import SCHEMES

for scheme in (None, *SCHEMES):
    moe = FusedMoE(8, 2, 128, 64, params_dtype=torch.bfloat16)
    if scheme is not None:
        moe.quantize_(scheme)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    y = moe(x, torch.randn(2, 3, 8))
    assert y.shape == x.shape and torch.isfinite(y).all(), scheme
    explained = moe.backend_choice().explain()
    assert "not triton: triton is not installed" in explained, explained

# training runs on the reference
moe = FusedMoE(8, 2, 64, 32, params_dtype=torch.float32)
x = torch.randn(5, 64, requires_grad=True)
moe(x, torch.randn(5, 8)).square().sum().backward()
assert x.grad is not None and moe.w13_weight.grad is not None
"""

FUNCTIONAL = """
import torch
from fusedmoe import fused_experts, fused_moe, select_backend

x = torch.randn(7, 64)
w13, w2 = torch.randn(4, 64, 64) / 8, torch.randn(4, 64, 32) / 8
weights = torch.rand(7, 2)
ids = torch.randint(0, 4, (7, 2), dtype=torch.int32)
assert torch.isfinite(fused_experts(x, w13, w2, weights, ids)).all()
assert torch.isfinite(fused_moe(x, w13, w2, torch.randn(7, 4), 2)).all()
choice = select_backend(
    device="cpu", dtype=torch.float32, hidden_size=64, intermediate_size=32, num_experts=4,
    top_k=2,
)
assert "triton is not installed" in choice.explain(), choice.explain()
"""

TRANSFORMERS = """
import fusedmoe.integrations.transformers  # registers the experts implementation
from fusedmoe.tools.cli import main
assert main(["demo", "--hf", "--repeats", "1"]) == 0
"""


def _cli(command: str) -> str:
    return f"from fusedmoe.tools.cli import main\nassert main({command.split()!r}) == 0\n"


BENCH = "bench --device cpu --preset qwen3-30b-a3b --tokens 3 --rep-ms 1"
ENTRY_POINTS = {
    "layer, every scheme, and training": LAYER,
    "fused_experts and fused_moe": FUNCTIONAL,
    "transformers integration": TRANSFORMERS,
    "fusedmoe demo": _cli("demo --repeats 1"),
    "fusedmoe demo --quant": _cli("demo --quant mxfp4_w4a16 --repeats 1"),
    "fusedmoe backends": _cli("backends"),
    "fusedmoe bench --device cpu": _cli(BENCH + " --quant bf16,fp8_block"),
    "fusedmoe bench --eager": _cli(BENCH + " --eager"),
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_point_runs_without_triton(name):
    if name == "transformers integration":
        pytest.importorskip("transformers", minversion="5")
    code = NO_TRITON + textwrap.dedent(ENTRY_POINTS[name]) + EPILOGUE
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and "NO-TRITON-OK" in result.stdout, (
        f"{name} failed without triton:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )


def test_backends_say_why_they_cannot_run_without_triton():
    code = NO_TRITON + _cli("backends") + EPILOGUE
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "deep_gemm: none: triton is not installed" in result.stdout, result.stdout
    assert "deep_gemm_fp4: none: triton is not installed" in result.stdout, result.stdout
