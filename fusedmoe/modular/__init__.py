"""The seams of the modular kernel: prepare/finalize, experts, reduce, and their composition."""

from fusedmoe.modular.experts import Experts
from fusedmoe.modular.kernel import FusedMoEModularKernel, WorkspaceCache, shared_workspaces
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize, PrepareFinalize
from fusedmoe.modular.reduce import (
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
)
from fusedmoe.modular.types import (
    ActivationSpec,
    ExpertTokensMeta,
    ExpertWeights,
    GatheredTokens,
    MoEProblem,
    OutputColumns,
    PrepareResult,
    TokenDispatch,
    WorkspaceShapes,
)

__all__ = [
    "ActivationSpec",
    "ExpertTokensMeta",
    "ExpertWeights",
    "Experts",
    "FusedMoEModularKernel",
    "GatheredTokens",
    "MoEProblem",
    "NoEPPrepareFinalize",
    "OutputColumns",
    "PrepareFinalize",
    "PrepareResult",
    "TokenDispatch",
    "TopKWeightAndReduce",
    "TopKWeightAndReduceContiguous",
    "TopKWeightAndReduceDelegate",
    "TopKWeightAndReduceNoOp",
    "WorkspaceCache",
    "WorkspaceShapes",
    "shared_workspaces",
]
