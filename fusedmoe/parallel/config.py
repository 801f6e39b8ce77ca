"""Parallel configuration and expert placement.

expert_map convention: int32 [E_global]; expert_map[g] is the local index of global expert g
on this rank, or -1 when g lives on another rank.

How tokens and experts are spread (the same for every backend):
    ep_size == 1                every rank holds every expert; tokens stay on their rank
    ep_size == dp_size > 1      each rank has its own tokens (any count, zero included) and
                                holds its share of the experts; tokens travel to the experts
                                (all2all_backend) and the layer returns each rank's own
                                tokens' full output
    ep_size > 1, dp_size == 1   every rank has the same tokens:
        sequence_parallel=False the layer returns this rank's partial sum (an all-reduce over
                                the group completes it)
        sequence_parallel=True  each rank takes a slice of the tokens, dispatches it, and the
                                slices' outputs are all-gathered: every rank gets the full output
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedmoe._checks import INDEX_DTYPES, check_tensor
from fusedmoe.parallel.placement import PLACEMENTS

#: how tokens travel to their experts' ranks (fusedmoe.parallel.wiring.resolve_dispatch):
#: "auto" takes symm_mem on CUDA where NVSHMEM runs, naive elsewhere
ALL2ALL_BACKENDS = ("auto", "naive", "all_to_all", "symm_mem")
DEFAULT_MAX_TOKENS_PER_RANK = 1024


@dataclass(frozen=True)
class ParallelConfig:
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    all2all_backend: str = "auto"
    group: object | None = None  # a torch.distributed ProcessGroup, or None for the default
    placement: str = "linear"  # "linear" or "round_robin" (fusedmoe.parallel.placement)
    num_redundant_experts: int = 0  # EPLB replicas beyond the E logical experts
    #: the symm_mem dispatch: the most tokens a rank passes in one call (its buffers and the
    #: experts' workspaces hold ep_size * max_tokens_per_rank rows; more is a ValueError)
    max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK

    def __post_init__(self) -> None:
        for size_name, rank_name in (
            ("ep_size", "ep_rank"),
            ("dp_size", "dp_rank"),
            ("tp_size", "tp_rank"),
        ):
            size, rank = getattr(self, size_name), getattr(self, rank_name)
            for name, value in ((size_name, size), (rank_name, rank)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"ParallelConfig.{name} must be an int, got {value!r}")
            if size < 1:
                raise ValueError(f"ParallelConfig.{size_name} must be >= 1, got {size}")
            if not 0 <= rank < size:
                raise ValueError(f"ParallelConfig.{rank_name} must be in [0, {size}), got {rank}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(
                f"ParallelConfig.all2all_backend must be one of {ALL2ALL_BACKENDS}, "
                f"got {self.all2all_backend!r}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"ParallelConfig.placement must be one of {PLACEMENTS}, got {self.placement!r}"
            )
        value = self.num_redundant_experts
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"ParallelConfig.num_redundant_experts must be an int >= 0, got {value!r}"
            )
        value = self.max_tokens_per_rank
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"ParallelConfig.max_tokens_per_rank must be an int >= 1, got {value!r}"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(
                f"ParallelConfig.sequence_parallel must be a bool, got {self.sequence_parallel!r}"
            )
        if self.sequence_parallel and (self.ep_size == 1 or self.dp_size > 1):
            raise ValueError(
                "ParallelConfig.sequence_parallel splits tokens that every rank of the EP group "
                f"shares: it needs ep_size > 1 and dp_size == 1, got ep_size={self.ep_size}, "
                f"dp_size={self.dp_size}"
            )

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1

    @property
    def moves_tokens(self) -> bool:
        """Whether tokens travel between ranks to reach their experts (an EP dispatch)."""
        return self.use_ep and (self.dp_size == self.ep_size or self.sequence_parallel)

    @classmethod
    def from_process_group(
        cls,
        group=None,
        all2all_backend: str = "auto",
        *,
        data_parallel: bool = False,
        sequence_parallel: bool = False,
        placement: str = "linear",
        num_redundant_experts: int = 0,
        max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
    ) -> ParallelConfig:
        """Expert parallelism over `group` (the default group when None): size and rank from it.

        data_parallel: each rank has its own tokens (dp_size = ep_size = the group's size);
        otherwise the ranks share their tokens (see the module docstring for both).
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ParallelConfig.from_process_group needs torch.distributed initialized"
            )
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return cls(
            ep_size=size,
            ep_rank=rank,
            dp_size=size if data_parallel else 1,
            dp_rank=rank if data_parallel else 0,
            sequence_parallel=sequence_parallel,
            all2all_backend=all2all_backend,
            group=group,
            placement=placement,
            num_redundant_experts=num_redundant_experts,
            max_tokens_per_rank=max_tokens_per_rank,
        )


def linear_expert_map(num_experts: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    """Contiguous placement: the first num_experts % ep_size ranks take one extra expert."""
    base, extra = divmod(num_experts, ep_size)
    count = base + (1 if ep_rank < extra else 0)
    start = ep_rank * base + min(ep_rank, extra)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[start : start + count] = torch.arange(count, dtype=torch.int32)
    return expert_map


def round_robin_expert_map(num_experts: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    """Round-robin placement: global expert g lives on rank g % ep_size, at local g // ep_size."""
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    mine = torch.arange(ep_rank, num_experts, ep_size)
    expert_map[mine] = torch.arange(mine.numel(), dtype=torch.int32)
    return expert_map


def get_compressed_expert_map(expert_map: torch.Tensor) -> str:
    """The experts on this rank as 'local->global' pairs: '0->5, 1->12'."""
    check_tensor("expert_map", expert_map, ndim=1, dtypes=INDEX_DTYPES)
    local = expert_map.cpu().tolist()
    pairs = sorted((lid, gid) for gid, lid in enumerate(local) if lid >= 0)
    return ", ".join(f"{lid}->{gid}" for lid, gid in pairs)
