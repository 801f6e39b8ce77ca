"""The FusedMoE layer's weights: from checkpoints, and to quantization schemes.

Modules:
    names.py     checkpoint names -> slices of the layer's tensors (resolve_expert_weight, ...)
    loading.py   load_weights: copy the tensors, keep the record of which experts are written
    gptq_awq.py  GPTQ / AWQ packed per-expert tensors -> the int4_w4a16 / int8_w8a16 layout
    quantize.py  quantize_ (online, in place) and the layer's quant config
    tensors.py   the expert tensors: random init, the ExpertWeights a backend takes
"""

from fusedmoe.weights.names import WeightTarget, resolve_expert_weight, resolve_quantized_weight

__all__ = ["WeightTarget", "resolve_expert_weight", "resolve_quantized_weight"]
