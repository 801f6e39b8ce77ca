"""The modular kernel: one PrepareFinalize composed with one Experts backend.

    for each chunk of at most chunk_size tokens:
        prepared = prepare_finalize.prepare(x[chunk], ...)
        experts.apply(ExpertsCall(out_buffer, prepared.a1q, ...))   # into reused workspaces
        prepare_finalize.finalize(output[chunk], out_buffer, ...)

Every token's result depends on that token alone, so chunking changes nothing in the output;
it bounds the workspace memory for long prefills. Under EP the chunks follow the rank with the
most tokens (PrepareFinalize.num_tokens_across_ranks), so every rank joins every collective.
Workspaces are reused across calls, except when autograd records the call (each such call gets
its own, as backward needs them; and the EP prepare/finalize is told, so its collectives take
part in backward on every rank).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass, field

import torch

from fusedmoe.modular.experts import Experts
from fusedmoe.modular.prepare_finalize import PrepareFinalize
from fusedmoe.modular.reduce import TopKWeightAndReduceNoOp
from fusedmoe.modular.types import ActivationSpec, ExpertsCall, ExpertWeights, needs_grad

CHUNK_SIZE_ENV = "FUSEDMOE_CHUNK_SIZE"
DEFAULT_CHUNK_SIZE = 32768


def default_chunk_size() -> int:
    value = os.environ.get(CHUNK_SIZE_ENV)
    if not value:
        return DEFAULT_CHUNK_SIZE
    try:
        size = int(value)
    except ValueError:
        raise ValueError(f"{CHUNK_SIZE_ENV} must be a positive int, got {value!r}") from None
    if size <= 0:
        raise ValueError(f"{CHUNK_SIZE_ENV} must be a positive int, got {value!r}")
    return size


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Never an inference tensor: a buffer made under inference_mode could not be written by a
    later call under no_grad. (The context is entered only where it matters: torch.compile
    traces neither it nor the inference-mode query.)"""
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return torch.empty(numel, dtype=dtype, device=device)
    with torch.inference_mode(False):
        return torch.empty(numel, dtype=dtype, device=device)


def stream_handle(device: torch.device) -> int:
    """The current stream's handle on a CUDA device (0 elsewhere), without building a Stream."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


@dataclass
class WorkspaceCache:
    """Grow-only buffers, one per (role, device, dtype, CUDA stream, thread), reused across
    calls (no allocation at steady state).

    Calls of one thread on one stream run one after another, so every kernel of a process may
    share one cache (`shared_workspaces`, what FusedMoEModularKernel takes by default): a
    model's layers then hold one set of workspaces, not one each (a 48-layer model prefilling a
    32k-token chunk would otherwise keep ~1.5 GB per layer). Other streams and other threads
    get buffers of their own. The buffers are scratch: a copy (deepcopy, pickling) of a shared
    cache is that cache, of a private one an empty one.

    retain: keep the buffers a larger one replaced (a CUDA graph captured with the smaller one
    still writes to its address: it must never be freed and handed to someone else); such a
    cache grows geometrically, so what it keeps stays under twice its largest buffers. Graphs
    are captured on a stream of their lane's own (fusedmoe.modular.graphs), so the buffers a
    graph writes belong to the stream it replays on, and no other stream's replay writes them."""

    buffers: dict[tuple, torch.Tensor] = field(default_factory=dict)
    retain: bool = False
    retired: list[torch.Tensor] = field(default_factory=list)

    def __reduce__(self):
        for retain, cache in _SHARED.items():
            if cache is self:
                return shared_workspaces, (retain,)
        return WorkspaceCache, ({}, self.retain)

    def clear(self) -> None:
        """Free the buffers (the next call allocates again). Not for a retain cache: graphs
        captured with its buffers would write to freed memory (fusedmoe.empty_cache drops the
        graphs first, then those buffers)."""
        if self.retain:
            raise ValueError("a retain=True cache backs CUDA graphs: its buffers cannot be freed")
        self.buffers.clear()

    def release_unused(self) -> None:
        """A retain cache's clear, for the caller that has just dropped every graph using it."""
        self.buffers.clear()
        self.retired.clear()

    def get(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        if torch.compiler.is_compiling():
            # A buffer kept across compiled calls would be a graph input the op mutates (CUDA
            # graph trees then skip the whole graph) or, stored from inside the graph, an output
            # the next replay overwrites. Inside a graph the allocator plans the memory anyway.
            return torch.empty(shape, dtype=dtype, device=device)
        numel = 1
        for size in shape:
            numel *= size
        key = (role, device, dtype, stream_handle(device), threading.get_ident())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = max(numel, 1)
            if buf is not None and self.retain:
                self.retired.append(buf)
                size = max(size, 2 * buf.numel())
            buf = _empty(size, dtype, device)
            self.buffers[key] = buf
        return buf[:numel].view(shape)


_SHARED = {False: WorkspaceCache(), True: WorkspaceCache(retain=True)}


def shared_workspaces(retain: bool = False) -> WorkspaceCache:
    """The process-wide workspaces every modular kernel uses unless given its own: one cache for
    eager calls, one (retain=True) for calls CUDA graphs capture."""
    return _SHARED[retain]


class FusedMoEModularKernel:
    def __init__(
        self,
        prepare_finalize: PrepareFinalize,
        experts: Experts,
        *,
        chunk_size: int | None = None,
        retain_workspaces: bool = False,
        workspaces: WorkspaceCache | None = None,
    ) -> None:
        """retain_workspaces: never free a workspace (for a kernel that CUDA graphs capture).
        workspaces: a cache of the kernel's own (default: the process-wide shared_workspaces)."""
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.chunk_size = default_chunk_size() if chunk_size is None else chunk_size
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if workspaces is None:
            workspaces = shared_workspaces(retain_workspaces)
        elif retain_workspaces and not workspaces.retain:
            raise ValueError("retain_workspaces needs a WorkspaceCache(retain=True)")
        self.workspaces = workspaces

    def forward(
        self,
        hidden_states: torch.Tensor,
        weights: ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        activation: ActivationSpec,
        global_num_experts: int,
        expert_map: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
        quant_config: object | None = None,
    ) -> torch.Tensor:
        """hidden_states [M, H] -> [M, H]. Inputs are assumed checked by the caller."""
        num_tokens = hidden_states.shape[0]
        output = torch.empty_like(hidden_states)
        # Under EP every rank runs as many chunks as the rank with the most tokens: a rank with
        # fewer (or none) passes empty chunks, and still joins each dispatch and combine.
        most = self.prepare_finalize.num_tokens_across_ranks(num_tokens, hidden_states.device)
        if self.prepare_finalize.single_pass():  # one dispatch per call, zero tokens too
            most = step = max(most, 1)
        elif most == 0:
            return output
        else:
            step = self.chunk_size if self.experts.supports_chunking() else most
        recorded = needs_grad(hidden_states, weights, topk_weights)
        for chunk_start in range(0, most, step):
            start, end = min(chunk_start, num_tokens), min(chunk_start + step, num_tokens)
            self._forward_chunk(
                output[start:end],
                hidden_states[start:end],
                weights,
                topk_weights[start:end],
                topk_ids[start:end],
                activation=activation,
                global_num_experts=global_num_experts,
                expert_map=expert_map,
                apply_router_weight_on_input=apply_router_weight_on_input,
                quant_config=quant_config,
                recorded=recorded,
            )
        return output

    def _forward_chunk(
        self,
        output,
        hidden_states,
        weights,
        topk_weights,
        topk_ids,
        *,
        activation,
        global_num_experts,
        expert_map,
        apply_router_weight_on_input,
        quant_config,
        recorded,
    ) -> None:
        experts = self.experts
        prepared = self.prepare_finalize.prepare(
            hidden_states,
            topk_weights,
            topk_ids,
            global_num_experts,
            expert_map,
            apply_router_weight_on_input,
            quant_config,
            defer_input_quant=experts.wants_unquantized_input(),
            # only when set: a PrepareFinalize written before this keyword still runs inference
            **({"requires_grad": True} if recorded else {}),
        )
        num_tokens, top_k = prepared.topk_ids.shape
        input_ready = prepared.input_ready  # the activations may still be on their way
        if input_ready is not None and (
            not (num_tokens and experts.reads_input_late(quant_config))
            or torch.compiler.is_compiling()  # a callback is no op argument
        ):
            input_ready()
            input_ready = None
        shapes = experts.workspace_shapes(
            num_tokens,
            weights.gemm1_out_size,
            weights.hidden_size,
            top_k,
            global_num_experts,
            weights.num_local_experts,
            activation.kind,
        )
        dtype = experts.workspace_dtype(hidden_states.dtype)
        device = hidden_states.device
        # Under autograd a backend keeps what it saves for backward in tensors of its own: it
        # gets empty workspaces, and an output buffer that is never reused.
        if recorded:
            shapes = dataclasses.replace(shapes, workspace13=(0,), workspace2=(0,))
        workspaces = WorkspaceCache() if recorded else self.workspaces
        workspace13 = workspaces.get("workspace13", shapes.workspace13, dtype, device)
        workspace2 = workspaces.get("workspace2", shapes.workspace2, dtype, device)
        reduce = experts.finalize_weight_and_reduce_impl()
        output_columns = None
        if (
            isinstance(reduce, TopKWeightAndReduceNoOp)
            and self.prepare_finalize.experts_may_write_output()
            and tuple(shapes.output) == tuple(output.shape)
        ):
            expert_output = output  # the backend reduces into the result: finalize copies nothing
        else:
            expert_output = None
            if not recorded:
                expert_output = self.prepare_finalize.expert_output_buffer(
                    tuple(shapes.output), hidden_states.dtype, device
                )
                # the combine may start on the blocks the experts have written (EP)
                if expert_output is not None and experts.writes_output_columns(quant_config):
                    output_columns = self.prepare_finalize.output_columns(output, expert_output)
            if expert_output is None:
                expert_output = workspaces.get("output", shapes.output, hidden_states.dtype, device)
        if num_tokens:  # EP: a rank where no token landed skips its experts, not finalize
            call = ExpertsCall(
                output=expert_output,
                hidden_states=prepared.a1q,
                weights=weights,
                topk_weights=prepared.topk_weights,
                topk_ids=prepared.topk_ids,
                activation=activation,
                global_num_experts=global_num_experts,
                workspace13=workspace13,
                workspace2=workspace2,
                expert_map=expert_map,
                quant_config=quant_config,
                a1q_scale=prepared.a1q_scale,
                a1q_global_scale=prepared.a1q_global_scale,
                expert_tokens_meta=prepared.expert_tokens_meta,
                apply_router_weight_on_input=apply_router_weight_on_input,
                output_columns=output_columns,
                input_ready=input_ready,
            )
            try:
                experts.apply(call)
            except BaseException:
                if input_ready is not None:  # what the dispatch left in flight is joined (a
                    input_ready()  # CUDA graph capture must end with every stream joined)
                raise
        self.prepare_finalize.finalize(
            output,
            expert_output,
            prepared.topk_weights,
            prepared.topk_ids,
            apply_router_weight_on_input,
            reduce,
        )

    def __repr__(self) -> str:
        return f"FusedMoEModularKernel({self.prepare_finalize!r}, {self.experts!r})"
