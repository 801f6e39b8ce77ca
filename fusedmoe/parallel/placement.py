"""Expert placement: which rank holds which expert, with redundant replicas (EPLB).

Legend: E logical experts (the router's), P >= E physical experts (E plus R redundant
replicas), R_ep ranks of the EP group, E_l physical experts on one rank.

    physical expert p computes logical expert physical_to_logical[p] and lives on rank
    physical_rank[p]; a rank keeps its physical experts in ascending p order, so
    expert_map(rank)[p] = local index of p on `rank`, or -1 when p lives elsewhere.

Strategies for the initial placement (expert_placement):
    linear       contiguous blocks: the first P % R_ep ranks take one extra expert
    round_robin  physical expert p on rank p % R_ep (neighbouring experts on different ranks)
Redundant replica p >= E computes logical expert p % E at first; fusedmoe.parallel.eplb.rebalance
proposes a placement from measured loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

PLACEMENTS = ("linear", "round_robin")


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class ExpertPlacement:
    """Where every physical expert lives and which logical expert it computes."""

    num_logical: int  # E, the experts the router picks among
    ep_size: int  # R_ep
    physical_to_logical: tuple[int, ...]  # [P], values in [0, E); every logical at least once
    physical_rank: tuple[int, ...]  # [P], values in [0, R_ep); every rank at least once

    def __post_init__(self) -> None:
        _check_count("num_logical", self.num_logical, 1)
        _check_count("ep_size", self.ep_size, 1)
        p2l, ranks = tuple(self.physical_to_logical), tuple(self.physical_rank)
        object.__setattr__(self, "physical_to_logical", p2l)
        object.__setattr__(self, "physical_rank", ranks)
        if len(p2l) != len(ranks):
            raise ValueError(
                f"physical_to_logical ({len(p2l)}) and physical_rank ({len(ranks)}) must have "
                "one entry per physical expert"
            )
        if len(p2l) < self.num_logical:
            raise ValueError(
                f"{len(p2l)} physical experts cannot hold {self.num_logical} logical experts"
            )
        if sorted(set(p2l)) != list(range(self.num_logical)):
            missing = sorted(set(range(self.num_logical)) - set(p2l))
            raise ValueError(
                f"physical_to_logical must name every logical expert in [0, {self.num_logical}) "
                f"and nothing else; missing {missing[:8]}, got values outside: "
                f"{sorted(v for v in set(p2l) if not 0 <= v < self.num_logical)[:8]}"
            )
        if sorted(set(ranks)) != list(range(self.ep_size)):
            raise ValueError(
                f"physical_rank must give every rank of [0, {self.ep_size}) at least one expert "
                f"and name no other rank, got ranks {sorted(set(ranks))[:8]}"
            )

    # ---- sizes ----
    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    def num_local(self, rank: int) -> int:
        return len(self.local_physical(rank))

    # ---- per rank ----
    def local_physical(self, rank: int) -> tuple[int, ...]:
        """The physical ids on `rank`, in local order (ascending)."""
        self._check_rank(rank)
        return self._by_rank[rank]

    def local_logical(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each local slot of `rank`: [E_l]."""
        return tuple(self.physical_to_logical[p] for p in self.local_physical(rank))

    def expert_map(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 [P]: local index of each physical expert on `rank`, -1 where it is elsewhere."""
        expert_map = torch.full((self.num_physical,), -1, dtype=torch.int32)
        local = torch.tensor(self.local_physical(rank), dtype=torch.long)
        expert_map[local] = torch.arange(local.numel(), dtype=torch.int32)
        return expert_map.to(device) if device is not None else expert_map

    def owner(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 [P]: the rank of each physical expert (the all-to-all dispatch's send map)."""
        return torch.tensor(self.physical_rank, dtype=torch.int32, device=device)

    def contiguous_start(self, rank: int) -> int | None:
        """The first id of `rank`'s experts when they are the logical block [s, s + E_l) with
        no replicas (what a backend that shifts ids instead of mapping them can run), else None."""
        if self.num_redundant:
            return None
        local = self.local_physical(rank)
        start = local[0]
        return start if local == tuple(range(start, start + len(local))) else None

    # ---- replicas ----
    @property
    def has_replicas(self) -> bool:
        return self.num_redundant > 0

    def replica_table(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical_to_physical int32 [E, max replicas], replica_count int32 [E]): row e lists
        the physical replicas of e (ascending), padded with its first replica."""
        replicas: list[list[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self.physical_to_logical):
            replicas[e].append(p)
        width = max(len(r) for r in replicas)
        table = [r + [r[0]] * (width - len(r)) for r in replicas]
        counts = [len(r) for r in replicas]
        return (
            torch.tensor(table, dtype=torch.int32, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device),
        )

    def describe(self, rank: int) -> str:
        """This rank's experts for logs: 'local->physical(logical)' pairs."""
        return ", ".join(
            f"{i}->{p}" + (f"({self.physical_to_logical[p]})" if self.has_replicas else "")
            for i, p in enumerate(self.local_physical(rank))
        )

    @cached_property
    def _by_rank(self) -> tuple[tuple[int, ...], ...]:
        by_rank: list[list[int]] = [[] for _ in range(self.ep_size)]
        for p, r in enumerate(self.physical_rank):
            by_rank[r].append(p)
        return tuple(tuple(r) for r in by_rank)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.ep_size:
            raise ValueError(f"rank must be an int in [0, {self.ep_size}), got {rank!r}")


def expert_placement(
    num_experts: int,
    ep_size: int = 1,
    placement: str = "linear",
    num_redundant_experts: int = 0,
) -> ExpertPlacement:
    """The initial placement of E logical experts plus R redundant replicas over ep_size ranks.

    Replica p >= E computes logical expert p % E; ranks by `placement` (see the module doc).
    """
    _check_count("num_experts", num_experts, 1)
    _check_count("ep_size", ep_size, 1)
    _check_count("num_redundant_experts", num_redundant_experts, 0)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    num_physical = num_experts + num_redundant_experts
    if ep_size > num_physical:
        raise ValueError(
            f"ep_size ({ep_size}) must be <= the number of physical experts ({num_physical}): "
            "every rank holds at least one expert"
        )
    if placement == "linear":
        base, extra = divmod(num_physical, ep_size)
        ranks = []
        for r in range(ep_size):
            ranks += [r] * (base + (1 if r < extra else 0))
    else:
        ranks = [p % ep_size for p in range(num_physical)]
    return ExpertPlacement(
        num_logical=num_experts,
        ep_size=ep_size,
        physical_to_logical=tuple(p % num_experts for p in range(num_physical)),
        physical_rank=tuple(ranks),
    )


__all__ = ["PLACEMENTS", "ExpertPlacement", "expert_placement"]
