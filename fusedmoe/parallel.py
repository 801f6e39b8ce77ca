"""Parallel configuration and expert placement.

expert_map convention: int32 [E_global]; expert_map[g] is the local index of global expert g
on this rank, or -1 when g lives on another rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedmoe._checks import INDEX_DTYPES, check_tensor

ALL2ALL_BACKENDS = ("naive", "all_to_all")


@dataclass(frozen=True)
class ParallelConfig:
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    all2all_backend: str = "naive"
    group: object | None = None  # a torch.distributed ProcessGroup, or None for the default

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

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1

    @classmethod
    def from_process_group(cls, group=None, all2all_backend: str = "naive") -> ParallelConfig:
        """Expert parallelism over `group` (the default group when None): size and rank from it."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ParallelConfig.from_process_group needs torch.distributed initialized"
            )
        return cls(
            ep_size=dist.get_world_size(group),
            ep_rank=dist.get_rank(group),
            all2all_backend=all2all_backend,
            group=group,
        )


def linear_expert_map(num_experts: int, ep_size: int, ep_rank: int) -> torch.Tensor:
    """Contiguous placement: the first num_experts % ep_size ranks take one extra expert."""
    base, extra = divmod(num_experts, ep_size)
    count = base + (1 if ep_rank < extra else 0)
    start = ep_rank * base + min(ep_rank, extra)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[start : start + count] = torch.arange(count, dtype=torch.int32)
    return expert_map


def get_compressed_expert_map(expert_map: torch.Tensor) -> str:
    """The experts on this rank as 'local->global' pairs: '0->5, 1->12'."""
    check_tensor("expert_map", expert_map, ndim=1, dtypes=INDEX_DTYPES)
    local = expert_map.cpu().tolist()
    pairs = sorted((lid, gid) for gid, lid in enumerate(local) if lid >= 0)
    return ", ".join(f"{lid}->{gid}" for lid, gid in pairs)
