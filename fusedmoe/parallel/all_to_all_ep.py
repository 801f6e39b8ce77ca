"""AllToAllEPPrepareFinalize: each token goes only to the ranks that own its experts.

Legend: R ranks, M tokens of this rank, k top-k, P physical experts, S token copies sent,
n token copies received, H hidden.

    dispatch: dest[m, j]   = owner[topk_ids[m, j]]                  # [M, k], -1 for empty slots
              to_rank[m, r] = any_j dest[m, j] == r                 # [M, R] bool
              send rows    = the (r, m) with to_rank[m, r], sorted by r then m      # S rows
              send_counts[r] = sum_m to_rank[m, r]; recv_counts by an all_to_all of the counts
              x, row scales, ids, weights of the send rows -> all_to_all_single with those split
              sizes -> n rows, grouped by source rank
    experts:  every received row carries all k of its ids; the expert_map of the receiving rank
              keeps the slots of its own experts (a slot's expert lives on exactly one rank)
    combine:  partial sums [n, H] -> all_to_all_single back with the splits swapped -> [S, H]
              in send order -> out[m] = sum of the copies of token m (float32 index_add;
              float64 for float64)

A token with its k experts on one rank travels once, not R - 1 times as in the naive
all-gather: the bytes moved follow the routing. The price: two count exchanges (one host sync
for the split sizes) and a gather / scatter of the rows on each side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedmoe._checks import INDEX_DTYPES, check_tensor
from fusedmoe.parallel.comm import row_bytes
from fusedmoe.parallel.naive_ep import EPPrepareFinalize


@dataclass
class _AllToAllState:
    token_of_row: torch.Tensor  # int64 [S]: the token each sent row copies, rows sorted by rank
    send_counts: list[int]  # [R] rows sent to each rank
    recv_counts: list[int]  # [R] rows received from each rank


class AllToAllEPPrepareFinalize(EPPrepareFinalize):
    """Dispatch and combine by all_to_all_single with split sizes (see the module docstring).

    expert_owner: int [P], the rank of every physical expert (ExpertPlacement.owner()).
    """

    def __init__(
        self,
        ep_size: int,
        ep_rank: int,
        expert_owner: torch.Tensor,
        group: object | None = None,
        *,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(ep_size, ep_rank, group, sequence_parallel=sequence_parallel)
        check_tensor("expert_owner", expert_owner, ndim=1, dtypes=INDEX_DTYPES)
        if expert_owner.numel() and not (
            int(expert_owner.min()) >= 0 and int(expert_owner.max()) < ep_size
        ):
            raise ValueError(f"expert_owner must hold ranks in [0, {ep_size})")
        self.expert_owner = expert_owner.long()

    def _owner_on(self, device: torch.device) -> torch.Tensor:
        if self.expert_owner.device != device:
            self.expert_owner = self.expert_owner.to(device)
        return self.expert_owner

    def _dispatch(self, batch):
        comm = self.comm
        ids = batch.topk_ids.long()  # [M, k]
        if ids.numel() and int(ids.max()) >= self.expert_owner.numel():
            raise ValueError(
                f"topk_ids name physical expert {int(ids.max())}, but expert_owner places "
                f"{self.expert_owner.numel()}"
            )
        owner = self._owner_on(ids.device)
        dest = torch.where(ids >= 0, owner[ids.clamp(min=0)], -1)  # [M, k]
        # [M, R]: whether token m has an expert on rank r (column 0 of the one-hot: no expert)
        to_rank = torch.nn.functional.one_hot(dest + 1, comm.size + 1)[..., 1:].any(dim=1)
        token_of_row = to_rank.t().nonzero()[:, 1]  # [S]: sorted by rank, then token
        send_counts_t = to_rank.sum(dim=0)  # int64 [R]
        recv_counts_t = comm.exchange_counts(send_counts_t)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()  # host sync
        sent = batch.map(lambda t: t[token_of_row])
        received = sent.map(lambda t: comm.all_to_all_rows(t, send_counts, recv_counts))
        me = comm.rank
        self.stats.add(
            dispatch_bytes_sent=(sum(send_counts) - send_counts[me]) * batch.row_bytes(),
            dispatch_bytes_received=(sum(recv_counts) - recv_counts[me]) * batch.row_bytes(),
            tokens_sent=sum(send_counts) - send_counts[me],
            tokens_received=sum(recv_counts) - recv_counts[me],
        )
        return received, _AllToAllState(token_of_row, send_counts, recv_counts)

    def _combine(self, partial, state, num_tokens, out=None):
        comm = self.comm
        back = comm.all_to_all_rows(partial, state.recv_counts, state.send_counts)  # [S, H]
        acc = torch.promote_types(partial.dtype, torch.float32)  # float32, float64 for float64
        out = torch.zeros(num_tokens, partial.shape[1], dtype=acc, device=partial.device)
        out.index_add_(0, state.token_of_row, back.to(acc))
        me, per_row = comm.rank, row_bytes(partial)
        self.stats.add(
            combine_bytes_sent=(sum(state.recv_counts) - state.recv_counts[me]) * per_row,
            combine_bytes_received=(sum(state.send_counts) - state.send_counts[me]) * per_row,
        )
        return out


__all__ = ["AllToAllEPPrepareFinalize"]
