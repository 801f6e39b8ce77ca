"""The collectives of the EP prepare/finalize objects, over one torch.distributed group.

Legend: R ranks in the group, n_r rows of rank r, n_max = max_r n_r, [n, ...] any row shape.

    all_gather_rows      rows [n_r, ...] of every rank -> [R * n_max, ...], rank r's at
                         [r * n_max, r * n_max + n_r) (uneven counts: each block padded)
    reduce_scatter_rows  [R * n_max, ...] on every rank -> the sum of block `rank`, [n_max, ...]
    all_to_all_rows      rows sorted by destination, send_counts[r] to rank r -> the rows every
                         rank sent here, sorted by source (all_to_all_single with split sizes)
    own_rows             [sum_r n_r, ...], the same on every rank -> rank's rows, [n_rank, ...]
                         (sequence parallel; no communication)

The same calls run on NCCL (GPU) and gloo (CPU). What torch 2.13's gloo lacks is worked
around here: it has no list all_gather of uneven sizes (we pad every block to n_max and use
all_gather_into_tensor) and no reduce-scatter of uneven sizes (padded the same way), and no
FP8 dtypes (FP8 tensors travel as their uint8 bytes, on NCCL as well: a byte is a byte).
Every rank must make the same calls in the same order, idle ranks (n_r = 0) included.

Under autograd (grad mode on and a float input that requires grad) each collective is a
torch.autograd.Function whose backward is its adjoint, itself a collective:

    all_gather_rows      -> reduce-scatter of the gradient rows (every rank used rank r's rows
                            to make its partial result: their gradient is the sum), padding
                            rows dropped; with replicated_grad (the output's gradient is the
                            same on every rank) -> this rank's block of it, no communication
    reduce_scatter_rows  -> all-gather of the gradient (each rank's block reached the sum once)
    all_to_all_rows      -> the reverse all_to_all (send and receive counts swapped)
    own_rows             -> all-gather of the slices' gradients (sequence parallel: the input is
                            replicated, so is its gradient)

Backward then runs these collectives too, so every rank must reach each one: autograd runs
the nodes it reaches (on one device) in decreasing creation order, hence in the same order on
every rank when every rank created the same collective nodes (tie keeps a node reachable
where no gradient path leads to it). Integer tensors and tensors without grad take the plain
path, exactly as in inference (no extra cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from fusedmoe.parallel.fingerprint import LayerFingerprint, disagreement

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
        #: what every rank's layer must share (fusedmoe.parallel.fingerprint): compared with
        #: each count exchange below; None: nothing compared
        self.fingerprint: LayerFingerprint | None = None

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
        """Every rank's count, with the fingerprints compared (ValueError where they differ:
        every rank sees the same table, so every rank raises)."""
        codes = [] if self.fingerprint is None else self.fingerprint.codes()
        mine = torch.tensor([count, *codes], dtype=torch.int64, device=device)
        table = torch.empty(self.size, mine.numel(), dtype=torch.int64, device=device)
        _all_gather(table.view(-1), mine, self.group)
        rows = table.tolist()
        if self.fingerprint is not None:
            why = disagreement([row[1:] for row in rows], self.fingerprint, self.rank)
            if why is not None:
                raise ValueError(why)
        return tuple(int(row[0]) for row in rows)

    def max_over_ranks(self, count: int, device: torch.device) -> int:
        return max(self.all_gather_counts(count, device))

    def agree(self, device: torch.device) -> None:
        """Compare the fingerprints once (a collective and a host sync), for a dispatch whose
        calls exchange nothing on the host."""
        if self.fingerprint is not None:
            self.all_gather_counts(0, device)

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """int64 [R] rows this rank sends to each rank -> int64 [R] rows it receives from each,
        the fingerprints compared on the way (one all-gather of every rank's counts and codes:
        a host read, as the caller makes anyway)."""
        if self.fingerprint is None:
            recv = torch.empty_like(send_counts)
            dist.all_to_all_single(recv, send_counts.contiguous(), group=self.group)
            return recv
        codes = torch.tensor(self.fingerprint.codes(), dtype=torch.int64)
        mine = torch.cat([send_counts.long(), codes.to(send_counts.device)])
        table = torch.empty(self.size, mine.numel(), dtype=torch.int64, device=mine.device)
        _all_gather(table.view(-1), mine, self.group)
        rows = table.tolist()
        why = disagreement([row[self.size :] for row in rows], self.fingerprint, self.rank)
        if why is not None:
            raise ValueError(why)
        return table[:, self.rank].contiguous()

    # ---- rows (differentiable where autograd records; see the module docstring) ----
    def all_gather_rows(
        self, local: torch.Tensor, max_rows: int, *, replicated_grad: bool = False
    ) -> torch.Tensor:
        """local [n_r, ...] -> [R * max_rows, ...]; padding rows hold zeros.

        replicated_grad: the output's gradient is the same on every rank (sequence parallel:
        every rank goes on with every token and computes the same loss), so the adjoint takes
        this rank's block of it instead of summing the blocks over ranks."""
        if _records(local):
            return _AllGatherRows.apply(local, self, max_rows, replicated_grad)
        return self._all_gather_rows(local, max_rows)

    def reduce_scatter_rows(self, full: torch.Tensor) -> torch.Tensor:
        """full [R * n_max, ...] -> the group's sum of rows [rank * n_max, (rank + 1) * n_max)."""
        if _records(full):
            return _ReduceScatterRows.apply(full, self)
        return self._reduce_scatter_rows(full)

    def all_to_all_rows(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """send [sum(send_counts), ...] grouped by destination -> [sum(recv_counts), ...]."""
        if _records(send):
            return _AllToAllRows.apply(send, self, send_counts, recv_counts)
        return self._all_to_all_rows(send, send_counts, recv_counts)

    def own_rows(self, replicated: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """replicated [sum(counts), ...], the same on every rank -> this rank's rows
        [start, start + counts[rank]), start = sum(counts[:rank]). No communication; under
        autograd the adjoint all-gathers the slices' gradients (every rank gets the whole,
        replicated gradient)."""
        if _records(replicated):
            return _OwnRows.apply(replicated, self, tuple(counts))
        start = sum(counts[: self.rank])
        return replicated[start : start + counts[self.rank]]

    # ---- the plain collectives (no autograd) ----
    def _all_gather_rows(self, local: torch.Tensor, max_rows: int) -> torch.Tensor:
        pad = max_rows - local.shape[0]
        if pad:
            local = torch.cat([local, local.new_zeros(pad, *local.shape[1:])])
        out = local.new_empty(self.size * max_rows, *local.shape[1:])
        if out.numel():  # every rank sees the same max_rows: all skip together
            _all_gather(to_wire(out), to_wire(local), self.group)
        return out

    def _reduce_scatter_rows(self, full: torch.Tensor) -> torch.Tensor:
        out = full.new_empty(full.shape[0] // self.size, *full.shape[1:])
        if out.numel():
            _reduce_scatter(out, full.contiguous(), self.group)
        return out

    def _all_to_all_rows(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
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


# ---- autograd: each collective's backward is its adjoint (see the module docstring) ----
def _records(t: torch.Tensor) -> bool:
    """Whether autograd records an op on t (a float tensor that requires grad, grad mode on)."""
    return t.requires_grad and torch.is_grad_enabled()


class _AllGatherRows(torch.autograd.Function):
    """y = all_gather_rows(x): rank r's rows reach every rank. Each rank's y feeds its own
    partial result, so dL/dx_r = sum over ranks s of block r of dL/dy_s: a reduce-scatter of
    the gradient (padded to max_rows as the forward was), then the padding rows dropped.
    With replicated_grad the blocks are equal on every rank: block r of this rank's is it."""

    @staticmethod
    def forward(ctx, local, comm, max_rows, replicated_grad):
        ctx.comm, ctx.num_rows, ctx.max_rows = comm, local.shape[0], max_rows
        ctx.replicated_grad = replicated_grad
        return comm._all_gather_rows(local, max_rows)

    @staticmethod
    def backward(ctx, grad):  # [R * max_rows, ...]
        comm = ctx.comm
        if ctx.replicated_grad:
            start = comm.rank * ctx.max_rows
            return grad[start : start + ctx.num_rows], None, None, None
        return comm._reduce_scatter_rows(grad)[: ctx.num_rows], None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    """y_r = sum over ranks s of block r of x_s: block r of every rank's x reaches y_r once,
    so dL/dx_s = the blocks dL/dy_r of every rank r in order: an all-gather of the gradient."""

    @staticmethod
    def forward(ctx, full, comm):
        ctx.comm = comm
        return comm._reduce_scatter_rows(full)

    @staticmethod
    def backward(ctx, grad):  # [n_max, ...], the same n_max on every rank
        return ctx.comm._all_gather_rows(grad, grad.shape[0]), None


class _AllToAllRows(torch.autograd.Function):
    """A permutation of rows across ranks: its adjoint sends each received row's gradient back
    where the row came from, the all_to_all with send and receive counts swapped."""

    @staticmethod
    def forward(ctx, send, comm, send_counts, recv_counts):
        ctx.comm, ctx.send_counts, ctx.recv_counts = comm, list(send_counts), list(recv_counts)
        return comm._all_to_all_rows(send, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad):  # [sum(recv_counts), ...]
        return ctx.comm._all_to_all_rows(grad, ctx.recv_counts, ctx.send_counts), None, None, None


class _OwnRows(torch.autograd.Function):
    """y_r = rows of rank r of x, x replicated (one tensor held by every rank). Its gradient is
    replicated too: the slices' gradients of every rank, in order: an all-gather (padded to the
    largest slice, the padding dropped)."""

    @staticmethod
    def forward(ctx, replicated, comm, counts):
        ctx.comm, ctx.counts = comm, counts
        start = sum(counts[: comm.rank])
        return replicated[start : start + counts[comm.rank]].clone()

    @staticmethod
    def backward(ctx, grad):  # [counts[rank], ...]
        counts, most = ctx.counts, max(ctx.counts)
        gathered = ctx.comm._all_gather_rows(grad, most)  # [R * most, ...]
        blocks = [gathered[r * most : r * most + count] for r, count in enumerate(counts)]
        return torch.cat(blocks), None, None


class _Tie(torch.autograd.Function):
    """y unchanged; in backward y gets its gradient and the tied tensors none, but autograd
    still reaches their nodes (their collectives get a zero gradient and run)."""

    @staticmethod
    def forward(ctx, y, *tied):
        ctx.num_tied = len(tied)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * ctx.num_tied


def tie(y: torch.Tensor, tied: Sequence[torch.Tensor]) -> torch.Tensor:
    """y, with `tied` joined to its autograd graph, for a call autograd records on every rank.

    A rank's result may not depend on what its dispatch received (no token landed on its
    experts) while another rank's does: without the tie, backward would skip the dispatch's
    collectives on one rank and wait for them on the other. Where nothing here requires grad
    (only the expert weights do, and no token used them on this rank), a zero-size leaf makes
    y part of the graph, so this rank's backward reaches the combine's collective as well."""
    tied = tuple(t for t in tied if t.requires_grad)
    if not (y.requires_grad or tied):
        tied = (torch.zeros(0, dtype=y.dtype, device=y.device, requires_grad=True),)
    return _Tie.apply(y, *tied)
