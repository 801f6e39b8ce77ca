"""The oracle (backend selection) and the parallel configuration."""

from __future__ import annotations

import pytest
import torch

from fusedmoe import (
    FusedMoE,
    ParallelConfig,
    available_backends,
    fused_experts,
    get_compressed_expert_map,
    select_backend,
)
from fusedmoe.experts.torch_ref import TorchExperts

H, I, E = 32, 16, 8

PROBLEM = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("activation", ["silu", "swigluoai", "relu2_no_mul"])
def test_auto_picks_torch_on_cpu(activation, dtype):
    choice = select_backend(device="cpu", dtype=dtype, activation=activation, **PROBLEM)
    assert choice.name == "torch"
    assert choice.experts_cls is TorchExperts
    assert "cpu" in choice.reason
    assert choice.explain().startswith("torch: ")


def test_explicit_torch_backend():
    choice = select_backend(backend="torch", has_bias=True, has_expert_map=True, **PROBLEM)
    assert choice.name == "torch"
    assert choice.reason == "requested explicitly"


@pytest.mark.parametrize("name", ["triton-ish", "Torch", ""])
def test_unknown_backend_name(name):
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend(backend=name, **PROBLEM)


def test_backend_of_wrong_type():
    with pytest.raises(TypeError, match="backend must be"):
        select_backend(backend=3, **PROBLEM)


def test_missing_problem_fields():
    with pytest.raises(ValueError, match="intermediate_size"):
        select_backend(hidden_size=H, num_experts=E, top_k=2)


def test_available_backends_lists_torch():
    assert "torch" in available_backends()


class _SomeQuantConfig:
    def __repr__(self):
        return "SomeQuantConfig(fp8)"


@pytest.mark.parametrize("quant_config", [_SomeQuantConfig(), "fp8", {"weights": "fp8"}])
def test_a_quant_config_of_the_wrong_type_is_refused(quant_config):
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.randint(0, E, (3, 1), dtype=torch.int32)
    with pytest.raises(TypeError, match="quant_config must be a FusedMoEQuantConfig"):
        fused_experts(torch.randn(3, H), w13, w2, torch.rand(3, 1), ids, quant_config=quant_config)


@pytest.mark.parametrize(
    ("scheme", "error", "match"),
    [("fp8", ValueError, "unknown quantization scheme 'fp8'"), (3, TypeError, "scheme must be")],
)
def test_a_layer_refuses_an_unknown_scheme(scheme, error, match):
    with pytest.raises(error, match=match):
        FusedMoE(E, 2, H, I, quant_config=scheme)


# ---- parallel configuration -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expert_map", "expected"),
    [
        ([-1, -1, -1, -1, -1, 0, -1, -1, -1, -1, -1, -1, 1], "0->5, 1->12"),
        ([1, -1, 0, -1], "0->2, 1->0"),
        ([0, 1, 2], "0->0, 1->1, 2->2"),
        ([-1, -1], ""),
    ],
)
def test_compressed_expert_map(expert_map, expected):
    for dtype in (torch.int32, torch.int64):
        assert get_compressed_expert_map(torch.tensor(expert_map, dtype=dtype)) == expected


def test_compressed_expert_map_needs_an_int_vector():
    with pytest.raises(TypeError, match="expert_map"):
        get_compressed_expert_map(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="expert_map must have 1 dimensions"):
        get_compressed_expert_map(torch.zeros(2, 2, dtype=torch.int32))


def test_parallel_config_defaults():
    config = ParallelConfig()
    assert (config.ep_size, config.ep_rank, config.use_ep) == (1, 0, False)
    assert ParallelConfig(ep_size=4, ep_rank=3).use_ep


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ep_size": 0}, ValueError, "ep_size must be >= 1"),
        ({"ep_size": 2, "ep_rank": 2}, ValueError, r"ep_rank must be in \[0, 2\)"),
        ({"ep_rank": -1}, ValueError, "ep_rank"),
        ({"dp_size": 2, "dp_rank": 5}, ValueError, "dp_rank"),
        ({"tp_size": 0}, ValueError, "tp_size"),
        ({"ep_size": 2.0}, TypeError, "ep_size must be an int"),
        ({"ep_size": True}, TypeError, "ep_size must be an int"),
        ({"all2all_backend": "deepep"}, ValueError, "all2all_backend"),
    ],
)
def test_parallel_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        ParallelConfig(**kwargs)


def test_layer_expert_parallelism_backends():
    ep = ParallelConfig(ep_size=2, ep_rank=0)
    # modular backends run a shard through the expert_map (tests/test_ep.py checks the result)
    assert (
        FusedMoE(E, 2, H, I, parallel_config=ep, backend="torch").backend_choice().name == "torch"
    )
    assert FusedMoE(E, 2, H, I, parallel_config=ep).backend_choice().name == "monolithic"
    rr = ParallelConfig(ep_size=2, ep_rank=0, placement="round_robin")
    with pytest.raises(ValueError, match="'monolithic' cannot run this call: no expert_map"):
        FusedMoE(E, 2, H, I, parallel_config=rr, backend="monolithic")


def test_layer_parallel_config_type():
    with pytest.raises(TypeError, match="parallel_config must be a ParallelConfig"):
        FusedMoE(E, 2, H, I, parallel_config={"ep_size": 1})


def test_layer_backend_choice():
    layer = FusedMoE(E, 2, H, I, params_dtype=torch.float32)
    choice = layer.backend_choice()  # an inference call: the layer has the router logits
    assert choice.name == "monolithic" and choice.reason
    assert layer.backend_choice(requires_grad=True).name == "torch"
    with pytest.raises(ValueError, match="unknown backend"):
        FusedMoE(E, 2, H, I, backend="fastest")


class _Float32Only(TorchExperts):
    name = "torch_float32_only"

    @classmethod
    def supports_dtype(cls, dtype):
        return dtype == torch.float32


def test_set_backend():
    layer = FusedMoE(E, 2, H, I)  # bfloat16
    assert layer.backend_choice().reason != "requested explicitly"
    layer.set_backend("torch")
    assert layer.backend_choice().reason == "requested explicitly"
    assert "backend='torch'" in repr(layer)
    x, logits = torch.randn(3, H, dtype=torch.bfloat16), torch.randn(3, E)
    before = layer(x, logits)

    # a backend that cannot run the layer's dtype is refused, and changes nothing
    with pytest.raises(ValueError, match=r"no torch\.bfloat16 activations"):
        layer.set_backend(_Float32Only)
    with pytest.raises(ValueError, match="unknown backend"):
        layer.set_backend("fastest")
    assert layer.backend_choice().name == "torch"
    assert torch.equal(layer(x, logits), before)

    layer.to(torch.float32)
    layer.set_backend(_Float32Only)
    assert layer.backend_choice().name == "torch_float32_only"
    assert "torch_float32_only" in repr(layer)
