"""FusedMoE: the MoE layer as an nn.Module.

Legend: T tokens (all leading dimensions flattened), H hidden, I intermediate, E experts.

forward(hidden_states [..., H], router_logits [..., E (+ zero experts)], input_ids [...]):
    x_r    = routed_input_transform(x)                  (identity by default)
    w, ids = router(x_r, logits, input_ids)             (routed_scaling_factor is in w)
    w, ids, zero_out = split_zero_experts(x_r, w, ids)  (zero experts never reach a backend)
    y      = modular_kernel(pad(x_r), w, ids)           (pad: when the backend needs an H multiple)
    y      = unpad(y) + zero_out
    y      = routed_output_transform(y)                 (identity by default)
    y     += shared_experts(x) * sigmoid(shared_expert_gate(x))   (gate optional)

A backend that routes inside (monolithic) replaces the router and modular kernel lines: it is
handed the logits, y, w, ids = backend.apply_monolithic(x_r, logits, ...), and the zero experts'
output is computed from the w, ids it returns. routed_scaling_factor is applied to the router
weights in float32, so identity zero experts are scaled like every other routed expert.

Parallelism (parallel_config; fusedmoe.parallel.config says how tokens and experts are spread):
    ep_size > 1   the layer holds its rank's physical experts only, placed as
                  parallel_config.placement says ("linear" blocks or "round_robin";
                  fusedmoe.parallel.placement), plus num_redundant_experts replicas (EPLB); its
                  expert_map buffer maps physical ids to local slots. load_weights takes global
                  checkpoints and keeps (and replicates) the local experts.
      dp_size == 1, not sequence_parallel: the ranks share their tokens and the output is this
                  rank's partial sum: an all-reduce over the EP group gives the layer's output.
                  The terms that belong to no expert (zero experts, shared experts) are added by
                  ep_rank 0 only, so the sum stays exact; a routed_output_transform (not linear
                  in general) is refused.
      dp_size == ep_size (EP over the DP group) or sequence_parallel: tokens travel to their
                  experts (modular backends: parallel_config.all2all_backend, "auto":
                  "symm_mem" on CUDA with NVSHMEM (counts on the GPU, CUDA-graph capturable,
                  inference only), else "naive" all-gather; or "all_to_all"; monolithic:
                  all-gather) and each rank gets the full output of its own tokens (sequence
                  parallel: of every token). Ranks built with different layers raise a
                  ValueError before tokens travel (fusedmoe.parallel.fingerprint).
                  Modular backends train there too (naive / all_to_all; a training call under
                  symm_mem runs all_to_all): backward runs the adjoint collectives
                  (fusedmoe.parallel.comm); under sequence parallel the output's gradient must
                  be the same on every rank, and each gets the whole gradient of its inputs.
    dp_size > 1, ep_size == 1: every rank holds every expert and its tokens stay local.
EPLB (num_redundant_experts > 0): each token's logical ids pick one physical replica
(fusedmoe.parallel.eplb.map_to_physical); expert_load counts the logical experts' tokens;
fusedmoe.parallel.eplb.rebalance and apply_placement move the experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from fusedmoe import layer_backends
from fusedmoe._checks import FLOAT_DTYPES, check_positive_int, check_tensor
from fusedmoe.activation import ActivationParams, MoEActivation
from fusedmoe.layer_graphs import (
    RouterGate,
    forward_graphed,
    gate_logits,
    gate_reads,
    graph_safe,
)
from fusedmoe.modular.experts import Experts
from fusedmoe.modular.graphs import DEFAULT_MAX_TOKENS, may_replay
from fusedmoe.modular.kernel import default_chunk_size
from fusedmoe.modular.types import ActivationSpec, InsideRouting
from fusedmoe.oracle import BackendChoice
from fusedmoe.parallel.config import ParallelConfig
from fusedmoe.parallel.eplb import map_to_physical, record_expert_load
from fusedmoe.parallel.placement import ExpertPlacement
from fusedmoe.parallel.wiring import (
    agree_shared_tokens,
    check_parallel,
    describe_placement,
    dp_dispatch,
    ep_partial,
    initial_placement,
    set_placement,
)
from fusedmoe.quant.config import FusedMoEQuantConfig, check_inference_only
from fusedmoe.router import ZeroExpertSplit, ZeroExpertType, split_zero_experts
from fusedmoe.router.factory import RouterBuilder
from fusedmoe.weights import loading, quantize
from fusedmoe.weights.quantize import call_quant_config
from fusedmoe.weights.tensors import (
    as_buffer,
    create_experts,
    expert_params,
    expert_weights,
    reset_experts,
)

Transform = Callable[[torch.Tensor], torch.Tensor]


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: MoEActivation | str = "silu",
        activation_params: ActivationParams | None = None,
        renormalize: bool = True,
        scoring_func: str = "softmax",
        use_grouped_topk: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        routed_scaling_factor: float = 1.0,
        custom_routing_function=None,
        zero_expert_num: int = 0,
        zero_expert_type: ZeroExpertType | str | None = None,
        hash_indices_table: torch.Tensor | None = None,
        has_bias: bool = False,
        shared_experts: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        routed_input_transform: Transform | None = None,
        routed_output_transform: Transform | None = None,
        quant_config: str | None = None,
        quant_options: dict | None = None,
        parallel_config: ParallelConfig | None = None,
        backend: str | type[Experts] = "auto",
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        gpt_oss_routing: bool = False,
    ) -> None:
        """The MoE layer (see the module docstring for the forward pass and parallelism).

        gpt_oss_routing: route as gpt-oss does, top-k over the raw logits and then softmax over
        those k. It equals the default softmax, top-k, renormalize (which it needs), so it
        changes how the monolithic backend computes the routing, not the result; other backends
        route through the router.

        quant_config: a scheme the layer is built quantized in (its weights then come from
        load_weights); quant_options: that scheme's options, as quantize_ takes them (for
        example {"fast_accum": True} or {"use_ue8m0": True} for fp8_block).
        """
        super().__init__()
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.top_k = check_positive_int("top_k", top_k)
        self.hidden_size = check_positive_int("hidden_size", hidden_size)
        self.intermediate_size = check_positive_int("intermediate_size", intermediate_size)
        self.activation = ActivationSpec.make(activation, activation_params)
        if params_dtype not in FLOAT_DTYPES:
            raise TypeError(f"params_dtype must be a float dtype, got {params_dtype}")
        self.parallel_config = parallel_config or ParallelConfig()
        check_parallel(self.parallel_config, self.num_experts, routed_output_transform)
        if shared_expert_gate is not None and shared_experts is None:
            raise ValueError("shared_expert_gate needs shared_experts")
        quantize.check_quant_options(quant_config, quant_options)
        self.params_dtype = params_dtype  # the activations' dtype (weights may be quantized)
        self.quant_scheme: str | None = None
        self._quant_options: dict = {}
        self.zero_expert_num = zero_expert_num
        self.zero_expert_type = (
            None if zero_expert_type is None else ZeroExpertType.parse(zero_expert_type)
        )
        self.routed_input_transform = routed_input_transform
        self.routed_output_transform = routed_output_transform
        self.shared_experts = shared_experts
        self.shared_expert_gate = shared_expert_gate

        # the physical experts this rank holds (all of them without EP), and the expert_map,
        # replica table and load counters that go with them (fusedmoe.parallel.wiring)
        self._set_placement(initial_placement(num_experts, self.parallel_config), device)
        #: count each logical expert's tokens in expert_load (on with EPLB replicas)
        self.record_expert_load = self.parallel_config.num_redundant_experts > 0
        #: intermediate size of the stored weights: intermediate_size, or that rounded up to the
        #: K-group width of a quantization scheme (see quantize_)
        self.padded_intermediate_size = intermediate_size
        # w13_weight [E_l, N, H], w2_weight [E_l, H, I] (+ w13_bias [E_l, N], w2_bias [E_l, H])
        create_experts(self, has_bias, params_dtype, device)
        self.register_buffer("e_score_correction_bias", as_buffer(e_score_correction_bias, device))
        self.register_buffer("hash_indices_table", as_buffer(hash_indices_table, device))
        self._router_builder = RouterBuilder(
            top_k,
            num_experts,
            renormalize=renormalize,
            scoring_func=scoring_func,
            use_grouped_topk=use_grouped_topk,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            custom_routing_function=custom_routing_function,
            zero_expert_num=zero_expert_num,
            zero_expert_type=zero_expert_type,
        )
        self.router = self._router_builder.build(
            self.e_score_correction_bias, self.hash_indices_table
        )
        if not isinstance(gpt_oss_routing, bool):
            raise TypeError(f"gpt_oss_routing must be a bool, got {type(gpt_oss_routing).__name__}")
        self.gpt_oss_routing = gpt_oss_routing
        InsideRouting(self.router, gpt_oss_routing)  # refuses gpt-oss routing on another router
        # the DP all-gather dispatch / combine of the monolithic backend (None: tokens stay)
        self._dispatch = dp_dispatch(self.parallel_config)
        self.chunk_size = default_chunk_size()  # tokens per pass of the modular kernel
        #: calls of up to this many tokens (CUDA, no autograd) replay CUDA graphs of the routed
        #: part, one per token bucket (fusedmoe.modular.graphs: powers of two to 256, then
        #: multiples of 256); 0 turns that off
        self.cuda_graph_max_tokens = DEFAULT_MAX_TOKENS
        self._graph_state = None
        self.reset_parameters()
        self.backend, self._kernels = backend, {}
        if quant_config is not None:  # random weights, quantized; load_weights fills them
            self.quantize_(quant_config, **(quant_options or {}))
        self.set_backend(backend)

    # ---- construction helpers ----
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """nn.Module's load, then the router rebuilt on the loaded buffers where assign=True
        replaced them (before any forward, so that a first torch.compile trace has nothing to
        rebuild: the router's checks do not trace)."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._sync_router()

    def _sync_router(self) -> None:
        """Rebuild the router where a buffer it holds was replaced, not changed in place
        (RouterBuilder.synced says why the buffers are read first)."""
        buffers = (self.e_score_correction_bias, self.hash_indices_table)
        if (router := self._router_builder.synced(self.router, *buffers)) is not self.router:
            self.router = router

    def _set_placement(self, placement: ExpertPlacement, device=None) -> None:
        """Take `placement` and its buffers (fusedmoe.parallel.wiring.set_placement)."""
        set_placement(self, placement, device)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_graph_state"] = None  # CUDA graphs are not copied (a copy captures its own)
        return state

    def _apply(self, fn, recurse=True):
        quantize.check_keeps_dtypes(self, fn)  # a quantized layer moves, never casts
        result = super()._apply(fn, recurse)
        if self.quant_scheme is None:
            self.params_dtype = self.w13_weight.dtype
        # .to() / .cuda() replace the buffers the router holds: rebuild it on the new ones
        self._sync_router()
        # and drop the backends built for the old tensors: their per-expert views would keep the
        # old device's or dtype's memory alive (workspaces and graph buffers are the process's:
        # fusedmoe.empty_cache() frees them)
        self._kernels = {}
        return result

    # ---- weights (fusedmoe.weights) ----
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True
    ) -> list[str]:
        """Copy checkpoint tensors (global, named as fusedmoe.weights.names reads them) into
        the layer; returns the names loaded. strict: every expert tensor of this rank's experts
        must be written by now, else ValueError (strict=False loads in parts; missing_weights
        says what is left). fusedmoe.weights.loading.load_weights says what is accepted."""
        return loading.load_weights(self, weights, strict=strict)

    def missing_weights(self) -> list[str]:
        """The expert tensors no load_weights call has written yet ([] once all are), e.g.
        ["w13_weight gate rows of experts [1-127]", "w2_weight of experts [0-127]"]."""
        return loading.missing_weights(self)

    def quantize_(self, scheme: str, **config_kwargs) -> FusedMoE:
        """Quantize the experts' float weights in place to `scheme` (fusedmoe.quant.config),
        config_kwargs as make_quant_config takes them; intermediate_size may be zero-padded to
        padded_intermediate_size, the output unchanged (fusedmoe.weights.quantize.quantize_)."""
        return quantize.quantize_(self, scheme, **config_kwargs)

    @property
    def quant_config(self) -> FusedMoEQuantConfig | None:
        """The quant config of the current weights and scales (None when unquantized)."""
        return quantize.quant_config(self)

    def reset_parameters(self) -> None:
        """Random init as nn.Linear does: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        reset_experts(self)
        loading.forget_writes(self)  # random, valid, and not loaded

    # ---- backend (fusedmoe.layer_backends) ----
    def set_backend(self, backend: str | type[Experts]) -> None:
        """Run on `backend` ("auto": the oracle's choice per device and dtype) from now on;
        checked at once for the parameters' device and dtype (refused here, not at a forward)."""
        layer_backends.set_backend(self, backend)

    def backend_choice(
        self,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
    ) -> BackendChoice:
        """The backend this layer runs on `device` / `dtype` (default: the parameters'), and why.

        requires_grad: for a forward that autograd records (training), not an inference one.
        """
        device = device or self.w13_weight.device
        dtype = dtype or self.params_dtype
        return self._kernel(device, dtype, requires_grad)[0]

    def _kernel(self, device: torch.device, dtype: torch.dtype, requires_grad: bool):
        """(the backend chosen for calls of this signature, the runner they call)"""
        return layer_backends.kernel(self, device, dtype, requires_grad)

    # ---- forward ----
    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [..., H], router_logits [..., E] -> [..., H]."""
        x = check_tensor("hidden_states", hidden_states, dtypes=FLOAT_DTYPES)
        check_tensor("router_logits", router_logits, dtypes=FLOAT_DTYPES, device=x.device)
        if x.dim() == 0 or router_logits.shape[:-1] != x.shape[:-1]:
            raise ValueError(
                f"hidden_states {tuple(x.shape)} and router_logits {tuple(router_logits.shape)} "
                "must share their leading dimensions"
            )
        return self._forward(x, router_logits, input_ids, None)

    def forward_gated(self, hidden_states: torch.Tensor, gate: RouterGate) -> torch.Tensor:
        """forward(hidden_states, gate.logits(gate.module, x)), for a caller that owns the
        router: hidden_states [..., H] -> [..., H]. Where the call replays a CUDA graph, the
        logits (and the shared experts) are computed inside it: one graph launch for the block
        (fusedmoe.layer_graphs says which modules a graph may stand in for)."""
        x = check_tensor("hidden_states", hidden_states, dtypes=FLOAT_DTYPES)
        if not isinstance(gate, RouterGate):
            raise TypeError(f"gate must be a RouterGate, got {type(gate).__name__}")
        if x.dim() == 0:
            raise ValueError("hidden_states must have at least one dimension [..., H]")
        return self._forward(x, None, None, gate)

    def _forward(self, x, router_logits, input_ids, gate: RouterGate | None) -> torch.Tensor:
        """forward, its arguments checked; router_logits None: gate computes them."""
        self._sync_router()
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        logits = None
        if router_logits is not None:
            logits = router_logits.reshape(-1, router_logits.shape[-1])
        if input_ids is not None:
            check_tensor("input_ids", input_ids, device=x.device)
            if input_ids.shape != lead:
                raise ValueError(
                    f"input_ids must have shape {tuple(lead)}, got {tuple(input_ids.shape)}"
                )
            input_ids = input_ids.reshape(-1)

        x_routed = x if self.routed_input_transform is None else self.routed_input_transform(x)
        self._check_routed_input(x_routed, x)
        # a gate stays for a CUDA graph to compute (never under autograd or tracing)
        if gate is not None and (torch.is_grad_enabled() or torch.compiler.is_compiling()):
            logits, gate = gate_logits(gate, x), None
        grad = torch.is_grad_enabled() and (
            x_routed.requires_grad
            or logits.requires_grad  # the router's gradient flows through the top-k weights
            or any(p.requires_grad for p in expert_params(self))
        )
        if grad and self.quant_scheme is not None:  # before any backend is chosen
            check_inference_only(call_quant_config(self), expert_params(self), x_routed)
        choice, runner = self._kernel(x_routed.device, x_routed.dtype, grad)
        if ep_partial(self.parallel_config):  # no dispatch to carry the ranks' fingerprints
            agree_shared_tokens(self, runner, x_routed.device)
        replayed = None  # decode calls from CUDA graphs (fusedmoe.layer_graphs)
        graphed = input_ids is None and graph_safe(self, choice)
        if graphed and may_replay(x_routed, self.cuda_graph_max_tokens):
            # the gate's module walked only here, where a graph may compute its logits
            reads = None if gate is None else gate_reads(self, gate)
            if gate is not None and reads is None:
                logits, gate = gate_logits(gate, x), None
            replayed = forward_graphed(self, choice, x_routed, logits, gate, reads)
        shared_done = False
        if replayed is not None:
            y, zero_output, shared_done = replayed.y, replayed.zero_output, replayed.shared_added
        else:
            if gate is not None:
                logits = gate_logits(gate, x)
            if choice.experts_cls.routes_inside:
                y, zero_output = self._forward_monolithic(runner, x_routed, logits, input_ids)
            else:
                y, zero_output = self._forward_modular(choice, runner, x_routed, logits, input_ids)
        # Under EP without DP the output is a partial sum over ranks: what belongs to no expert
        # is added once, by rank 0.
        whole = not ep_partial(self.parallel_config) or self.parallel_config.ep_rank == 0
        if zero_output is not None and whole:
            y = y + zero_output
        if self.routed_output_transform is not None:
            y = self.routed_output_transform(y)
        if self.shared_experts is not None and whole and not shared_done:
            y = y + self._shared_output(x)
        return y.reshape(*lead, y.shape[-1])

    def _shared_output(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return shared

    def _forward_modular(self, choice, kernel, x_routed, logits, input_ids):
        """Route, then run the modular kernel: -> (y [T, H], zero experts' output or None)."""
        topk_weights, topk_ids = self.router.select_experts(x_routed, logits, input_ids)
        zero_output = None
        if self.zero_expert_num > 0:  # their slots emptied, their output computed here
            split = self._split_zero_experts(x_routed, topk_weights, topk_ids)
            topk_weights, topk_ids = split.topk_weights, split.topk_ids
            zero_output = split.zero_output
        if self.record_expert_load:
            record_expert_load(self.expert_load, topk_ids)
        if self.logical_to_physical is not None:  # EPLB: each slot picks one replica
            topk_ids = map_to_physical(topk_ids, self.logical_to_physical, self.replica_count)
        alignment = choice.experts_cls.hidden_size_alignment
        pad = -self.hidden_size % alignment
        x_in = nn.functional.pad(x_routed, (0, pad)) if pad else x_routed
        y = kernel.forward(
            x_in,
            expert_weights(self, alignment),
            topk_weights,
            topk_ids,
            activation=self.activation,
            global_num_experts=self.placement.num_physical,
            expert_map=self.expert_map,
            quant_config=call_quant_config(self),
        )
        if pad:
            y = y[:, : self.hidden_size]
        return y, zero_output

    def _forward_monolithic(self, experts: Experts, x_routed, logits, input_ids):
        """Hand the logits to a backend that routes inside: -> (y [T, H], zero output or None).

        Zero experts are routed with the rest; the backend skips their ids (>= E, never on a
        rank) and their output is computed here from the routing it returns.
        """
        result = experts.apply_monolithic(
            x_routed,
            logits,
            expert_weights(self, 1),
            routing=InsideRouting(self.router, self.gpt_oss_routing),
            activation=self.activation,
            expert_start=self.expert_start,
            dispatch=self._dispatch,
            input_ids=input_ids,
        )
        if self.record_expert_load:  # zero experts' ids (>= E) are not counted
            record_expert_load(self.expert_load, result.topk_ids)
        zero_output = None
        if self.zero_expert_num > 0:
            split = self._split_zero_experts(x_routed, result.topk_weights, result.topk_ids)
            zero_output = split.zero_output
        return result.output, zero_output

    def _split_zero_experts(self, x_routed, topk_weights, topk_ids) -> ZeroExpertSplit:
        zero_type = self.zero_expert_type
        return split_zero_experts(x_routed, topk_weights, topk_ids, self.num_experts, zero_type)

    def _check_routed_input(self, x_routed: torch.Tensor, x: torch.Tensor) -> None:
        where = "" if self.routed_input_transform is None else " (after routed_input_transform)"
        if x_routed.dim() != 2 or x_routed.shape != (x.shape[0], self.hidden_size):
            raise ValueError(
                f"hidden_states{where} must be [..., {self.hidden_size}], "
                f"got {tuple(x_routed.shape)}"
            )
        if x_routed.dtype != self.params_dtype:
            raise TypeError(
                f"hidden_states{where} has dtype {x_routed.dtype} but the layer computes in "
                f"{self.params_dtype}: cast the input or the layer (layer.to(dtype))"
            )
        if x_routed.device != self.w13_weight.device:
            raise ValueError(
                f"hidden_states is on {x_routed.device}, the layer on {self.w13_weight.device}"
            )

    def extra_repr(self) -> str:
        padded = self.padded_intermediate_size
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, activation={self.activation.kind.value}, "
            f"has_bias={self.has_bias}, backend={getattr(self.backend, 'name', self.backend)!r}, "
            f"router={self.router!r}"
            + ("" if padded == self.intermediate_size else f", padded_intermediate_size={padded}")
            + describe_placement(self.parallel_config, self.placement, self.expert_start)
        )
