"""All-gather dispatch and reduce combine over a data-parallel group whose ranks hold different
experts (expert parallelism over the DP group), for a backend that routes inside.

Legend: R ranks in the group, M_r tokens of rank r, M_max = max_r M_r, k top-k, H hidden.

    dispatch: each rank's routed tokens (x [M_r, H], topk_weights [M_r, k], topk_ids [M_r, k])
              -> every rank's, rank r's at rows [r * M_max, r * M_max + M_r) of
                 x [R * M_max, H]; padding rows get id -1 and weight 0 (empty slots)
    combine:  this rank's experts' output for every token, float32 [R * M_max, H]
              -> summed over the group (reduce-scatter) -> this rank's rows [M_r, H]

Each rank routes its own tokens before the dispatch, so the ids and weights travel with x. Every
rank must call dispatch and combine, with zero tokens too (a collective waits for all ranks).
Only this module and the PrepareFinalize objects talk to a process group. The seam it
implements (TokenDispatch, GatheredTokens) is modular's: the backend never imports this module.
"""

from __future__ import annotations

import torch

from fusedmoe.modular.types import GatheredTokens, TokenDispatch
from fusedmoe.parallel.comm import EPGroup

__all__ = ["AllGatherDispatch"]


class AllGatherDispatch(TokenDispatch):
    """Dispatch by all-gather and combine by reduce-scatter over `group` (None: the default),
    through the EP collectives (fusedmoe.parallel.comm.EPGroup).

    dp_size / dp_rank: what the ParallelConfig says; checked against the group at each call.
    """

    def __init__(self, dp_size: int, dp_rank: int, group: object | None = None) -> None:
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.comm = EPGroup(dp_size, dp_rank, group)

    def dispatch(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> GatheredTokens:
        self.comm.check()
        num_tokens_per_rank = self.comm.all_gather_counts(topk_ids.shape[0], x.device)
        max_rows = max(num_tokens_per_rank)
        pad = max_rows - topk_ids.shape[0]
        # padding slots are empty (-1); all_gather_rows pads x and the weights with zeros
        ids = torch.nn.functional.pad(topk_ids.to(torch.int32), (0, 0, 0, pad), value=-1)
        gathered = [
            self.comm.all_gather_rows(t.contiguous(), max_rows)
            for t in (x, topk_weights.float(), ids)
        ]
        return GatheredTokens(*gathered, num_tokens=num_tokens_per_rank, rank=self.dp_rank)

    def combine(self, partial: torch.Tensor, gathered: GatheredTokens) -> torch.Tensor:
        """partial [R * M_max, H] (this rank's experts) -> the group's sum of this rank's rows."""
        return self.comm.reduce_scatter_rows(partial)[: gathered.num_tokens[gathered.rank]]
