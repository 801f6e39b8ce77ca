"""Training through the reference backend: gradients match autograd of an independent
float64 reference, and recorded calls never share workspaces."""

import copy

import pytest
import torch

from fusedmoe import FusedMoE, fused_experts
from tests.helpers import assert_close
from tests.reference import experts_ref, softmax_topk_ref

E, H, I = 6, 24, 16


@pytest.mark.parametrize("activation", ["silu", "swigluoai", "relu2_no_mul"])
@pytest.mark.parametrize("has_bias", [False, True])
def test_fused_experts_gradients_match_float64_reference(activation, has_bias):
    gated = activation != "relu2_no_mul"
    n = 2 * I if gated else I
    leaves = {
        "x": torch.randn(11, H),
        "w13": torch.randn(E, n, H) * 0.3,
        "w2": torch.randn(E, H, I) * 0.3,
    }
    if has_bias:
        leaves |= {"w13_bias": torch.randn(E, n) * 0.1, "w2_bias": torch.randn(E, H) * 0.1}
    weights, ids = softmax_topk_ref(torch.randn(11, E), 3)
    grad_out = torch.randn(11, H)

    ours = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    out = fused_experts(
        ours["x"],
        ours["w13"],
        ours["w2"],
        weights,
        ids,
        activation=activation,
        w13_bias=ours.get("w13_bias"),
        w2_bias=ours.get("w2_bias"),
    )
    out.backward(grad_out)

    ref = {k: v.double().requires_grad_() for k, v in leaves.items()}
    expected = experts_ref(
        ref["x"],
        ref["w13"],
        ref["w2"],
        weights,
        ids,
        activation=activation,
        w13_bias=ref.get("w13_bias"),
        w2_bias=ref.get("w2_bias"),
    )
    expected.backward(grad_out.double())
    assert_close(out, expected, torch.float32)
    for name in leaves:
        assert_close(ours[name].grad, ref[name].grad, torch.float32, what=f"grad of {name}")


def test_layer_trains_across_two_recorded_calls():
    """Two forwards before one backward: the first call's saved tensors must be intact."""
    layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32)
    x1, x2 = torch.randn(9, H), torch.randn(9, H)
    logits1, logits2 = torch.randn(9, E), torch.randn(9, E)
    loss = layer(x1, logits1).square().sum() + layer(x2, logits2).square().sum()
    loss.backward()
    grad_two_calls = layer.w13_weight.grad.clone()

    layer.zero_grad()
    layer(x1, logits1).square().sum().backward()
    layer(x2, logits2).square().sum().backward()  # accumulates
    assert_close(grad_two_calls, layer.w13_weight.grad, torch.float32)
    assert layer.w13_weight.grad.abs().sum() > 0
    copy.deepcopy(layer)  # no graph tensor is left inside the layer


@pytest.mark.parametrize("scheme", ["fp8_block", "int8", "mxfp4_w4a16"])
def test_quantized_experts_are_inference_only(scheme):
    """Training quantized experts is refused before any backend runs; with the experts frozen
    (quantize_ freezes the biases with the weights) a recorded forward runs, and the gradient
    reaches the input and the router logits through the dequantized weights."""
    layer = FusedMoE(4, 2, 256, 128, has_bias=True, quant_config=scheme)
    assert not any(p.requires_grad for p in layer.parameters())
    x, logits = torch.randn(5, 256, dtype=torch.bfloat16), torch.randn(5, 4)
    logits.requires_grad_(True)
    layer(x, logits).float().square().sum().backward()  # the router trains through them
    assert logits.grad.abs().sum() > 0
    x.requires_grad_(True)
    if layer.quant_config.a1.quantized:  # rounding x would cut its gradient
        with pytest.raises(ValueError, match="quantizes it"):
            layer(x, logits)
    else:  # frozen weight-only experts: what lies around them trains
        layer(x, logits).float().square().sum().backward()
        assert x.grad.abs().sum() > 0
    layer.w2_bias.requires_grad_(True)  # training a bias is training the layer
    refused = rf"{scheme}-quantized experts are inference only.*torch.no_grad\(\)"
    with pytest.raises(ValueError, match=refused):
        layer(x.detach(), logits.detach())
    with torch.no_grad():
        assert layer(x, logits).shape == (5, 256)
    qc = layer.quant_config
    weights, ids = softmax_topk_ref(logits.detach(), 2)
    w13 = layer.w13_weight.detach().clone()
    if w13.is_floating_point():
        w13.requires_grad_(True)
        with pytest.raises(ValueError, match="inference only"):
            fused_experts(x.detach(), w13, layer.w2_weight, weights, ids, quant_config=qc)


@pytest.mark.parametrize("activation", ["silu", "swigluoai", "gelu_no_mul"])
def test_reference_backward_passes_gradcheck(activation):
    """torch.autograd.gradcheck (float64 finite differences) through the reference backend:
    x, both weights and both biases. (The router weights are float32 by convention, too coarse
    for finite differences; tests/test_train_triton.py checks their gradient analytically.)"""
    gated = activation != "gelu_no_mul"
    n = 2 * 5 if gated else 5
    num_tokens, hidden, num_experts = 4, 6, 3
    inputs = (
        torch.randn(num_tokens, hidden, dtype=torch.float64),
        torch.randn(num_experts, n, hidden, dtype=torch.float64) * 0.5,
        torch.randn(num_experts, hidden, 5, dtype=torch.float64) * 0.5,
        torch.randn(num_experts, n, dtype=torch.float64) * 0.1,
        torch.randn(num_experts, hidden, dtype=torch.float64) * 0.1,
    )
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]], dtype=torch.int32)
    weights = torch.rand(num_tokens, 2) + 0.1

    def experts(x, w13, w2, b13, b2):
        return fused_experts(
            x, w13, w2, weights, ids, activation=activation, w13_bias=b13, w2_bias=b2,
            backend="torch",
        )  # fmt: skip

    leaves = tuple(t.requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(experts, leaves, eps=1e-6, atol=1e-5)
