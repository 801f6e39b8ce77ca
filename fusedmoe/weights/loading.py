"""FusedMoE.load_weights: checkpoint tensors -> the layer's tensors, and the record of which
experts they have written.

load_weights(layer, weights, strict):
    for name, tensor in weights:
        target = resolve_packed_weight(name)          (GPTQ / AWQ, gptq_awq.py)
                 or resolve_quantized_weight(name) or resolve_expert_weight(name)   (names.py)
        an expert tensor -> copy this rank's share into param[index] (a GPTQ / AWQ tensor
            converted to the layer's layout first, or only checked); record the slots written
        else             -> e_score_correction_bias, shared_experts.* / shared_expert_gate.*
    strict, and some name was an expert tensor: every expert tensor of every local slot has
        been written by this or an earlier call, else ValueError naming what is missing

The record (ExpertWrites) is host-side bookkeeping, one bool per local expert slot per
(tensor, part), where a part is the gate or up rows of w13 (of a gated activation) or the
whole expert. The tensors it covers: w13_weight, w2_weight, the biases (has_bias) and, once
quantized, the weight scales and global scales. It is written as the copies happen and never
reads a device value. A fresh layer holds valid random weights (reset_parameters) and a record
of nothing loaded; quantize_ carries the record of the float weights over to the quantized
ones and their scales. Shared experts and e_score_correction_bias are modules and buffers of
their own: loaded by name, outside the record.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fusedmoe.parallel.eplb import EXPERT_TENSORS
from fusedmoe.parallel.placement import ExpertPlacement
from fusedmoe.weights.gptq_awq import resolve_packed_weight
from fusedmoe.weights.names import WeightTarget, resolve_expert_weight, resolve_quantized_weight

#: the expert tensors the record covers, in report order (those the layer holds)
RECORDED = EXPERT_TENSORS
RECORDED = (
    "w13_weight",
    "w2_weight",
    "w13_bias",
    "w2_bias",
    "w13_weight_scale",
    "w2_weight_scale",
    "w13_weight_global_scale",
    "w2_weight_global_scale",
    "w13_weight_zero_point",
    "w2_weight_zero_point",
)


@dataclass
class ExpertWrites:
    """Which local expert slots of each expert tensor have been written by load_weights."""

    placement: ExpertPlacement  # the placement whose local slots the flags index
    #: (tensor name, part) -> bool [E_local] on the CPU; part "gate" / "up" (the rows of one
    #: projection of a gated w13 tensor) or None (the whole expert)
    written: dict[tuple[str, str | None], torch.Tensor]

    def complete(self) -> bool:
        return all(bool(flags.all()) for flags in self.written.values())


# ---- the record ---------------------------------------------------------------------------------
def _parts(layer, name: str) -> tuple[str | None, ...]:
    """The parts the record tracks for tensor `name`: gate and up rows of a gated w13 tensor
    with a row dimension ([E, N, ...]), else the whole expert."""
    tensor = getattr(layer, name)
    if name.startswith("w13") and layer.activation.kind.is_gated and tensor.dim() >= 2:
        return ("gate", "up")
    return (None,)


def _recorded(layer) -> list[str]:
    return [name for name in RECORDED if getattr(layer, name, None) is not None]


def forget_writes(layer) -> None:
    """Record nothing written: the state of a fresh (or reset_parameters) layer."""
    num_local = layer.local_num_experts
    layer._expert_writes = ExpertWrites(
        layer.placement,
        {
            (name, part): torch.zeros(num_local, dtype=torch.bool)
            for name in _recorded(layer)
            for part in _parts(layer, name)
        },
    )


def expert_writes(layer) -> ExpertWrites:
    """The layer's record, made anew when the placement changed (EPLB moved the experts:
    a complete record stays complete, anything else counts as not loaded)."""
    record = getattr(layer, "_expert_writes", None)
    if record is not None and record.placement is layer.placement:
        return record
    complete = record is not None and record.complete()
    forget_writes(layer)
    if complete:
        for flags in layer._expert_writes.written.values():
            flags.fill_(True)
    return layer._expert_writes


def carry_writes_to_quantized(layer, before: ExpertWrites) -> None:
    """After quantize_: the quantized weights and their scales are as written as the float
    weights they came from (a scale of a whole expert: as its least written part)."""
    forget_writes(layer)
    for (name, part), flags in layer._expert_writes.written.items():
        source = name if name.endswith("_bias") else name[: name.index("_")] + "_weight"
        if (source, part) in before.written:
            flags.copy_(before.written[(source, part)])
        else:
            parts = [f for (n, _), f in before.written.items() if n == source]
            flags.copy_(torch.stack(parts).all(dim=0))


def _mark(layer, record: ExpertWrites, target: WeightTarget, slots: list[int] | None) -> None:
    """Record target.param's `slots` (None: every local slot) written for target.part."""
    parts = _parts(layer, target.param)
    if target.part is not None:
        assert target.part in parts, f"{target.param}: no {target.part} part in {parts}"
        parts = (target.part,)
    for part in parts:
        flags = record.written[(target.param, part)]
        if slots is None:
            flags.fill_(True)
        else:
            flags[slots] = True


def missing_weights(layer) -> list[str]:
    """What no load_weights call has written yet, one entry per tensor (and part): e.g.
    "w13_weight gate rows of experts [1-127]"; experts by global (logical) id.

    A fresh layer holds random weights (usable) and reports them all missing: none were
    loaded. quantize_ keeps the report (the quantized tensors are as loaded as the float
    ones); reset_parameters clears it."""
    record = expert_writes(layer)
    local_logical = layer.placement.local_logical(layer.parallel_config.ep_rank)
    missing = []
    for name in _recorded(layer):
        parts = _parts(layer, name)
        experts = {}  # part -> the global ids of the experts it misses
        for part in parts:
            slots = (~record.written[(name, part)]).nonzero()[:, 0].tolist()
            experts[part] = sorted({local_logical[s] for s in slots})
        if all(experts[part] == experts[parts[0]] for part in parts):  # all parts alike
            experts = {None: experts[parts[0]]}
        for part, ids in experts.items():
            if ids:
                rows = "" if part is None else f" {part} rows"
                missing.append(f"{name}{rows} of experts [{_ranges(ids)}]")
    return missing


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ---- loading ------------------------------------------------------------------------------------
@torch.no_grad()
def load_weights(
    layer, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True
) -> list[str]:
    """FusedMoE.load_weights: copy checkpoint tensors into the layer; returns the names loaded.

    Expert weights in the namings of fusedmoe.weights.names (float checkpoints into an
    unquantized layer; quantized ones, gpt-oss MXFP4 and DeepSeek FP8 included, into a layer
    quantized to their scheme; GPTQ / AWQ per-expert qweight / qzeros / scales / g_idx into an
    int4_w4a16 / int8_w8a16 layer built with quant_options={"checkpoint_format": ...}, see
    fusedmoe.weights.gptq_awq); also `e_score_correction_bias` and, when the layer has them,
    `shared_experts.*` / `shared_expert.*` / `shared_expert_gate.*`. Float tensors are cast
    to the parameters' dtype; quantized data must have the layer's storage dtype. An unknown
    name, a wrong shape or dtype is an error that names the tensor; nothing is loaded after.

    Checkpoints are global: under expert parallelism the layer keeps its rank's experts
    (the others' names are skipped and not returned). A layer whose intermediate size was
    padded (quantize_) takes tensors of the padded layout, padded_intermediate_size wide.

    strict (as nn.Module.load_state_dict): when the checkpoint names any expert tensor, every
    expert tensor of this rank's experts (gate, up and down rows; biases; scales when
    quantized) must have been written by this call or an earlier one, else ValueError
    listing what is missing. The tensors named were copied before the check, so after that
    error the layer is half loaded. strict=False loads in parts (one call per checkpoint
    file, say); missing_weights() then says what is left. Shared experts and
    e_score_correction_bias are outside the check: modules and buffers of their own.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    shapes = dict(
        num_experts=layer.num_experts,
        hidden_size=layer.hidden_size,
        intermediate_size=layer.padded_intermediate_size,
        activation=layer.activation.kind,
    )
    record = expert_writes(layer)
    named_experts = False  # some name was an expert tensor (this rank's or another's)
    loaded = []
    for name, tensor in weights:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        target = _resolve(layer, name, shapes)
        if target is None:
            if not _load_other(layer, name, tensor):
                raise ValueError(f"{name}: not a weight of this FusedMoE layer")
            loaded.append(name)
            continue
        named_experts = True
        param = None if target.param is None else getattr(layer, target.param)
        if param is None and target.param is not None:
            hint = " (construct with has_bias=True)" if "bias" in target.param else ""
            raise ValueError(f"{name}: the layer has no {target.param}{hint}")
        shares = [(target.index, tensor, target.shape)]
        if layer.expert_map is not None:
            shares = _this_ranks_share(layer, name, tensor, target.index, target.shape)
            if not shares:
                continue  # another rank's expert
        if target.convert is not None:  # GPTQ / AWQ: checked, in the layer's layout
            converted = target.convert(tensor)
            shares = [(index, converted, shape) for index, _, shape in shares]
        if param is None:  # checked only (g_idx, the qzeros of a symmetric layer)
            loaded.append(name)
            continue
        for index, share, shape in shares:
            slot = param[index] if index else param
            copy_checked(name, slot, share, shape, exact_dtype=target.exact_dtype)
            _mark(layer, record, target, [index[0]] if index else None)
        loaded.append(name)
    if strict and named_experts:
        missing = missing_weights(layer)
        if missing:
            pc = layer.parallel_config
            where = f" of ep_rank {pc.ep_rank}" if pc.use_ep else ""
            raise ValueError(
                f"load_weights: the checkpoint leaves expert tensors{where} unwritten: "
                f"{', '.join(missing)}. The tensors it names have been copied, so the layer is "
                "half loaded: load the rest (load_weights(..., strict=False) loads in parts; "
                "layer.missing_weights() says what is left)"
            )
    return loaded


def _resolve(layer, name: str, shapes: dict) -> WeightTarget | None:
    target = resolve_packed_weight(
        name,
        checkpoint_format=getattr(layer, "_checkpoint_format", None),
        scheme=layer.quant_scheme,
        group_size=layer._quant_options.get("group_size"),
        zero_points=getattr(layer, "w13_weight_zero_point", None) is not None,
        **shapes,
    )
    if target is not None:
        return target
    if layer.quant_scheme is not None:
        target = resolve_quantized_weight(
            name,
            scheme=layer.quant_scheme,
            group_size=layer._quant_options.get("group_size", "default"),
            zero_points=getattr(layer, "w13_weight_zero_point", None) is not None,
            **shapes,
        )
    if target is None:
        target = resolve_expert_weight(name, **shapes)
        if target is not None and layer.quant_scheme is not None and "bias" not in target.param:
            raise ValueError(
                f"{name}: the layer holds {layer.quant_scheme} weights; load float "
                "weights into an unquantized layer and then quantize_()"
            )
    return target


def _this_ranks_share(layer, name, tensor, index, shape):
    """A global (logical) expert tensor -> [(index, tensor, shape)] for this rank's local
    slots that compute that expert: none (another rank's), one, or several (replicas)."""
    local_logical = layer.placement.local_logical(layer.parallel_config.ep_rank)
    if index:  # one expert's tensor: (expert, rows)
        expert = index[0]
        return [
            ((slot, *index[1:]), tensor, shape)
            for slot, logical in enumerate(local_logical)
            if logical == expert
        ]
    # every expert's (fused names): check the global shape, keep this rank's experts
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
    rows = torch.tensor(local_logical, dtype=torch.long, device=tensor.device)
    return [((), tensor.index_select(0, rows), (len(local_logical), *shape[1:]))]


def _load_other(layer, name: str, tensor: torch.Tensor) -> bool:
    """e_score_correction_bias and the shared experts' tensors: False for any other name."""
    if name.endswith("e_score_correction_bias"):
        if layer.e_score_correction_bias is None:
            raise ValueError(f"{name}: the layer was built without e_score_correction_bias")
        buf = layer.e_score_correction_bias
        copy_checked(name, buf, tensor, tuple(buf.shape))
        return True
    for prefix, module in (
        ("shared_expert_gate.", layer.shared_expert_gate),
        ("shared_experts.", layer.shared_experts),
        ("shared_expert.", layer.shared_experts),
    ):
        head, sep, tail = name.partition(prefix)
        if sep and (head == "" or head.endswith(".")) and module is not None:
            state = dict(module.named_parameters()) | dict(module.named_buffers())
            if tail not in state:
                raise ValueError(f"{name}: {tail!r} is not a tensor of the shared experts module")
            copy_checked(name, state[tail], tensor, tuple(state[tail].shape))
            return True
    return False


def copy_checked(
    name: str,
    dst: torch.Tensor,
    src: torch.Tensor,
    shape: tuple[int, ...],
    *,
    exact_dtype: bool = False,
) -> None:
    """Copy src (of checkpoint shape `shape`, or that with a trailing 1) into dst."""
    shape = tuple(shape)
    if tuple(src.shape) == (*shape, 1):  # per-channel scales stored as [N, 1]
        src = src.squeeze(-1)
    if tuple(src.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(src.shape)}")
    if exact_dtype and src.dtype != dst.dtype:
        raise TypeError(
            f"{name}: expected {dst.dtype} (quantized data is not cast), got {src.dtype}"
        )
    if not (src.is_floating_point() or dst.dtype == src.dtype):
        raise TypeError(f"{name}: expected a floating-point tensor, got {src.dtype}")
    dst.copy_(src.reshape(dst.shape))
