"""fusedmoe: the modular fused Mixture-of-Experts layer, as a standalone PyTorch library.

    router -> prepare/finalize -> expert backend -> weighted top-k reduce, in a FusedMoE module.

Importing fusedmoe queries no hardware and needs neither a GPU nor Triton.
"""

from fusedmoe._checks import debug_checks, set_debug_checks
from fusedmoe.activation import ActivationParams, MoEActivation, apply_activation
from fusedmoe.functional import fused_experts, fused_moe
from fusedmoe.layer import FusedMoE, RouterGate
from fusedmoe.modular.graphs import empty_cache
from fusedmoe.oracle import BackendChoice, available_backends, select_backend
from fusedmoe.parallel.config import ParallelConfig, get_compressed_expert_map
from fusedmoe.router import Router, create_router

__version__ = "0.1.0"

__all__ = [
    "ActivationParams",
    "BackendChoice",
    "FusedMoE",
    "MoEActivation",
    "ParallelConfig",
    "Router",
    "RouterGate",
    "__version__",
    "apply_activation",
    "available_backends",
    "create_router",
    "debug_checks",
    "empty_cache",
    "fused_experts",
    "fused_moe",
    "get_compressed_expert_map",
    "select_backend",
    "set_debug_checks",
]
