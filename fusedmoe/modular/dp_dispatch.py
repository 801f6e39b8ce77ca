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
Only this module and the PrepareFinalize objects talk to a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GatheredTokens:
    x: torch.Tensor  # [R * M_max, H], every rank's tokens, each rank's block padded to M_max
    topk_weights: torch.Tensor  # float32 [R * M_max, k], 0 on padding rows
    topk_ids: torch.Tensor  # int32 [R * M_max, k], -1 on padding rows
    num_tokens: tuple[int, ...]  # M_r of each rank of the group
    rank: int  # this rank's index in the group

    @property
    def max_tokens(self) -> int:
        return max(self.num_tokens)


class AllGatherDispatch:
    """Dispatch by all-gather and combine by reduce-scatter over `group` (None: the default).

    dp_size / dp_rank: what the ParallelConfig says; checked against the group at each call.
    """

    def __init__(self, dp_size: int, dp_rank: int, group: object | None = None) -> None:
        self.dp_size, self.dp_rank, self.group = dp_size, dp_rank, group

    def _check_group(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"parallel_config.dp_size = {self.dp_size}: the DP dispatch needs "
                "torch.distributed initialized (init_process_group) on every rank"
            )
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (size, rank) != (self.dp_size, self.dp_rank):
            raise ValueError(
                f"parallel_config says dp_size={self.dp_size}, dp_rank={self.dp_rank}, but the "
                f"process group has size {size} and this process is rank {rank} in it"
            )

    def dispatch(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> GatheredTokens:
        self._check_group()
        num_tokens = topk_ids.shape[0]
        counts = torch.empty(self.dp_size, dtype=torch.int64, device=x.device)
        _all_gather(counts, torch.tensor([num_tokens], device=x.device), self.group)
        num_tokens_per_rank = tuple(int(c) for c in counts.tolist())  # one host sync
        pad = max(num_tokens_per_rank) - num_tokens
        x_pad = torch.nn.functional.pad(x, (0, 0, 0, pad))
        weights_pad = torch.nn.functional.pad(topk_weights.float(), (0, 0, 0, pad))
        ids_pad = torch.nn.functional.pad(topk_ids.to(torch.int32), (0, 0, 0, pad), value=-1)
        gathered = []
        for local in (x_pad, weights_pad, ids_pad):
            out = local.new_empty(self.dp_size * local.shape[0], *local.shape[1:])
            if out.numel():  # every rank idle: every rank skips (they all see the same counts)
                _all_gather(out, local.contiguous(), self.group)
            gathered.append(out)
        return GatheredTokens(*gathered, num_tokens=num_tokens_per_rank, rank=self.dp_rank)

    def combine(self, partial: torch.Tensor, gathered: GatheredTokens) -> torch.Tensor:
        """partial [R * M_max, H] (this rank's experts) -> the group's sum of this rank's rows."""
        max_tokens = gathered.max_tokens
        own = partial.new_empty(max_tokens, *partial.shape[1:])
        if own.numel():
            _reduce_scatter(own, partial.contiguous(), self.group)
        return own[: gathered.num_tokens[gathered.rank]]


def _all_gather(out: torch.Tensor, local: torch.Tensor, group) -> None:
    # the *_single names replace the *_tensor ones in recent torch (which warn on the old names)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, local, group=group)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, full, group=group)
