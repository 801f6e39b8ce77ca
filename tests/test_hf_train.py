"""Fine-tuning transformers MoE models through fusedmoe: a few AdamW steps of a tiny model with
the "fusedmoe" experts implementation, and with patch(), against the same model computing its
own experts ("eager"): the same losses at every step, the loss going down, and after the first
backward the same gradient on every parameter of the model (experts, expert biases, router,
shared experts, attention, embeddings). Float32 on the CPU, through whichever backend fusedmoe
picks for a recorded forward.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

import fusedmoe.integrations.transformers as hf  # noqa: E402
from tests.helpers import assert_close  # noqa: E402
from tests.test_hf_integration import (  # noqa: E402
    FAMILY,
    VOCAB,
    blocks,
    build,
    skip_if_other_version_skipped,
)

STEPS = 4
LR = 1e-2
#: losses of two float32 computations of the same model, a few AdamW steps apart
LOSS_RTOL = 1e-4
#: per family, parameters of each MoE block (names within the block) whose gradient goes
#: through fusedmoe's computation: each must get a nonzero one
TRAINED = {
    "qwen3_moe": ["experts.gate_up_proj", "experts.down_proj", "gate.weight"],
    "mixtral": ["experts.gate_up_proj", "experts.down_proj", "gate.weight"],
    "qwen2_moe": [
        "experts.gate_up_proj", "experts.down_proj", "gate.weight",
        "shared_expert.gate_proj.weight", "shared_expert.down_proj.weight",
        "shared_expert_gate.weight",
    ],
    "deepseek_v3": [
        "experts.gate_up_proj", "experts.down_proj", "gate.weight",
        "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
    ],
    "gpt_oss": [
        "experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias",
        "experts.down_proj_bias", "router.weight", "router.bias",
    ],
}  # fmt: skip
#: patch() copies these (a transposed layout); every other parameter is the model's own object
COPIED = {"gpt_oss": {"experts.gate_up_proj", "experts.down_proj"}}
#: FusedMoEBlock's copies of transposed experts: its name -> the experts module's
COPY_NAMES = {"moe.w13_weight": "experts.gate_up_proj", "moe.w2_weight": "experts.down_proj"}


def batch() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def fused_model(model: torch.nn.Module, mode: str) -> tuple[torch.nn.Module, dict[int, str]]:
    """A copy of `model` computing its experts through fusedmoe, and {id: name} of its
    parameters as they were named before (the same names as in `model`)."""
    fused = copy.deepcopy(model)
    names = {id(p): n for n, p in fused.named_parameters()}
    if mode == "registered":
        fused.set_experts_implementation("fusedmoe")
    else:
        report = hf.patch(fused)
        skip_if_other_version_skipped(report)
        assert len(report.replaced) == 2 and report.skipped == {}, report
    return fused, names


def grads_by_original_name(
    model: torch.nn.Module, names_before: dict[int, str]
) -> tuple[dict[str, torch.Tensor | None], set[str]]:
    """Each parameter's gradient under the name it had before patch(): the same object's name,
    or, for an expert weight a FusedMoEBlock copied, its source's (transposed back); and the
    names of those copied."""
    grads, copied = {}, set()
    for name, param in model.named_parameters():
        if id(param) in names_before:
            grads[names_before[id(param)]] = param.grad
            continue
        block, _, local = name.rpartition(".moe.")
        assert f"moe.{local}" in COPY_NAMES, f"{name}: not one of the model's parameters"
        source = f"{block}.{COPY_NAMES[f'moe.{local}']}"
        grads[source] = None if param.grad is None else param.grad.transpose(1, 2)
        copied.add(source)
    return grads, copied


@pytest.mark.parametrize("mode", ["registered", "patch"])
@pytest.mark.parametrize("name", list(TRAINED))
def test_training_matches_eager(name, mode):
    family = FAMILY[name]
    eager = build(family).train()
    block_names = [n for n, m in eager.named_modules() if type(m).__name__ == family.block]
    fused, names_before = fused_model(eager, mode)
    ids = batch()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (eager, fused)]
    losses: list[list[float]] = [[], []]
    for step in range(STEPS):
        for model, optimizer, record in zip((eager, fused), optimizers, losses, strict=True):
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            record.append(loss.item())
        if step == 0:
            expected = {n: p.grad for n, p in eager.named_parameters()}
            actual, copied = grads_by_original_name(fused, names_before)
            assert actual.keys() == expected.keys()
            for param_name, grad in expected.items():
                assert grad is not None and actual[param_name] is not None, param_name
                assert_close(actual[param_name], grad, torch.float32, what=param_name)
            for block in block_names:
                for local in TRAINED[name]:
                    grad = actual[f"{block}.{local}"]
                    assert grad.abs().max() > 0, f"{block}.{local}: no gradient"
            # the model's own parameters are trained, but where patch() must copy
            copies = COPIED.get(name, set()) if mode == "patch" else set()
            assert copied == {f"{b}.{local}" for b in block_names for local in copies}
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(losses[1], losses[0], rtol=LOSS_RTOL, atol=0)
    assert losses[0][-1] < losses[0][0] - 0.1, losses  # it learns


def test_patch_keeps_the_models_own_parameters():
    """The FusedMoE layers hold the experts' Parameter objects: an optimizer built before
    patch() trains them, and a frozen one stays frozen."""
    family = FAMILY["qwen2_moe"]
    model = build(family).train()
    experts = [block.experts for block in blocks(model, family)]
    experts[1].down_proj.requires_grad_(False)
    params = [(e.gate_up_proj, e.down_proj) for e in experts]
    before = [w13.detach().clone() for w13, _ in params]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    assert len(hf.patch(model).replaced) == 2
    layers = [b.moe for b in model.modules() if isinstance(b, hf.FusedMoEBlock)]
    for layer, (w13, w2) in zip(layers, params, strict=True):
        assert layer.w13_weight is w13 and layer.w2_weight is w2
    ids = batch()
    model(ids, labels=ids).loss.backward()
    optimizer.step()

    for (w13, _), old in zip(params, before, strict=True):
        assert w13.grad is not None and not torch.equal(w13, old)
    assert experts[1].down_proj.grad is None and experts[0].down_proj.grad is not None
    assert {id(p) for p in model.parameters()} <= {
        id(p) for group in optimizer.param_groups for p in group["params"]
    }


def test_a_quantized_patched_model_refuses_to_train():
    """FP8 rounds the hidden states that reach the experts: their gradient would be cut, so a
    training forward is refused (tests/test_autograd.py: weight-only schemes with frozen
    experts let the model around them train)."""
    model = build(FAMILY["qwen3_moe"]).train()
    assert len(hf.patch(model, quant="fp8_block").replaced) == 2
    ids = batch()
    with pytest.raises(
        ValueError, match=r"fp8_block-quantized experts are inference only.*no_grad"
    ):
        model(ids, labels=ids)
    with torch.no_grad():  # inference is fine
        assert torch.isfinite(model(ids, labels=ids).loss)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["registered", "patch"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_gpu_bf16_training_matches_eager(name, mode, monkeypatch):
    """On CUDA in bf16 the experts train on the triton backend's kernels: a few AdamW steps
    give the eager model's losses within bf16 tolerance, and the loss goes down."""
    from fusedmoe.experts.triton import TritonExperts

    recorded = []
    real = TritonExperts._apply_recorded
    monkeypatch.setattr(
        TritonExperts, "_apply_recorded", lambda self, call: recorded.append(1) or real(self, call)
    )
    family = FAMILY[name]
    eager = build(family).to("cuda", torch.bfloat16).train()
    fused, _ = fused_model(eager, mode)
    ids = batch().cuda()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (eager, fused)]
    losses: list[list[float]] = [[], []]
    for _ in range(STEPS):
        for model, optimizer, record in zip((eager, fused), optimizers, losses, strict=True):
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            record.append(loss.item())
    for ours, theirs in zip(*losses, strict=True):
        assert abs(ours - theirs) <= 3e-2 * abs(theirs), (losses[1], losses[0])
    assert losses[1][-1] < losses[1][0]
    assert len(recorded) == 2 * STEPS, "the experts did not train on the triton kernels"
