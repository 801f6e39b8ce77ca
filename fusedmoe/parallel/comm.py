"""The collectives of the EP prepare/finalize objects, over one torch.distributed group.

Legend: R ranks in the group, n_r rows of rank r, n_max = max_r n_r, [n, ...] any row shape.

    all_gather_rows      rows [n_r, ...] of every rank -> [R * n_max, ...], rank r's at
                         [r * n_max, r * n_max + n_r) (uneven counts: each block padded)
    reduce_scatter_rows  [R * n_max, ...] on every rank -> the sum of block `rank`, [n_max, ...]
    all_to_all_rows      rows sorted by destination, send_counts[r] to rank r -> the rows every
                         rank sent here, sorted by source (all_to_all_single with split sizes)

The same calls run on NCCL (GPU) and gloo (CPU). What torch 2.13's gloo lacks is worked
around here: it has no list all_gather of uneven sizes (we pad every block to n_max and use
all_gather_into_tensor) and no reduce-scatter of uneven sizes (padded the same way), and no
FP8 dtypes (FP8 tensors travel as their uint8 bytes, on NCCL as well: a byte is a byte).
Every rank must make the same calls in the same order, idle ranks (n_r = 0) included.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

_FP8 = {
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
}


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor every backend of torch.distributed can move (FP8 as uint8 bytes)."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def row_bytes(t: torch.Tensor | None) -> int:
    """Bytes of one row of t (0 for None)."""
    if t is None or t.dim() == 0:
        return 0
    numel = 1
    for size in t.shape[1:]:
        numel *= size
    return numel * t.element_size()


@dataclass
class EPCommStats:
    """Bytes and token copies that crossed between ranks (a rank's own rows excluded), summed
    over the calls since the last reset. Naive counts the padded blocks it really moves."""

    calls: int = 0
    dispatch_bytes_sent: int = 0
    dispatch_bytes_received: int = 0
    combine_bytes_sent: int = 0
    combine_bytes_received: int = 0
    tokens_sent: int = 0  # token copies sent to other ranks
    tokens_received: int = 0  # token copies received from other ranks

    def add(self, **counts: int) -> None:
        for name, value in counts.items():
            setattr(self, name, getattr(self, name) + int(value))

    @property
    def bytes_sent(self) -> int:
        return self.dispatch_bytes_sent + self.combine_bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.dispatch_bytes_received + self.combine_bytes_received

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class EPGroup:
    """The group a prepare/finalize talks to: size and rank as the ParallelConfig says,
    checked against torch.distributed at each call (check)."""

    def __init__(self, size: int, rank: int, group: object | None = None) -> None:
        self.size, self.rank, self.group = size, rank, group

    def check(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs torch.distributed initialized "
                "(init_process_group, e.g. under torchrun) on every rank"
            )
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (size, rank) != (self.size, self.rank):
            raise ValueError(
                f"parallel_config says ep_size={self.size}, ep_rank={self.rank}, but the process "
                f"group has size {size} and this process is rank {rank} in it"
            )

    # ---- counts (one small collective and one host sync each) ----
    def all_gather_counts(self, count: int, device: torch.device) -> tuple[int, ...]:
        counts = torch.empty(self.size, dtype=torch.int64, device=device)
        _all_gather(counts, torch.tensor([count], dtype=torch.int64, device=device), self.group)
        return tuple(int(c) for c in counts.tolist())

    def max_over_ranks(self, count: int, device: torch.device) -> int:
        value = torch.tensor([count], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return int(value.item())

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """int64 [R] rows this rank sends to each rank -> int64 [R] rows it receives from each."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts.contiguous(), group=self.group)
        return recv

    # ---- rows ----
    def all_gather_rows(self, local: torch.Tensor, max_rows: int) -> torch.Tensor:
        """local [n_r, ...] -> [R * max_rows, ...]; padding rows hold zeros."""
        pad = max_rows - local.shape[0]
        if pad:
            local = torch.cat([local, local.new_zeros(pad, *local.shape[1:])])
        out = local.new_empty(self.size * max_rows, *local.shape[1:])
        if out.numel():  # every rank sees the same max_rows: all skip together
            _all_gather(to_wire(out), to_wire(local), self.group)
        return out

    def reduce_scatter_rows(self, full: torch.Tensor) -> torch.Tensor:
        """full [R * n_max, ...] -> the group's sum of rows [rank * n_max, (rank + 1) * n_max)."""
        out = full.new_empty(full.shape[0] // self.size, *full.shape[1:])
        if out.numel():
            _reduce_scatter(out, full.contiguous(), self.group)
        return out

    def all_to_all_rows(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """send [sum(send_counts), ...] grouped by destination -> [sum(recv_counts), ...]."""
        out = send.new_empty(sum(recv_counts), *send.shape[1:])
        # every rank joins, with nothing to send too (it may receive)
        dist.all_to_all_single(
            to_wire(out),
            to_wire(send),
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=self.group,
        )
        return out

    def __repr__(self) -> str:
        return f"EPGroup(size={self.size}, rank={self.rank})"


def _all_gather(out: torch.Tensor, local: torch.Tensor, group) -> None:
    # the *_single names replace the *_tensor ones in recent torch (which warn on the old names)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, local, group=group)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, full, group=group)
