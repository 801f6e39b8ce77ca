"""GPTQ and AWQ checkpoints: per-expert packed int32 tensors -> the int4_w4a16 / int8_w8a16
layout of the layer.

A layer built for one, FusedMoE(..., quant_config="int4_w4a16" (or "int8_w8a16"),
quant_options={"checkpoint_format": "gptq" | "gptq_v2" | "awq", "group_size": g,
"zero_points": ...}), takes per expert and projection (Mixtral w1 / w3 / w2, Qwen3-MoE
gate_proj / up_proj / down_proj; any prefix before `experts.`):

    GPTQ ("gptq", "gptq_v2"; bits b = 4 or 8, p = 32 / b values per int32, lowest bits first):
        experts.{e}.{proj}.qweight  int32 [K / p, N]      packed along K  -> codes [N, K]
        experts.{e}.{proj}.qzeros   int32 [K / g, N / p]  packed along N  -> zeros [N, K / g]
        experts.{e}.{proj}.scales   float [K / g, N]                      -> scales [N, K / g]
        experts.{e}.{proj}.g_idx    int   [K]             must be k // g; checked, not stored
    AWQ ("awq", AutoAWQ GEMM; 4-bit, p = 8):
        experts.{e}.{proj}.qweight  int32 [K, N / 8]      packed along N, interleaved
        experts.{e}.{proj}.qzeros   int32 [K / g, N / 8]  the same packing
        experts.{e}.{proj}.scales   float [K / g, N]

Legend: K the projection's input size, N its output size (gate / up: K = H, N = I; down:
K = I, N = H), g the group size along K (int8 per channel: g = K, one group).

    GPTQ v1 ("gptq", what the hub's GPTQ checkpoints hold) stores zero - 1: the packed words
        are the v2 words minus 0x11111111 (int4) / 0x01010101 (int8) as int32, so a zero of 0
        borrows from the next value; adding the constant back recovers every zero exactly.
    AWQ packs the 8 nibbles of a word with columns in the order 0 2 4 6 1 3 5 7 (nibble j
        holds column _AWQ_COLUMNS[j] of its 8), for qweight and qzeros alike.

Into the layer: int4 codes two per uint8 along K (even k in the low nibble), zero points
uint8 [N, K / g]. A layer without zero points (symmetric: zero 8, or 128 for int8) takes qzeros
only when every zero is that value (sym=True checkpoints), and stores none. int8_w8a16 is
symmetric: q = code - 128 as int8. Each tensor converts on its own, in any order; scales are
cast to the layer's scale dtype (float16 / bfloat16 -> float32 exactly).

Refused, with the tensor named: act-order (desc_act) checkpoints, whose g_idx is not k // g
(the layer's groups are contiguous along K); zero points other than the symmetric one into a
layer without zero points, or into int8_w8a16; a checkpoint group size other than the
layer's (the scales' shape says which); AWQ into int8_w8a16 (AWQ is 4-bit).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from fusedmoe.activation import MoEActivation
from fusedmoe.quant.formats import pack_fp4
from fusedmoe.weights.names import WeightTarget, resolve_expert_weight

#: the checkpoint formats quant_options["checkpoint_format"] names
CHECKPOINT_FORMATS = ("gptq", "gptq_v2", "awq")
#: the schemes a packed checkpoint loads into, and the bits of their codes
_BITS = {"int4_w4a16": 4, "int8_w8a16": 8}

_PACKED = re.compile(
    r"(?:^|\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\."
    r"(qweight|qzeros|scales|g_idx)$"
)
#: nibble j of an AWQ word holds column _AWQ_COLUMNS[j] of the word's 8 columns
_AWQ_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)
#: ... so column c of the 8 sits in nibble _AWQ_NIBBLES[c] (AutoAWQ's reverse order)
_AWQ_NIBBLES = tuple(_AWQ_COLUMNS.index(c) for c in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


def is_packed_name(name: str) -> bool:
    """Whether `name` is a GPTQ / AWQ per-expert tensor (qweight, qzeros, scales, g_idx)."""
    return _PACKED.search(name) is not None


def check_checkpoint_format(scheme: str, checkpoint_format: object) -> None:
    """quant_options["checkpoint_format"]: one of CHECKPOINT_FORMATS, for int4_w4a16 /
    int8_w8a16 (AWQ: int4_w4a16 only)."""
    if checkpoint_format is None:
        return
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}"
        )
    if scheme not in _BITS:
        raise ValueError(
            f"checkpoint_format ({checkpoint_format}) applies to int4_w4a16 / int8_w8a16, "
            f"not {scheme}"
        )
    if checkpoint_format == "awq" and scheme != "int4_w4a16":
        raise ValueError(
            f"AWQ checkpoints are 4-bit: build the layer with quant_config='int4_w4a16', "
            f"not {scheme}"
        )


def resolve_packed_weight(
    name: str,
    *,
    checkpoint_format: str | None,
    scheme: str | None,
    group_size: int | None,
    zero_points: bool,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    activation: MoEActivation,
) -> WeightTarget | None:
    """The target of a GPTQ / AWQ tensor (None when `name` is not one): its converter from
    the checkpoint layout, and where the result goes (param None: checked, not stored)."""
    match = _PACKED.search(name)
    if match is None:
        return None
    if checkpoint_format is None or scheme not in _BITS:
        raise ValueError(
            f"{name}: a GPTQ / AWQ tensor; load it into a layer built for the checkpoint: "
            "FusedMoE(..., quant_config='int4_w4a16' (or 'int8_w8a16'), quant_options="
            "{'checkpoint_format': 'gptq' | 'gptq_v2' | 'awq', 'group_size': g, "
            "'zero_points': ...})"
        )
    expert, proj, kind = match.group(1), match.group(2), match.group(3)
    # where the projection's rows go: the float weight's target (expert range, gate / up
    # rows, non-gated activations) decides it
    base = resolve_expert_weight(
        f"experts.{expert}.{proj}.weight",
        num_experts=num_experts,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        activation=activation,
    )
    rows, k = base.shape
    prefix = base.param.removesuffix("_weight")  # "w13" / "w2"
    bits = _BITS[scheme]
    spec = _Spec(name, checkpoint_format, bits, rows, k, k if group_size is None else group_size)
    per_channel = group_size is None  # int8: scales [N], one group spanning K
    if kind == "qweight":
        shape = (rows, k // 2 if bits == 4 else k)
        param, convert = f"{prefix}_weight", spec.qweight
    elif kind == "scales":
        shape = (rows,) if per_channel else (rows, spec.groups)
        param, convert = f"{prefix}_weight_scale", functools.partial(spec.scales, per_channel)
    elif kind == "qzeros":
        shape = (rows, spec.groups)
        param = f"{prefix}_weight_zero_point" if zero_points else None
        convert = functools.partial(spec.qzeros, zero_points)
    else:
        if checkpoint_format == "awq":
            raise ValueError(f"{name}: AWQ checkpoints have no g_idx (the layer is for AWQ)")
        shape, param, convert = (k,), None, spec.g_idx
    return WeightTarget(
        param, base.index, shape, exact_dtype=kind != "scales", part=base.part, convert=convert
    )


@dataclass(frozen=True)
class _Spec:
    """The checkpoint layout of one projection (N = rows, K = k) and its converters: each
    checks the checkpoint tensor's dtype and shape and returns it in the layer's layout."""

    name: str  # the checkpoint tensor's, for errors
    fmt: str  # "gptq", "gptq_v2" or "awq"
    bits: int
    rows: int
    k: int
    group: int

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def groups(self) -> int:
        return self.k // self.group

    @property
    def what(self) -> str:
        return "AWQ" if self.fmt == "awq" else "GPTQ"

    def _check(self, tensor: torch.Tensor, shape: tuple[int, ...], layout: str, kind: str):
        """tensor has `shape` (of `layout`, for the error) and is of `kind`: "int32" words,
        "float" scales or "int" indices."""
        ok = {
            "int32": tensor.dtype == torch.int32,
            "float": tensor.is_floating_point(),
            "int": not (tensor.is_floating_point() or tensor.is_complex())
            and tensor.dtype != torch.bool,
        }[kind]
        if not ok:
            what = f"{kind} {self.what} {layout}"
            raise TypeError(f"{self.name}: expected {what}, got {tensor.dtype}")
        if tuple(tensor.shape) != shape:
            hint = ""
            if "K / g" in layout or "g_idx" in layout:
                hint = (
                    f"; the layer's groups are {self.group} wide along K (build it with the "
                    "checkpoint's group_size)"
                )
            raise ValueError(
                f"{self.name}: expected shape {shape} ({self.what} {self.bits}-bit {layout} with "
                f"K = {self.k}, N = {self.rows}), got {tuple(tensor.shape)}{hint}"
            )

    def _unpack_columns(self, words: torch.Tensor, add: int = 0) -> torch.Tensor:
        """int32 [R, ceil(N / p)] packed along N -> the values [R, N] (AWQ's column order
        undone); `add`: a constant added to each word first (as uint32, wrapping)."""
        values = _unpack(words, self.bits, add)  # [R, W, p]
        if self.fmt == "awq":
            values = values[..., list(_AWQ_NIBBLES)]
        return values.flatten(1)[:, : self.rows]

    def qweight(self, tensor: torch.Tensor) -> torch.Tensor:
        """-> int4: uint8 [N, K / 2] (even k in the low nibble); int8: int8 [N, K]."""
        if self.fmt == "awq":
            self._check(tensor, (self.k, -(-self.rows // self.pack)), "qweight [K, N / 8]", "int32")
            codes = self._unpack_columns(tensor).t()  # [N, K]
        else:
            layout = f"qweight [K / {self.pack}, N]"
            self._check(tensor, (self.k // self.pack, self.rows), layout, "int32")
            codes = _unpack(tensor, self.bits).permute(0, 2, 1).reshape(self.k, self.rows).t()
        if self.bits == 4:
            return pack_fp4(codes.to(torch.uint8))
        return (codes - 128).to(torch.int8)

    def qzeros(self, store: bool, tensor: torch.Tensor) -> torch.Tensor:
        """-> uint8 zero points [N, K / g], checked to be the symmetric zero where the layer
        stores none (store False)."""
        width = -(-self.rows // self.pack)
        self._check(tensor, (self.groups, width), f"qzeros [K / g, N / {self.pack}]", "int32")
        # v1 stores zero - 1 per value, subtracted from the whole word: add it back
        add = sum(1 << (self.bits * j) for j in range(self.pack)) if self.fmt == "gptq" else 0
        zeros = self._unpack_columns(tensor, add).t()  # [N, K / g]
        symmetric = 1 << (self.bits - 1)
        if not store:
            bad = (zeros != symmetric).nonzero()
            if bad.numel():
                row, group = (int(i) for i in bad[0])
                value = int(zeros[row, group])
                if self.bits == 8:
                    fix = "int8_w8a16 is symmetric: asymmetric 8-bit GPTQ is not supported"
                else:
                    fix = "build the layer with quant_options={'zero_points': True}"
                raise ValueError(
                    f"{self.name}: zero point {value} (row {row}, group {group}) where the "
                    f"layer is symmetric (zero {symmetric}, no zero points stored): {fix}"
                    + (
                        ""
                        if self.fmt == "awq"
                        else " (checkpoint_format 'gptq' reads v1 qzeros, which hold zero - 1; "
                        "'gptq_v2' reads them as they are)"
                    )
                )
        return zeros.to(torch.uint8)

    def scales(self, per_channel: bool, tensor: torch.Tensor) -> torch.Tensor:
        """-> [N, K / g] (int8 per channel: [N]), the checkpoint's dtype."""
        self._check(tensor, (self.groups, self.rows), "scales [K / g, N]", "float")
        return tensor[0] if per_channel else tensor.t()

    def g_idx(self, tensor: torch.Tensor) -> torch.Tensor:
        """Checked to be the trivial k // g (no act-order); not stored."""
        self._check(tensor, (self.k,), "g_idx [K]", "int")
        trivial = torch.arange(self.k, device=tensor.device) // self.group
        if not torch.equal(tensor.to(torch.int64), trivial):
            raise ValueError(
                f"{self.name}: act-order (desc_act) GPTQ checkpoints are not supported: g_idx "
                f"is not k // group_size (group_size {self.group}); the layer's groups are "
                "contiguous along K. Requantize without desc_act, or load the float weights "
                "and quantize_"
            )
        return tensor


def _unpack(words: torch.Tensor, bits: int, add: int = 0) -> torch.Tensor:
    """int32 words [..., W] -> [..., W, 32 / bits]: the values each holds, the lowest bits
    first; `add` is added to each word as a uint32 first (wrapping: a carry out of bit 31 is
    never read). int32 (the arithmetic shift's sign bits are masked off), int64 with `add`."""
    if add:
        words = (words.to(torch.int64) & 0xFFFFFFFF) + add
    shifts = torch.arange(0, 32, bits, dtype=words.dtype, device=words.device)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
