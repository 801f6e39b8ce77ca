"""The Experts interface: what every expert backend declares and does.

A backend computes, for each (token m, slot j) with a local expert e = expert_map[topk_ids[m, j]]:

    h = a1q[m] @ w13[e].T (+ w13_bias[e])        # GEMM1, [N]
    a = act(h)                                   # [N/2] gated, [N] otherwise
    y = a @ w2[e].T (+ w2_bias[e])               # GEMM2, [H]

and either leaves y per slot ([M, k, H], finalize reduces) or does the weighted top-k sum
itself ([M, H]). A slot whose id is -1, or whose expert is not local, contributes zero.

A backend that routes inside (routes_inside = True) is not run by the modular kernel: the layer
hands it the router logits (apply_monolithic), and it routes, computes and reduces itself. It
needs the logits, so the oracle refuses it where only topk ids exist (fused_experts).

Capabilities are declared once, here, as class-level predicates; the oracle reads them
(nowhere else re-declares them) and reports the first one that fails as the refusal reason.
"""

from __future__ import annotations

import abc
import inspect
from typing import ClassVar

import torch

from fusedmoe.activation import MoEActivation
from fusedmoe.modular.reduce import TopKWeightAndReduce
from fusedmoe.modular.types import (
    ActivationSpec,
    ExpertsCall,
    ExpertWeights,
    InsideRouting,
    MoEProblem,
    MonolithicResult,
    TokenDispatch,
    WorkspaceShapes,
)
from fusedmoe.quant.config import FusedMoEQuantConfig


class Experts(abc.ABC):
    #: the name users pass as backend=...
    name: ClassVar[str]
    #: the hidden size must be a multiple of this (the layer pads to it when needed)
    hidden_size_alignment: ClassVar[int] = 1
    #: takes router logits and routes inside (apply_monolithic) instead of running in the
    #: modular kernel on topk ids; refused where the caller has no logits
    routes_inside: ClassVar[bool] = False
    #: a call launches the same kernels every time and reads no device value on the host, so
    #: the layer may replay it from a CUDA graph (fusedmoe.modular.graphs)
    cuda_graph_safe: ClassVar[bool] = False

    @classmethod
    def create(cls, *, requested: bool = False) -> Experts:
        """The instance a call runs (requested: the caller named this backend rather than
        letting the oracle pick it; a backend may then refuse instead of falling back)."""
        return cls()

    @classmethod
    def engine_description(cls, problem: MoEProblem | None = None) -> str | None:
        """Which GEMM engine runs here, where a backend has several (fusedmoe backends and the
        oracle's explanation print it; the explanation passes its problem, for what depends on
        the shape); None where there is nothing to choose."""
        return None

    # ---- capabilities (class-level: the oracle asks before building anything) ----
    @classmethod
    def is_available(cls) -> str | None:
        """None when the backend's dependencies are importable here, else why not."""
        return None

    @classmethod
    @abc.abstractmethod
    def supports_device(cls, device: torch.device) -> bool: ...

    @classmethod
    def preferred_on(cls, device: torch.device) -> bool:
        """Whether "auto" may pick this backend on `device` (a backend that only emulates
        there, such as Triton's CPU interpreter, runs when requested by name)."""
        return True

    @classmethod
    @abc.abstractmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool: ...

    @classmethod
    @abc.abstractmethod
    def supports_quant_config(cls, quant_config: FusedMoEQuantConfig | None) -> bool: ...

    @classmethod
    @abc.abstractmethod
    def supports_activation(cls, activation: MoEActivation) -> bool: ...

    @classmethod
    def supports_hidden_size(cls, hidden_size: int) -> bool:
        return True

    @classmethod
    def supports_bias(cls) -> bool:
        return False

    @classmethod
    def supports_expert_map(cls) -> bool:
        return False

    @classmethod
    def supports_ep(cls, ep_size: int) -> bool:
        """Whether the backend runs one shard of an EP group: any backend that takes an
        expert_map does (the EP prepare/finalize brings it the tokens and takes the results)."""
        return ep_size == 1 or cls.supports_expert_map()

    @classmethod
    def supports_token_dispatch(cls, all2all_backend: str | None, sequence_parallel: bool) -> bool:
        """Whether the backend runs where tokens travel between ranks that way. A modular
        backend runs under any EP prepare/finalize; one that routes inside dispatches by
        itself, by all-gather only (a modular.types.TokenDispatch the layer hands it)."""
        if not cls.routes_inside:
            return True
        return all2all_backend in (None, "naive") and not sequence_parallel

    @classmethod
    def supports_autograd(cls, quant_config: FusedMoEQuantConfig | None = None) -> bool:
        """Whether gradients flow through apply (for training and fine-tuning) with this quant
        config (None: unquantized). A call that autograd records gets empty workspaces: what
        it saves for backward is its own."""
        return False

    @classmethod
    def refusal_reason(cls, problem: MoEProblem) -> str | None:
        """None when this backend can run `problem`, else the first reason it cannot."""
        checks = (
            (cls.is_available() is None, lambda: cls.is_available()),
            (
                not cls.routes_inside or problem.has_router_logits,
                lambda: (
                    "routes inside: it needs the router logits (FusedMoE has them; "
                    "fused_experts gets topk ids only)"
                ),
            ),
            (cls.supports_device(problem.device), lambda: f"does not run on {problem.device.type}"),
            (cls.supports_dtype(problem.dtype), lambda: f"no {problem.dtype} activations"),
            (
                cls.supports_quant_config(problem.quant_config),
                lambda: f"does not support quant config {problem.quant_config!r}",
            ),
            (
                cls.supports_activation(problem.activation.kind),
                lambda: f"no {problem.activation.kind.value} activation",
            ),
            (
                cls.supports_hidden_size(problem.hidden_size),
                lambda: f"hidden_size {problem.hidden_size} not supported",
            ),
            (not problem.has_bias or cls.supports_bias(), lambda: "no expert biases"),
            (not problem.has_expert_map or cls.supports_expert_map(), lambda: "no expert_map"),
            (
                cls.supports_ep(problem.ep_size),
                lambda: f"no expert parallelism (ep={problem.ep_size})",
            ),
            (
                cls.supports_token_dispatch(problem.all2all_backend, problem.sequence_parallel),
                lambda: (
                    "routes inside and dispatches by all-gather only: no "
                    + (
                        "sequence-parallel dispatch"
                        if problem.sequence_parallel
                        else f"{problem.all2all_backend!r} dispatch"
                    )
                ),
            ),
            (
                not problem.requires_grad or _supports_autograd(cls, problem.quant_config),
                lambda: (
                    "no autograd (backward)"
                    if problem.quant_config is None or not cls.supports_autograd()
                    else "trains unquantized weights only (quantized schemes are inference only)"
                ),
            ),
        )
        for ok, reason in checks:
            if not ok:
                return reason()
        return None

    # ---- contract of one call ----
    def supports_chunking(self) -> bool:
        """Whether the modular kernel may split M into chunks around this backend."""
        return True

    def wants_unquantized_input(self) -> bool:
        """True when the backend quantizes activations itself (prepare must not)."""
        return False

    def writes_output_columns(self, quant_config: FusedMoEQuantConfig | None) -> bool:
        """Whether apply honours call.output_columns for this scheme: it writes its reduced
        output [M, H] block by block and reports each (types.OutputColumns)."""
        return False

    def reads_input_late(self, quant_config: FusedMoEQuantConfig | None) -> bool:
        """Whether apply honours call.input_ready for this scheme: it does its routing work
        (the alignment of the slots by expert) first, then calls it, then reads the input. An
        EP dispatch then moves the activations while that work runs."""
        return False

    @abc.abstractmethod
    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        top_k: int,
        global_num_experts: int,
        local_num_experts: int,
        activation: MoEActivation,
    ) -> WorkspaceShapes:
        """Shapes of the buffers for M tokens, GEMM1 width N, hidden size K."""

    @abc.abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce: ...

    def workspace_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return act_dtype

    @abc.abstractmethod
    def apply(self, call: ExpertsCall) -> None:
        """Write the experts' result into call.output (shape from workspace_shapes)."""

    def apply_monolithic(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        weights: ExpertWeights,
        *,
        routing: InsideRouting,
        activation: ActivationSpec,
        expert_start: int,
        dispatch: TokenDispatch | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> MonolithicResult:
        """Route and run the experts, for a backend with routes_inside (the others never are).

        hidden_states [M, H], router_logits [M, E (+ zero experts)] of this rank's tokens;
        weights: this rank's experts, global ids [expert_start, expert_start + E_l); dispatch:
        the DP all-gather / combine when tokens are sharded over a group whose ranks hold
        different experts (None: tokens stay local). Inputs are assumed checked by the caller.
        """
        raise NotImplementedError(f"{type(self).__name__} does not route inside")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _supports_autograd(cls: type[Experts], quant_config: FusedMoEQuantConfig | None) -> bool:
    """cls.supports_autograd(quant_config), or for a backend written when it took no argument,
    supports_autograd() for unquantized calls only."""
    try:
        takes_config = len(inspect.signature(cls.supports_autograd).parameters) > 0
    except (TypeError, ValueError):  # pragma: no cover - a builtin or odd callable
        takes_config = True
    if takes_config:
        return cls.supports_autograd(quant_config)
    return quant_config is None and cls.supports_autograd()
