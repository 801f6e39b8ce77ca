"""Quantization: keys, per-operand configs, quantize / dequantize for every scheme.

w13_q, w2_q, qc = quantize_experts(w13, w2, "fp8_block")
out = fusedmoe.fused_experts(x, w13_q, w2_q, topk_weights, topk_ids, quant_config=qc)
"""

from fusedmoe.quant.activation import (
    act_mul_per_token_group_quant_fp8,
    per_token_group_quant_fp8,
    quantize_activation,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_input,
    quantize_int8_per_token,
    quantize_mxfp8,
    quantize_nvfp4,
)
from fusedmoe.quant.config import (
    SCHEMES,
    FusedMoEQuantConfig,
    OperandQuant,
    make_quant_config,
    quantize_experts,
)
from fusedmoe.quant.keys import QuantKey
from fusedmoe.quant.reference import Quantized, dequantize, quantize

__all__ = [
    "SCHEMES",
    "FusedMoEQuantConfig",
    "OperandQuant",
    "QuantKey",
    "Quantized",
    "act_mul_per_token_group_quant_fp8",
    "dequantize",
    "make_quant_config",
    "per_token_group_quant_fp8",
    "quantize",
    "quantize_activation",
    "quantize_experts",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token",
    "quantize_input",
    "quantize_int8_per_token",
    "quantize_mxfp8",
    "quantize_nvfp4",
]
