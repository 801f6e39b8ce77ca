"""The Router interface and the scoring functions every router shares.

Legend: M tokens, E experts (Z more with zero experts), k top-k.

A router turns router logits [M, E] into
    topk_weights  float32 [M, k]   the weight of each chosen expert (scaled, maybe renormalized)
    topk_ids      int32   [M, k]   the chosen experts, distinct per token
Weights are always the *unbiased* scores of the chosen experts; a correction bias only changes
which experts are chosen.

Non-finite logits are not checked (that would need a device-to-host sync on every call).
Their behaviour is defined instead: a -inf logit is an expert that is never chosen while the
token has k experts with a finite logit; a NaN logit makes that token's weights NaN, so its
output is NaN, never a silently wrong number. Other tokens are unaffected.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fusedmoe._checks import FLOAT_DTYPES, check_positive_int, check_tensor, parse_enum
from fusedmoe._triton import has_triton, interpreting
from fusedmoe.router.checks import check_scaling_factor


class ScoringFunc(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    SQRTSOFTPLUS = "sqrtsoftplus"

    @classmethod
    def parse(cls, value: ScoringFunc | str) -> ScoringFunc:
        return parse_enum(cls, value, "scoring_func")


def compute_scores(logits: torch.Tensor, scoring: ScoringFunc) -> torch.Tensor:
    """logits [M, E] -> float32 scores [M, E]."""
    x = logits.float()
    if scoring is ScoringFunc.SOFTMAX:
        return torch.softmax(x, dim=-1)
    if scoring is ScoringFunc.SIGMOID:
        return torch.sigmoid(x)
    return torch.sqrt(F.softplus(x))


def finish_weights(
    weights: torch.Tensor, renormalize: bool, routed_scaling_factor: float
) -> torch.Tensor:
    """Renormalize the chosen weights to sum 1 per token, then apply the routed scaling."""
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights


# Logit dtypes of the fused routing kernels (fusedmoe.router.fused.FUSED_ROUTING_DTYPES,
# repeated here so that this module does not import triton). float64 stays on torch.
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Set only inside `fused_routing_on_interpreter()`; a plain global, so torch.compile reads it
# as a constant.
_FUSED_ON_INTERPRETER = False


def use_fused_routing(logits: torch.Tensor) -> bool:
    """Whether the routers route these logits with the fused Triton kernels
    (fusedmoe.router.fused, one launch) instead of the torch twins (about ten launches):
    CUDA logits of bf16 / fp16 / fp32 with Triton installed, unless autograd records them
    (training: the twins differentiate). CPU logits take the torch path,
    except inside `fused_routing_on_interpreter()` under TRITON_INTERPRET=1 (tests)."""
    if logits.dtype not in _FUSED_DTYPES or not has_triton():
        return False
    if logits.requires_grad and torch.is_grad_enabled():
        return False  # the kernels have no backward: the torch twins carry the router's gradient
    if logits.is_cuda:
        return True
    return _FUSED_ON_INTERPRETER and logits.device.type == "cpu" and interpreting()


@contextlib.contextmanager
def fused_routing_on_interpreter() -> Iterator[None]:
    """Route CPU logits with the fused kernels on Triton's CPU interpreter (for tests; slow).
    Has an effect only under TRITON_INTERPRET=1; CUDA logits use the kernels regardless."""
    global _FUSED_ON_INTERPRETER
    previous, _FUSED_ON_INTERPRETER = _FUSED_ON_INTERPRETER, True
    try:
        yield
    finally:
        _FUSED_ON_INTERPRETER = previous


class Router(abc.ABC):
    """Chooses k experts per token. Subclasses implement `_select`; inputs are checked here."""

    #: whether select_experts needs input_ids (hash routing)
    needs_input_ids = False
    #: select_experts launches the same kernels every call and reads no device value on the
    #: host (a CUDA graph may replay it); False for user functions and random simulation
    cuda_graph_safe = True

    def __init__(
        self,
        top_k: int,
        num_experts: int,
        *,
        renormalize: bool = True,
        scoring_func: ScoringFunc | str = "softmax",
        routed_scaling_factor: float = 1.0,
        num_logits: int | None = None,
    ) -> None:
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.top_k = check_positive_int("top_k", top_k)
        #: columns of router_logits; more than num_experts with zero experts
        self.num_logits = num_experts if num_logits is None else num_logits
        if top_k > self.num_logits:
            raise ValueError(
                f"top_k ({top_k}) must be <= the number of experts ({self.num_logits})"
            )
        if not isinstance(renormalize, bool):
            raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
        self.renormalize = renormalize
        self.scoring = ScoringFunc.parse(scoring_func)
        self.routed_scaling_factor = check_scaling_factor(routed_scaling_factor)

    @property
    def kind(self) -> str:
        return type(self).__name__

    def select_experts(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (topk_weights float32 [M, k], topk_ids int32 [M, k])."""
        logits = check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
        if logits.shape[1] != self.num_logits:
            raise ValueError(
                f"router_logits must have {self.num_logits} columns (one per expert), "
                f"got shape {tuple(logits.shape)}"
            )
        x = check_tensor("hidden_states", hidden_states, ndim=2, device=logits.device)
        if x.shape[0] != logits.shape[0]:
            raise ValueError(
                f"hidden_states has {x.shape[0]} tokens but router_logits has {logits.shape[0]}"
            )
        if self.needs_input_ids:
            if input_ids is None:
                raise ValueError(f"{self.kind} needs input_ids (hash routing)")
            check_tensor(
                "input_ids", input_ids, ndim=1, dtypes=(torch.int32, torch.int64), device=x.device
            )
            if input_ids.shape[0] != x.shape[0]:
                raise ValueError(
                    f"input_ids has {input_ids.shape[0]} tokens, hidden_states {x.shape[0]}"
                )
        weights, ids = self._select(x, logits, input_ids)
        return weights.to(torch.float32), ids.to(torch.int32)

    @abc.abstractmethod
    def _select(
        self, x: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def __repr__(self) -> str:
        return (
            f"{self.kind}(top_k={self.top_k}, num_experts={self.num_experts}, "
            f"scoring={self.scoring.value}, renormalize={self.renormalize})"
        )
