"""transformers integration: patch() and the "fusedmoe" experts implementation, on tiny models.

Every family is a tiny model built from its config class (no downloads): float32, eval mode,
hidden 32, 2 layers, 4-8 experts, vocabulary 128, with its MoE parameters redrawn larger than
the init so that routing, biases and clamps matter. Patched and registered models are compared
with the model computing its own experts ("eager"): logits within the float32 bound, greedy
generation token for token. Nothing here depends on which fusedmoe backend "auto" picks.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

import fusedmoe.integrations.transformers as hf  # noqa: E402
from tests.helpers import assert_close, assert_equal  # noqa: E402

#: the block adapters follow one release's modeling code; on another, a block whose code moved
#: is reported as skipped (never patched wrongly), and these tests skip rather than fail
TESTED_VERSION = transformers.__version__.startswith(hf.TESTED_TRANSFORMERS + ".")


def skip_if_other_version_skipped(report) -> None:
    if not TESTED_VERSION and any("could not read" in why for why in report.skipped.values()):
        pytest.skip(f"transformers {transformers.__version__}: {report.skipped}")


VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip
DEEPSEEK_ATTENTION = dict(
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    num_key_value_heads=4, first_k_dense_replace=0,
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    name: str
    config: str  # transformers config class
    model: str  # its causal LM class
    block: str  # the sparse MoE block class that patch() replaces
    kwargs: dict = field(default_factory=dict)


FAMILIES = [
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM", "MixtralSparseMoeBlock",
           dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    Family("minimax", "MiniMaxConfig", "MiniMaxForCausalLM", "MiniMaxSparseMoeBlock",
           dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeSparseMoeBlock",
           dict(intermediate_size=32, moe_intermediate_size=16, num_experts=8,
                num_experts_per_tok=2, shared_expert_intermediate_size=24,
                norm_topk_prob=False)),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeSparseMoeBlock",
           dict(intermediate_size=32, moe_intermediate_size=16, num_experts=8,
                num_experts_per_tok=2, head_dim=8, norm_topk_prob=True)),
    Family("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextSparseMoeBlock",
           dict(intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                num_experts_per_tok=2, shared_expert_intermediate_size=16, head_dim=8,
                layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)),
    Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
           "Qwen3_5MoeSparseMoeBlock",
           dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                shared_expert_intermediate_size=16, head_dim=8,
                layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)),
    Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "OlmoeSparseMoeBlock",
           dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    Family("flex_olmo", "FlexOlmoConfig", "FlexOlmoForCausalLM", "FlexOlmoSparseMoeBlock",
           dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    Family("jamba", "JambaConfig", "JambaForCausalLM", "JambaSparseMoeBlock",
           dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                expert_layer_period=1, expert_layer_offset=0, attn_layer_period=1,
                attn_layer_offset=0, use_mamba_kernels=False)),
    Family("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", "GraniteMoeMoE",
           dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    Family("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
           "GraniteMoeSharedMoE",
           dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                shared_intermediate_size=16)),
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM", "GptOssMLP",
           dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                sliding_window=8, swiglu_limit=1.0, swiglu_alpha=1.5)),
    Family("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2Moe",
           dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, topk_method="group_limited_greedy",
                n_group=4, topk_group=2, routed_scaling_factor=1.5, **DEEPSEEK_ATTENTION)),
    Family("deepseek_v2_greedy", "DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2Moe",
           dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, topk_method="greedy",
                **DEEPSEEK_ATTENTION)),
    Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepseekV3MoE",
           dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                routed_scaling_factor=2.5, **DEEPSEEK_ATTENTION)),
    Family("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", "Glm4MoeMoE",
           dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                first_k_dense_replace=0, head_dim=8, norm_topk_prob=False)),
    Family("dots1", "Dots1Config", "Dots1ForCausalLM", "Dots1MoE",
           dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                first_k_dense_replace=0, head_dim=8)),
    Family("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeForCausalLM", "ExaoneMoeSparseMoEBlock",
           dict(intermediate_size=32, moe_intermediate_size=16, num_experts=8,
                num_experts_per_tok=2, n_group=2, topk_group=1, num_shared_experts=1,
                first_k_dense_replace=0, head_dim=8)),
    Family("solar_open", "SolarOpenConfig", "SolarOpenForCausalLM", "SolarOpenMoE",
           dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
                num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                first_k_dense_replace=0, head_dim=8)),
    Family("minimax_m2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM", "MiniMaxM2SparseMoeBlock",
           dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
    Family("hunyuan_v1_moe", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Moe",
           dict(intermediate_size=16, num_experts=4, moe_topk=2, head_dim=8)),
]  # fmt: skip
FAMILY = {f.name: f for f in FAMILIES}


def build(family: Family, **overrides) -> torch.nn.Module:
    """The family's tiny model (eager experts), its MoE parameters redrawn from a fixed seed."""
    config_cls = getattr(transformers, family.config, None)
    model_cls = getattr(transformers, family.model, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"this transformers has no {family.model}")
    config = config_cls(**{**COMMON, **family.kwargs, **overrides})
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in blocks(model, family):
            for name, param in block.named_parameters():
                std = 0.5 if name.split(".")[0] in ("gate", "router") else 0.2  # peaky routing
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            for name, buf in block.named_buffers():
                if name.endswith("bias"):  # e_score_correction_bias: moves the choice
                    buf.copy_(torch.randn(buf.shape, generator=generator) * 0.1)
    return model


def blocks(model: torch.nn.Module, family: Family) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == family.block]


def block_names(model: torch.nn.Module, family: Family) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == family.block]


def prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))


def outputs(model: torch.nn.Module, ids: torch.Tensor, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs)


def greedy(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)


@pytest.fixture
def count_fused_experts(monkeypatch):
    """The fused_experts calls of the registered implementation: (w13, w2) of each."""
    calls = []
    original = hf.fused_experts

    def counting(hidden_states, w13, w2, *args, **kwargs):
        calls.append((w13, w2))
        return original(hidden_states, w13, w2, *args, **kwargs)

    monkeypatch.setattr(hf, "fused_experts", counting)
    return calls


# ---- every family --------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_patch_matches_original(family):
    model = build(family)
    ids = prompt()
    expected = outputs(model, ids).logits
    names = block_names(model, family)
    assert len(names) == 2

    report = hf.patch(model)

    skip_if_other_version_skipped(report)
    assert report.replaced == names
    assert report.skipped == {}
    for name in names:
        assert isinstance(model.get_submodule(name), hf.FusedMoEBlock)
    assert_close(outputs(model, ids).logits, expected, torch.float32, what=family.name)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_registered_implementation_matches_original(family, count_fused_experts):
    model = build(family)
    ids = prompt()
    expected = outputs(model, ids).logits

    model.set_experts_implementation("fusedmoe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the module's own forward
        actual = outputs(model, ids).logits

    assert model.config._experts_implementation == "fusedmoe"
    assert len(count_fused_experts) == 2  # one call per MoE layer
    assert_close(actual, expected, torch.float32, what=family.name)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_greedy_generation_is_identical(family):
    model = build(family)
    ids = prompt()[:1]
    expected = greedy(model, ids)
    assert expected.shape[1] == ids.shape[1] + 20

    registered = copy.deepcopy(model)
    registered.set_experts_implementation("fusedmoe")
    assert_equal(greedy(registered, ids), expected, what="registered")
    skip_if_other_version_skipped(hf.patch(model))
    assert_equal(greedy(model, ids), expected, what="patched")


# ---- the registered implementation ---------------------------------------------------------
def test_registration_is_idempotent_and_not_done_by_import_fusedmoe():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    hf.register()
    hf.register()
    assert ALL_EXPERTS_FUNCTIONS["fusedmoe"] is hf.fusedmoe_experts_forward
    code = "import sys, fusedmoe; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_registered_implementation_uses_the_parameters_in_place(name, count_fused_experts):
    """Views of the parameters (gpt-oss: transposed), never copies, so updates are seen."""
    family = FAMILY[name]
    model = build(family)
    ids = prompt()
    registered = copy.deepcopy(model)
    registered.set_experts_implementation("fusedmoe")
    outputs(registered, ids)
    experts = [block.experts for block in blocks(registered, family)]
    for (w13, w2), module in zip(count_fused_experts, experts, strict=True):
        assert w13.untyped_storage().data_ptr() == module.gate_up_proj.untyped_storage().data_ptr()
        assert w2.untyped_storage().data_ptr() == module.down_proj.untyped_storage().data_ptr()

    with torch.no_grad():  # the same in-place update in both models
        for m in (model, registered):
            blocks(m, family)[1].experts.down_proj.mul_(-2.0)
    assert_close(outputs(registered, ids).logits, outputs(model, ids).logits, torch.float32)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_registered_implementation_trains(name):
    """Gradients reach the experts' parameters through the views, as in the eager forward."""
    family = FAMILY[name]
    model = build(family).train()
    registered = copy.deepcopy(model)
    registered.set_experts_implementation("fusedmoe")
    ids = prompt()
    for m in (model, registered):
        m(ids, labels=ids).loss.backward()
    for a, e in zip(blocks(registered, family), blocks(model, family), strict=True):
        for param in ("gate_up_proj", "down_proj"):
            grad, expected = getattr(a.experts, param).grad, getattr(e.experts, param).grad
            assert_close(grad, expected, torch.float32, what=f"{param}.grad")


def test_unrepresentable_experts_fall_back_with_a_warning(count_fused_experts):
    """A gated ReLU has no fusedmoe activation: the module runs its own forward, says why."""
    model = build(FAMILY["mixtral"], hidden_act="relu")
    ids = prompt()
    expected = outputs(model, ids).logits

    model.set_experts_implementation("fusedmoe")
    with pytest.warns(UserWarning, match="runs its own forward.*ReLU") as record:
        actual = outputs(model, ids).logits
    assert len([w for w in record if "fusedmoe" in str(w.message)]) == 2  # once per module
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not again
        outputs(model, ids)

    assert count_fused_experts == []
    assert_equal(actual, expected, what="fallback logits")


def test_from_pretrained_with_experts_implementation(tmp_path):
    family = FAMILY["qwen3_moe"]
    model = build(family)
    model.save_pretrained(tmp_path)
    ids = prompt()

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="fusedmoe", dtype=torch.float32
    ).eval()

    assert loaded.config._experts_implementation == "fusedmoe"
    assert_close(outputs(loaded, ids).logits, outputs(model, ids).logits, torch.float32)


# ---- patch ---------------------------------------------------------------------------------
def test_unrepresentable_block_is_reported_and_left_untouched():
    """Phi-MoE routes by sparsemixer: no fusedmoe router computes it."""
    model = transformers.PhimoeForCausalLM(
        transformers.PhimoeConfig(
            **COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
        )
    ).eval()
    ids = prompt()
    before = {n: m for n, m in model.named_modules()}
    expected = outputs(model, ids).logits

    report = hf.patch(model)

    assert report.replaced == []
    assert sorted(report.skipped) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all("sparsemixer" in why for why in report.skipped.values())
    assert all(m is before[n] for n, m in model.named_modules())
    assert_equal(outputs(model, ids).logits, expected)


def test_unrepresentable_activation_is_reported():
    model = build(FAMILY["mixtral"], hidden_act="relu")
    report = hf.patch(model)
    assert report.replaced == []
    assert set(report.skipped) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert all("ReLU has no gated fusedmoe equivalent" in why for why in report.skipped.values())


def test_block_without_an_adapter_is_reported():
    family = FAMILY["mixtral"]
    experts = blocks(build(family), family)[0].experts

    class HomeMadeMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = experts

    model = torch.nn.Sequential(HomeMadeMoE())
    report = hf.patch(model)
    assert report.replaced == []
    assert list(report.skipped) == ["0"]
    assert "HomeMadeMoE: no fusedmoe adapter" in report.skipped["0"]


def test_jitter_noise_is_refused_in_training_only():
    family = FAMILY["mixtral"]
    model = build(family, router_jitter_noise=0.1)

    report = hf.patch(model.train())
    assert report.replaced == []
    assert all("jitters its input" in why for why in report.skipped.values())

    report = hf.patch(model.eval())
    assert len(report.replaced) == 2
    model.train()
    with pytest.raises(RuntimeError, match="jitters its input in training mode"):
        model(prompt())


def test_patch_is_idempotent():
    model = build(FAMILY["qwen2_moe"])
    assert len(hf.patch(model).replaced) == 2
    again = hf.patch(model)
    assert again.replaced == [] and again.skipped == {}


def test_patch_refuses_unknown_backend_and_scheme():
    model = build(FAMILY["mixtral"])
    with pytest.raises(ValueError, match="backend"):
        hf.patch(model, backend="no-such-backend")
    with pytest.raises(ValueError, match="quant scheme"):
        hf.patch(model, quant="fp3")


def test_patch_with_a_named_backend():
    model = build(FAMILY["deepseek_v3"])
    ids = prompt()
    expected = outputs(model, ids).logits
    assert len(hf.patch(model, backend="torch").replaced) == 2
    assert all(b.moe.backend == "torch" for b in model.modules() if isinstance(b, hf.FusedMoEBlock))
    assert_close(outputs(model, ids).logits, expected, torch.float32)


@pytest.mark.skipif(not TESTED_VERSION, reason="router-logit outputs follow one release's code")
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_router_logits_are_still_recorded(name):
    """output_router_logits: transformers records them with hooks on the router module."""
    family = FAMILY[name]
    model = build(family)
    ids = prompt()
    expected = outputs(model, ids, output_router_logits=True)
    hf.patch(model)
    actual = outputs(model, ids, output_router_logits=True)
    assert len(actual.router_logits) == len(expected.router_logits) == 2
    for a, e in zip(actual.router_logits, expected.router_logits, strict=True):
        assert_close(a, e, torch.float32, what="router logits")
    assert_close(actual.logits, expected.logits, torch.float32)
    if expected.get("aux_loss") is not None:  # the load-balancing loss, from those logits
        assert_close(actual.aux_loss, expected.aux_loss, torch.float32, what="aux loss")


def test_gpt_oss_block_keeps_its_output_contract():
    """GptOssMLP returns (hidden, top-k router scores); the FusedMoEBlock does too."""
    family = FAMILY["gpt_oss"]
    original = blocks(build(family), family)[0]
    patched = copy.deepcopy(torch.nn.Sequential(original))
    hf.patch(patched)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        hidden, scores = original(x)
        hidden_p, scores_p = patched[0](x)
    assert_close(hidden_p, hidden, torch.float32, what="hidden")
    assert_close(scores_p, scores, torch.float32, what="router scores")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_patch_quantized_fp8_block(name):
    """Online FP8 (128x128 weight blocks, 1x128 activation groups): each block's output within
    FP8's error of the original block's (same routing: the router is not quantized)."""
    family = FAMILY[name]
    model = build(family)
    original = copy.deepcopy(model)
    report = hf.patch(model, quant="fp8_block")
    assert len(report.replaced) == 2 and report.skipped == {}
    x = torch.randn(2, 7, 32)
    for block_name in report.replaced:
        block = model.get_submodule(block_name)
        assert block.moe.quant_scheme == "fp8_block"
        with torch.no_grad():
            expected = original.get_submodule(block_name)(x)
            actual = block(x)
        if isinstance(expected, tuple):
            expected, actual = expected[0], actual[0]
        assert_close(actual, expected, tol=0.15, rms_tol=0.03, what=f"{name} {block_name}")
    out = greedy(model, prompt()[:1])
    assert out.shape == (1, 29)


@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("mxfp4_w4a16", None),
        ("nvfp4_w4a16", None),
        ("int4_w4a16", {"group_size": 32, "zero_points": True}),
        ("int8_w8a16", None),
    ],
)
def test_patch_weight_only(scheme, options):
    """The weight-only schemes through patch(): each block's output within the scheme's error
    of the original block's (tests/test_quant_schemes.py's bounds)."""
    model = build(FAMILY["qwen2_moe"])
    original = copy.deepcopy(model)
    report = hf.patch(model, quant=scheme, quant_options=options)
    assert len(report.replaced) == 2 and report.skipped == {}
    x = torch.randn(2, 7, 32)
    for block_name in report.replaced:
        block = model.get_submodule(block_name)
        assert block.moe.quant_scheme == scheme
        with torch.no_grad():
            expected = original.get_submodule(block_name)(x)
            actual = block(x)
        if isinstance(expected, tuple):
            expected, actual = expected[0], actual[0]
        assert_close(actual, expected, tol=0.6, rms_tol=0.1, what=f"{scheme} {block_name}")


def test_patch_passes_quant_options():
    """quant_options reach every block's quantize_; bad ones fail patch() at once (not one
    skipped block after another)."""
    model = build(FAMILY["qwen3_moe"])
    report = hf.patch(model, quant="fp8_block", quant_options={"fast_accum": True})
    assert len(report.replaced) == 2 and report.skipped == {}
    for block_name in report.replaced:
        assert model.get_submodule(block_name).moe.quant_config.fast_accum
    fresh = build(FAMILY["qwen3_moe"])
    with pytest.raises(ValueError, match="quant_options needs quant"):
        hf.patch(fresh, quant_options={"fast_accum": True})
    with pytest.raises(ValueError, match="fast_accum applies to fp8_block"):
        hf.patch(fresh, quant="int8", quant_options={"fast_accum": True})
    with pytest.raises(TypeError, match="quant_options must be a dict"):
        hf.patch(fresh, quant="fp8_block", quant_options=[("fast_accum", True)])
    assert not any(isinstance(m, hf.FusedMoEBlock) for m in fresh.modules())


def test_a_layer_fusedmoe_refuses_is_reported(monkeypatch):
    """A ValueError of FusedMoE (a scheme it cannot apply, ...) leaves the block, with why."""

    def refuse(self, scheme, **kwargs):
        raise ValueError(f"{scheme}: not for these shapes")

    monkeypatch.setattr(hf.FusedMoE, "quantize_", refuse)
    model = build(FAMILY["qwen3_moe"])
    report = hf.patch(model, quant="nvfp4")
    assert report.replaced == []
    assert set(report.skipped.values()) == {
        "Qwen3MoeSparseMoeBlock: FusedMoE refused it: nvfp4: not for these shapes"
    }
    assert not any(isinstance(m, hf.FusedMoEBlock) for m in model.modules())
