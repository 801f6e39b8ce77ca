"""Hugging Face transformers (>= 5) integration: fusedmoe computes a model's MoE layers.

Two ways in, both on the model's own weights.

1. An experts implementation. Importing this module registers "fusedmoe" in transformers'
   experts-implementation registry:

       import fusedmoe.integrations.transformers
       model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="fusedmoe")
       model.set_experts_implementation("fusedmoe")              # or switch a loaded model

   Every `@use_experts_implementation` experts module then computes, from the routing the
   model made,
       fused_experts(x, w13, w2, top_k_weights, top_k_index, activation=..., w13_bias, w2_bias)
   with w13 / w2 views of its own parameters (see `experts_layout`). A module whose function
   fusedmoe cannot represent runs its original forward instead, with a warning saying why.

2. `patch(model, backend="auto", quant=None)` replaces whole sparse MoE blocks (router,
   experts, shared experts) by FusedMoE layers that compute the same function, and reports the
   blocks it replaced and why it left the others (`PatchReport`). `BLOCK_ADAPTERS` lists the
   block classes it knows, each with what its router computes.

Legend: T tokens, H hidden, I intermediate, E experts, k top-k, N = 2I (gated) or I.

transformers 5 experts layouts, and what fusedmoe reads:
    gate_up_proj [E, 2I, H], gate rows then up rows   -> w13, as it is
    down_proj    [E, H, I]                            -> w2, as it is
    is_transposed (gpt-oss): [E, H, 2I] / [E, I, H]   -> w13 / w2 = .transpose(1, 2) views
    has_gate=False: up_proj [E, I, H]                 -> w13 of a non-gated activation
    gpt-oss: gate / up columns interleaved, clamped   -> activation "swigluoai", which reads
             SwiGLU with alpha and limit                 w13's rows interleaved: the view is
                                                         already its layout
    gate_up_proj_bias [E, 2I], down_proj_bias [E, H]  -> w13_bias / w2_bias

In place, never copied: the views are taken from the module's attributes on every call (a
transpose only changes strides), so they follow in-place updates, a replaced Parameter or a
.to(), cost no memory, and carry gradients back to the parameters. A cached contiguous copy
would double the experts' memory and go stale; the price of views is that a backend reads
gpt-oss's transposed weights with strides. The module's settings (has_gate, is_transposed,
has_bias, its activation) are read at its first call.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fusedmoe._checks import FLOAT_DTYPES
from fusedmoe.activation import ActivationParams, MoEActivation
from fusedmoe.functional import fused_experts
from fusedmoe.layer import FusedMoE, RouterGate
from fusedmoe.modular.graphs import plain_call
from fusedmoe.oracle import get_backend
from fusedmoe.quant import SCHEMES

try:
    from transformers import activations as _hf_act
    from transformers.integrations import moe as _hf_moe

    _hf_moe.ExpertsInterface  # noqa: B018  (transformers 4 has no experts interface)
except (ImportError, AttributeError) as exc:
    raise ImportError(
        "fusedmoe.integrations.transformers needs transformers >= 5 (its experts interface): "
        "pip install 'fusedmoe[hf]'"
    ) from exc

__all__ = [
    "BLOCK_ADAPTERS",
    "IMPLEMENTATION_NAME",
    "BlockSpec",
    "ExpertsLayout",
    "FusedMoEBlock",
    "NotRepresentable",
    "PatchReport",
    "experts_layout",
    "fusedmoe_experts_forward",
    "patch",
    "register",
]

#: the name of the experts implementation this module registers
IMPLEMENTATION_NAME = "fusedmoe"


class NotRepresentable(Exception):
    """A transformers module computes a function fusedmoe cannot represent; str() says why."""


# ---- activations -----------------------------------------------------------------------------
def _classes(*names: str) -> tuple[type, ...]:
    return tuple(getattr(_hf_act, n) for n in names if hasattr(_hf_act, n))


# transformers activation modules (and functions) -> the function they compute exactly
_SILU = (*_classes("SiLUActivation"), nn.SiLU)
_GELU_ERF = _classes("GELUActivation")  # F.gelu, or its erf formula in Python
_GELU_TANH = _classes("GELUTanh", "NewGELUActivation", "FastGELUActivation")  # tanh formula
_RELU2 = _classes("ReLUSquaredActivation")

_GATED = {"silu": MoEActivation.SILU, "gelu": MoEActivation.GELU,
          "gelu_tanh": MoEActivation.GELU_TANH}  # fmt: skip
_NON_GATED = {"silu": MoEActivation.SILU_NO_MUL, "gelu": MoEActivation.GELU_NO_MUL,
              "relu2": MoEActivation.RELU2_NO_MUL}  # fmt: skip


def _act_fn_name(act_fn: object) -> str | None:
    if isinstance(act_fn, nn.GELU):
        return "gelu" if act_fn.approximate == "none" else "gelu_tanh"
    kind = type(act_fn)
    if kind in _SILU or act_fn is F.silu:
        return "silu"
    if kind in _GELU_ERF or act_fn is F.gelu:
        return "gelu"
    if kind in _GELU_TANH:
        return "gelu_tanh"
    if kind in _RELU2:
        return "relu2"
    return None


def _act_fn_activation(module: nn.Module, gated: bool) -> MoEActivation:
    """The fusedmoe activation of `act_fn(gate) * up` (gated) or `act_fn(h)`."""
    act_fn = getattr(module, "act_fn", None)
    table = _GATED if gated else _NON_GATED
    activation = table.get(_act_fn_name(act_fn))
    if activation is None:
        what = type(act_fn).__name__ if isinstance(act_fn, nn.Module) else repr(act_fn)
        raise NotRepresentable(
            f"its activation {what} has no {'gated' if gated else 'non-gated'} fusedmoe "
            f"equivalent (fusedmoe has {sorted(table)})"
        )
    return activation


def _params(**values: float) -> ActivationParams:
    try:
        return ActivationParams(**{k: float(v) for k, v in values.items()})
    except ValueError as exc:
        raise NotRepresentable(f"activation parameters {values}: {exc}") from exc


def _clamped_silu(limit: float) -> tuple[MoEActivation, ActivationParams | None]:
    """silu(min(g, L)) * clamp(u, -L, L); no clamp when L is +inf."""
    if math.isinf(limit) and limit > 0:
        return MoEActivation.SILU, None
    return MoEActivation.SILU, _params(limit=limit)


def _silu_act_fn_clamped(module: nn.Module):
    """act_fn(min(g, L)) * clamp(u, -L, L) with act_fn silu."""
    if _act_fn_activation(module, gated=True) is not MoEActivation.SILU:
        raise NotRepresentable("its clamped gate activation is not SiLU")
    return _clamped_silu(module.limit)


# Experts classes that override `_apply_gate` (the default is act_fn(gate) * up on halves),
# keyed by the class that defines it: what fusedmoe activation computes the same.
_CUSTOM_GATES: dict[str, Callable[[nn.Module], tuple[MoEActivation, ActivationParams | None]]] = {
    # interleaved (u + 1) * g * sigmoid(alpha * g), g <= limit, |u| <= limit
    "GptOssExperts": lambda m: (
        MoEActivation.SWIGLUOAI, _params(alpha=m.alpha, limit=m.limit)
    ),
    # the same on halves
    "OpenAIPrivacyFilterExperts": lambda m: (
        MoEActivation.SWIGLUOAI_UNINTERLEAVE, _params(alpha=m.alpha, beta=1.0, limit=m.limit)
    ),
    "MiniMaxM3VLExperts": lambda m: (
        MoEActivation.SWIGLUOAI_UNINTERLEAVE,
        _params(alpha=m.swiglu_alpha, beta=1.0, limit=m.swiglu_limit),
    ),
    # act_fn(g) * u computed in float32: fusedmoe computes every activation in float32
    "BeamExperts": lambda m: (_act_fn_activation(m, gated=True), None),
    # silu(min(g, L)) * clamp(u, -L, L)
    "DeepseekV4Experts": _silu_act_fn_clamped,
    "Glm5NextTextExperts": lambda m: _clamped_silu(m.swiglu_limit),
    "HYV4Experts": lambda m: _clamped_silu(m.swiglu_limit),
}  # fmt: skip


def _activation(module: nn.Module, gated: bool) -> tuple[MoEActivation, ActivationParams | None]:
    if not gated:
        return _act_fn_activation(module, gated=False), None
    apply_gate = getattr(type(module), "_apply_gate", None)
    default = getattr(_hf_moe, "_default_apply_gate", None)
    if apply_gate is None or apply_gate is default:
        return _act_fn_activation(module, gated=True), None
    owner = apply_gate.__qualname__.rsplit(".", 1)[0]
    rule = _CUSTOM_GATES.get(owner)
    if rule is None or not apply_gate.__module__.startswith("transformers."):
        raise NotRepresentable(
            f"its gate {owner}._apply_gate is not one fusedmoe knows an activation for"
        )
    return rule(module)


# ---- the experts implementation ----------------------------------------------------------------
@dataclass(frozen=True)
class ExpertsLayout:
    """A transformers experts module's tensors as fusedmoe reads them: views, never copies."""

    w13: torch.Tensor  # [E, N, H]: gate rows then up rows (interleaved for swigluoai)
    w2: torch.Tensor  # [E, H, I]
    w13_bias: torch.Tensor | None  # [E, N]
    w2_bias: torch.Tensor | None  # [E, H]
    activation: MoEActivation
    activation_params: ActivationParams | None


def _tensor(module: nn.Module, name: str, ndim: int) -> torch.Tensor:
    t = getattr(module, name, None)
    if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.dtype not in FLOAT_DTYPES:
        what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise NotRepresentable(
            f"its {name} is {what}, not a float tensor of {ndim} dimensions "
            "(quantized by transformers, or missing)"
        )
    return t


@dataclass(frozen=True)
class _ExpertsSettings:
    """What experts_layout reads from an experts module besides its tensors: the attributes
    transformers sets at construction."""

    w13_name: str  # "gate_up_proj" (gated) or "up_proj"
    transposed: bool  # is_transposed: [E, H, N] / [E, I, H] stored
    w13_bias_name: str | None  # the bias attributes where has_bias, else None
    w2_bias_name: str | None
    activation: MoEActivation
    activation_params: ActivationParams | None


def _experts_settings(module: nn.Module) -> _ExpertsSettings:
    if getattr(module, "has_post_expert_norm", False):
        raise NotRepresentable("it normalises each expert's output (has_post_expert_norm)")
    if getattr(module, "_is_expert_parallel", False):
        raise NotRepresentable("it is sharded for expert parallelism by transformers")
    gated = getattr(module, "has_gate", True)
    activation, params = _activation(module, gated)
    has_bias = getattr(module, "has_bias", False)
    return _ExpertsSettings(
        w13_name="gate_up_proj" if gated else "up_proj",
        transposed=bool(getattr(module, "is_transposed", False)),
        w13_bias_name=("gate_up_proj_bias" if gated else "up_proj_bias") if has_bias else None,
        w2_bias_name="down_proj_bias" if has_bias else None,
        activation=activation,
        activation_params=params,
    )


def _read_layout(module: nn.Module, settings: _ExpertsSettings) -> ExpertsLayout:
    """The module's tensors, as `settings` says to read them, checked."""
    activation = settings.activation
    w13 = _tensor(module, settings.w13_name, 3)
    w2 = _tensor(module, "down_proj", 3)
    if settings.transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, H, N] -> [E, N, H]; [E, I, H]
    num_experts, num_n, hidden = w13.shape
    if (
        w2.shape[:2] != (num_experts, hidden)
        or activation.gemm1_out_size(w2.shape[2]) != num_n
        or w2.dtype != w13.dtype
        or w2.device != w13.device
    ):
        raise NotRepresentable(
            f"its weights {tuple(w13.shape)} / {tuple(w2.shape)} ({w13.dtype} / {w2.dtype}) "
            f"are not w13 [E, N, H] and w2 [E, H, I] of one dtype for {activation.value}"
        )
    w13_bias = w2_bias = None
    if (
        settings.w13_bias_name is not None
        and getattr(module, settings.w13_bias_name, None) is not None
    ):
        w13_bias = _tensor(module, settings.w13_bias_name, 2)
    if (
        settings.w2_bias_name is not None
        and getattr(module, settings.w2_bias_name, None) is not None
    ):
        w2_bias = _tensor(module, settings.w2_bias_name, 2)
    return ExpertsLayout(w13, w2, w13_bias, w2_bias, activation, settings.activation_params)


def experts_layout(module: nn.Module) -> ExpertsLayout:
    """The fusedmoe view of a transformers `@use_experts_implementation` experts module.

    Raises NotRepresentable (saying why) for a module fusedmoe cannot compute.
    """
    return _read_layout(module, _experts_settings(module))


#: experts module -> (the ids of its submodules, its settings), for _layout_of
_SETTINGS: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _layout_of(module: nn.Module) -> ExpertsLayout:
    """experts_layout(module), its settings (the attribute walk, the activation) read at the
    first call and again when a submodule (its activation) is replaced; what transformers sets
    at construction (has_gate, is_transposed, has_bias, an activation's limits) is not read
    again. The tensors are read and checked on every call: views taken now, in this call's
    grad mode, of the parameters as they are now (a new Parameter, .to(), a load)."""
    if torch.compiler.is_compiling():  # traced once into the graph: nothing to look up
        return experts_layout(module)
    submodules = tuple(id(m) for m in module._modules.values())
    cached = _SETTINGS.get(module)
    if cached is None or cached[0] != submodules:
        cached = _SETTINGS[module] = (submodules, _experts_settings(module))
    return _read_layout(module, cached[1])


def _original_forward(module: nn.Module) -> Callable:
    """The experts class's own forward, under transformers' dispatching wrapper."""
    forward = getattr(type(module).forward, "__wrapped__", None)
    if forward is None:
        raise RuntimeError(
            f"{type(module).__name__} has no original forward to fall back to: it is not a "
            "@use_experts_implementation experts class"
        )
    return forward


def _fall_back(module: nn.Module, why: NotRepresentable) -> Callable:
    # Once per module; Python's warning filter then shows a repeated message once.
    if getattr(module, "_fusedmoe_fallback", None) != str(why):
        module._fusedmoe_fallback = str(why)
        warnings.warn(
            f"fusedmoe: {type(module).__name__} runs its own forward, not fusedmoe: {why}",
            UserWarning,
            stacklevel=4,
        )
    return _original_forward(module)


def fusedmoe_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The "fusedmoe" experts implementation: x [T, H], ids [T, k], weights [T, k] -> [T, H].

        out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(x[t])

    on views of the module's parameters; a module fusedmoe cannot represent (its activation,
    a per-expert norm, quantized weights, an input dtype other than its weights') runs its own
    forward.
    """
    try:
        layout = _layout_of(self)
        if hidden_states.dtype != layout.w13.dtype:
            raise NotRepresentable(
                f"hidden_states are {hidden_states.dtype}, its weights {layout.w13.dtype}"
            )
    except NotRepresentable as why:
        return _fall_back(self, why)(self, hidden_states, top_k_index, top_k_weights)
    return fused_experts(
        hidden_states,
        layout.w13,
        layout.w2,
        top_k_weights,
        top_k_index,
        activation=layout.activation,
        activation_params=layout.activation_params,
        w13_bias=layout.w13_bias,
        w2_bias=layout.w2_bias,
    )


def register() -> None:
    """Register "fusedmoe" in transformers' experts-implementation registry (idempotent)."""
    _hf_moe.ExpertsInterface.register(IMPLEMENTATION_NAME, fusedmoe_experts_forward)


# ---- patch: whole blocks -----------------------------------------------------------------------
def _linear_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, router.weight)


def _linear_logits_in_weight_dtype(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(router.weight.dtype), router.weight)


def _biased_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, router.weight, router.bias)


def _float32_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), router.weight.float())


def _hunyuan_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    wg = router.wg  # an nn.Linear kept in float32 by default; the input follows it then
    return wg(x.float() if wg.weight.dtype == torch.float32 else x)


@dataclass(frozen=True)
class BlockSpec:
    """What a transformers sparse MoE block computes, in FusedMoE's terms."""

    experts: nn.Module  # the block's experts module (read through experts_layout)
    router_attr: str  # the block's router module: "gate" or "router"
    #: (router, x [T, H]) -> router logits [T, E], exactly as the router computes them
    router_logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    top_k: int
    renormalize: bool  # the chosen weights are divided by their sum
    scoring_func: str = "softmax"  # or "sigmoid"
    num_expert_group: int | None = None  # grouped top-k (DeepSeek) when set
    topk_group: int | None = None
    e_score_correction_bias: torch.Tensor | None = None  # [E], changes the choice only
    routed_scaling_factor: float = 1.0  # multiplies the routed weights
    router_takes_bias: bool = False  # router.forward(x, e_score_correction_bias) (MiniMax-M2)
    shared_experts: nn.Module | None = None  # its output is added for every token
    shared_expert_gate: nn.Module | None = None  # scales it by sigmoid(gate(x)) (Qwen2-MoE)
    returns_router_scores: bool = False  # forward returns (hidden, top-k weights) (gpt-oss)
    jitter_noise: float = 0.0  # random input jitter in training mode: refused there


# One adapter per routing; each names the block classes it reads and what they compute.
def _softmax_topk_renormalized(block: nn.Module) -> BlockSpec:
    """Mixtral, MiniMax: softmax, top-k, renormalized; input jitter in training."""
    return BlockSpec(
        block.experts, "gate", _linear_logits, block.gate.top_k, renormalize=True,
        jitter_noise=float(block.jitter_noise),
    )  # fmt: skip


def _softmax_topk_norm_prob(block: nn.Module) -> BlockSpec:
    """Qwen3-MoE, OLMoE, FlexOlmo: softmax, top-k, renormalized when norm_topk_prob."""
    return BlockSpec(
        block.experts, "gate", _linear_logits, block.gate.top_k,
        renormalize=bool(block.gate.norm_topk_prob),
    )  # fmt: skip


def _qwen_shared(renormalize: bool | None) -> Callable[[nn.Module], BlockSpec]:
    """Qwen2-MoE, Qwen3-Next (norm_topk_prob), Qwen3.5-MoE (always renormalized): softmax top-k,
    plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def adapter(block: nn.Module) -> BlockSpec:
        norm = block.gate.norm_topk_prob if renormalize is None else renormalize
        return BlockSpec(
            block.experts, "gate", _linear_logits, block.gate.top_k, renormalize=bool(norm),
            shared_experts=block.shared_expert, shared_expert_gate=block.shared_expert_gate,
        )  # fmt: skip

    return adapter


def _softmax_topk_unnormalized(block: nn.Module) -> BlockSpec:
    """Jamba: softmax, top-k, not renormalized."""
    return BlockSpec(block.experts, "router", _linear_logits, block.router.top_k, renormalize=False)


def _topk_logits_softmax(block: nn.Module) -> BlockSpec:
    """Granite-MoE: top-k of the logits, softmax over those k (= softmax, top-k, renormalized)."""
    return BlockSpec(block.experts, "router", _linear_logits, block.router.top_k, renormalize=True)


def _gpt_oss(block: nn.Module) -> BlockSpec:
    """gpt-oss: logits with a bias, top-k of them, softmax over those k; returns the k weights."""
    return BlockSpec(
        block.experts, "router", _biased_logits, block.router.top_k, renormalize=True,
        returns_router_scores=True,
    )  # fmt: skip


def _deepseek_v2(block: nn.Module) -> BlockSpec:
    """DeepSeek-V2: float32 softmax, greedy or group-limited (max per group) top-k, never
    renormalized, times routed_scaling_factor; shared experts."""
    gate = block.gate
    grouped = {}
    if gate.topk_method == "group_limited_greedy":
        grouped = dict(num_expert_group=gate.num_group, topk_group=gate.topk_group)
    elif gate.topk_method != "greedy":
        raise NotRepresentable(f"its topk_method {gate.topk_method!r} is not a fusedmoe router")
    return BlockSpec(
        block.experts, "gate", _float32_logits, gate.top_k, renormalize=False,
        routed_scaling_factor=float(gate.routed_scaling_factor),
        shared_experts=block.shared_experts, **grouped,
    )  # fmt: skip


def _deepseek_v3(block: nn.Module) -> BlockSpec:
    """DeepSeek-V3, GLM-4-MoE, dots.llm1, EXAONE-MoE, Solar-Open: float32 sigmoid scores; groups
    ranked by the sum of their top-2 (scores + e_score_correction_bias); top-k of that within
    the kept groups; renormalized when norm_topk_prob (its + 1e-20 is below float32 resolution
    for any sum > 1e-13); times routed_scaling_factor; shared experts."""
    gate = block.gate
    if gate.num_experts // gate.num_group < 2:
        raise NotRepresentable("its groups have one expert (the router sums a top-2 per group)")
    return BlockSpec(
        block.experts, "gate", _float32_logits, gate.top_k,
        renormalize=bool(gate.norm_topk_prob), scoring_func="sigmoid",
        num_expert_group=gate.num_group, topk_group=gate.topk_group,
        e_score_correction_bias=gate.e_score_correction_bias,
        routed_scaling_factor=float(gate.routed_scaling_factor),
        shared_experts=block.shared_experts,
    )  # fmt: skip


def _minimax_m2(block: nn.Module) -> BlockSpec:
    """MiniMax-M2: sigmoid, top-k of (scores + the block's e_score_correction_bias),
    renormalized; input jitter in training."""
    return BlockSpec(
        block.experts, "gate", _linear_logits_in_weight_dtype, block.gate.top_k,
        renormalize=True, scoring_func="sigmoid",
        e_score_correction_bias=block.e_score_correction_bias, router_takes_bias=True,
        jitter_noise=float(block.jitter_noise),
    )  # fmt: skip


def _hunyuan(block: nn.Module) -> BlockSpec:
    """HunYuan-MoE-V1: softmax (float32 gate), top-k, renormalized; an ungated shared MLP."""
    return BlockSpec(
        block.experts, "gate", _hunyuan_logits, block.gate.top_k, renormalize=True,
        shared_experts=block.shared_mlp,
    )  # fmt: skip


def _phimoe(block: nn.Module) -> BlockSpec:
    raise NotRepresentable(
        "its sparsemixer routing (top-2 chosen one at a time, each weighted by a softmax over "
        "the experts within a jitter threshold of the maximum) is not a fusedmoe router"
    )


#: block class name (transformers' own classes) -> its adapter
BLOCK_ADAPTERS: dict[str, Callable[[nn.Module], BlockSpec]] = {
    "MixtralSparseMoeBlock": _softmax_topk_renormalized,
    "MiniMaxSparseMoeBlock": _softmax_topk_renormalized,
    "Qwen2MoeSparseMoeBlock": _qwen_shared(renormalize=None),
    "Qwen3NextSparseMoeBlock": _qwen_shared(renormalize=None),
    "Qwen3_5MoeSparseMoeBlock": _qwen_shared(renormalize=True),
    "Qwen3MoeSparseMoeBlock": _softmax_topk_norm_prob,
    "OlmoeSparseMoeBlock": _softmax_topk_norm_prob,
    "FlexOlmoSparseMoeBlock": _softmax_topk_norm_prob,
    "JambaSparseMoeBlock": _softmax_topk_unnormalized,
    "GraniteMoeMoE": _topk_logits_softmax,
    "GraniteMoeSharedMoE": _topk_logits_softmax,
    "GptOssMLP": _gpt_oss,
    "DeepseekV2Moe": _deepseek_v2,
    "DeepseekV3MoE": _deepseek_v3,
    "Glm4MoeMoE": _deepseek_v3,
    "Dots1MoE": _deepseek_v3,
    "ExaoneMoeSparseMoEBlock": _deepseek_v3,
    "SolarOpenMoE": _deepseek_v3,
    "MiniMaxM2SparseMoeBlock": _minimax_m2,
    "HunYuanMoEV1Moe": _hunyuan,
    "PhimoeSparseMoeBlock": _phimoe,
}


class FusedMoEBlock(nn.Module):
    """A transformers sparse MoE block computed by a FusedMoE layer (`moe`).

    forward(hidden_states [..., H]) returns what the replaced block returned: [..., H], or
    ([..., H], top-k weights [T, k]) for gpt-oss. The block's router module stays, under its
    own attribute name: its weights keep their names, transformers' router-logit recorders
    still find it, and its linear gives the router logits that FusedMoE routes.
    """

    def __init__(self, moe: FusedMoE, router: nn.Module, spec: BlockSpec, replaced: str) -> None:
        super().__init__()
        self.moe = moe
        self.router_attr = spec.router_attr
        self.add_module(spec.router_attr, router)
        self.router_logits = spec.router_logits
        self.router_takes_bias = spec.router_takes_bias
        self.returns_router_scores = spec.returns_router_scores
        self.jitter_noise = spec.jitter_noise
        self.replaced = replaced  # the class name of the block this one replaced

    def forward(self, hidden_states: torch.Tensor):
        if self.training and self.jitter_noise > 0:
            raise RuntimeError(
                f"{self.replaced} jitters its input in training mode (router_jitter_noise="
                f"{self.jitter_noise}), which fusedmoe does not compute: train the unpatched model"
            )
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        router = getattr(self, self.router_attr)
        router_hooked = router._forward_hooks or router._forward_pre_hooks
        if not (router_hooked or self.returns_router_scores) and plain_call(self.moe):
            # the layer computes the logits from the router's weights: inside its CUDA graph,
            # where it replays one (self.router_logits: one function on every call)
            gate = RouterGate(router, self.router_logits)
            return self.moe.forward_gated(x, gate).view(hidden_states.shape)
        if router_hooked:
            # output_router_logits: transformers records the router's output with hooks on it
            extra = (self.moe.e_score_correction_bias,) if self.router_takes_bias else ()
            logits = router(x, *extra)[0]
        else:
            logits = self.router_logits(router, x)  # [T, E]
        y = self.moe(x, logits).view(hidden_states.shape)
        if self.returns_router_scores:
            topk_weights, _ = self.moe.router.select_experts(x, logits)  # [T, k]
            return y, topk_weights.to(logits.dtype)
        return y

    def extra_repr(self) -> str:
        return f"replaced={self.replaced}"


@dataclass
class PatchReport:
    """What patch() did to each sparse MoE block of a model."""

    replaced: list[str] = field(default_factory=list)  # module names, now FusedMoEBlock
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> why it was left


def _build_layer(
    spec: BlockSpec, backend: str, quant: str | None, quant_options: dict | None = None
) -> FusedMoE:
    layout = experts_layout(spec.experts)
    if layout.w13.is_meta:
        raise NotRepresentable("its weights are on the meta device (offloaded or not loaded)")
    num_experts, _, hidden = layout.w13.shape
    has_bias = layout.w13_bias is not None or layout.w2_bias is not None
    moe = FusedMoE(
        num_experts,
        spec.top_k,
        hidden,
        layout.w2.shape[2],
        activation=layout.activation,
        activation_params=layout.activation_params,
        renormalize=spec.renormalize,
        scoring_func=spec.scoring_func,
        use_grouped_topk=spec.num_expert_group is not None,
        num_expert_group=spec.num_expert_group,
        topk_group=spec.topk_group,
        e_score_correction_bias=spec.e_score_correction_bias,
        routed_scaling_factor=spec.routed_scaling_factor,
        has_bias=has_bias,
        shared_experts=spec.shared_experts,
        shared_expert_gate=spec.shared_expert_gate,
        backend=backend,
        params_dtype=layout.w13.dtype,
        device=layout.w13.device,
    )
    weights = [("experts.gate_up_proj", layout.w13), ("experts.down_proj", layout.w2)]
    if has_bias:  # a missing one of the two is zero (the layer holds both)
        w13_bias, w2_bias = layout.w13_bias, layout.w2_bias
        if w13_bias is None:
            w13_bias = layout.w13.new_zeros(layout.w13.shape[:2])
        if w2_bias is None:
            w2_bias = layout.w2.new_zeros(layout.w2.shape[:2])
        weights += [("experts.gate_up_proj_bias", w13_bias), ("experts.down_proj_bias", w2_bias)]
    moe.load_weights(weights)
    _share_parameters(moe, layout)
    if quant is not None:
        moe.quantize_(quant, **(quant_options or {}))
    return moe


def _share_parameters(moe: FusedMoE, layout: ExpertsLayout) -> None:
    """Make the layer's expert parameters the experts module's own Parameter objects wherever
    the layouts agree (a transposed view, gpt-oss's weights, stays the copy just loaded).

    Training then updates the model's own tensors: an optimizer built before patch() keeps
    them, a frozen parameter (requires_grad=False) stays frozen, and no second copy of the
    experts stays in memory. The values are the ones load_weights copied, so nothing changes.
    """
    for name, theirs in (
        ("w13_weight", layout.w13),
        ("w2_weight", layout.w2),
        ("w13_bias", layout.w13_bias),
        ("w2_bias", layout.w2_bias),
    ):
        ours = getattr(moe, name)
        if (
            isinstance(theirs, nn.Parameter)
            and ours is not None
            and theirs.shape == ours.shape
            and theirs.dtype == ours.dtype
            and theirs.device == ours.device
        ):
            setattr(moe, name, theirs)


#: the transformers release whose modeling code the block adapters were written and tested on
TESTED_TRANSFORMERS = "5.23"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _patch_block(
    block: nn.Module, backend: str, quant: str | None, quant_options: dict | None = None
) -> FusedMoEBlock:
    name = type(block).__name__
    if not type(block).__module__.startswith("transformers."):
        raise NotRepresentable(
            f"{name} is not transformers' own class ({type(block).__module__}): its code may "
            "differ from the one fusedmoe's adapter was written for"
        )
    try:
        spec = BLOCK_ADAPTERS[name](block)
    except (AttributeError, KeyError, TypeError, IndexError) as exc:
        raise NotRepresentable(
            f"the {name} adapter could not read the block: {exc!r} (adapters follow the "
            f"modeling code of transformers {TESTED_TRANSFORMERS}; this is "
            f"{_transformers_version()})"
        ) from exc
    if block.training and spec.jitter_noise > 0:
        raise NotRepresentable(
            f"it jitters its input in training mode (router_jitter_noise={spec.jitter_noise}); "
            "patch the model in eval mode"
        )
    try:
        moe = _build_layer(spec, backend, quant, quant_options)
    except (ValueError, TypeError) as exc:
        raise NotRepresentable(f"FusedMoE refused it: {exc}") from exc
    wrapper = FusedMoEBlock(moe, getattr(block, spec.router_attr), spec, replaced=name)
    return wrapper.train(block.training)


def patch(
    model: nn.Module,
    backend: str = "auto",
    quant: str | None = None,
    quant_options: dict | None = None,
) -> PatchReport:
    """Replace every sparse MoE block of `model` that fusedmoe can compute by a FusedMoEBlock.

    Blocks are recognised by class (BLOCK_ADAPTERS). A block is replaced only when the
    FusedMoE computes the same function (router included): any other block, and any module
    with an `experts` submodule whose class has no adapter, is left as it is and reported with
    the reason. backend goes to FusedMoE(backend=...); quant ("fp8_block", ...) quantizes the
    experts online (layer.quantize_), with quant_options as quantize_'s options (for example
    {"fast_accum": True} for fp8_block).

    The FusedMoE layers hold the experts' own Parameter objects (gate_up_proj, down_proj and
    their biases), so training updates the model's tensors and an optimizer built before
    patch() still holds them; gpt-oss's transposed weights are copied instead (build the
    optimizer after patch() there). The router and shared experts are the block's own
    modules, moved over. The experts' state-dict names change (`moe.w13_weight`, ...): save
    checkpoints from an unpatched model.
    """
    if not (isinstance(backend, str) and backend == "auto"):
        get_backend(backend)  # an unknown name fails here, not once per block
    if quant is not None and quant not in SCHEMES:
        raise ValueError(f"unknown quant scheme {quant!r}; expected None or one of {SCHEMES}")
    if quant_options is not None:  # checked once here, not refused block by block
        if quant is None:
            raise ValueError("quant_options needs quant (the scheme they are for)")
        FusedMoE(2, 1, 128, 128, quant_config=quant, quant_options=quant_options, device="cpu")
    report = PatchReport()
    done: list[str] = []
    for name, module in list(model.named_modules()):
        if any(name.startswith(prefix + ".") for prefix in done):
            continue
        is_known = type(module).__name__ in BLOCK_ADAPTERS
        if not is_known:
            if isinstance(getattr(module, "experts", None), nn.Module):
                report.skipped[name] = (
                    f"{type(module).__name__}: no fusedmoe adapter for this block class "
                    "(its routing has not been checked against fusedmoe's routers)"
                )
                done.append(name)
            continue
        done.append(name)
        if name == "":
            report.skipped[name] = "the model is itself a MoE block: patch its parent module"
            continue
        try:
            wrapper = _patch_block(module, backend, quant, quant_options)
        except NotRepresentable as why:
            report.skipped[name] = f"{type(module).__name__}: {why}"
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, wrapper)
        report.replaced.append(name)
    return report


register()
