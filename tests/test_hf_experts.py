"""The "fusedmoe" experts implementation on every experts class of the installed transformers.

Each `@use_experts_implementation` class is built alone from its family's config (sizes made
tiny), its parameters drawn large enough that clamps (gpt-oss, DeepSeek-V4, ...) act. Either
fusedmoe computes it (within the float32 bound of the class's own forward, on views of its
parameters), or it is refused with a reason and runs its own forward, bit for bit.
Legend: T tokens, H hidden, E experts, k top-k.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pathlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

import fusedmoe.integrations.transformers as hf  # noqa: E402
from tests.helpers import assert_close, assert_equal  # noqa: E402

T, H, E, K = 11, 32, 4, 2
TINY = dict(
    hidden_size=H, intermediate_size=16, moe_intermediate_size=16, num_experts=E,
    num_local_experts=E, n_routed_experts=E, expert_intermediate_size=16,
)  # fmt: skip

# what the custom gates and activations must map to (classes absent from this version: ignored)
EXPECTED = {
    "GptOssExperts": "swigluoai",
    "OpenAIPrivacyFilterExperts": "swigluoai_uninterleave",
    "MiniMaxM3VLExperts": "swigluoai_uninterleave",
    "NemotronHExperts": "relu2_no_mul",
    "Gemma4TextExperts": "gelu_tanh",
    "DeepseekV4Experts": "silu",
    "Glm5NextTextExperts": "silu",
    "HYV4Experts": "silu",
    "MixtralExperts": "silu",
}


def _is_experts_class(obj: object, module_name: str) -> bool:
    """Decorated by use_experts_implementation: its forward closes over the experts interface."""
    forward = getattr(obj, "forward", None)
    return (
        inspect.isclass(obj)
        and obj.__module__ == module_name
        and hasattr(forward, "__code__")
        and "experts_interface" in forward.__code__.co_freevars
    )


def experts_classes() -> list[tuple[str, type, list[type]]]:
    """(name, experts class, the config classes of its module) for every family that has one."""
    models = pathlib.Path(transformers.__file__).parent / "models"
    found = []
    for path in sorted(models.glob("*/modeling_*.py")):
        if "@use_experts_implementation" not in path.read_text():
            continue
        module_name = f"transformers.models.{path.parent.name}.{path.stem}"
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a family that needs an optional dependency
            continue
        configs = [
            c
            for c in vars(module).values()
            if inspect.isclass(c) and issubclass(c, transformers.PreTrainedConfig)
        ]
        for name, obj in vars(module).items():
            if _is_experts_class(obj, module_name):
                found.append((name, obj, configs))
    return found


CLASSES = experts_classes()


def build_experts(cls: type, configs: list[type]) -> torch.nn.Module:
    for config_cls in configs:
        try:
            config = config_cls()
            config = config.get_text_config()
            for key, value in TINY.items():
                with contextlib.suppress(AttributeError, TypeError, ValueError):
                    setattr(config, key, value)  # a field this config does not have
            config._experts_implementation = "fusedmoe"
            module = cls(config).float()
            break
        except Exception:
            continue
    else:
        pytest.skip(f"{cls.__name__}: no tiny config of its family builds it")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 1.5)
    return module


def inputs(num_experts: int):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=generator)  # [T, H]
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=generator)  # [T, k]
    return x, ids, weights


def test_every_family_is_found():
    names = {name for name, _, _ in CLASSES}
    assert {"MixtralExperts", "GptOssExperts", "DeepseekV3Experts"} <= names


@pytest.mark.parametrize("cls, configs", [c[1:] for c in CLASSES], ids=[c[0] for c in CLASSES])
def test_experts_class(cls, configs, monkeypatch):
    module = build_experts(cls, configs)
    x, ids, weights = inputs(module.num_experts)
    if x.shape[1] != getattr(module.config, "hidden_size", H):
        pytest.skip(f"{cls.__name__} does not take its hidden size from config.hidden_size")
    original = cls.forward.__wrapped__
    with torch.no_grad():
        try:
            expected = original(module, x, ids, weights)
        except Exception as exc:  # e.g. a norm sized by another config field
            pytest.skip(f"{cls.__name__}: its own forward fails on the tiny config: {exc}")

    try:
        layout = hf.experts_layout(module)
    except hf.NotRepresentable as why:
        with pytest.warns(UserWarning, match="runs its own forward"), torch.no_grad():
            actual = hf.fusedmoe_experts_forward(module, x, ids, weights)
        assert_equal(actual, expected, what=f"{cls.__name__} fallback ({why})")
        assert cls.__name__ not in EXPECTED
        return

    seen = []
    fused = hf.fused_experts
    monkeypatch.setattr(hf, "fused_experts", lambda *a, **k: seen.append(a[1:3]) or fused(*a, **k))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        actual = hf.fusedmoe_experts_forward(module, x, ids, weights)
    assert_close(actual, expected, torch.float32, what=cls.__name__)
    (w13, w2), first = seen[0], "gate_up_proj" if module.has_gate else "up_proj"
    assert w13.untyped_storage().data_ptr() == getattr(module, first).untyped_storage().data_ptr()
    assert w2.untyped_storage().data_ptr() == module.down_proj.untyped_storage().data_ptr()
    if cls.__name__ in EXPECTED:
        assert layout.activation.value == EXPECTED[cls.__name__]


def test_gpt_oss_parameters_reach_the_activation():
    [(cls, configs)] = [c[1:] for c in CLASSES if c[0] == "GptOssExperts"]
    module = build_experts(cls, configs)
    module.alpha, module.limit = 1.25, 0.5
    layout = hf.experts_layout(module)
    assert (layout.activation_params.alpha, layout.activation_params.limit) == (1.25, 0.5)
    x, ids, weights = inputs(module.num_experts)
    with torch.no_grad():
        expected = cls.forward.__wrapped__(module, x, ids, weights)
        actual = hf.fusedmoe_experts_forward(module, x, ids, weights)
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda m: setattr(m, "has_post_expert_norm", True), "normalises each expert's output"),
        (lambda m: setattr(m, "_is_expert_parallel", True), "expert parallelism"),
        (
            lambda m: setattr(
                m,
                "gate_up_proj",
                torch.nn.Parameter(m.gate_up_proj.to(torch.float8_e4m3fn), requires_grad=False),
            ),
            "quantized by transformers",
        ),
        (lambda m: setattr(m, "act_fn", torch.nn.Tanh()), "Tanh has no gated fusedmoe"),
    ],
    ids=["post_expert_norm", "expert_parallel", "fp8_weights", "tanh"],
)
def test_refusals_say_why(change, reason):
    [(cls, configs)] = [c[1:] for c in CLASSES if c[0] == "MixtralExperts"]
    module = build_experts(cls, configs)
    change(module)
    with pytest.raises(hf.NotRepresentable, match=reason):
        hf.experts_layout(module)
