"""Quantization: keys, per-operand configs, quantize / dequantize for every scheme."""
