"""GPU runs of the spine: the layer on CUDA matches the float64 reference on the CPU."""

import copy

import pytest
import torch

from fusedmoe.tools.cli import main
from fusedmoe.tools.presets import PRESETS
from tests.helpers import assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b"])
@pytest.mark.parametrize("num_tokens", [1, 37, 256])
def test_layer_on_cuda_matches_cpu_float64(preset, num_tokens):
    spec = PRESETS[preset].scaled(4)
    layer = spec.build(dtype=torch.bfloat16, device="cuda")
    x = torch.randn(num_tokens, spec.hidden_size, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(num_tokens, spec.num_experts, device="cuda")
    out = layer(x, logits)
    reference = copy.deepcopy(layer).cpu().to(torch.float64)
    expected = reference(x.cpu().double(), logits.cpu())
    assert out.device.type == "cuda"
    assert_close(out.cpu(), expected, torch.bfloat16)


def test_demo_on_cuda(capsys):
    assert main(["demo", "--device", "cuda", "--tokens", "64"]) == 0
    assert "cuda" in capsys.readouterr().out
