"""HPCExperts ("hpc"): one fully fused FP8 MoE path, the weighted top-k reduce inside.

The contract of the fused FP8 MoE of Tencent's HPC ops library as the big engines use it, on
our Triton kernels (fusedmoe.kernels.hpc_moe): x arrives unquantized (prepare defers, GEMM1
quantizes its tiles), GEMM1 reads the tokens through the expert-sorted ids with SiLU * up and
the FP8 quantization of a2 in its epilogue, GEMM2 adds each slot's weighted output straight
into a float32 accumulator (workspace13), and one cast writes the output. Its reason to exist is
latency: three launches at M = 1, four above (the alignment), no host synchronisation.

    device      CUDA compute capability 9.0 or 10.x (the CPU only under TRITON_INTERPRET=1,
                by name)
    schemes     fp8_tensor with static a1 / a2 scales; fp8_block (dynamic 1 x 128 groups,
                float32 or UE8M0 scales)
    activation  SiLU (no clamp)
    hidden      a multiple of 128
    EP          no expert_map needed: HPCExperts(ep_rank=r, ep_size=n) runs rank r's linear block
                of experts (fusedmoe.parallel.config.linear_expert_map) and skips the others itself;
                an expert_map the caller passes (the layer under EP) is followed instead
    workspaces  (M, H) float32 accumulator, (0,), output (M, H): finalize's reduce is NoOp
"""

from __future__ import annotations

import torch

from fusedmoe._triton import INSTALL_HINT, has_triton, interpreting
from fusedmoe.activation import MoEActivation
from fusedmoe.modular.experts import Experts
from fusedmoe.modular.reduce import TopKWeightAndReduceNoOp
from fusedmoe.modular.types import WorkspaceShapes
from fusedmoe.quant import keys

_BLOCK_ACTS = (keys.FP8_DYNAMIC_GROUP128, keys.FP8_DYNAMIC_GROUP128_UE8M0)


def _hpc_scheme(quant_config) -> str | None:
    """The kind of fused path of the scheme, "tensor" or "block"; None where it has none."""
    if quant_config is None:
        return None
    a1, a2 = quant_config.a1.key, quant_config.a2.key
    if quant_config.scheme == "fp8_tensor" and a1 == a2 == keys.FP8_STATIC_TENSOR:
        return "tensor"
    if quant_config.scheme == "fp8_block" and a1 == a2 and a1 in _BLOCK_ACTS:
        return "block"
    return None


class HPCExperts(Experts):
    name = "hpc"
    cuda_graph_safe = True

    def __init__(self, ep_rank: int = 0, ep_size: int = 1) -> None:
        for name, value in (("ep_rank", ep_rank), ("ep_size", ep_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not 0 <= ep_rank < max(ep_size, 1):
            raise ValueError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
        self.ep_rank = ep_rank
        self.ep_size = ep_size

    @classmethod
    def is_available(cls):
        return None if has_triton() else f"triton is not installed ({INSTALL_HINT})"

    @classmethod
    def supports_device(cls, device):
        if device.type == "cpu":
            return interpreting()
        if device.type != "cuda":
            return False
        if not torch.cuda.is_available():  # nothing to ask (the capability matrix on a CPU)
            return True
        major, minor = torch.cuda.get_device_capability(device)
        return (major, minor) == (9, 0) or major == 10

    @classmethod
    def preferred_on(cls, device):
        return device.type == "cuda"

    @classmethod
    def supports_dtype(cls, dtype):
        return dtype in (torch.bfloat16, torch.float16)

    @classmethod
    def supports_quant_config(cls, quant_config):
        return _hpc_scheme(quant_config) is not None

    @classmethod
    def supports_activation(cls, activation):
        return activation is MoEActivation.SILU

    @classmethod
    def supports_hidden_size(cls, hidden_size):
        return hidden_size % 128 == 0

    @classmethod
    def supports_ep(cls, ep_size):
        return True  # by ep_rank: the experts of other ranks are skipped in the kernels

    @classmethod
    def refusal_reason(cls, problem):
        why = super().refusal_reason(problem)
        if why is None and problem.activation.params.limit is not None:
            return "no clamped SiLU (the fused path runs plain SiLU * up)"
        return why

    def wants_unquantized_input(self):
        return True  # GEMM1 quantizes x tile by tile

    def workspace_dtype(self, act_dtype):
        return torch.float32  # workspace13 is the accumulator of the top-k sum

    def workspace_shapes(self, M, N, K, top_k, global_num_experts, local_num_experts, activation):
        return WorkspaceShapes(workspace13=(M, K), workspace2=(0,), output=(M, K))

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, call):
        from fusedmoe.kernels.hpc_moe import fused_moe_hpc, local_expert_map

        qc, weights, expert_map = call.quant_config, call.weights, call.expert_map
        global_num_experts = call.global_num_experts
        scheme = _hpc_scheme(qc)
        if scheme is None:  # the oracle refuses these; a direct call gets the reason
            raise ValueError(f"the hpc backend does not support {qc!r}")
        if call.apply_router_weight_on_input:
            raise ValueError("the hpc backend applies the router weight in GEMM2, not on x")
        if expert_map is None:  # rank ep_rank's linear block: E / ep_size, the first E % ep_size
            base, extra = divmod(global_num_experts, self.ep_size)  # ranks one more
            block = base + (self.ep_rank < extra)
            if weights.num_local_experts != block:
                raise ValueError(
                    f"{weights.num_local_experts} local experts, but rank {self.ep_rank} of "
                    f"{self.ep_size} holds {block} of the {global_num_experts} experts: "
                    "construct HPCExperts(ep_rank=..., ep_size=...) to match, or pass an "
                    "expert_map"
                )
            expert_map = local_expert_map(
                global_num_experts, self.ep_size, self.ep_rank, call.hidden_states.device
            )
        fused_moe_hpc(
            call.output,
            call.hidden_states,
            weights.w13,
            weights.w2,
            call.topk_weights,
            call.topk_ids,
            w13_scale=qc.w1.scale,
            w2_scale=qc.w2.scale,
            accumulator=call.workspace13,
            a1_scale=qc.a1.scale,
            a2_scale=qc.a2.scale,
            expert_map=expert_map,
            block_quant=scheme == "block",
            use_ue8m0=qc.a1.key == keys.FP8_DYNAMIC_GROUP128_UE8M0,
        )

    def __repr__(self) -> str:
        return f"HPCExperts(ep_rank={self.ep_rank}, ep_size={self.ep_size})"


__all__ = ["HPCExperts"]
