"""SymmMemEPPrepareFinalize: dispatch and combine through torch's symmetric memory (NVSHMEM),
with every count on the GPU: no host synchronisation, and the whole EP forward can be captured
in a CUDA graph.

Legend: R ranks, M tokens of this rank in the call (M <= B), B = max_tokens_per_rank,
C = R * B rows a rank can receive, k top-k, H hidden, G scale columns of a row.

Two layouts, one per transport. Where every peer's buffers are mapped into this process (one
host: peer access over NVLink, or PCIe (not tried), what nvshmem_ptr gives), the dispatch
stores into peers' memory directly and the combine loads from it (the peer transport, the
default there); elsewhere (across nodes) torch's all_to_all_vdev moves the rows (the vdev
transport).

Peer transport, regions (rank s's rows at rank p: rows [s * B, s * B + n) of p's recv):

    dispatch: pos, counts = dispatch_positions(topk_ids, owner, grouped=False)  # [M, R], [R]
              count r stored into rank r's incoming[me] (a peer store)
              row of token m = x's bytes | ids | weights (| scales), stored straight into
                  rank r's recv row me * B + pos[m, r] for every rank r it goes to
              barrier (every rank's stores done and seen)
              rows of region s past incoming[s] are stale: ids -1 (empty slots), weights 0
              at prefill sizes (routing_first) the rows' x bytes go on a side stream, then a
              barrier of their own (pads_x); the metadata words and the barrier above stay on
              the current stream, where the experts align their slots meanwhile
    experts:  the C received rows (a fixed shape: the same launches whatever the routing), x
              read in place (after joining the side stream: PrepareResult.input_ready); a
              backend that reduces writes its [C, H] output into `out`
    combine:  barrier (every rank's experts wrote their out)
              y[m] = sum_r rank r's out row me * B + pos[m, r]   (loads from the peers' out,
                  over NVLink; the layer's output, summed in fp32)
              at prefill sizes by column blocks (combine_bounds): a barrier and a sum per
                  block, issued on a side stream as soon as the experts wrote the block
                  (OutputColumns), while they write the next

Two barriers a call (one more per extra column block, one more where the routing goes
first), and no copy but the dispatch's stores and the combine's loads. Why each
buffer is free when it is written (on rank p, for any peer q): q's next dispatch stores into
p's recv and incoming only after it passed this call's combine barriers, which p reaches
after its experts (which read recv; incoming was read before them; a side stream's stores
start after what q's current stream issued before them); p's next experts write p's out
only after the next call's dispatch barriers, which q reaches after its sum has loaded this
call's rows from p's out. The barrier is epochs in symmetric memory, one writer per word
(kernels.ep_rows.barrier_triton).

vdev transport, grouped (the rows a rank sends grouped by destination, as an all-to-all's):

    dispatch: pos, counts = dispatch_positions(topk_ids, owner)            # grouped
              rows -> send[pos[m, r]];  all_to_all_vdev(send -> recv, counts): each rank pulls
              its rows from its peers' send buffers; received [2, R] is filled on the GPU
              rows [n, C) of recv, n = sum(received[0]), are stale
    combine:  all_to_all_vdev(out -> send, received[0]): every rank gets its rows back where it
              sent them;  y[m] = sum_r send[pos[m, r]]

all_to_all_vdev starts with a barrier of the group and has none at its end (peers may still be
reading this rank's send buffer when it returns here), so each buffer is written only where a
barrier since its last remote use guarantees the peers are done with it: `send` takes the
combine's rows back (the combine's barrier comes after every peer's dispatch), `out` is written
by the experts after the dispatch's barrier, and the dispatch and the combine have each their
own received-counts tensor. Its blocks must divide each peer's bytes evenly: buffers of at
least _MIN_BYTES, rows padded to 64 bytes, a power-of-two group.

Either way each token travels once to each rank that owns one of its experts, as in the
all_to_all kind, but the split sizes never reach the host. The price is the fixed shape: the
buffers and the experts' workspaces are sized for C rows, and a call with more than B tokens
on a rank is refused: that rank sends none of them, still takes part in the call's exchanges
(its peers finish the call right, the ranks stay in step) and raises a ValueError at the
call's end. Set ParallelConfig.max_tokens_per_rank to the largest call a rank makes (a prefill
chunk), or use the all_to_all kind for longer calls.

Buffers are symmetric (allocated collectively at a layer's first call, the same size on every
rank) and shared by every layer of the process per (group, device, size): a model's layers run
one after another. One EP forward is in flight per group at a time, as for any collective: the
ranks must issue their dispatches in the same order. Between its dispatch and its combine a
forward holds the buffers: a dispatch meanwhile gets a RuntimeError, from another thread or
CUDA stream, or from this one after a forward that stopped between the two (its exchanges are
then one behind its peers'). A CUDA graph captured on a side stream (after a warm-up call,
which allocates the buffers) uses the buffers of the eager calls.

Transports (FUSEDMOE_SYMM_MEM_TRANSPORT): "auto" (the default: peer where every peer is
mapped on every rank, else vdev), "peer", "vdev", and for machines without NVSHMEM (CPU,
gloo) "emulated" (the regions layout; the rows move with all_to_all_single, the combine's
as whole regions of out to their senders, where the sum reads them) and
"emulated_vdev" (the grouped layout; the split sizes read on the host): they test the layouts,
not the speed, and are never chosen by themselves.

Inference only: under autograd the layer runs the all_to_all kind (whose collectives have
their adjoints), and its backend choice says so. Schemes with one activation scale over the
whole batch (FP8 per-tensor dynamic, NVFP4) are refused: the stale rows would enter the scale.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusedmoe.modular.kernel import stream_handle
from fusedmoe.modular.types import OutputColumns
from fusedmoe.parallel.all_to_all_ep import AllToAllEPPrepareFinalize
from fusedmoe.parallel.comm import to_wire
from fusedmoe.parallel.naive_ep import TokenBatch, quantizes_before_dispatch
from fusedmoe.parallel.rows import (
    dispatch_positions,
    gather_sum_rows,
    pack_meta,
    scatter_rows,
    unpack_meta,
)

__all__ = [
    "TRANSPORTS",
    "TRANSPORT_ENV",
    "SymmMemEPPrepareFinalize",
    "emulated_transport",
    "nvshmem_unavailable_reason",
    "transport_kind",
]

TRANSPORT_ENV = "FUSEDMOE_SYMM_MEM_TRANSPORT"  # TRANSPORTS; "auto" by default


def nvshmem_unavailable_reason(device: torch.device, group=None) -> str | None:
    """None where the NVSHMEM transport can run on `device` for `group`, else why not (probed
    when asked: never at import, never on the way to a CPU call). Where it can, the process's
    symmetric memory is switched to NVSHMEM (torch's default is its CUDA backend, which has no
    all_to_all_vdev); that is refused once a symmetric tensor exists on another backend."""
    if device.type != "cuda":
        return f"needs CUDA (the layer is on {device.type})"
    import torch.distributed as dist

    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return "this torch has no torch.distributed._symmetric_memory"
    if not symm_mem.is_nvshmem_available():
        return "NVSHMEM is not available in this torch build or on this machine"
    if dist.is_initialized():
        # "nccl", or a mixed group's "cpu:gloo,cuda:nccl" (init_process_group() unnamed)
        get_config = getattr(dist, "get_backend_config", None)
        backend = str(get_config(group) if get_config else dist.get_backend(group))
        if "nccl" not in backend:
            return f"the process group's CUDA backend is not NCCL ({backend!r})"
        size = dist.get_world_size(group)
        if size & (size - 1) and transport_kind() != "peer":
            # the peer transport takes any size (tests/test_ep.py runs 3 ranks emulated); a
            # group without mapped peers would fall to vdev, which cannot run it
            return (
                f"needs a power-of-two group (this one has {size} ranks) unless "
                f"{TRANSPORT_ENV}=peer: torch's all_to_all_vdev, its transport where peers are "
                "not mapped, splits each peer's rows into equal blocks"
            )
    backend = symm_mem.get_backend(device)
    if backend != "NVSHMEM":
        try:
            symm_mem.set_backend("NVSHMEM")
        except RuntimeError as e:
            return f"the process's symmetric memory already runs on {backend!r} ({e})"
    return None


def _rank_tensors(tensors):
    """A plan's per-rank views as kernels.ep_rows.RankTensors (their offsets found once); a
    plain tuple where Triton is not installed (the torch twins take any sequence)."""
    try:
        from fusedmoe.kernels.ep_rows import RankTensors
    except ImportError:
        return tuple(tensors)
    return RankTensors(tensors)


# ---- transports ----------------------------------------------------------------------------
TRANSPORTS = ("auto", "peer", "vdev", "emulated", "emulated_vdev")


def transport_kind() -> str:
    """FUSEDMOE_SYMM_MEM_TRANSPORT, checked ("nvshmem", the old spelling, is "auto")."""
    kind = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    kind = "auto" if kind == "nvshmem" else kind
    if kind not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV} must be one of {TRANSPORTS}, got {kind!r}")
    return kind


def emulated_transport() -> bool:
    """An emulated transport (tests): symm_mem on any device and process group."""
    return transport_kind().startswith("emulated")


class _NvshmemTransport:
    """torch's NVSHMEM symmetric memory: buffers from symm_mem.empty, rendezvoused on the group.
    Regions layout where every peer's buffers are mapped on every rank (the kernels store into
    and load from peers' memory; barriers in symmetric memory), else the grouped one
    (all_to_all_vdev reads the split sizes on the GPU and writes what it received there)."""

    def __init__(self, group, kind: str, region_rows: int) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.rank = dist.get_rank(self.group)
        self.kind = kind  # "auto", "peer" or "vdev"
        self.name = "nvshmem"
        self.region_rows = region_rows
        self._handles: dict[int, object] = {}

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        t = self._symm_mem.empty(shape, dtype=dtype, device=device)
        self._handles[t.data_ptr()] = self._symm_mem.rendezvous(t, self.group_name)
        return t

    def _peers(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's copy of t, mapped here; None where one is not (another node)."""
        handle = self._handles[t.data_ptr()]
        if not all(handle.buffer_ptrs):
            return None
        size = len(handle.buffer_ptrs)
        return [handle.get_buffer(r, tuple(t.shape), t.dtype, 0) for r in range(size)]

    def regions(self, bufs: _Buffers) -> bool:
        """Decide the layout of a new set of buffers, the same on every rank (collective:
        every rank, in the same order): regions where every rank wants it ("auto" or "peer")
        and has every peer mapped, else grouped; ranks that disagree (another
        FUSEDMOE_SYMM_MEM_TRANSPORT) all raise rather than run different layouts."""
        import torch.distributed as dist

        bufs.pads.zero_()
        bufs.pads_x.zero_()
        peers = None
        if self.kind != "vdev":
            names = ("recv", "out", "incoming", "pads", "pads_x")  # what kernels reach on peers
            peers = {n: self._peers(getattr(bufs, n)) for n in names}
            if any(v is None for v in peers.values()):
                peers = None
        want = peers is not None
        # [min, -max] of want over the group (after every rank's pads are zero: stream order)
        votes = torch.tensor([int(want), -int(want)], device=bufs.pads.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.group)
        low, high = int(votes[0]), -int(votes[1])
        if low != high:
            raise ValueError(
                "the ranks disagree on the symm_mem transport: some run the peer transport, "
                f"others cannot or were told not to ({TRANSPORT_ENV}); set it alike on every rank"
            )
        if not want and self.kind == "peer":
            raise ValueError(
                f"{TRANSPORT_ENV}=peer needs every rank's buffers mapped on every rank (one "
                "host, peer access over NVLink or PCIe); some are not: use 'auto' or 'vdev'"
            )
        if peers is not None:
            peers = {name: _rank_tensors(tensors) for name, tensors in peers.items()}
        bufs.peer = peers
        return want

    def uses_send(self, bufs: _Buffers) -> bool:
        """Grouped only: the peer transport stores into and loads from the peers' buffers."""
        return not bufs.regions

    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, counts: torch.Tensor, received: torch.Tensor
    ) -> None:
        """Grouped: send rows grouped by destination, counts [R] of them -> recv, grouped by
        source; received [2, R] <- (rows from each rank, their offsets in recv)."""
        torch.ops.symm_mem.all_to_all_vdev(send, recv, counts, received, self.group_name)

    # ---- the regions layout ----
    def dispatch_targets(self, bufs: _Buffers, view) -> tuple[list, list]:
        """(rank r's recv rows of this rank's region, rank r's incoming slot of this rank)."""
        me = self.rank
        rows = self.peer_regions(bufs, "recv", view)
        return rows, [peer[me : me + 1] for peer in bufs.peer["incoming"]]

    def after_dispatch(
        self, bufs: _Buffers, dst: torch.Tensor, src: torch.Tensor | None, pads: str = "pads"
    ) -> None:
        """The rows stored are seen where they went (dst, src: the staging's rows; unused): a
        barrier on `pads` ("pads_x": the activations' own, when they travel apart)."""
        from fusedmoe.kernels.ep_rows import barrier_triton

        barrier_triton(bufs.peer[pads], self.rank)

    def combine(self, bufs: _Buffers, plan: _CombinePlan, cols: slice) -> None:
        """A barrier: every rank's experts wrote the bytes `cols` of their out (the sum then
        loads this rank's region of each rank's out there: combine_sources)."""
        from fusedmoe.kernels.ep_rows import barrier_triton

        barrier_triton(bufs.peer["pads"], self.rank)

    def combine_sources(self, bufs: _Buffers, view) -> list[torch.Tensor]:
        """Where the sum reads rank r's partial sums of this rank's rows: rank r's out (a
        peer's, over NVLink), from this rank's region on."""
        return self.peer_regions(bufs, "out", view)

    def peer_regions(self, bufs: _Buffers, name: str, view) -> list[torch.Tensor]:
        """Rank r's buffer `name` as rows, from this rank's region on."""
        return [view(peer)[self.rank * self.region_rows :] for peer in bufs.peer[name]]


class _EmulatedTransport:
    """Either layout over any process group (gloo on the CPU), for tests. Grouped: the split
    sizes are read on the host and the rows move with all_to_all_single. Regions: the rows for
    rank r are stored into region r of a local staging buffer (send), and all_to_all_single
    moves region r to rank r's region of this rank."""

    name = "emulated"

    def __init__(self, group, kind: str, region_rows: int) -> None:
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.kind = kind  # "emulated" (regions) or "emulated_vdev" (grouped)
        self.region_rows = region_rows

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def regions(self, bufs: _Buffers) -> bool:
        return self.kind == "emulated"

    def uses_send(self, bufs: _Buffers) -> bool:
        return True  # regions: the staging; grouped: the rows out and back

    def all_to_all(
        self, send: torch.Tensor, recv: torch.Tensor, counts: torch.Tensor, received: torch.Tensor
    ) -> None:
        import torch.distributed as dist

        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.clone(), group=self.group)
        sent, got = counts.tolist(), recv_counts.tolist()
        dist.all_to_all_single(
            to_wire(recv[: sum(got)]),
            to_wire(send[: sum(sent)]),
            output_split_sizes=got,
            input_split_sizes=sent,
            group=self.group,
        )
        received[0].copy_(recv_counts)
        received[1].copy_(torch.cumsum(recv_counts, 0) - recv_counts)

    # ---- the regions layout ----
    def _regions(self, rows: torch.Tensor, size: int) -> list[torch.Tensor]:
        return [rows[r * self.region_rows :] for r in range(size)]

    def dispatch_targets(self, bufs: _Buffers, view) -> tuple[list, list]:
        size = bufs.counts.shape[0]
        return self._regions(view(bufs.send), size), [bufs.staged[r : r + 1] for r in range(size)]

    def _move(self, bufs: _Buffers, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Region r of src -> this rank's region of rank r's dst (rows of bytes; a block of
        their columns goes through contiguous copies)."""
        import torch.distributed as dist

        rows = self.region_rows * bufs.counts.shape[0]
        dst, src = dst[:rows], src[:rows]
        if dst.is_contiguous() and src.is_contiguous():
            dist.all_to_all_single(dst, src, group=self.group)
            return
        moved = torch.empty_like(src, memory_format=torch.contiguous_format)
        dist.all_to_all_single(moved, src.contiguous(), group=self.group)
        dst.copy_(moved)

    def after_dispatch(
        self, bufs: _Buffers, dst: torch.Tensor, src: torch.Tensor | None, pads: str = "pads"
    ) -> None:
        """The staged rows (src) and counts to their ranks (pads: the peer transport's)."""
        import torch.distributed as dist

        self._move(bufs, dst, src)
        dist.all_to_all_single(bufs.incoming, bufs.staged, group=self.group)

    def combine(self, bufs: _Buffers, plan: _CombinePlan, cols: slice) -> None:
        """Region r of out (rank r's rows, their partial sums: the bytes `cols`) to rank r,
        into its send at this rank's region: what the peer transport's sum loads from rank r's
        out, moved first."""
        self._move(bufs, plan.back[:, cols], plan.rows[:, cols])

    def combine_sources(self, bufs: _Buffers, view) -> list[torch.Tensor]:
        """Where the sum reads rank r's partial sums of this rank's rows: region r of send."""
        return self._regions(view(bufs.send), bufs.counts.shape[0])


def _make_transport(group, region_rows: int):
    kind = transport_kind()
    if kind.startswith("emulated"):
        return _EmulatedTransport(group, kind, region_rows)
    return _NvshmemTransport(group, kind, region_rows)


# ---- buffers ----------------------------------------------------------------------------
#: (transport, group, device, bytes) -> symmetric buffers; kept for the process (a CUDA graph
#: captured with them reads and writes their addresses; freeing NVSHMEM memory is a collective)
_BUFFERS: dict[tuple, _Buffers] = {}
_BUFFERS_LOCK = threading.Lock()
#: all_to_all_vdev (the grouped layout) moves each peer's bytes in equal blocks, and asserts
#: that they divide evenly: it launches ceil(input bytes / 64 KiB) blocks, rounded up to a
#: multiple of the group's size, at most 64 (16 across nodes), so with a power-of-two group and
#: an input of at least 64 blocks' worth (_MIN_BYTES) each peer gets 64 / R blocks (a power of
#: two, at most 32). Rows are padded to a multiple of 64 bytes: any count of them then divides
#: evenly, and the regions layout's kernels keep their 16-byte vectors. (A block count set by
#: hand, TORCH_SYMMMEM_NBLOCKS, must keep 64 / (its blocks per peer) whole.)
_ROW_ALIGN = 64
_MIN_BYTES = 8 << 20  # 64 blocks of up to 128 KiB


def _row_bytes(nbytes: int) -> int:
    return -(-nbytes // _ROW_ALIGN) * _ROW_ALIGN


def _view_rows(capacity: int, row_bytes: int) -> int:
    """Rows of a view: at least C + 1 (row C takes what goes nowhere), and _MIN_BYTES."""
    return max(capacity + 1, -(-_MIN_BYTES // row_bytes))


# ---- the combine by column blocks ---------------------------------------------------------
#: The peer transport combines the experts' output [C, H] in column blocks, each as soon as
#: the experts' GEMM2 and sum have written it, on a side stream of the highest priority while
#: they write the next: its loads over NVLink overlap GEMM2 (which reads its weights by output
#: column, so nothing is read twice), in one program a SM (the GEMM keeps the others). Each
#: block costs a barrier: there are blocks where the output holds at least
#: COMBINE_BLOCKS_MIN_BYTES (a prefill-sized bound), one below (a decode-sized bound: the
#: barriers' latency is not hidden there). The rule reads the bound, not the call's tokens:
#: a small call of a layer bounded for prefill runs in blocks too (docs/expert-parallelism.md:
#: 40-60 us at 128 tokens on 4 H200s). The blocks are COMBINE_PARTS of H wide, decreasing: the
#: last block's sum, the one that nothing hides, is short, and each block's sum fits in the
#: next block's GEMM2. Bounds are multiples of 256 columns (GEMM2's widest tile: no tile spans
#: two blocks; FP8's 128-blocks).
#: The rule reads only C, H and the dtype, which every rank shares (its fingerprint): the
#: ranks make the same barriers. (4 H200s, deepseek-v3, 4096 tokens a rank: docs/performance.md.)
COMBINE_PARTS = (12, 8, 5, 3)
COMBINE_BLOCKS_MIN_BYTES = 64 << 20
_COLUMN_ALIGN = 256
_blocks_override: tuple[int, int] | None = None  # (blocks, column alignment)


@contextlib.contextmanager
def combine_blocks_override(blocks: int | None, align: int = _COLUMN_ALIGN):
    """Scoped: every combine of this process in `blocks` column blocks of even widths (as
    many as whole `align`-column blocks allow), whatever the size; None: the rule. For tests
    and benchmarks (every rank must set the same); an align that is not a multiple of 128
    only where no weights are in 128-column blocks (FP8 blocks)."""
    global _blocks_override
    for name, value in (("blocks", blocks), ("align", align)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise ValueError(f"combine {name} must be an int >= 1, got {value!r}")
    saved = _blocks_override
    _blocks_override = None if blocks is None else (blocks, align)
    try:
        yield
    finally:
        _blocks_override = saved


def combine_bounds(capacity: int, hidden: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The column bounds (0, ..., H) of the combine's blocks for [C, H] partial sums."""
    if _blocks_override is not None:
        blocks, align = _blocks_override
        parts = (1,) * blocks  # as wide as the alignment allows
    elif capacity * hidden * dtype.itemsize >= COMBINE_BLOCKS_MIN_BYTES:
        parts, align = COMBINE_PARTS, _COLUMN_ALIGN
    else:
        return (0, hidden)
    bounds, total, done = [0], sum(parts), 0
    for part in parts[:-1]:
        done += part
        bound = round(done * hidden / total / align) * align
        if bounds[-1] < bound < hidden:
            bounds.append(bound)
    return (*bounds, hidden)


#: The peer transport's dispatch sends the routing ahead of the activations where the rows a
#: rank can receive hold at least this many bytes (C x the row's bytes: a prefill-sized bound):
#: the ids and weights are stored and a barrier passed on the current stream, where the experts
#: align their slots (ExpertsCall.input_ready), while the activations are stored on a side
#: stream with a barrier of their own, which the experts wait for before GEMM1. Below it (a
#: decode-sized bound) the stores are short and leave little to hide: one chain, one barrier
#: (on 2 H200s either way took the same time there; docs/performance.md). Like
#: combine_bounds, the rule reads only what every rank shares: the ranks make the same
#: barriers.
ROUTING_FIRST_MIN_BYTES = 64 << 20
_routing_first_override: bool | None = None


@contextlib.contextmanager
def routing_first_override(on: bool | None):
    """Scoped: every peer-transport dispatch of this process sends the routing first (True)
    or not (False), whatever the size; None: the rule. For tests and benchmarks (every rank
    must set the same)."""
    global _routing_first_override
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"routing_first_override takes True, False or None, got {on!r}")
    saved = _routing_first_override
    _routing_first_override = on
    try:
        yield
    finally:
        _routing_first_override = saved


def routing_first(capacity: int, row_bytes: int) -> bool:
    """Whether a dispatch of C rows of row_bytes sends the routing ahead of the activations
    (ROUTING_FIRST_MIN_BYTES, or the override)."""
    if _routing_first_override is not None:
        return _routing_first_override
    return capacity * row_bytes >= ROUTING_FIRST_MIN_BYTES


@dataclass
class _Buffers:
    """One set of byte buffers (symmetric for NVSHMEM), viewed per call as rows: the dispatch's
    rows (x's bytes, then the metadata words) in recv (and send: grouped, or the emulated
    transport's staged regions), the combine's (the partial sums) in out (the peer transport's
    sum loads them there; grouped and emulated, they come back into send). Each all-to-all
    of the grouped layout sees a whole view: its block split depends on the size."""

    recv: torch.Tensor  # uint8: the dispatch's rows in (the experts read x there)
    out: torch.Tensor  # uint8: the experts' output; the combine's rows (read by the peers)
    counts: torch.Tensor  # int64 [R]: rows this rank sends to each rank
    received: torch.Tensor  # int64 [2, 2, R]: (rows, offsets) received, dispatch and combine
    #: uint8: grouped, the dispatch's rows out and the combine's back; emulated regions, the
    #: same; None for the peer transport, which stores into and loads from the peers' recv
    #: and out (allocated once the ranks have chosen the layout)
    send: torch.Tensor | None = None
    incoming: torch.Tensor | None = None  # int64 [R]: rows from each rank (regions)
    staged: torch.Tensor | None = None  # int64 [R]: counts before they move (emulated regions)
    pads: torch.Tensor | None = None  # int64 [R + 1]: the barrier's epochs (peer transport)
    #: the same for the activations' barrier, where they travel beside the routing (on a side
    #: stream: its barrier may run at the same time as one on pads)
    pads_x: torch.Tensor | None = None
    regions: bool = False  # the layout (the module docstring)
    peer: dict | None = None  # name -> every rank's copy of that buffer, mapped here (peer)
    plans: dict = field(default_factory=dict)  # (what, row bytes, ...) -> _DispatchPlan etc.
    #: (thread, CUDA stream) of the forward between its dispatch and its combine: the buffers
    #: refuse another caller meanwhile (STYLE: shared state refuses the second caller)
    holder: tuple[int, int] | None = None

    @staticmethod
    def rows(buf: torch.Tensor, capacity: int, row_bytes: int) -> torch.Tensor:
        """buf's first bytes as [rows, row_bytes] (_view_rows)."""
        num_rows = _view_rows(capacity, row_bytes)
        return buf[: num_rows * row_bytes].view(num_rows, row_bytes)

    def take(self, device: torch.device) -> None:
        """Hold the buffers from a dispatch to its combine. Refused while held: by another
        thread or stream (one EP forward of a group at a time), or by this one (its last
        forward stopped between its dispatch and its combine: this rank's exchanges are now
        one behind its peers', and going on would pair the wrong ones)."""
        me = (threading.get_ident(), stream_handle(device))
        with _BUFFERS_LOCK:
            if self.holder == me:
                raise RuntimeError(
                    "an EP forward of this thread stopped between its symm_mem dispatch and its "
                    "combine (it raised midway): this rank's exchanges are out of step with its "
                    "peers', which wait for the combine; restart the ranks"
                )
            if self.holder is not None:
                raise RuntimeError(
                    "the symm_mem dispatch's buffers are in use by an EP forward of another "
                    "thread or CUDA stream: one EP forward of a group at a time (the ranks must "
                    "issue their dispatches in the same order)"
                )
            self.holder = me

    def release(self) -> None:
        self.holder = None


@dataclass
class _DispatchPlan:
    recv: torch.Tensor  # [rows, row bytes] the rows that arrive here
    recv_words: torch.Tensor  # the same as int32 words (the metadata's unpack reads them)
    staging: torch.Tensor | None  # send as rows: grouped, the rows out; emulated regions, the
    #                               staging; None for the peer transport (no send)
    targets: object  # send [rows, row bytes] (grouped), or each rank's region (regions)
    words: object  # targets as int32 words (the metadata's)
    posts: list[torch.Tensor] | None  # regions: each rank's slot for this rank's count


@dataclass
class _CombinePlan:
    rows: torch.Tensor  # out as [rows, row bytes]: the partial sums leave from there
    rows_c: torch.Tensor  # its first C rows as the partial sums' dtype (the experts' output)
    back: torch.Tensor | None  # send as [rows, bytes], where they come back (vdev, emulated)
    sources: object  # where this rank's partial sums are read: one tensor or one per rank
    #: (lo, hi) -> the sources' columns [lo, hi) (regions: a RankTensors), made once each
    blocks: dict = field(default_factory=dict)

    def block_sources(self, lo: int, hi: int):
        found = self.blocks.get((lo, hi))
        if found is None:
            found = self.blocks[lo, hi] = _rank_tensors(s[:, lo:hi] for s in self.sources)
        return found


@dataclass
class _Columns:
    """The combine by column blocks of a call (OutputColumns): blocks [0, next) are issued."""

    bounds: tuple[int, ...]  # column bounds of the blocks (combine_bounds)
    target: torch.Tensor  # [M, H]: the combine's output, allocated before the experts ran
    plan: _CombinePlan  # the views the blocks' exchanges and sums read and write
    side: torch.cuda.Stream | None  # CUDA: the stream the blocks' exchanges and sums run on
    programs: int | None  # CUDA: the SMs, the programs of a sum beside GEMM2
    next: int = 0  # the first block not issued yet


class _Join:
    """PrepareResult.input_ready of a dispatch whose activations travel on a side stream: the
    stream current at the call waits for it; once (later calls do nothing)."""

    def __init__(self, side: torch.cuda.Stream) -> None:
        self.side: torch.cuda.Stream | None = side

    def __call__(self) -> None:
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.side = None


@dataclass
class _DispatchState:
    pos: torch.Tensor  # int64 [M, R]: token m's row for rank r (grouped: in send; regions: in
    #                     this rank's region at rank r), C where it does not go
    buffers: _Buffers  # the set the dispatch used: the combine's rows go back through it
    combine_bytes: int  # bytes of a combine row (the partial sums', padded)
    refused: bool  # this rank was over the bound: it sent nothing, its output is refused
    columns: _Columns | None = None  # blocks combined while the experts run (output_columns)
    #: the activations still arriving on a side stream (routing_first): joins it
    input_ready: Callable[[], None] | None = None


class SymmMemEPPrepareFinalize(AllToAllEPPrepareFinalize):
    """Dispatch and combine on symmetric memory, counts on the GPU (the module docstring): the
    all_to_all kind's traffic (each token once to each rank of its experts), its own transport.

    expert_owner: int [P], the rank of every physical expert (ExpertPlacement.owner()).
    max_tokens_per_rank: B, the most tokens a rank may pass in one call.
    """

    def __init__(
        self,
        ep_size: int,
        ep_rank: int,
        expert_owner: torch.Tensor,
        group: object | None = None,
        *,
        max_tokens_per_rank: int,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(ep_size, ep_rank, expert_owner, group, sequence_parallel=sequence_parallel)
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int):
            raise TypeError(f"max_tokens_per_rank must be an int, got {max_tokens_per_rank!r}")
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
        self.max_tokens = max_tokens_per_rank
        self.capacity = ep_size * max_tokens_per_rank  # C
        self._transport = None
        self._out_dtype: torch.dtype | None = None  # the activations' dtype, from prepare
        #: read the counts on the host after each dispatch to fill self.stats (a host sync per
        #: call: for benchmarks, off by default)
        self.count_traffic = False
        self._agreed = False  # the ranks' fingerprints compared (EPGroup.agree)
        self._refused: str | None = None  # this call was over the bound: why (finalize raises)
        self._last_buffers: _Buffers | None = None  # the set of the last call (device_barrier)
        #: device -> (the side stream, its SMs): the activations' stores (routing_first) and
        #: the combine's blocks (output_columns)
        self._side_streams: dict[torch.device, tuple[torch.cuda.Stream, int]] = {}
        #: this call's activations may travel on a side stream (not where torch.compile
        #: traces the layer: its graph would not join it); set by prepare
        self._overlap_input = True

    # ---- the PrepareFinalize contract ----
    def single_pass(self) -> bool:
        return True

    def num_tokens_across_ranks(self, num_tokens: int, device: torch.device) -> int:
        """This rank's own count: every rank makes one dispatch per call whatever its count
        (single_pass), so nothing is exchanged on the host. A count over the bound is refused
        at the end of the call (finalize), not here: the rank still joins the call's dispatch
        and combine (sending nothing), so that its peers finish their calls right and the ranks
        stay in step."""
        self.comm.check()
        self._refused = None
        if not self._agreed:  # once, at the first call (a host sync: the warm-up's)
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "the first call of a symm_mem EP layer allocates its symmetric buffers and "
                    "compares the ranks' layers (collectives): make one eager call on every "
                    "rank before capturing a CUDA graph"
                )
            self.comm.agree(device)
            self._agreed = True
        mine = num_tokens
        if self.sequence_parallel:
            mine = -(-num_tokens // self.comm.size)
        if mine > self.max_tokens:
            what = "tokens per rank (sequence parallel)" if self.sequence_parallel else "tokens"
            self._refused = (
                f"the symm_mem dispatch takes at most max_tokens_per_rank = {self.max_tokens} "
                f"tokens per rank in a call, this rank had {mine} {what}: raise "
                "ParallelConfig.max_tokens_per_rank (its buffers and workspaces are sized for "
                f"ep_size * max_tokens_per_rank = {self.capacity} rows), split the call, or "
                "use all2all_backend='all_to_all' (this rank sent nothing; its peers' outputs "
                "of the call are right)"
            )
        return num_tokens

    # Under torch.compile prepare and finalize run outside the graph (graph breaks): they
    # reinterpret the symmetric buffers' bytes, which aot_autograd cannot trace
    # (docs/expert-parallelism.md). torch.compiler.disable is applied when compiling only: as a
    # decorator it would import torch._dynamo with this module and wrap every eager call.
    def prepare(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # (its graph would not join a side stream)
            return torch.compiler.disable(self._prepare)(*args, overlap_input=False, **kwargs)
        return self._prepare(*args, **kwargs)

    def finalize(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(self._finalize)(*args, **kwargs)
        return self._finalize(*args, **kwargs)

    def _prepare(
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
        overlap_input=True,
    ):
        self._overlap_input = overlap_input  # read by _dispatch (routing_first)
        if requires_grad:
            raise ValueError(
                "the symm_mem dispatch is inference only: a forward that autograd records runs "
                "the all_to_all kind (FusedMoE picks it; backend_choice(requires_grad=True) "
                "says so)"
            )
        if not quantizes_before_dispatch(None if defer_input_quant else quant_config):
            raise ValueError(
                "the symm_mem dispatch cannot run a scheme with one activation scale over the "
                "whole batch (FP8 per-tensor dynamic, NVFP4): its fixed-size receive buffer's "
                "stale rows would enter the scale; use all2all_backend='naive'"
            )
        self._out_dtype = a1.dtype
        return super().prepare(
            a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
            quant_config, defer_input_quant,
        )  # fmt: skip

    def _finalize(self, *args, **kwargs):
        try:
            super().finalize(*args, **kwargs)
        finally:
            refused, self._refused = self._refused, None
        if refused is not None:
            raise ValueError(refused)

    # ---- buffers ----
    def _buffers(self, device: torch.device, dispatch_bytes: int, combine_bytes: int) -> _Buffers:
        if self._transport is None:
            self._transport = _make_transport(self.comm.group, self.max_tokens)
        transport = self._transport
        group_key = getattr(transport, "group_name", None) or id(self.comm.group)
        nbytes = max(
            _view_rows(self.capacity, row) * row for row in (dispatch_bytes, combine_bytes)
        )
        key = (transport.name, transport.kind, group_key, device, nbytes)
        with _BUFFERS_LOCK:
            bufs = _BUFFERS.get(key)
            if bufs is None:
                size = self.comm.size

                def alloc(shape, dtype):
                    return transport.alloc(shape, dtype, device)

                bufs = _Buffers(
                    recv=alloc((nbytes,), torch.uint8),
                    out=alloc((nbytes,), torch.uint8),
                    counts=alloc((size,), torch.int64),  # all_to_all_vdev's splits: symmetric
                    received=alloc((2, 2, size), torch.int64),
                    incoming=alloc((size,), torch.int64),
                    staged=torch.zeros(size, dtype=torch.int64, device=device),
                    pads=alloc((size + 1,), torch.int64),
                    pads_x=alloc((size + 1,), torch.int64),
                )
                bufs.regions = transport.regions(bufs)  # collective where it maps peers
                if transport.uses_send(bufs):  # the same on every rank (the layout is)
                    bufs.send = alloc((nbytes,), torch.uint8)
                _BUFFERS[key] = bufs
        self._last_buffers = bufs
        return bufs

    def device_barrier(self) -> bool:
        """A barrier of the ranks' GPUs on the current stream (the peer transport's, on the
        buffers of this layer's last call): a benchmark starts a timed stage on every rank
        together, without the host's launch skew. False (nothing done) elsewhere. Collective:
        every rank calls it, as many times (its epochs count the barriers)."""
        bufs = self._last_buffers
        if bufs is None or bufs.peer is None:
            return False
        from fusedmoe.kernels.ep_rows import barrier_triton

        barrier_triton(bufs.peer["pads"], self.comm.rank)
        return True

    def expert_output_buffer(self, shape, dtype: torch.dtype, device: torch.device):
        """The combine's rows (out), where the experts may write their reduced output [C, H]
        directly (no copy before the combine); None for another shape or dtype."""
        in_flight = self._in_flight
        if in_flight is None or len(shape) != 2 or shape[0] != self.capacity:
            return None
        if torch.compiler.is_compiling():  # a compiled graph cannot write a byte buffer's view
            return None
        state = in_flight.dispatch
        if dtype != self._out_dtype or _row_bytes(shape[1] * dtype.itemsize) != (
            state.combine_bytes
        ):
            return None
        rows = _Buffers.rows(state.buffers.out, self.capacity, state.combine_bytes)
        return rows[: shape[0], : shape[1] * dtype.itemsize].view(dtype)

    def output_columns(self, output: torch.Tensor, expert_output: torch.Tensor):
        """The combine's column blocks (combine_bounds) where the experts write into out (the
        peer or emulated transport, one block or more): block j's barrier and sum are issued,
        on a side stream on CUDA, as soon as the experts report it; None otherwise."""
        in_flight = self._in_flight
        if in_flight is None or torch.compiler.is_compiling():
            return None
        state = in_flight.dispatch
        bufs = state.buffers
        if not bufs.regions or state.columns is not None:
            return None
        if expert_output.data_ptr() != bufs.out.data_ptr() or expert_output.dim() != 2:
            return None
        hidden, dtype = expert_output.shape[1], expert_output.dtype
        bounds = combine_bounds(self.capacity, hidden, dtype)
        if len(bounds) == 2:
            return None
        if in_flight.sp_counts is None and output.dtype == dtype and output.shape[1] == hidden:
            target = output
        else:  # sequence parallel combines this rank's slice, gathered after (finalize)
            num = output.shape[0]
            if in_flight.sp_counts is not None:
                num = in_flight.sp_counts[self.comm.rank]
            target = expert_output.new_empty(num, hidden)
        side = programs = None
        if expert_output.is_cuda:  # (the side stream's uses recorded below)
            side, programs = self._side_stream(expert_output.device)
            # a forward whose experts raise after some blocks never joins the side stream:
            # what it writes and reads there stays allocated until that work is done
            target.record_stream(side)
            state.pos.record_stream(side)
        plan = self._combine_plan(bufs, state.combine_bytes, dtype, hidden * dtype.itemsize)
        state.columns = _Columns(bounds, target, plan, side, programs)
        return OutputColumns(bounds, lambda block: self._combine_columns(state, block + 1))

    def _side_stream(self, device: torch.device) -> tuple[torch.cuda.Stream, int]:
        """(the side stream of this device, its SMs). The highest priority: the combine's
        blocks of threads are scheduled as soon as GEMM2's free an SM, not after all of
        GEMM2's are."""
        found = self._side_streams.get(device)
        if found is None:
            found = self._side_streams[device] = (
                torch.cuda.Stream(device, priority=-100),
                torch.cuda.get_device_properties(device).multi_processor_count,
            )
        return found

    def _combine_columns(self, state: _DispatchState, stop: int, overlapped: bool = True) -> None:
        """Issue the barriers and sums of the column blocks [columns.next, stop), on the side
        stream after what the current one issued (CUDA)."""
        columns = state.columns
        if stop <= columns.next:
            return
        blocks = range(columns.next, stop)
        if columns.side is None:
            self._combine_blocks(state, columns.plan, columns.bounds, columns.target, blocks)
        else:
            columns.side.wait_stream(torch.cuda.current_stream(columns.side.device))
            programs = columns.programs if overlapped else None
            with torch.cuda.stream(columns.side):
                self._combine_blocks(
                    state, columns.plan, columns.bounds, columns.target, blocks, programs
                )
        columns.next = stop

    def _combine_blocks(
        self, state: _DispatchState, plan: _CombinePlan, bounds, target, blocks, programs=None
    ) -> None:
        """Each block's exchange (peer: a barrier) and, unless refused, its sum into the
        target's columns [bounds[j], bounds[j + 1])."""
        dtype, hidden, bufs = target.dtype, bounds[-1], state.buffers
        for j in blocks:
            lo, hi = bounds[j], bounds[j + 1]
            self._transport.combine(bufs, plan, slice(lo * dtype.itemsize, hi * dtype.itemsize))
            if not state.refused:
                block = plan.sources if hi - lo == hidden else plan.block_sources(lo, hi)
                gather_sum_rows(block, state.pos, target[:, lo:hi], self.capacity, programs)

    # ---- dispatch and combine ----
    def _dispatch_plan(self, bufs: _Buffers, row_bytes: int) -> _DispatchPlan:
        """The views a dispatch with rows of row_bytes writes and reads (made once per set of
        buffers, row size and region: a decode call makes no tensor views on the host)."""
        key = ("dispatch", row_bytes, self.max_tokens)
        plan = bufs.plans.get(key)
        if plan is None:

            def view(buf):
                return _Buffers.rows(buf, self.capacity, row_bytes)

            if bufs.regions:  # a region of each rank's recv (or of the staging buffer)
                targets, posts = self._transport.dispatch_targets(bufs, view)
                words = _rank_tensors(t.view(torch.int32) for t in targets)
                targets, posts = _rank_tensors(targets), _rank_tensors(posts)
            else:  # send, grouped by destination
                targets, posts = view(bufs.send), None
                words = targets.view(torch.int32)
            staging = None if bufs.send is None else view(bufs.send)
            recv = view(bufs.recv)
            plan = _DispatchPlan(recv, recv.view(torch.int32), staging, targets, words, posts)
            bufs.plans[key] = plan
        return plan

    def _combine_plan(
        self, bufs: _Buffers, row_bytes: int, dtype: torch.dtype, width: int
    ) -> _CombinePlan:
        """The views a combine of [C, width bytes] partial sums writes and reads (made once)."""
        key = ("combine", row_bytes, dtype, width, self.max_tokens)
        plan = bufs.plans.get(key)
        if plan is None:

            def view(buf):
                return _Buffers.rows(buf, self.capacity, row_bytes)

            rows = view(bufs.out)
            back = None if bufs.send is None else view(bufs.send)
            if bufs.regions:  # rank r's partial sums of this rank's rows: its region at r
                sources = _rank_tensors(
                    r[:, :width].view(dtype) for r in self._transport.combine_sources(bufs, view)
                )
            else:  # grouped: they come back into send where they left
                sources = back[:, :width].view(dtype)
            rows_c = rows[: self.capacity, :width].view(dtype)
            plan = _CombinePlan(rows, rows_c, back, sources)
            bufs.plans[key] = plan
        return plan

    def _dispatch(self, batch: TokenBatch):
        """Packed rows, x's bytes then ids | weights (| scales) as int32 words: stored into each
        rank's region at the destination (regions), or grouped and moved by all_to_all_vdev."""
        device, capacity = batch.x.device, self.capacity
        refused = self._refused is not None
        if refused:  # over the bound: this rank sends nothing, and still joins the exchange
            batch = batch.map(lambda t: t[:0])
        top_k = batch.topk_ids.shape[1]
        hidden = batch.x.shape[1]
        x = to_wire(batch.x).view(torch.uint8)  # [M, H * bytes]
        num_scales = 0 if batch.scale is None else batch.scale.shape[1]
        out_dtype = self._out_dtype or batch.x.dtype
        x_bytes = -(-x.shape[1] // 16) * 16  # the metadata starts 16-byte aligned
        meta_words = 2 * top_k + num_scales
        dispatch_bytes = _row_bytes(x_bytes + 4 * meta_words)
        combine_bytes = _row_bytes(hidden * out_dtype.itemsize)
        bufs = self._buffers(device, dispatch_bytes, combine_bytes)
        bufs.take(device)
        plan = self._dispatch_plan(bufs, dispatch_bytes)
        owner = self._owner_on(device)
        ids_, weights_ = batch.topk_ids, batch.topk_weights
        size, recv = self.comm.size, plan.recv
        pos = dispatch_positions(
            ids_, owner, size, capacity, bufs.counts, grouped=not bufs.regions, post=plan.posts
        )
        input_ready = None
        # the barriers a call makes follow only what every rank shares (routing_first); where
        # the activations go first decides only the stream they travel on
        if bufs.peer is not None and routing_first(capacity, dispatch_bytes):
            if self._overlap_input:  # the experts align their slots while they travel
                side = self._side_stream(device)[0]
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._send_activations(bufs, plan, x, pos, "pads_x")
                x.record_stream(side)
                pos.record_stream(side)
                input_ready = _Join(side)
            else:  # (torch.compile: its graph would not join a side stream)
                self._send_activations(bufs, plan, x, pos, "pads_x")
        else:
            scatter_rows(x, pos, plan.targets, 0, capacity)
        pack_meta(ids_, weights_, batch.scale, pos, plan.words, x_bytes // 4, capacity)
        if bufs.regions:  # each rank's rows are in its region at the destination
            self._transport.after_dispatch(bufs, recv, plan.staging)
            received, region_rows = bufs.incoming, self.max_tokens
        else:  # grouped by destination in send: all_to_all_vdev
            self._transport.all_to_all(plan.targets, recv, bufs.counts, bufs.received[0])
            received, region_rows = bufs.received[0, 0], None

        # the rows that did not arrive hold what an earlier call left: empty slots
        ids, weights, scale = unpack_meta(
            plan.recv_words, x_bytes // 4, received, capacity, top_k, num_scales,
            region_rows,
        )  # fmt: skip
        if scale is not None:
            scale = scale.to(batch.scale.dtype)
        x_in = recv[:capacity, : x.shape[1]].view(batch.x.dtype)  # rows dispatch_bytes apart
        if self.count_traffic:  # the counts on the host: a sync, only where asked
            self._count(bufs.counts, received, dispatch_bytes, combine_bytes)
        state = _DispatchState(pos, bufs, combine_bytes, refused, input_ready=input_ready)
        return TokenBatch(x_in, scale, ids, weights), state

    def _input_ready(self, state: _DispatchState):
        return state.input_ready

    def _send_activations(self, bufs: _Buffers, plan: _DispatchPlan, x, pos, pads: str) -> None:
        """The activations' bytes of each row into its destinations, then a barrier on pads
        (the routing's words travel apart, with the dispatch's own barrier)."""
        scatter_rows(x, pos, plan.targets, 0, self.capacity)
        self._transport.after_dispatch(bufs, plan.recv, plan.staging, pads=pads)

    def _count(self, sent, received, dispatch_bytes: int, combine_bytes: int) -> None:
        """The traffic of the call (rows as they travel, padding included) into self.stats."""
        me = self.comm.rank
        sent, received = sent.tolist(), received.tolist()
        peers_sent, peers_received = sum(sent) - sent[me], sum(received) - received[me]
        self.stats.add(
            dispatch_bytes_sent=peers_sent * dispatch_bytes,
            dispatch_bytes_received=peers_received * dispatch_bytes,
            combine_bytes_sent=peers_received * combine_bytes,
            combine_bytes_received=peers_sent * combine_bytes,
            tokens_sent=peers_sent,
            tokens_received=peers_received,
        )

    def _combine(self, partial, state: _DispatchState, num_tokens: int, out=None):
        bufs, capacity = state.buffers, self.capacity
        hidden, width = partial.shape[1], partial.shape[1] * partial.element_size()

        plan = self._combine_plan(bufs, state.combine_bytes, partial.dtype, width)
        if partial.data_ptr() != plan.rows_c.data_ptr():  # else the experts wrote it there
            plan.rows_c.copy_(partial)
        columns = state.columns
        if columns is not None:  # the blocks the experts did not report, then the join
            self._combine_columns(state, len(columns.bounds) - 1, overlapped=False)
            if columns.side is not None:
                torch.cuda.current_stream(columns.side.device).wait_stream(columns.side)
            out = columns.target
        else:
            if out is None or out.dtype != partial.dtype:
                out = partial.new_empty(num_tokens, hidden)
            if bufs.regions:  # per block: a barrier (peer: the sum then loads from the peers'
                # out), or the regions moved to their senders (emulated); then the sum
                bounds = combine_bounds(capacity, hidden, partial.dtype)
                self._combine_blocks(state, plan, bounds, out, range(len(bounds) - 1))
            else:
                # the rows each rank sent are what goes back to it: the dispatch's received
                # counts (read before the combine's barrier; no peer writes them again before)
                self._transport.all_to_all(
                    plan.rows, plan.back, bufs.received[0, 0], bufs.received[1]
                )
                if not state.refused:
                    gather_sum_rows(plan.sources, state.pos, out, capacity)
        # the exchanges are done and the sums issued (a call that raised before here, a sum
        # included, keeps the buffers held: its exchanges may be out of step, _Buffers.take);
        # held until then, as the sums may read the peers' out: a forward let in before could
        # free them to overwrite it
        bufs.release()
        if state.refused:  # this rank sent nothing: its call is refused in finalize
            out.zero_()
        return out
