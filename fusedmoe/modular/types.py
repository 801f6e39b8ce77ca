"""The typed state passed between the stages of one MoE forward call.

Legend: M tokens (on this rank, after dispatch), E experts (global), E_l local experts,
k top-k, H hidden_size, I intermediate_size, N = 2I (gated) or I (non-gated).
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusedmoe.activation import ActivationParams, MoEActivation
from fusedmoe.quant.config import FusedMoEQuantConfig
from fusedmoe.router.base import Router, ScoringFunc
from fusedmoe.router.topk import TopKRouter


@dataclass
class ExpertWeights:
    """The weights of the experts on this rank, as the backend consumes them."""

    w13: torch.Tensor  # [E_l, N, H]; gate rows [0, I) then up rows [I, 2I) (interleaved: SWIGLUOAI)
    w2: torch.Tensor  # [E_l, H, I]
    w13_bias: torch.Tensor | None = None  # [E_l, N]
    w2_bias: torch.Tensor | None = None  # [E_l, H]
    #: values stored per element along K (2 for packed FP4: w13 is [E_l, N, H/2])
    k_packing: int = 1

    @property
    def num_local_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2] * self.k_packing

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * self.k_packing

    @property
    def gemm1_out_size(self) -> int:
        return self.w13.shape[1]

    @property
    def has_bias(self) -> bool:
        return self.w13_bias is not None or self.w2_bias is not None


@dataclass(frozen=True)
class ActivationSpec:
    """Which activation runs between the GEMMs, with its parameters."""

    kind: MoEActivation = MoEActivation.SILU
    params: ActivationParams = field(default_factory=ActivationParams)

    @classmethod
    def make(cls, activation: MoEActivation | str, params: ActivationParams | None = None):
        kind = MoEActivation.parse(activation)
        params = params or ActivationParams()
        if not isinstance(params, ActivationParams):
            raise TypeError(
                f"activation_params must be an ActivationParams, got {type(params).__name__}"
            )
        params.check_for(kind)
        return cls(kind, params)


@dataclass
class ExpertTokensMeta:
    """How many tokens each local expert receives, when prepare knows it (EP dispatch)."""

    expert_num_tokens: torch.Tensor  # int32 [E_l]
    expert_num_tokens_cpu: torch.Tensor | None = None  # the same on the host, if already synced


@dataclass
class PrepareResult:
    """What prepare hands to the experts."""

    a1q: torch.Tensor  # [M, H] activations for GEMM1, quantized when the scheme says so
    a1q_scale: torch.Tensor | None  # scales of a1q, None when unquantized
    topk_weights: torch.Tensor  # float32 [M, k]
    topk_ids: torch.Tensor  # int32 [M, k], global expert ids; -1 marks an empty slot
    a1q_global_scale: torch.Tensor | None = None  # NVFP4 activations: float32 [1]
    expert_tokens_meta: ExpertTokensMeta | None = None
    #: where a1q and its scales may still be arriving (an EP dispatch that sends the routing
    #: first): call it, on the current stream, before reading them; the routing fields are
    #: ready. A second call does nothing (the modular kernel calls it again where the experts
    #: raise). None: everything is there (Experts.reads_input_late says who calls it)
    input_ready: Callable[[], None] | None = None


@dataclass
class ExpertsCall:
    """One call of Experts.apply: the experts' inputs, where they write, and their scratch.

    The modular kernel builds it after prepare; a backend reads the fields it needs. Adding a
    field here (with a default) reaches every backend without touching their signatures.
    """

    output: torch.Tensor  # written by the backend: [M, H] if it reduces, else [M, k, H]
    hidden_states: torch.Tensor  # a1q [M, H]: quantized by prepare unless the backend defers it
    weights: ExpertWeights
    topk_weights: torch.Tensor  # float32 [M, k]
    topk_ids: torch.Tensor  # int32 [M, k] global ids; -1 (or an id off this rank) adds nothing
    activation: ActivationSpec
    global_num_experts: int  # E: the range of topk_ids
    workspace13: torch.Tensor  # scratch of workspace_shapes().workspace13
    workspace2: torch.Tensor  # scratch of workspace_shapes().workspace2
    expert_map: torch.Tensor | None = None  # int32 [E] global -> local id, -1 on other ranks
    quant_config: FusedMoEQuantConfig | None = None
    a1q_scale: torch.Tensor | None = None  # scales of a quantized hidden_states
    a1q_global_scale: torch.Tensor | None = None  # NVFP4 activations: float32 [1]
    expert_tokens_meta: ExpertTokensMeta | None = None  # tokens per local expert, when known
    #: top-1 routing with the router weight applied to the input (prepare did it): the
    #: backend must not multiply by topk_weights again
    apply_router_weight_on_input: bool = False
    #: where finalize combines the output by column blocks (a backend that writes them, see
    #: Experts.writes_output_columns; None: the output in one piece)
    output_columns: OutputColumns | None = None
    #: a backend that reads_input_late calls it once, on the current stream, after the work
    #: that reads only the routing and before its first read of hidden_states or a1q_scale
    #: (PrepareResult.input_ready); None: the input is there
    input_ready: Callable[[], None] | None = None

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]


@dataclass(frozen=True)
class OutputColumns:
    """The experts' output [M, H] in column blocks, each combined by finalize as soon as it is
    written, while the experts write the next (an EP combine overlapped with GEMM2).

        for j in range(len(bounds) - 1):
            write output[:, bounds[j] : bounds[j + 1]] for every row   # GEMM2 and its sum
            done(j)                                                    # on the current stream

    A backend calls done once per block, in order, after the block's last write is issued on
    the current CUDA stream; finalize combines the blocks it was not told of."""

    bounds: tuple[int, ...]  # 0 = bounds[0] < bounds[1] < ... < bounds[-1] = H
    done: Callable[[int], None]  # done(j): block j is written (issued on the current stream)

    def __post_init__(self) -> None:
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(lo >= hi for lo, hi in itertools.pairwise(b)):
            raise ValueError(f"OutputColumns.bounds must rise from 0 to H, got {b!r}")

    def check(self, hidden: int, multiple: int = 1) -> None:
        """A backend's check before it writes anything: the bounds end at H, and the inner
        ones are multiples of `multiple` (its weights' scale blocks)."""
        if self.bounds[-1] != hidden:
            raise ValueError(f"OutputColumns.bounds end at {self.bounds[-1]}, H is {hidden}")
        if any(b % multiple for b in self.bounds[1:-1]):
            raise ValueError(
                f"OutputColumns.bounds {self.bounds!r}: this backend needs the inner bounds "
                f"multiples of {multiple} columns"
            )


@dataclass(frozen=True)
class WorkspaceShapes:
    """Buffers the modular kernel allocates (and reuses) for one call of the experts."""

    workspace13: tuple[int, ...]  # scratch shared by GEMM1 output and GEMM2 output
    workspace2: tuple[int, ...]  # scratch for the activation output
    output: tuple[int, ...]  # [M, k, H] when finalize reduces, [M, H] when the backend does


@dataclass(frozen=True)
class MoEProblem:
    """Everything a backend needs to know to say whether it can run a call."""

    device: torch.device
    dtype: torch.dtype  # activation dtype
    hidden_size: int
    intermediate_size: int
    num_experts: int  # global
    top_k: int
    activation: ActivationSpec = field(default_factory=ActivationSpec)
    quant_config: FusedMoEQuantConfig | None = None
    has_bias: bool = False
    has_expert_map: bool = False
    ep_size: int = 1
    #: how tokens travel to the experts' ranks: None (they stay), "naive", "all_to_all"
    #: (fusedmoe.parallel.config.ParallelConfig.moves_tokens), and whether in sequence-parallel mode
    all2all_backend: str | None = None
    sequence_parallel: bool = False
    requires_grad: bool = False  # autograd will differentiate through the experts
    #: the caller has the router logits (FusedMoE does; fused_experts gets topk ids only), so a
    #: backend that routes inside (Experts.routes_inside) can run
    has_router_logits: bool = False


@dataclass(frozen=True)
class InsideRouting:
    """How a backend that routes inside (Experts.routes_inside) turns router logits into top-k.

    router:  the layer's router; grouped top-k, custom functions and every other kind run
             through its select_experts (a plain TopKRouter is softmax, top-k, renormalize)
    gpt_oss: route as gpt-oss does instead: top-k over the raw logits, then softmax over those
             k. Equal to softmax, top-k, renormalize, so it needs the router to be exactly that
             (a plain softmax TopKRouter with renormalize=True); routed scaling still applies.
    """

    router: Router
    gpt_oss: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.router, Router):
            raise TypeError(f"router must be a fusedmoe Router, got {type(self.router).__name__}")
        if self.gpt_oss:
            router = self.router
            plain = type(router) is TopKRouter and router.scoring is ScoringFunc.SOFTMAX
            if not (plain and router.renormalize):
                raise ValueError(
                    "gpt_oss_routing (top-k over the logits, then softmax over the k) equals "
                    "softmax, top-k, renormalize: it needs scoring_func='softmax', "
                    "renormalize=True and no grouped top-k, custom function, correction bias, "
                    f"hash table, zero experts or routing simulation (the router is {router!r})"
                )


@dataclass
class MonolithicResult:
    """What a backend that routes inside returns for this rank's M tokens."""

    #: [M, H] in the activation dtype: the weighted sum over this rank's experts (the full sum
    #: once a DP combine reduced it over the group; a partial sum under EP without DP)
    output: torch.Tensor
    topk_weights: torch.Tensor  # float32 [M, k], the routing it computed (scaled)
    topk_ids: torch.Tensor  # int32 [M, k], global ids (zero experts: ids >= E)


@dataclass
class GatheredTokens:
    """Every rank's routed tokens after a DP dispatch (TokenDispatch.dispatch); R ranks in the
    group, M_r tokens of rank r, M_max = max_r M_r. Rank r's rows are
    [r * M_max, r * M_max + M_r); the padding rows are empty slots (id -1, weight 0)."""

    x: torch.Tensor  # [R * M_max, H], every rank's tokens, each rank's block padded to M_max
    topk_weights: torch.Tensor  # float32 [R * M_max, k], 0 on padding rows
    topk_ids: torch.Tensor  # int32 [R * M_max, k], -1 on padding rows
    num_tokens: tuple[int, ...]  # M_r of each rank of the group
    rank: int  # this rank's index in the group

    @property
    def max_tokens(self) -> int:
        return max(self.num_tokens)


class TokenDispatch(abc.ABC):
    """How a backend that routes inside meets a data-parallel group whose ranks hold different
    experts: dispatch this rank's routed tokens to every rank, then combine this rank's experts'
    output for all of them into the group's sum for this rank's tokens. The layer hands one
    to apply_monolithic (fusedmoe.parallel.dp_dispatch.AllGatherDispatch implements it);
    the backend only calls it. Every rank calls both, with zero tokens too."""

    @abc.abstractmethod
    def dispatch(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> GatheredTokens:
        """x [M_r, H], topk_weights float32 [M_r, k], topk_ids [M_r, k] -> every rank's."""

    @abc.abstractmethod
    def combine(self, partial: torch.Tensor, gathered: GatheredTokens) -> torch.Tensor:
        """partial [R * M_max, H] (this rank's experts) -> the group's sum of this rank's rows."""


def needs_grad(
    hidden_states: torch.Tensor, weights: ExpertWeights, *others: torch.Tensor | None
) -> bool:
    """Whether autograd records this call (grad mode on and an input that requires grad:
    hidden_states, a weight or bias, or one of `others`, e.g. the router weights)."""
    if not torch.is_grad_enabled():
        return False
    tensors = (hidden_states, weights.w13, weights.w2, weights.w13_bias, weights.w2_bias, *others)
    return any(t is not None and t.requires_grad for t in tensors)
