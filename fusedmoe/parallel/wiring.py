"""The FusedMoE layer's parallel parts: the checks of its parallel config, its placement and the
buffers that go with it, and the objects that move its tokens.

    check_parallel     the config against the layer (before anything is built)
    ep_partial         whether each rank's output is a partial sum the caller all-reduces
    initial_placement  the placement parallel_config asks for (fusedmoe.parallel.placement)
    set_placement      a placement and its buffers on the layer: expert_map, EPLB replica table
    describe_placement the placement in the layer's repr
    resolve_dispatch   the dispatch kind of a call ("auto": symm_mem where NVSHMEM runs), and why
    prepare_finalize   the modular kernel's PrepareFinalize: NoEP unless tokens travel
    layer_fingerprint  what every rank's layer must share, compared before tokens travel
    agree_shared_tokens  the same, once, for EP over shared tokens (no dispatch)
    make_runner        what a call runs: a modular kernel around the backend, or the backend
    dp_dispatch        the DP all-gather a backend that routes inside is handed (or None)

torch.distributed is imported only where a dispatch is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedmoe.modular.experts import Experts
from fusedmoe.modular.kernel import FusedMoEModularKernel
from fusedmoe.modular.prepare_finalize import NoEPPrepareFinalize, PrepareFinalize
from fusedmoe.modular.types import TokenDispatch
from fusedmoe.parallel.config import ParallelConfig
from fusedmoe.parallel.fingerprint import LayerFingerprint
from fusedmoe.parallel.placement import ExpertPlacement, expert_placement


def ep_partial(pc: ParallelConfig) -> bool:
    """Whether the layer's output is this rank's partial sum (EP over shared tokens, no
    dispatch): an all-reduce completes it."""
    return pc.use_ep and not pc.moves_tokens


def check_parallel(pc: ParallelConfig, num_experts: int, routed_output_transform) -> None:
    """Refuse a parallel config the layer cannot run (TypeError / ValueError saying why)."""
    if not isinstance(pc, ParallelConfig):
        raise TypeError(f"parallel_config must be a ParallelConfig, got {type(pc).__name__}")
    if pc.ep_size > num_experts + pc.num_redundant_experts:
        raise ValueError(
            f"parallel_config.ep_size ({pc.ep_size}) must be <= num_experts ({num_experts})"
            + (
                f" + num_redundant_experts ({redundant})"
                if (redundant := pc.num_redundant_experts)
                else ""
            )
            + ": every rank holds at least one expert"
        )
    if pc.dp_size > 1 and pc.use_ep and (pc.ep_size, pc.ep_rank) != (pc.dp_size, pc.dp_rank):
        raise ValueError(
            "parallel_config: with dp_size > 1 and ep_size > 1 the experts are sharded over "
            f"the DP group, so ep_size / ep_rank must equal dp_size / dp_rank; got "
            f"ep {pc.ep_rank}/{pc.ep_size}, dp {pc.dp_rank}/{pc.dp_size}"
        )
    if ep_partial(pc) and routed_output_transform is not None:
        raise ValueError(
            "routed_output_transform with ep_size > 1 and no DP: the layer returns this "
            "rank's partial sum, which a (nonlinear) transform does not commute with"
        )


def initial_placement(num_experts: int, pc: ParallelConfig) -> ExpertPlacement:
    return expert_placement(num_experts, pc.ep_size, pc.placement, pc.num_redundant_experts)


def set_placement(layer, placement: ExpertPlacement, device=None) -> None:
    """FusedMoE._set_placement: the layer takes `placement` (its weights are the caller's
    business: fusedmoe.parallel.eplb moves them).

    layer.expert_start: the first global id of this rank's experts when they are one contiguous
    block of logical experts (what the monolithic backend runs), else None. Buffers (not saved
    in the state dict): expert_map where experts are mapped (EP or replicas), the EPLB replica
    table and counts, and expert_load (kept across placements). The layer's backends are
    dropped: an all-to-all dispatch knows where each expert lives.
    """
    pc = layer.parallel_config
    if device is None and getattr(layer, "w13_weight", None) is not None:
        device = layer.w13_weight.device
    layer.placement = placement
    layer.local_num_experts = placement.num_local(pc.ep_rank)
    layer.expert_start = placement.contiguous_start(pc.ep_rank)
    mapped = pc.use_ep or placement.has_replicas
    layer.register_buffer(
        "expert_map", placement.expert_map(pc.ep_rank, device) if mapped else None, False
    )
    table, counts = placement.replica_table(device) if placement.has_replicas else (None, None)
    layer.register_buffer("logical_to_physical", table, False)
    layer.register_buffer("replica_count", counts, False)
    if getattr(layer, "expert_load", None) is None:
        load = torch.zeros(layer.num_experts, dtype=torch.int64, device=device)
        layer.register_buffer("expert_load", load, False)
    layer._kernels = {}


def describe_placement(pc: ParallelConfig, placement: ExpertPlacement, expert_start) -> str:
    """The layer's experts for its repr ("" without EP or replicas)."""
    if not (pc.use_ep or placement.has_replicas):
        return ""
    if expert_start is not None:
        return f", experts [{expert_start}, {expert_start + placement.num_local(pc.ep_rank)})"
    return f", experts {{{placement.describe(pc.ep_rank)}}}"


@dataclass(frozen=True)
class DispatchChoice:
    """How a call's tokens travel between ranks (ParallelConfig.all2all_backend resolved for
    one call signature), and why."""

    kind: str | None  # "naive", "all_to_all", "symm_mem"; None: tokens stay on their rank
    reason: str = ""

    def describe(self) -> str:
        return (
            "none (tokens stay on their rank)"
            if self.kind is None
            else (f"{self.kind}: {self.reason}")
        )


def resolve_dispatch(
    pc: ParallelConfig,
    device: torch.device,
    *,
    requires_grad: bool = False,
    rows_independent: bool = True,
    routes_inside: bool = False,
) -> DispatchChoice:
    """The dispatch kind a call on `device` runs (pc.all2all_backend, "auto" resolved).

    auto: symm_mem on CUDA where NVSHMEM runs (counts stay on the GPU: no host sync, CUDA-graph
    capturable), else naive. Where symm_mem cannot run the call (a forward autograd records,
    an activation scale over the whole batch, a backend that routes inside): the kind that
    can, saying why. symm_mem asked for on a machine without NVSHMEM: ValueError."""
    if not pc.moves_tokens:
        return DispatchChoice(None)
    asked = pc.all2all_backend
    if asked in ("naive", "all_to_all"):
        return DispatchChoice(asked, "asked for (ParallelConfig.all2all_backend)")
    if routes_inside:
        return DispatchChoice("naive", "the backend routes inside and dispatches by all-gather")
    not_symm = None
    if requires_grad:
        not_symm = "symm_mem is inference only; all_to_all's collectives have their adjoints"
    elif not rows_independent:
        not_symm = (
            "the activations take one scale over the whole batch, which symm_mem's fixed-size "
            "receive buffer (stale rows) would change"
        )
    if not_symm is not None:
        return DispatchChoice("naive" if asked == "auto" else "all_to_all", not_symm)
    from fusedmoe.parallel.symm_mem_ep import emulated_transport, nvshmem_unavailable_reason

    emulated = emulated_transport()
    # the emulated transport (tests): any device, any process group
    why = None if emulated else nvshmem_unavailable_reason(device, pc.group)
    if why is None:
        how = "the emulated transport (tests)" if emulated else "CUDA with NVSHMEM"
        return DispatchChoice(
            "symm_mem",
            ("asked for" if asked == "symm_mem" else "auto")
            + f", {how}: counts stay on the GPU, up to {pc.max_tokens_per_rank} tokens per "
            "rank a call",
        )
    if asked == "symm_mem":
        raise ValueError(f"all2all_backend='symm_mem' cannot run here: {why}")
    return DispatchChoice("naive", f"auto; symm_mem {why}")


def prepare_finalize(
    pc: ParallelConfig, placement: ExpertPlacement, kind: str | None = None
) -> PrepareFinalize:
    """The prepare/finalize for the parallel config and dispatch kind (resolve_dispatch; None:
    the config's own, "auto" taken as naive): NoEP unless tokens travel."""
    if not pc.moves_tokens:
        return NoEPPrepareFinalize()
    kind = kind or pc.all2all_backend
    # torch.distributed is imported here, only when a dispatch is asked for
    if kind in ("all_to_all", "symm_mem"):  # tokens to the ranks of their experts
        if kind == "symm_mem":
            from fusedmoe.parallel.symm_mem_ep import SymmMemEPPrepareFinalize as cls

            extra = {"max_tokens_per_rank": pc.max_tokens_per_rank}
        else:
            from fusedmoe.parallel.all_to_all_ep import AllToAllEPPrepareFinalize as cls

            extra = {}
        return cls(
            pc.ep_size, pc.ep_rank, placement.owner(), pc.group,
            sequence_parallel=pc.sequence_parallel, **extra,
        )  # fmt: skip
    from fusedmoe.parallel.naive_ep import NaiveEPPrepareFinalize

    return NaiveEPPrepareFinalize(
        pc.ep_size, pc.ep_rank, pc.group, sequence_parallel=pc.sequence_parallel
    )


def layer_fingerprint(layer, dispatch: str | None, experts: Experts) -> LayerFingerprint:
    """What every rank's layer must share for its dispatch to run (compared before tokens
    travel; fusedmoe.parallel.fingerprint)."""
    pc = layer.parallel_config
    qc = layer.quant_config
    chunked = dispatch != "symm_mem" and experts.supports_chunking()
    return LayerFingerprint(
        (
            ("num_experts", layer.num_experts),
            ("physical_experts", layer.placement.num_physical),
            ("top_k", layer.top_k),
            ("hidden_size", layer.hidden_size),
            ("intermediate_size", layer.padded_intermediate_size),
            ("dtype", str(layer.params_dtype)),
            ("activation", layer.activation.kind.value),
            ("has_bias", layer.has_bias),
            ("quant_scheme", "none" if qc is None else qc.scheme),
            ("quant_options", repr(sorted(layer._quant_options.items()))),
            ("ep_size", pc.ep_size),
            ("dp_size", pc.dp_size),
            ("sequence_parallel", pc.sequence_parallel),
            ("placement", pc.placement),
            ("num_redundant_experts", pc.num_redundant_experts),
            ("dispatch", dispatch or "none"),
            ("max_tokens_per_rank", pc.max_tokens_per_rank if dispatch == "symm_mem" else 0),
            ("chunk_size", layer.chunk_size if chunked else 0),
        )
    )


def agree_shared_tokens(layer, runner, device: torch.device) -> None:
    """EP over shared tokens makes no collective of its own (the caller all-reduces the partial
    sums), so a rank built with another layer would hang or corrupt that all-reduce: the ranks
    compare their fingerprints once per runner, at its first call where torch.distributed is
    initialized (one all-gather and a host read; not while torch.compile traces). Every rank
    raises the same ValueError where they differ."""
    if getattr(runner, "_fingerprint_agreed", False) or torch.compiler.is_compiling():
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # shards run in one process (tests, a caller summing them): nothing to compare
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the first call of an EP layer over shared tokens compares the ranks' layers (a "
            "collective): make one eager call on every rank before capturing a CUDA graph"
        )
    from fusedmoe.parallel.comm import EPGroup

    pc = layer.parallel_config
    group = EPGroup(pc.ep_size, pc.ep_rank, pc.group)
    group.check()
    group.fingerprint = layer_fingerprint(layer, None, getattr(runner, "experts", runner))
    group.agree(device)
    runner._fingerprint_agreed = True


def attach_fingerprint(runner, dispatch: TokenDispatch | None, fingerprint) -> None:
    """Give the runner's EP group (and a backend's DP dispatch) the fingerprint to compare."""
    pf = getattr(runner, "prepare_finalize", None)
    for owner in (pf, dispatch):
        comm = getattr(owner, "comm", None)
        if comm is not None:
            comm.fingerprint = fingerprint


def make_runner(
    experts: Experts,
    pc: ParallelConfig,
    placement: ExpertPlacement,
    chunk_size: int,
    *,
    dispatch: str | None = None,
    retain_workspaces: bool = False,
) -> Experts | FusedMoEModularKernel:
    """What the layer's calls on backend `experts` run: the backend itself where it routes
    inside (it is handed the logits), else a modular kernel of the prepare/finalize of
    `dispatch` (resolve_dispatch's kind) around it (retain_workspaces: workspaces never freed,
    for CUDA graphs)."""
    if experts.routes_inside:
        return experts
    return FusedMoEModularKernel(
        prepare_finalize(pc, placement, dispatch),
        experts,
        chunk_size=chunk_size,
        retain_workspaces=retain_workspaces,
    )


def dp_dispatch(pc: ParallelConfig) -> TokenDispatch | None:
    """The DP all-gather dispatch / combine a backend that routes inside (monolithic) is handed
    where the DP group's ranks hold different experts; None where tokens stay local."""
    if not (pc.dp_size > 1 and pc.use_ep):
        return None
    from fusedmoe.parallel.dp_dispatch import AllGatherDispatch  # torch.distributed

    return AllGatherDispatch(pc.dp_size, pc.dp_rank, pc.group)
