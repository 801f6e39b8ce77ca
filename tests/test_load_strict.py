"""Strict loading: load_weights(strict=True) refuses a checkpoint that leaves expert tensors
unwritten, missing_weights() says which, and quantization refuses NaN / Inf weights.

Every checkpoint is fresh random tensors (tests/test_load_weights.py and test_quant_layer.py
build them). Legend: H hidden, I intermediate, E experts.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import FusedMoE, ParallelConfig
from fusedmoe.parallel.eplb import rebalance_layer
from fusedmoe.quant.config import quantize_experts
from tests.helpers import assert_equal
from tests.test_load_weights import GatedMLP, H, I, check_forward, checkpoint, per_expert_names
from tests.test_quant_layer import deepseek_checkpoint

E = 8


def _layer(num_experts=E, **kwargs) -> FusedMoE:
    return FusedMoE(num_experts, 2, H, I, params_dtype=torch.float32, **kwargs)


def _names(items, *roles):
    """The items of `per_expert_names` whose projection is one of `roles`."""
    return [(n, t) for n, t in items if any(f".{role}." in n for role in roles)]


def _expert(items, *experts):
    return [(n, t) for n, t in items if int(n.split("experts.")[1].split(".")[0]) in experts]


# ---- what is missing -------------------------------------------------------------------------
def test_a_fresh_layer_reports_everything_missing():
    assert _layer().missing_weights() == [
        "w13_weight of experts [0-7]",
        "w2_weight of experts [0-7]",
    ]
    assert _layer(has_bias=True).missing_weights() == [
        "w13_weight of experts [0-7]",
        "w2_weight of experts [0-7]",
        "w13_bias of experts [0-7]",
        "w2_bias of experts [0-7]",
    ]


def test_a_partial_checkpoint_raises_naming_what_is_missing():
    """One expert's gate_proj: the other experts would keep their random init."""
    ckpt = checkpoint(E)
    layer = _layer()
    gate0 = ckpt["gate"][0]
    with pytest.raises(ValueError) as info:
        layer.load_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", gate0)])
    message = str(info.value)
    assert (
        "w13_weight gate rows of experts [1-7], w13_weight up rows of experts [0-7], "
        "w2_weight of experts [0-7]"
    ) in message
    assert "half loaded" in message and "strict=False" in message
    assert_equal(layer.w13_weight[0, :I], gate0, what="the copy happened")  # half loaded


def test_scattered_missing_experts_are_listed_compactly():
    ckpt = checkpoint(E)
    layer = _layer()
    items = per_expert_names(ckpt, "mlp.")
    kept = [(n, t) for n, t in items if not any(f"experts.{e}.down" in n for e in (1, 2, 3, 6))]
    with pytest.raises(ValueError, match=r"unwritten: w2_weight of experts \[1-3, 6\]\. "):
        layer.load_weights(kept)
    assert layer.missing_weights() == ["w2_weight of experts [1-3, 6]"]


def test_a_complete_checkpoint_loads_in_one_call():
    ckpt = checkpoint(E, bias=True)
    layer = _layer(has_bias=True)
    layer.load_weights(per_expert_names(ckpt, "model.layers.2.mlp."))
    assert layer.missing_weights() == []
    check_forward(layer, ckpt)


def test_missing_biases_are_named():
    ckpt = checkpoint(E, bias=True)
    layer = _layer(has_bias=True)
    items = [(n, t) for n, t in per_expert_names(ckpt, "mlp.") if not n.endswith(".bias")]
    with pytest.raises(ValueError, match=r"unwritten: w13_bias of experts \[0-7\], w2_bias of"):
        layer.load_weights(items)
    up_bias_only = [(n, t) for n, t in per_expert_names(ckpt, "mlp.") if "up_proj.bias" in n]
    with pytest.raises(ValueError, match=r"w13_bias gate rows of experts \[0-7\], w2_bias"):
        layer.load_weights(up_bias_only)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_gate_and_up_rows_are_tracked_apart(activation):
    """Interleaved (swigluoai) or not, the gate and up rows of each expert are two parts."""
    ckpt = checkpoint(E)
    layer = _layer(activation=activation)
    items = per_expert_names(ckpt, "mlp.")
    with pytest.raises(ValueError, match=r"unwritten: w13_weight up rows of experts \[5\]\. "):
        layer.load_weights([(n, t) for n, t in items if "experts.5.up_proj" not in n])


def test_non_gated_w13_is_one_part():
    ckpt = checkpoint(E, gated=False)
    layer = _layer(activation="relu2_no_mul")
    items = per_expert_names(ckpt, "mlp.", (None, "up_proj", "down_proj"))
    with pytest.raises(ValueError, match=r"unwritten: w13_weight of experts \[0, 3\]\. "):
        layer.load_weights([(n, t) for n, t in items if not _is_up_of(n, 0, 3)])
    layer.load_weights(items)
    assert layer.missing_weights() == []
    check_forward(layer, ckpt, activation="relu2_no_mul")


def _is_up_of(name, *experts):
    return any(f"experts.{e}.up_proj" in name for e in experts)


def test_loads_that_name_no_expert_are_not_checked():
    """e_score_correction_bias and the shared experts are outside the record."""
    layer = _layer(e_score_correction_bias=torch.zeros(E), shared_experts=GatedMLP(H, 8))
    layer.load_weights([("mlp.gate.e_score_correction_bias", torch.randn(E))])
    layer.load_weights([("mlp.shared_experts.up_proj.weight", torch.randn(8, H))])
    assert layer.missing_weights() == ["w13_weight of experts [0-7]", "w2_weight of experts [0-7]"]


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="strict must be a bool, got str"):
        _layer().load_weights([], strict="no")


# ---- incremental loading -----------------------------------------------------------------------
def test_incremental_loading_to_completion():
    """One call per checkpoint file with strict=False; the last, strict, call sees them all."""
    ckpt = checkpoint(E, bias=True)
    layer = _layer(has_bias=True)
    items = per_expert_names(ckpt, "model.layers.7.mlp.")
    layer.load_weights(_names(items, "gate_proj"), strict=False)
    assert layer.missing_weights() == [
        "w13_weight up rows of experts [0-7]",
        "w2_weight of experts [0-7]",
        "w13_bias up rows of experts [0-7]",
        "w2_bias of experts [0-7]",
    ]
    layer.load_weights(_expert(_names(items, "up_proj"), *range(4)), strict=False)
    layer.load_weights(_names(items, "down_proj"), strict=False)
    assert layer.missing_weights() == [
        "w13_weight up rows of experts [4-7]",
        "w13_bias up rows of experts [4-7]",
    ]
    with pytest.raises(ValueError, match=r"w13_weight up rows of experts \[6-7\]"):
        layer.load_weights(_expert(_names(items, "up_proj"), 4, 5))  # strict: still short
    layer.load_weights(_expert(_names(items, "up_proj"), 6, 7))  # strict, and complete
    assert layer.missing_weights() == []
    check_forward(layer, ckpt)


def test_reset_parameters_forgets_the_loads():
    ckpt = checkpoint(E)
    layer = _layer()
    layer.load_weights(per_expert_names(ckpt, "mlp."))
    layer.reset_parameters()
    assert layer.missing_weights() == ["w13_weight of experts [0-7]", "w2_weight of experts [0-7]"]


# ---- expert parallelism ------------------------------------------------------------------------
@pytest.mark.parametrize(("placement", "redundant"), [("linear", 0), ("round_robin", 2)])
@pytest.mark.parametrize("ep_rank", [0, 1])
def test_ep_needs_only_its_local_experts(ep_rank, placement, redundant):
    ckpt = checkpoint(E)
    pc = ParallelConfig(
        ep_size=2, ep_rank=ep_rank, placement=placement, num_redundant_experts=redundant
    )
    layer = _layer(parallel_config=pc)
    local = sorted(set(layer.placement.local_logical(ep_rank)))
    others = [e for e in range(E) if e not in local]
    items = per_expert_names(ckpt, "mlp.")
    listed = (
        ", ".join(map(str, local))
        if placement == "round_robin"
        else "0-3"
        if ep_rank == 0
        else "4-7"
    )
    assert layer.missing_weights() == [
        f"w13_weight of experts [{listed}]",
        f"w2_weight of experts [{listed}]",
    ]
    # the other rank's experts only: this rank's are all missing
    with pytest.raises(ValueError, match=rf"of ep_rank {ep_rank} unwritten: w13_weight of experts"):
        layer.load_weights(_expert(items, *others))
    # its own experts only (replicas included): complete
    assert sorted(layer.load_weights(_expert(items, *local))) == sorted(
        n for n, _ in _expert(items, *local)
    )
    assert layer.missing_weights() == []


def test_ep_fused_names_write_every_local_slot():
    ckpt = checkpoint(E)
    gate_up = torch.stack(
        [torch.cat([g, u]) for g, u in zip(ckpt["gate"], ckpt["up"], strict=True)]
    )
    pc = ParallelConfig(ep_size=2, ep_rank=1, placement="round_robin", num_redundant_experts=2)
    layer = _layer(parallel_config=pc)
    with pytest.raises(ValueError, match=r"w2_weight of experts \[1, 3, 5, 7"):
        layer.load_weights([("experts.gate_up_proj", gate_up)])
    layer.load_weights([("experts.down_proj", torch.stack(ckpt["down"]))])
    assert layer.missing_weights() == []


def test_eplb_moves_keep_a_complete_record_complete():
    ckpt = checkpoint(E)
    layer = _layer(parallel_config=ParallelConfig(num_redundant_experts=3), backend="torch")
    layer.load_weights(per_expert_names(ckpt, "mlp."))
    with torch.no_grad():
        layer(torch.randn(17, H), torch.randn(17, E))
    placement = rebalance_layer(layer)
    assert layer.placement is placement and layer.local_num_experts == E + 3
    assert layer.missing_weights() == []


# ---- quantized layers --------------------------------------------------------------------------
QH, QI, QE = 256, 128, 4  # whole 128-blocks for fp8_block


def _quant_layer(scheme="fp8_block", **kwargs) -> FusedMoE:
    return FusedMoE(QE, 2, QH, QI, quant_config=scheme, **kwargs)


def test_deepseek_fp8_block_checkpoint_is_strict():
    prefix = "model.layers.3.mlp.experts"
    ckpt = deepseek_checkpoint(QE, QH, QI, prefix)
    layer = _quant_layer()
    assert layer.missing_weights() == [  # random init, quantized: nothing loaded
        "w13_weight of experts [0-3]",
        "w2_weight of experts [0-3]",
        "w13_weight_scale of experts [0-3]",
        "w2_weight_scale of experts [0-3]",
    ]
    partial = {
        k: v
        for k, v in ckpt.items()
        if k not in (f"{prefix}.2.down_proj.weight_scale_inv", f"{prefix}.1.up_proj.weight")
    }
    with pytest.raises(ValueError) as info:
        layer.load_weights(partial.items())
    assert "unwritten: w13_weight up rows of experts [1], w2_weight_scale of experts [2]. " in str(
        info.value
    )
    layer.load_weights(ckpt.items())
    assert layer.missing_weights() == []


def test_quantizing_loaded_float_weights_counts_as_loaded():
    ckpt = checkpoint(E)
    layer = _layer()
    layer.load_weights(per_expert_names(ckpt, "mlp."))
    layer.quantize_("fp8_channel")
    assert layer.missing_weights() == []
    # so one expert's quantized tensors replace that expert's alone, strictly
    q = torch.randn(I, H).to(torch.float8_e4m3fn)
    layer.load_weights([("mlp.experts.3.up_proj.weight", q)])
    assert_equal(layer.w13_weight[3, I:].view(torch.uint8), q.view(torch.uint8))


def test_quantize_carries_a_partial_record_over():
    """The weights keep their parts; a scale of a whole expert (fp8_tensor) is as loaded as
    its least loaded part."""
    ckpt = checkpoint(E)
    layer = _layer()
    items = per_expert_names(ckpt, "mlp.")
    layer.load_weights(_names(items, "gate_proj", "down_proj"), strict=False)
    layer.quantize_("fp8_tensor")
    assert layer.missing_weights() == [
        "w13_weight up rows of experts [0-7]",
        "w13_weight_scale of experts [0-7]",
    ]


def test_nvfp4_global_scales_are_tracked():
    layer = _quant_layer("nvfp4")
    assert "w13_weight_global_scale of experts [0-3]" in layer.missing_weights()
    with pytest.raises(ValueError, match="w2_weight_global_scale of experts"):
        layer.load_weights([("experts.gate_up_proj_global_scale", torch.rand(QE) + 0.5)])


# ---- NaN / Inf ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_experts_refuses_nonfinite_weights(bad):
    kind = "NaN" if bad != bad else "Inf"
    w13, w2 = torch.randn(QE, 2 * QI, QH), torch.randn(QE, QH, QI)
    w13[2, 5, 7] = bad
    w13[3, 0, 0] = bad
    with pytest.raises(ValueError, match=rf"^w13 holds {kind} \(first in expert 2\)"):
        quantize_experts(w13, w2, "fp8_block")
    w13[2, 5, 7] = w13[3, 0, 0] = 0.5
    w2[1, -1, -1] = bad
    with pytest.raises(ValueError, match=rf"^w2 holds {kind} \(first in expert 1\)"):
        quantize_experts(w13, w2, "mxfp4_w4a16")


def test_quantize_refuses_nonfinite_weights_and_changes_nothing():
    ckpt = checkpoint(E)
    ckpt["down"][3][2, 1] = float("nan")
    layer = _layer()
    layer.load_weights(per_expert_names(ckpt, "mlp."))
    with pytest.raises(ValueError, match=r"quantize_: w2_weight holds NaN \(first in expert 3\)"):
        layer.quantize_("fp8_block")
    assert layer.quant_scheme is None and layer.w2_weight.dtype == torch.float32
    ckpt["down"][3][2, 1] = 0.25
    ckpt["gate"][6][0, 0] = float("inf")
    layer.load_weights(per_expert_names(ckpt, "mlp."))
    with pytest.raises(ValueError, match=r"w13_weight holds Inf \(first in expert 6\)"):
        layer.quantize_("int8")


def test_quantize_names_the_global_expert_under_ep():
    ckpt = checkpoint(E)
    ckpt["up"][5][0, 0] = float("nan")
    layer = _layer(parallel_config=ParallelConfig(ep_size=2, ep_rank=1, placement="round_robin"))
    layer.load_weights(per_expert_names(ckpt, "mlp."))  # rank 1: experts 1, 3, 5, 7
    with pytest.raises(
        ValueError, match=r"w13_weight holds NaN \(first in expert 5 \(local slot 2\)\)"
    ):
        layer.quantize_("fp8_channel")
