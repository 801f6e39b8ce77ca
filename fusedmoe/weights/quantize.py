"""FusedMoE.quantize_: the layer's float experts -> a quantization scheme, in place.

quantize_(layer, scheme):
    refuse NaN / Inf weights (they would poison their scales)
    w13, w2, w13_bias = pad_intermediate(...)        (I -> Ip, a multiple of the scheme's K group)
    w13_q, w2_q, config = quantize_experts(w13, w2, scheme)
    the layer's w13_weight / w2_weight <- w13_q / w2_q; its buffers <- the config's scales

and the layer's quant config, made from those buffers whenever it is asked for (quant_config),
so a load_weights that writes the scales in place shows in the next forward; a forward takes
it from call_quant_config, which builds it once per set of scale tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedmoe.activation import MoEActivation
from fusedmoe.quant.config import (
    INT_WEIGHT_ONLY,
    FusedMoEQuantConfig,
    check_scheme,
    first_nonfinite_expert,
    make_quant_config,
    quantize_experts,
    weight_key,
)
from fusedmoe.weights.gptq_awq import check_checkpoint_format
from fusedmoe.weights.loading import carry_writes_to_quantized, expert_writes


@torch.no_grad()
def quantize_(layer, scheme: str, **config_kwargs):
    """FusedMoE.quantize_: the experts' float weights quantized in place to `scheme` (see
    fusedmoe.quant.config): -> the layer.

    config_kwargs: those of make_quant_config (static a1_scale / a2_scale for fp8_tensor,
    per_token_activations, use_ue8m0, column_major_scales, fast_accum for fp8_block; the
    gemm1_* parameters are refused: a layer takes them from activation_params=).

    Schemes whose K groups must be whole (MX: 32, NVFP4: 16) pad the intermediate size I
    up to a multiple of the group, Ip = padded_intermediate_size (gpt-oss: I = 2880 is one
    already, nothing changes). Padded with zeros: the gate rows [I, Ip) and up rows [I, Ip)
    of w13 and w13_bias (for the interleaved swigluoai, the pairs I .. Ip - 1 at rows
    [2I, 2Ip)), and the columns [I, Ip) of w2. Those channels compute act(0) and meet zero
    columns of w2, so the output is that of the unpadded weights exactly. load_weights then
    takes checkpoints of the padded layout (as gpt-oss ships them).

    Weights holding NaN or Inf are refused (ValueError naming the tensor and the expert).
    The quantized weights and scales count as loaded where the float weights were (see
    missing_weights): quantizing a loaded layer leaves nothing missing.

    checkpoint_format ("gptq", "gptq_v2" or "awq"; int4_w4a16 / int8_w8a16) is no option of
    the config: it tells load_weights how the GPTQ / AWQ checkpoint it will read packs its
    tensors (fusedmoe.weights.gptq_awq).
    """
    if layer.quant_scheme is not None:
        raise ValueError(f"the layer is already quantized ({layer.quant_scheme})")
    config_kwargs = dict(config_kwargs)
    checkpoint_format = config_kwargs.pop("checkpoint_format", None)
    gemm1 = [k for k in config_kwargs if k.startswith("gemm1_")]
    if gemm1:
        raise ValueError(
            f"quantize_: {', '.join(gemm1)}: a layer takes its activation parameters "
            "from activation_params="
        )
    key = weight_key(scheme, config_kwargs.get("group_size", "default"))
    check_checkpoint_format(scheme, checkpoint_format)
    _check_finite(layer)
    group_k = key.group[1] if key.exact_groups else 1
    padded = -(-layer.intermediate_size // group_k) * group_k
    w13, w2, w13_bias = pad_intermediate(
        layer.w13_weight.detach(),
        layer.w2_weight.detach(),
        None if layer.w13_bias is None else layer.w13_bias.detach(),
        layer.activation.kind,
        padded,
    )
    w13_q, w2_q, config = quantize_experts(w13, w2, scheme, **config_kwargs)
    writes = expert_writes(layer)  # of the float weights: the quantized ones inherit it
    if w13_bias is not None and w13_bias.shape != layer.w13_bias.shape:
        layer.w13_bias = nn.Parameter(w13_bias)
    for bias in (layer.w13_bias, layer.w2_bias):
        if bias is not None:  # quantized experts are inference only: nothing of theirs trains
            bias.requires_grad_(False)
    layer.padded_intermediate_size = padded
    layer.w13_weight = nn.Parameter(w13_q, requires_grad=False)
    layer.w2_weight = nn.Parameter(w2_q, requires_grad=False)
    for name, value in (
        ("w13_weight_scale", config.w1.scale),
        ("w2_weight_scale", config.w2.scale),
        ("w13_weight_global_scale", config.w1.global_scale),
        ("w2_weight_global_scale", config.w2.global_scale),
        ("w13_weight_zero_point", config.w1.zero_point),
        ("w2_weight_zero_point", config.w2.zero_point),
        ("a1_scale", config.a1.scale),
        ("a2_scale", config.a2.scale),
    ):
        layer.register_buffer(name, value)
    layer.quant_scheme = scheme
    layer._checkpoint_format = checkpoint_format  # how load_weights reads GPTQ / AWQ tensors
    layer._quant_options = {
        k: v for k, v in config_kwargs.items() if k not in ("a1_scale", "a2_scale", "zero_points")
    }
    if scheme in INT_WEIGHT_ONLY:  # the group size the scales were made with
        layer._quant_options["group_size"] = None if key.group is None else key.group[1]
    carry_writes_to_quantized(layer, writes)
    layer.set_backend(layer.backend)  # the quantized weights may need another backend
    return layer


def quant_config(layer) -> FusedMoEQuantConfig | None:
    """The quant config of the layer's current weights and scales (None when unquantized)."""
    if layer.quant_scheme is None:
        return None
    return make_quant_config(
        layer.quant_scheme,
        layer.w13_weight_scale,
        layer.w2_weight_scale,
        w1_global_scale=layer.w13_weight_global_scale,
        w2_global_scale=layer.w2_weight_global_scale,
        w1_zero_point=getattr(layer, "w13_weight_zero_point", None),
        w2_zero_point=getattr(layer, "w2_weight_zero_point", None),
        a1_scale=layer.a1_scale,
        a2_scale=layer.a2_scale,
        **layer._quant_options,
    )


#: the layer's tensors a quant config is made of
_SCALES = ("w13_weight_scale", "w2_weight_scale", "w13_weight_global_scale",
           "w2_weight_global_scale", "w13_weight_zero_point", "w2_weight_zero_point",
           "a1_scale", "a2_scale")  # fmt: skip


def call_quant_config(layer) -> FusedMoEQuantConfig | None:
    """quant_config, built once per set of scale tensors (a forward needs it every call;
    building it checks every field). Rebuilt when a scale tensor is replaced, as .to() and
    quantize_ do; in-place writes (load_weights) show through the tensors it holds."""
    if layer.quant_scheme is None:
        return None
    key = (layer.quant_scheme, *(id(getattr(layer, name, None)) for name in _SCALES))
    cached = getattr(layer, "_quant_config_cache", None)
    if cached is None or cached[0] != key:
        cached = (key, layer.quant_config)
        layer._quant_config_cache = cached
    return cached[1]


def check_quant_options(scheme: str | None, options: object) -> None:
    """FusedMoE(quant_config=scheme, quant_options=options): a known scheme, and options (a
    dict, as quantize_ takes them) only with a scheme."""
    if scheme is not None:
        check_scheme(scheme)
    if options is not None:
        if not isinstance(options, dict):
            raise TypeError(f"quant_options must be a dict, got {type(options).__name__}")
        if scheme is None:
            raise ValueError("quant_options needs quant_config (the scheme they are for)")


def check_keeps_dtypes(layer, fn) -> None:
    """Before nn.Module._apply(fn) on a quantized layer: fn may move it between devices but not
    change a dtype. Probes every dtype the layer holds (quantized data, scales, biases): int8 /
    uint8 weights pass a float cast unchanged, while their float scales and biases would not."""
    if layer.quant_scheme is None:
        return
    tensors = [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        probe = fn(torch.empty(0, dtype=dtype, device=layer.w13_weight.device))
        if probe.dtype != dtype:
            raise TypeError(
                f"a {layer.quant_scheme}-quantized FusedMoE moves between devices but does "
                f"not change dtype (asked {dtype} -> {probe.dtype})"
            )


def _check_finite(layer) -> None:
    """NaN / Inf weights are refused, naming the tensor and the first expert (by global id)
    that holds one. Reads the weights on the host: quantize_ is a one-time step."""
    local_logical = layer.placement.local_logical(layer.parallel_config.ep_rank)
    for name in ("w13_weight", "w2_weight"):
        bad = first_nonfinite_expert(getattr(layer, name).detach())
        if bad is not None:
            slot, kind = bad
            where = f"expert {local_logical[slot]}"
            if layer.parallel_config.use_ep or layer.placement.has_replicas:
                where += f" (local slot {slot})"
            raise ValueError(
                f"quantize_: {name} holds {kind} (first in {where}); quantizing would poison "
                "its scales: load finite weights first"
            )


def pad_intermediate(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    activation: MoEActivation,
    padded: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Zero-pad the intermediate size I of w13 [E, N(I), H], w13_bias [E, N(I)] and
    w2 [E, H, I] to `padded` (see FusedMoE.quantize_ for where the zeros go)."""
    extra = padded - w2.shape[2]
    if extra == 0:
        return w13, w2, w13_bias

    def pad_rows(t: torch.Tensor) -> torch.Tensor:
        """Zeros after the gate rows and after the up rows (dim 1), or after the single block."""
        pad = [0, 0] * (t.dim() - 2) + [0, extra]  # F.pad lists dims from the last
        if activation is MoEActivation.SWIGLUOAI:  # (gate, up) pairs alternate: `extra` pairs
            pad[-1] = 2 * extra
        elif activation.is_gated:
            gate, up = t.chunk(2, dim=1)
            return torch.cat([nn.functional.pad(gate, pad), nn.functional.pad(up, pad)], dim=1)
        return nn.functional.pad(t, pad)

    return (
        pad_rows(w13),
        nn.functional.pad(w2, (0, extra)),
        None if w13_bias is None else pad_rows(w13_bias),
    )
