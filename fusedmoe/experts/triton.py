"""TritonExperts ("triton"): the fused gather-GEMM backend, for CUDA GPUs.

Tokens are sorted by local expert into runs padded to the block height (moe_align, on the
GPU); GEMM1 reads the tokens through the sorted ids (no gathered copy of x) and applies the
activation, and the a2 quantization where it is per tensor (static) or per 1 x 128 group, in
its epilogue; GEMM2 multiplies by the router weight; a last kernel sums each token's k rows.
No host synchronisation: it captures in a CUDA graph, and the whole pipeline is one custom op
for torch.compile (fusedmoe.kernels.fused_moe).

Schemes: bf16 / fp16 / fp32; FP8 per-tensor (static or dynamic activations, or per-token),
per-channel x per-token, 128 x 128 blocks x 1 x 128 groups (float32 or UE8M0 scales); INT8
per-channel x per-token; and the weight-only schemes (mxfp4_w4a16, nvfp4_w4a16, int4_w4a16,
int8_w8a16), whose 4- and 8-bit weights are dequantized inside the GEMMs
(fusedmoe.kernels.wo_moe: the weights stay in their stored format). Biases, expert_map, every
activation. It reduces itself (finalize: NoOp), so its output is [M, H].

A call that autograd records (training; unquantized only) runs the training op instead
(fusedmoe.kernels.moe_train): GPU kernels forward and backward, differentiable in x, the
weights, the biases and the router weights.

On the CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1), when asked for by
name: the tests check it there against the torch backend; the oracle never picks it there.
"""

from __future__ import annotations

import torch

from fusedmoe._triton import INSTALL_HINT, has_triton, interpreting
from fusedmoe.modular.experts import Experts
from fusedmoe.modular.reduce import TopKWeightAndReduceNoOp
from fusedmoe.modular.types import WorkspaceShapes, needs_grad
from fusedmoe.quant import keys
from fusedmoe.quant.config import FusedMoEQuantConfig

# scheme -> weight scale layout (the op's w_mode)
_W_MODE = {
    "fp8_tensor": "tensor",
    "fp8_channel": "channel",
    "fp8_block": "block",
    "int8": "channel",
}
# activation key -> (a1 scale layout, a2 mode)
_ACT_MODES = {
    keys.FP8_STATIC_TENSOR: ("tensor", "fp8_static"),
    keys.FP8_DYNAMIC_TENSOR: ("tensor", "fp8_dynamic_tensor"),
    keys.FP8_DYNAMIC_TOKEN: ("row", "fp8_dynamic_token"),
    keys.FP8_DYNAMIC_GROUP128: ("group", "fp8_group"),
    keys.FP8_DYNAMIC_GROUP128_UE8M0: ("group", "fp8_group_ue8m0"),
    keys.INT8_DYNAMIC_TOKEN: ("row", "int8_dynamic_token"),
}
_DTYPE_KEY = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
#: weight-only scheme -> the weight format of fusedmoe.kernels.wo_moe
_WEIGHT_ONLY = {
    "mxfp4_w4a16": "mxfp4",
    "nvfp4_w4a16": "nvfp4",
    "int4_w4a16": "int4",
    "int8_w8a16": "int8",
}


def _weight_only(quant_config: FusedMoEQuantConfig | None) -> tuple[str, int] | None:
    """(weight format, scale group along K; 0: per channel) of a weight-only scheme."""
    if quant_config is None or quant_config.scheme not in _WEIGHT_ONLY:
        return None
    group = quant_config.w1.key.group
    return _WEIGHT_ONLY[quant_config.scheme], 0 if group is None else group[1]


def _modes(quant_config: FusedMoEQuantConfig | None) -> tuple[str, str, str, str] | None:
    """(a1 scale layout, w scale layout, a2 mode, config dtype key); None: not supported."""
    if quant_config is None:
        return "none", "none", "none", ""
    w_mode = _W_MODE.get(quant_config.scheme)
    act = _ACT_MODES.get(quant_config.a1.key)
    if w_mode is None or act is None or quant_config.a2.key != quant_config.a1.key:
        return None
    return act[0], w_mode, act[1], quant_config.scheme


class TritonExperts(Experts):
    name = "triton"
    cuda_graph_safe = True

    @classmethod
    def is_available(cls):
        return None if has_triton() else f"triton is not installed ({INSTALL_HINT})"

    @classmethod
    def supports_device(cls, device):
        return device.type == "cuda" or (device.type == "cpu" and interpreting())

    @classmethod
    def preferred_on(cls, device):
        return device.type == "cuda"

    @classmethod
    def supports_dtype(cls, dtype):
        return dtype in _DTYPE_KEY

    @classmethod
    def supports_quant_config(cls, quant_config):
        return _modes(quant_config) is not None or _weight_only(quant_config) is not None

    @classmethod
    def supports_activation(cls, activation):
        return True

    @classmethod
    def supports_bias(cls):
        return True

    @classmethod
    def supports_expert_map(cls):
        return True

    @classmethod
    def supports_autograd(cls, quant_config=None):
        return quant_config is None

    def workspace_shapes(self, M, N, K, top_k, global_num_experts, local_num_experts, activation):
        # workspace13: GEMM2's per-slot output; workspace2: a2 (GEMM1's activation output,
        # or its FP8 bytes and group scales). GEMM1's h never leaves the registers.
        return WorkspaceShapes(
            workspace13=(M * top_k, K),
            workspace2=(M * top_k, activation.output_size(N)),
            output=(M, K),
        )

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

    def writes_output_columns(self, quant_config):
        # the fused path (its GEMM2 and sum by column blocks); not the weight-only kernels
        return _modes(quant_config) is not None and _weight_only(quant_config) is None

    def reads_input_late(self, quant_config):
        # the fused path: its alignment of the slots runs before GEMM1 reads x
        return self.writes_output_columns(quant_config)

    def apply(self, call, gate: torch.Tensor | None = None):
        """gate: uint8 [1] on the device; where it reads 0 the call writes nothing
        (fusedmoe.kernels.fused_moe.fused_experts_triton)."""
        from fusedmoe.kernels.fused_moe import fused_experts_triton
        from fusedmoe.quant.kernels import resolve_params

        qc = call.quant_config
        weight_only = _weight_only(qc)
        modes = _modes(qc)
        if modes is None and weight_only is None:  # the oracle refuses these
            raise ValueError(f"the triton backend does not support {qc!r}")
        weights, activation = call.weights, call.activation
        if needs_grad(call.hidden_states, weights, call.topk_weights):
            if gate is not None:
                raise ValueError("a gated call is inference only (run under torch.no_grad())")
            if call.input_ready is not None:
                call.input_ready()
            self._apply_recorded(call)
            return
        if weight_only is not None:
            if gate is not None:
                raise ValueError(f"a gated call does not run {qc.scheme} (weight-only)")
            self._apply_weight_only(call, *weight_only)
            return
        a_mode, w_mode, a2_mode, dtype_key = modes
        fused_experts_triton(
            call.output,
            call.hidden_states,
            weights.w13,
            weights.w2,
            call.topk_weights.float().contiguous(),
            call.topk_ids,
            activation=activation.kind,
            params=resolve_params(activation.kind, activation.params),
            workspace13=call.workspace13,
            workspace2=call.workspace2,
            a1_scale=call.a1q_scale,
            w13_scale=None if qc is None else qc.w1.scale,
            w2_scale=None if qc is None else qc.w2.scale,
            w13_bias=weights.w13_bias,
            w2_bias=weights.w2_bias,
            expert_map=call.expert_map,
            a2_static_scale=None if qc is None else qc.a2.scale,
            a_mode=a_mode,
            w_mode=w_mode,
            a2_mode=a2_mode,
            mul_routed_weight=not call.apply_router_weight_on_input,
            dtype_key=dtype_key or _DTYPE_KEY[call.output.dtype],
            gate=gate,
            output_columns=call.output_columns,
            input_ready=call.input_ready,
        )

    def _apply_weight_only(
        self, call, w_format: str, group: int, x=None, a2_fp8_group: int = 0, a2_ue8m0=False
    ) -> None:
        """4- and 8-bit weights x activations in the layer's dtype (fusedmoe.kernels.wo_moe); x
        in place of call.hidden_states, and a2_fp8_group / a2_ue8m0 (the op's), where a caller
        (deep_gemm_fp4) gives them."""
        from fusedmoe.kernels.wo_moe import fused_experts_weight_only
        from fusedmoe.quant.kernels import resolve_params

        qc, weights, activation = call.quant_config, call.weights, call.activation
        fused_experts_weight_only(
            call.output,
            call.hidden_states if x is None else x,
            weights.w13,
            weights.w2,
            call.topk_weights.float().contiguous(),
            call.topk_ids,
            w_format=w_format,
            group=group,
            w13_scale=qc.w1.scale,
            w2_scale=qc.w2.scale,
            w13_zero=qc.w1.zero_point,
            w2_zero=qc.w2.zero_point,
            w13_global_scale=qc.w1.global_scale,
            w2_global_scale=qc.w2.global_scale,
            activation=activation.kind,
            params=resolve_params(activation.kind, activation.params),
            workspace13=call.workspace13,
            workspace2=call.workspace2,
            w13_bias=weights.w13_bias,
            w2_bias=weights.w2_bias,
            expert_map=call.expert_map,
            mul_routed_weight=not call.apply_router_weight_on_input,
            a2_fp8_group=a2_fp8_group,
            a2_ue8m0=a2_ue8m0,
        )

    def _apply_recorded(self, call) -> None:
        """A call that autograd records: the training op (fusedmoe.kernels.moe_train), whose
        backward runs on the GPU kernels too. Unquantized only (the oracle refuses the rest)."""
        from fusedmoe.kernels.moe_train import experts_train
        from fusedmoe.quant.kernels import resolve_params

        if call.quant_config is not None:
            raise ValueError(
                "the triton backend trains unquantized weights only: quantized schemes are "
                "inference only (run under torch.no_grad())"
            )
        weights, activation = call.weights, call.activation
        out = experts_train(
            call.hidden_states,
            weights.w13,
            weights.w2,
            call.topk_weights.float(),
            call.topk_ids,
            activation=activation.kind,
            params=resolve_params(activation.kind, activation.params),
            w13_bias=weights.w13_bias,
            w2_bias=weights.w2_bias,
            expert_map=call.expert_map,
            mul_routed_weight=not call.apply_router_weight_on_input,
        )
        call.output.copy_(out)


__all__ = ["TritonExperts"]
