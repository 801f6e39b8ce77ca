"""EPLB: expert-parallel load balancing with redundant experts.

Legend: M tokens, k top-k, E logical experts, P = E + R physical experts (R redundant
replicas), W the most replicas of one expert, R_ep ranks.

    map_to_physical     logical ids [M, k] -> physical ids [M, k]: token m takes replica
                        m % replica_count[e] of expert e (deterministic; spreads the tokens of a
                        hot expert evenly over its replicas); no host sync
    record_expert_load  load[e] += number of slots routed to logical expert e; no host sync
    rebalance           loads [E] -> a proposed ExpertPlacement: replicate the hottest experts
                        (each extra replica to one of the experts with the highest load per
                        replica, the one that packs best), then pack the replicas onto the
                        ranks heaviest first, each to the least loaded rank with a free slot
                        (avoiding two replicas of one expert on a rank where it can); the
                        current placement stays unless the proposal is strictly better
    apply_placement     move a FusedMoE layer's expert tensors to a new placement: local copies,
                        and point-to-point send / recv from the rank that holds each expert
    rebalance_layer     the whole step: sum the loads over the group, rebalance, move, reset

Every function here is deterministic, so every rank computes the same placement from the same
loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusedmoe.parallel.placement import ExpertPlacement

#: the FusedMoE tensors with one row per local physical expert (moved by apply_placement)
EXPERT_TENSORS = (
    "w13_weight",
    "w2_weight",
    "w13_bias",
    "w2_bias",
    "w13_weight_scale",
    "w2_weight_scale",
    "w13_weight_global_scale",
    "w2_weight_global_scale",
    "w13_weight_zero_point",
    "w2_weight_zero_point",
)


def map_to_physical(
    topk_ids: torch.Tensor, logical_to_physical: torch.Tensor, replica_count: torch.Tensor
) -> torch.Tensor:
    """topk_ids [M, k] logical (-1: empty slot) -> physical ids [M, k], same dtype.

    logical_to_physical int [E, W], replica_count int [E] (ExpertPlacement.replica_table).
    """
    ids = topk_ids.long()
    valid = ids >= 0
    logical = ids.clamp(min=0)
    token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)  # [M, 1]
    replica = token % replica_count.long()[logical]  # [M, k]
    physical = logical_to_physical.long()[logical, replica]
    return torch.where(valid, physical, -1).to(topk_ids.dtype)


def map_to_physical_ref(
    topk_ids: torch.Tensor, placement: ExpertPlacement
) -> torch.Tensor:  # the twin: plain loops
    replicas = [
        [p for p, e in enumerate(placement.physical_to_logical) if e == logical]
        for logical in range(placement.num_logical)
    ]
    out = topk_ids.clone()
    for m in range(topk_ids.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[m, j])
            if e >= 0:
                out[m, j] = replicas[e][m % len(replicas[e])]
    return out


def record_expert_load(load: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """load int64 [E] += the slots of topk_ids routed to each expert (ids outside [0, E), the
    empty slots and zero experts, are not counted). In place, no host sync."""
    ids = topk_ids.reshape(-1).long()
    num_experts = load.shape[0]
    counted = ((ids >= 0) & (ids < num_experts)).to(load.dtype)
    load.index_add_(0, ids.clamp(0, num_experts - 1), counted)


def _as_loads(load: torch.Tensor | Sequence[float]) -> list[float]:
    if isinstance(load, torch.Tensor):
        if load.dim() != 1:
            raise ValueError(f"load must be [E], got shape {tuple(load.shape)}")
        values = [float(v) for v in load.detach().cpu().double().tolist()]
    else:
        values = [float(v) for v in load]
    if not values:
        raise ValueError("load must name at least one expert")
    if any(not v >= 0 for v in values):  # negative or NaN
        raise ValueError("load must hold non-negative counts")
    return values


def rebalance(
    load: torch.Tensor | Sequence[float],
    num_physical: int,
    ep_size: int,
    current: ExpertPlacement | None = None,
) -> ExpertPlacement:
    """Propose a placement of E = len(load) logical experts as num_physical physical ones over
    ep_size ranks (linear slot counts: the first num_physical % ep_size ranks hold one more).

    Each extra replica goes to one of the few experts with the highest load per replica: the
    one whose packing leaves the lightest heaviest rank. current: the placement in use; it is
    kept (returned) unless the proposal balances the load strictly better.
    """
    loads = _as_loads(load)
    num_logical = len(loads)
    for name, value in (("num_physical", num_physical), ("ep_size", ep_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_physical < num_logical:
        raise ValueError(f"num_physical ({num_physical}) must be >= len(load) ({num_logical})")
    if not 1 <= ep_size <= num_physical:
        raise ValueError(f"ep_size must be in [1, num_physical={num_physical}], got {ep_size}")

    base, extra = divmod(num_physical, ep_size)
    slots = [base + (1 if r < extra else 0) for r in range(ep_size)]
    replicas = [1] * num_logical
    for added in range(num_physical - num_logical):
        hottest = sorted(range(num_logical), key=lambda e: (-loads[e] / replicas[e], e))
        best, best_key = None, None
        for e in hottest[:_CANDIDATES]:
            trial = list(replicas)
            trial[e] += 1
            # pack as if every replica left were placed too (fills the slots like the end state)
            _, rank_load = _pack(loads, trial, slots, num_physical - num_logical - added - 1)
            key = (max(rank_load), -loads[e] / replicas[e], e)
            if best_key is None or key < best_key:
                best, best_key = e, key
        replicas[best] += 1
    holds, _ = _pack(loads, replicas, slots, 0)

    physical_to_logical, physical_rank = [], []
    for rank, experts in enumerate(holds):  # physical ids rank by rank, logical order within
        physical_to_logical += sorted(experts)
        physical_rank += [rank] * len(experts)
    proposal = ExpertPlacement(
        num_logical, ep_size, tuple(physical_to_logical), tuple(physical_rank)
    )
    if current is not None and imbalance(loads, current) <= imbalance(loads, proposal):
        return current
    return proposal


_CANDIDATES = 4  # experts tried for each extra replica


def _pack(
    loads: list[float], replicas: list[int], slots: list[int], spare: int
) -> tuple[list[list[int]], list[float]]:
    """Replicas (each carrying load / count) onto ranks, heaviest first, each to the least
    loaded rank with a free slot (one without that expert where it can); `spare` slots are
    left free (the replicas not decided yet). -> (experts of each rank, load of each rank)."""
    free = list(slots)
    for _ in range(spare):  # keep the spare slots on the fullest ranks: they fill last
        free[max(range(len(free)), key=lambda r: (free[r], -r))] -= 1
    rank_load = [0.0] * len(slots)
    holds: list[list[int]] = [[] for _ in slots]
    items = sorted(
        ((loads[e] / replicas[e], e) for e in range(len(loads)) for _ in range(replicas[e])),
        key=lambda item: (-item[0], item[1]),
    )
    for share, expert in items:
        open_ranks = [r for r in range(len(slots)) if free[r]]
        fresh = [r for r in open_ranks if expert not in holds[r]] or open_ranks
        rank = min(fresh, key=lambda r: (rank_load[r], r))
        holds[rank].append(expert)
        rank_load[rank] += share
        free[rank] -= 1
    return holds, rank_load


def rank_loads(load: torch.Tensor | Sequence[float], placement: ExpertPlacement) -> list[float]:
    """The load each rank would carry under `placement` (an expert's load split evenly over
    its replicas, as map_to_physical spreads the tokens)."""
    loads = _as_loads(load)
    if len(loads) != placement.num_logical:
        raise ValueError(f"load has {len(loads)} experts, the placement {placement.num_logical}")
    counts = [0] * placement.num_logical
    for e in placement.physical_to_logical:
        counts[e] += 1
    per_rank = [0.0] * placement.ep_size
    for p, e in enumerate(placement.physical_to_logical):
        per_rank[placement.physical_rank[p]] += loads[e] / counts[e]
    return per_rank


def imbalance(load: torch.Tensor | Sequence[float], placement: ExpertPlacement) -> float:
    """max rank load / mean rank load (1.0 is perfect balance)."""
    per_rank = rank_loads(load, placement)
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0


def _sources(old: ExpertPlacement, new: ExpertPlacement) -> list[list[tuple[int, int]]]:
    """For each rank and each of its new local slots: (source rank, source local slot) of a
    replica of the same logical expert in `old` (the rank's own when it has one)."""
    holders: dict[int, list[tuple[int, int]]] = {}
    for rank in range(old.ep_size):
        for slot, e in enumerate(old.local_logical(rank)):
            holders.setdefault(e, []).append((rank, slot))
    plan = []
    for rank in range(new.ep_size):
        slots = []
        for e in new.local_logical(rank):
            own = [h for h in holders[e] if h[0] == rank]
            slots.append(own[0] if own else holders[e][0])
        plan.append(slots)
    return plan


@torch.no_grad()
def apply_placement(layer, placement: ExpertPlacement) -> None:
    """Move `layer`'s (a FusedMoE) local experts to `placement`, on every rank of its EP group.

    Local copies where the rank already holds the expert, else a send / recv from the first
    rank that holds it (batch_isend_irecv; FP8 as bytes). Every rank of the group must call it
    with the same placement.
    """
    old = layer.placement
    pc = layer.parallel_config
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"placement must be an ExpertPlacement, got {type(placement).__name__}")
    if (placement.num_logical, placement.ep_size) != (old.num_logical, old.ep_size):
        raise ValueError(
            f"placement is for {placement.num_logical} experts over {placement.ep_size} ranks, "
            f"the layer has {old.num_logical} over {old.ep_size}"
        )
    if placement.num_physical != old.num_physical:
        raise ValueError(
            f"placement has {placement.num_physical} physical experts, the layer "
            f"{old.num_physical} (parallel_config.num_redundant_experts fixes it)"
        )
    plan = _sources(old, placement)
    me = pc.ep_rank
    num_old = old.num_local(me)
    for name in EXPERT_TENSORS:
        tensor = getattr(layer, name, None)
        if tensor is None:
            continue
        assert tensor.shape[0] == num_old, f"{name}: {tuple(tensor.shape)} vs {num_old} experts"
        moved = _move_rows(tensor.detach(), plan, me, pc)
        if isinstance(tensor, torch.nn.Parameter):
            setattr(layer, name, torch.nn.Parameter(moved, requires_grad=tensor.requires_grad))
        else:
            layer.register_buffer(name, moved)
    layer._set_placement(placement)


def _move_rows(old_rows: torch.Tensor, plan, me: int, pc) -> torch.Tensor:
    """The rows of this rank's new slots, from the `plan` of _sources."""
    new_rows = old_rows.new_empty(len(plan[me]), *old_rows.shape[1:])
    ops = []
    for tag, (dst, slot, src, src_slot) in enumerate(
        (dst, slot, src, src_slot)
        for dst, slots in enumerate(plan)
        for slot, (src, src_slot) in enumerate(slots)
    ):
        if dst == src == me:
            new_rows[slot] = old_rows[src_slot]
        elif src == me:
            ops.append(("send", old_rows[src_slot], dst, tag))
        elif dst == me:
            ops.append(("recv", new_rows[slot], src, tag))
    if ops:  # only under EP: torch.distributed is imported when something travels
        import torch.distributed as dist

        from fusedmoe.parallel.comm import to_wire

        p2p = [
            dist.P2POp(
                dist.isend if kind == "send" else dist.irecv, to_wire(t), peer, pc.group, tag
            )
            for kind, t, peer, tag in ops
        ]
        for request in dist.batch_isend_irecv(p2p):
            request.wait()
    return new_rows


def gather_expert_load(layer) -> torch.Tensor:
    """The layer's expert_load summed over the ranks that routed different tokens (the EP
    group when tokens travel; a rank's own count when the ranks share their tokens)."""
    load = layer.expert_load.clone()
    pc = layer.parallel_config
    if pc.moves_tokens and not pc.sequence_parallel:
        import torch.distributed as dist

        dist.all_reduce(load, group=pc.group)
    return load


def rebalance_layer(layer) -> ExpertPlacement:
    """Sum the loads, propose a placement, move the experts to it, reset the counters."""
    load = gather_expert_load(layer)
    current = layer.placement
    placement = rebalance(load, current.num_physical, current.ep_size, current=current)
    if placement is not current:
        apply_placement(layer, placement)
    layer.expert_load.zero_()
    return placement


__all__ = [
    "EXPERT_TENSORS",
    "apply_placement",
    "gather_expert_load",
    "imbalance",
    "map_to_physical",
    "map_to_physical_ref",
    "rank_loads",
    "rebalance",
    "rebalance_layer",
    "record_expert_load",
]
