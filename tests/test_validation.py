"""Bad input: a ValueError or TypeError that names the problem, raised before any expert runs.

Every case runs on a backend that records its calls, and checks that it was never called.
Legend: M tokens, H hidden, I intermediate, E experts, k top-k.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import ActivationParams, FusedMoE, ParallelConfig, fused_experts
from fusedmoe.experts.torch_ref import TorchExperts

H, I, E, M = 32, 16, 8, 5


class Recorder(TorchExperts):
    name = "torch_recorder"
    calls = 0

    def apply(self, call):
        type(self).calls += 1
        super().apply(call)


@pytest.fixture(autouse=True)
def _reset_recorder():
    Recorder.calls = 0
    yield


def good_args() -> dict:
    return dict(
        hidden_states=torch.randn(M, H),
        w13=torch.randn(E, 2 * I, H),
        w2=torch.randn(E, H, I),
        topk_weights=torch.rand(M, 2),
        topk_ids=torch.randint(0, E, (M, 2), dtype=torch.int32),
    )


def call(**overrides):
    args = good_args()
    args.update(overrides)
    args.setdefault("backend", Recorder)
    return fused_experts(
        args.pop("hidden_states"),
        args.pop("w13"),
        args.pop("w2"),
        args.pop("topk_weights"),
        args.pop("topk_ids"),
        **args,
    )


def test_good_call_runs_the_backend():
    out = call()
    assert out.shape == (M, H)
    assert Recorder.calls == 1


META = torch.device("meta")

FUSED_EXPERTS_CASES = [
    # (id, overrides, error, match)
    (
        "x 3-D",
        {"hidden_states": torch.randn(1, M, H)},
        ValueError,
        r"hidden_states must have 2 dimensions, got shape \(1, 5, 32\)",
    ),
    (
        "x int",
        {"hidden_states": torch.ones(M, H, dtype=torch.int32)},
        TypeError,
        "hidden_states must have dtype",
    ),
    (
        "x list",
        {"hidden_states": [[0.0] * H] * M},
        TypeError,
        "hidden_states must be a torch.Tensor",
    ),
    ("w13 2-D", {"w13": torch.randn(2 * I, H)}, ValueError, "w13 must have 3 dimensions"),
    (
        "w13 wrong H",
        {"w13": torch.randn(E, 2 * I, H + 1)},
        ValueError,
        r"w13 must be \[E, N, H=32\]",
    ),
    (
        "w2 wrong E",
        {"w2": torch.randn(E - 1, H, I)},
        ValueError,
        r"w2 must have shape \(8, 32, 16\)",
    ),
    ("w2 wrong H", {"w2": torch.randn(E, H - 1, I)}, ValueError, "w2 must have shape"),
    (
        "gated needs 2I",
        {"w13": torch.randn(E, I, H)},
        ValueError,
        r"w13 must have 32 rows per expert for the gated \(2 \* I\) activation 'silu'",
    ),
    (
        "non-gated needs I",
        {"activation": "relu2_no_mul"},
        ValueError,
        r"w13 must have 16 rows per expert for the non-gated \(I\) activation 'relu2_no_mul'",
    ),
    (
        "w13 dtype",
        {"w13": torch.randn(E, 2 * I, H, dtype=torch.bfloat16)},
        TypeError,
        "w13 has dtype torch.bfloat16 but hidden_states has torch.float32",
    ),
    (
        "w2 dtype",
        {"w2": torch.randn(E, H, I, dtype=torch.float16)},
        TypeError,
        "w2 has dtype torch.float16",
    ),
    (
        "w13 device",
        {"w13": torch.empty(E, 2 * I, H, device=META)},
        ValueError,
        "w13 is on meta, expected cpu",
    ),
    (
        "ids device",
        {"topk_ids": torch.empty(M, 2, dtype=torch.int32, device=META)},
        ValueError,
        "topk_ids is on meta",
    ),
    (
        "weights device",
        {"topk_weights": torch.empty(M, 2, device=META)},
        ValueError,
        "topk_weights is on meta",
    ),
    (
        "w13_bias shape",
        {"w13_bias": torch.randn(E, I)},
        ValueError,
        r"w13_bias must have shape \(8, 32\), got \(8, 16\)",
    ),
    (
        "w13_bias rank",
        {"w13_bias": torch.randn(2 * I)},
        ValueError,
        "w13_bias must have 2 dimensions",
    ),
    (
        "w2_bias shape",
        {"w2_bias": torch.randn(E, I)},
        ValueError,
        r"w2_bias must have shape \(8, 32\)",
    ),
    (
        "w2_bias int",
        {"w2_bias": torch.ones(E, H, dtype=torch.int64)},
        TypeError,
        "w2_bias must have dtype",
    ),
    (
        "weights/ids shapes",
        {"topk_weights": torch.rand(M, 3)},
        ValueError,
        r"topk_weights \(5, 3\) and topk_ids \(5, 2\) must have the same shape",
    ),
    (
        "ids tokens",
        {
            "topk_ids": torch.zeros(M + 1, 2, dtype=torch.int32),
            "topk_weights": torch.rand(M + 1, 2),
        },
        ValueError,
        "topk_ids has 6 tokens",
    ),
    (
        "ids 1-D",
        {"topk_ids": torch.zeros(M, dtype=torch.int32)},
        ValueError,
        "topk_ids must have 2 dimensions",
    ),
    ("ids float", {"topk_ids": torch.zeros(M, 2)}, TypeError, "topk_ids must have dtype"),
    (
        "weights int",
        {"topk_weights": torch.ones(M, 2, dtype=torch.int32)},
        TypeError,
        "topk_weights must have dtype",
    ),
    (
        "ids too large",
        {"topk_ids": torch.tensor([[0, E]] * M, dtype=torch.int32)},
        ValueError,
        r"topk_ids must lie in \[-1, 8\), got values in \[0, 8\]",
    ),
    (
        "ids below -1",
        {"topk_ids": torch.tensor([[0, -2]] * M, dtype=torch.int32)},
        ValueError,
        r"topk_ids must lie in \[-1, 8\)",
    ),
    (
        "k = 0",
        {"topk_ids": torch.zeros(M, 0, dtype=torch.int32), "topk_weights": torch.rand(M, 0)},
        ValueError,
        "top_k must be >= 1",
    ),
    ("global without map", {"global_num_experts": 16}, ValueError, "pass the expert_map"),
    (
        "map length",
        {"expert_map": torch.arange(E, dtype=torch.int32), "global_num_experts": 16},
        ValueError,
        r"expert_map must be \[global_num_experts=16\]",
    ),
    (
        "map entry",
        {"expert_map": torch.tensor([0, 1, 2, 3, 4, 5, 6, 8], dtype=torch.int32)},
        ValueError,
        r"expert_map must lie in \[-1, 8\)",
    ),
    ("map float", {"expert_map": torch.zeros(E)}, TypeError, "expert_map must have dtype"),
    (
        "ids beyond map",
        {
            "expert_map": torch.arange(4, dtype=torch.int32),
            "w13": torch.randn(4, 2 * I, H),
            "w2": torch.randn(4, H, I),
        },
        ValueError,
        r"topk_ids must lie in \[-1, 4\)",
    ),
    ("activation name", {"activation": "swish"}, ValueError, "unknown activation 'swish'"),
    (
        "activation params type",
        {"activation_params": {"limit": 7.0}},
        TypeError,
        "activation_params must be an ActivationParams",
    ),
    (
        "activation params refused",
        {"activation": "gelu", "activation_params": ActivationParams(limit=7.0)},
        ValueError,
        "activation 'gelu' takes no limit",
    ),
    ("backend name", {"backend": "fastest"}, ValueError, "unknown backend 'fastest'"),
    ("weight on input k=2", {"apply_router_weight_on_input": True}, ValueError, "top_k == 1"),
]


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [case[1:] for case in FUSED_EXPERTS_CASES],
    ids=[case[0] for case in FUSED_EXPERTS_CASES],
)
def test_fused_experts_bad_input(overrides, error, match):
    with pytest.raises(error, match=match):
        call(**overrides)
    assert Recorder.calls == 0


# ---- FusedMoE construction -----------------------------------------------------------------


CONSTRUCTOR_CASES = [
    ("num_experts 0", {"num_experts": 0}, ValueError, "num_experts must be >= 1"),
    ("top_k 0", {"top_k": 0}, ValueError, "top_k must be >= 1"),
    ("top_k > E", {"top_k": E + 1}, ValueError, r"top_k \(9\) must be <= the number of experts"),
    ("hidden str", {"hidden_size": "32"}, TypeError, "hidden_size must be an int"),
    ("intermediate float", {"intermediate_size": 16.0}, TypeError, "intermediate_size must be"),
    ("params_dtype", {"params_dtype": torch.int32}, TypeError, "params_dtype must be a float"),
    ("activation", {"activation": "swish"}, ValueError, "unknown activation"),
    (
        "params refused",
        {"activation": "relu2_no_mul", "activation_params": ActivationParams(limit=1.0)},
        ValueError,
        "takes no limit",
    ),
    (
        "gate without shared",
        {"shared_expert_gate": torch.nn.Linear(H, 1)},
        ValueError,
        "shared_expert_gate needs shared_experts",
    ),
    (
        "bias shape",
        {"e_score_correction_bias": torch.zeros(E + 1)},
        ValueError,
        r"e_score_correction_bias must have shape \(8,\)",
    ),
    ("backend", {"backend": "fastest"}, ValueError, "unknown backend"),
    ("backend type", {"backend": 3}, TypeError, "backend must be"),
    # the monolithic backend dispatches by all-gather only
    (
        "ep",
        {
            "parallel_config": ParallelConfig(ep_size=2, dp_size=2, all2all_backend="all_to_all"),
            "backend": "monolithic",
        },
        ValueError,
        "routes inside and dispatches by all-gather only: no 'all_to_all' dispatch",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [case[1:] for case in CONSTRUCTOR_CASES],
    ids=[case[0] for case in CONSTRUCTOR_CASES],
)
def test_layer_bad_construction(overrides, error, match):
    args = {"num_experts": E, "top_k": 2, "hidden_size": H, "intermediate_size": I}
    args.update(overrides)
    with pytest.raises(error, match=match):
        FusedMoE(
            args.pop("num_experts"),
            args.pop("top_k"),
            args.pop("hidden_size"),
            args.pop("intermediate_size"),
            **args,
        )


# ---- FusedMoE forward ------------------------------------------------------------------------


def _layer(**kwargs) -> FusedMoE:
    kwargs.setdefault("params_dtype", torch.float32)
    return FusedMoE(E, 2, H, I, backend=Recorder, **kwargs)


FORWARD_CASES = [
    (
        "logits experts",
        torch.randn(M, H),
        torch.randn(M, E + 1),
        ValueError,
        r"router_logits must have 8 columns \(one per expert\), got shape \(5, 9\)",
    ),
    (
        "lead dims",
        torch.randn(M, H),
        torch.randn(M + 1, E),
        ValueError,
        "must share their leading dimensions",
    ),
    (
        "lead dims 3-D",
        torch.randn(2, 3, H),
        torch.randn(3, 2, E),
        ValueError,
        "must share their leading dimensions",
    ),
    (
        "hidden size",
        torch.randn(M, H + 1),
        torch.randn(M, E),
        ValueError,
        r"hidden_states must be \[\.\.\., 32\], got \(5, 33\)",
    ),
    (
        "x dtype",
        torch.randn(M, H, dtype=torch.bfloat16),
        torch.randn(M, E),
        TypeError,
        "hidden_states has dtype torch.bfloat16 but the layer computes in torch.float32",
    ),
    (
        "x int",
        torch.ones(M, H, dtype=torch.int64),
        torch.randn(M, E),
        TypeError,
        "hidden_states must have dtype",
    ),
    (
        "logits int",
        torch.randn(M, H),
        torch.ones(M, E, dtype=torch.int64),
        TypeError,
        "router_logits must have dtype",
    ),
    (
        "logits device",
        torch.randn(M, H),
        torch.empty(M, E, device=META),
        ValueError,
        "router_logits is on meta",
    ),
    ("x scalar", torch.tensor(1.0), torch.randn(E), ValueError, "leading dimensions"),
]


@pytest.mark.parametrize(
    ("x", "logits", "error", "match"),
    [case[1:] for case in FORWARD_CASES],
    ids=[case[0] for case in FORWARD_CASES],
)
def test_layer_bad_forward(x, logits, error, match):
    layer = _layer()
    with pytest.raises(error, match=match):
        layer(x, logits)
    assert Recorder.calls == 0


def test_layer_x_on_another_device_than_the_layer():
    layer = _layer()
    with pytest.raises(ValueError, match="hidden_states is on meta, the layer on cpu"):
        layer(torch.empty(M, H, device=META), torch.empty(M, E, device=META))


def test_layer_bfloat16_layer_refuses_float32_input():
    layer = _layer(params_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"cast the input or the layer"):
        layer(torch.randn(M, H), torch.randn(M, E))
    assert Recorder.calls == 0


def _hash_layer():
    table = torch.stack([torch.randperm(E)[:2] for _ in range(10)])
    return _layer(hash_indices_table=table)


@pytest.mark.parametrize(
    ("input_ids", "error", "match"),
    [
        (None, ValueError, "needs input_ids"),
        (torch.zeros(M + 1, dtype=torch.int64), ValueError, r"input_ids must have shape \(5,\)"),
        (torch.zeros(M), TypeError, "input_ids must have dtype"),
        (torch.full((M,), 10), ValueError, r"input_ids must lie in \[0, 10\)"),
        (torch.full((M,), -1), ValueError, r"input_ids must lie in \[0, 10\)"),
    ],
)
def test_layer_bad_input_ids(input_ids, error, match):
    layer = _hash_layer()
    with pytest.raises(error, match=match):
        layer(torch.randn(M, H), torch.randn(M, E), input_ids=input_ids)
    assert Recorder.calls == 0
