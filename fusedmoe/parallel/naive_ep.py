"""EP prepare/finalize: quantize, send the tokens to the ranks of their experts, and bring the
experts' results back (NaiveEPPrepareFinalize here; the all-to-all one in all_to_all_ep.py).

Legend: R ranks of the EP group, M tokens of this rank in this call, M_r those of rank r,
n rows received, H hidden, k top-k, G scale columns of a row (per-token / per-group scales).

    prepare:  [sequence parallel: keep this rank's slice of the shared tokens]
              -> x * w (top-1 weight on input) -> quantize -> dispatch [subclass]
                 (x, its row scales, topk ids and weights travel together; a static
                 per-tensor scale is the same on every rank and does not travel; a dynamic
                 per-tensor one is computed after the dispatch, over the tokens that landed)
    finalize: weighted top-k reduce of the n received tokens (this rank's experts only)
              -> combine [subclass]: the partial sums go back to the tokens' ranks and add up
              -> [sequence parallel: all-gather the slices, every rank gets every token]

Every rank must call prepare and finalize the same number of times (a rank with no tokens
too): the modular kernel loops over the chunks of the largest rank (num_tokens_across_ranks).
One call is in flight at a time: prepare leaves what finalize needs on the object.

Training: where autograd records the call (prepare's requires_grad, the same on every rank),
the float tensors travel through the differentiable collectives of fusedmoe.parallel.comm, so
backward runs the adjoint collectives: the gradients of the expert outputs go back to the
tokens' ranks, those of x and topk_weights (the router's) to where the tokens came from. The
dispatched tensors are tied into the combine's graph (comm.tie), so that every rank's backward
reaches every collective, with no token on its experts too. Sequence parallel: hidden_states,
router logits and the output are replicated, and so must be the output's gradient (every
rank computes the same loss); each rank gets the whole gradient of hidden_states and logits.
Quantized dispatch stays inference only.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusedmoe.modular.prepare_finalize import PrepareFinalize, apply_weight_on_input
from fusedmoe.modular.types import PrepareResult
from fusedmoe.parallel.comm import EPCommStats, EPGroup, row_bytes, tie
from fusedmoe.quant import keys
from fusedmoe.quant.activation import quantize_input
from fusedmoe.quant.config import FusedMoEQuantConfig
from fusedmoe.quant.reference import Quantized


@dataclass
class TokenBatch:
    """The rows that travel together, one per token."""

    x: torch.Tensor  # [n, H] activations (FP8 / INT8 when quantized before the dispatch)
    scale: torch.Tensor | None  # [n, G] per-row scales, row-major; None when none travel
    topk_ids: torch.Tensor  # int32 [n, k] physical expert ids, -1 for an empty slot
    topk_weights: torch.Tensor  # float32 [n, k]

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.x, self.scale, self.topk_ids, self.topk_weights)

    def row_bytes(self) -> int:
        return sum(row_bytes(t) for t in self.tensors())

    def map(self, fn) -> TokenBatch:
        """The batch with fn applied to each tensor (None stays None)."""
        return TokenBatch(*(None if t is None else fn(t) for t in self.tensors()))


@dataclass
class _InFlight:
    """What prepare leaves for finalize."""

    dispatch: object  # the subclass's state (what its combine needs)
    sp_counts: tuple[int, ...] | None  # sequence parallel: the slice sizes of every rank
    #: autograd records the call: the dispatched tensors to tie into the combine's graph
    #: (those that require grad; maybe none); None when not recorded
    tied: tuple[torch.Tensor, ...] | None = None


def quantizes_before_dispatch(quant_config: FusedMoEQuantConfig | None) -> bool:
    """Whether the activations are quantized before they travel (fewer bytes, and the scales
    travel with their rows). Not when one dynamic scale covers the whole tensor (FP8
    per-tensor dynamic, NVFP4's global scale): that scale belongs to the tokens on one rank,
    so those are quantized after the dispatch, where the tokens land."""
    if quant_config is None or quant_config.a1.key is None:
        return True
    key = quant_config.a1.key
    if key.static:
        return True
    return key.layout is not keys.ScaleLayout.TENSOR and (
        key.scale_format is not keys.ScaleFormat.E4M3_GLOBAL
    )


def _quantize_rows(x: torch.Tensor, quant_config: FusedMoEQuantConfig | None) -> Quantized:
    """quantize_input, also for x with no rows (a rank where no token is): the quantizers
    reduce over rows, so a zero row is quantized and the rows sliced off (per-row scales too)."""
    if x.shape[0] or quant_config is None or quant_config.a1.key is None:
        return quantize_input(x, quant_config)
    q = quantize_input(x.new_zeros(1, x.shape[1]), quant_config)
    per_row = quant_config.a1.key.layout is not keys.ScaleLayout.TENSOR
    scale = q.scale[:0] if per_row and q.scale is not None else q.scale
    return Quantized(q=q.q[:0], scale=scale, global_scale=q.global_scale)


def even_split(num_tokens: int, num_ranks: int) -> tuple[int, ...]:
    """Sequence-parallel slice sizes: the first num_tokens % num_ranks ranks take one more."""
    base, extra = divmod(num_tokens, num_ranks)
    return tuple(base + (1 if r < extra else 0) for r in range(num_ranks))


class EPPrepareFinalize(PrepareFinalize):
    """The shared part of the EP prepare/finalize objects (see the module docstring)."""

    def __init__(
        self, ep_size: int, ep_rank: int, group: object | None = None, *, sequence_parallel=False
    ) -> None:
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
        self.comm = EPGroup(ep_size, ep_rank, group)
        self.sequence_parallel = sequence_parallel
        self.stats = EPCommStats()  # traffic since the last reset_stats()
        self._in_flight: _InFlight | None = None

    # ---- what the subclasses do ----
    @abc.abstractmethod
    def _dispatch(self, batch: TokenBatch) -> tuple[TokenBatch, object]:
        """This rank's tokens -> (the tokens this rank's experts compute, state for combine)."""

    @abc.abstractmethod
    def _combine(
        self, partial: torch.Tensor, state: object, num_tokens: int, out=None
    ) -> torch.Tensor:
        """partial [n, H]: this rank's experts' reduced output of the n tokens it received
        -> [num_tokens, H]: the full output of this rank's own tokens (into `out` [num_tokens,
        H] where given and the subclass can: finalize then copies nothing)."""

    # ---- the PrepareFinalize contract ----
    def num_dispatchers(self) -> int:
        return self.comm.size

    def num_tokens_across_ranks(self, num_tokens: int, device: torch.device) -> int:
        self.comm.check()
        if self.sequence_parallel:  # the ranks share their tokens: the same count everywhere
            return num_tokens
        return self.comm.max_over_ranks(num_tokens, device)

    def reset_stats(self) -> EPCommStats:
        """Return the traffic counted so far and start again from zero."""
        stats, self.stats = self.stats, EPCommStats()
        return stats

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
        self.comm.check()
        if self._in_flight is not None:
            raise RuntimeError(f"{type(self).__name__}: prepare called twice without finalize")
        if requires_grad and quant_config is not None:
            raise ValueError(
                "a forward that autograd records (training) through an EP dispatch of a "
                "quantized layer: the quantized dispatch is inference only; run under "
                "torch.no_grad() or train the unquantized layer"
            )
        sp_counts = None
        if self.sequence_parallel:  # the tokens are replicated: keep this rank's slice
            sp_counts = even_split(a1.shape[0], self.comm.size)
            a1, topk_weights, topk_ids = (
                self.comm.own_rows(t, sp_counts) for t in (a1, topk_weights, topk_ids)
            )
        if apply_router_weight_on_input:
            a1 = apply_weight_on_input(a1, topk_weights)
        qc = None if defer_input_quant else quant_config
        quantize_first = quantizes_before_dispatch(qc)
        scale_here, global_scale, col_major = None, None, False
        if quantize_first:
            q = _quantize_rows(a1, qc)
            x, scale_here, global_scale = q.q, q.scale, q.global_scale
        else:
            x = a1
        row_scale = None
        if scale_here is not None and qc.a1.key.layout is not keys.ScaleLayout.TENSOR:
            row_scale, scale_here = scale_here, None  # one row of scales per token: it travels
            col_major = row_scale.dim() == 2 and row_scale.shape[1] > 1 and row_scale.stride(0) == 1
            row_scale = row_scale.contiguous()
        batch = TokenBatch(x, row_scale, topk_ids.to(torch.int32), topk_weights.float())
        received, state = self._dispatch(batch)
        input_ready = self._input_ready(state)  # the activations may still be arriving
        tied = (received.x, received.topk_weights) if requires_grad else None
        self._in_flight = _InFlight(state, sp_counts, tied)
        self.stats.add(calls=1)

        a1q, a1q_scale = received.x, received.scale if row_scale is not None else scale_here
        if col_major and a1q_scale is not None:  # back to the layout the config asked for
            a1q_scale = a1q_scale.t().contiguous().t()
        if not quantize_first:
            if input_ready is not None:  # the quantizer reads them
                input_ready()
                input_ready = None
            q = _quantize_rows(received.x, qc)
            a1q, a1q_scale, global_scale = q.q, q.scale, q.global_scale
        return PrepareResult(
            a1q=a1q,
            a1q_scale=a1q_scale,
            a1q_global_scale=global_scale,
            topk_weights=received.topk_weights,
            topk_ids=received.topk_ids,
            input_ready=input_ready,
        )

    def _input_ready(self, state) -> Callable[[], None] | None:
        """Where the dispatch's activations are still on their way when it returns: what
        makes them ready (PrepareResult.input_ready); None: they are there."""
        return None

    def finalize(
        self,
        output,
        fused_expert_output,
        topk_weights,
        topk_ids,
        apply_router_weight_on_input,
        weight_and_reduce,
    ):
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            raise RuntimeError(f"{type(self).__name__}: finalize called without prepare")
        hidden = output.shape[1]
        if topk_ids.shape[0] == 0:  # nothing landed here; the combine still runs
            partial = output.new_zeros(0, hidden)
        else:
            reduce = self.resolve_reduce(weight_and_reduce)
            partial = reduce.apply(  # [n, H]
                None, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input
            )
        if in_flight.tied is not None:  # every rank's backward must reach every collective
            partial = tie(partial, in_flight.tied)
        if in_flight.sp_counts is None:
            combined = self._combine(partial, in_flight.dispatch, output.shape[0], output)
            if combined is not output:
                output.copy_(combined)
            return
        counts = in_flight.sp_counts
        mine = self._combine(partial, in_flight.dispatch, counts[self.comm.rank])
        # [R*max, H]; every rank goes on with every token: the output's gradient is replicated
        gathered = self.comm.all_gather_rows(
            mine.to(output.dtype), max(counts), replicated_grad=True
        )
        peer_bytes = (self.comm.size - 1) * max(counts) * row_bytes(gathered)
        self.stats.add(combine_bytes_sent=peer_bytes, combine_bytes_received=peer_bytes)
        start = 0
        for rank, count in enumerate(counts):
            block = rank * max(counts)
            output[start : start + count] = gathered[block : block + count]
            start += count

    def __repr__(self) -> str:
        sp = ", sequence_parallel" if self.sequence_parallel else ""
        return f"{type(self).__name__}(ep {self.comm.rank}/{self.comm.size}{sp})"


@dataclass
class _NaiveState:
    counts: tuple[int, ...]  # M_r of every rank
    max_tokens: int  # max_r M_r: the padded block of each rank in the gathered tensors
    rows: torch.Tensor | None  # int64 [sum M_r]: the real rows of the padded layout (None: all)


class NaiveEPPrepareFinalize(EPPrepareFinalize):
    """Dispatch by all-gather, combine by reduce-scatter: every rank sees every token.

        dispatch: counts = all_gather(M_r); each tensor padded to max M_r and all-gathered;
                  the padding rows dropped: n = sum_r M_r tokens, rank r's after rank r-1's
        combine:  this rank's partial sums [n, H], put back into the padded layout
                  [R * max M_r, H] -> reduce-scatter (sum over ranks) -> block `rank`, [:M_r]

    Simple, and the bytes do not depend on the routing: each rank receives every other
    rank's tokens (padded to the largest count) and as many partial sums back.
    """

    def _dispatch(self, batch):
        comm = self.comm
        device = batch.x.device
        counts = comm.all_gather_counts(batch.num_tokens, device)
        max_tokens = max(counts)
        gathered = batch.map(lambda t: comm.all_gather_rows(t, max_tokens))
        rows = None
        if min(counts) != max_tokens:  # uneven: drop the padding rows
            rows = torch.cat(
                [
                    torch.arange(r * max_tokens, r * max_tokens + c, device=device)
                    for r, c in enumerate(counts)
                ]
            )
            gathered = gathered.map(lambda t: t[rows])
        peers = comm.size - 1
        self.stats.add(
            dispatch_bytes_sent=peers * max_tokens * batch.row_bytes(),
            dispatch_bytes_received=peers * max_tokens * batch.row_bytes(),
            tokens_sent=peers * batch.num_tokens,
            tokens_received=sum(counts) - batch.num_tokens,
        )
        return gathered, _NaiveState(counts, max_tokens, rows)

    def _combine(self, partial, state, num_tokens, out=None):
        comm = self.comm
        full = partial
        if state.rows is not None:
            full = partial.new_zeros(comm.size * state.max_tokens, partial.shape[1])
            full[state.rows] = partial
        own = comm.reduce_scatter_rows(full)  # [max M_r, H]
        peer_bytes = (comm.size - 1) * state.max_tokens * row_bytes(partial)
        self.stats.add(combine_bytes_sent=peer_bytes, combine_bytes_received=peer_bytes)
        return own[:num_tokens]


__all__ = [
    "EPPrepareFinalize",
    "NaiveEPPrepareFinalize",
    "TokenBatch",
    "even_split",
    "quantizes_before_dispatch",
]
