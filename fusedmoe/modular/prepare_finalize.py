"""PrepareFinalize: the stage before and after the experts.

    prepare:  x [M, H] -> (apply the router weight on the input) -> quantize -> EP dispatch
    finalize: expert output -> weighted top-k reduce (if the experts left it) -> EP combine

Only PrepareFinalize objects talk to a process group; the no-EP one here only quantizes. The EP
ones: NaiveEPPrepareFinalize (fusedmoe.parallel.naive_ep, all-gather / reduce-scatter)
and AllToAllEPPrepareFinalize (fusedmoe.parallel.all_to_all_ep, tokens to their experts' ranks).
"""

from __future__ import annotations

import abc

import torch

from fusedmoe.modular.reduce import (
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
)
from fusedmoe.modular.types import OutputColumns, PrepareResult
from fusedmoe.quant.activation import quantize_input
from fusedmoe.quant.config import FusedMoEQuantConfig


def apply_weight_on_input(a1: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """x * w for top-1 routing: the router weight scales the input instead of the output."""
    if topk_weights.shape[1] != 1:
        raise ValueError(
            f"apply_router_weight_on_input needs top_k == 1, got top_k = {topk_weights.shape[1]}"
        )
    acc = torch.promote_types(a1.dtype, torch.float32)
    return (a1.to(acc) * topk_weights.to(acc)).to(a1.dtype)


class PrepareFinalize(abc.ABC):
    @abc.abstractmethod
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig | None,
        defer_input_quant: bool = False,
        requires_grad: bool = False,
    ) -> PrepareResult:
        """requires_grad: autograd records this call (the expert weights, x or topk_weights
        require grad), the same on every rank of an EP group; the EP dispatch then keeps its
        collectives in the graph of every rank (fusedmoe.parallel.naive_ep)."""

    @abc.abstractmethod
    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce: TopKWeightAndReduce,
    ) -> None:
        """Reduce (when asked) and combine into `output` [M, H] (this rank's tokens)."""

    def experts_may_write_output(self) -> bool:
        """Whether a backend that reduces itself may write straight into finalize's `output`
        (true when finalize has nothing to combine: no EP)."""
        return False

    def num_dispatchers(self) -> int:
        """How many ranks send tokens to this rank's experts."""
        return 1

    def num_tokens_across_ranks(self, num_tokens: int, device: torch.device) -> int:
        """The most tokens any rank of the dispatch group has in this call: the modular kernel
        loops over that many chunks on every rank, so a rank with fewer (or no) tokens still
        joins every collective. No EP: num_tokens."""
        return num_tokens

    def expert_output_buffer(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """Where the experts of the prepared call may write their output of `shape` (finalize
        then has nothing to copy before its combine), or None: the modular kernel's workspace.
        Asked between prepare and finalize."""
        return None

    def output_columns(
        self, output: torch.Tensor, expert_output: torch.Tensor
    ) -> OutputColumns | None:
        """Column blocks in which finalize combines the experts' output as the experts write
        it (types.OutputColumns), or None: one combine after the experts. output: finalize's
        [M, H]; expert_output: where the experts write (expert_output_buffer's). Asked between
        prepare and finalize, of a backend that writes_output_columns."""
        return None

    def single_pass(self) -> bool:
        """Whether every call is one dispatch on every rank, whatever its token count (zero
        included): the modular kernel then never chunks it, and num_tokens_across_ranks is
        this rank's own count (the symm_mem dispatch, which keeps the counts on the GPU)."""
        return False

    def topk_indices_dtype(self) -> torch.dtype | None:
        """The id dtype the dispatch needs, or None for any."""
        return None

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def default_reduce(self) -> TopKWeightAndReduce:
        return TopKWeightAndReduceContiguous()

    def resolve_reduce(self, weight_and_reduce: TopKWeightAndReduce) -> TopKWeightAndReduce:
        if isinstance(weight_and_reduce, TopKWeightAndReduceDelegate):
            return self.default_reduce()
        return weight_and_reduce

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoEPPrepareFinalize(PrepareFinalize):
    """Single rank: prepare quantizes (unless the experts defer it), finalize reduces."""

    def experts_may_write_output(self) -> bool:
        return True

    def prepare(
        self,
        a1,
        topk_weights,
        topk_ids,
        num_experts,
        expert_map,
        apply_router_weight_on_input,
        quant_config,
        defer_input_quant=False,
        requires_grad=False,
    ):
        if apply_router_weight_on_input:
            a1 = apply_weight_on_input(a1, topk_weights)
        a1q = quantize_input(a1, None if defer_input_quant else quant_config)
        return PrepareResult(
            a1q=a1q.q,
            a1q_scale=a1q.scale,
            a1q_global_scale=a1q.global_scale,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
        )

    def finalize(
        self,
        output,
        fused_expert_output,
        topk_weights,
        topk_ids,
        apply_router_weight_on_input,
        weight_and_reduce,
    ):
        reduce = self.resolve_reduce(weight_and_reduce)
        reduce.apply(
            output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input
        )
